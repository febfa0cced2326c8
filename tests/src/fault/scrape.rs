//! What each relay counted, from its own Prometheus metrics (not from its log's wording): failed
//! publishes by class, publishes blamed on the producer, producer replacements by reason. Scraped
//! every second and right before the runner kills or stops a relay; counters only grow, so the
//! last scrape is what the relay counted up to then. A scrape that answers but lacks a metric the
//! runner relies on is an error, never a 0.

use std::collections::BTreeMap;

use crate::relay::Relay;

/// Reasons the relay exports for `outbox_producer_replaced_total` (each at 0 from the start).
pub(super) const REPLACE_REASONS: [&str; 4] = ["fenced", "fatal", "timeouts", "unreachable"];

/// One relay's counters as of its last scrape.
#[derive(Debug, Default, Clone, PartialEq)]
pub(super) struct Counters {
    /// `outbox_published_total`, every topic: delivered, and settled by this relay's ack.
    pub(super) published: u64,
    /// `outbox_stale_acks_total`: delivered, but no longer held when the ack landed.
    pub(super) stale_acks: u64,
    /// `outbox_failed_total` by `class` (absent until the first failure of that class).
    pub(super) failed_transient: u64,
    pub(super) failed_permanent: u64,
    /// `outbox_producer_failures_total`.
    pub(super) producer_failures: u64,
    /// `outbox_producer_replaced_total` by `reason`.
    pub(super) replaced: BTreeMap<String, u64>,
}

impl Counters {
    /// Publishes settled: delivered (then acked, or found no longer held) or failed (then
    /// released or nacked).
    pub(super) fn settled(&self) -> u64 {
        self.published + self.stale_acks + self.failed_transient + self.failed_permanent
    }

    pub(super) fn replaced_total(&self) -> u64 {
        self.replaced.values().sum()
    }
}

/// GET /metrics of a running relay. `Ok(None)`: it did not answer (not listening yet, exiting);
/// `Err`: it answered without a metric the runner needs.
pub(super) fn scrape(relay: &Relay) -> Result<Option<Counters>, String> {
    match relay.http_get("/metrics") {
        Some((status, body)) if status.contains(" 200 ") => parse(&body).map(Some),
        _ => Ok(None),
    }
}

/// Parses the Prometheus text of the relay's /metrics.
pub(super) fn parse(body: &str) -> Result<Counters, String> {
    let mut c = Counters::default();
    let mut producer_failures = None;
    let mut stale_acks = None;
    for line in body.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let Ok(v) = value.trim().parse::<f64>() else {
            continue;
        };
        let v = v as u64;
        let (name, labels) = series.split_once('{').unwrap_or((series, ""));
        match name {
            "outbox_published_total" => c.published += v,
            "outbox_failed_total" if labels.contains(r#"class="transient""#) => {
                c.failed_transient += v
            }
            "outbox_failed_total" if labels.contains(r#"class="permanent""#) => {
                c.failed_permanent += v
            }
            "outbox_producer_failures_total" => producer_failures = Some(v),
            "outbox_stale_acks_total" => stale_acks = Some(v),
            "outbox_producer_replaced_total" => {
                if let Some(reason) = label(labels, "reason") {
                    *c.replaced.entry(reason.to_string()).or_default() += v;
                }
            }
            _ => {}
        }
    }
    c.producer_failures =
        producer_failures.ok_or("the relay's /metrics has no outbox_producer_failures_total")?;
    c.stale_acks = stale_acks.ok_or("the relay's /metrics has no outbox_stale_acks_total")?;
    for reason in REPLACE_REASONS {
        if !c.replaced.contains_key(reason) {
            return Err(format!(
                "the relay's /metrics has no outbox_producer_replaced_total{{reason=\"{reason}\"}}"
            ));
        }
    }
    Ok(c)
}

/// The value of `name="…"` in a label set `a="x",b="y"}`.
fn label<'a>(labels: &'a str, name: &str) -> Option<&'a str> {
    let at = labels.find(&format!("{name}=\""))? + name.len() + 2;
    let rest = &labels[at..];
    Some(&rest[..rest.find('"')?])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_relays_counters_and_refuses_missing_ones() {
        let body = "# HELP x\n\
            outbox_published_total{topic=\"orders\"} 10\n\
            outbox_failed_total{class=\"transient\",topic=\"orders\"} 3\n\
            outbox_failed_total{class=\"transient\",topic=\"payments\"} 2\n\
            outbox_failed_total{class=\"permanent\",topic=\"poison\"} 7\n\
            outbox_producer_failures_total 4\n\
            outbox_stale_acks_total 6\n\
            outbox_producer_replaced_total{reason=\"fatal\"} 0\n\
            outbox_producer_replaced_total{reason=\"fenced\"} 1\n\
            outbox_producer_replaced_total{reason=\"timeouts\"} 2\n\
            outbox_producer_replaced_total{reason=\"unreachable\"} 0\n";
        let c = parse(body).expect("parses");
        assert_eq!((c.failed_transient, c.failed_permanent), (5, 7));
        assert_eq!(c.producer_failures, 4);
        assert_eq!(c.settled(), 28);
        assert_eq!(c.replaced_total(), 3);
        assert_eq!(c.replaced["fenced"], 1);
        let renamed = body.replace("outbox_producer_failures_total", "outbox_x_total");
        assert!(parse(&renamed).is_err());
        assert!(parse(&body.replace("outbox_stale_acks_total", "outbox_y_total")).is_err());
        let no_reason = body.replace("reason=\"timeouts\"", "why=\"timeouts\"");
        assert!(parse(&no_reason).is_err());
    }
}
