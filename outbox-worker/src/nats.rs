//! The NATS JetStream sink: each event a JetStream publish to the subject `--nats-subject` makes of
//! its topic (and key), with the relay's headers and `Nats-Msg-Id` = `event_id`, so the stream's
//! duplicate window drops a redelivery. Delivered means the stream's publish ack.

use std::str::FromStr;
use std::time::{Duration, Instant};

use async_nats::jetstream::context::{ContextBuilder, PublishErrorKind};
use async_nats::jetstream::{self, ErrorCode};
use async_nats::{HeaderMap, HeaderName, HeaderValue};
use futures_util::future::join_all;

use crate::cli::NatsArgs;
use crate::error::{FailureClass, PublishError};
use crate::message::headers;
use crate::sink::{chains, Outcome, Replaced, Sink};
use crate::store::Event;
use crate::Fatal;

/// The subject of an event without a key when the template has `{key}`.
const NO_KEY: &str = "_";

/// Publishes awaiting their ack at once, over all claim loops.
const MAX_ACK_INFLIGHT: usize = 10_000;

/// What went wrong with one publish; decides how the event is settled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NatsErrorKind {
    /// No publish ack within the send timeout (server down, slow, or unreachable).
    TimedOut,
    /// The connection broke before the ack came.
    Disconnected,
    /// No stream captures the event's subject.
    NoStream,
    /// Larger than the server's `max_payload` or the stream's `max_msg_size`.
    TooLarge,
    /// The event cannot be a NATS message: its key or a header name or value is not allowed.
    Invalid,
    /// JetStream refused it with an error code neither list above names.
    Rejected,
}

impl NatsErrorKind {
    /// The `code` label of the failure metrics.
    pub fn label(self) -> &'static str {
        match self {
            NatsErrorKind::TimedOut => "TimedOut",
            NatsErrorKind::Disconnected => "Disconnected",
            NatsErrorKind::NoStream => "NoStream",
            NatsErrorKind::TooLarge => "TooLarge",
            NatsErrorKind::Invalid => "Invalid",
            NatsErrorKind::Rejected => "Rejected",
        }
    }
}

/// A failed NATS publish: its kind and the client's words.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct NatsError {
    pub kind: NatsErrorKind,
    pub message: String,
}

impl NatsError {
    fn new(kind: NatsErrorKind, message: impl Into<String>) -> NatsError {
        NatsError {
            kind,
            message: message.into(),
        }
    }

    /// The event's own fault (no stream, too large, invalid) is permanent; the server's or the
    /// network's is transient; a JetStream error code not named here is unknown.
    pub fn class(&self) -> FailureClass {
        match self.kind {
            NatsErrorKind::TimedOut | NatsErrorKind::Disconnected => FailureClass::Transient,
            NatsErrorKind::NoStream | NatsErrorKind::TooLarge | NatsErrorKind::Invalid => {
                FailureClass::Permanent
            }
            NatsErrorKind::Rejected => FailureClass::Unknown,
        }
    }
}

impl From<async_nats::jetstream::context::PublishError> for NatsError {
    fn from(e: async_nats::jetstream::context::PublishError) -> NatsError {
        let api_code = std::error::Error::source(&e)
            .and_then(|s| s.downcast_ref::<jetstream::Error>())
            .map(|a| a.error_code());
        let kind = match e.kind() {
            PublishErrorKind::TimedOut | PublishErrorKind::MaxAckPending => NatsErrorKind::TimedOut,
            PublishErrorKind::BrokenPipe => NatsErrorKind::Disconnected,
            PublishErrorKind::StreamNotFound => NatsErrorKind::NoStream,
            PublishErrorKind::MaxPayloadExceeded => NatsErrorKind::TooLarge,
            _ => match api_code {
                Some(
                    ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM
                    | ErrorCode::STREAM_HEADER_EXCEEDS_MAXIMUM,
                ) => NatsErrorKind::TooLarge,
                Some(ErrorCode::STREAM_NOT_FOUND) => NatsErrorKind::NoStream,
                _ => NatsErrorKind::Rejected,
            },
        };
        let message = match std::error::Error::source(&e) {
            Some(s) => format!("{e}: {s}"),
            None => e.to_string(),
        };
        NatsError::new(kind, message)
    }
}

