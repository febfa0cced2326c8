//! The Kafka side: idempotent producers (lanes, `lanes.rs`) shared by every claim loop, each
//! replaced when it becomes unusable, librdkafka's log lines routed to tracing and its statistics
//! to the metrics, and publishing of a batch (keys concurrently, each ordered key one event at a
//! time) with one outcome per row. The message itself is built in `message.rs`.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use rdkafka::config::{ClientConfig, RDKafkaLogLevel};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord, Producer};
use rdkafka::statistics::Statistics;
use rdkafka::util::Timeout;
use rdkafka::ClientContext;

use crate::defaults;
use crate::error::PublishError;
use crate::kafka_metrics::KafkaMetrics;
use crate::lanes::{lane_of, PartitionCounts};
use crate::message::build_headers;
use crate::sink::{chains, Outcome, ReplaceReason, Replaced, Sink};
use crate::store::Event;
use crate::Fatal;

/// How long a batch waits before offering a message again to a full librdkafka queue.
const QUEUE_FULL_PAUSE: Duration = Duration::from_millis(10);

/// Routes librdkafka's own log lines and client errors into tracing, its statistics into the
/// `outbox_kafka_*` gauges.
pub struct LogContext {
    metrics: Arc<KafkaMetrics>,
    partitions: Arc<PartitionCounts>,
    lane: usize,
}

impl ClientContext for LogContext {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, msg: &str) {
        match level {
            RDKafkaLogLevel::Emerg | RDKafkaLogLevel::Alert | RDKafkaLogLevel::Critical => {
                tracing::error!(target: "librdkafka", "{fac}: {msg}")
            }
            // Connection failures are logged at librdkafka's Error level; for the relay they are
            // warnings (the events are retried), errors are kept for dead letters.
            RDKafkaLogLevel::Error | RDKafkaLogLevel::Warning => {
                tracing::warn!(target: "librdkafka", "{fac}: {msg}")
            }
            RDKafkaLogLevel::Notice | RDKafkaLogLevel::Info => {
                tracing::info!(target: "librdkafka", "{fac}: {msg}")
            }
            RDKafkaLogLevel::Debug => tracing::debug!(target: "librdkafka", "{fac}: {msg}"),
        }
    }

    fn error(&self, error: KafkaError, reason: &str) {
        match error.rdkafka_error_code() {
            // Already logged by librdkafka's own log line.
            Some(RDKafkaErrorCode::BrokerTransportFailure) => {
                tracing::debug!(target: "librdkafka", "kafka client error: {error}: {reason}")
            }
            _ => tracing::warn!(target: "librdkafka", "kafka client error: {error}: {reason}"),
        }
    }

    fn stats(&self, statistics: Statistics) {
        self.metrics.update(self.lane, &statistics);
        self.partitions.note(&statistics);
    }
}

/// The relay's Kafka producer: librdkafka's async producer with its log lines routed to tracing.
pub type KafkaProducer = FutureProducer<LogContext>;

pub struct Publisher {
    /// Kept to build a replacement producer. Never print it: its Debug output includes secrets
    /// such as sasl.password.
    config: ClientConfig,
    metrics: Arc<KafkaMetrics>,
    partitions: Arc<PartitionCounts>,
    lanes: Vec<Lane>,
    send_timeout: Duration,
    /// Topics a publish found missing. librdkafka remembers a missing topic until its metadata
    /// expires (`metadata.max.age.ms`, 15 min), so events requeued after an operator created the
    /// topic would fail again: their topic's metadata is fetched again before they are sent.
    missing_topics: Mutex<BTreeSet<String>>,
}

/// Whether `producer`'s metadata request lists `topic` with partitions (its cache learns it too).
async fn topic_exists(producer: Arc<KafkaProducer>, topic: String, timeout: Duration) -> bool {
    tokio::task::spawn_blocking(move || {
        producer
            .client()
            .fetch_metadata(Some(&topic), timeout)
            .is_ok_and(|md| {
                md.topics().iter().any(|mt| {
                    mt.name() == topic && mt.error().is_none() && !mt.partitions().is_empty()
                })
            })
    })
    .await
    .unwrap_or(false)
}

/// One producer and its own streak of failed rounds.
struct Lane {
    producer: RwLock<Arc<KafkaProducer>>,
    /// Rounds in a row that delivered nothing in this lane and only timed out.
    timed_out_rounds: AtomicU32,
}

