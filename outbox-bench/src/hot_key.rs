//! Claim cost at a hot key (report section 7): one `outbox_claim` at a single key holding a small
//! and a large backlog, as shared buffers touched and time per call.

use anyhow::{bail, Result};
use serde_json::{json, Value};
use std::time::Instant;
use tokio_postgres::Client;

use outbox_tests::db::TestDb;

use crate::db::{BenchDb, TRUNCATE_OUTBOX};
use crate::ordering::fill;
use crate::report::{ms, num, Goal, Table};
use crate::results::Results;
use crate::Profile;

/// Goal: the claim at the largest backlog within this factor of the smallest (buffers and time).
pub const CLAIM_COST_GOAL_FACTOR: f64 = 2.0;
/// The claim measured: `outbox_claim('bench', 100)`, rolled back. 100 is the smallest backlog, so
/// every call claims the same batch and the figures differ by the backlog alone (with 500, the
/// call at 100 waiting claimed 100 events and the others 500, which compared batch sizes).
pub const CLAIM_MAX_EVENTS: i32 = 100;
const CLAIM_SQL: &str = "SELECT count(*) FROM outbox_claim($1, $2) /* bench-claim-cost */";

/// One `outbox_claim` at a single key with `waiting` WAIT events, medians over `calls` calls.
pub struct ClaimCost {
    pub waiting: i64,
    pub claimed: i64,
    pub calls: usize,
    /// Shared buffers touched (hit + read) per call, the empty-transaction baseline subtracted.
    pub buffers: f64,
    pub us_median: f64,
    pub us_p90: f64,
    /// The claim that opened the window (committed, then acked): it reads the window's id bounds
    /// once, over the whole backlog.
    pub first_buffers: f64,
    pub first_us: f64,
}

pub struct ClaimCosts {
    /// How buffers were counted: `pg_stat_statements` or `pg_stat_database`.
    pub method: &'static str,
    /// Median buffers of the same sequence with an empty transaction (subtracted above).
    pub baseline: f64,
    pub runs: Vec<ClaimCost>,
}

/// Whether pg_stat_statements is loaded by the server and can be created in the scratch database.
async fn pg_stat_statements(c: &Client) -> bool {
    let loaded: bool = match c
        .query_one(
            "SELECT current_setting('shared_preload_libraries') ~ '(^|[\\s,])pg_stat_statements([\\s,]|$)'",
            &[],
        )
        .await
    {
        Ok(row) => row.get(0),
        Err(_) => false,
    };
    loaded
        && c.batch_execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            .await
            .is_ok()
}

/// Shared buffers (hit + read) counted so far: this database's top-level claim statements in
/// pg_stat_statements, or the whole scratch database (only this session works in it) after
/// flushing this session's pending statistics.
async fn buffers(c: &Client, method: &str) -> Result<f64> {
    let row = if method == "pg_stat_statements" {
        c.query_one(
            "SELECT coalesce(sum(shared_blks_hit + shared_blks_read), 0)::float8 FROM pg_stat_statements
              WHERE toplevel AND dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
                AND query LIKE $1",
            &[&"%bench-claim-cost%"],
        )
        .await?
    } else {
        c.batch_execute("SELECT pg_stat_force_next_flush()").await?;
        c.query_one(
            "SELECT (blks_hit + blks_read)::float8 FROM pg_stat_database WHERE datname = current_database()",
            &[],
        )
        .await?
    };
    Ok(row.get(0))
}

fn median(v: &mut [f64]) -> f64 {
    quantile(v, 0.5)
}

fn quantile(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(((v.len().max(1) - 1) as f64 * q).round() as usize)
        .copied()
        .unwrap_or(f64::NAN)
}

