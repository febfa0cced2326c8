//! What the claim loops need of a broker: publish a round of events with one outcome per event,
//! answer a health request, flush on the way out. Kafka (`publisher.rs`) is the default sink,
//! NATS JetStream (`nats.rs`) and Apache RocketMQ (`rocketmq.rs`) the others; the claim loop,
//! breaker, settling and metrics only see this interface.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future::join_all;

use crate::error::{FailureClass, PublishError};
use crate::metrics::Metrics;
use crate::store::Event;

/// The sink's contract, which every implementation keeps:
/// - `publish` returns the outcome of `events[i]` at index `i`, within about the send timeout;
/// - per ordered key, a later event never reaches the broker once an earlier event of that key
///   in the same round has failed or may still fail: it is `NotSent` (or failed) instead;
/// - `Delivered` only once the broker has stored the event (acked by all its replicas).
#[async_trait::async_trait]
pub trait Sink: Send + Sync {
    /// The broker's name in log lines ("Kafka", "NATS").
    fn name(&self) -> &'static str;

    /// Publishes a round: the events come sorted by id (commit order per key).
    /// Also returns each client the round found unusable and replaced.
    async fn publish(&self, events: &[Event]) -> (Vec<Outcome>, Vec<Replaced>);

    /// One request to the broker answered within `timeout`: what it said, or why not.
    async fn health(&self, timeout: Duration) -> Result<String, String>;

    /// Waits (at most the send timeout) for whatever is still on its way to the broker.
    async fn flush(&self);

    /// Called after a failed health request: replaces a client that may not find the broker
    /// again by itself, and says why for each. Clients that reconnect on their own keep theirs.
    async fn reconnect(&self) -> Vec<Replaced> {
        Vec::new()
    }
}

/// One event's outcome in a round.
#[derive(Debug, Clone)]
pub enum Outcome {
    /// Stored by the broker. Both durations count from the start of `publish`.
    Delivered {
        /// Until the event was handed to the broker's client.
        handed: Duration,
        /// Until the broker acknowledged it.
        delivered: Duration,
    },
    /// Failed: its class (`PublishError::class`) says whose fault it was.
    Failed(PublishError),
    /// Not handed to the broker: an earlier event of its ordered key failed in this round.
    NotSent,
}

/// Why a sink's client was replaced: the `reason` label of `outbox_producer_replaced_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplaceReason {
    /// A delivery report said the broker rejects the producer's id, epoch or sequence
    /// (ProducerFenced, InvalidProducerEpoch, OutOfOrderSequenceNumber, UnknownProducerId, ...).
    Fenced,
    /// The client raised a fatal error: it refuses every later message.
    Fatal,
    /// Several rounds in a row that delivered nothing and only timed out.
    Timeouts,
    /// A health request failed: the breaker's probe or the periodic one (`Sink::reconnect`).
    Unreachable,
}

impl ReplaceReason {
    pub const ALL: [ReplaceReason; 4] = [
        ReplaceReason::Fenced,
        ReplaceReason::Fatal,
        ReplaceReason::Timeouts,
        ReplaceReason::Unreachable,
    ];

    pub fn label(self) -> &'static str {
        match self {
            ReplaceReason::Fenced => "fenced",
            ReplaceReason::Fatal => "fatal",
            ReplaceReason::Timeouts => "timeouts",
            ReplaceReason::Unreachable => "unreachable",
        }
    }
}

/// A client this round found unusable and replaced: why, and the client's words for it.
#[derive(Debug, Clone)]
pub struct Replaced {
    pub reason: ReplaceReason,
    pub detail: String,
}

/// One health request; when it fails, the sink's client is replaced if the sink asks for it
/// (`Sink::reconnect`), counted and logged, so that the next request starts afresh.
pub async fn health_or_reconnect(
    sink: &dyn Sink,
    timeout: Duration,
    metrics: &Metrics,
) -> Result<String, String> {
    let answer = sink.health(timeout).await;
    if answer.is_err() {
        for r in sink.reconnect().await {
            metrics.client_replaced(sink.name(), &r);
        }
    }
    answer
}

/// Asks the broker once at start-up (logged), so the first round does not pay for the connection
/// and an unreachable broker shows in the log. Returns whether the broker answered.
pub async fn probe(sink: Arc<dyn Sink>) -> bool {
    let name = sink.name();
    match sink.health(Duration::from_secs(10)).await {
        Ok(what) => {
            tracing::info!("connected to {name}: {what}");
            true
        }
        Err(e) => {
            tracing::warn!("{name} not reachable yet ({e}); events are retried until it is");
            false
        }
    }
}

/// What went wrong with one publish of a sink that reports per message (NATS, RocketMQ); decides
/// how the event is settled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    /// No ack within the send timeout (broker down, slow, or unreachable).
    TimedOut,
    /// The connection broke before the ack came.
    Disconnected,
    /// Nothing on the broker takes the event: no stream captures its subject, no such topic.
    NotFound,
    /// Larger than the broker or the stream or topic accepts.
    TooLarge,
    /// The event cannot be a message of this broker: its key or a header is not allowed.
    Invalid,
    /// The broker refused it for a reason none of the kinds above names.
    Rejected,
}

