//! The shared suite's broker: the same test runs against each sink the relay publishes to (Kafka,
//! NATS JetStream, Apache RocketMQ), each broker started by the test on free loopback ports.

use std::time::Duration;

use crate::broker::{Broker, Msg};
use crate::nats::Nats;
use crate::relay::Relay;
use crate::rocketmq::RocketMq;

/// A running broker of one sink.
pub enum TestSink {
    Kafka(Broker),
    Nats(Nats),
    RocketMq(RocketMq),
}

impl TestSink {
    pub fn kafka() -> TestSink {
        TestSink::Kafka(Broker::start())
    }

    pub fn nats() -> TestSink {
        TestSink::Nats(Nats::start())
    }

    pub fn rocketmq() -> TestSink {
        TestSink::RocketMq(RocketMq::start())
    }

    /// The sink's name in reports ("Kafka", "NATS JetStream").
    pub fn name(&self) -> &'static str {
        match self {
            TestSink::Kafka(_) => "Kafka",
            TestSink::Nats(_) => "NATS JetStream",
            TestSink::RocketMq(_) => "Apache RocketMQ",
        }
    }

    /// The broker's process while it runs (for its CPU time).
    pub fn pid(&self) -> Option<u32> {
        match self {
            TestSink::Kafka(b) => b.pid(),
            TestSink::Nats(n) => n.pid(),
            TestSink::RocketMq(r) => r.pid(),
        }
    }

    /// The relay flags that publish to this broker.
    pub fn relay_args(&self) -> Vec<String> {
        match self {
            TestSink::Kafka(b) => vec!["--brokers".into(), b.addr()],
            TestSink::Nats(n) => vec!["--sink".into(), "nats".into(), "--nats-url".into(), n.url()],
            TestSink::RocketMq(r) => vec![
                "--sink".into(),
                "rocketmq".into(),
                "--rocketmq-proxy".into(),
                r.proxy_addr(),
            ],
        }
    }

    /// `outbox-worker run --database-url URL` publishing here, plus `extra`.
    pub fn spawn_relay(&self, db_url: &str, extra: &[&str]) -> Relay {
        let sink = self.relay_args();
        let mut args = vec!["run", "--database-url", db_url];
        args.extend(sink.iter().map(String::as_str));
        args.extend_from_slice(extra);
        Relay::spawn_args(&args)
    }

    /// A Kafka topic, or a JetStream stream capturing the subject of that name.
    pub fn create_topic(&self, name: &str) {
        match self {
            TestSink::Kafka(b) => b.create_topic(name),
            TestSink::Nats(n) => n.create_stream(name),
            TestSink::RocketMq(r) => r.create_topic(name),
        }
    }

    /// Every message stored for `topic`, in partition and offset (stream sequence) order.
    pub fn consume_all(&self, topic: &str, stall: Duration) -> Vec<Msg> {
        let mut msgs = match self {
            TestSink::Kafka(b) => b.consume_all(topic, stall),
            TestSink::Nats(n) => n.consume_all(topic),
            TestSink::RocketMq(r) => r.consume_all(topic),
        };
        msgs.sort_by_key(|m| (m.partition, m.offset));
        msgs
    }

    /// Stops the broker, keeping its data.
    pub fn stop(&mut self) {
        match self {
            TestSink::Kafka(b) => b.stop(),
            TestSink::Nats(n) => n.stop(),
            TestSink::RocketMq(r) => r.stop(),
        }
    }

    /// Starts the stopped broker again with its data; returns once it answers.
    pub fn start_again(&mut self) {
        match self {
            TestSink::Kafka(b) => b.start_again(),
            TestSink::Nats(n) => n.start_again(),
            TestSink::RocketMq(r) => r.start_again(),
        }
    }
}
