//! What a run measured, section by section: what the report and the goals are made from, and the
//! same figures as JSON (`BENCHMARKS.json` next to the markdown report) for tools and for
//! comparing runs. Times are µs unless a key says otherwise, rates events (or transactions) per
//! second.

use hdrhistogram::Histogram;
use serde_json::{json, Value};

use crate::report::Goal;
use crate::{
    broker_drain, enqueue, held_snapshot, hot_key, idle, inbox, latency, lifecycle, null_sink,
    ordering, seed, Profile,
};

/// Everything the report needs, filled in section by section.
#[derive(Default)]
pub struct Results {
    pub enqueue: Option<enqueue::EnqueueSummary>,
    pub matrix: Vec<null_sink::DrainRun>,
    pub sync_off: Option<null_sink::DrainRun>,
    pub headline: Option<null_sink::DrainRun>,
    pub health_md: Option<String>,
    pub health: Option<Value>,
    pub contention: Vec<null_sink::DrainRun>,
    pub seed: Vec<seed::SeedRun>,
    pub seed_compare: Option<null_sink::DrainRun>,
    pub broker: Vec<broker_drain::BrokerDrain>,
    pub latency: Vec<latency::LatencyRun>,
    pub idle: Vec<idle::IdleRun>,
    pub ordering: Vec<ordering::KeyedDrain>,
    pub claim_cost: Option<hot_key::ClaimCosts>,
    pub indexes_md: Option<String>,
    pub indexes: Option<Value>,
    pub fairness_md: Option<String>,
    pub fairness: Option<Value>,
    pub sinks_md: Option<String>,
    pub sinks: Option<Value>,
    pub lifecycle: Option<lifecycle::Lifecycle>,
    pub held: Vec<held_snapshot::HeldRun>,
    pub inbox: Vec<inbox::InboxRun>,
    pub inbox_notes: Vec<String>,
    pub inbox_consumer: String,
    pub broker_note: Option<String>,
    pub failures: Vec<String>,
}

/// p50, p99, p99.9 and max of a histogram of µs.
fn quantiles(h: &Histogram<u64>) -> Value {
    json!({
        "p50": h.value_at_quantile(0.5),
        "p99": h.value_at_quantile(0.99),
        "p999": h.value_at_quantile(0.999),
        "max": h.max(),
    })
}

fn drain_run(d: &null_sink::DrainRun) -> Value {
    json!({
        "loops": d.loops,
        "batch": d.batch,
        "synchronous_commit_off": d.sync_off,
        "backlog": d.backlog,
        "drained": d.drained,
        "complete": d.complete,
        "secs": d.secs,
        "rate": d.rate(),
        "db_cpu_us_per_event": d.cpu_us_per_event(),
        "host_busy_pct": d.host_busy_pct,
        "other_load_pct": d.other_pct,
        "double_claims": d.duplicates,
        "claim_us": quantiles(&d.claim_hist),
        "ack_us": quantiles(&d.ack_hist),
    })
}

fn seed_run(s: &seed::SeedRun) -> Value {
    json!({
        "instances": s.loops,
        "delay_secs": s.delay.map(|d| d.as_secs_f64()),
        "rounds": s.rounds,
        "drained": s.drained,
        "secs": s.secs,
        "rate": s.rate(),
        "lost_claim_races": s.lost_races,
        "double_sends": s.double_sends,
        "db_cpu_secs": s.db_cpu_secs,
    })
}

pub fn broker_run(b: &broker_drain::BrokerDrain) -> Value {
    json!({
        "loops": b.loops,
        "relay_settings": b.settings,
        "relay_defaults": b.default_settings,
        "drained": b.drained,
        "complete": b.complete,
        "secs": b.secs,
        "wall_secs": b.wall_secs,
        "rate": b.rate(),
        "db_cpu_secs": b.db_cpu_secs,
        "relay_cpu_secs": b.relay_cpu_secs,
        "broker_cpu_secs": b.broker_cpu_secs,
        "host_busy_pct": b.host_busy_pct,
        "other_load_pct": b.other_pct,
    })
}

fn latency_run(l: &latency::LatencyRun) -> Value {
    let c = &l.commit_to_ack;
    json!({
        "offered_rate": l.rate,
        "achieved_rate": l.achieved_rate,
        "server": l.server,
        "wake_up_mode": l.wake,
        "producers_notify": l.producer_notify,
        "relay_settings": l.settings,
        "sent": l.sent,
        "missing": l.missing,
        "duplicates": l.duplicates,
        "commit_to_ack_us": {"p50": c[0], "p99": c[1], "p999": c[2], "max": c[3], "clock": l.ack_source},
        "relay_db_cpu_us_per_event": l.relay_db_cpu_us,
        "machine_cpu_busy_pct": l.machine_busy_pct,
        "statement_to_consumer_us": quantiles(&l.stmt_hist),
        "commit_to_consumer_us": quantiles(&l.hist),
        "start_to_claim_us": {"p50": l.to_claim.0, "p99": l.to_claim.1},
        "claim_to_ack_us": {"p50": l.to_ack.0, "p99": l.to_ack.1},
        "commit_to_append_us": {"p50": l.to_append.0, "p99": l.to_append.1},
        "commit_to_claim_us": {"p50": l.commit_to_claim.0, "p99": l.commit_to_claim.1},
        "relay_stages_us": l.stages.iter().map(|(s, p50, p99)| (s.to_string(), json!({"p50": p50, "p99": p99}))).collect::<serde_json::Map<_, _>>(),
    })
}