/// The first claim of the backlog, committed and acked: it opens the cursor's window, so the
/// measured claims after it start inside that window. Its buffers (the ack not counted) and µs.
async fn open_window(c: &Client, method: &str) -> Result<(f64, f64)> {
    c.batch_execute("VACUUM outbox_stream, outbox_stream_cursor")
        .await?;
    let b0 = buffers(c, method).await?;
    let t = Instant::now();
    let row = c
        .query_one(
            "SELECT array_agg(id), max(claim_token) FROM outbox_claim($1, $2) /* bench-claim-cost */",
            &[&"bench", &CLAIM_MAX_EVENTS],
        )
        .await?;
    let us = t.elapsed().as_secs_f64() * 1e6;
    let b1 = buffers(c, method).await?;
    let (ids, token): (Vec<i64>, i64) = (row.get(0), row.get(1));
    c.execute("SELECT outbox_ack('bench', $1, $2)", &[&token, &ids])
        .await?;
    Ok((b1 - b0, us))
}

/// `calls` times: VACUUM of the tables a claim reads (same state for every call), then BEGIN, the
/// statement, ROLLBACK. Returns the buffers and µs of each call and the claimed count of the last.
async fn measure(
    c: &Client,
    method: &str,
    sql: &str,
    calls: usize,
) -> Result<(Vec<f64>, Vec<f64>, i64)> {
    let stmt = c.prepare(sql).await?;
    let (mut bufs, mut times, mut claimed) = (Vec::new(), Vec::new(), 0);
    // One call more than measured: the first warms the caches and the plan.
    for i in 0..=calls {
        c.batch_execute(
            "VACUUM outbox_scheduled, outbox_key, outbox_stream, outbox_stream_cursor, outbox_stream_batch",
        )
        .await?;
        let b0 = buffers(c, method).await?;
        c.batch_execute("BEGIN").await?;
        let t = Instant::now();
        let row = if sql == CLAIM_SQL {
            c.query_one(&stmt, &[&"bench", &CLAIM_MAX_EVENTS]).await?
        } else {
            c.query_one(&stmt, &[]).await?
        };
        let us = t.elapsed().as_secs_f64() * 1e6;
        c.batch_execute("ROLLBACK").await?;
        let b1 = buffers(c, method).await?;
        claimed = row.get(0);
        if i > 0 {
            bufs.push(b1 - b0);
            times.push(us);
        }
    }
    Ok((bufs, times, claimed))
}

/// Section 7b: one claim at a single key holding each of the profile's backlogs.
pub async fn run(p: &Profile, db: &TestDb, r: &mut Results) -> Result<()> {
    progress!("==> 7. claim cost at a hot key");
    let c = db.client().await?;
    let method = if pg_stat_statements(&c).await {
        "pg_stat_statements"
    } else {
        "pg_stat_database"
    };
    let calls = p.claim_cost_calls;
    let (mut base, _, _) = measure(&c, method, "SELECT 0::bigint", calls).await?;
    let baseline = median(&mut base);
    let mut runs = Vec::new();
    for &waiting in &p.claim_cost_backlogs {
        progress!(
            "  one key, {} waiting events, {calls} calls",
            num(waiting as f64)
        );
        fill(db, waiting + i64::from(CLAIM_MAX_EVENTS), 1, true).await?;
        let (first_buffers, first_us) = open_window(&c, method).await?;
        let (mut bufs, mut times, claimed) = measure(&c, method, CLAIM_SQL, calls).await?;
        if claimed != waiting.min(CLAIM_MAX_EVENTS as i64) {
            bail!("claim at one key with {waiting} waiting events claimed {claimed}");
        }
        let cost = ClaimCost {
            waiting,
            claimed,
            calls,
            buffers: median(&mut bufs) - baseline,
            us_median: median(&mut times),
            us_p90: quantile(&mut times, 0.9),
            first_buffers: first_buffers - baseline,
            first_us,
        };
        progress!(
            "    -> {:.0} buffers, {} ms per claim of {claimed} events",
            cost.buffers,
            ms(cost.us_median)
        );
        runs.push(cost);
    }
    c.batch_execute(TRUNCATE_OUTBOX).await?;
    r.claim_cost = Some(ClaimCosts {
        method,
        baseline,
        runs,
    });
    Ok(())
}

/// Large backlog vs small: (buffers factor, time factor), from the first and last sizes.
fn claim_factors(c: &ClaimCosts) -> Option<(&ClaimCost, &ClaimCost, f64, f64)> {
    let (small, large) = (c.runs.first()?, c.runs.last()?);
    if c.runs.len() < 2 {
        return None;
    }
    let bf = large.buffers / small.buffers.max(1.0);
    Some((small, large, bf, large.us_median / small.us_median))
}