/// `--nats-subject` has only the placeholders `{topic}` and `{key}`, and `{topic}`.
pub fn check_subject_template(t: &str) -> Result<(), Fatal> {
    let rest = t.replace("{topic}", "").replace("{key}", "");
    if !t.contains("{topic}") || rest.contains(['{', '}']) {
        return Err(Fatal::usage(format!(
            "--nats-subject {t:?} must contain {{topic}} and may contain {{key}}, no other placeholder"
        )));
    }
    Ok(())
}

/// The subject of `ev` under `template`: a NATS subject of non-empty tokens without whitespace or
/// wildcards; the key, when used, must be one token.
fn subject(template: &str, ev: &Event) -> Result<String, NatsError> {
    let key = ev.key.as_deref().unwrap_or(NO_KEY);
    if template.contains("{key}") && !is_token(key) {
        return Err(NatsError::new(
            NatsErrorKind::Invalid,
            format!(
                "key {key:?} cannot be a NATS subject token (no '.', '*', '>', whitespace, empty)"
            ),
        ));
    }
    let s = template.replace("{topic}", &ev.topic).replace("{key}", key);
    if !s.split('.').all(is_token) {
        return Err(NatsError::new(
            NatsErrorKind::Invalid,
            format!("{s:?} is not a NATS subject"),
        ));
    }
    Ok(s)
}

fn is_token(t: &str) -> bool {
    !t.is_empty() && !t.contains(|c: char| c.is_whitespace() || matches!(c, '.' | '*' | '>'))
}

/// The relay's headers as NATS headers, `Nats-Msg-Id` among them.
fn nats_headers(ev: &Event) -> Result<HeaderMap, NatsError> {
    let mut map = HeaderMap::new();
    for (k, v) in headers(ev) {
        let invalid = |what: &str| {
            NatsError::new(
                NatsErrorKind::Invalid,
                format!("header {k:?}: {what} not allowed in a NATS header"),
            )
        };
        let name = HeaderName::from_str(&k).map_err(|_| invalid("name"))?;
        let value = HeaderValue::from_str(&v).map_err(|_| invalid("value"))?;
        map.insert(name, value);
    }
    map.insert(async_nats::header::NATS_MESSAGE_ID, ev.event_id.as_str());
    Ok(map)
}

pub struct NatsSink {
    client: async_nats::Client,
    js: jetstream::Context,
    subject: String,
    send_timeout: Duration,
}

impl NatsSink {
    /// Connects in the background (a server not up yet is retried, as Kafka's is) and never gives
    /// up reconnecting.
    pub async fn connect(args: &NatsArgs, send_timeout: Duration) -> Result<NatsSink, Fatal> {
        check_subject_template(&args.nats_subject)?;
        let servers: Vec<async_nats::ServerAddr> = args
            .nats_url
            .split(',')
            .map(|u| u.trim().parse())
            .collect::<Result<_, _>>()
            .map_err(|e| Fatal::usage(format!("invalid --nats-url: {e}")))?;
        let client = async_nats::ConnectOptions::new()
            .name(crate::defaults::CLIENT_ID)
            .retry_on_initial_connect()
            .max_reconnects(None)
            .request_timeout(Some(send_timeout))
            .connect(servers)
            .await
            .map_err(|e| Fatal::usage(format!("cannot connect to NATS: {e}")))?;
        let js = ContextBuilder::new()
            .timeout(send_timeout)
            .max_ack_inflight(MAX_ACK_INFLIGHT)
            .backpressure_on_inflight(true)
            .build(client.clone());
        Ok(NatsSink {
            client,
            js,
            subject: args.nats_subject.clone(),
            send_timeout,
        })
    }

    /// Publishes one event and waits for its ack.
    async fn send(&self, ev: &Event) -> Result<(), NatsError> {
        let subject = subject(&self.subject, ev)?;
        let msg = jetstream::message::PublishMessage::build()
            .payload(ev.payload.clone().into())
            .headers(nats_headers(ev)?);
        let ack = self.js.send_publish(subject, msg).await?;
        ack.await?;
        Ok(())
    }