/// After this many rounds in a row without a single delivery, only timeouts, the producer is
/// replaced: measured in the fault suite, a producer that lived through a broker restart kept
/// timing out for good while freshly started relays delivered at once. If the broker is really
/// down, the new producer times out too and nothing is lost but a reconnect.
const TIMED_OUT_ROUNDS_BEFORE_REPLACING: u32 = 3;

fn create(cfg: &ClientConfig, context: LogContext) -> Result<KafkaProducer, Fatal> {
    cfg.create_with_context(context).map_err(|e| match e {
        KafkaError::ClientConfig(_, desc, key, value) => Fatal::usage(format!(
            "invalid Kafka property {key}: {}",
            without_value(&desc, &value)
        )),
        KafkaError::ClientCreation(desc) => {
            Fatal::usage(format!("cannot create the Kafka producer: {desc}"))
        }
        other => Fatal::usage(format!("cannot create the Kafka producer: {other}")),
    })
}

/// librdkafka's complaint about a property with its value (`Invalid value "…" for ...`) left
/// out: the value may be a secret.
fn without_value(desc: &str, value: &str) -> String {
    if value.is_empty() {
        return desc.to_string();
    }
    desc.replace(&format!("\"{value}\""), "(value not shown)")
}

/// A failed publish of `ev`, and the producer's replacement when the error made it unusable.
fn failure(ev: &Event, e: KafkaError) -> (Outcome, Option<Replaced>) {
    let error = PublishError {
        topic: ev.topic.clone(),
        source: e.into(),
    };
    let unusable = error.producer_unusable().then(|| Replaced {
        reason: if error.code() == Some(RDKafkaErrorCode::Fatal) {
            ReplaceReason::Fatal
        } else {
            ReplaceReason::Fenced
        },
        detail: error.to_string(),
    });
    (Outcome::Failed(error), unusable)
}

impl Publisher {
    /// Builds `lanes` producers: idempotent with the gapless guarantee, acks=all, linger.ms=0,
    /// message.timeout.ms = send timeout, the Java client's partitioner, statistics every 15 s,
    /// then the user's properties on top. Nothing is connected yet.
    pub fn new(
        brokers: &str,
        send_timeout: Duration,
        properties: &[(String, String)],
        lanes: usize,
        metrics: Arc<KafkaMetrics>,
    ) -> Result<Publisher, Fatal> {
        let mut cfg = ClientConfig::new();
        cfg.set("bootstrap.servers", brokers)
            .set("client.id", defaults::CLIENT_ID)
            .set("enable.idempotence", "true")
            // A request rejected for good raises a fatal error instead of an epoch bump that
            // sends the partition's later batches on: with one request in flight, a key's later
            // event never overtakes a rejected one. The producer is replaced after it.
            .set("enable.gapless.guarantee", "true")
            .set("max.in.flight.requests.per.connection", "1")
            .set("acks", defaults::ACKS)
            // A round waits for every delivery report before it acks, and hands the whole
            // batch to librdkafka at once (so it batches anyway): lingering only delays the
            // round. Measured on the 2-core box: idle commit-to-ack 24 ms -> 12 ms, drain rate
            // equal or better. Override with --kafka-property linger.ms=N.
            .set("linger.ms", defaults::LINGER_MS.to_string())
            // A produce request is one small write: Nagle's algorithm would hold it back until
            // the previous segment is acknowledged.
            .set("socket.nagle.disable", "true")
            .set(
                "message.timeout.ms",
                send_timeout.as_millis().max(1).to_string(),
            )
            // A topic missing from the cluster fails its messages with UnknownTopic (the event's
            // fault: counted, dead-lettered in the end) only after this wait; librdkafka's 30 s
            // default would let the send timeout hit first, and a timeout is the broker's fault
            // (released, never dead-lettered), so a typo in a topic would retry forever.
            .set(
                "topic.metadata.propagation.max.ms",
                (send_timeout / 2).as_millis().max(1).to_string(),
            )
            .set("partitioner", defaults::PARTITIONER)
            .set(
                "statistics.interval.ms",
                defaults::STATISTICS_INTERVAL_MS.to_string(),
            );
        for (k, v) in properties {
            cfg.set(k, v);
        }
        cfg.set_log_level(crate::logging::librdkafka_log_level());
        let mut publisher = Publisher {
            config: cfg,
            metrics,
            partitions: Arc::default(),
            lanes: Vec::with_capacity(lanes),
            send_timeout,
            missing_topics: Mutex::new(BTreeSet::new()),
        };
        for lane in 0..lanes.max(1) {
            let producer = create(&publisher.config, publisher.context(lane))?;
            publisher.lanes.push(Lane {
                producer: RwLock::new(Arc::new(producer)),
                timed_out_rounds: AtomicU32::new(0),
            });
        }
        Ok(publisher)
    }

