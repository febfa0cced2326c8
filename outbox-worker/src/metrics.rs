//! Prometheus metrics and a minimal HTTP endpoint: `GET /metrics`, and the health endpoints
//! `/live`, `/ready` and `/health` (state in `health.rs`).

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus::{
    exponential_buckets, Encoder, Gauge, Histogram, HistogramOpts, HistogramVec, IntCounter,
    IntCounterVec, IntGauge, Opts, Registry, TextEncoder,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::health::Health;
use crate::sink::{ReplaceReason, Replaced};
use crate::Fatal;

pub struct Metrics {
    pub registry: Registry,
    /// By `topic`: the events an ack settled (the ids `outbox_ack_returning` returned).
    pub published: IntCounterVec,
    /// Delivered events an ack found no longer held (reclaimed, or acked by a lost try).
    pub stale_acks: IntCounter,
    /// By `topic` and `class` (permanent: counted as an attempt; transient: released; unknown:
    /// released within the grace, then counted).
    pub failed: IntCounterVec,
    /// By librdkafka's `code` name and `class`.
    pub publish_errors: IntCounterVec,
    /// By `topic`.
    pub dead_lettered: IntCounterVec,
    pub broker_circuit_open: IntGauge,
    pub reclaimed: IntCounter,
    pub database_errors: IntCounter,
    /// By `reason` (fenced, fatal, timeouts; every reason exported from the start, at 0).
    pub producer_replaced: IntCounterVec,
    /// Failed publishes blamed on the producer itself (each also in `failed`).
    pub producer_failures: IntCounter,
    pub claim_batch_size: Histogram,
    pub publish_latency: Histogram,
    /// Per acked event, by `stage`: where its time in the relay went.
    pub stage: HistogramVec,
    pub commit_to_ack_lag: Histogram,
    pub backlog: IntGauge,
    pub delayed: IntGauge,
    pub sending: IntGauge,
    pub dead_letters: IntGauge,
    pub oldest_due_age: Gauge,
    pub blocked_keys: IntGauge,
    pub oldest_blocked_age: Gauge,
    pub oldest_lease_age: Gauge,
    pub health: Health,
    /// The topics that have a `topic` label of their own (see [`Metrics::topic_label`]).
    labelled_topics: Mutex<BTreeSet<String>>,
}

/// The `topic` label of every topic past the first [`MAX_TOPIC_LABELS`]: parentheses are not
/// allowed in Kafka topic names, so no topic has it.
pub const OTHER_TOPICS: &str = "(other)";

/// Buckets of `outbox_event_stage_seconds`: fine below 10 ms, where a healthy relay's stages are.
const STAGE_BUCKETS: [f64; 20] = [
    0.0001, 0.0002, 0.0005, 0.001, 0.0015, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.02,
    0.03, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0,
];

/// How many topics get a `topic` label of their own.
pub const MAX_TOPIC_LABELS: usize = 100;

fn counter(r: &Registry, name: &str, help: &str) -> IntCounter {
    let c = IntCounter::new(name, help).expect("valid metric");
    r.register(Box::new(c.clone())).expect("unique metric");
    c
}

fn counter_vec(r: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    let c = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
    r.register(Box::new(c.clone())).expect("unique metric");
    c
}

fn int_gauge(r: &Registry, name: &str, help: &str) -> IntGauge {
    let g = IntGauge::new(name, help).expect("valid metric");
    r.register(Box::new(g.clone())).expect("unique metric");
    g
}

fn gauge(r: &Registry, name: &str, help: &str) -> Gauge {
    let g = Gauge::new(name, help).expect("valid metric");
    r.register(Box::new(g.clone())).expect("unique metric");
    g
}

fn histogram(r: &Registry, name: &str, help: &str, buckets: Vec<f64>) -> Histogram {
    let h = Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets))
        .expect("valid metric");
    r.register(Box::new(h.clone())).expect("unique metric");
    h
}

impl Metrics {
    /// `health` is the state the health endpoints read.
    pub fn new(health: Health) -> Arc<Metrics> {
        Metrics::in_registry(health, Registry::new())
    }

