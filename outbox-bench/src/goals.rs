//! The goals of issue 5 against this run's figures, and the relay defaults the figures recommend.

use outbox_worker::defaults;

use crate::enqueue::Variant;
use crate::latency::notify_cap_note;
use crate::null_sink::find_run;
use crate::report::{ms, num, pct, Goal};
use crate::results::Results;
use crate::{broker_drain, latency, null_sink, ordering};

fn cpu_limit_note(host_busy: f64, other: f64) -> String {
    let base = if host_busy >= 85.0 {
        format!("CPU-bound: the machine's CPUs were {host_busy:.0} % busy")
    } else {
        format!("CPUs {host_busy:.0} % busy: latency-bound (round trips, commits), not CPU")
    };
    if other >= 10.0 {
        format!("{base}, {other:.0} % of it by other processes on the machine")
    } else {
        base
    }
}

/// The goals of issue 5: null-sink and broker drain rates (events/s), the enqueue overhead (%), and
/// the commit-to-broker latency (ms) at `LATENCY_GOAL_RATE` events/s.
pub const NULL_SINK_RATE_GOAL: f64 = 20_000.0;
pub const BROKER_RATE_GOAL: f64 = 10_000.0;
pub const ENQUEUE_OVERHEAD_GOAL_PCT: f64 = 10.0;
pub const LATENCY_GOAL_RATE: f64 = 1_000.0;
pub const LATENCY_P50_GOAL_MS: f64 = 5.0;
pub const LATENCY_P99_GOAL_MS: f64 = 25.0;

fn rate_target(goal: f64) -> String {
    format!("≥ {} events/s", num(goal))
}

fn latency_name() -> String {
    format!(
        "commit-to-broker latency at {} ev/s",
        num(LATENCY_GOAL_RATE)
    )
}

fn enqueue_target() -> String {
    format!("≤ {ENQUEUE_OVERHEAD_GOAL_PCT} %")
}

fn latency_target() -> String {
    format!("p50 ≤ {LATENCY_P50_GOAL_MS} ms, p99 ≤ {LATENCY_P99_GOAL_MS} ms")
}

