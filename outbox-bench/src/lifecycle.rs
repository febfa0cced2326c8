//! The life cycle of an event (report section 9): WAL per event for each phase of an event's
//! life (enqueue, claim + ack, purge), the null-sink drain rate and the tables' size after the
//! drain, for the extension's default version side by side with the release before it (when the
//! server has its frozen install script), each on a fresh database in the same run.

use anyhow::{Context, Result};
use futures_util::{StreamExt, TryStreamExt};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};
use tokio_postgres::Client;

use outbox_tests::db::TestDb;

use crate::db::{self, BenchDb};
use crate::ext_rels::{self, ExtRels};
use crate::null_sink;
use crate::report::{bytes, num, Goal, Table};
use crate::results::Results;
use crate::sys::ProcSnapshot;
use crate::wal::{self, Span, WalMeter};
use crate::Profile;

const TOPIC: &str = "bench.life";
/// Enqueue statements in flight on the producer's one connection (each its own transaction).
const PIPELINE: usize = 32;
/// The drain's claim size (`outbox_claim(owner, 500)`), as in the issue's measurement.
const DRAIN_BATCH: i32 = 500;
const DRAIN_CAP: Duration = Duration::from_secs(600);
/// `max_rows` of each `outbox_purge('0 seconds', …)` call; called until it returns 0.
const PURGE_ROWS: i32 = 1_000_000;
/// Keys of the keyed runs (`'k' || g % KEYS`).
pub const KEYS: i64 = 100;
/// The goals: WAL per event over the whole life, and a drain not slower than the previous
/// release's (5 % for the noise of one drain on a shared machine).
pub const WAL_GOAL_BYTES: f64 = 500.0;
pub const DRAIN_RATIO_GOAL: f64 = 0.95;
/// Full-page images above this over a life mean a checkpoint started during it (after the
/// `CHECKPOINT` before it, a life images only the few catalog and first pages it touches: about
/// 100 KiB for 100,000 events).
const FPI_RETRY_BYTES: i64 = 1 << 20;
/// Record kinds per run in the record-type table.
const TOP_KINDS: usize = 8;

/// One event's life on one schema version, N events at once.
pub struct LifeRun {
    pub version: String,
    /// "default" or "previous release".
    pub role: &'static str,
    pub keyed: bool,
    pub events: i64,
    pub enqueue: Span,
    pub drain: Span,
    pub purge: Span,
    /// `VACUUM` of the extension's tables after the purge (not part of the life total).
    pub vacuum: Span,
    pub enqueue_secs: f64,
    pub drained: i64,
    pub drain_secs: f64,
    /// CPU of the claim loop's backend during the drain.
    pub drain_cpu_secs: Option<f64>,
    pub purged: i64,
    pub after_drain: ExtRels,
    /// Autovacuum and autoanalyze runs on the extension's tables during the life.
    pub autovacuum_runs: i64,
}

impl LifeRun {
    /// Enqueue + claim + ack + purge.
    pub fn life(&self) -> Span {
        let mut s = self.enqueue.clone();
        s.add(&self.drain);
        s.add(&self.purge);
        s
    }
    pub fn per_event(&self, b: i64) -> f64 {
        b as f64 / self.events.max(1) as f64
    }
    pub fn life_per_event(&self) -> f64 {
        self.per_event(self.life().bytes())
    }
    pub fn drain_rate(&self) -> f64 {
        self.drained as f64 / self.drain_secs.max(1e-9)
    }
    pub fn label(&self) -> String {
        format!(
            "{}{}",
            self.version,
            if self.keyed {
                format!(" · {KEYS} keys")
            } else {
                String::new()
            }
        )
    }
}

/// The section's figures.
#[derive(Default)]
pub struct Lifecycle {
    pub runs: Vec<LifeRun>,
    pub default_version: String,
    pub available: Vec<String>,
    /// The version the default is compared with: the release before it, when installed.
    pub baseline: Option<String>,
    /// Why WAL records could not be attributed to the database (then the server-wide distance is
    /// reported), and spans pg_walinspect could no longer read.
    pub walinspect: Option<String>,
    pub wal_notes: Vec<String>,
    pub keyed: bool,
}

impl Lifecycle {
    pub fn run(&self, version: &str, keyed: bool) -> Option<&LifeRun> {
        self.runs
            .iter()
            .find(|r| r.version == version && r.keyed == keyed)
    }
}

/// "0.10.0" after "0.9.0".
fn version_key(v: &str) -> Vec<u64> {
    v.split(['.', '-'])
        .map(|p| p.parse().unwrap_or(0))
        .collect()
}