    fn context(&self, lane: usize) -> LogContext {
        LogContext {
            metrics: self.metrics.clone(),
            partitions: self.partitions.clone(),
            lane,
        }
    }

    fn current(&self, lane: usize) -> Arc<KafkaProducer> {
        self.lanes[lane]
            .producer
            .read()
            .expect("producer lock")
            .clone()
    }

    /// Publishes a round: `events[i]`'s outcome at `i`, within about twice the send timeout. A
    /// key's next event goes out only after the previous one's delivery report (librdkafka can
    /// fail an earlier event yet send a later one). Unusable producers are replaced and returned.
    pub async fn publish(&self, events: &[Event]) -> (Vec<Outcome>, Vec<Replaced>) {
        let producers: Vec<_> = (0..self.lanes.len()).map(|l| self.current(l)).collect();
        // The look at missing topics counts toward the send timeout: a round stays within two.
        let start = Instant::now();
        self.recheck_missing_topics(&producers, events).await;
        let producers = &producers;
        let sent = join_all(chains(events).into_iter().map(|c| {
            let first = c[0].1;
            let l = lane_of(first, self.partitions.get(&first.topic), producers.len());
            async move { (l, self.send_chain(&producers[l], c, start).await) }
        }))
        .await;
        let mut results = vec![(Outcome::NotSent, None); events.len()];
        let mut by_lane = vec![Vec::new(); producers.len()];
        for (l, chain) in sent {
            for (i, r) in chain {
                by_lane[l].push(i);
                results[i] = r;
            }
        }
        self.note_missing_topics(&results);
        let mut replaced = Vec::new();
        for (l, indexes) in by_lane.iter().enumerate().filter(|(_, ix)| !ix.is_empty()) {
            let lane_results: Vec<_> = indexes.iter().map(|&i| &results[i]).collect();
            if let Some(why) = self.broken(l, &producers[l], &lane_results) {
                if self.replace(l, &producers[l]).is_some() {
                    replaced.push(why);
                }
            }
        }
        let outcomes = results.into_iter().map(|(o, _)| o).collect();
        (outcomes, replaced)
    }

    /// Why lane `l`'s producer is unusable after its share of a round, if it is.
    fn broken(
        &self,
        l: usize,
        producer: &KafkaProducer,
        results: &[&(Outcome, Option<Replaced>)],
    ) -> Option<Replaced> {
        results
            .iter()
            .find_map(|(_, u)| u.clone())
            .or_else(|| {
                producer
                    .client()
                    .fatal_error()
                    .map(|(code, reason)| Replaced {
                        reason: ReplaceReason::Fatal,
                        detail: format!("fatal error {code:?}: {reason}"),
                    })
            })
            .or_else(|| self.note_timeouts(l, results))
    }

    /// Publishes a chain (one ordered key's events, or one other event) one event after the
    /// other: the first failure ends it, the rest is `NotSent`. An event whose turn comes after
    /// the send timeout is not sent either: it fails as timed out (released, no attempt counted).
    async fn send_chain(
        &self,
        producer: &KafkaProducer,
        chain: Vec<(usize, &Event)>,
        start: Instant,
    ) -> Vec<(usize, (Outcome, Option<Replaced>))> {
        let mut out = Vec::with_capacity(chain.len());
        let mut failed = false;
        for (i, ev) in chain {
            let result = if failed {
                (Outcome::NotSent, None)
            } else if start.elapsed() >= self.send_timeout {
                failure(
                    ev,
                    KafkaError::MessageProduction(RDKafkaErrorCode::MessageTimedOut),
                )
            } else {
                self.send(producer, ev, start).await
            };
            failed = !matches!(result.0, Outcome::Delivered { .. });
            out.push((i, result));
        }
        out
    }

