//! 2. Null-sink drain, 4. claim contention, 5. seed-design baseline, 6. table health.

use anyhow::{bail, Result};
use hdrhistogram::Histogram;
use std::time::{Duration, Instant};
use tokio_postgres::Client;

use outbox_tests::db::TestDb;

use crate::db::{self, BenchDb};
use crate::report::{bytes, ms, num, Table};
use crate::sys::{HostMeter, ProcSnapshot};

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

struct LoopOut {
    acked: i64,
    ids: Vec<i64>,
    claim: Histogram<u64>,
    ack: Histogram<u64>,
    short_acks: i64,
}

/// Drains a fresh backlog of `backlog` events with `loops` claim loops (claim -> ack, no broker).
/// Stops when the backlog is empty or after `cap`. With `collect_ids`, every claimed id is
/// checked for double claims.
pub async fn null_sink(
    db: &TestDb,
    monitor: &Client,
    loops: usize,
    batch: i32,
    backlog: i64,
    cap: Duration,
    sync_off: bool,
) -> Result<DrainRun> {
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

async fn claim_loop(
    c: Client,
    owner: String,
    batch: i32,
    deadline: Instant,
) -> Result<(LoopOut, Client)> {
    let claim = c
        .prepare("SELECT id, claim_token, topic, event_key, event_type, payload::text, headers::text FROM outbox_claim($1::text, $2::int)")
        .await?;
    let ack = c
        .prepare("SELECT outbox_ack($1::text, $2::bigint, $3::bigint[])")
        .await?;
    let mut out = LoopOut {
        acked: 0,
        ids: Vec::new(),
        claim: crate::report::hist(),
        ack: crate::report::hist(),
        short_acks: 0,
    };
    while Instant::now() < deadline {
        let t0 = Instant::now();
        let rows = c.query(&claim, &[&owner, &batch]).await?;
        out.claim.saturating_record(t0.elapsed().as_micros() as u64);
        if rows.is_empty() {
            break;
        }
        let token: i64 = rows[0].get(1);
        let ids: Vec<i64> = rows.iter().map(|r| r.get(0)).collect();
        let t1 = Instant::now();
        let n: i32 = c.query_one(&ack, &[&owner, &token, &ids]).await?.get(0);
        out.ack.saturating_record(t1.elapsed().as_micros() as u64);
        out.short_acks += ids.len() as i64 - n as i64;
        out.acked += n as i64;
        out.ids.extend(ids);
    }
    Ok((out, c))
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

// ---------------------------------------------------------------------------------------------
// Seed design

pub struct SeedRun {
    pub loops: usize,
    pub delay: Option<Duration>,
    pub drained: i64,
    pub secs: f64,
    pub rounds: u64,
    pub lost_races: i64,
    pub double_sends: usize,
    pub db_cpu_secs: Option<f64>,
}

impl SeedRun {
    pub fn rate(&self) -> f64 {
        self.drained as f64 / self.secs
    }
}

pub async fn create_seed_table(c: &Client) -> Result<()> {
    // The seed design's table: same columns, status as text, composite indexes.
    c.batch_execute(
        "CREATE TABLE seed_event (
             id bigserial PRIMARY KEY,
             topic text NOT NULL,
             event_key text,
             event_type text,
             payload jsonb NOT NULL,
             headers jsonb NOT NULL DEFAULT '{}',
             status varchar(16) NOT NULL,
             retry_count int NOT NULL DEFAULT 0,
             next_retry_time timestamptz NOT NULL,
             claim_owner text,
             claimed_at timestamptz,
             last_error text,
             created_at timestamptz NOT NULL DEFAULT now(),
             updated_at timestamptz NOT NULL DEFAULT now());
         CREATE INDEX seed_event_status_next_idx ON seed_event (status, next_retry_time);
         CREATE INDEX seed_event_status_claimed_idx ON seed_event (status, claimed_at);",
    )
    .await?;
    Ok(())
}

/// Runs the seed algorithm with `loops` instances: SELECT 20 candidates without a lock, one
/// conditional UPDATE per row, one ack UPDATE per row (each its own transaction), then `delay`.
pub async fn seed(
    db: &TestDb,
    monitor: &Client,
    loops: usize,
    backlog: i64,
    cap: Duration,
    delay: Option<Duration>,
    max_rounds: Option<u64>,
) -> Result<SeedRun> {
    monitor.batch_execute("TRUNCATE seed_event").await?;
    monitor
        .execute(
            "INSERT INTO seed_event (topic, event_key, event_type, payload, status, next_retry_time)
             SELECT 'bench.seed', 'order-' || g, 'OrderCreated',
                    jsonb_build_object('order_id', g, 'customer', 'c' || (g % 977), 'amount', 42.50),
                    'WAIT', now() - ($1 - g) * interval '1 microsecond'
               FROM generate_series(1, $1::bigint) g",
            &[&backlog],
        )
        .await?;
    monitor.batch_execute("VACUUM ANALYZE seed_event").await?;
    let mut clients = Vec::new();
    let mut pids = Vec::new();
    for _ in 0..loops {
        let c = db.client().await?;
        pids.push(db::backend_pid(&c).await?);
        clients.push(c);
    }
    let cpu0 = ProcSnapshot::take(&pids);
    let start = Instant::now();
    let deadline = start + cap;
    let mut tasks = Vec::new();
    for (i, c) in clients.into_iter().enumerate() {
        tasks.push(tokio::spawn(seed_loop(
            c,
            format!("seed-{i}"),
            deadline,
            delay,
            max_rounds,
        )));
    }
    let mut drained = 0;
    let mut lost = 0;
    let mut rounds = 0;
    let mut ids = Vec::new();
    let mut keep = Vec::new();
    for t in tasks {
        let (a, l, r, mut i, c) = t.await??;
        drained += a;
        lost += l;
        rounds += r;
        ids.append(&mut i);
        keep.push(c);
    }
    let secs = start.elapsed().as_secs_f64();
    let cpu1 = ProcSnapshot::take(&pids);
    drop(keep);
    progress!(
        "    -> {:.1} events/s ({drained} events in {secs:.2} s)",
        drained as f64 / secs
    );
    let n = ids.len();
    ids.sort_unstable();
    ids.dedup();
    Ok(SeedRun {
        loops,
        delay,
        drained,
        secs,
        rounds,
        lost_races: lost,
        double_sends: n - ids.len(),
        db_cpu_secs: if cpu1.0.is_empty() {
            None
        } else {
            Some(cpu1.cpu_secs_since(&cpu0))
        },
    })
}

async fn seed_loop(
    c: Client,
    owner: String,
    deadline: Instant,
    delay: Option<Duration>,
    max_rounds: Option<u64>,
) -> Result<(i64, i64, u64, Vec<i64>, Client)> {
    let select = c
        .prepare(
            "SELECT id, topic, event_key, event_type, payload::text, headers::text FROM seed_event
              WHERE status = 'WAIT' AND next_retry_time <= now()
              ORDER BY next_retry_time LIMIT 20",
        )
        .await?;
    let claim = c
        .prepare(
            "UPDATE seed_event SET status = 'SENDING', claim_owner = $2, claimed_at = now(), updated_at = now()
              WHERE id = $1 AND status = 'WAIT'",
        )
        .await?;
    let ack = c
        .prepare("UPDATE seed_event SET status = 'SUCCESS', updated_at = now() WHERE id = $1")
        .await?;
    let (mut acked, mut lost, mut rounds) = (0i64, 0i64, 0u64);
    let mut sent = Vec::new();
    loop {
        if Instant::now() >= deadline || max_rounds.is_some_and(|m| rounds >= m) {
            break;
        }
        let rows = c.query(&select, &[]).await?;
        if rows.is_empty() && delay.is_none() {
            break;
        }
        let mut claimed = Vec::new();
        for r in &rows {
            let id: i64 = r.get(0);
            if c.execute(&claim, &[&id, &owner]).await? == 1 {
                claimed.push(id);
            } else {
                lost += 1;
            }
        }
        for id in &claimed {
            c.execute(&ack, &[id]).await?;
        }
        acked += claimed.len() as i64;
        sent.extend(claimed);
        rounds += 1;
        if let Some(d) = delay {
            tokio::time::sleep(d).await;
        }
    }
    Ok((acked, lost, rounds, sent, c))
}

// ---------------------------------------------------------------------------------------------
// Table health

struct Health {
    table: i64,
    indexes: Vec<(String, i64)>,
    live: i64,
    dead: i64,
    autovacuums: i64,
    empty_claim_us: f64,
    stats_us: f64,
}

async fn health_snapshot(c: &Client) -> Result<Health> {
    c.batch_execute("SELECT pg_stat_force_next_flush()").await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    c.batch_execute("SELECT pg_stat_clear_snapshot()").await?;
    let table: i64 = c
        .query_one("SELECT pg_relation_size('outbox_event')", &[])
        .await?
        .get(0);
    let indexes = c
        .query(
            "SELECT i.indexrelid::regclass::text, pg_relation_size(i.indexrelid)
               FROM pg_index i WHERE i.indrelid = 'outbox_event'::regclass ORDER BY 1",
            &[],
        )
        .await?
        .iter()
        .map(|r| (r.get::<_, String>(0), r.get::<_, i64>(1)))
        .collect();
    let r = c
        .query_one(
            "SELECT n_live_tup, n_dead_tup, autovacuum_count FROM pg_stat_user_tables
              WHERE relid = 'outbox_event'::regclass",
            &[],
        )
        .await?;
    let probe = c
        .prepare("SELECT count(*) FROM outbox_claim('health-probe', 100)")
        .await?;
    let t0 = Instant::now();
    for _ in 0..20 {
        c.query_one(&probe, &[]).await?;
    }
    let empty_claim_us = t0.elapsed().as_micros() as f64 / 20.0;
    let t1 = Instant::now();
    for _ in 0..5 {
        c.query_one("SELECT * FROM outbox_stats()", &[]).await?;
    }
    let stats_us = t1.elapsed().as_micros() as f64 / 5.0;
    Ok(Health {
        table,
        indexes,
        live: r.get(0),
        dead: r.get(1),
        autovacuums: r.get(2),
        empty_claim_us,
        stats_us,
    })
}

/// Sizes and dead tuples after the drain that just ran, then after `outbox_purge('0')` in a loop,
/// then after VACUUM.
pub async fn health(monitor: &Client, drained: i64) -> Result<(String, bool)> {
    // The claim loops have disconnected: give their backends time to report their statistics.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let a = health_snapshot(monitor).await?;
    let t0 = Instant::now();
    let mut purged: i64 = 0;
    let mut calls = 0;
    loop {
        let n: i64 = monitor
            .query_one("SELECT outbox_purge('0', 10000)", &[])
            .await?
            .get(0);
        calls += 1;
        purged += n;
        if n == 0 {
            break;
        }
    }
    let purge_secs = t0.elapsed().as_secs_f64();
    let b = health_snapshot(monitor).await?;
    let t1 = Instant::now();
    monitor.batch_execute("VACUUM outbox_event").await?;
    let vacuum_secs = t1.elapsed().as_secs_f64();
    let c = health_snapshot(monitor).await?;

    let mut t = Table::new(&[
        "",
        "after drain",
        "after outbox_purge loop",
        "after purge + VACUUM",
    ]);
    t.row(vec![
        "table (heap) size".into(),
        bytes(a.table),
        bytes(b.table),
        bytes(c.table),
    ]);
    for (i, (name, size)) in a.indexes.iter().enumerate() {
        t.row(vec![
            format!("index `{name}`"),
            bytes(*size),
            bytes(b.indexes.get(i).map(|x| x.1).unwrap_or(0)),
            bytes(c.indexes.get(i).map(|x| x.1).unwrap_or(0)),
        ]);
    }
    t.row(vec![
        "n_live_tup / n_dead_tup".into(),
        format!("{} / {}", num(a.live as f64), num(a.dead as f64)),
        format!("{} / {}", num(b.live as f64), num(b.dead as f64)),
        format!("{} / {}", num(c.live as f64), num(c.dead as f64)),
    ]);
    t.row(vec![
        "autovacuum runs on the table so far".into(),
        a.autovacuums.to_string(),
        b.autovacuums.to_string(),
        c.autovacuums.to_string(),
    ]);
    t.row(vec![
        "empty `outbox_claim(…, 100)` ms".into(),
        ms(a.empty_claim_us),
        ms(b.empty_claim_us),
        ms(c.empty_claim_us),
    ]);
    t.row(vec![
        "`outbox_stats()` ms".into(),
        ms(a.stats_us),
        ms(b.stats_us),
        ms(c.stats_us),
    ]);
    let ok = purged == drained;
    let autovacuum: String = monitor
        .query_one("SELECT current_setting('autovacuum')", &[])
        .await?
        .get(0);
    let av = if autovacuum == "on" {
        "autovacuum on".to_string()
    } else {
        "**autovacuum is off on this server** (`autovacuum = off` in its configuration), so nothing \
         reclaims dead tuples during the drain: the 'after drain' column is the worst case"
            .to_string()
    };
    let md = format!(
        "After the headline null-sink drain of {} events ({av}). \
         `outbox_purge('0', 10000)` was called {calls} times and deleted {} SUCCESS rows in {:.2} s \
         ({} rows/s); VACUUM then took {:.2} s.\n\n{}",
        num(drained as f64),
        num(purged as f64),
        purge_secs,
        num(purged as f64 / purge_secs.max(1e-9)),
        vacuum_secs,
        t.render()
    );
    Ok((md, ok))
}