/// A fresh database with `version` of the extension (the tests' scratch database, its default
/// version replaced), its catalogs vacuumed after the scripts ran.
async fn fresh_db(server: &str, version: &str) -> Result<TestDb> {
    let db = TestDb::create_on(server, "outbox_bench_life");
    let c = db.client().await?;
    c.batch_execute("DROP EXTENSION outbox").await?;
    c.batch_execute(&format!(
        "CREATE EXTENSION outbox VERSION '{}'",
        version.replace('\'', "''")
    ))
    .await
    .with_context(|| format!("CREATE EXTENSION outbox VERSION '{version}'"))?;
    c.batch_execute("VACUUM").await?;
    Ok(db)
}

/// `n` events through `outbox_enqueue`, each its own transaction (autocommit), `PIPELINE` in
/// flight; the payload is db.rs's order event. `synchronous_commit = off` in this session only:
/// the records are the same, the producer does not wait for each flush.
async fn enqueue(c: &Client, n: i64, keyed: bool) -> Result<()> {
    c.batch_execute("SET synchronous_commit = off").await?;
    let stmt = c
        .prepare(
            "SELECT outbox_enqueue($1::text, $2::text::jsonb, key => $3::text, event_type => 'OrderCreated')",
        )
        .await?;
    let stmt = &stmt;
    futures_util::stream::iter(1..=n)
        .map(|g| async move {
            let payload = format!(
                r#"{{"order_id": {g}, "customer": "c{}", "amount": 42.50}}"#,
                g % 977
            );
            let key = keyed.then(|| format!("k{}", g % KEYS));
            c.query_one(stmt, &[&TOPIC, &payload, &key]).await
        })
        .buffered(PIPELINE)
        .try_for_each(|_| async { Ok(()) })
        .await
        .context("enqueuing")?;
    Ok(())
}