pub fn goals(r: &Results) -> Vec<Goal> {
    let mut g = Vec::new();
    // Null-sink drain.
    let best = r
        .matrix
        .iter()
        .chain(r.headline.iter())
        .max_by(|a, b| a.rate().total_cmp(&b.rate()));
    g.push(match best {
        Some(b) => Goal {
            name: "drain to the null sink".into(),
            target: rate_target(NULL_SINK_RATE_GOAL),
            measured: format!(
                "{} events/s ({} loop(s), batch {})",
                num(b.rate()),
                b.loops,
                b.batch
            ),
            met: Some(b.rate() >= NULL_SINK_RATE_GOAL),
            note: format!(
                "{:.2}× the goal; {}; DB CPU {} µs/event",
                b.rate() / NULL_SINK_RATE_GOAL,
                cpu_limit_note(b.host_busy_pct, b.other_pct),
                b.cpu_us_per_event()
                    .map(|c| format!("{c:.0}"))
                    .unwrap_or_else(|| "n/a".into())
            ),
        },
        None => not_measured("drain to the null sink", rate_target(NULL_SINK_RATE_GOAL)),
    });
    // Broker drain with default settings (one loop, no flags).
    let def = r.broker.iter().find(|b| b.default_settings && b.loops == 1);
    g.push(match def {
        Some(b) => Goal {
            name: "drain to the broker, relay defaults".into(),
            target: rate_target(BROKER_RATE_GOAL),
            measured: format!("{} events/s", num(b.rate())),
            met: Some(b.rate() >= BROKER_RATE_GOAL),
            note: format!(
                "{:.2}× the goal; {}; CPU µs/event DB {} / relay {:.0} / broker {:.0}",
                b.rate() / BROKER_RATE_GOAL,
                cpu_limit_note(b.host_busy_pct, b.other_pct),
                b.db_cpu_secs
                    .map(|c| format!("{:.0}", c * 1e6 / b.drained.max(1) as f64))
                    .unwrap_or_else(|| "n/a".into()),
                b.relay_cpu_secs * 1e6 / b.drained.max(1) as f64,
                b.broker_cpu_secs * 1e6 / b.drained.max(1) as f64
            ),
        },
        None => not_measured(
            "drain to the broker, relay defaults",
            rate_target(BROKER_RATE_GOAL),
        ),
    });
    // Enqueue overhead.
    g.push(match &r.enqueue {
        Some(e) => {
            let o = e.overhead_pct(Variant::Outbox);
            let one = e.overhead_pct(Variant::OutboxOneStatement);
            Goal {
                name: "enqueue overhead".into(),
                target: enqueue_target(),
                measured: format!(
                    "{} ({} tx/s → {} tx/s)",
                    pct(o),
                    num(e.tps(Variant::OrderOnly)),
                    num(e.tps(Variant::Outbox))
                ),
                met: Some(o <= ENQUEUE_OVERHEAD_GOAL_PCT),
                note: format!(
                    "{:.1} points {} the goal. Without the extra statement's round trip (one statement): {}; \
                     with `outbox.notify = off`: {}. Server side, `outbox_enqueue` costs {:.1} µs per row \
                     against {:.1} µs for a plain INSERT of the same row and {:.1} µs for the order row: \
                     the function's checks, not the table, dominate the database work; the order \
                     transaction here is a single small INSERT, so any added statement weighs heavily. {}",
                    (o - ENQUEUE_OVERHEAD_GOAL_PCT).abs(),
                    if o <= ENQUEUE_OVERHEAD_GOAL_PCT { "under" } else { "over" },
                    pct(one),
                    pct(e.overhead_pct(Variant::OutboxNoNotify)),
                    e.per_row_us.get(2).copied().unwrap_or(f64::NAN),
                    e.per_row_us.get(1).copied().unwrap_or(f64::NAN),
                    e.per_row_us.first().copied().unwrap_or(f64::NAN),
                    notify_cap_note(r, r.latency.iter().map(|l| l.rate).fold(0.0, f64::max))
                        .unwrap_or_default(),
                ),
            }
        }
        None => not_measured("enqueue overhead", enqueue_target()),
    });
    // Latency at the goal's rate with NOTIFY, relay defaults.
    let lat = r
        .latency
        .iter()
        .find(|l| l.notify && l.rate == LATENCY_GOAL_RATE && l.settings == "defaults");
    g.push(match lat {
        Some(l) => {
            let (p50, p99) = (l.commit_to_ack[0] / 1000.0, l.commit_to_ack[1] / 1000.0);
            Goal {
                name: latency_name(),
                target: latency_target(),
                measured: format!(
                    "commit→ack (delivery report + ack): p50 {} ms, p99 {} ms; commit→consumer: p50 {} ms, p99 {} ms",
                    ms(l.commit_to_ack[0]),
                    ms(l.commit_to_ack[1]),
                    ms(l.q(0.5)),
                    ms(l.q(0.99))
                ),
                met: Some(p50 <= LATENCY_P50_GOAL_MS && p99 <= LATENCY_P99_GOAL_MS),
                note: format!(
                    "commit→ack p50 {:.2}× and p99 {:.2}× the limit; claim→ack p50 {} ms (publish with \
                     `linger.ms={}`, delivery reports, ack), the rest is the wake-up and the round in \
                     progress. {}",
                    p50 / LATENCY_P50_GOAL_MS,
                    p99 / LATENCY_P99_GOAL_MS,
                    ms(l.to_ack.0),
                    defaults::LINGER_MS,
                    notify_cap_note(r, LATENCY_GOAL_RATE).unwrap_or_default()
                ),
            }
        }
        None => not_measured(&latency_name(), latency_target()),
    });
    // Contention.
    let one = r.contention.iter().find(|c| c.loops == 1);
    let eight = r.contention.iter().find(|c| c.loops == 8);
    g.push(match (one, eight) {
        (Some(a), Some(b)) => Goal {
            name: "8 claimers vs 1".into(),
            target: "throughput(8) ≥ throughput(1), no double claims".into(),
            measured: format!(
                "{} vs {} events/s, {} double claims",
                num(b.rate()),
                num(a.rate()),
                b.duplicates
            ),
            met: Some(b.rate() >= a.rate() && b.duplicates == 0),
            note: format!("ratio {:.2}", b.rate() / a.rate()),
        },
        _ => not_measured("8 claimers vs 1", "throughput(8) ≥ throughput(1)".into()),
    });
    g.extend(ordering::goals(r));
    g
}

