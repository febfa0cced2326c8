//! Per-key order (report section 7): one keyed backlog drained through the relay to the broker
//! with its keys ordered (the default) and unordered (`outbox.unordered_topics`), for 1 to
//! 100,000 keys. The claim cost at a hot key's backlog, the section's second part, is hot_key.rs.

use anyhow::{bail, Result};
use serde_json::{json, Value};

use outbox_tests::db::TestDb;
use outbox_worker::defaults;

use crate::broker_drain::{self, BrokerDrain};
use crate::db::{self, BenchDb, KEYED_FILL_TX};
use crate::relay_env::RelayEnv;
use crate::report::{not_run, num, Goal, Table};
use crate::results::{broker_run, Results};
use crate::{hot_key, Profile};

/// The benchmark's topic (created on the broker by the suite).
pub const TOPIC: &str = "bench.order";
/// Goals of the per-key order issue: ordered ≥ this share of unordered at this many keys; with
/// one key at least this rate.
pub const RATIO_GOAL: f64 = 0.5;
pub const RATIO_GOAL_KEYS: i64 = 10_000;
pub const ONE_KEY_RATE_GOAL: f64 = 2_000.0;

/// One drain of the keyed backlog (the best of the profile's repeats).
pub struct KeyedDrain {
    pub keys: i64,
    pub ordered: bool,
    /// Rows in `outbox_key` after the fill (0: fresh events of idle keys go to the stream).
    pub key_rows: i64,
    pub run: BrokerDrain,
}

/// The profile's key counts, capped at the backlog, without repeats.
fn key_counts(p: &Profile) -> Vec<i64> {
    let mut ks: Vec<i64> = Vec::new();
    for k in p.ordering_keys.iter().map(|&k| k.min(p.ordering_backlog)) {
        if !ks.contains(&k) {
            ks.push(k);
        }
    }
    ks
}

/// Fills the keyed backlog in a session of its own (the unordered setting dies with it) and checks
/// the flags and key rows the fill should have made.
pub async fn fill(db: &TestDb, n: i64, keys: i64, ordered: bool) -> Result<i64> {
    let c = db.client().await?;
    let (ordered_rows, key_rows) = db::fill_keyed(&c, TOPIC, n, keys, !ordered).await?;
    // Since 0.7.0 fresh events of idle keys go to the append-only stream: no key rows.
    let want = if ordered { (n, 0) } else { (0, 0) };
    if (ordered_rows, key_rows) != want {
        bail!(
            "keyed fill ({n} events, {keys} keys, ordered {ordered}): {ordered_rows} ordered events \
             and {key_rows} key rows, expected {want:?}"
        );
    }
    Ok(key_rows)
}

/// Section 7a: the ordered vs unordered drains, interleaved per key count.
pub async fn run_drains(p: &Profile, env: &RelayEnv<'_>, r: &mut Results) -> Result<()> {
    let n = p.ordering_backlog;
    for keys in key_counts(p) {
        for ordered in [true, false] {
            let mode = if ordered { "ordered" } else { "unordered" };
            progress!(
                "  {} events over {} key(s), {mode}",
                num(n as f64),
                num(keys as f64)
            );
            let mut best: Option<KeyedDrain> = None;
            for i in 0..p.repeats {
                let key_rows = fill(env.db, n, keys, ordered).await?;
                let tag = format!("order-{keys}-{mode}-{i}");
                let loops = defaults::CONCURRENCY;
                let run =
                    broker_drain::drain_filled(env, n, p.ordering_cap, loops, &[], &tag).await?;
                if p.name == "smoke" && !run.complete {
                    r.failures.push(format!(
                        "{mode} drain over {keys} keys: not complete within {:?}",
                        p.ordering_cap
                    ));
                }
                if best.as_ref().is_none_or(|b| run.rate() > b.run.rate()) {
                    best = Some(KeyedDrain {
                        keys,
                        ordered,
                        key_rows,
                        run,
                    });
                }
            }
            r.ordering.extend(best);
        }
    }
    env.monitor.batch_execute(db::TRUNCATE_OUTBOX).await?;
    Ok(())
}

/// (ordered, unordered) drains per key count, in the order run.
fn pairs(r: &Results) -> Vec<(&KeyedDrain, &KeyedDrain)> {
    r.ordering
        .iter()
        .filter(|d| d.ordered)
        .filter_map(|o| {
            r.ordering
                .iter()
                .find(|u| !u.ordered && u.keys == o.keys)
                .map(|u| (o, u))
        })
        .collect()
}

fn ratio(o: &KeyedDrain, u: &KeyedDrain) -> f64 {
    o.run.rate() / u.run.rate()
}

