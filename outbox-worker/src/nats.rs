//! The NATS JetStream sink: each event a JetStream publish to the subject `--nats-subject` makes of
//! its topic (and key), with the relay's headers and `Nats-Msg-Id` = `event_id`, so the stream's
//! duplicate window drops a redelivery. Delivered means the stream's publish ack.

use std::str::FromStr;
use std::time::Duration;

use async_nats::jetstream::context::{ContextBuilder, PublishErrorKind};
use async_nats::jetstream::{self, ErrorCode};
use async_nats::{HeaderMap, HeaderName, HeaderValue};

use crate::cli::NatsArgs;
use crate::message::headers;
use crate::sink::{publish_chained, BrokerError, FailureKind, Outcome, Replaced, Sink};
use crate::store::Event;
use crate::Fatal;

/// The subject of an event without a key when the template has `{key}`.
const NO_KEY: &str = "_";

/// Publishes awaiting their ack at once, over all claim loops.
const MAX_ACK_INFLIGHT: usize = 10_000;

/// A JetStream publish error as the relay classifies it.
fn broker_error(e: async_nats::jetstream::context::PublishError) -> BrokerError {
    let api_code = std::error::Error::source(&e)
        .and_then(|s| s.downcast_ref::<jetstream::Error>())
        .map(|a| a.error_code());
    let kind = match e.kind() {
        PublishErrorKind::TimedOut | PublishErrorKind::MaxAckPending => FailureKind::TimedOut,
        PublishErrorKind::BrokenPipe => FailureKind::Disconnected,
        PublishErrorKind::StreamNotFound => FailureKind::NotFound,
        PublishErrorKind::MaxPayloadExceeded => FailureKind::TooLarge,
        _ => match api_code {
            Some(
                ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM
                | ErrorCode::STREAM_HEADER_EXCEEDS_MAXIMUM,
            ) => FailureKind::TooLarge,
            Some(ErrorCode::STREAM_NOT_FOUND) => FailureKind::NotFound,
            _ => FailureKind::Rejected,
        },
    };
    let message = match std::error::Error::source(&e) {
        Some(s) => format!("{e}: {s}"),
        None => e.to_string(),
    };
    BrokerError::new(kind, message)
}

/// The client's options from the flags: name, reconnects, TLS and the user.
fn connect_options(
    args: &NatsArgs,
    send_timeout: Duration,
) -> Result<async_nats::ConnectOptions, Fatal> {
    let mut o = async_nats::ConnectOptions::new()
        .name(crate::defaults::CLIENT_ID)
        .max_reconnects(None)
        .request_timeout(Some(send_timeout));
    if let Some(ca) = &args.nats_tls_ca {
        if !ca.is_file() {
            return Err(Fatal::usage(format!(
                "--nats-tls-ca {}: no such file",
                ca.display()
            )));
        }
        o = o.add_root_certificates(ca.clone()).require_tls(true);
    }
    if let (Some(user), Some(password)) = (&args.nats_user, &args.nats_password) {
        o = o.user_and_password(user.clone(), password.clone());
    }
    Ok(o)
}

/// A connect error that is the TLS handshake's: the client refused the server's certificate
/// (rustls reports it as invalid data), or the TLS set-up itself failed.
fn is_tls_failure(e: &async_nats::ConnectError) -> bool {
    if e.kind() == async_nats::ConnectErrorKind::Tls {
        return true;
    }
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            if io.kind() == std::io::ErrorKind::InvalidData {
                return true;
            }
        }
        source = s.source();
    }
    false
}

/// An error and its sources on one line.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !out.contains(&text) {
            out += &format!(": {text}");
        }
        source = s.source();
    }
    out
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
fn subject(template: &str, ev: &Event) -> Result<String, BrokerError> {
    let key = ev.key.as_deref().unwrap_or(NO_KEY);
    if template.contains("{key}") && !is_token(key) {
        return Err(BrokerError::new(
            FailureKind::Invalid,
            format!(
                "key {key:?} cannot be a NATS subject token (no '.', '*', '>', whitespace, empty)"
            ),
        ));
    }
    let s = template.replace("{topic}", &ev.topic).replace("{key}", key);
    if !s.split('.').all(is_token) {
        return Err(BrokerError::new(
            FailureKind::Invalid,
            format!("{s:?} is not a NATS subject"),
        ));
    }
    Ok(s)
}

fn is_token(t: &str) -> bool {
    !t.is_empty() && !t.contains(|c: char| c.is_whitespace() || matches!(c, '.' | '*' | '>'))
}

/// The relay's headers as NATS headers, `Nats-Msg-Id` among them.
fn nats_headers(ev: &Event) -> Result<HeaderMap, BrokerError> {
    let mut map = HeaderMap::new();
    for (k, v) in headers(ev) {
        let invalid = |what: &str| {
            BrokerError::new(
                FailureKind::Invalid,
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
    /// Connects once at start: a TLS handshake the client refuses ends the start (exit 2); a
    /// server not up yet is retried in the background, as Kafka's is. Never gives up reconnecting.
    pub async fn connect(args: &NatsArgs, send_timeout: Duration) -> Result<NatsSink, Fatal> {
        check_subject_template(&args.nats_subject)?;
        let servers: Vec<async_nats::ServerAddr> = args
            .nats_url
            .split(',')
            .map(|u| u.trim().parse())
            .collect::<Result<_, _>>()
            .map_err(|e| Fatal::usage(format!("invalid --nats-url: {e}")))?;
        let first = tokio::time::timeout(
            send_timeout,
            connect_options(args, send_timeout)?.connect(servers.clone()),
        )
        .await;
        let client = match first {
            Ok(Ok(client)) => client,
            Ok(Err(e)) if is_tls_failure(&e) => {
                return Err(Fatal::usage(format!(
                    "TLS to the NATS server {} failed: {}",
                    args.nats_url,
                    error_chain(&e)
                )))
            }
            _ => connect_options(args, send_timeout)?
                .retry_on_initial_connect()
                .connect(servers)
                .await
                .map_err(|e| Fatal::usage(format!("cannot connect to NATS: {e}")))?,
        };
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
    async fn send(&self, ev: &Event) -> Result<(), BrokerError> {
        let subject = subject(&self.subject, ev)?;
        let msg = jetstream::message::PublishMessage::build()
            .payload(ev.payload.clone().into())
            .headers(nats_headers(ev)?);
        let ack = self
            .js
            .send_publish(subject, msg)
            .await
            .map_err(broker_error)?;
        ack.await.map_err(broker_error)?;
        Ok(())
    }
}

#[async_trait::async_trait]
impl Sink for NatsSink {
    fn name(&self) -> &'static str {
        crate::cli::SinkKind::Nats.broker_name()
    }

    /// Ordered keys go one event at a time (the next after the previous one's ack), so a later
    /// event never reaches the stream once an earlier one of its key failed; keys run concurrently.
    async fn publish(&self, events: &[Event]) -> (Vec<Outcome>, Vec<Replaced>) {
        let outcomes = publish_chained(events, self.send_timeout, |ev| self.send(ev)).await;
        (outcomes, Vec::new())
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
    use crate::sink::tests::ev;

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
            assert_eq!(err.kind, FailureKind::Invalid, "{bad:?}");
            assert_eq!(err.class(), crate::error::FailureClass::Permanent);
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
        assert_eq!(nats_headers(&bad).unwrap_err().kind, FailureKind::Invalid);
    }
}
