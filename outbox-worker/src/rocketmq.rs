//! The Apache RocketMQ 5 sink: each event a FIFO message sent through the broker's gRPC proxy
//! (the `rocketmq` crate). Its key is the message group, so a key's events are stored in one
//! queue in order; the message keys are the `event_id` (consumers deduplicate by it) and the key;
//! `event_type` is the tag; the relay's headers are user properties. Delivered means the proxy's
//! send receipt: the broker stored the message.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rocketmq::conf::{ClientOption, LoggingFormat, ProducerOption};
use rocketmq::error::{ClientError, ErrorKind};
use rocketmq::model::message::{Message, MessageBuilder};
use rocketmq::Producer;
use tokio::sync::{OnceCell, OwnedMutexGuard};

use crate::cli::{RocketMqArgs, SinkKind};
use crate::message::headers;
use crate::sink::{publish_chained, BrokerError, FailureKind, Outcome, Replaced, Sink};
use crate::store::Event;
use crate::Fatal;

/// The message group of an event without a key: its own id, so such events spread over queues.
fn message_group(ev: &Event) -> &str {
    ev.key.as_deref().unwrap_or(&ev.event_id)
}

/// Response codes of the proxy that are the event's own fault.
const PERMANENT_CODES: [&str; 7] = [
    "MESSAGE_BODY_TOO_LARGE",
    "MESSAGE_PROPERTIES_TOO_LARGE",
    "ILLEGAL_TOPIC",
    "ILLEGAL_MESSAGE_TAG",
    "ILLEGAL_MESSAGE_KEY",
    "ILLEGAL_MESSAGE_GROUP",
    "ILLEGAL_MESSAGE_PROPERTY_KEY",
];

/// Response codes of a broker that is busy, starting or down. TOPIC_NOT_FOUND too: a new topic's
/// route reaches the name server only when its broker next registers.
const TRANSIENT_CODES: [&str; 7] = [
    "TOPIC_NOT_FOUND",
    "INTERNAL_SERVER_ERROR",
    "PROXY_TIMEOUT",
    "TOO_MANY_REQUESTS",
    "MASTER_PERSISTENCE_TIMEOUT",
    "SLAVE_PERSISTENCE_TIMEOUT",
    "HA_NOT_AVAILABLE",
];

/// A client error as the relay classifies it.
fn broker_error(e: &ClientError) -> BrokerError {
    let code = e
        .context()
        .iter()
        .find(|(k, _)| *k == "code")
        .map(|(_, v)| v.as_str());
    let kind = match (e.kind(), code) {
        (ErrorKind::InvalidMessage, _) => FailureKind::Invalid,
        (ErrorKind::Server, Some("MESSAGE_BODY_TOO_LARGE" | "MESSAGE_PROPERTIES_TOO_LARGE")) => {
            FailureKind::TooLarge
        }
        (ErrorKind::Server, Some(c)) if PERMANENT_CODES.contains(&c) => FailureKind::Invalid,
        (ErrorKind::Server, Some(c)) if TRANSIENT_CODES.contains(&c) => FailureKind::TimedOut,
        (ErrorKind::Server, _) => FailureKind::Rejected,
        _ => FailureKind::Disconnected,
    };
    let context: Vec<String> = e
        .context()
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    BrokerError::new(kind, format!("{} ({})", e.message(), context.join(", ")))
}

pub struct RocketMqSink {
    /// Started by the first round or health request that reaches the proxy.
    producer: OnceCell<Arc<Producer>>,
    routes: Routes,
    client: ClientOption,
    proxy: String,
    send_timeout: Duration,
}

impl RocketMqSink {
    /// Checks the flags; the producer starts once the proxy answers (a proxy not up yet is
    /// retried, as Kafka's brokers are).
    pub fn new(args: &RocketMqArgs, send_timeout: Duration) -> Result<RocketMqSink, Fatal> {
        let proxy = args.rocketmq_proxy.trim().to_string();
        if proxy.is_empty() || proxy.contains("://") || !proxy.contains(':') {
            return Err(Fatal::usage(format!(
                "--rocketmq-proxy {proxy:?} must be HOST:PORT of a RocketMQ proxy's gRPC endpoint"
            )));
        }
        let mut client = ClientOption::default();
        client.set_access_url(proxy.clone());
        client.set_timeout(send_timeout);
        client.set_enable_tls(false);
        Ok(RocketMqSink {
            producer: OnceCell::new(),
            routes: Routes::default(),
            client,
            proxy,
            send_timeout,
        })
    }

    async fn producer(&self) -> Result<&Arc<Producer>, BrokerError> {
        self.producer
            .get_or_try_init(|| async {
                let mut option = ProducerOption::default();
                option.set_logging_format(LoggingFormat::Terminal);
                let mut p =
                    Producer::new(option, self.client.clone()).map_err(|e| broker_error(&e))?;
                match tokio::time::timeout(self.send_timeout, p.start()).await {
                    Ok(Ok(())) => Ok(Arc::new(p)),
                    Ok(Err(e)) => Err(broker_error(&e)),
                    Err(_) => Err(BrokerError::new(
                        FailureKind::TimedOut,
                        format!(
                            "no answer from the RocketMQ proxy {} within {:?}",
                            self.proxy, self.send_timeout
                        ),
                    )),
                }
            })
            .await
    }

    /// Sends one event and waits for its receipt.
    async fn send(&self, ev: &Event) -> Result<(), BrokerError> {
        let producer = self.producer().await?;
        let send = || {
            let (producer, message) = (Arc::clone(producer), message(ev));
            async move { producer.send(message?).await.map(drop) }
        };
        match tokio::time::timeout(self.send_timeout, self.routes.send(&ev.topic, send)).await {
            Ok(sent) => sent,
            Err(_) => Err(BrokerError::new(
                FailureKind::TimedOut,
                format!("no send receipt within {:?}", self.send_timeout),
            )),
        }
    }
}