    /// Counts and logs a `broker` client replaced by a new one: `info` for a failed health
    /// request (routine during an outage, whose breaker already warns), `warn` otherwise.
    pub fn client_replaced(&self, broker: &str, replaced: &Replaced) {
        let reason = replaced.reason.label();
        self.producer_replaced.with_label_values(&[reason]).inc();
        let line = format!(
            "the {broker} producer was replaced by a new one ({}); events not delivered are retried",
            replaced.detail
        );
        match replaced.reason {
            ReplaceReason::Unreachable => tracing::info!(reason, "{line}"),
            _ => tracing::warn!(reason, "{line}"),
        }
    }

    /// The metrics registered in `r` (one with a `database` label per database of a fleet).
    pub fn in_registry(health: Health, r: Registry) -> Arc<Metrics> {
        Arc::new(Metrics {
            published: counter_vec(
                &r,
                "outbox_published_total",
                "Events the broker acknowledged and this relay's ack settled in the outbox",
                &["topic"],
            ),
            stale_acks: counter(
                &r,
                "outbox_stale_acks_total",
                "Events the broker acknowledged that this relay's ack found no longer held: \
                 reclaimed (its lease expired or its heartbeat ran out; published again), or \
                 acked by an earlier try whose reply was lost",
            ),
            failed: counter_vec(
                &r,
                "outbox_failed_total",
                "Failed publishes; class=permanent: the event's fault, nacked (an attempt counted); \
                 class=transient: the broker's, released (no attempt counted); class=unknown: a \
                 code the relay does not classify, released a few times per event, then counted",
                &["topic", "class"],
            ),
            publish_errors: counter_vec(
                &r,
                "outbox_publish_errors_total",
                "Failed publishes by librdkafka's error code name (code) and how the relay \
                 classifies it (class: permanent, transient, unknown)",
                &["code", "class"],
            ),
            dead_lettered: counter_vec(
                &r,
                "outbox_dead_lettered_total",
                "Events that this relay's nack or reclaim moved to FAIL (retries exhausted)",
                &["topic"],
            ),
            broker_circuit_open: int_gauge(
                &r,
                "outbox_broker_circuit_open",
                "1 while the broker is unreachable and the relay does not claim (circuit breaker open)",
            ),
            reclaimed: counter(
                &r,
                "outbox_reclaimed_total",
                "Expired leases reclaimed by this relay",
            ),
            database_errors: counter(
                &r,
                "outbox_database_errors_total",
                "Failed database calls (claim, ack, nack, reclaim, stats)",
            ),
            producer_replaced: {
                let c = counter_vec(
                    &r,
                    "outbox_producer_replaced_total",
                    "Kafka producers replaced by a new one; reason=fenced: a \
                     delivery report rejected its id, epoch or sequence; fatal: librdkafka raised a \
                     fatal error; timeouts: rounds in a row that delivered nothing and only \
                     timed out; unreachable: a health request to the broker failed",
                    &["reason"],
                );
                // Exported at 0 from the start: a scraper tells "never" from "not exported".
                for reason in ReplaceReason::ALL {
                    c.with_label_values(&[reason.label()]);
                }
                c
            },
            producer_failures: counter(
                &r,
                "outbox_producer_failures_total",
                "Failed publishes blamed on the producer itself (fenced, epoch or sequence \
                 rejected, fatal error): released, and the producer replaced",
            ),
            claim_batch_size: histogram(
                &r,
                "outbox_claim_batch_size",
                "Events per claim that returned at least one event",
                vec![
                    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0,
                    10000.0,
                ],
            ),
            publish_latency: histogram(
                &r,
                "outbox_publish_latency_seconds",
                "From handing an event to the producer to its successful delivery report",
                exponential_buckets(0.0005, 2.0, 16).expect("valid buckets"),
            ),
            stage: {
                let h = HistogramVec::new(
                    HistogramOpts::new(
                        "outbox_event_stage_seconds",
                        "Where each acked event's time in the relay went: stage=claim (the claim \
                         call that took it), handoff (claim returned to handed to the broker's \
                         client), delivery (handed to acknowledged by the broker), ack (broker's \
                         acknowledgement to outbox_ack returned)",
                    )
                    .buckets(STAGE_BUCKETS.to_vec()),
                    &["stage"],
                )
                .expect("valid metric");
                r.register(Box::new(h.clone())).expect("unique metric");
                h
            },
            commit_to_ack_lag: histogram(
                &r,
                "outbox_commit_to_ack_lag_seconds",
                "From the event's created_at to its ack (database clock at claim + relay time)",
                exponential_buckets(0.001, 2.5, 16).expect("valid buckets"),
            ),
            backlog: int_gauge(
                &r,
                "outbox_backlog_events",
                "Due WAIT events (outbox_stats().due_wait)",
            ),
            delayed: int_gauge(
                &r,
                "outbox_delayed_events",
                "WAIT events not yet due (backoff or deliver_at)",
            ),
            sending: int_gauge(&r, "outbox_sending_events", "Events currently claimed"),
            dead_letters: int_gauge(
                &r,
                "outbox_dead_letter_events",
                "FAIL events in the outbox (dead letters)",
            ),
            oldest_due_age: gauge(
                &r,
                "outbox_oldest_due_age_seconds",
                "Age of the oldest due WAIT event (0 when none)",
            ),
            oldest_lease_age: gauge(
                &r,
                "outbox_oldest_lease_age_seconds",
                "Age of the oldest lease (0 when none)",
            ),
            blocked_keys: int_gauge(
                &r,
                "outbox_blocked_keys",
                "Keys held back by a dead head event (outbox.head_of_line = block)",
            ),
            oldest_blocked_age: gauge(
                &r,
                "outbox_oldest_blocked_age_seconds",
                "Time since the oldest blocking head event became a dead letter (0 when none)",
            ),
            registry: r,
            health,
            labelled_topics: Mutex::default(),
        })
    }

