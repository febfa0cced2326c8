//! Long transactions (issue 9; report section 10): an open-loop producer at a fixed rate while one
//! claim loop drains to a null sink; after a warm-up at the same rate, a REPEATABLE READ
//! transaction opens on another connection and stays open through the measured part, and the
//! same without it is the control. Per interval of the measured part:
//! enqueue→ack latency of the events sent in it, the WAIT backlog, dead tuples and the size of
//! every index of the extension's tables.

use anyhow::{Context, Result};
use hdrhistogram::Histogram;
use outbox_worker::defaults;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_postgres::Client;

use outbox_tests::db::TestDb;

use crate::db::BenchDb;
use crate::ext_rels::{self, ExtRels};
use crate::latency::{self, Commit};
use crate::null_sink::{ACK_SQL, CLAIM_SQL};
use crate::report::{bytes, hist, ms, num, Goal, Table};
use crate::results::Results;
use crate::Profile;

const TOPIC: &str = "bench.held";
/// One producer connection per this many offered events/s, at most `MAX_PRODUCERS` (as in the
/// latency section).
const EVENTS_PER_PRODUCER: f64 = 100.0;
const MAX_PRODUCERS: usize = 16;
/// The claim loop's wait between empty claims.
const WAIT: &str = "100 ms";
/// Issue 9's goals: p99 of the last minute ≤ 2 × the first minute's; the backlog never above one
/// second of production.
pub const P99_GROWTH_GOAL: f64 = 2.0;
pub const BACKLOG_GOAL_SECS: f64 = 1.0;
const MINUTE: f64 = 60.0;

/// One reporting interval of a run.
pub struct Interval {
    pub to_s: f64,
    /// Enqueue→ack of the events whose statement was issued in the interval, µs.
    pub hist: Histogram<u64>,
    /// The largest WAIT count (`outbox_stats()`: due + delayed) of the samples taken each second.
    pub wait_max: i64,
    /// The extension's tables at the interval's end.
    pub rels: ExtRels,
    /// Server-wide checkpoints during the interval: how many started, and the buffers they wrote
    /// in it (`pg_stat_bgwriter`, reported by the checkpointer as it goes). Their stalls hit the
    /// control as much as the held run.
    pub ckpt_started: i64,
    pub ckpt_buffers: i64,
}

pub struct HeldRun {
    pub held: bool,
    /// Events with a key each (`order-<n>`: ordered, scheduled rows) or none (the stream).
    pub keyed: bool,
    pub rate: f64,
    pub secs: f64,
    /// The load before the measured part (and before the held transaction opens), s.
    pub warmup_secs: f64,
    pub interval_secs: f64,
    pub wake: String,
    pub sent: i64,
    pub acked: i64,
    pub achieved_rate: f64,
    pub intervals: Vec<Interval>,
    pub start: ExtRels,
    pub first_minute: Histogram<u64>,
    pub last_minute: Histogram<u64>,
    pub wait_max: i64,
    /// `age(backend_xmin)` of the held transaction's session at the end (transactions).
    pub held_xmin_age: Option<i32>,
    pub claims: u64,
    pub empty_claims: u64,
}

impl HeldRun {
    pub fn label(&self) -> String {
        format!(
            "{}, {}",
            if self.keyed {
                "keyed events"
            } else {
                "unkeyed events"
            },
            if self.held {
                "REPEATABLE READ transaction held open"
            } else {
                "control (no held transaction)"
            }
        )
    }
    pub fn p99_ratio(&self) -> f64 {
        self.last_minute.value_at_quantile(0.99) as f64
            / (self.first_minute.value_at_quantile(0.99) as f64).max(1.0)
    }
    pub fn missing(&self) -> i64 {
        self.sent - self.acked
    }
}

/// What the claim loop saw: when each id's ack returned, claims and empty claims, and claimed ids
/// `outbox_ack` did not acknowledge.
struct DrainOut {
    acked_at: HashMap<i64, Instant>,
    claims: u64,
    empty_claims: u64,
    short_acks: i64,
}

