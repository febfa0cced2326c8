//! Index comparison (its own report, `reports/INDEXES.md`): the partial indexes the extension ships
//! against the seed design's composite `(status, …)` ones, on a table with a long SUCCESS history
//! and a small backlog. The table is `outbox_scheduled`, whose rows change status (retried, delayed
//! and ordered events; fresh unordered ones are `outbox_stream`'s, which has no status). Per design: the plans of both hot-path queries with their buffers, their
//! latency over a fixed time, a claim + ack drain of the backlog and the index sizes; the
//! conclusion is computed from those figures.

use anyhow::{Context, Result};
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use tokio_postgres::Client;

use outbox_tests::db::TestDb;

use crate::db::BenchDb;
use crate::report::{bytes, hist, ms, num, Table};
use crate::results::Results;
use crate::Profile;

/// A ratio within this fraction of 1 is reported as no difference.
const NOISE: f64 = 0.10;

/// The two hot-path queries: name, SQL, and what the plan appends (the claim's row locks).
const PATHS: [(&str, &str, &str); 2] = [
    (
        "claim candidates, LIMIT 100",
        "SELECT id FROM outbox_scheduled WHERE status = 'WAIT' AND NOT ordered \
         AND next_retry_time <= now() ORDER BY next_retry_time, id LIMIT 100",
        " FOR UPDATE SKIP LOCKED",
    ),
    (
        "expired leases",
        "SELECT id FROM outbox_scheduled WHERE status = 'SENDING' \
         AND claimed_at < now() - interval '10 minutes'",
        "",
    ),
];