    /// `topic`, or [`OTHER_TOPICS`] once [`MAX_TOPIC_LABELS`] other topics have a label: a
    /// producer that writes to ever new topics must not grow the metrics without bound.
    pub fn topic_label(&self, topic: &str) -> String {
        let mut labelled = self.labelled_topics.lock().expect("topic labels");
        if labelled.contains(topic) || labelled.len() < MAX_TOPIC_LABELS {
            labelled.insert(topic.to_string());
            topic.to_string()
        } else {
            OTHER_TOPICS.to_string()
        }
    }

    pub fn db_result<T, E>(&self, r: &Result<T, E>) {
        self.health.db_result(r.is_ok());
        if r.is_err() {
            self.database_errors.inc();
        }
    }

    pub fn render(&self) -> String {
        render_all(&[&self.registry])
    }
}

/// What the endpoints serve: one relay's [`Metrics`], or a fleet's (`fleet.rs`).
pub trait Status: Send + Sync + 'static {
    /// The Prometheus text of `/metrics`.
    fn render(&self) -> String;
    /// `/live`: `Err(why)` answers 503.
    fn live(&self) -> Result<(), String>;
    /// `/ready`: `Ok(body)` answers 200 (the body may name a degraded database), `Err` 503.
    fn ready(&self) -> Result<String, String>;
    /// `/health`: the database(s) alone.
    fn health(&self) -> Result<(), String>;
}

impl Status for Metrics {
    fn render(&self) -> String {
        Metrics::render(self)
    }
    fn live(&self) -> Result<(), String> {
        self.health.live()
    }
    fn ready(&self) -> Result<String, String> {
        self.health.ready().map(|()| "ok\n".to_string())
    }
    fn health(&self) -> Result<(), String> {
        match (self.health.stopping(), self.health.db_ok()) {
            (true, _) => Err("stopping".into()),
            (false, true) => Ok(()),
            (false, false) => Err("database unreachable".into()),
        }
    }
}