/// Claims (`outbox_claim(owner, relay default batch)`) and acks until `done` was set before an
/// empty claim, or `abort`; waits in `outbox_wait('100 ms')` after an empty claim. `expected`:
/// the events the run sends. The map is sized for them up front: growing it rehashes every entry
/// while the clock runs, which stalled the loop for up to ~150 ms at 115, 229 and 459 s of a
/// 10-minute run (~0.9 million entries), and those stalls were counted as the outbox's latency.
async fn drain_loop(
    c: Client,
    expected: usize,
    done: Arc<AtomicBool>,
    abort: Arc<AtomicBool>,
) -> Result<DrainOut> {
    let owner = "bench-held".to_string();
    let claim = c.prepare(CLAIM_SQL).await?;
    let ack = c.prepare(ACK_SQL).await?;
    let wait = c.prepare(&format!("SELECT outbox_wait('{WAIT}')")).await?;
    let mut out = DrainOut {
        acked_at: HashMap::with_capacity(expected),
        claims: 0,
        empty_claims: 0,
        short_acks: 0,
    };
    while !abort.load(Ordering::Relaxed) {
        let finished = done.load(Ordering::Acquire);
        let rows = c.query(&claim, &[&owner, &defaults::BATCH_SIZE]).await?;
        out.claims += 1;
        if rows.is_empty() {
            out.empty_claims += 1;
            if finished {
                break;
            }
            c.query_one(&wait, &[]).await?;
            continue;
        }
        let token: i64 = rows[0].get(1);
        let ids: Vec<i64> = rows.iter().map(|r| r.get(0)).collect();
        let n: i32 = c.query_one(&ack, &[&owner, &token, &ids]).await?.get(0);
        let at = Instant::now();
        out.short_acks += ids.len() as i64 - i64::from(n);
        for id in ids {
            out.acked_at.insert(id, at);
        }
    }
    Ok(out)
}

/// WAIT rows now (`outbox_stats()`: due + delayed).
/// Checkpoints started so far and the buffers they wrote (`pg_stat_bgwriter`).
async fn checkpoints(c: &Client) -> Result<(i64, i64)> {
    let r = c
        .query_one(
            "SELECT checkpoints_timed + checkpoints_req, buffers_checkpoint FROM pg_stat_bgwriter",
            &[],
        )
        .await?;
    Ok((r.get(0), r.get(1)))
}

async fn wait_count(c: &Client) -> Result<i64> {
    Ok(c.query_one(
        "SELECT (due_wait + delayed_wait)::bigint FROM outbox_stats()",
        &[],
    )
    .await?
    .get(0))
}

