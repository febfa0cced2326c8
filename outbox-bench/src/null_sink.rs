//! Null-sink drain (report section 2): N claim loops (claim -> ack, no broker) on a fresh backlog,
//! the matrix of loops x batch sizes, the best one with `synchronous_commit = off`, and the
//! headline run.

use anyhow::{bail, Result};
use hdrhistogram::Histogram;
use std::time::{Duration, Instant};
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, Row, Statement};

use outbox_tests::db::TestDb;

use crate::db::{self, BenchDb};
use crate::report::{ms, num, Table};
use crate::results::Results;
use crate::sys::{HostMeter, ProcSnapshot};
use crate::Profile;

pub struct DrainRun {
    pub loops: usize,
    /// The claim sessions ran with `synchronous_commit = off`.
    pub sync_off: bool,
    pub batch: i32,
    pub backlog: i64,
    pub drained: i64,
    pub secs: f64,
    pub complete: bool,
    pub db_cpu_secs: Option<f64>,
    pub host_busy_pct: f64,
    /// Share of all CPUs used by other processes on the machine meanwhile.
    pub other_pct: f64,
    /// Claimed ids seen more than once (must be 0).
    pub duplicates: usize,
    pub claim_hist: Histogram<u64>,
    pub ack_hist: Histogram<u64>,
}

impl DrainRun {
    pub fn rate(&self) -> f64 {
        self.drained as f64 / self.secs
    }
    pub fn cpu_us_per_event(&self) -> Option<f64> {
        self.db_cpu_secs
            .map(|c| c * 1e6 / self.drained.max(1) as f64)
    }
}

/// The null sink's claim (the columns a relay reads) and ack, `$1` owner, `$2` batch or token,
/// `$3` the claimed ids.
pub const CLAIM_SQL: &str = "SELECT id, claim_token, topic, event_key, event_type, payload::text, headers::text FROM outbox_claim($1::text, $2::int)";
pub const ACK_SQL: &str = "SELECT outbox_ack($1::text, $2::bigint, $3::bigint[])";

/// How the claim loops send their statements.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Statements {
    /// Prepared once per session; each call is Bind/Execute.
    #[default]
    Named,
    /// Parsed and planned on every call (Parse/Bind/Execute in one round trip), as through a
    /// transaction-mode pooler.
    Unnamed,
}

/// How the claim loops' sessions run.
#[derive(Clone, Copy, Debug, Default)]
pub struct Sessions {
    /// `synchronous_commit = off`.
    pub sync_off: bool,
    pub statements: Statements,
}

/// What one claim loop did: events acked, every id it claimed, claim and ack times (µs), and
/// claimed events that `outbox_ack` did not acknowledge.
pub struct LoopOut {
    pub acked: i64,
    pub ids: Vec<i64>,
    pub claim: Histogram<u64>,
    pub ack: Histogram<u64>,
    pub short_acks: i64,
}

/// Drains a fresh backlog of `backlog` events with `loops` claim loops (claim -> ack, no broker).
/// Stops when the backlog is empty or after `cap`. With `collect_ids`, every claimed id is
/// checked for double claims.
pub async fn drain(
    db: &TestDb,
    monitor: &Client,
    loops: usize,
    batch: i32,
    backlog: i64,
    cap: Duration,
    sessions: Sessions,
) -> Result<DrainRun> {
    let Sessions {
        sync_off,
        statements,
    } = sessions;
    db::fill_backlog(monitor, backlog, "bench.drain").await?;
    let mut clients = Vec::new();
    let mut pids = Vec::new();
    for _ in 0..loops {
        let c = db.client().await?;
        if sync_off {
            c.batch_execute("SET synchronous_commit = off").await?;
        }
        pids.push(db::backend_pid(&c).await?);
        clients.push(c);
    }
    let cpu0 = ProcSnapshot::take(&pids);
    let host0 = HostMeter::start();
    let start = Instant::now();
    let deadline = start + cap;
    let mut tasks = Vec::new();
    for (i, c) in clients.into_iter().enumerate() {
        tasks.push(tokio::spawn(claim_loop(
            c,
            format!("bench-null-{i}"),
            batch,
            deadline,
            statements,
        )));
    }
    let mut outs = Vec::new();
    let mut keep = Vec::new();
    for t in tasks {
        let (o, c) = t.await??;
        outs.push(o);
        keep.push(c);
    }
    let secs = start.elapsed().as_secs_f64();
    // Before the loops disconnect: an exited backend's CPU is gone from /proc.
    let cpu1 = ProcSnapshot::take(&pids);
    drop(keep);
    let db_cpu = if cpu1.0.is_empty() {
        None
    } else {
        Some(cpu1.cpu_secs_since(&cpu0))
    };
    let (host_busy, other_pct) = host0.stop(db_cpu.unwrap_or(0.0));

    let mut all: Vec<i64> = outs.iter().flat_map(|o| o.ids.iter().copied()).collect();
    let claimed = all.len();
    all.sort_unstable();
    all.dedup();
    let duplicates = claimed - all.len();
    let drained: i64 = outs.iter().map(|o| o.acked).sum();
    let short: i64 = outs.iter().map(|o| o.short_acks).sum();
    if short > 0 {
        bail!("{short} claimed events were not acknowledged by outbox_ack (lost lease?)");
    }
    let mut claim_hist = crate::report::hist();
    let mut ack_hist = crate::report::hist();
    for o in &outs {
        claim_hist.add(&o.claim).expect("hist");
        ack_hist.add(&o.ack).expect("hist");
    }
    let (due, sending) = db::stats_pending(monitor).await?;
    let complete = due == 0 && sending == 0;
    progress!(
        "    -> {:.0} events/s ({drained} events in {secs:.2} s{})",
        drained as f64 / secs,
        if complete { "" } else { ", time cap" }
    );
    if complete {
        let ok = db::count_status(monitor, "SUCCESS").await?;
        if ok != backlog {
            bail!("drain finished with {ok} SUCCESS rows for a backlog of {backlog}");
        }
    }
    Ok(DrainRun {
        loops,
        sync_off,
        batch,
        backlog,
        drained,
        secs,
        complete,
        db_cpu_secs: db_cpu,
        host_busy_pct: host_busy,
        other_pct,
        duplicates,
        claim_hist,
        ack_hist,
    })
}