    /// Hands one event to librdkafka and waits for its delivery report.
    async fn send(
        &self,
        producer: &KafkaProducer,
        ev: &Event,
        start: Instant,
    ) -> (Outcome, Option<Replaced>) {
        let delivery = match self.enqueue(producer, ev, start).await {
            Ok(delivery) => delivery,
            Err(e) => return failure(ev, e),
        };
        let handed = start.elapsed();
        match delivery.await {
            Ok(Ok(_)) => (
                Outcome::Delivered {
                    handed,
                    delivered: start.elapsed(),
                },
                None,
            ),
            Ok(Err((e, _msg))) => failure(ev, e),
            Err(_canceled) => failure(ev, KafkaError::Canceled),
        }
    }

    /// Queues one message, waiting for room in librdkafka's queue until the send timeout.
    async fn enqueue(
        &self,
        producer: &KafkaProducer,
        ev: &Event,
        start: Instant,
    ) -> Result<DeliveryFuture, KafkaError> {
        let mut record: FutureRecord<'_, str, str> = FutureRecord::to(&ev.topic)
            .payload(ev.payload.as_str())
            .headers(build_headers(ev))
            .timestamp(ev.created_at_ms);
        if let Some(k) = &ev.key {
            record = record.key(k.as_str());
        }
        loop {
            match producer.send_result(record) {
                Ok(delivery) => return Ok(delivery),
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back))
                    if start.elapsed() < self.send_timeout =>
                {
                    record = back;
                    tokio::time::sleep(QUEUE_FULL_PAUSE).await;
                }
                Err((e, _)) => return Err(e),
            }
        }
    }

    /// Asks the cluster again about the batch's topics that were missing, through every producer
    /// (each keeps its own metadata): one request per such topic and producer, all at once.
    async fn recheck_missing_topics(&self, producers: &[Arc<KafkaProducer>], events: &[Event]) {
        let suspects: Vec<String> = {
            let missing = self.missing_topics.lock().expect("missing topics");
            let batch: BTreeSet<&str> = events.iter().map(|e| e.topic.as_str()).collect();
            batch
                .into_iter()
                .filter(|t| missing.contains(*t))
                .map(str::to_owned)
                .collect()
        };
        let looks = suspects.into_iter().map(|topic| async move {
            let seen = join_all(
                producers
                    .iter()
                    .map(|p| topic_exists(p.clone(), topic.clone(), self.send_timeout)),
            )
            .await;
            (topic, seen.into_iter().all(|exists| exists))
        });
        for (topic, exists) in join_all(looks).await {
            if exists {
                tracing::info!(topic = %topic, "topic exists now");
                self.missing_topics
                    .lock()
                    .expect("missing topics")
                    .remove(&topic);
            }
        }
    }

    fn note_missing_topics(&self, results: &[(Outcome, Option<Replaced>)]) {
        let mut missing = self.missing_topics.lock().expect("missing topics");
        for (o, _) in results {
            if let Outcome::Failed(e) = o {
                if matches!(
                    e.code(),
                    Some(
                        RDKafkaErrorCode::UnknownTopic | RDKafkaErrorCode::UnknownTopicOrPartition
                    )
                ) {
                    missing.insert(e.topic.clone());
                }
            }
        }
    }

    /// Counts a lane's rounds that only timed out; names the reason once there were too many in
    /// a row.
    fn note_timeouts(
        &self,
        l: usize,
        results: &[&(Outcome, Option<Replaced>)],
    ) -> Option<Replaced> {
        let streak = &self.lanes[l].timed_out_rounds;
        if !only_timed_out(results.iter().map(|(o, _)| o)) {
            streak.store(0, Ordering::Relaxed);
            return None;
        }
        let rounds = streak.fetch_add(1, Ordering::Relaxed) + 1;
        (rounds >= TIMED_OUT_ROUNDS_BEFORE_REPLACING).then(|| {
            streak.store(0, Ordering::Relaxed);
            Replaced {
                reason: ReplaceReason::Timeouts,
                detail: format!(
                    "{rounds} rounds in a row without a delivery, every failure a timeout"
                ),
            }
        })
    }

    /// Swaps in a new producer for lane `l` unless another claim loop already did. Returns
    /// `Some` when this call replaced it.
    fn replace(&self, l: usize, old: &Arc<KafkaProducer>) -> Option<()> {
        let mut cur = self.lanes[l].producer.write().expect("producer lock");
        if !Arc::ptr_eq(&cur, old) {
            return None;
        }
        match create(&self.config, self.context(l)) {
            Ok(p) => {
                *cur = Arc::new(p);
                Some(())
            }
            Err(e) => {
                tracing::error!("cannot create a replacement Kafka producer: {}", e.message);
                None
            }
        }
    }

    /// One metadata request (brokers, topics known), answered within `timeout` or an error.
    pub async fn metadata(&self, timeout: Duration) -> Result<(usize, usize), String> {
        let producer = self.current(0);
        tokio::task::spawn_blocking(move || {
            producer
                .client()
                .fetch_metadata(None, timeout)
                .map(|md| (md.brokers().len(), md.topics().len()))
                .map_err(|e| e.to_string())
        })
        .await
        .map_err(|e| e.to_string())?
    }
}

