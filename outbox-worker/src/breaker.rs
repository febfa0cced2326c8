//! The circuit breaker in front of the broker. After a round in which nothing was delivered and
//! the broker or the network was to blame (timeouts, transport errors), the claim loops stop
//! claiming: claiming during an outage only holds rows, costs rounds of send timeouts and, before
//! this breaker, burned every event's retries. One prober then asks the broker for its metadata,
//! with a backoff that doubles (with jitter) up to a ceiling, and closes the breaker as soon as
//! the broker answers. Kafka Connect blocks the same way rather than dropping records.

use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::defaults;
use crate::metrics::Metrics;
use crate::sink::Sink;

/// Open (claims stopped) or closed, shared by the claim loops and the prober.
pub struct Breaker {
    open: watch::Sender<bool>,
}

impl Default for Breaker {
    fn default() -> Self {
        Breaker::new()
    }
}

impl Breaker {
    pub fn new() -> Breaker {
        Breaker {
            open: watch::Sender::new(false),
        }
    }

    pub fn is_open(&self) -> bool {
        *self.open.borrow()
    }

    /// Stops the claims until the prober reaches the broker. Returns true when this call opened it.
    pub fn trip(&self) -> bool {
        self.open
            .send_if_modified(|open| !std::mem::replace(open, true))
    }

    fn close(&self) {
        self.open.send_replace(false);
    }

    /// Returns at once when closed, else when the breaker closes or `cancel` fires.
    pub async fn wait_closed(&self, cancel: &CancellationToken) {
        let mut rx = self.open.subscribe();
        tokio::select! {
            _ = cancel.cancelled() => {}
            _ = rx.wait_for(|open| !*open) => {}
        }
    }
}

/// The prober: while the breaker is open, probes the broker with a metadata request after a
/// backoff of `BREAKER_BACKOFF_MIN` doubling to `BREAKER_BACKOFF_MAX` (±20 % jitter, so relays
/// that tripped together do not probe together), and closes the breaker when one succeeds.
pub async fn probe_loop(
    breaker: Arc<Breaker>,
    publisher: Arc<dyn Sink>,
    probe_timeout: Duration,
    metrics: Arc<Metrics>,
    cancel: CancellationToken,
) -> Result<(), crate::error::DbError> {
    let mut rx = breaker.open.subscribe();
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return Ok(()),
            r = rx.wait_for(|open| *open) => if r.is_err() { return Ok(()) },
        }
        metrics.health.set_breaker_open(true);
        metrics.broker_circuit_open.set(1);
        metrics.health.set_broker_reachable(false);
        let opened = Instant::now();
        let mut backoff = defaults::BREAKER_BACKOFF_MIN;
        let mut probes = 0u32;
        tracing::warn!(
            "broker unreachable: claims stopped (events stay WAIT, no attempt counted); probing every {} to {}",
            humantime::format_duration(defaults::BREAKER_BACKOFF_MIN),
            humantime::format_duration(defaults::BREAKER_BACKOFF_MAX)
        );
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return Ok(()),
                _ = tokio::time::sleep(jittered(backoff)) => {}
            }
            probes += 1;
            match crate::sink::health_or_reconnect(&*publisher, probe_timeout, &metrics).await {
                Ok(answer) => {
                    tracing::info!(
                        answer,
                        probes,
                        down_for = %humantime::format_duration(round_secs(opened.elapsed())),
                        "broker reachable again: claiming resumed"
                    );
                    break;
                }
                Err(why) => {
                    tracing::debug!(probes, "broker probe failed: {why}");
                    backoff = (backoff * 2).min(defaults::BREAKER_BACKOFF_MAX);
                }
            }
        }
        metrics.broker_circuit_open.set(0);
        metrics.health.set_breaker_open(false);
        metrics.health.set_broker_reachable(true);
        breaker.close();
    }
}

fn round_secs(d: Duration) -> Duration {
    Duration::from_secs(d.as_secs())
}

/// `d` ± 20 %.
fn jittered(d: Duration) -> Duration {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    h.write_u128(now.map(|d| d.as_nanos()).unwrap_or(0));
    let unit = (h.finish() % 10_000) as f64 / 10_000.0; // [0, 1)
    d.mul_f64(0.8 + 0.4 * unit)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jitter_stays_within_a_fifth_and_varies() {
        let d = Duration::from_secs(10);
        let samples: Vec<Duration> = (0..50).map(|_| jittered(d)).collect();
        assert!(samples
            .iter()
            .all(|s| *s >= d.mul_f64(0.8) && *s < d.mul_f64(1.2)));
        assert!(samples.iter().any(|s| *s != samples[0]), "no jitter");
    }

    #[tokio::test]
    async fn trip_opens_once_and_wait_closed_returns_after_close() {
        let b = Arc::new(Breaker::new());
        assert!(!b.is_open());
        assert!(b.trip());
        assert!(!b.trip(), "already open");
        let waiter = {
            let b = b.clone();
            tokio::spawn(async move { b.wait_closed(&CancellationToken::new()).await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiter.is_finished(), "returned while open");
        b.close();
        tokio::time::timeout(Duration::from_secs(1), waiter)
            .await
            .expect("returned after close")
            .expect("task");
    }
}
