//! librdkafka's statistics (every `statistics.interval.ms`) as Prometheus gauges: per broker
//! connection state and round-trip time, the producer's queue depth. Also the `build_info`
//! gauge and librdkafka's build, which operators need when a broker feature (a compression codec,
//! a SASL mechanism) is refused.

use std::collections::BTreeSet;
use std::sync::Mutex;

use prometheus::{Gauge, GaugeVec, IntGauge, IntGaugeVec, Opts, Registry};
use rdkafka::statistics::Statistics;

pub struct KafkaMetrics {
    /// The brokers of the last report: their series are removed once a report no longer has them.
    brokers: Mutex<BTreeSet<String>>,
    broker_up: IntGaugeVec,
    rtt_avg: GaugeVec,
    rtt_p99: GaugeVec,
    queue_messages: IntGauge,
    queue_bytes: IntGauge,
    stats_time: Gauge,
}

/// librdkafka's version string and its `builtin.features` (e.g. `gzip,snappy,ssl,sasl,…`).
pub fn librdkafka_build() -> (String, String) {
    let (_, version) = rdkafka::util::get_rdkafka_version();
    let features = rdkafka::ClientConfig::new()
        .create_native_config()
        .and_then(|c| c.get("builtin.features"))
        .unwrap_or_else(|e| format!("unknown ({e})"));
    (version, features)
}

fn register<C: prometheus::core::Collector + Clone + 'static>(r: &Registry, c: C) -> C {
    r.register(Box::new(c.clone())).expect("unique metric");
    c
}

impl KafkaMetrics {
    /// Registers the gauges, and sets `outbox_relay_build_info` once.
    pub fn register(r: &Registry) -> KafkaMetrics {
        let per_broker = |name: &str, help: &str| {
            register(
                r,
                GaugeVec::new(Opts::new(name, help), &["broker"]).expect("valid metric"),
            )
        };
        let build_info = register(
            r,
            IntGaugeVec::new(
                Opts::new(
                    "outbox_relay_build_info",
                    "Always 1; the relay's version and the librdkafka it is built with",
                ),
                &["version", "rdkafka_version"],
            )
            .expect("valid metric"),
        );
        let (rdkafka_version, _) = librdkafka_build();
        build_info
            .with_label_values(&[env!("CARGO_PKG_VERSION"), rdkafka_version.as_str()])
            .set(1);
        KafkaMetrics {
            brokers: Mutex::new(BTreeSet::new()),
            broker_up: register(
                r,
                IntGaugeVec::new(
                    Opts::new(
                        "outbox_kafka_broker_up",
                        "1 when the producer's connection to the broker is up (librdkafka state UP)",
                    ),
                    &["broker"],
                )
                .expect("valid metric"),
            ),
            rtt_avg: per_broker(
                "outbox_kafka_broker_rtt_avg_seconds",
                "Average request round-trip time to the broker over the last statistics window",
            ),
            rtt_p99: per_broker(
                "outbox_kafka_broker_rtt_p99_seconds",
                "99th percentile request round-trip time to the broker over the last window",
            ),
            queue_messages: register(
                r,
                IntGauge::new(
                    "outbox_kafka_queue_messages",
                    "Messages in the producer's queue, not yet acknowledged by the broker",
                )
                .expect("valid metric"),
            ),
            queue_bytes: register(
                r,
                IntGauge::new(
                    "outbox_kafka_queue_bytes",
                    "Bytes of the messages in the producer's queue",
                )
                .expect("valid metric"),
            ),
            stats_time: register(
                r,
                Gauge::new(
                    "outbox_kafka_statistics_timestamp_seconds",
                    "When librdkafka last reported its statistics (Unix time; stale means the \
                     producer is stuck or statistics.interval.ms=0)",
                )
                .expect("valid metric"),
            ),
        }
    }

    /// One statistics report. Brokers that are gone (a replaced producer, a broker removed from
    /// the cluster) drop out instead of keeping their last value. A round-trip time is only
    /// updated by a window that had requests: an idle producer keeps its last measurement
    /// rather than reporting 0, which would read as a perfect broker.
    pub fn update(&self, s: &Statistics) {
        let mut seen = BTreeSet::new();
        for b in s.brokers.values() {
            // librdkafka's internal pseudo-broker (partitions without a leader) has no connection.
            if b.source == "internal" {
                continue;
            }
            let name = [b.name.as_str()];
            self.broker_up
                .with_label_values(&name)
                .set(i64::from(b.state == "UP"));
            if let Some(rtt) = b.rtt.as_ref().filter(|w| w.cnt > 0) {
                // librdkafka reports microseconds.
                self.rtt_avg
                    .with_label_values(&name)
                    .set(rtt.avg as f64 / 1e6);
                self.rtt_p99
                    .with_label_values(&name)
                    .set(rtt.p99 as f64 / 1e6);
            }
            seen.insert(b.name.clone());
        }
        let mut known = self.brokers.lock().expect("brokers lock");
        for gone in known.difference(&seen) {
            let name = [gone.as_str()];
            let _ = self.broker_up.remove_label_values(&name);
            let _ = self.rtt_avg.remove_label_values(&name);
            let _ = self.rtt_p99.remove_label_values(&name);
        }
        *known = seen;
        self.queue_messages
            .set(i64::try_from(s.msg_cnt).unwrap_or(i64::MAX));
        self.queue_bytes
            .set(i64::try_from(s.msg_size).unwrap_or(i64::MAX));
        // `time` is librdkafka's wall clock in seconds.
        self.stats_time.set(s.time as f64);
    }
}