pub fn goals(r: &Results) -> Vec<Goal> {
    let mut g = Vec::new();
    let ps = pairs(r);
    let at = ps.iter().find(|(o, _)| o.keys == RATIO_GOAL_KEYS);
    let name = format!("per-key order at {} keys", num(RATIO_GOAL_KEYS as f64));
    let target = format!("ordered ≥ {:.0} % of unordered", 100.0 * RATIO_GOAL);
    g.push(match at {
        Some((o, u)) => Goal {
            name,
            target,
            measured: format!(
                "{} vs {} events/s ({:.0} %)",
                num(o.run.rate()),
                num(u.run.rate()),
                100.0 * ratio(o, u)
            ),
            met: Some(ratio(o, u) >= RATIO_GOAL),
            note: format!(
                "{:.2}× the goal; relay defaults, {} events",
                ratio(o, u) / RATIO_GOAL,
                num(o.run.drained as f64)
            ),
        },
        None => Goal::not_measured(name, target),
    });
    let one = ps.iter().find(|(o, _)| o.keys == 1);
    let (name, target) = (
        "per-key order, 1 key".to_string(),
        format!("ordered ≥ {} events/s", num(ONE_KEY_RATE_GOAL)),
    );
    g.push(match one {
        Some((o, u)) => Goal {
            name,
            target,
            measured: format!("{} events/s", num(o.run.rate())),
            met: Some(o.run.rate() >= ONE_KEY_RATE_GOAL),
            note: format!(
                "{:.2}× the goal; unordered, same backlog: {} events/s",
                o.run.rate() / ONE_KEY_RATE_GOAL,
                num(u.run.rate())
            ),
        },
        None => Goal::not_measured(name, target),
    });
    g.push(hot_key::goal(r));
    g
}

fn cpu(d: &KeyedDrain) -> String {
    d.run
        .db_cpu_secs
        .map(|c| format!("{:.0}", c * 1e6 / d.run.drained.max(1) as f64))
        .unwrap_or_else(|| "n/a".into())
}

pub fn markdown(p: &Profile, r: &Results) -> String {
    let mut s = "### Ordered vs unordered drain to the broker\n\n".to_string();
    let ps = pairs(r);
    if ps.is_empty() {
        s += &not_run(r);
    } else {
        s += &format!(
            "The same backlog of {} events, enqueued through `outbox_enqueue(topic, payload, key => …)` \
             over K keys ({} events per transaction), \
             drained by `outbox-worker run` with its defaults (batch {}, {} loop); once ordered (the \
             default) and once with the topic in `outbox.unordered_topics`. Events/s from first claim \
             to last ack; best of {} run(s); the fill is not timed.\n\n",
            num(p.ordering_backlog as f64),
            num(KEYED_FILL_TX as f64),
            defaults::BATCH_SIZE,
            defaults::CONCURRENCY,
            p.repeats
        );
        let mut t = Table::new(&[
            "keys",
            "events per key",
            "ordered events/s",
            "unordered events/s",
            "ordered / unordered",
            "DB CPU µs/event ordered / unordered",
            "host CPU busy (other load) ordered / unordered",
        ]);
        for (o, u) in &ps {
            let cap = |d: &KeyedDrain| if d.run.complete { "" } else { " (time cap)" };
            t.row(vec![
                num(o.keys as f64),
                num(o.run.drained as f64 / o.keys as f64),
                format!("{}{}", num(o.run.rate()), cap(o)),
                format!("{}{}", num(u.run.rate()), cap(u)),
                format!("{:.0} %", 100.0 * ratio(o, u)),
                format!("{} / {}", cpu(o), cpu(u)),
                format!(
                    "{:.0} % ({:.0} %) / {:.0} % ({:.0} %)",
                    o.run.host_busy_pct, o.run.other_pct, u.run.host_busy_pct, u.run.other_pct
                ),
            ]);
        }
        s += &t.render();
    }
    s += "\n### Claim cost at a hot key\n\n";
    s += &hot_key::markdown(r);
    s
}

pub fn json(r: &Results) -> Value {
    json!({
        "drains": r.ordering.iter().map(|d| {
            let mut v = broker_run(&d.run);
            v["keys"] = json!(d.keys);
            v["ordered"] = json!(d.ordered);
            v["key_rows_after_fill"] = json!(d.key_rows);
            v
        }).collect::<Vec<_>>(),
        "ordered_vs_unordered": pairs(r).iter().map(|(o, u)| json!({
            "keys": o.keys,
            "ordered_rate": o.run.rate(),
            "unordered_rate": u.run.rate(),
            "ratio": ratio(o, u),
        })).collect::<Vec<_>>(),
        "claim_cost": hot_key::json(r),
    })
}
