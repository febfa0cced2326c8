//! The claim loops: each round claims a batch, publishes it and settles every row (ack the
//! delivered, nack the events that failed by their own fault, release without counting an attempt
//! those the broker failed), then claims again at once after a round that claimed anything (after
//! `--claim-cooldown` unless it filled its batch), or waits for the poll interval or a wake-up. A
//! round that delivered nothing because the broker failed opens the circuit breaker
//! (`breaker.rs`): no claims until the broker answers again.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{watch, Notify, RwLock};
use tokio_util::sync::CancellationToken;

use crate::breaker::Breaker;
use crate::defaults;
use crate::error::{DbError, FailureClass};
use crate::metrics::Metrics;
use crate::sink::{Outcome, Sink};
use crate::store::{Event, Store};
use crate::unknown::UnknownErrors;

/// Everything the claim loops share.
pub struct Relay {
    pub store: Store,
    pub publisher: Arc<dyn Sink>,
    pub breaker: Arc<Breaker>,
    pub metrics: Arc<Metrics>,
    pub owner: String,
    pub batch_size: i32,
    pub poll_interval: Duration,
    /// Least time from a claim that did not fill its batch to the next claim (`--claim-cooldown`).
    pub claim_cooldown: Duration,
    /// A claim's lease: past it, another relay may have taken the rows back.
    pub lease: Duration,
    /// Events taken by the last finished round (the wake-up session waits for one).
    pub rounds: watch::Sender<usize>,
    /// Wakes one waiting claim loop (or the next one to wait): each wake-up is one loop's round.
    pub wake: Arc<Notify>,
    /// Failures with an unclassified code, per event: how long they are released, not counted.
    pub unknown: UnknownErrors,
    /// The tokens of the claims the rounds hold now.
    pub held: Mutex<BTreeSet<i64>>,
    /// Held (shared) by a claim until its token is in `held`, so that releasing orphans
    /// (exclusive) never takes a claim whose round is about to settle it.
    pub claiming: RwLock<()>,
}

/// A round's token in [`Relay::held`] until the round ends.
struct HeldToken<'a>(&'a Mutex<BTreeSet<i64>>, i64);

impl Drop for HeldToken<'_> {
    fn drop(&mut self) {
        self.0.lock().expect("held tokens").remove(&self.1);
    }
}

/// How a failed event is settled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Settle {
    /// `outbox_nack`: an attempt counted, a dead letter after `outbox.max_retry`.
    Nack,
    /// `outbox_release`: back to WAIT after `RELEASE_DELAY`, no attempt counted.
    Release,
}

/// Rounds until cancelled (the round in flight is finished first). Ends with the error when a
/// database call meets a configuration error, which no retry would fix.
pub async fn claim_loop(
    n: usize,
    relay: Arc<Relay>,
    cancel: CancellationToken,
) -> Result<(), DbError> {
    let mut failures: u32 = 0;
    let mut cooldown_until: Option<Instant> = None;
    loop {
        if cancel.is_cancelled() {
            break;
        }
        // While the broker is unreachable, claiming would only hold rows. Waiting on purpose is
        // being alive: /live must not get the relay restarted for a broker outage.
        while relay.breaker.is_open() && !cancel.is_cancelled() {
            relay.metrics.health.round_completed(n);
            tokio::select! {
                _ = relay.breaker.wait_closed(&cancel) => {}
                _ = tokio::time::sleep(relay.poll_interval.min(Duration::from_secs(5))) => {}
            }
        }
        if cancel.is_cancelled() {
            break;
        }
        if let Some(at) = cooldown_until.take() {
            tokio::select! {
                _ = cancel.cancelled() => break,
                _ = tokio::time::sleep_until(at.into()) => {}
            }
        }
        let claim_start = Instant::now();
        let result = relay.round().await;
        relay.metrics.health.round_completed(n);
        relay.rounds.send_replace(*result.as_ref().unwrap_or(&0));
        // A full batch says more is waiting: no cooldown after it.
        if !matches!(result, Ok(c) if c >= relay.batch_size as usize) {
            cooldown_until = Some(claim_start + relay.claim_cooldown);
        }
        let delay = match result {
            // A full batch, or events committed while the round ran: claim again at once (or
            // after the cooldown) rather than after the wake-up session's next look.
            Ok(claimed) if claimed > 0 => {
                failures = 0;
                continue;
            }
            Ok(_) => {
                failures = 0;
                relay.poll_interval
            }
            // Every retry would meet it again: the loop (and the relay) stops instead.
            Err(e) if !e.is_retriable() => return Err(e),
            Err(e) => {
                failures += 1;
                tracing::warn!(claim_loop = n, "claim failed: {e}; retrying");
                (Duration::from_millis(250) * 2u32.pow(failures.min(7))).min(relay.poll_interval)
            }
        };
        tokio::select! {
            _ = cancel.cancelled() => break,
            _ = tokio::time::sleep(delay) => {}
            // A wake-up given while the round ran (no loop waiting) ends this wait at once.
            _ = relay.wake.notified() => {}
        }
    }
    tracing::debug!(claim_loop = n, "claim loop stopped");
    Ok(())
}