/// One claim loop of the null sink: `outbox_claim(owner, batch)` (the columns a relay reads),
/// then `outbox_ack` of the whole batch, until a claim returns nothing or `deadline`.
pub async fn claim_loop(
    c: Client,
    owner: String,
    batch: i32,
    deadline: Instant,
    statements: Statements,
) -> Result<(LoopOut, Client)> {
    let claim = c.prepare(CLAIM_SQL).await?;
    let ack = c.prepare(ACK_SQL).await?;
    let mut out = LoopOut {
        acked: 0,
        ids: Vec::new(),
        claim: crate::report::hist(),
        ack: crate::report::hist(),
        short_acks: 0,
    };
    while Instant::now() < deadline {
        let t0 = Instant::now();
        let params: [(&(dyn ToSql + Sync), Type); 2] = [(&owner, Type::TEXT), (&batch, Type::INT4)];
        let rows = call(&c, statements, (&claim, CLAIM_SQL), &params).await?;
        out.claim.saturating_record(t0.elapsed().as_micros() as u64);
        if rows.is_empty() {
            break;
        }
        let token: i64 = rows[0].get(1);
        let ids: Vec<i64> = rows.iter().map(|r| r.get(0)).collect();
        let t1 = Instant::now();
        let params: [(&(dyn ToSql + Sync), Type); 3] = [
            (&owner, Type::TEXT),
            (&token, Type::INT8),
            (&ids, Type::INT8_ARRAY),
        ];
        let n: i32 = call(&c, statements, (&ack, ACK_SQL), &params).await?[0].get(0);
        out.ack.saturating_record(t1.elapsed().as_micros() as u64);
        out.short_acks += ids.len() as i64 - n as i64;
        out.acked += n as i64;
        out.ids.extend(ids);
    }
    Ok((out, c))
}

/// One statement's rows: the prepared `stmt`, or `sql` unnamed.
async fn call(
    c: &Client,
    how: Statements,
    (stmt, sql): (&Statement, &str),
    params: &[(&(dyn ToSql + Sync), Type)],
) -> Result<Vec<Row>, tokio_postgres::Error> {
    match how {
        Statements::Named => {
            let values: Vec<_> = params.iter().map(|(v, _)| *v).collect();
            c.query(stmt, &values).await
        }
        Statements::Unnamed => c.query_typed(sql, params).await,
    }
}

pub fn drain_table(runs: &[DrainRun]) -> String {
    let mut t = Table::new(&[
        "claim loops",
        "batch",
        "events",
        "events/s",
        "DB CPU µs/event",
        "host CPU busy (other load)",
        "claim p50 / p99 ms",
        "ack p50 / p99 ms",
        "double claims",
    ]);
    for r in runs {
        t.row(vec![
            r.loops.to_string(),
            if r.sync_off {
                format!("{} (`synchronous_commit = off`)", r.batch)
            } else {
                r.batch.to_string()
            },
            format!(
                "{}{}",
                num(r.drained as f64),
                if r.complete { "" } else { " (time cap)" }
            ),
            num(r.rate()),
            r.cpu_us_per_event()
                .map(|c| format!("{c:.1}"))
                .unwrap_or_else(|| "n/a".into()),
            format!("{:.0} % ({:.0} %)", r.host_busy_pct, r.other_pct),
            format!(
                "{} / {}",
                ms(r.claim_hist.value_at_quantile(0.5) as f64),
                ms(r.claim_hist.value_at_quantile(0.99) as f64)
            ),
            format!(
                "{} / {}",
                ms(r.ack_hist.value_at_quantile(0.5) as f64),
                ms(r.ack_hist.value_at_quantile(0.99) as f64)
            ),
            r.duplicates.to_string(),
        ]);
    }
    t.render()
}

