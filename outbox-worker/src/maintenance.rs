//! The relay's background work beside the claim loops: saying it is alive (heartbeats),
//! reclaiming expired leases and the claims of relays that stopped beating (then waking the
//! claim loops), reading `outbox_stats()` into the backlog gauges, and asking the broker for
//! metadata so readiness knows whether it answers even when no event is sent. Transient database errors
//! are logged and retried at the next interval; a configuration error ends the task (and the
//! relay).

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio_postgres::error::SqlState;
use tokio_util::sync::CancellationToken;

use crate::breaker::Breaker;
use crate::claim::Relay;
use crate::defaults;
use crate::error::DbError;
use crate::metrics::Metrics;
use crate::sink::Sink;
use crate::Fatal;

pub async fn reclaim_loop(
    relay: Arc<Relay>,
    lease: Duration,
    every: Duration,
    cancel: CancellationToken,
) -> Result<(), DbError> {
    loop {
        let res = relay.store.reclaim(lease).await;
        relay.metrics.db_result(&res);
        match res {
            Ok(rows) if rows.is_empty() => {}
            Ok(rows) => {
                relay.metrics.reclaimed.inc_by(rows.len() as u64);
                tracing::info!(
                    reclaimed = rows.len(),
                    "reclaimed events whose lease ({}) expired or whose relay stopped beating",
                    humantime::format_duration(lease)
                );
                // A reclaim counts as a failed attempt: a poison event that kills its relay
                // every time ends here, and is as loud as one the relay nacked.
                for r in rows.iter().filter(|r| r.dead_letter) {
                    relay
                        .metrics
                        .dead_lettered
                        .with_label_values(&[&relay.metrics.topic_label(&r.topic)])
                        .inc();
                    tracing::error!(
                        outbox_id = r.id,
                        topic = %r.topic,
                        attempts = r.retry_count,
                        "dead letter: event {} for topic {} failed {} times: reclaimed from {} (lease expired or heartbeat ran out)",
                        r.id,
                        r.topic,
                        r.retry_count,
                        r.expired_owner.as_deref().unwrap_or("?")
                    );
                }
                relay.wake.notify_one();
            }
            Err(e) if !e.is_retriable() => return Err(e),
            Err(e) => tracing::warn!("reclaim failed: {e}"),
        }
        tokio::select! {
            _ = cancel.cancelled() => return Ok(()),
            _ = tokio::time::sleep(every) => {}
        }
    }
}

/// Beats every sixth of `timeout` until `cancel` (after the rounds settled), each naming the last
/// one's expiry; a failed beat costs duplicates, never an event. Ends with the last expiry, or,
/// when another process took the owner over, fires `stop` and ends with why.
pub async fn heartbeat_loop(
    relay: Arc<Relay>,
    timeout: Duration,
    mut last: Option<SystemTime>,
    cancel: CancellationToken,
    stop: CancellationToken,
) -> Result<Option<SystemTime>, Fatal> {
    let every = timeout / defaults::BEATS_PER_HEARTBEAT_TIMEOUT;
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return Ok(last),
            _ = tokio::time::sleep(every) => {}
        }
        let res = relay.store.heartbeat(&relay.owner, timeout, last).await;
        relay.metrics.db_result(&res);
        match res {
            Ok(expires_at) => last = Some(expires_at),
            Err(e) if owner_taken(&e) => {
                stop.cancel();
                return Err(taken_over(&relay.owner, &e));
            }
            Err(e) => {
                // The beat may have landed all the same: the next one cannot name its expiry.
                last = None;
                tracing::warn!(
                    "heartbeat failed: {e}; after {} without one, other relays reclaim this relay's claims",
                    humantime::format_duration(timeout)
                );
            }
        }
    }
}

/// Whether a beat failed because another process beats as the owner (outbox_heartbeat's 55006).
pub fn owner_taken(e: &DbError) -> bool {
    e.sqlstate() == Some(&SqlState::OBJECT_IN_USE)
}

/// Why a relay stops when another process took its owner over: the newest process keeps it.
pub fn taken_over(owner: &str, e: &DbError) -> Fatal {
    Fatal::usage(format!(
        "another relay took over --owner {owner} ({e}); this one stops and leaves it what the \
         owner holds: give each relay its own --owner, or leave it unset"
    ))
}

pub async fn stats_loop(
    relay: Arc<Relay>,
    every: Duration,
    cancel: CancellationToken,
) -> Result<(), DbError> {
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
                m.blocked_keys.set(stats.blocked_keys);
                m.oldest_blocked_age
                    .set(stats.oldest_blocked_age.unwrap_or(0.0));
            }
            Err(e) if !e.is_retriable() => return Err(e),
            Err(e) => tracing::warn!("reading outbox_stats() failed: {e}"),
        }
        tokio::select! {
            _ = cancel.cancelled() => return Ok(()),
            _ = tokio::time::sleep(every) => {}
        }
    }
}

/// Every `every`, one metadata request answered within `timeout` sets whether the broker is
/// reachable (the rounds' outcomes set it too, in between). While the breaker is closed a failed
/// one replaces the producer, so that an idle relay's producer that lost its brokers does not
/// keep it unready; while it is open, its prober does that.
pub async fn broker_watch(
    publisher: Arc<dyn Sink>,
    breaker: Arc<Breaker>,
    metrics: Arc<Metrics>,
    every: Duration,
    timeout: Duration,
    cancel: CancellationToken,
) -> Result<(), DbError> {
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return Ok(()),
            _ = tokio::time::sleep(every) => {}
        }
        // A frozen broker holds the request for `timeout`: not the stop.
        let request = async {
            if breaker.is_open() {
                publisher.health(timeout).await
            } else {
                crate::sink::health_or_reconnect(&*publisher, timeout, &metrics).await
            }
        };
        let ok = tokio::select! {
            _ = cancel.cancelled() => return Ok(()),
            r = request => r,
        };
        if let Err(e) = &ok {
            tracing::debug!("{} health request failed: {e}", publisher.name());
        }
        metrics.health.set_broker_reachable(ok.is_ok());
    }
}