fn not_measured(name: &str, target: String) -> Goal {
    Goal {
        name: name.into(),
        target,
        measured: "—".into(),
        met: None,
        note: "not run in this profile".into(),
    }
}

pub fn recommendations(r: &Results) -> String {
    let mut out = Vec::new();
    // Batch size: the smallest batch within 10 % of the best one-loop null-sink rate.
    let one: Vec<&null_sink::DrainRun> = r.matrix.iter().filter(|m| m.loops == 1).collect();
    if let Some(best) = one.iter().max_by(|a, b| a.rate().total_cmp(&b.rate())) {
        let mut sorted = one.clone();
        sorted.sort_by_key(|m| m.batch);
        if let Some(pick) = sorted.iter().find(|m| m.rate() >= 0.9 * best.rate()) {
            let brk: Vec<String> = r
                .broker
                .iter()
                .filter(|b| b.settings.contains("--batch-size"))
                .map(|b| format!("{} → {}", b.settings, num(b.rate())))
                .collect();
            out.push(format!(
                "- **batch size {}** (`--batch-size`, the relay's default is {}): the smallest batch within 10 % of the best one-loop \
                 rate. Null sink, 1 loop, events/s by batch: {}{}. Each claim and each ack is one \
                 statement and one commit, so small batches pay that fixed cost per few events.",
                pick.batch,
                defaults::BATCH_SIZE,
                sorted
                    .iter()
                    .map(|m| format!("{} → {}", m.batch, num(m.rate())))
                    .collect::<Vec<_>>()
                    .join(", "),
                if brk.is_empty() {
                    String::new()
                } else {
                    format!("; through the relay and broker: {}", brk.join(", "))
                }
            ));
        }
    }
    // Concurrency: 1 if one loop meets the broker goal, else the fewest loops that do.
    let mut loops: Vec<&broker_drain::BrokerDrain> =
        r.broker.iter().filter(|b| b.default_settings).collect();
    loops.sort_by_key(|b| b.loops);
    if !loops.is_empty() {
        let scaling = loops
            .iter()
            .map(|b| format!("{} loop(s) → {}", b.loops, num(b.rate())))
            .collect::<Vec<_>>()
            .join(", ");
        let pick = loops
            .iter()
            .find(|b| b.rate() >= BROKER_RATE_GOAL)
            .or(loops.last())
            .map(|b| b.loops)
            .unwrap_or(1);
        out.push(format!(
            "- **concurrency {pick}** (`--concurrency`, the relay's default is {}): the fewest claim \
             loops that reach the {} events/s goal through the broker ({scaling} events/s). More loops help a backlog drain \
             on an idle machine but cost a connection each and interleave batches across loops; raise \
             it (or run more relay processes) only when the backlog grows faster than one loop drains.",
            defaults::CONCURRENCY,
            num(BROKER_RATE_GOAL)
        ));
    }
    // Linger: the setting with the lowest commit->ack p50 at the goal's rate, with its drain rate.
    let lat: Vec<&latency::LatencyRun> = r
        .latency
        .iter()
        .filter(|l| l.notify && l.rate == LATENCY_GOAL_RATE)
        .collect();
    if lat.len() > 1 {
        let drain_of = |settings: &str| {
            r.broker
                .iter()
                .find(|b| {
                    b.loops == 1
                        && (b.settings == settings
                            || (settings == "defaults" && b.default_settings))
                })
                .map(|b| num(b.rate()))
                .unwrap_or_else(|| "n/a".into())
        };
        let best = lat
            .iter()
            .min_by(|a, b| a.commit_to_ack[0].total_cmp(&b.commit_to_ack[0]))
            .expect("non-empty");
        let default = lat.iter().find(|l| l.settings == "defaults");
        let verdict = match default {
            Some(d) if best.settings != "defaults" => {
                let gain = 1.0 - best.commit_to_ack[0] / d.commit_to_ack[0];
                if gain >= 0.2 {
                    format!(
                        "It cuts the p50 by {:.0} % against the relay's default (`linger.ms={}`): the \
                         relay already batches by claim and waits for every delivery report before its \
                         next round, so lingering only delays each round. Make it the relay's default.",
                        100.0 * gain,
                        defaults::LINGER_MS
                    )
                } else {
                    format!(
                        "Only {:.0} % better than the relay's default (`linger.ms={}`) at the p50, within \
                         this machine's run-to-run noise: no change justified by this run.",
                        100.0 * gain,
                        defaults::LINGER_MS
                    )
                }
            }
            _ => "The relay's default is the best setting measured.".to_string(),
        };
        out.push(format!(
            "- **producer linger**: lowest commit→ack p50 at {} events/s with {}. By setting \
             (commit→ack p50 / p99 ms; one-loop drain events/s): {}. {verdict}",
            num(LATENCY_GOAL_RATE),
            if best.settings == "defaults" {
                format!("the relay's default (`linger.ms={}`)", defaults::LINGER_MS)
            } else {
                best.settings.clone()
            },
            lat.iter()
                .map(|l| format!(
                    "{} → {} / {} ms; {} ev/s",
                    l.settings,
                    ms(l.commit_to_ack[0]),
                    ms(l.commit_to_ack[1]),
                    drain_of(&l.settings)
                ))
                .collect::<Vec<_>>()
                .join(" — ")
        ));
    }
    // Wake-up.
    let polled = r
        .latency
        .iter()
        .find(|l| !l.notify && l.rate == LATENCY_GOAL_RATE && l.settings == "defaults");
    let notified = r
        .latency
        .iter()
        .find(|l| l.notify && l.rate == LATENCY_GOAL_RATE && l.settings == "defaults");
    if let (Some(p), Some(n)) = (polled, notified) {
        out.push(format!(
            "- **keep `outbox.notify` on and the {} s poll interval as the fallback**: at {} events/s \
             the commit→ack p50 is {} ms with NOTIFY and {} ms with polling alone.",
            defaults::POLL_INTERVAL.as_secs(),
            num(LATENCY_GOAL_RATE),
            ms(n.commit_to_ack[0]),
            ms(p.commit_to_ack[0])
        ));
    }
    // Synchronous commit in the relay's sessions.
    if let (Some(off), Some(on)) = (
        &r.sync_off,
        r.sync_off
            .as_ref()
            .and_then(|o| find_run(&r.matrix, o.loops, o.batch)),
    ) {
        out.push(format!(
            "- `synchronous_commit = off` in the relay's sessions: {} vs {} events/s with it on \
             ({:+.0} %) on this disk; {}",
            num(off.rate()),
            num(on.rate()),
            100.0 * (off.rate() / on.rate() - 1.0),
            if off.rate() > 1.1 * on.rate() {
                "worth offering as an option (a lost claim or ack only re-sends an event)."
            } else {
                "not worth a default: commits are not the bottleneck here."
            }
        ));
    }
    if out.is_empty() {
        "No recommendation: the sections that feed it were not run.".into()
    } else {
        out.join("\n")
    }
}