pub fn goal(r: &Results) -> Goal {
    let name = "claim cost at a hot key's backlog".to_string();
    let target = format!("largest backlog ≤ {CLAIM_COST_GOAL_FACTOR}× smallest (buffers and time)");
    let Some((small, large, bf, tf)) = r.claim_cost.as_ref().and_then(claim_factors) else {
        return Goal::not_measured(name, target);
    };
    Goal {
        name,
        target,
        measured: format!(
            "{} vs {} waiting: {:.0} vs {:.0} buffers, {} vs {} ms per call",
            num(large.waiting as f64),
            num(small.waiting as f64),
            large.buffers,
            small.buffers,
            ms(large.us_median),
            ms(small.us_median)
        ),
        met: Some(bf <= CLAIM_COST_GOAL_FACTOR && tf <= CLAIM_COST_GOAL_FACTOR),
        note: format!(
            "buffers {bf:.2}×, time {tf:.2}×; it claims {} vs {} events (per claimed event: \
             {:.1} vs {:.1} buffers); the claim that opens the window reads its bounds once: \
             {:.0} vs {:.0} buffers, {} vs {} ms",
            large.claimed,
            small.claimed,
            large.buffers / large.claimed.max(1) as f64,
            small.buffers / small.claimed.max(1) as f64,
            large.first_buffers,
            small.first_buffers,
            ms(large.first_us),
            ms(small.first_us),
        ),
    }
}

pub fn markdown(r: &Results) -> String {
    let mut s = String::new();
    match &r.claim_cost {
        None => s += "Not run.\n",
        Some(c) => {
            s += &format!(
                "One key with N waiting events (enqueued through `outbox_enqueue`, plus one batch \
                 more): a first claim, committed and acked, opens the cursor's window (it reads the \
                 window's id bounds once: the last two columns); then `outbox_claim('bench', \
                 {CLAIM_MAX_EVENTS})` in a transaction that is rolled back, after a VACUUM so every call \
                 starts from the same state inside that window; medians of {} calls after one warm-up. Shared buffers \
                 (hit + read) from {}; the same sequence with an empty transaction ({:.0} buffers) \
                 is subtracted.\n\n",
                c.runs.first().map_or(0, |x| x.calls),
                if c.method == "pg_stat_statements" {
                    "`pg_stat_statements` (the top-level claim statement, nested work included)"
                } else {
                    "the scratch database's `pg_stat_database.blks_hit + blks_read` around each call, \
                     after `pg_stat_force_next_flush()` (pg_stat_statements is not in \
                     `shared_preload_libraries`; only the bench's session works in that database)"
                },
                c.baseline
            );
            let mut t = Table::new(&[
                "waiting events of the key",
                "events claimed",
                "shared buffers per call",
                "buffers per claimed event",
                "ms per call p50",
                "ms per call p90",
                "window-opening claim: buffers",
                "window-opening claim: ms",
            ]);
            for x in &c.runs {
                t.row(vec![
                    num(x.waiting as f64),
                    num(x.claimed as f64),
                    format!("{:.0}", x.buffers),
                    format!("{:.1}", x.buffers / x.claimed.max(1) as f64),
                    ms(x.us_median),
                    ms(x.us_p90),
                    format!("{:.0}", x.first_buffers),
                    ms(x.first_us),
                ]);
            }
            s += &t.render();
        }
    }
    s
}

pub fn json(r: &Results) -> Option<Value> {
    r.claim_cost.as_ref().map(|c| {
        json!({
            "method": c.method,
            "max_events": CLAIM_MAX_EVENTS,
            "baseline_buffers": c.baseline,
            "backlogs": c.runs.iter().map(|x| json!({
                "waiting": x.waiting,
                "claimed": x.claimed,
                "calls": x.calls,
                "buffers_median": x.buffers,
                "us_median": x.us_median,
                "window_opening_buffers": x.first_buffers,
                "window_opening_us": x.first_us,
                "us_p90": x.us_p90,
            })).collect::<Vec<_>>(),
        })
    })
}