/// One run on a fresh database with the extension's default version.
async fn one(
    p: &Profile,
    server: &str,
    held: bool,
    keyed: bool,
    failures: &mut Vec<String>,
) -> Result<HeldRun> {
    let rate = p.held_rate;
    let secs = p.held_time.as_secs_f64();
    let step_secs = p.held_interval.as_secs().max(1);
    let step = step_secs as f64;
    progress!(
        "  {}, {}: {} events/s for {:.0} s, then {secs:.0} s measured",
        if keyed { "keyed" } else { "unkeyed" },
        if held {
            "held REPEATABLE READ transaction"
        } else {
            "control"
        },
        num(rate),
        p.held_warmup.as_secs_f64()
    );
    let db = TestDb::create_on(server, "outbox_bench_held");
    let monitor = db.client().await?;
    let wake: String = monitor
        .query_one("SELECT outbox_wake_mode()", &[])
        .await?
        .get(0);
    // The load runs `held_warmup` before the measured part, and the held transaction opens when
    // the measured part starts: its first minute is then an outbox in steady state, and, since
    // CREATE DATABASE forces a checkpoint, neither measured minute holds the end of a timed
    // checkpoint (see `markdown`).
    let warm = (rate * p.held_warmup.as_secs_f64()).round() as i64;
    let total = (rate * secs).round().max(1.0) as i64;
    let producers = ((rate / EVENTS_PER_PRODUCER).ceil() as usize).clamp(1, MAX_PRODUCERS);
    let mut clients = Vec::new();
    for _ in 0..producers {
        clients.push(db.client().await?);
    }
    let holder = if held { Some(db.client().await?) } else { None };
    let done = Arc::new(AtomicBool::new(false));
    let abort = Arc::new(AtomicBool::new(false));
    let drain = tokio::spawn(drain_loop(
        db.client().await?,
        (warm + total) as usize,
        done.clone(),
        abort.clone(),
    ));
    let load_start = tokio::time::Instant::now() + Duration::from_millis(100);
    let start = load_start + Duration::from_secs_f64(warm as f64 / rate);
    let mut tasks = Vec::new();
    for (k, c) in clients.into_iter().enumerate() {
        tasks.push(tokio::spawn(latency::producer(
            c,
            latency::ENQUEUE,
            TOPIC.to_string(),
            k as i64,
            producers as i64,
            warm + total,
            rate,
            load_start,
            keyed,
        )));
    }
    tokio::time::sleep_until(start).await;
    if let Some(h) = &holder {
        // As pg_dump would: a snapshot, and a share lock on every table behind the view.
        h.batch_execute(
            "BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT 1 FROM outbox_event LIMIT 1",
        )
        .await
        .context("opening the held transaction")?;
    }
    let holder_pid = match &holder {
        Some(h) => Some(crate::db::backend_pid(h).await?),
        None => None,
    };
    let start_rels = ext_rels::snapshot(&monitor).await?;
    let start_ckpt = checkpoints(&monitor).await?;

    // Samples: the WAIT count every second, the tables at each interval's end.
    let mut waits: Vec<(f64, i64)> = Vec::new();
    let mut snaps: Vec<(f64, ExtRels, (i64, i64))> = Vec::new();
    let mut tick = 1u64;
    loop {
        let t = tick as f64;
        if t > secs + 1e-9 {
            break;
        }
        tokio::time::sleep_until(start + Duration::from_secs(tick)).await;
        waits.push((t, wait_count(&monitor).await?));
        if tick.is_multiple_of(step_secs) || t + 1.0 > secs + 1e-9 {
            snaps.push((
                t,
                ext_rels::snapshot(&monitor).await?,
                checkpoints(&monitor).await?,
            ));
        }
        tick += 1;
    }
    let mut commits: Vec<Commit> = Vec::with_capacity((warm + total) as usize);
    for t in tasks {
        commits.extend(t.await??);
    }
    let last_commit = commits
        .iter()
        .map(|c| c.2)
        .max()
        .unwrap_or_else(|| start.into_std());
    let achieved_rate = total as f64 / (last_commit - start.into_std()).as_secs_f64().max(1e-9);
    done.store(true, Ordering::Release);
    // Let the loop drain what is left, within a bound.
    let settle = Duration::from_secs_f64((secs / 2.0).max(30.0));
    let drained = tokio::time::timeout(settle, async {
        while !drain.is_finished() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    if drained.is_err() {
        abort.store(true, Ordering::Relaxed);
    }
    let out = drain.await??;
    let held_xmin_age = match holder_pid {
        Some(pid) => monitor
            .query_one(
                "SELECT age(backend_xmin) FROM pg_stat_activity WHERE pid = $1",
                &[&pid],
            )
            .await?
            .get(0),
        None => None,
    };
    if let Some(h) = &holder {
        h.batch_execute("ROLLBACK").await?;
    }

    let t0 = start.into_std();
    let n_int = (secs / step).ceil().max(1.0) as usize;
    let mut hists: Vec<Histogram<u64>> = (0..n_int).map(|_| hist()).collect();
    let (mut first, mut last) = (hist(), hist());
    let (mut acked, mut warm_acked) = (0i64, 0i64);
    for (seq, issued, _, id, _) in &commits {
        let Some(at) = out.acked_at.get(id) else {
            continue;
        };
        if *seq < warm {
            warm_acked += 1;
            continue;
        }
        acked += 1;
        let us = at.saturating_duration_since(*issued).as_micros() as u64;
        let off = issued.saturating_duration_since(t0).as_secs_f64();
        let i = ((off / step) as usize).min(n_int - 1);
        hists[i].saturating_record(us);
        if off < MINUTE {
            first.saturating_record(us);
        }
        if off >= secs - MINUTE {
            last.saturating_record(us);
        }
    }
    if acked < total || warm_acked < warm || out.short_acks > 0 {
        failures.push(format!(
            "long transactions ({}, {}): {acked} of {total} events acked, {warm_acked} of the \
             {warm} sent before ({} claimed but not acked)",
            if keyed { "keyed" } else { "unkeyed" },
            if held { "held" } else { "control" },
            out.short_acks
        ));
    }
    let mut intervals = Vec::new();
    let mut snaps = snaps.into_iter().peekable();
    let mut rels = start_rels.clone();
    let mut ckpt = start_ckpt;
    let mut prev_end = 0.0;
    for (i, h) in hists.into_iter().enumerate() {
        let to_s = ((i + 1) as f64 * step).min(secs);
        let wait_max = waits
            .iter()
            .filter(|(t, _)| *t > prev_end && *t <= to_s + 1e-9)
            .map(|x| x.1)
            .max()
            .unwrap_or(0);
        // The tables as sampled at (or just before) the interval's end.
        let ckpt_before = ckpt;
        while let Some((t, _, _)) = snaps.peek() {
            if *t > to_s + 1e-9 {
                break;
            }
            if let Some((_, s, c)) = snaps.next() {
                rels = s;
                ckpt = c;
            }
        }
        intervals.push(Interval {
            to_s,
            hist: h,
            wait_max,
            rels: rels.clone(),
            ckpt_started: ckpt.0 - ckpt_before.0,
            ckpt_buffers: ckpt.1 - ckpt_before.1,
        });
        prev_end = to_s;
    }
    let run = HeldRun {
        held,
        keyed,
        rate,
        secs,
        warmup_secs: warm as f64 / rate,
        interval_secs: step,
        wake,
        sent: total,
        acked,
        achieved_rate,
        wait_max: waits.iter().map(|x| x.1).max().unwrap_or(0),
        intervals,
        start: start_rels,
        first_minute: first,
        last_minute: last,
        held_xmin_age,
        claims: out.claims,
        empty_claims: out.empty_claims,
    };
    progress!(
        "    -> achieved {:.0}/s; enqueue→ack p99 first minute {} ms, last minute {} ms; WAIT max {}; {} of {} acked",
        run.achieved_rate,
        ms(run.first_minute.value_at_quantile(0.99) as f64),
        ms(run.last_minute.value_at_quantile(0.99) as f64),
        run.wait_max,
        run.acked,
        run.sent
    );
    Ok(run)
}

/// Keyed events (scheduled rows) then unkeyed ones (the stream): the control, then the run with
/// the held transaction.
pub async fn run(p: &Profile, db: &TestDb, r: &mut Results) -> Result<()> {
    progress!("==> 10. long transactions: a held snapshot under steady load");
    for keyed in [true, false] {
        for held in [false, true] {
            let run = one(p, &db.server, held, keyed, &mut r.failures).await?;
            r.held.push(run);
        }
    }
    Ok(())
}

fn interval_table(run: &HeldRun) -> String {
    let indexes: Vec<String> = run
        .intervals
        .last()
        .map(|i| i.rels.indexes.iter().map(|x| x.0.clone()).collect())
        .unwrap_or_default();
    let tables: Vec<String> = run.start.tables.iter().map(|t| t.name.clone()).collect();
    let mut head = vec![
        "interval s".to_string(),
        "events sent".into(),
        "enqueue→ack p50 / p99 / max ms".into(),
        "WAIT max".into(),
        "checkpoints started / buffers they wrote".into(),
        format!("n_dead_tup ({})", tables.join(" / ")),
        format!("heap ({})", tables.join(" / ")),
    ];
    head.extend(indexes.iter().map(|i| format!("`{i}`")));
    let head: Vec<&str> = head.iter().map(String::as_str).collect();
    let mut t = Table::new(&head);
    let mut from = 0.0;
    for i in &run.intervals {
        let per_table = |f: &dyn Fn(&ext_rels::TableStat) -> String| {
            tables
                .iter()
                .map(|name| {
                    i.rels
                        .tables
                        .iter()
                        .find(|t| &t.name == name)
                        .map(f)
                        .unwrap_or_else(|| "—".into())
                })
                .collect::<Vec<_>>()
                .join(" / ")
        };
        let mut cells = vec![
            format!("{from:.0}–{:.0}", i.to_s),
            num(i.hist.len() as f64),
            if i.hist.is_empty() {
                "—".into()
            } else {
                format!(
                    "{} / {} / {}",
                    ms(i.hist.value_at_quantile(0.5) as f64),
                    ms(i.hist.value_at_quantile(0.99) as f64),
                    ms(i.hist.max() as f64)
                )
            },
            num(i.wait_max as f64),
            format!("{} / {}", i.ckpt_started, num(i.ckpt_buffers as f64)),
            per_table(&|t| num(t.dead as f64)),
            per_table(&|t| bytes(t.heap)),
        ];
        cells.extend(
            indexes
                .iter()
                .map(|name| i.rels.index_size(name).map(bytes).unwrap_or("—".into())),
        );
        t.row(cells);
        from = i.to_s;
    }
    t.render()
}

fn summary_table(runs: &[HeldRun]) -> String {
    let mut t = Table::new(&[
        "run",
        "offered (achieved) ev/s",
        "events acked / sent",
        "enqueue→ack p99 first minute ms",
        "p99 last minute ms",
        "last ÷ first",
        "WAIT max",
        "n_dead_tup at the end",
        "indexes at start → end",
        "held snapshot's xmin age at the end",
    ]);
    for r in runs {
        let end = r.intervals.last().map(|i| &i.rels);
        t.row(vec![
            r.label(),
            format!("{} ({})", num(r.rate), num(r.achieved_rate)),
            format!("{} / {}", num(r.acked as f64), num(r.sent as f64)),
            ms(r.first_minute.value_at_quantile(0.99) as f64),
            ms(r.last_minute.value_at_quantile(0.99) as f64),
            format!("{:.2}", r.p99_ratio()),
            num(r.wait_max as f64),
            end.map(|e| num(e.tables.iter().map(|t| t.dead).sum::<i64>() as f64))
                .unwrap_or_else(|| "—".into()),
            format!(
                "{} → {}",
                bytes(r.start.index()),
                end.map(|e| bytes(e.index())).unwrap_or_else(|| "—".into())
            ),
            r.held_xmin_age
                .map(|a| format!("{} transactions", num(a as f64)))
                .unwrap_or_else(|| "—".into()),
        ]);
    }
    t.render()
}

pub fn markdown(r: &Results) -> String {
    let Some(first) = r.held.first() else {
        return "Not run.\n".into();
    };
    let mut s = format!(
        "Open-loop load at {} events/s for {:.0} s on a fresh database with the default version \
         (wake-up mode `{}`): one `SELECT outbox_enqueue('{TOPIC}', …, key => 'order-<n>')` per \
         transaction (autocommit; the unkeyed runs give no key, so their events go to the stream \
         instead of scheduled rows) on a fixed schedule from {} connections, as in section 3. \
         **No relay and no broker**: one claim loop drains to a null sink in process \
         (`outbox_claim(owner, {})`, the relay's default batch, then `outbox_ack`; after an empty \
         claim it waits in `outbox_wait('{WAIT}')`), so the figures are the database's share of \
         the relay's latency. **enqueue→ack**: from the producer issuing its statement to the claim \
         loop seeing `outbox_ack` return, one clock, for the events sent in each interval. The \
         load starts {:.0} s before the measured part, at the same rate; then the held run opens \
         `BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT 1 FROM outbox_event LIMIT 1` (a \
         snapshot and a share lock on the tables behind the view, as pg_dump takes) on another \
         connection, keeps it through the measured part and the drain, and rolls it back; the \
         control runs the same without it. Times in the tables count from the measured part's \
         start. **WAIT max**: the largest of the \
         `outbox_stats()` WAIT counts (due + delayed) sampled each second. n_dead_tup comes from \
         `pg_stat_user_tables` (busy sessions report their counts about once a second, so it may \
         lag by that much); sizes are `pg_table_size` and each index's `pg_relation_size`, at \
         the end of the interval. **Checkpoints** are the server's (`pg_stat_bgwriter`): how \
         many started in the interval, and the buffers checkpoints wrote in it (as the \
         checkpointer reports them). **Why the load starts early:** setting up the run's fresh \
         database forces a checkpoint (the server log shows `checkpoint starting: immediate \
         force wait`), and with `checkpoint_timeout` 300 s and `checkpoint_completion_target` \
         0.9 a timed one then writes from 300 s to about 570 s after it and ends with a sync of \
         every file it wrote, which stalls every commit's WAL flush on this machine's disk. \
         Started with the transaction, a 10-minute run put that sync in its last minute and \
         never in its first, whatever the transaction did. Started 150 s early (the long \
         profile; the shorter ones end before a timed checkpoint), the timed \
         checkpoints end near 420 s and 720 s of the measured part, outside both of the minutes \
         the goal compares; their stalls still show in the interval table. The first minute is \
         also an outbox in steady state rather than a fresh database. The first and last minute \
         overlap when a run is shorter than two minutes.\n\n",
        num(first.rate),
        first.secs,
        first.wake,
        ((first.rate / EVENTS_PER_PRODUCER).ceil() as usize).clamp(1, MAX_PRODUCERS),
        defaults::BATCH_SIZE,
        first.warmup_secs,
    );
    s += &summary_table(&r.held);
    for run in &r.held {
        s += &format!(
            "\n**{}** (every {:.0} s; {} claims, {} of them empty):\n\n{}",
            run.label(),
            run.interval_secs,
            num(run.claims as f64),
            num(run.empty_claims as f64),
            interval_table(run)
        );
    }
    s
}

/// Issue 9's goals of the held-snapshot run.
pub fn goals(r: &Results) -> Vec<Goal> {
    let mut g = goals_of(r, true);
    g.extend(goals_of(r, false));
    g
}

fn goals_of(r: &Results, keyed: bool) -> Vec<Goal> {
    let held = r.held.iter().find(|x| x.held && x.keyed == keyed);
    let control = r.held.iter().find(|x| !x.held && x.keyed == keyed);
    let which = if keyed { "keyed" } else { "unkeyed" };
    let p99_name = format!("[9] held REPEATABLE READ transaction, {which} events: p99 stays flat");
    let p99_target =
        format!("enqueue→ack p99 of the last minute ≤ {P99_GROWTH_GOAL} × the first minute's");
    let backlog_name = format!("[9] held REPEATABLE READ transaction, {which} events: backlog");
    let backlog_target = format!("never above {BACKLOG_GOAL_SECS:.0} s of production");
    let Some(h) = held else {
        return vec![
            Goal::not_measured(p99_name, p99_target),
            Goal::not_measured(backlog_name, backlog_target),
        ];
    };
    let control_note = |f: &dyn Fn(&HeldRun) -> String| {
        control
            .map(|c| format!("; control without the transaction: {}", f(c)))
            .unwrap_or_default()
    };
    let p99s = |x: &HeldRun| {
        format!(
            "{} → {} ms",
            ms(x.first_minute.value_at_quantile(0.99) as f64),
            ms(x.last_minute.value_at_quantile(0.99) as f64)
        )
    };
    let end_dead = |x: &HeldRun| {
        x.intervals
            .last()
            .map(|i| i.rels.tables.iter().map(|t| t.dead).sum::<i64>())
            .unwrap_or(0)
    };
    let limit = (h.rate * BACKLOG_GOAL_SECS).round() as i64;
    vec![
        Goal {
            name: p99_name,
            target: p99_target,
            measured: format!(
                "{:.2}× ({}, {:.0} s at {} ev/s)",
                h.p99_ratio(),
                p99s(h),
                h.secs,
                num(h.rate)
            ),
            met: Some(h.p99_ratio() <= P99_GROWTH_GOAL && h.missing() == 0),
            note: format!(
                "n_dead_tup {} at the end, indexes {} → {}{}",
                num(end_dead(h) as f64),
                bytes(h.start.index()),
                h.intervals
                    .last()
                    .map(|i| bytes(i.rels.index()))
                    .unwrap_or_default(),
                control_note(&|c| format!(
                    "{} ({:.2}×), n_dead_tup {}",
                    p99s(c),
                    c.p99_ratio(),
                    num(end_dead(c) as f64)
                ))
            ),
        },
        Goal {
            name: backlog_name,
            target: backlog_target,
            measured: format!(
                "WAIT max {} (limit {})",
                num(h.wait_max as f64),
                num(limit as f64)
            ),
            met: Some(h.wait_max <= limit && h.missing() == 0),
            note: format!(
                "achieved {} of {} ev/s offered; sampled once a second{}",
                num(h.achieved_rate),
                num(h.rate),
                control_note(&|c| format!("WAIT max {}", num(c.wait_max as f64)))
            ),
        },
    ]
}

fn quantiles(h: &Histogram<u64>) -> Value {
    json!({
        "count": h.len(),
        "p50": h.value_at_quantile(0.5),
        "p99": h.value_at_quantile(0.99),
        "max": h.max(),
    })
}

pub fn json(r: &Results) -> Value {
    Value::Array(
        r.held
            .iter()
            .map(|run| {
                json!({
                    "held_transaction": run.held,
                    "keyed": run.keyed,
                    "offered_rate": run.rate,
                    "achieved_rate": run.achieved_rate,
                    "secs": run.secs,
                    "warmup_secs": run.warmup_secs,
                    "wake_up_mode": run.wake,
                    "sent": run.sent,
                    "acked": run.acked,
                    "claims": run.claims,
                    "empty_claims": run.empty_claims,
                    "wait_max": run.wait_max,
                    "held_xmin_age": run.held_xmin_age,
                    "enqueue_to_ack_us": {
                        "first_minute": quantiles(&run.first_minute),
                        "last_minute": quantiles(&run.last_minute),
                    },
                    "start": run.start.json(),
                    "intervals": run.intervals.iter().map(|i| json!({
                        "to_secs": i.to_s,
                        "enqueue_to_ack_us": quantiles(&i.hist),
                        "wait_max": i.wait_max,
                        "checkpoints_started": i.ckpt_started,
                        "checkpoint_buffers_written": i.ckpt_buffers,
                        "relations": i.rels.json(),
                    })).collect::<Vec<_>>(),
                })
            })
            .collect(),
    )
}