impl FailureKind {
    /// The `code` label of the failure metrics.
    pub fn label(self) -> &'static str {
        match self {
            FailureKind::TimedOut => "TimedOut",
            FailureKind::Disconnected => "Disconnected",
            FailureKind::NotFound => "NotFound",
            FailureKind::TooLarge => "TooLarge",
            FailureKind::Invalid => "Invalid",
            FailureKind::Rejected => "Rejected",
        }
    }
}

/// A failed publish of a sink that reports per message: its kind and the client's words.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct BrokerError {
    pub kind: FailureKind,
    pub message: String,
}

impl BrokerError {
    pub fn new(kind: FailureKind, message: impl Into<String>) -> BrokerError {
        BrokerError {
            kind,
            message: message.into(),
        }
    }

    /// The event's own fault (nothing takes it, too large, invalid) is permanent; the broker's or
    /// the network's is transient; a refusal not named here is unknown.
    pub fn class(&self) -> FailureClass {
        match self.kind {
            FailureKind::TimedOut | FailureKind::Disconnected => FailureClass::Transient,
            FailureKind::NotFound | FailureKind::TooLarge | FailureKind::Invalid => {
                FailureClass::Permanent
            }
            FailureKind::Rejected => FailureClass::Unknown,
        }
    }
}

/// The round's events as chains published one event at a time: one per ordered key (in the
/// round's order), one per other event.
pub fn chains(events: &[Event]) -> Vec<Vec<(usize, &Event)>> {
    let mut by_key: BTreeMap<(&str, &str), usize> = BTreeMap::new();
    let mut out: Vec<Vec<(usize, &Event)>> = Vec::new();
    for (i, ev) in events.iter().enumerate() {
        match ev.key.as_deref().filter(|_| ev.ordered) {
            Some(k) => {
                let n = *by_key.entry((ev.topic.as_str(), k)).or_insert_with(|| {
                    out.push(Vec::new());
                    out.len() - 1
                });
                out[n].push((i, ev));
            }
            None => out.push(vec![(i, ev)]),
        }
    }
    out
}

/// Publishes a round with `send` (one event, until stored): chains side by side, a chain's events
/// one after the other, so a key's later event never follows a failed one. A failure or the end of
/// `send_timeout` ends a chain: the rest of it is `NotSent`.
pub async fn publish_chained<'a, F, Fut>(
    events: &'a [Event],
    send_timeout: Duration,
    send: F,
) -> Vec<Outcome>
where
    F: Fn(&'a Event) -> Fut,
    Fut: Future<Output = Result<(), BrokerError>>,
{
    let start = Instant::now();
    let send = &send;
    let chain = |chain: Vec<(usize, &'a Event)>| async move {
        let mut out = Vec::with_capacity(chain.len());
        let mut failed = false;
        for (i, ev) in chain {
            if failed {
                out.push((i, Outcome::NotSent));
                continue;
            }
            let handed = start.elapsed();
            let sent = if handed >= send_timeout {
                Err(BrokerError::new(
                    FailureKind::TimedOut,
                    "the send timeout ran out before an earlier event of its key was acked",
                ))
            } else {
                send(ev).await
            };
            let outcome = match sent {
                Ok(()) => Outcome::Delivered {
                    handed,
                    delivered: start.elapsed(),
                },
                Err(e) => {
                    failed = true;
                    Outcome::Failed(PublishError {
                        topic: ev.topic.clone(),
                        source: e.into(),
                    })
                }
            };
            out.push((i, outcome));
        }
        out
    };
    let done = join_all(chains(events).into_iter().map(chain)).await;
    let mut outcomes = vec![Outcome::NotSent; events.len()];
    for (i, o) in done.into_iter().flatten() {
        outcomes[i] = o;
    }
    outcomes
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub fn ev(id: i64, topic: &str, key: Option<&str>, ordered: bool) -> Event {
        Event {
            id,
            event_id: format!("e{id}"),
            topic: topic.into(),
            key: key.map(Into::into),
            event_type: None,
            payload: "{}".into(),
            headers: "{}".into(),
            claim_token: 1,
            retry_count: 0,
            age_at_claim: 0.0,
            created_at_ms: 0,
            ordered,
        }
    }

    #[test]
    fn ordered_keys_are_chained_others_sent_alone() {
        let events = [
            ev(1, "orders", Some("A"), true),
            ev(2, "orders", Some("B"), true),
            ev(3, "orders", Some("A"), true),
            ev(4, "audit", Some("A"), true),
            ev(5, "orders", None, true),
            ev(6, "clicks", Some("A"), false),
            ev(7, "clicks", Some("A"), false),
        ];
        let c: Vec<Vec<usize>> = chains(&events)
            .iter()
            .map(|c| c.iter().map(|(i, _)| *i).collect())
            .collect();
        assert_eq!(
            c,
            vec![vec![0, 2], vec![1], vec![3], vec![4], vec![5], vec![6]]
        );
    }

    #[tokio::test]
    async fn a_failed_event_stops_its_chain_only() {
        let events = [
            ev(1, "orders", Some("A"), true),
            ev(2, "orders", Some("A"), true),
            ev(3, "orders", Some("B"), true),
        ];
        let out = publish_chained(&events, Duration::from_secs(5), |e| async move {
            match e.id {
                1 => Err(BrokerError::new(FailureKind::TooLarge, "too large")),
                _ => Ok(()),
            }
        })
        .await;
        assert!(matches!(out[0], Outcome::Failed(_)));
        assert!(matches!(out[1], Outcome::NotSent));
        assert!(matches!(out[2], Outcome::Delivered { .. }));
    }
}