/// Prometheus text of several registries, the series of a name under one family (a fleet's
/// databases each register the same names with their own `database` label).
pub fn render_all(registries: &[&Registry]) -> String {
    let mut families: Vec<prometheus::proto::MetricFamily> = Vec::new();
    for mut f in registries.iter().flat_map(|r| r.gather()) {
        match families.iter_mut().find(|g| g.name() == f.name()) {
            Some(g) => g.mut_metric().extend(f.take_metric()),
            None => families.push(f),
        }
    }
    families.sort_by(|a, b| a.name().cmp(b.name()));
    let mut buf = Vec::new();
    TextEncoder::new()
        .encode(&families, &mut buf)
        .expect("text encoding");
    String::from_utf8(buf).expect("utf-8")
}

/// The pause after a failed accept.
const ACCEPT_RETRY: Duration = Duration::from_millis(100);

/// Binds the address now (so a bad address fails start-up) and serves until cancelled.
pub async fn serve(
    addr: SocketAddr,
    metrics: Arc<dyn Status>,
    cancel: CancellationToken,
) -> Result<tokio::task::JoinHandle<()>, Fatal> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|e| Fatal::usage(format!("cannot listen on --metrics-addr {addr}: {e}")))?;
    // Port 0 picks a free port: say which.
    let addr = listener.local_addr().unwrap_or(addr);
    tracing::info!(
        "metrics at http://{addr}/metrics, health at http://{addr}/live and http://{addr}/ready"
    );
    Ok(tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                acc = listener.accept() => {
                    let stream = match acc {
                        Ok((stream, _)) => stream,
                        // Out of file descriptors (EMFILE) fails every accept at once until
                        // one is freed: pause instead of spinning on it.
                        Err(e) => {
                            tracing::debug!("metrics: accept failed: {e}");
                            tokio::time::sleep(ACCEPT_RETRY).await;
                            continue;
                        }
                    };
                    let m = metrics.clone();
                    tokio::spawn(async move {
                        let _ = tokio::time::timeout(Duration::from_secs(5), handle(stream, m)).await;
                    });
                }
            }
        }
    }))
}

async fn handle(mut stream: tokio::net::TcpStream, m: Arc<dyn Status>) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") && buf.len() < 8192 {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let head = String::from_utf8_lossy(&buf);
    let mut parts = head.split_whitespace();
    let method = parts.next().unwrap_or("");
    let path = parts.next().unwrap_or("");
    let path = path.split('?').next().unwrap_or("");
    let (status, ctype, body) = match (method, path) {
        ("GET", "/metrics") => (
            "200 OK",
            "text/plain; version=0.0.4; charset=utf-8",
            m.render(),
        ),
        ("GET", "/live") => status(m.live().map(|()| "ok\n".to_string())),
        ("GET", "/ready") => status(m.ready()),
        // Before /live and /ready: the database alone (kept for existing probes).
        ("GET", "/health") => status(m.health().map(|()| "ok\n".to_string())),
        ("GET", _) => ("404 Not Found", "text/plain", "not found\n".to_string()),
        _ => (
            "405 Method Not Allowed",
            "text/plain",
            "method not allowed\n".to_string(),
        ),
    };
    let resp = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(resp.as_bytes()).await?;
    stream.shutdown().await
}

/// A health check's answer: `200` with its body, or `503` with the reason.
fn status(r: Result<String, String>) -> (&'static str, &'static str, String) {
    match r {
        Ok(body) => ("200 OK", "text/plain", body),
        Err(why) => ("503 Service Unavailable", "text/plain", format!("{why}\n")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topics_past_the_cap_share_one_label() {
        let m = Metrics::new(Health::new(1, Duration::from_secs(60), "Kafka"));
        for n in 0..MAX_TOPIC_LABELS {
            assert_eq!(m.topic_label(&format!("t{n}")), format!("t{n}"));
        }
        assert_eq!(m.topic_label("one.too.many"), OTHER_TOPICS);
        assert_eq!(
            m.topic_label("t0"),
            "t0",
            "a labelled topic keeps its label"
        );
        m.published
            .with_label_values(&[&m.topic_label("another")])
            .inc();
        assert!(m
            .render()
            .contains("outbox_published_total{topic=\"(other)\"} 1"));
    }
}