/// One index design: its name and its two hot-path indexes.
struct Design {
    label: &'static str,
    indexes: [&'static str; 2],
}

/// The extension's own (sql/schema.sql), there after `CREATE EXTENSION`.
const SHIPPED: Design = Design {
    label: "partial (shipped)",
    indexes: [
        "outbox_scheduled_wait_due_idx",
        "outbox_scheduled_sending_claimed_idx",
    ],
};

const SEED: Design = Design {
    label: "composite (seed)",
    indexes: ["seed_status_next_retry_idx", "seed_status_claimed_idx"],
};

/// Replaces the shipped indexes with the seed's (on the emptied table, so that both designs grow
/// with the rows as in a live table).
const TO_SEED: &str = "TRUNCATE outbox_scheduled;
    DROP INDEX outbox_scheduled_wait_due_idx, outbox_scheduled_sending_claimed_idx;
    CREATE INDEX seed_status_next_retry_idx ON outbox_scheduled (status, next_retry_time);
    CREATE INDEX seed_status_claimed_idx ON outbox_scheduled (status, claimed_at);";

/// One hot-path query under one design.
struct Query {
    plan: String,
    /// Shared buffers (hit + read) of the plan's top node.
    buffers: i64,
    calls: u64,
    mean_us: f64,
    p99_us: f64,
}

struct DesignRun {
    label: &'static str,
    /// In the order of [`PATHS`].
    queries: Vec<Query>,
    /// The fastest of `repeats` drains, and the fewest rows one of them acked.
    drain_ms: f64,
    drained: i64,
    /// Bytes of the two hot-path indexes after the build and after the drain.
    built: [i64; 2],
    after: [i64; 2],
}

/// The same table for each design, from empty: history first (as in a live table: old rows
/// settled), then the leases, then the backlog with half of it due and half delayed (backoff or
/// deliver_at); then VACUUM ANALYZE. Returns the backlog's first id.
async fn build(c: &Client, p: &Profile) -> Result<i64> {
    c.batch_execute(&format!(
        "TRUNCATE outbox_scheduled;
         INSERT INTO outbox_scheduled (topic, payload, status, next_retry_time, created_at, updated_at,
                                   claim_owner, claim_token, claimed_at)
         SELECT 'orders', jsonb_build_object('n', g), 'SUCCESS',
                now() - interval '2 days' + g * interval '100 ms', now() - interval '2 days',
                now() - interval '1 day', 'relay', g, now() - interval '1 day'
           FROM generate_series(1, {}) g;
         INSERT INTO outbox_scheduled (topic, payload, status, next_retry_time, claim_owner, claim_token, claimed_at)
         SELECT 'orders', jsonb_build_object('n', g), 'SENDING', now() - interval '1 hour', 'relay', g,
                now() - (g % 20) * interval '1 minute'
           FROM generate_series(1, {}) g;
         INSERT INTO outbox_scheduled (topic, payload, status, next_retry_time)
         SELECT 'orders', jsonb_build_object('n', g), 'WAIT', now() + (g - {b} / 2) * interval '1 second'
           FROM generate_series(1, {b}) g;",
        p.index_history,
        p.index_sending,
        b = p.index_backlog
    ))
    .await?;
    c.batch_execute("VACUUM ANALYZE outbox_scheduled").await?;
    let first = "SELECT min(id) FROM outbox_scheduled WHERE status = 'WAIT'";
    Ok(c.query_one(first, &[]).await?.get(0))
}

/// EXPLAIN (ANALYZE, BUFFERS) of `sql`, and the top node's shared buffers.
async fn plan(c: &Client, sql: &str) -> Result<(String, i64)> {
    let lines: Vec<String> = c
        .query(
            &format!("EXPLAIN (ANALYZE, BUFFERS, COSTS OFF, TIMING OFF) {sql}"),
            &[],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let buffers = lines
        .iter()
        .find_map(|l| l.trim().strip_prefix("Buffers: shared "))
        .map(|b| {
            b.split_whitespace()
                .filter_map(|kv| kv.split_once('='))
                .filter(|(k, _)| matches!(*k, "hit" | "read"))
                .filter_map(|(_, v)| v.parse::<i64>().ok())
                .sum()
        })
        .unwrap_or(0);
    Ok((lines.join("\n"), buffers))
}

/// The plan of `sql` (with `lock` appended, as in the claim), then `sql` run back to back for
/// `time` over the simple query protocol (what pgbench does by default), one session.
async fn query(c: &Client, sql: &str, lock: &str, time: Duration) -> Result<Query> {
    let (plan, buffers) = plan(c, &format!("{sql}{lock}")).await?;
    let mut h = hist();
    let t0 = Instant::now();
    while t0.elapsed() < time {
        let t = Instant::now();
        c.simple_query(sql).await?;
        h.record((t.elapsed().as_micros() as u64).max(1))?;
    }
    Ok(Query {
        plan,
        buffers,
        calls: h.len(),
        mean_us: h.mean(),
        p99_us: h.value_at_quantile(0.99) as f64,
    })
}

async fn sizes(c: &Client, d: &Design) -> Result<[i64; 2]> {
    let sql = "SELECT pg_relation_size($1::text::regclass), pg_relation_size($2::text::regclass)";
    let r = c.query_one(sql, &[&d.indexes[0], &d.indexes[1]]).await?;
    Ok([r.get(0), r.get(1)])
}

/// One design on a freshly built table: plans and latency of both queries, then the drain of the
/// whole backlog made due (claim 100 + ack in one server-side loop), then the sizes.
async fn measure(c: &Client, p: &Profile, d: &Design) -> Result<DesignRun> {
    progress!("    {}", d.label);
    let first = build(c, p).await.context("building the table")?;
    let built = sizes(c, d).await?;
    let mut queries = Vec::new();
    for (_, sql, lock) in PATHS {
        queries.push(query(c, sql, lock, p.index_time).await?);
    }
    // The drain `repeats` times from the same state (the backlog made due again), keeping the
    // fastest, as the other drains of the bench do.
    let (mut drain_ms, mut drained) = (f64::INFINITY, p.index_backlog);
    for _ in 0..p.repeats {
        c.execute(
            "UPDATE outbox_scheduled SET status = 'WAIT', next_retry_time = now() - interval '1 hour',
                    claim_owner = NULL, claim_token = NULL, claimed_at = NULL WHERE id >= $1",
            &[&first],
        )
        .await?;
        c.batch_execute("VACUUM ANALYZE outbox_scheduled").await?;
        let t0 = Instant::now();
        // One transaction per claim and its ack, as a relay has them (a claim refuses a
        // transaction that has written).
        c.batch_execute(
            "DO $$ DECLARE tok bigint; ids bigint[]; BEGIN LOOP
               SELECT max(claim_token), array_agg(id) INTO tok, ids FROM outbox_claim('bench', 100);
               EXIT WHEN ids IS NULL;
               PERFORM outbox_ack('bench', tok, ids);
               COMMIT;
             END LOOP; END $$",
        )
        .await?;
        drain_ms = drain_ms.min(t0.elapsed().as_secs_f64() * 1000.0);
        let done = "SELECT count(*) FROM outbox_scheduled WHERE id >= $1 AND status = 'SUCCESS'";
        drained = drained.min(c.query_one(done, &[&first]).await?.get(0));
    }
    Ok(DesignRun {
        label: d.label,
        queries,
        drain_ms,
        drained,
        built,
        after: sizes(c, d).await?,
    })
}

/// "partial 1.8× faster" / "no difference (within 10 %)": shipped against seed, lower is better.
fn verdict(shipped: f64, seed: f64, better: &str, worse: &str) -> (i32, String) {
    let r = seed / shipped.max(1e-9);
    if (1.0 - NOISE..=1.0 + NOISE).contains(&r) {
        (0, format!("no difference (within {:.0} %)", NOISE * 100.0))
    } else if r > 1.0 {
        (1, format!("partial {r:.1}× {better}"))
    } else {
        (-1, format!("partial {:.1}× {worse}", 1.0 / r))
    }
}

/// The comparison's sentence, built from the figures.
fn conclusion(p: &Profile, s: &DesignRun, c: &DesignRun) -> String {
    let drain = format!("drain of {}", num(p.index_backlog as f64));
    let mut times: Vec<(&str, f64, f64)> = (PATHS.iter().zip(&s.queries).zip(&c.queries))
        .map(|(((name, ..), a), b)| (*name, a.mean_us, b.mean_us))
        .collect();
    times.push((&drain, s.drain_ms * 1000.0, c.drain_ms * 1000.0));
    let (mut parts, mut slower) = (Vec::new(), 0);
    for (name, a, b) in times {
        let (v, text) = verdict(a, b, "faster", "slower");
        slower += (v < 0) as usize;
        parts.push(format!("{name}: {} vs {} ms, {text}", ms(a), ms(b)));
    }
    for (((name, ..), a), b) in PATHS.iter().zip(&s.queries).zip(&c.queries) {
        let (_, text) = verdict(a.buffers as f64, b.buffers as f64, "fewer", "more");
        parts.push(format!(
            "{name}: {} vs {} plan buffers, {text}",
            a.buffers, b.buffers
        ));
    }
    let (a, b) = (s.after.iter().sum::<i64>(), c.after.iter().sum::<i64>());
    let (smaller, text) = verdict(a as f64, b as f64, "smaller", "larger");
    parts.push(format!(
        "hot-path indexes after the drain: {} vs {}, {text}",
        bytes(a),
        bytes(b)
    ));
    let support = match (slower, smaller > 0) {
        (0, true) => "the figures support the shipped partial design".to_string(),
        (0, false) => "the partial indexes are not smaller here".to_string(),
        (n, _) => format!("partial is slower on {n} of 3 timings here: re-run on a quiet machine before concluding"),
    };
    format!(
        "Partial (shipped) vs composite (seed): {}; {support}.",
        parts.join("; ")
    )
}

fn design_json(d: &DesignRun) -> Value {
    let q = |q: &Query| json!({"mean_us": q.mean_us, "p99_us": q.p99_us, "calls": q.calls, "plan_buffers": q.buffers});
    json!({
        "design": d.label,
        "claim": q(&d.queries[0]),
        "reclaim": q(&d.queries[1]),
        "drain_ms": d.drain_ms,
        "drained": d.drained,
        "index_bytes_built": d.built,
        "index_bytes_after_drain": d.after,
    })
}

fn markdown(p: &Profile, s: &DesignRun, c: &DesignRun, conclusion: &str) -> String {
    let mut t = Table::new(&["", SEED.label, SHIPPED.label]);
    let secs = p.index_time.as_secs_f64();
    for (i, (name, ..)) in PATHS.iter().enumerate() {
        let (a, b) = (&c.queries[i], &s.queries[i]);
        let lat = |q: &Query| format!("{} ({})", ms(q.mean_us), ms(q.p99_us));
        t.row(vec![
            format!("{name}: mean (p99) ms, {secs} s, 1 session"),
            lat(a),
            lat(b),
        ]);
        t.row(vec![
            format!("{name}: shared buffers in the plan"),
            a.buffers.to_string(),
            b.buffers.to_string(),
        ]);
    }
    let backlog = num(p.index_backlog as f64);
    let drain = |d: &DesignRun| format!("{:.0}", d.drain_ms);
    t.row(vec![
        format!(
            "drain {backlog} due rows, claim 100 + ack, ms (fastest of {})",
            p.repeats
        ),
        drain(c),
        drain(s),
    ]);
    for (when, f) in [
        ("built", (|d| d.built) as fn(&DesignRun) -> [i64; 2]),
        ("after the drain", |d| d.after),
    ] {
        let size = |d: &DesignRun| format!("{} + {}", bytes(f(d)[0]), bytes(f(d)[1]));
        t.row(vec![
            format!("hot-path index sizes, {when}"),
            size(c),
            size(s),
        ]);
    }
    let mut md = format!(
        "Table `outbox_scheduled`: {} SUCCESS rows, {} SENDING rows (about half with leases older than 10 min), \
         {backlog} WAIT rows (half due), built afresh for each design with its indexes in place; the queries \
         run back to back over the simple query protocol, as pgbench does.\n\n{}\n**Conclusion** \
         (computed from the figures above): {conclusion}\n\nPlans (EXPLAIN ANALYZE, BUFFERS; the \
         claim with its `FOR UPDATE SKIP LOCKED`):\n\n",
        num(p.index_history as f64),
        num(p.index_sending as f64),
        t.render()
    );
    for d in [s, c] {
        for ((name, ..), q) in PATHS.iter().zip(&d.queries) {
            md += &format!("{}, {name}:\n\n```\n{}\n```\n\n", d.label, q.plan);
        }
    }
    md
}

/// Runs the comparison in a scratch database of its own (it replaces the extension's indexes).
pub async fn run(p: &Profile, server: &str, r: &mut Results) -> Result<()> {
    progress!("==> 8. index comparison");
    let db = TestDb::create_on(server, "outbox_index_bench");
    let c = db.client().await?;
    let shipped = measure(&c, p, &SHIPPED).await?;
    c.batch_execute(TO_SEED).await?;
    let seed = measure(&c, p, &SEED).await?;
    for d in [&shipped, &seed] {
        if d.drained != p.index_backlog {
            r.failures.push(format!(
                "index comparison, {}: the drain acked {} of {} rows",
                d.label, d.drained, p.index_backlog
            ));
        }
    }
    let text = conclusion(p, &shipped, &seed);
    r.indexes_md = Some(markdown(p, &shipped, &seed, &text));
    r.indexes = Some(json!({
        "history_rows": p.index_history,
        "sending_rows": p.index_sending,
        "backlog_rows": p.index_backlog,
        "query_secs": p.index_time.as_secs_f64(),
        "designs": [design_json(&seed), design_json(&shipped)],
        "conclusion": text,
    }));
    Ok(())
}