    /// Publishes a chain of events one after the other, each after the previous one's ack: the
    /// first failure (or the end of the send timeout) ends it, the rest is `NotSent`.
    async fn send_chain(
        &self,
        chain: Vec<(usize, &Event)>,
        start: Instant,
    ) -> Vec<(usize, Outcome)> {
        let mut out = Vec::with_capacity(chain.len());
        let mut failed = false;
        for (i, ev) in chain {
            if failed {
                out.push((i, Outcome::NotSent));
                continue;
            }
            let handed = start.elapsed();
            let sent = if handed >= self.send_timeout {
                Err(NatsError::new(
                    NatsErrorKind::TimedOut,
                    "the send timeout ran out before an earlier event of its key was acked",
                ))
            } else {
                self.send(ev).await
            };
            out.push((
                i,
                match sent {
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
                },
            ));
        }
        out
    }
}

#[async_trait::async_trait]
impl Sink for NatsSink {
    fn name(&self) -> &'static str {
        "NATS"
    }

    /// Ordered keys go one event at a time (the next after the previous one's ack), so a later
    /// event never reaches the stream once an earlier one of its key failed; keys run concurrently.
    async fn publish(&self, events: &[Event]) -> (Vec<Outcome>, Option<Replaced>) {
        let start = Instant::now();
        let done = join_all(
            chains(events)
                .into_iter()
                .map(|c| self.send_chain(c, start)),
        )
        .await;
        let mut outcomes = vec![Outcome::NotSent; events.len()];
        for (i, o) in done.into_iter().flatten() {
            outcomes[i] = o;
        }
        (outcomes, None)
    }

    /// JetStream's account info: answers only once JetStream is up.
    async fn health(&self, timeout: Duration) -> Result<String, String> {
        match tokio::time::timeout(timeout, self.js.query_account()).await {
            Ok(Ok(a)) => Ok(format!("JetStream, {} streams", a.streams)),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!("no answer within {timeout:?}")),
        }
    }

    async fn flush(&self) {
        if tokio::time::timeout(self.send_timeout, self.client.flush())
            .await
            .is_err()
        {
            tracing::warn!("flushing the NATS connection timed out");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(id: i64, topic: &str, key: Option<&str>, ordered: bool) -> Event {
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
    fn subjects_come_from_topic_and_key() {
        let e = ev(1, "orders", Some("A-1"), true);
        assert_eq!(subject("{topic}", &e).unwrap(), "orders");
        assert_eq!(
            subject("outbox.{topic}.{key}", &e).unwrap(),
            "outbox.orders.A-1"
        );
        let no_key = ev(2, "orders", None, true);
        assert_eq!(subject("{topic}.{key}", &no_key).unwrap(), "orders._");
        for bad in ["a.b", "a b", "*", ">", ""] {
            let e = ev(3, "orders", Some(bad), true);
            let err = subject("{topic}.{key}", &e).unwrap_err();
            assert_eq!(err.kind, NatsErrorKind::Invalid, "{bad:?}");
            assert_eq!(err.class(), FailureClass::Permanent);
        }
        // A key with a dot is fine while the subject does not use it.
        assert!(subject("{topic}", &ev(4, "orders", Some("a.b"), true)).is_ok());
    }

    #[test]
    fn a_subject_template_needs_the_topic_and_no_other_placeholder() {
        assert!(check_subject_template("{topic}").is_ok());
        assert!(check_subject_template("x.{topic}.{key}").is_ok());
        assert!(check_subject_template("{key}").is_err());
        assert!(check_subject_template("{topic}.{id}").is_err());
    }

    #[test]
    fn headers_carry_the_event_id_as_nats_msg_id() {
        let h = nats_headers(&ev(9, "orders", Some("A"), true)).unwrap();
        assert_eq!(h.get("Nats-Msg-Id").map(|v| v.as_str()), Some("e9"));
        assert_eq!(h.get("event_id").map(|v| v.as_str()), Some("e9"));
        assert_eq!(h.get("outbox_id").map(|v| v.as_str()), Some("9"));
        let mut bad = ev(10, "orders", Some("A"), true);
        bad.headers = r#"{"x":"line\r\nbreak"}"#.into();
        assert_eq!(nats_headers(&bad).unwrap_err().kind, NatsErrorKind::Invalid);
    }
}
