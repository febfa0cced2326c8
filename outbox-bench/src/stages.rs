//! Where an event's time in the relay went: the relay's `outbox_event_stage_seconds` histograms
//! (claim, hand-off to the broker's client, delivery report, ack), read from its `/metrics` before
//! and after a run; the quantiles of the difference are the run's.

use std::collections::BTreeMap;

/// The relay's stages, in the order an event goes through them.
pub const STAGES: [&str; 4] = ["claim", "handoff", "delivery", "ack"];

const BUCKET: &str = "outbox_event_stage_seconds_bucket{";

/// Per stage, the cumulative bucket counts: (upper bound in seconds, events at or below it).
#[derive(Debug, Default, Clone)]
pub struct StageHists(BTreeMap<String, Vec<(f64, f64)>>);

impl StageHists {
    /// The stage histograms of a `/metrics` page (empty when it has none).
    pub fn parse(metrics: &str) -> StageHists {
        let mut out: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
        for line in metrics.lines() {
            let Some(rest) = line.strip_prefix(BUCKET) else {
                continue;
            };
            let Some((labels, value)) = rest.split_once("} ") else {
                continue;
            };
            let label = |name: &str| {
                labels.split(',').find_map(|kv| {
                    let (k, v) = kv.split_once('=')?;
                    (k == name).then(|| v.trim_matches('"').to_string())
                })
            };
            let (Some(stage), Some(le), Ok(count)) =
                (label("stage"), label("le"), value.trim().parse::<f64>())
            else {
                continue;
            };
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().unwrap_or(f64::INFINITY)
            };
            out.entry(stage).or_default().push((le, count));
        }
        // Several series of one stage (a fleet's databases) add up.
        for buckets in out.values_mut() {
            buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
            buckets.dedup_by(|later, kept| {
                let same = later.0 == kept.0;
                if same {
                    kept.1 += later.1;
                }
                same
            });
        }
        StageHists(out)
    }

    /// Quantile `q` of what `stage` observed since `before`, in µs, interpolated within its
    /// bucket; None when it observed nothing.
    pub fn quantile_since(&self, before: &StageHists, stage: &str, q: f64) -> Option<f64> {
        let after = self.0.get(stage)?;
        let earlier = before.0.get(stage);
        let counts: Vec<(f64, f64)> = after
            .iter()
            .enumerate()
            .map(|(i, (le, n))| (*le, n - earlier.and_then(|b| b.get(i)).map_or(0.0, |b| b.1)))
            .collect();
        let total = counts.last()?.1;
        if total <= 0.0 {
            return None;
        }
        let target = q * total;
        let (mut lo, mut below) = (0.0, 0.0);
        for (le, n) in counts {
            if n >= target {
                if le.is_infinite() {
                    return Some(lo * 1e6);
                }
                let share = if n > below {
                    (target - below) / (n - below)
                } else {
                    1.0
                };
                return Some((lo + (le - lo) * share) * 1e6);
            }
            (lo, below) = (le, n);
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page(claim: &[(&str, u32)]) -> String {
        claim
            .iter()
            .map(|(le, n)| format!("{BUCKET}stage=\"claim\",le=\"{le}\"}} {n}\n"))
            .collect()
    }

    #[test]
    fn quantiles_come_from_the_difference_interpolated_in_the_bucket() {
        let before = StageHists::parse(&page(&[("0.001", 10), ("0.002", 10), ("+Inf", 10)]));
        let after = StageHists::parse(&page(&[("0.001", 10), ("0.002", 30), ("+Inf", 30)]));
        // 20 new events, all between 1 and 2 ms: the median is in the middle.
        let p50 = after.quantile_since(&before, "claim", 0.5).unwrap();
        assert!((p50 - 1500.0).abs() < 1e-6, "{p50}");
        assert_eq!(after.quantile_since(&after, "claim", 0.5), None);
        assert_eq!(after.quantile_since(&before, "ack", 0.5), None);
    }
}