/// One life of `n` events on a fresh database with `version` on `server`; a drain or purge
/// that misses events is recorded in `failures`.
async fn life(
    (server, meter, n): (&str, &WalMeter, i64),
    (version, role): (&str, &'static str),
    keyed: bool,
    notes: &mut Vec<String>,
    failures: &mut Vec<String>,
) -> Result<LifeRun> {
    let db = fresh_db(server, version).await?;
    progress!(
        "  {version} ({role}){}: {} events",
        if keyed { ", keyed" } else { "" },
        num(n as f64)
    );
    let admin = db.client().await?;
    let producer = db.client().await?;
    let oid = wal::dboid(&admin).await?;
    let tables = ext_rels::table_list(&admin).await?;
    let first_note = notes.len();
    meter.checkpoint().await?;
    notes.extend(meter.hold_wal().await?);

    let l0 = meter.lsn().await?;
    let t0 = Instant::now();
    enqueue(&producer, n, keyed).await?;
    let enqueue_secs = t0.elapsed().as_secs_f64();
    drop(producer);
    progress!("    enqueued in {enqueue_secs:.1} s");
    let l1 = meter.lsn().await?;
    let enq = meter.span(&l0, &l1, oid, notes).await?;
    // The claim's plan must not depend on whether autovacuum analyzed the new table yet.
    admin.batch_execute(&format!("ANALYZE {tables}")).await?;

    let loop_c = db.client().await?;
    let pid = db::backend_pid(&loop_c).await?;
    let cpu0 = ProcSnapshot::take(&[pid]);
    let t1 = Instant::now();
    let (out, loop_c) = null_sink::claim_loop(
        loop_c,
        "bench-life".into(),
        DRAIN_BATCH,
        Instant::now() + DRAIN_CAP,
        null_sink::Statements::Named,
    )
    .await?;
    let drain_secs = t1.elapsed().as_secs_f64();
    let cpu1 = ProcSnapshot::take(&[pid]);
    drop(loop_c);
    let drain_cpu_secs = (!cpu1.0.is_empty()).then(|| cpu1.cpu_secs_since(&cpu0));
    let l2 = meter.lsn().await?;
    progress!("    drained in {drain_secs:.1} s");
    let drain = meter.span(&l1, &l2, oid, notes).await?;
    let after_drain = ext_rels::snapshot(&admin).await?;
    if out.acked != n || out.short_acks > 0 {
        failures.push(format!(
            "life cycle {version}: the drain acked {} of {n} events ({} claimed but not acked)",
            out.acked, out.short_acks
        ));
    }

    // Statistics as autovacuum would have them by then (the phases follow each other faster than
    // its naptime): planned with the enqueue's statistics (no SUCCESS rows), 0.5.0's purge filters
    // its id array row by row and takes half a minute for 100,000 rows.
    admin.batch_execute(&format!("ANALYZE {tables}")).await?;
    let purge_stmt = admin
        .prepare("SELECT outbox_purge('0 seconds', $1::int)")
        .await?;
    let mut purged = 0i64;
    loop {
        let k: i64 = admin.query_one(&purge_stmt, &[&PURGE_ROWS]).await?.get(0);
        purged += k;
        if k == 0 {
            break;
        }
    }
    let l3 = meter.lsn().await?;
    progress!("    purged");
    let purge = meter.span(&l2, &l3, oid, notes).await?;
    if purged != n {
        failures.push(format!(
            "life cycle {version}: outbox_purge('0 seconds') deleted {purged} of {n} events"
        ));
    }
    // Before our own VACUUM: the autovacuum runs the life itself triggered.
    admin
        .batch_execute("SELECT pg_stat_force_next_flush()")
        .await?;
    let autovacuum_runs = ext_rels::snapshot(&admin).await?.autovacuum_runs();
    admin.batch_execute(&format!("VACUUM {tables}")).await?;
    let l4 = meter.lsn().await?;
    let vacuum = meter.span(&l3, &l4, oid, notes).await?;
    meter.release_wal().await?;
    for note in &mut notes[first_note..] {
        *note = format!("{version}{}: {note}", if keyed { " keyed" } else { "" });
    }
    let run = LifeRun {
        version: version.to_string(),
        role,
        keyed,
        events: n,
        enqueue: enq,
        drain,
        purge,
        vacuum,
        enqueue_secs,
        drained: out.acked,
        drain_secs,
        drain_cpu_secs,
        purged,
        after_drain,
        autovacuum_runs,
    };
    progress!(
        "    -> WAL/event: enqueue {:.0}, claim+ack {:.0}, purge {:.0}, life {:.0} B; drain {:.0} events/s; {} after the drain",
        run.per_event(run.enqueue.bytes()),
        run.per_event(run.drain.bytes()),
        run.per_event(run.purge.bytes()),
        run.life_per_event(),
        run.drain_rate(),
        bytes(run.after_drain.total())
    );
    Ok(run)
}

/// A life on a fresh database with `version`, once more on another when
/// its full-page images show that a checkpoint started during it (other work on the server wrote
/// enough WAL to trigger one, so the run's pages were imaged again); the run with fewer such bytes
/// is kept, and a note says so.
async fn measure(
    (server, meter, n): (&str, &WalMeter, i64),
    (version, role): (&str, &'static str),
    keyed: bool,
    notes: &mut Vec<String>,
    failures: &mut Vec<String>,
) -> Result<LifeRun> {
    let on = (server, meter, n);
    let run = life(on, (version, role), keyed, notes, failures).await?;
    let fpi = run.life().fpi().unwrap_or(0);
    if fpi <= FPI_RETRY_BYTES {
        return Ok(run);
    }
    progress!(
        "    {} of full-page images: a checkpoint started during the life; once more",
        bytes(fpi)
    );
    let again = life(on, (version, role), keyed, notes, failures).await?;
    let fpi2 = again.life().fpi().unwrap_or(0);
    notes.push(format!(
        "{}: a checkpoint started during the first run ({} of full-page images); measured again \
         ({}), the run with fewer is shown",
        again.label(),
        bytes(fpi),
        bytes(fpi2)
    ));
    Ok(if fpi2 <= fpi { again } else { run })
}

/// The versions to compare, in ascending order: the release before the default (the newest
/// installed version below it, if any) and the default. Runs the unkeyed life of each, then the
/// keyed ones.
pub async fn run(p: &Profile, db: &TestDb, r: &mut Results) -> Result<()> {
    progress!("==> 9. the life cycle of an event");
    let meter = WalMeter::new(db.client().await?).await?;
    let c = db.client().await?;
    let default_version: String = c
        .query_one(
            "SELECT default_version FROM pg_available_extensions WHERE name = 'outbox'",
            &[],
        )
        .await?
        .get(0);
    let mut available: Vec<String> = c
        .query(
            "SELECT version FROM pg_available_extension_versions WHERE name = 'outbox'",
            &[],
        )
        .await?
        .iter()
        .map(|row| row.get(0))
        .collect();
    available.sort_by_key(|v| version_key(v));
    let previous = available
        .iter()
        .rfind(|v| version_key(v) < version_key(&default_version))
        .cloned();
    let mut lc = Lifecycle {
        default_version: default_version.clone(),
        available,
        walinspect: meter.unavailable.clone(),
        keyed: p.lifecycle_keyed,
        baseline: previous.clone(),
        ..Default::default()
    };
    let mut plan: Vec<(String, &'static str)> = Vec::new();
    if let Some(previous) = previous {
        plan.push((previous, "previous release"));
    }
    plan.push((default_version, "default"));
    let keyed_too = if p.lifecycle_keyed { &plan[..] } else { &[] };
    let n = p.lifecycle_events;
    for ((v, role), keyed) in plan
        .iter()
        .map(|x| (x, false))
        .chain(keyed_too.iter().map(|x| (x, true)))
    {
        let run = measure(
            (&db.server, &meter, n),
            (v, role),
            keyed,
            &mut lc.wal_notes,
            &mut r.failures,
        )
        .await?;
        lc.runs.push(run);
    }
    lc.runs.sort_by_key(|x| (x.keyed, version_key(&x.version)));
    r.lifecycle = Some(lc);
    Ok(())
}

fn per_event_cell(run: &LifeRun, s: &Span) -> String {
    format!("{:.0}", run.per_event(s.bytes()))
}

fn phase_table(lc: &Lifecycle) -> String {
    let mut t = Table::new(&[
        "version (role)",
        "events",
        "enqueue B/event",
        "claim + ack B/event",
        "purge B/event",
        "life total B/event (of it FPI)",
        "life without FPI B/event",
        "server-wide WAL B/event",
        "VACUUM after purge B/event",
        "drain events/s",
        "drain DB CPU µs/event",
        "tables + indexes after drain (heap / indexes)",
        "autovacuum runs",
    ]);
    for run in &lc.runs {
        let life = run.life();
        t.row(vec![
            format!("{} ({})", run.label(), run.role),
            num(run.events as f64),
            per_event_cell(run, &run.enqueue),
            per_event_cell(run, &run.drain),
            per_event_cell(run, &run.purge),
            format!(
                "**{:.0}** ({})",
                run.per_event(life.bytes()),
                life.fpi()
                    .map(|f| format!("{:.1}", run.per_event(f)))
                    .unwrap_or_else(|| "n/a".into())
            ),
            life.fpi()
                .map(|f| format!("{:.0}", run.per_event(life.bytes() - f)))
                .unwrap_or_else(|| "n/a".into()),
            format!("{:.0}", run.per_event(life.lsn_bytes)),
            per_event_cell(run, &run.vacuum),
            num(run.drain_rate()),
            run.drain_cpu_secs
                .map(|c| format!("{:.1}", c * 1e6 / run.drained.max(1) as f64))
                .unwrap_or_else(|| "n/a".into()),
            format!(
                "{} ({} / {})",
                bytes(run.after_drain.total()),
                bytes(run.after_drain.heap()),
                bytes(run.after_drain.index())
            ),
            run.autovacuum_runs.to_string(),
        ]);
    }
    t.render()
}

/// The largest record kinds of each run's life, bytes (and records) per event, one column per run.
fn kinds_table(lc: &Lifecycle) -> Option<String> {
    let lives: Vec<(String, BTreeMap<String, wal::Kind>, f64)> = lc
        .runs
        .iter()
        .filter_map(|run| {
            run.life()
                .kinds
                .map(|k| (run.label(), k, run.events.max(1) as f64))
        })
        .collect();
    if lives.is_empty() {
        return None;
    }
    let mut rows: Vec<String> = Vec::new();
    for (_, kinds, _) in &lives {
        let mut v: Vec<(&String, &wal::Kind)> = kinds.iter().collect();
        v.sort_by_key(|(_, k)| -k.bytes);
        for (name, _) in v.into_iter().take(TOP_KINDS) {
            if !rows.contains(name) {
                rows.push(name.clone());
            }
        }
    }
    // Largest first in the last run (the default version's unkeyed run sorts last among unkeyed).
    let order = lives
        .iter()
        .rev()
        .find(|(label, _, _)| *label == lc.default_version)
        .unwrap_or(&lives[0]);
    rows.sort_by_key(|name| -order.1.get(name).map(|k| k.bytes).unwrap_or(0));
    let mut head = vec!["record (resource manager/type)".to_string()];
    head.extend(
        lives
            .iter()
            .map(|(l, _, _)| format!("{l}: B (records) per event")),
    );
    let head: Vec<&str> = head.iter().map(String::as_str).collect();
    let mut t = Table::new(&head);
    for name in &rows {
        let mut cells = vec![format!("`{name}`")];
        for (_, kinds, n) in &lives {
            cells.push(match kinds.get(name) {
                Some(k) => format!("{:.1} ({:.2})", k.bytes as f64 / n, k.count as f64 / n),
                None => "—".into(),
            });
        }
        t.row(cells);
    }
    let mut cells = vec!["all records".to_string()];
    for (_, kinds, n) in &lives {
        let b: i64 = kinds.values().map(|k| k.bytes).sum();
        let c: i64 = kinds.values().map(|k| k.count).sum();
        cells.push(format!("{:.1} ({:.2})", b as f64 / n, c as f64 / n));
    }
    t.row(cells);
    Some(t.render())
}

pub fn markdown(r: &Results) -> String {
    let Some(lc) = &r.lifecycle else {
        return "Not run.\n".into();
    };
    let n = lc.runs.first().map(|x| x.events).unwrap_or(0);
    let mut s = format!(
        "{} events per run, each run on a fresh database with `CREATE EXTENSION outbox VERSION …` \
         (versions installed on the server: {}; default {}), after a `CHECKPOINT`, so that each \
         run pays full-page images alike. Phases, back to back: **enqueue**: one \
         `outbox_enqueue('{TOPIC}', payload, key => …, event_type => 'OrderCreated')` per \
         transaction ({}; autocommit, {PIPELINE} statements pipelined on one connection with \
         `synchronous_commit = off`, which writes the same records without waiting for each \
         flush), the ~90-byte order payload of the other sections; then `ANALYZE` of the \
         extension's tables; **claim + ack**: one null-sink loop, `outbox_claim(owner, \
         {DRAIN_BATCH})` (reading the columns a relay reads) then `outbox_ack` of the returned ids, \
         until a claim returns nothing; `ANALYZE` again; **purge**: `outbox_purge('0 seconds', \
         {PURGE_ROWS})` until it returns 0. The life total is the sum of these three; **VACUUM after purge** (`VACUUM` \
         of the extension's tables) is shown beside it, not counted. WAL bytes are {} Autovacuum \
         stays on (its WAL counts in the phase it ran in). The drain rate is one run per version \
         on a shared machine; its DB CPU is the claim loop's backend (utime + stime).\n\n",
        num(n as f64),
        lc.available.join(", "),
        lc.default_version,
        if lc.keyed {
            format!("key NULL in the unkeyed runs, `'k' || (g % {KEYS})` in the keyed ones")
        } else {
            "key NULL".into()
        },
        match &lc.walinspect {
            None => "the records of the run's database, read with `pg_walinspect` \
                     (`pg_get_wal_records_info`: records with a block in the database, plus the \
                     commit records of the transactions that wrote them; record length with its \
                     full-page image); the server-wide column is `pg_wal_lsn_diff` of the insert \
                     positions, which also holds other databases' WAL, page headers and alignment."
                .to_string(),
            Some(why) => format!(
                "the server-wide distance between insert positions (`pg_wal_lsn_diff`), which \
                 also holds other work's WAL: the records could not be attributed ({why}), so \
                 the record-type table and the FPI figures are omitted."
            ),
        }
    );
    for note in &lc.wal_notes {
        s += &format!("- {note}\n");
    }
    if !lc.wal_notes.is_empty() {
        s += "\n";
    }
    s += &phase_table(lc);
    if let Some(k) = kinds_table(lc) {
        s += &format!(
            "\nLargest WAL record kinds over the life (enqueue + claim + ack + purge), per event \
             (the top {TOP_KINDS} of each run):\n\n{k}"
        );
    }
    s
}

/// The two goals of the life cycle.
pub fn goals(r: &Results) -> Vec<Goal> {
    let wal_name = "[9] WAL per event over its whole life (default version)";
    let wal_target = format!("≤ {WAL_GOAL_BYTES:.0} bytes (enqueue, claim, ack, purge)");
    let drain_name = "[9] null-sink drain vs the previous release";
    let drain_target = format!(
        "≥ {DRAIN_RATIO_GOAL} × the previous release's events/s (one loop, batch {DRAIN_BATCH})"
    );
    let Some(lc) = &r.lifecycle else {
        return vec![
            Goal::not_measured(wal_name, wal_target),
            Goal::not_measured(drain_name, drain_target),
        ];
    };
    let mut g = Vec::new();
    let def = lc.run(&lc.default_version, false);
    let base = lc.baseline.as_deref().and_then(|b| lc.run(b, false));
    g.push(match def {
        Some(d) => {
            let life = d.life();
            let mut others: Vec<String> = lc
                .runs
                .iter()
                .filter(|x| !std::ptr::eq(*x, d))
                .map(|x| format!("{} {:.0} B", x.label(), x.life_per_event()))
                .collect();
            if others.is_empty() {
                others.push("no other version measured".into());
            }
            Goal {
                name: wal_name.into(),
                target: wal_target,
                measured: format!(
                    "{:.0} B/event ({}, unkeyed)",
                    d.life_per_event(),
                    d.version
                ),
                met: Some(d.life_per_event() <= WAL_GOAL_BYTES),
                note: format!(
                    "enqueue {:.0} + claim/ack {:.0} + purge {:.0} B{}; VACUUM after the purge adds \
                     {:.0} B (not counted); others: {}",
                    d.per_event(d.enqueue.bytes()),
                    d.per_event(d.drain.bytes()),
                    d.per_event(d.purge.bytes()),
                    life.fpi()
                        .map(|f| format!(" (FPI {:.1} B)", d.per_event(f)))
                        .unwrap_or_default(),
                    d.per_event(d.vacuum.bytes()),
                    others.join(", ")
                ),
            }
        }
        None => Goal::not_measured(wal_name, wal_target),
    });
    g.push(match (def, base) {
        (Some(d), Some(b)) if d.version != b.version => {
            let ratio = d.drain_rate() / b.drain_rate();
            let cpu = |x: &LifeRun| {
                x.drain_cpu_secs
                    .map(|c| format!("{:.1}", c * 1e6 / x.drained.max(1) as f64))
                    .unwrap_or_else(|| "n/a".into())
            };
            Goal {
                name: drain_name.into(),
                target: drain_target,
                measured: format!(
                    "{ratio:.2}× ({} vs {} events/s, {} vs {})",
                    num(d.drain_rate()),
                    num(b.drain_rate()),
                    d.version,
                    b.version
                ),
                met: Some(ratio >= DRAIN_RATIO_GOAL),
                note: format!(
                    "one drain of {} events each on a shared machine; DB CPU of the claim loop {} vs \
                     {} µs/event; tables + indexes after the drain {} vs {}",
                    num(d.events as f64),
                    cpu(d),
                    cpu(b),
                    bytes(d.after_drain.total()),
                    bytes(b.after_drain.total())
                ),
            }
        }
        _ => Goal::not_measured(drain_name, drain_target),
    });
    g
}

fn span_json(run: &LifeRun, s: &Span) -> Value {
    json!({
        "bytes": s.bytes(),
        "bytes_per_event": run.per_event(s.bytes()),
        "fpi_bytes": s.fpi(),
        "server_wide_bytes": s.lsn_bytes,
        "records": s.kinds.as_ref().map(|k| k.iter().map(|(name, x)| (name.clone(), json!({
            "count": x.count, "bytes": x.bytes, "fpi_bytes": x.fpi,
        }))).collect::<serde_json::Map<_, _>>()),
    })
}

pub fn json(r: &Results) -> Value {
    let Some(lc) = &r.lifecycle else {
        return Value::Null;
    };
    json!({
        "default_version": lc.default_version,
        "available_versions": lc.available,
        "baseline": lc.baseline,
        "walinspect_unavailable": lc.walinspect,
        "wal_notes": lc.wal_notes,
        "runs": lc.runs.iter().map(|run| json!({
            "version": run.version,
            "role": run.role,
            "keyed": run.keyed,
            "keys": if run.keyed { Some(KEYS) } else { None },
            "events": run.events,
            "enqueue_secs": run.enqueue_secs,
            "wal": {
                "enqueue": span_json(run, &run.enqueue),
                "claim_ack": span_json(run, &run.drain),
                "purge": span_json(run, &run.purge),
                "life": span_json(run, &run.life()),
                "vacuum_after_purge": span_json(run, &run.vacuum),
            },
            "drain": {
                "batch": DRAIN_BATCH,
                "drained": run.drained,
                "secs": run.drain_secs,
                "rate": run.drain_rate(),
                "db_cpu_secs": run.drain_cpu_secs,
            },
            "purged": run.purged,
            "after_drain": run.after_drain.json(),
            "autovacuum_runs": run.autovacuum_runs,
        })).collect::<Vec<_>>(),
    })
}