#[async_trait::async_trait]
impl Sink for Publisher {
    fn name(&self) -> &'static str {
        crate::cli::SinkKind::Kafka.broker_name()
    }

    async fn publish(&self, events: &[Event]) -> (Vec<Outcome>, Vec<Replaced>) {
        Publisher::publish(self, events).await
    }

    async fn health(&self, timeout: Duration) -> Result<String, String> {
        match self.metadata(timeout).await? {
            (0, _) => Err("the answer lists no broker (a broker shutting down answers so)".into()),
            (brokers, topics) => Ok(format!("{brokers} brokers, {topics} topics")),
        }
    }

    /// librdkafka (2.10 on) forgets every broker it knows when a metadata answer lists none, as a
    /// broker gives while it shuts down, and then never connects again (librdkafka issue 5301):
    /// only a new producer, starting from `bootstrap.servers`, finds the broker.
    /// Every lane is replaced: each may have heard the empty answer.
    async fn reconnect(&self) -> Vec<Replaced> {
        (0..self.lanes.len())
            .filter(|&l| self.replace(l, &self.current(l)).is_some())
            .map(|_| Replaced {
                reason: ReplaceReason::Unreachable,
                detail: "a health request to the broker failed".into(),
            })
            .collect()
    }

    async fn flush(&self) {
        let timeout = self.send_timeout;
        let flushes = (0..self.lanes.len()).map(|l| {
            let producer = self.current(l);
            tokio::task::spawn_blocking(move || producer.flush(Timeout::After(timeout)))
        });
        for flushed in join_all(flushes).await {
            if let Ok(Err(e)) = flushed {
                tracing::warn!("flushing the producer: {e}");
            }
        }
    }
}

/// A round that delivered nothing and failed only by timeouts. Events held back behind a failure
/// of their key (`NotSent`) say nothing of the producer, so they neither count nor end a streak.
fn only_timed_out<'a>(outcomes: impl IntoIterator<Item = &'a Outcome>) -> bool {
    let mut timed_out = false;
    for o in outcomes {
        match o {
            Outcome::Failed(e) if e.timed_out() => timed_out = true,
            Outcome::NotSent => {}
            _ => return false,
        }
    }
    timed_out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_round_of_timeouts_counts_though_its_keys_held_events_back() {
        let timed_out = || {
            Outcome::Failed(PublishError {
                topic: "orders".into(),
                source: KafkaError::MessageProduction(RDKafkaErrorCode::MessageTimedOut).into(),
            })
        };
        let delivered = Outcome::Delivered {
            handed: Duration::ZERO,
            delivered: Duration::ZERO,
        };
        // Two keys, each failed by a timeout, each with a later event held back.
        let keyed = [timed_out(), Outcome::NotSent, timed_out(), Outcome::NotSent];
        assert!(only_timed_out(&keyed));
        assert!(!only_timed_out(&[timed_out(), delivered]));
        assert!(!only_timed_out(&[Outcome::NotSent]));
        assert!(!only_timed_out(&[]));
    }

    #[test]
    fn a_refused_property_value_is_not_repeated() {
        let d = without_value(
            r#"Invalid value "s3cr3t" for configuration property "sasl.mechanism""#,
            "s3cr3t",
        );
        assert_eq!(
            d,
            r#"Invalid value (value not shown) for configuration property "sasl.mechanism""#
        );
        assert_eq!(without_value("No such property", ""), "No such property");
    }
}
