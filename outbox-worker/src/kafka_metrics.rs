//! librdkafka's statistics (every `statistics.interval.ms`) as Prometheus gauges: per broker
//! connection state and round-trip time, the producer's queue depth. Also the `build_info`
//! gauge and librdkafka's build, which operators need when a broker feature (a compression codec,
//! a SASL mechanism) is refused.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

use prometheus::{Gauge, GaugeVec, IntGauge, IntGaugeVec, Opts, Registry};
use rdkafka::statistics::Statistics;

pub struct KafkaMetrics {
    /// Each lane's last report, by lane: the gauges sum or combine them.
    reports: Mutex<BTreeMap<usize, LaneReport>>,
    /// The brokers the gauges have: their series are removed once no report has them.
    brokers: Mutex<BTreeSet<String>>,
    broker_up: IntGaugeVec,
    rtt_avg: GaugeVec,
    rtt_p99: GaugeVec,
    queue_messages: IntGauge,
    queue_bytes: IntGauge,
    stats_time: Gauge,
}

/// One broker as producers see it.
#[derive(Clone, Copy, Default)]
struct BrokerState {
    up: bool,
    /// Round-trip time (average, p99, seconds) of the last window that had requests.
    rtt: Option<(f64, f64)>,
}

impl BrokerState {
    /// Over several producers: up when one is connected, the slowest round trips.
    fn merge(self, other: BrokerState) -> BrokerState {
        let rtt = match (self.rtt, other.rtt) {
            (Some(a), Some(b)) => Some((a.0.max(b.0), a.1.max(b.1))),
            (a, b) => a.or(b),
        };
        BrokerState {
            up: self.up || other.up,
            rtt,
        }
    }
}

/// What one producer's statistics said.
#[derive(Default)]
struct LaneReport {
    brokers: BTreeMap<String, BrokerState>,
    messages: u64,
    bytes: u64,
    time: i64,
}

impl LaneReport {
    /// A producer's report; a broker idle in this window keeps `before`'s round-trip times.
    fn of(s: &Statistics, before: Option<&LaneReport>) -> LaneReport {
        let mut brokers = BTreeMap::new();
        for b in s.brokers.values() {
            // librdkafka's internal pseudo-broker (partitions without a leader) has no connection.
            if b.source == "internal" {
                continue;
            }
            // librdkafka reports microseconds.
            let rtt = match b.rtt.as_ref().filter(|w| w.cnt > 0) {
                Some(w) => Some((w.avg as f64 / 1e6, w.p99 as f64 / 1e6)),
                None => before.and_then(|r| r.brokers.get(&b.name)?.rtt),
            };
            let up = b.state == "UP";
            brokers.insert(b.name.clone(), BrokerState { up, rtt });
        }
        LaneReport {
            brokers,
            messages: s.msg_cnt,
            bytes: s.msg_size,
            time: s.time,
        }
    }
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
            reports: Mutex::new(BTreeMap::new()),
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

    /// One statistics report of lane `lane`'s producer. Over lanes: a broker is up when a lane's
    /// connection is, its RTT is the slowest lane's, queues add up, the timestamp is the oldest.
    /// Brokers no lane reports drop out; an idle window keeps the last RTT (0 reads as perfect).
    pub fn update(&self, lane: usize, s: &Statistics) {
        let mut reports = self.reports.lock().expect("reports lock");
        let report = LaneReport::of(s, reports.get(&lane));
        reports.insert(lane, report);
        let mut brokers: BTreeMap<&str, BrokerState> = BTreeMap::new();
        for r in reports.values() {
            for (name, &state) in &r.brokers {
                let b = brokers.entry(name.as_str()).or_default();
                *b = b.merge(state);
            }
        }
        for (name, b) in &brokers {
            let name = [*name];
            self.broker_up.with_label_values(&name).set(i64::from(b.up));
            if let Some((avg, p99)) = b.rtt {
                self.rtt_avg.with_label_values(&name).set(avg);
                self.rtt_p99.with_label_values(&name).set(p99);
            }
        }
        let seen: BTreeSet<String> = brokers.keys().map(|b| b.to_string()).collect();
        let mut known = self.brokers.lock().expect("brokers lock");
        for gone in known.difference(&seen) {
            let name = [gone.as_str()];
            let _ = self.broker_up.remove_label_values(&name);
            let _ = self.rtt_avg.remove_label_values(&name);
            let _ = self.rtt_p99.remove_label_values(&name);
        }
        *known = seen;
        let sum = |f: fn(&LaneReport) -> u64| reports.values().map(f).sum::<u64>();
        let gauge = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        self.queue_messages.set(gauge(sum(|r| r.messages)));
        self.queue_bytes.set(gauge(sum(|r| r.bytes)));
        // `time` is librdkafka's wall clock in seconds.
        let oldest = reports.values().map(|r| r.time).min().unwrap_or(s.time);
        self.stats_time.set(oldest as f64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_broker_is_up_when_one_producer_is_connected_and_as_slow_as_the_slowest() {
        let a = BrokerState {
            up: false,
            rtt: Some((0.002, 0.010)),
        };
        let b = BrokerState {
            up: true,
            rtt: Some((0.004, 0.008)),
        };
        let m = a.merge(b);
        assert!(m.up);
        assert_eq!(m.rtt, Some((0.004, 0.010)));
        let idle = BrokerState::default();
        assert_eq!(idle.merge(a).rtt, a.rtt);
        assert!(!idle.merge(a).up);
    }
}