/// The event as a FIFO message of its topic.
fn message(ev: &Event) -> Result<impl Message, ClientError> {
    let mut keys = vec![ev.event_id.clone()];
    keys.extend(ev.key.clone());
    let properties: HashMap<String, String> = headers(ev).into_iter().collect();
    let mut msg = MessageBuilder::fifo_message_builder(
        ev.topic.clone(),
        ev.payload.clone().into_bytes(),
        message_group(ev),
    )
    .set_keys(keys)
    .set_properties(properties);
    if let Some(t) = &ev.event_type {
        msg = msg.set_tag(t.clone());
    }
    msg.build()
}

/// The client's operations of a route query: its answer, and the gRPC call.
const ROUTE_QUERY: [&str; 2] = ["client.query_route", "rpc.query_route"];

/// The failure of a send's route query, and when it came.
type RouteFailure = Option<(Instant, BrokerError)>;

/// What the sink knows of a topic's route.
enum Route {
    /// A send of the topic succeeded: the client keeps its route.
    Found,
    /// Asked for by one send at a time, the one holding this lock; the last failure of its query.
    Unknown(Arc<tokio::sync::Mutex<RouteFailure>>),
}

/// The client's shared route query tells the sends that waited for it no cause when it fails (an
/// error the relay could only call unknown). So one send of a routeless topic asks at a time, and
/// those that waited fail with its error, classified.
#[derive(Clone, Default)]
struct Routes(Arc<Mutex<HashMap<String, Route>>>);

impl Routes {
    /// Runs `send`, one send at a time while the topic's route is not found; a send that waited
    /// while another one's route query failed fails with that error.
    async fn send<F, Fut>(&self, topic: &str, send: F) -> Result<(), BrokerError>
    where
        F: Fn() -> Fut,
        Fut: Future<Output = Result<(), ClientError>> + Send + 'static,
    {
        let Some(asking) = self.unknown(topic) else {
            return send().await.map_err(|e| broker_error(&e));
        };
        let waiting_since = Instant::now();
        let failure = asking.lock_owned().await;
        match &*failure {
            Some((at, e)) if *at >= waiting_since => return Err(e.clone()),
            _ if self.unknown(topic).is_none() => {
                drop(failure);
                return send().await.map_err(|e| broker_error(&e));
            }
            _ => {}
        }
        // A task of its own, which a caller's timeout abandons but never cancels: the client
        // marks the topic's route query in flight until the query returns, so a query dropped
        // half-way would leave every later send of the topic waiting for it for good.
        let asked = tokio::spawn(self.clone().ask(topic.to_string(), failure, send()));
        asked
            .await
            .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()))
    }

    /// Awaits a send of a topic whose route is not found, holding the topic's lock until it
    /// returns, and keeps what it learnt of the route.
    async fn ask(
        self,
        topic: String,
        mut failure: OwnedMutexGuard<RouteFailure>,
        send: impl Future<Output = Result<(), ClientError>>,
    ) -> Result<(), BrokerError> {
        let sent = send.await;
        match &sent {
            Ok(()) => {
                let mut routes = self.0.lock().expect("routes");
                routes.insert(topic, Route::Found);
            }
            Err(e) if ROUTE_QUERY.contains(&e.operation()) => {
                *failure = Some((Instant::now(), broker_error(e)));
            }
            Err(_) => {}
        }
        sent.map_err(|e| broker_error(&e))
    }

    /// The lock of a topic whose route is not found yet.
    fn unknown(&self, topic: &str) -> Option<Arc<tokio::sync::Mutex<RouteFailure>>> {
        let mut routes = self.0.lock().expect("routes");
        let route = routes
            .entry(topic.to_string())
            .or_insert_with(|| Route::Unknown(Arc::default()));
        match route {
            Route::Found => None,
            Route::Unknown(asking) => Some(asking.clone()),
        }
    }
}

#[async_trait::async_trait]
impl Sink for RocketMqSink {
    fn name(&self) -> &'static str {
        SinkKind::Rocketmq.broker_name()
    }

    /// Ordered keys go one event at a time (the next after the previous one's receipt), so a
    /// later event never reaches the broker once an earlier one of its key failed.
    async fn publish(&self, events: &[Event]) -> (Vec<Outcome>, Vec<Replaced>) {
        let outcomes = publish_chained(events, self.send_timeout, |ev| self.send(ev)).await;
        (outcomes, Vec::new())
    }

    /// The producer started (the proxy answered a route and a heartbeat), and the proxy's gRPC
    /// port accepts a connection now.
    async fn health(&self, timeout: Duration) -> Result<String, String> {
        let check = async {
            self.producer().await.map_err(|e| e.to_string())?;
            tokio::net::TcpStream::connect(&self.proxy)
                .await
                .map_err(|e| format!("proxy {}: {e}", self.proxy))?;
            Ok(format!("proxy {}", self.proxy))
        };
        match tokio::time::timeout(timeout, check).await {
            Ok(r) => r,
            Err(_) => Err(format!("no answer within {timeout:?}")),
        }
    }

    /// Every send awaits its receipt within the round: nothing is left on its way.
    async fn flush(&self) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_without_key_is_a_message_group_of_its_own() {
        let mut ev = crate::sink::tests::ev(1, "orders", Some("A-1"), true);
        assert_eq!(message_group(&ev), "A-1");
        ev.key = None;
        assert_eq!(message_group(&ev), "e1");
    }
}