/// The loops x batches matrix (best of `p.repeats` runs each), then its best configuration with
/// `synchronous_commit = off` in the claim sessions.
pub async fn run(p: &Profile, db: &TestDb, monitor: &Client, r: &mut Results) -> Result<()> {
    let smoke = p.name == "smoke";
    progress!("==> 2. null-sink drain matrix");
    for &loops in &p.loops {
        for &batch in &p.batches {
            progress!(
                "  {} events, {loops} loop(s), batch {batch}",
                num(p.matrix_backlog as f64)
            );
            let mut best: Option<DrainRun> = None;
            for _ in 0..p.repeats {
                let run = matrix_drain(p, db, monitor, (loops, batch), false).await?;
                check_drain(&run, "null-sink drain", smoke, &mut r.failures);
                if best.as_ref().is_none_or(|b| run.rate() > b.rate()) {
                    best = Some(run);
                }
            }
            r.matrix.extend(best);
        }
    }
    // The relay may commit its claims and acks without waiting for the WAL flush: a lost
    // claim or ack after a crash only means the event is sent again (at-least-once anyway).
    if let Some((loops, batch)) = best_config(&r.matrix) {
        progress!("  same as the best, with synchronous_commit = off in the claim sessions");
        let run = matrix_drain(p, db, monitor, (loops, batch), true).await?;
        check_drain(
            &run,
            "null-sink drain (sync commit off)",
            smoke,
            &mut r.failures,
        );
        r.sync_off = Some(run);
    }
    Ok(())
}

/// One drain of the matrix's backlog and time cap with (loops, batch).
async fn matrix_drain(
    p: &Profile,
    db: &TestDb,
    monitor: &Client,
    (loops, batch): (usize, i32),
    sync_off: bool,
) -> Result<DrainRun> {
    drain(
        db,
        monitor,
        loops,
        batch,
        p.matrix_backlog,
        p.matrix_cap,
        p.sessions(sync_off),
    )
    .await
}

/// The headline drain: the best configuration of the matrix on the full backlog; returns the
/// events it drained (for the table health section).
pub async fn headline(p: &Profile, db: &TestDb, monitor: &Client, r: &mut Results) -> Result<i64> {
    // The headline drain: the best configuration of the matrix on the full backlog.
    let (loops, batch) = best_config(&r.matrix).unwrap_or((2, 100));
    progress!(
        "==> 2/6. headline null-sink drain: {} events, {loops} loop(s), batch {batch}",
        num(p.headline_backlog as f64)
    );
    let run = drain(
        db,
        monitor,
        loops,
        batch,
        p.headline_backlog,
        Duration::from_secs(600),
        p.sessions(false),
    )
    .await?;
    check_drain(&run, "headline null-sink drain", true, &mut r.failures);
    let drained = run.drained;
    r.headline = Some(run);
    Ok(drained)
}

pub fn best_config(runs: &[DrainRun]) -> Option<(usize, i32)> {
    runs.iter()
        .max_by(|a, b| a.rate().total_cmp(&b.rate()))
        .map(|b| (b.loops, b.batch))
}

pub fn find_run(runs: &[DrainRun], loops: usize, batch: i32) -> Option<&DrainRun> {
    runs.iter().find(|r| r.loops == loops && r.batch == batch)
}

/// Double claims always fail the run; an unfinished drain fails it when `strict` (the smoke
/// profile, and drains without a practical time cap).
pub fn check_drain(run: &DrainRun, what: &str, strict: bool, failures: &mut Vec<String>) {
    if run.duplicates > 0 {
        failures.push(format!(
            "{what}: {} double claims with {} loops",
            run.duplicates, run.loops
        ));
    }
    if !run.complete && (strict || run.drained == 0) {
        failures.push(format!(
            "{what}: drain not complete ({} of {} events)",
            run.drained, run.backlog
        ));
    }
}

pub fn markdown(p: &Profile, r: &Results) -> String {
    let mut s = String::new();
    if r.matrix.is_empty() {
        s += "Not run.\n";
    } else {
        s += &format!(
            "A fresh backlog of {} due events per run (TRUNCATE, INSERT, VACUUM ANALYZE), drained by \
             N claim loops, each its own connection: `outbox_claim(owner, batch)` then `outbox_ack` of \
             the whole batch, until a claim returns nothing (or the {:.0} s cap). Best of {} run(s) \
             per row: other work shares this machine, and \"other load\" is the share of all CPUs \
             that other processes used during the reported run. DB CPU is user + system time of the \
             loops' backends from /proc, per event.\n\n",
            num(p.matrix_backlog as f64),
            p.matrix_cap.as_secs_f64(),
            p.repeats
        );
        s += &drain_table(&r.matrix);
        if let Some(so) = &r.sync_off {
            s += &format!(
                "\nThe best configuration again with `SET synchronous_commit = off` in the claim sessions \
                 (safe for a relay: a claim or ack lost in a crash only means the event is sent again, \
                 which at-least-once delivery allows):\n\n{}",
                drain_table(std::slice::from_ref(so))
            );
        }
    }
    if let Some(h) = &r.headline {
        s += &format!(
            "\nHeadline run on {} events with the best configuration above:\n\n",
            num(h.backlog as f64)
        );
        s += &drain_table(std::slice::from_ref(h));
    }
    s
}
