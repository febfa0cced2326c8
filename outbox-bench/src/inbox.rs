//! The consumer's inbox (issue 31): one `outbox_inbox_accept` against a plain INSERT of a uuid
//! into a table with a primary key, as the same non-superuser role (so the inbox's row-level
//! policy counts), one call per transaction: wall time and backend CPU per call, WAL per call.

use anyhow::Result;
use serde_json::{json, Value};
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use tokio_postgres::Client;

use outbox_tests::db::TestDb;

use crate::db::{self, BenchDb};
use crate::report::{num, Goal};
use crate::results::Results;
use crate::sys::ProcSnapshot;
use crate::wal::{self, WalMeter};
use crate::Profile;

/// Issue 31: an accept costs at most this many plain INSERTs.
pub const ACCEPT_COST_GOAL: f64 = 2.0;
/// Alternating rounds per variant; the fastest counts (the least disturbed by other work).
const ROUNDS: usize = 3;

#[derive(Clone, Copy, PartialEq, Debug)]
pub enum Variant {
    Accept,
    PlainInsert,
}

impl Variant {
    fn label(self) -> &'static str {
        match self {
            Variant::Accept => "outbox_inbox_accept(consumer, event_id)",
            Variant::PlainInsert => "INSERT INTO t (event_id uuid PRIMARY KEY)",
        }
    }
}

#[derive(Clone)]
pub struct InboxRun {
    pub variant: Variant,
    pub calls: i64,
    pub wall_us: f64,
    pub cpu_us: f64,
    pub wal_bytes: f64,
}

/// Sequential, time-ordered ids (UUID version 7's layout), as events of the relay carry.
fn v7_ids(n: i64, salt: u64) -> Vec<String> {
    let ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    (0..n as u64)
        .map(|i| {
            let seq = (salt << 32) | i;
            format!(
                "{:08x}-{:04x}-7{:03x}-8{:03x}-{:012x}",
                ms >> 16,
                ms & 0xffff,
                (seq >> 48) & 0xfff,
                (seq >> 36) & 0xfff,
                seq & 0xffff_ffff_ffff
            )
        })
        .collect()
}

/// `calls` single-call transactions of `variant` on `c` (acting as the consumer role).
async fn measure(
    c: &Client,
    meter: &WalMeter,
    dboid: u32,
    consumer: &str,
    variant: Variant,
    ids: &[String],
    notes: &mut Vec<String>,
) -> Result<InboxRun> {
    let sql = match variant {
        Variant::Accept => "SELECT outbox_inbox_accept($1, $2::text::uuid)",
        Variant::PlainInsert => {
            "INSERT INTO inbox_bench_plain (event_id) SELECT $2::text::uuid WHERE $1::text IS NOT NULL"
        }
    };
    let stmt = c.prepare(sql).await?;
    let pid = db::backend_pid(c).await?;
    let l0 = meter.lsn().await?;
    let cpu0 = ProcSnapshot::take(&[pid]);
    let t0 = Instant::now();
    for id in ids {
        c.execute(&stmt, &[&consumer, id]).await?;
    }
    let wall = t0.elapsed().as_secs_f64();
    let cpu = ProcSnapshot::take(&[pid]).cpu_secs_since(&cpu0);
    let l1 = meter.lsn().await?;
    let wal = meter.span(&l0, &l1, dboid, notes).await?;
    let n = ids.len() as f64;
    Ok(InboxRun {
        variant,
        calls: ids.len() as i64,
        wall_us: wall * 1e6 / n,
        cpu_us: cpu * 1e6 / n,
        wal_bytes: wal.bytes() as f64 / n,
    })
}

pub async fn run(p: &Profile, db: &TestDb, r: &mut Results) -> Result<()> {
    progress!("==> 11. the consumer's inbox: accept vs a plain INSERT");
    let admin = db.client().await?;
    // A name as short as a real consumer's (roles are server-wide: the pid keeps it unique); its
    // length counts in the WAL, twice per row (heap and primary key).
    let consumer = format!("loyalty{}", std::process::id());
    admin
        .batch_execute(&format!(
            "CREATE ROLE {consumer} NOLOGIN;
             GRANT SELECT, INSERT ON outbox_inbox TO {consumer};
             GRANT EXECUTE ON FUNCTION outbox_inbox_accept(text, uuid) TO {consumer};
             CREATE TABLE inbox_bench_plain (event_id uuid PRIMARY KEY);
             GRANT INSERT ON inbox_bench_plain TO {consumer}"
        ))
        .await?;
    let res = runs(p, db, &admin, &consumer, r).await;
    admin
        .batch_execute(&format!(
            "DROP TABLE inbox_bench_plain; DELETE FROM outbox_inbox;
             REVOKE ALL ON outbox_inbox FROM {consumer};
             REVOKE ALL ON FUNCTION outbox_inbox_accept(text, uuid) FROM {consumer};
             DROP ROLE {consumer}"
        ))
        .await?;
    res
}