fn idle_run(i: &idle::IdleRun) -> Value {
    json!({
        "server": i.server,
        "wake_up_mode": i.wake,
        "secs": i.secs,
        "backends_start": i.backends.0,
        "backends_end": i.backends.1,
        "db_cpu_secs": i.db_cpu_secs,
        "db_cpu_pct_of_core": i.pct(),
        "relay_cpu_secs": i.relay_cpu_secs,
        "transactions": i.xacts,
    })
}

fn enqueue_summary(e: &enqueue::EnqueueSummary) -> Value {
    let c = &e.cost;
    let b = &e.bulk;
    json!({
        "clients": e.clients,
        "producer_ratio_vs_plain_insert": e.producer_ratio(),
        "waiter_wakes": e.waiter_wakes,
        "wake_up_mode": e.wake_mode,
        "variants": e.results.iter().map(|v| json!({
            "variant": v.variant.key(),
            "label": v.variant.label(),
            "tps": v.tps(),
            "tps_rounds": v.rounds,
            "transactions": v.tx,
            "secs": v.secs,
            "tx_us": quantiles(&v.hist),
            "db_cpu_secs": v.db_cpu_secs,
        })).collect::<Vec<_>>(),
        "cpu_per_row": {
            "statements": c.statements,
            "per_statement_backend_cpu_us": {"insert": c.stmt_insert_us, "outbox_enqueue": c.stmt_enqueue_us, "ratio": c.stmt_ratio()},
            "per_statement_client_us": {"insert": c.stmt_insert_wall_us, "outbox_enqueue": c.stmt_enqueue_wall_us},
            "set_rows": c.set_rows,
            "set_based_us_per_row": {"order_row": c.set_order_us, "insert": c.set_insert_us, "outbox_enqueue": c.set_enqueue_us, "outbox_enqueue_many": c.set_many_us, "ratio": c.set_ratio()},
        },
        "bulk": {
            "events": b.rows,
            "single_calls_secs": b.single_secs,
            "enqueue_many_secs": b.many_secs,
            "single_calls_rounds": b.single_rounds,
            "enqueue_many_rounds": b.many_rounds,
            "single_calls_cpu_secs": b.single_cpu_secs,
            "enqueue_many_cpu_secs": b.many_cpu_secs,
            "speedup": b.speedup(),
        },
    })
}

/// The run's figures, goals and failures as one JSON document.
pub fn to_json(p: &Profile, r: &Results, goals: &[Goal], took_secs: f64) -> Value {
    json!({
        "profile": p.name,
        "took_secs": took_secs,
        "enqueue": r.enqueue.as_ref().map(enqueue_summary),
        "null_sink": {
            "matrix": r.matrix.iter().map(drain_run).collect::<Vec<_>>(),
            "synchronous_commit_off": r.sync_off.as_ref().map(drain_run),
            "headline": r.headline.as_ref().map(drain_run),
        },
        "broker_drain": r.broker.iter().map(broker_run).collect::<Vec<_>>(),
        "latency": r.latency.iter().map(latency_run).collect::<Vec<_>>(),
        "idle": r.idle.iter().map(idle_run).collect::<Vec<_>>(),
        "ordering": ordering::json(r),
        "contention": r.contention.iter().map(drain_run).collect::<Vec<_>>(),
        "seed": {
            "runs": r.seed.iter().map(seed_run).collect::<Vec<_>>(),
            "this_project": r.seed_compare.as_ref().map(drain_run),
        },
        "table_health": r.health,
        "indexes": r.indexes,
        "lifecycle": lifecycle::json(r),
        "held_snapshot": held_snapshot::json(r),
        "inbox": inbox::json(r),
        "goals": goals.iter().map(|g| json!({
            "name": g.name,
            "target": g.target,
            "measured": g.measured,
            "met": g.met,
        })).collect::<Vec<_>>(),
        "broker_note": r.broker_note,
        "failures": r.failures,
    })
}

/// The JSON of the index report (`--only indexes`, `INDEXES.json`).
/// The figures of a section with its own report (`indexes`, `fairness`).
pub fn section_json(
    p: &Profile,
    name: &str,
    figures: &Option<Value>,
    r: &Results,
    took_secs: f64,
) -> Value {
    json!({
        "profile": p.name,
        "took_secs": took_secs,
        name: figures,
        "failures": r.failures,
    })
}
