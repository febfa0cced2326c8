//! `outbox-worker run`: claim loops, the reclaimer, the stats poller, and shutdown.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::cli::RunArgs;
use crate::db;
use crate::error::DbError;
use crate::metrics::{self, Metrics};
use crate::publisher::{Outcome, Publisher};
use crate::store::{Settings, Store};
use crate::{shutdown, wakeup, Fatal};

/// Everything the claim loops share.
pub struct Relay {
    store: Store,
    publisher: Arc<Publisher>,
    metrics: Arc<Metrics>,
    owner: String,
    batch_size: i32,
    poll_interval: Duration,
    /// `outbox.max_retry` as this relay's sessions see it (refreshed by the stats poller).
    max_retry: AtomicI32,
}

/// hostname-pid-random
pub fn default_owner() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname NUL-terminates on success.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    let host = if rc == 0 {
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        String::from_utf8_lossy(&buf[..end]).into_owned()
    } else {
        "unknown".to_string()
    };
    let host: String = host.chars().filter(|c| !c.is_control()).take(150).collect();
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    format!("{host}-{}-{:08x}", std::process::id(), h.finish() as u32)
}

pub async fn run(args: RunArgs) -> Result<(), Fatal> {
    args.validate()?;
    // Signals from here on stop the relay cleanly (exit 0), even during start-up.
    let metrics = Metrics::new();
    let cancel = CancellationToken::new();
    shutdown::spawn_signal_handler(cancel.clone(), metrics.clone());
    let props = args.producer_properties()?;
    let (pg_cfg, desc) = db::config(&args.db)?;
    // One connection per claim loop, one for the reclaimer, one for the stats poller.
    let store = Store::open(pg_cfg.clone(), desc.clone(), args.concurrency + 2).await?;
    // Retried: a connection terminated right at start-up (failover, pg_terminate_backend) is
    // no reason to exit.
    let mut attempt = 0;
    let Settings {
        max_retry,
        max_claim,
    } = loop {
        attempt += 1;
        match store.settings().await {
            Ok(v) => break v,
            Err(e) => {
                let message = match &e {
                    DbError::Connect(c) => {
                        format!("cannot connect to the database ({}): {c}", store.desc())
                    }
                    _ => format!(
                        "cannot call {}() ({}): {e}",
                        store.func("stats"),
                        store.desc()
                    ),
                };
                if attempt >= 3 {
                    return Err(Fatal::runtime(message));
                }
                tracing::warn!("{message}; retrying");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    };
    if let Some(max_claim) = max_claim {
        if args.batch_size > max_claim {
            return Err(Fatal::usage(format!(
                "--batch-size {} is above the database's outbox.max_claim ({max_claim})",
                args.batch_size
            )));
        }
    }

    // Created after the database checks: librdkafka starts connecting at once.
    let publisher = Publisher::new(&args.kafka.brokers, args.send_timeout, &props)?;

    let server_cancel = CancellationToken::new();
    let server = match args.metrics_addr {
        Some(addr) => Some(metrics::serve(addr, metrics.clone(), server_cancel.clone()).await?),
        None => None,
    };

    let owner = args.owner.clone().unwrap_or_else(default_owner);
    tracing::info!(
        owner = %owner,
        database = %desc,
        brokers = %args.kafka.brokers,
        batch_size = args.batch_size,
        concurrency = args.concurrency,
        poll_interval = %humantime::format_duration(args.poll_interval),
        lease = %humantime::format_duration(args.lease),
        send_timeout = %humantime::format_duration(args.send_timeout),
        max_retry,
        "relay started"
    );

    let publisher = Arc::new(publisher);
    tokio::spawn(publisher.clone().probe());
    let relay = Arc::new(Relay {
        store,
        publisher,
        metrics: metrics.clone(),
        owner,
        batch_size: args.batch_size,
        poll_interval: args.poll_interval,
        max_retry: AtomicI32::new(max_retry),
    });

    let (wake_tx, wake_rx) = watch::channel(0u64);
    let listener = tokio::spawn(wakeup::listen(pg_cfg, wake_tx.clone(), cancel.clone()));
    let reclaimer = tokio::spawn(reclaim_loop(
        relay.clone(),
        args.lease,
        args.reclaim_interval,
        wake_tx.clone(),
        cancel.clone(),
    ));
    let stats = tokio::spawn(stats_loop(
        relay.clone(),
        args.stats_interval,
        cancel.clone(),
    ));
    let loops: Vec<_> = (0..args.concurrency)
        .map(|n| {
            tokio::spawn(claim_loop(
                n,
                relay.clone(),
                wake_rx.clone(),
                cancel.clone(),
            ))
        })
        .collect();

    for l in loops {
        let _ = l.await;
    }
    cancel.cancel();
    let _ = listener.await;
    let _ = reclaimer.await;
    let _ = stats.await;
    relay.publisher.flush();
    server_cancel.cancel();
    if let Some(s) = server {
        let _ = s.await;
    }
    tracing::info!("relay stopped: in-flight events settled");
    Ok(())
}

async fn claim_loop(
    n: usize,
    relay: Arc<Relay>,
    mut wake: watch::Receiver<u64>,
    cancel: CancellationToken,
) {
    let mut failures: u32 = 0;
    loop {
        if cancel.is_cancelled() {
            break;
        }
        // Notifications from now on end the wait after this round.
        wake.borrow_and_update();
        let result = relay.round().await;
        let delay = match result {
            Ok(claimed) if claimed as i32 >= relay.batch_size => {
                failures = 0;
                continue;
            }
            Ok(_) => {
                failures = 0;
                relay.poll_interval
            }
            Err(e) => {
                failures += 1;
                tracing::warn!(claim_loop = n, "claim failed: {e}; retrying");
                (Duration::from_millis(250) * 2u32.pow(failures.min(7))).min(relay.poll_interval)
            }
        };
        tokio::select! {
            _ = cancel.cancelled() => break,
            _ = tokio::time::sleep(delay) => {}
            r = wake.changed() => if r.is_err() { tokio::time::sleep(delay).await },
        }
    }
    tracing::debug!(claim_loop = n, "claim loop stopped");
}

impl Relay {
    /// One round: claim, publish, settle. Returns how many events were claimed; an error means
    /// the claim itself failed (nothing is held).
    async fn round(&self) -> Result<usize, DbError> {
        let round_start = Instant::now();
        let events = self.store.claim(&self.owner, self.batch_size).await;
        self.metrics.db_result(&events);
        let events = events?;
        let claimed_at = Instant::now();
        let Some(token) = events.first().map(|e| e.claim_token) else {
            tracing::debug!("claim returned no due events");
            return Ok(0);
        };
        if events.len() < self.batch_size as usize {
            tracing::debug!(
                claimed = events.len(),
                "partial batch (nothing else due, or taken by another relay)"
            );
        }
        self.metrics.claim_batch_size.observe(events.len() as f64);

        let (outcomes, replaced) = self.publisher.publish(&events).await;
        if let Some(reason) = replaced {
            self.metrics.producer_restarts.inc();
            tracing::warn!(
                "the Kafka producer became unusable ({reason}): replaced by a new producer; this round's failed events are retried"
            );
        }
        let published_at = Instant::now();

        let mut delivered = Vec::new();
        // One nack per distinct error text (it becomes the rows' last_error).
        let mut failed: BTreeMap<String, Vec<usize>> = BTreeMap::new();
        for (i, o) in outcomes.iter().enumerate() {
            match o {
                Outcome::Delivered { latency } => {
                    self.metrics.publish_latency.observe(latency.as_secs_f64());
                    delivered.push(i);
                }
                Outcome::Failed(error) => failed.entry(error.to_string()).or_default().push(i),
            }
        }
        if !delivered.is_empty() {
            let ids: Vec<i64> = delivered.iter().map(|&i| events[i].id).collect();
            match self
                .settle(|| self.store.ack(&self.owner, token, &ids))
                .await
            {
                Ok(n) => {
                    self.metrics.published.inc_by(ids.len() as u64);
                    let now = claimed_at.elapsed().as_secs_f64();
                    for &i in &delivered {
                        self.metrics
                            .commit_to_ack_lag
                            .observe(events[i].age_at_claim + now);
                    }
                    if n < ids.len() as u64 {
                        tracing::warn!(
                            acked = n,
                            delivered = ids.len(),
                            "some delivered events were no longer held by this relay (lease expired and reclaimed): they will be published again"
                        );
                    }
                }
                Err(e) => tracing::error!(
                    count = ids.len(),
                    "could not ack delivered events ({e}): they stay SENDING until reclaimed after the lease, then are published again"
                ),
            }
        }
        let max_retry = self.max_retry.load(Ordering::Relaxed);
        for (error, idx) in failed {
            let ids: Vec<i64> = idx.iter().map(|&i| events[i].id).collect();
            self.metrics.failed.inc_by(ids.len() as u64);
            tracing::warn!(
                count = ids.len(),
                first_id = ids[0],
                "publish failed: {error}"
            );
            match self
                .settle(|| self.store.nack(&self.owner, token, &ids, &error))
                .await
            {
                Ok(_) => {
                    for &i in &idx {
                        let ev = &events[i];
                        if ev.retry_count + 1 > max_retry {
                            self.metrics.dead_lettered.inc();
                            tracing::error!(
                                outbox_id = ev.id,
                                event_id = %ev.event_id,
                                topic = %ev.topic,
                                attempts = ev.retry_count + 1,
                                "dead letter: event {} for topic {} failed {} times: {error}",
                                ev.id,
                                ev.topic,
                                ev.retry_count + 1
                            );
                        }
                    }
                }
                Err(e) => tracing::error!(
                    count = ids.len(),
                    "could not nack failed events ({e}): they stay SENDING until reclaimed after the lease"
                ),
            }
        }
        tracing::debug!(
            events = events.len(),
            claim_ms = claimed_at.duration_since(round_start).as_millis() as u64,
            publish_ms = published_at.duration_since(claimed_at).as_millis() as u64,
            settle_ms = published_at.elapsed().as_millis() as u64,
            "round done"
        );
        Ok(events.len())
    }

    /// One `outbox_ack` / `outbox_nack` call, retried a few times on database errors (it is
    /// idempotent: rows no longer held are not counted).
    async fn settle<F, Fut>(&self, call: F) -> Result<u64, DbError>
    where
        F: Fn() -> Fut,
        Fut: Future<Output = Result<u64, DbError>>,
    {
        let mut attempt = 0u32;
        loop {
            let res = call().await;
            self.metrics.db_result(&res);
            match res {
                Err(_) if attempt < 3 => {
                    attempt += 1;
                    tokio::time::sleep(Duration::from_millis(200) * attempt).await;
                }
                other => return other,
            }
        }
    }
}

async fn reclaim_loop(
    relay: Arc<Relay>,
    lease: Duration,
    every: Duration,
    wake: watch::Sender<u64>,
    cancel: CancellationToken,
) {
    loop {
        let res = relay.store.reclaim(lease).await;
        relay.metrics.db_result(&res);
        match res {
            Ok(n) => {
                if n > 0 {
                    relay.metrics.reclaimed.inc_by(n);
                    tracing::info!(
                        reclaimed = n,
                        "reclaimed events whose lease ({}) expired",
                        humantime::format_duration(lease)
                    );
                    wake.send_modify(|g| *g = g.wrapping_add(1));
                }
            }
            Err(e) => tracing::warn!("reclaim failed: {e}"),
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
    }
}

async fn stats_loop(relay: Arc<Relay>, every: Duration, cancel: CancellationToken) {
    loop {
        let res = relay.store.stats().await;
        relay.metrics.db_result(&res);
        match res {
            Ok(stats) => {
                let m = &relay.metrics;
                m.backlog.set(stats.due_wait);
                m.delayed.set(stats.delayed_wait);
                m.sending.set(stats.sending);
                m.dead_letters.set(stats.failed);
                m.oldest_due_age.set(stats.oldest_due_age.unwrap_or(0.0));
                m.oldest_lease_age
                    .set(stats.oldest_lease_age.unwrap_or(0.0));
                if let Some(r) = stats.max_retry {
                    relay.max_retry.store(r, Ordering::Relaxed);
                }
            }
            Err(e) => tracing::warn!("reading outbox_stats() failed: {e}"),
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_owner_is_host_pid_random() {
        let o = default_owner();
        assert!(o.contains(&format!("-{}-", std::process::id())), "{o}");
        assert!(o.len() <= 200 && !o.chars().any(char::is_control));
        assert_ne!(o, default_owner());
    }
}