async fn runs(
    p: &Profile,
    db: &TestDb,
    admin: &Client,
    consumer: &str,
    r: &mut Results,
) -> Result<()> {
    let meter = WalMeter::new(db.client().await?).await?;
    let dboid = wal::dboid(admin).await?;
    let mut notes = meter.hold_wal().await?.into_iter().collect::<Vec<_>>();
    let c = db.client().await?;
    c.batch_execute(&format!(
        "SET ROLE {consumer}; SET synchronous_commit = off"
    ))
    .await?;
    let mut best: Vec<InboxRun> = Vec::new();
    for round in 0..ROUNDS {
        for (k, variant) in [Variant::Accept, Variant::PlainInsert]
            .into_iter()
            .enumerate()
        {
            let ids = v7_ids(p.inbox_calls, (round * 2 + k) as u64);
            let run = measure(&c, &meter, dboid, consumer, variant, &ids, &mut notes).await?;
            match best.iter_mut().find(|b| b.variant == variant) {
                Some(b) if b.wall_us <= run.wall_us => {}
                Some(b) => *b = run,
                None => best.push(run),
            }
        }
    }
    meter.release_wal().await?;
    for b in &best {
        progress!(
            "  {}: {:.1} µs/call, {:.1} µs CPU, {:.0} B WAL",
            b.variant.label(),
            b.wall_us,
            b.cpu_us,
            b.wal_bytes
        );
    }
    r.inbox = best;
    r.inbox_consumer = consumer.to_string();
    r.inbox_notes = notes;
    Ok(())
}

fn find(r: &Results, v: Variant) -> Option<&InboxRun> {
    r.inbox.iter().find(|x| x.variant == v)
}

pub fn markdown(r: &Results) -> String {
    let (Some(a), Some(b)) = (find(r, Variant::Accept), find(r, Variant::PlainInsert)) else {
        return "Not run.\n".into();
    };
    let mut s = format!(
        "{} calls per variant, one call per transaction (`synchronous_commit = off`), as a \
         non-superuser consumer role ({}, {} characters), sequential UUID v7 ids; the fastest of \
         {ROUNDS} alternating rounds. WAL: this database's records, commit records included.\n\n\
         | call | µs per call | backend CPU µs | WAL B per call |\n|---|---:|---:|---:|\n",
        num(a.calls as f64),
        r.inbox_consumer,
        r.inbox_consumer.len()
    );
    for x in [a, b] {
        s += &format!(
            "| {} | {:.1} | {:.1} | {:.0} |\n",
            x.variant.label(),
            x.wall_us,
            x.cpu_us,
            x.wal_bytes
        );
    }
    s += &format!(
        "| **ratio** | **{:.2}×** | **{:.2}×** | **{:.2}×** |\n",
        a.wall_us / b.wall_us,
        a.cpu_us / b.cpu_us,
        a.wal_bytes / b.wal_bytes
    );
    for n in &r.inbox_notes {
        s += &format!("\n{n}\n");
    }
    s
}

pub fn goals(r: &Results) -> Vec<Goal> {
    let name = "[31] inbox accept vs a plain INSERT of a uuid";
    let target = format!("≤ {ACCEPT_COST_GOAL} × per call (wall time)");
    let (Some(a), Some(b)) = (find(r, Variant::Accept), find(r, Variant::PlainInsert)) else {
        return vec![Goal::not_measured(name, target)];
    };
    let ratio = a.wall_us / b.wall_us;
    vec![Goal {
        name: name.into(),
        target,
        measured: format!("{ratio:.2}× ({:.1} vs {:.1} µs)", a.wall_us, b.wall_us),
        met: Some(ratio <= ACCEPT_COST_GOAL),
        note: format!(
            "backend CPU {:.2}×; WAL {:.0} vs {:.0} B per call",
            a.cpu_us / b.cpu_us,
            a.wal_bytes,
            b.wal_bytes
        ),
    }]
}

pub fn json(r: &Results) -> Value {
    json!(r
        .inbox
        .iter()
        .map(|x| json!({
            "call": x.variant.label(),
            "calls": x.calls,
            "us_per_call": x.wall_us,
            "backend_cpu_us_per_call": x.cpu_us,
            "wal_bytes_per_call": x.wal_bytes,
        }))
        .collect::<Vec<_>>())
}