impl Relay {
    /// One round: claim, publish, settle. Returns how many events were claimed. An error means
    /// the claim failed (nothing is held), or a settle call met a configuration error (its rows
    /// stay SENDING until reclaimed, as after any failed settle).
    async fn round(&self) -> Result<usize, DbError> {
        let round_start = Instant::now();
        let claiming = self.claiming.read().await;
        let events = self.store.claim(&self.owner, self.batch_size).await;
        self.metrics.db_result(&events);
        let token = events
            .as_ref()
            .ok()
            .and_then(|e| e.first())
            .map(|e| e.claim_token);
        let _held = token.map(|t| {
            self.held.lock().expect("held tokens").insert(t);
            HeldToken(&self.held, t)
        });
        drop(claiming);
        let events = match events {
            Ok(events) => events,
            Err(e) => {
                if e.may_have_committed() {
                    self.release_orphans().await;
                }
                return Err(e);
            }
        };
        let claimed_at = Instant::now();
        let lease_end = claimed_at + self.lease;
        let Some(token) = token else {
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

        let publishing_at = Instant::now();
        let (outcomes, replaced) = self.publisher.publish(&events).await;
        let producer_failures = outcomes
            .iter()
            .filter(|o| matches!(o, Outcome::Failed(e) if e.producer_unusable()))
            .count();
        self.metrics
            .producer_failures
            .inc_by(producer_failures as u64);
        for r in &replaced {
            self.metrics.client_replaced(self.publisher.name(), r);
        }
        let published_at = Instant::now();

        let mut permanent: Option<DbError> = None;
        // (index, handed to the broker's client, acknowledged by the broker)
        let mut delivered: Vec<(usize, Instant, Instant)> = Vec::new();
        let held = held_back(&events, &outcomes);
        // One settle call per settlement, class and distinct error text (the rows' last_error).
        let mut failed: BTreeMap<(Settle, FailureClass, String), Vec<usize>> = BTreeMap::new();
        for (i, o) in outcomes.iter().enumerate() {
            if held.contains(&i) {
                continue;
            }
            match o {
                Outcome::Delivered {
                    handed,
                    delivered: at,
                } => {
                    self.metrics
                        .publish_latency
                        .observe(at.saturating_sub(*handed).as_secs_f64());
                    delivered.push((i, publishing_at + *handed, publishing_at + *at));
                }
                Outcome::Failed(error) => {
                    let class = error.class();
                    self.metrics
                        .publish_errors
                        .with_label_values(&[&error.code_label(), class.label()])
                        .inc();
                    let settle = self.settlement(class, events[i].id);
                    failed
                        .entry((settle, class, error.to_string()))
                        .or_default()
                        .push(i);
                }
                // Always after a failure of its key, so among the held-back events above.
                Outcome::NotSent => {}
            }
        }
        if !delivered.is_empty() {
            let claim = (round_start, claimed_at);
            if let Err(e) = self.ack(&events, &delivered, token, claim).await {
                keep_permanent(&mut permanent, e);
            }
        }
        if !held.is_empty() {
            let ids: Vec<i64> = held.iter().map(|&i| events[i].id).collect();
            tracing::info!(
                count = ids.len(),
                first_id = ids[0],
                "events held back behind an earlier event of their key that failed: released, to be published after it"
            );
            if let Err(e) = self
                .settle("release held-back", ids.len(), lease_end, || {
                    self.store
                        .release(&self.owner, token, &ids, Duration::ZERO, HELD_BACK)
                })
                .await
            {
                keep_permanent(&mut permanent, e);
            }
        }
        let delivered_any = outcomes
            .iter()
            .any(|o| matches!(o, Outcome::Delivered { .. }));
        let broker_down = !delivered_any
            && failed
                .keys()
                .any(|(_, class, _)| *class == FailureClass::Transient);
        for ((settle, class, error), idx) in failed {
            for &i in &idx {
                self.metrics
                    .failed
                    .with_label_values(&[
                        &self.metrics.topic_label(&events[i].topic),
                        class.label(),
                    ])
                    .inc();
            }
            if let Err(e) = self
                .settle_failed(&events, &idx, (token, lease_end), (settle, class), &error)
                .await
            {
                keep_permanent(&mut permanent, e);
            }
        }
        // Readiness follows the same verdict as the breaker (which marks the broker unreachable
        // when it opens), not a second classification of the errors.
        if delivered_any {
            self.metrics.health.set_broker_reachable(true);
        }
        if broker_down && self.breaker.trip() {
            tracing::debug!("no delivery and broker-wide failures: circuit breaker opened");
        }
        tracing::debug!(
            events = events.len(),
            claim_ms = claimed_at.duration_since(round_start).as_millis() as u64,
            publish_ms = published_at.duration_since(claimed_at).as_millis() as u64,
            settle_ms = published_at.elapsed().as_millis() as u64,
            "round done"
        );
        match permanent {
            Some(e) => Err(e),
            None => Ok(events.len()),
        }
    }

    /// After a claim whose reply may have been lost: what this relay holds under a token no round
    /// knows goes back without an attempt counted (it was never published).
    async fn release_orphans(&self) {
        let _alone = self.claiming.write().await;
        let keep: Vec<i64> = self
            .held
            .lock()
            .expect("held tokens")
            .iter()
            .copied()
            .collect();
        let released = self
            .settle("release orphaned", 0, Instant::now() + self.lease, || {
                self.store.release_orphans(&self.owner, &keep)
            })
            .await;
        if let Some(n) = released.ok().filter(|n| *n > 0) {
            tracing::warn!(
                released = n,
                "the reply to a claim was lost after it committed: its events were released"
            );
        }
    }

    /// How a failure of event `id` is settled: by its class; an unknown code is released while
    /// the event is within its grace, and counted as an attempt after that.
    fn settlement(&self, class: FailureClass, id: i64) -> Settle {
        match class {
            FailureClass::Permanent => Settle::Nack,
            FailureClass::Transient => Settle::Release,
            FailureClass::Unknown => match self.unknown.within_grace(id) {
                Some(_) => Settle::Release,
                None => Settle::Nack,
            },
        }
    }

    /// Acks the delivered events (index, handed over, acknowledged) of the claim that ran from
    /// `claim.0` to `claim.1` and records each one's stages. Only the events the ack settled count
    /// as published: one no longer held (reclaimed) is counted by whoever settles it.
    async fn ack(
        &self,
        events: &[Event],
        delivered: &[(usize, Instant, Instant)],
        token: i64,
        (claim_start, claimed_at): (Instant, Instant),
    ) -> Result<(), DbError> {
        let ids: Vec<i64> = delivered.iter().map(|d| events[d.0].id).collect();
        self.unknown.forget(ids.iter().copied());
        let settled: BTreeSet<i64> = self
            .settle("ack delivered", ids.len(), claimed_at + self.lease, || {
                self.store.ack(&self.owner, token, &ids)
            })
            .await?
            .into_iter()
            .collect();
        let acked_at = Instant::now();
        let now = claimed_at.elapsed().as_secs_f64();
        let stage = |name: &str, from: Instant, to: Instant| {
            self.metrics
                .stage
                .with_label_values(&[name])
                .observe(to.saturating_duration_since(from).as_secs_f64())
        };
        for &(i, handed, broker_ack) in delivered {
            let ev = &events[i];
            if !settled.contains(&ev.id) {
                continue;
            }
            self.metrics
                .published
                .with_label_values(&[&self.metrics.topic_label(&ev.topic)])
                .inc();
            self.metrics
                .commit_to_ack_lag
                .observe(ev.age_at_claim + now);
            stage("claim", claim_start, claimed_at);
            stage("handoff", claimed_at, handed);
            stage("delivery", handed, broker_ack);
            stage("ack", broker_ack, acked_at);
        }
        let stale = ids.len() - settled.len();
        if stale > 0 {
            self.metrics.stale_acks.inc_by(stale as u64);
            tracing::warn!(
                acked = settled.len(),
                delivered = ids.len(),
                "some delivered events were no longer held when the ack landed: reclaimed (to be published again), or acked by a try whose reply was lost"
            );
        }
        Ok(())
    }

    /// Settles failed events. Nack (the event's fault, or an unknown code past its grace): an
    /// attempt, a dead letter after `outbox.max_retry`. Release (the broker's or the network's
    /// fault, or an unknown code within its grace): back to WAIT soon, no attempt counted.
    async fn settle_failed(
        &self,
        events: &[Event],
        idx: &[usize],
        (token, lease_end): (i64, Instant),
        (settle, class): (Settle, FailureClass),
        error: &str,
    ) -> Result<(), DbError> {
        let ids: Vec<i64> = idx.iter().map(|&i| events[i].id).collect();
        let (count, first_id) = (ids.len(), ids[0]);
        let grace = self.unknown.grace();
        let nacked = match settle {
            Settle::Release => {
                if class == FailureClass::Unknown {
                    tracing::warn!(
                        count,
                        first_id,
                        "publish failed with an error code the relay does not classify, released without counting an attempt (the first {grace} times per event, then counted): {error}"
                    );
                } else {
                    tracing::warn!(
                        count,
                        first_id,
                        "publish failed, released without counting an attempt: {error}"
                    );
                }
                self.settle("release failed", count, lease_end, || {
                    self.store
                        .release(&self.owner, token, &ids, defaults::RELEASE_DELAY, error)
                })
                .await?;
                return Ok(());
            }
            Settle::Nack => {
                if class == FailureClass::Unknown {
                    tracing::warn!(
                        count,
                        first_id,
                        "publish failed with an error code the relay does not classify, more than {grace} times: counted as an attempt: {error}"
                    );
                } else {
                    tracing::warn!(count, first_id, "publish failed: {error}");
                }
                self.settle("nack failed", count, lease_end, || {
                    self.store.nack(&self.owner, token, &ids, error)
                })
                .await?
            }
        };
        let by_id: BTreeMap<i64, &Event> =
            idx.iter().map(|&i| (events[i].id, &events[i])).collect();
        let dead = nacked.iter().filter(|r| r.dead_letter);
        self.unknown.forget(dead.clone().map(|r| r.id));
        for row in dead {
            let Some(ev) = by_id.get(&row.id) else {
                continue;
            };
            self.metrics
                .dead_lettered
                .with_label_values(&[&self.metrics.topic_label(&ev.topic)])
                .inc();
            tracing::error!(
                outbox_id = ev.id,
                event_id = %ev.event_id,
                topic = %ev.topic,
                attempts = row.retry_count,
                "dead letter: event {} for topic {} failed {} times: {error}",
                ev.id,
                ev.topic,
                row.retry_count
            );
        }
        Ok(())
    }

    /// One ack, nack or release, retried on transient errors (it is idempotent) with backoff from
    /// 200 ms to 5 s until it lands or the claim's lease ends (past it the rows may be another
    /// relay's). A final failure is logged; `what` ("ack delivered") names the call.
    async fn settle<T, F, Fut>(
        &self,
        what: &str,
        count: usize,
        lease_end: Instant,
        call: F,
    ) -> Result<T, DbError>
    where
        F: Fn() -> Fut,
        Fut: Future<Output = Result<T, DbError>>,
    {
        let mut backoff = Duration::from_millis(200);
        loop {
            let res = call().await;
            self.metrics.db_result(&res);
            match res {
                Err(e) if e.is_retriable() && Instant::now() + backoff < lease_end => {
                    tracing::warn!(
                        count,
                        "could not {what} events ({e}): retrying in {backoff:?}"
                    );
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(SETTLE_BACKOFF_MAX);
                }
                Err(e) => {
                    tracing::error!(
                        count,
                        "could not {what} events ({e}): they stay SENDING until reclaimed (then published again)"
                    );
                    return Err(e);
                }
                ok => return ok,
            }
        }
    }
}

/// The longest wait between two tries of a settle call.
const SETTLE_BACKOFF_MAX: Duration = Duration::from_secs(5);

/// The last_error of events released because an earlier event of their key failed.
const HELD_BACK: &str = "held back: an earlier event of its key failed in the same batch";

/// Per-key order within a batch (in id order): the indexes of ordered events after a failed event
/// of their key, sent or not. They must not be acked before it: back to WAIT, no attempt counted
/// (consumers drop an extra copy by `event_id`).
fn held_back(events: &[Event], outcomes: &[Outcome]) -> BTreeSet<usize> {
    let mut failed_keys: BTreeSet<(&str, &str)> = BTreeSet::new();
    let mut held = BTreeSet::new();
    for (i, (ev, outcome)) in events.iter().zip(outcomes).enumerate() {
        let (true, Some(key)) = (ev.ordered, ev.key.as_deref()) else {
            continue;
        };
        if failed_keys.contains(&(ev.topic.as_str(), key)) {
            held.insert(i);
        } else if matches!(outcome, Outcome::Failed(_)) {
            failed_keys.insert((ev.topic.as_str(), key));
        }
    }
    held
}

/// Remembers the first error of a round that no retry fixes.
fn keep_permanent(slot: &mut Option<DbError>, e: DbError) {
    if slot.is_none() && !e.is_retriable() {
        *slot = Some(e);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::PublishError;
    use rdkafka::error::{KafkaError, RDKafkaErrorCode};

    fn ev(id: i64, key: Option<&str>, ordered: bool) -> Event {
        crate::sink::tests::ev(id, "orders", key, ordered)
    }

    fn ok() -> Outcome {
        Outcome::Delivered {
            handed: Duration::ZERO,
            delivered: Duration::ZERO,
        }
    }

    fn failed() -> Outcome {
        Outcome::Failed(PublishError {
            topic: "orders".into(),
            source: KafkaError::MessageProduction(RDKafkaErrorCode::MessageSizeTooLarge).into(),
        })
    }

    #[test]
    fn events_after_a_failure_of_their_ordered_key_are_held_back() {
        let events = [
            ev(1, Some("A"), true),
            ev(2, Some("B"), true),
            ev(3, Some("A"), true),  // failed
            ev(4, Some("A"), true),  // delivered, but after 3: held back
            ev(5, Some("B"), true),  // B never failed: acked
            ev(6, None, false),      // no key: never held back
            ev(7, Some("C"), false), // unordered topic: failures do not hold it back
            ev(8, Some("C"), false),
            ev(9, Some("A"), true), // failed too, but after 3: held back, not nacked
            ev(10, Some("A"), true), // not even sent
        ];
        let outcomes = [
            ok(),
            ok(),
            failed(),
            ok(),
            ok(),
            ok(),
            failed(),
            ok(),
            failed(),
            Outcome::NotSent,
        ];
        let held: Vec<usize> = held_back(&events, &outcomes).into_iter().collect();
        assert_eq!(held, vec![3, 8, 9]);
    }
}
