//! A real Apache Kafka broker (single node, KRaft, see `kafka.rs`) per test, on a free loopback
//! port, killed on drop (its directory is kept when the test failed); topics created through the
//! Admin API; reading a topic back with a Kafka consumer up to the high watermarks, or following
//! it with `outbox-worker tail --follow`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use outbox_worker::{HEADER_EVENT_ID, HEADER_OUTBOX_ID};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{BorrowedMessage, Headers};
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};

use crate::kafka::{self, Kafka};
use crate::relay::relay_bin;

/// Partitions of the topics `create_topic` makes.
pub const PARTITIONS: i32 = 4;

/// A loopback port nothing listens on right now.
pub fn free_port() -> u16 {
    kafka::free_port().expect("bind 127.0.0.1:0")
}

pub struct Broker {
    pub port: u16,
    kafka: Kafka,
    /// The broker's log (kept with its directory when the test fails).
    pub log: PathBuf,
}

/// One message read back from a topic.
#[derive(Debug, Clone)]
pub struct Msg {
    pub partition: i64,
    pub offset: i64,
    pub key: Option<String>,
    pub headers: BTreeMap<String, String>,
    pub value: String,
    /// The message's timestamp (ms since the Unix epoch), None when it has none.
    pub timestamp_ms: Option<i64>,
}

impl Msg {
    /// The row id of the event in its database (the `outbox_id` header).
    pub fn outbox_id(&self) -> i64 {
        self.headers
            .get(HEADER_OUTBOX_ID)
            .unwrap_or_else(|| panic!("message without {HEADER_OUTBOX_ID} header: {self:?}"))
            .parse()
            .expect("numeric outbox_id")
    }

    /// The event's global UUID (the `event_id` header), what consumers deduplicate on.
    pub fn event_id(&self) -> &str {
        self.headers
            .get(HEADER_EVENT_ID)
            .unwrap_or_else(|| panic!("message without {HEADER_EVENT_ID} header: {self:?}"))
    }

    /// Parses one line of `outbox-worker tail --json`.
    pub fn from_json_line(line: &str) -> Msg {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("tail line {line:?}: {e}"));
        let headers = v["headers"]
            .as_object()
            .map(|m| {
                m.iter()
                    .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_string()))
                    .collect()
            })
            .unwrap_or_default();
        Msg {
            partition: v["partition"].as_i64().unwrap_or(-1),
            offset: v["offset"].as_i64().unwrap_or(-1),
            key: v["key"].as_str().map(str::to_string),
            headers,
            value: v["value"].as_str().unwrap_or_default().to_string(),
            timestamp_ms: v["timestamp_ms"].as_i64(),
        }
    }
}

impl Broker {
    /// Starts a broker on a free port and waits until it answers a metadata request.
    pub fn start() -> Broker {
        Broker::start_on(free_port())
    }

    /// Starts a new, empty broker on 127.0.0.1:`port` (its controller on another free port), with
    /// its data in a fresh directory under the temp dir.
    pub fn start_on(port: u16) -> Broker {
        Broker::start_with(port, None)
    }

    /// A broker with a second listener, SASL_PLAINTEXT (SCRAM-SHA-256, OAUTHBEARER), on
    /// `sasl.port`.
    pub fn start_sasl(sasl: &kafka::Sasl) -> Broker {
        Broker::start_with(free_port(), Some(kafka::Listeners::Sasl(sasl)))
    }

    /// A broker with two listeners over TLS, SSL and SASL_SSL (see [`kafka::Tls`]).
    pub fn start_tls(tls: &kafka::Tls) -> Broker {
        Broker::start_with(free_port(), Some(kafka::Listeners::Tls(tls)))
    }

    /// A free port can be taken by a test running beside this one before the JVM binds it: such a
    /// start is tried again (a fresh controller port each time), up to three times.
    fn start_with(port: u16, extra: Option<kafka::Listeners<'_>>) -> Broker {
        let mut attempt = 0;
        loop {
            attempt += 1;
            let dir = std::env::temp_dir().join(format!(
                "outbox-test-kafka-{port}-{}-{attempt}",
                std::process::id()
            ));
            match Broker::try_start_in(&dir, port, extra) {
                Ok(broker) => return broker,
                Err(e) if attempt < 3 && e.contains("Address already in use") => continue,
                Err(e) => panic!("{e}"),
            }
        }
    }

    /// Starts a new, empty broker on 127.0.0.1:`port` with its data in `dir`; an error (with the
    /// broker's log) instead of a panic, for callers that report it (outbox-bench).
    pub fn try_start_in(
        dir: &Path,
        port: u16,
        extra: Option<kafka::Listeners<'_>>,
    ) -> Result<Broker, String> {
        let kafka = Kafka::start_with(dir, port, extra)
            .map_err(|e| format!("starting Kafka on 127.0.0.1:{port}: {e}"))?;
        let log = kafka.log();
        Ok(Broker { port, kafka, log })
    }

    /// The broker JVM's pid while it runs (for its CPU time).
    pub fn pid(&self) -> Option<u32> {
        self.kafka.pid()
    }

    /// `host:port` for `--brokers`.
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// The broker's log directory (`<topic>-<partition>/` with the segment files).
    pub fn data_dir(&self) -> PathBuf {
        self.kafka.dir.join("data")
    }

    /// Creates a topic with 4 partitions (the broker does not create topics on first produce) and
    /// waits until every partition has a leader.
    pub fn create_topic(&self, name: &str) {
        self.try_create_topic(name)
            .unwrap_or_else(|e| panic!("{e}"));
    }

    /// A topic like [`Broker::create_topic`]'s with topic-level settings, e.g.
    /// `[("max.message.bytes", "1024")]`.
    pub fn create_topic_with(&self, name: &str, config: &[(&str, &str)]) {
        kafka::create_topics_with(&self.addr(), &[name], PARTITIONS, config)
            .unwrap_or_else(|e| panic!("{e}\nbroker log {}", self.log.display()));
    }

    /// `create_topic`, returning the failure with the tail of the broker's log.
    pub fn try_create_topic(&self, name: &str) -> Result<(), String> {
        kafka::create_topics(&self.addr(), &[name], PARTITIONS).map_err(|e| {
            format!(
                "{e}\nbroker log {}:\n{}",
                self.log.display(),
                kafka::log_tail(&self.log, 20)
            )
        })
    }

    /// Stops the broker cleanly (SIGTERM) and starts it again on the same ports with the same
    /// data; returns once it answers again.
    pub fn restart(&mut self) {
        self.kafka
            .restart()
            .unwrap_or_else(|e| panic!("restarting Kafka on {}: {e}", self.addr()));
    }

    /// Stops the broker cleanly (SIGTERM), keeping its data: clients get connection refused
    /// until [`Broker::start_again`].
    pub fn stop(&mut self) {
        self.kafka.stop();
    }

    /// Starts a stopped broker again on the same ports with the same data; returns once it
    /// answers.
    pub fn start_again(&mut self) {
        self.restart();
    }

    /// Freezes the broker's JVM (SIGSTOP: connections stay open, nothing is answered).
    pub fn freeze(&self) {
        self.kafka.signal(libc::SIGSTOP);
    }

    pub fn thaw(&self) {
        self.kafka.signal(libc::SIGCONT);
    }

    /// Every message of the topic: each partition read from its first offset up to its high
    /// watermark as of this call (everything acknowledged with acks=all before the call). Panics
    /// if no message arrives for `stall` (at least 10 s) while some partition is not read up to
    /// its watermark yet.
    pub fn consume_all(&self, topic: &str, stall: Duration) -> Vec<Msg> {
        let mut out = Vec::new();
        read_to_end(&self.addr(), topic, stall, |m| out.push(msg_from_kafka(m)))
            .unwrap_or_else(|e| panic!("reading {topic} back: {e}"));
        out
    }

    /// A `tail --follow` consumer whose messages arrive on the returned channel as they come.
    pub fn follow(&self, topic: &str) -> Follower {
        let mut child = Command::new(relay_bin())
            .args([
                "tail",
                "--json",
                "--follow",
                "--brokers",
                &self.addr(),
                "--topic",
                topic,
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn outbox-worker tail");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                if line.starts_with('{')
                    && tx
                        .send((Instant::now(), Msg::from_json_line(&line)))
                        .is_err()
                {
                    return;
                }
            }
        });
        Follower { child, rx }
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        self.kafka.kill();
        // Keep the broker's data and log when the test failed.
        if std::thread::panicking() {
            eprintln!(
                "Kafka of the failed test kept in {} (log {})",
                self.kafka.dir.display(),
                self.log.display()
            );
        } else {
            let _ = std::fs::remove_dir_all(&self.kafka.dir);
        }
    }
}

/// The same fields `Msg::from_json_line` takes from `outbox-worker tail --json`, from a message
/// read with rdkafka (text lossily decoded as UTF-8, a header without value as "").
fn msg_from_kafka(m: &BorrowedMessage<'_>) -> Msg {
    let text = |b: Option<&[u8]>| b.map(|b| String::from_utf8_lossy(b).into_owned());
    let headers = m
        .headers()
        .map(|hs| {
            hs.iter()
                .map(|h| (h.key.to_string(), text(h.value).unwrap_or_default()))
                .collect()
        })
        .unwrap_or_default();
    Msg {
        partition: i64::from(m.partition()),
        offset: m.offset(),
        key: text(m.key()),
        headers,
        value: text(m.payload()).unwrap_or_default(),
        timestamp_ms: m.timestamp().to_millis(),
    }
}

/// Reads every partition of `topic` on `addr` from its first offset up to its high watermark as
/// of the call, with assigned partitions (no group join, nothing committed), handing each message
/// to `f`. Fails if no message arrives for `stall` (at least 10 s) while a partition is behind.
pub fn read_to_end(
    addr: &str,
    topic: &str,
    stall: Duration,
    mut f: impl FnMut(&BorrowedMessage<'_>),
) -> Result<(), String> {
    let stall = stall.max(Duration::from_secs(10));
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", addr)
        .set(
            "group.id",
            format!("outbox-tests-read-{}", std::process::id()),
        )
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "false")
        .set("fetch.wait.max.ms", "10")
        .create()
        .map_err(|e| format!("consumer for {addr}: {e}"))?;
    let md = consumer
        .fetch_metadata(Some(topic), Duration::from_secs(10))
        .map_err(|e| format!("metadata of {topic} from {addr}: {e}"))?;
    let t = md
        .topics()
        .iter()
        .find(|t| t.name() == topic && t.error().is_none())
        .ok_or_else(|| format!("topic {topic} does not exist on {addr}"))?;
    // partition -> next offset to read (starting at the low watermark), high watermark
    let mut todo: BTreeMap<i32, (i64, i64)> = BTreeMap::new();
    let mut tpl = TopicPartitionList::new();
    for p in t.partitions() {
        let (low, high) = consumer
            .fetch_watermarks(topic, p.id(), Duration::from_secs(10))
            .map_err(|e| format!("watermarks of {topic}[{}]: {e}", p.id()))?;
        if high > low {
            todo.insert(p.id(), (low, high));
            tpl.add_partition_offset(topic, p.id(), Offset::Offset(low))
                .map_err(|e| e.to_string())?;
        }
    }
    if todo.is_empty() {
        return Ok(());
    }
    consumer
        .assign(&tpl)
        .map_err(|e| format!("assigning {topic}: {e}"))?;
    let mut last = Instant::now();
    while !todo.is_empty() {
        match consumer.poll(Duration::from_millis(100)) {
            Some(Ok(m)) => {
                last = Instant::now();
                if let Some((next, high)) = todo.get_mut(&m.partition()) {
                    if m.offset() >= *next && m.offset() < *high {
                        f(&m);
                        *next = m.offset() + 1;
                    }
                    if *next >= *high {
                        todo.remove(&m.partition());
                    }
                }
            }
            Some(Err(e)) => return Err(format!("consuming {topic}: {e}")),
            None if last.elapsed() > stall => {
                return Err(format!(
                    "no message for {} s with partitions behind their high watermark \
                     (partition: (next offset, high watermark)) {todo:?}",
                    stall.as_secs()
                ));
            }
            None => {}
        }
    }
    Ok(())
}

/// A running `tail --follow`.
pub struct Follower {
    child: Child,
    pub rx: std::sync::mpsc::Receiver<(Instant, Msg)>,
}

impl Follower {
    /// Waits for the message with this event id; returns when it arrived.
    pub fn wait_for(&self, outbox_id: i64, timeout: Duration) -> Option<(Instant, Msg)> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.checked_duration_since(Instant::now())?;
            match self.rx.recv_timeout(left) {
                Ok((t, m)) if m.outbox_id() == outbox_id => return Some((t, m)),
                Ok(_) => continue,
                Err(_) => return None,
            }
        }
    }
}

impl Drop for Follower {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
