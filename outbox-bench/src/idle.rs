//! Idle cost (issue 10): CPU used on the database server by the backends of a relay with default
//! settings and nothing to do, in both wake-up modes.

use anyhow::{bail, Result};
use std::time::{Duration, Instant};
use tokio_postgres::Client;

use outbox_worker::{defaults, WAKEUP_READY};

use crate::relay_env::RelayEnv;
use crate::report::{not_run, Table};
use crate::results::Results;
use crate::sys::{clk_tck, proc_ticks, ProcSnapshot};
use crate::Profile;

pub struct IdleRun {
    pub server: &'static str,
    pub wake: String,
    pub secs: f64,
    /// The relay's backends at the start and at the end of the window.
    pub backends: (usize, usize),
    /// CPU seconds of those backends over the window (None: not visible in /proc).
    pub db_cpu_secs: Option<f64>,
    /// CPU seconds of the relay process itself.
    pub relay_cpu_secs: Option<f64>,
    /// Transactions of the bench database over the window (pg_stat_database, approximate: the
    /// backends report at most once a second).
    pub xacts: Option<i64>,
}

impl IdleRun {
    /// DB backends' CPU as % of one core.
    pub fn pct(&self) -> Option<f64> {
        Some(100.0 * self.db_cpu_secs? / self.secs)
    }
}

/// The relay's database sessions (its `application_name`).
pub async fn relay_pids(c: &Client, db: &str) -> Result<Vec<i32>> {
    Ok(c.query(
        "SELECT pid FROM pg_stat_activity WHERE datname = $1 AND application_name = $2",
        &[&db, &defaults::CLIENT_ID],
    )
    .await?
    .iter()
    .map(|r| r.get(0))
    .collect())
}

async fn xacts(c: &Client, db: &str) -> Result<i64> {
    Ok(c.query_one(
        "SELECT (xact_commit + xact_rollback)::bigint FROM pg_stat_database WHERE datname = $1",
        &[&db],
    )
    .await?
    .get(0))
}

struct Watch {
    pids: Vec<i32>,
    snap: ProcSnapshot,
    relay: Option<u64>,
    xacts: i64,
    at: Instant,
}

/// Starts a relay (defaults) on each server with an empty outbox, waits until it waits, then
/// watches all of them over the same `p.idle_time` window.
pub async fn run(
    p: &Profile,
    envs: &[(&'static str, &RelayEnv<'_>)],
    r: &mut Results,
) -> Result<()> {
    let mut relays = Vec::new();
    for (i, (server, env)) in envs.iter().enumerate() {
        env.monitor
            .batch_execute(crate::db::TRUNCATE_OUTBOX)
            .await?;
        let relay = env.start_relay(&[], &format!("idle-{i}"))?;
        if !relay.wait_log(&[WAKEUP_READY], Duration::from_secs(30)) {
            bail!(
                "idle relay on the {server} never logged {WAKEUP_READY:?}; {}",
                relay.log_tail()
            );
        }
        relays.push(relay);
    }
    // Let start-up work (pool warm-up, first maintenance rounds) pass.
    tokio::time::sleep(Duration::from_secs(2)).await;
    progress!(
        "  {} idle relay(s) (defaults) watched for {:?}",
        relays.len(),
        p.idle_time
    );
    let mut watches = Vec::new();
    for ((_, env), relay) in envs.iter().zip(&relays) {
        let pids = relay_pids(env.monitor, &env.db.name).await?;
        watches.push(Watch {
            snap: ProcSnapshot::take(&pids),
            pids,
            relay: proc_ticks(relay.pid()),
            xacts: xacts(env.monitor, &env.db.name).await?,
            at: Instant::now(),
        });
    }
    tokio::time::sleep(p.idle_time).await;
    for (((server, env), relay), w) in envs.iter().zip(&relays).zip(&watches) {
        let end_pids = relay_pids(env.monitor, &env.db.name).await?;
        let mut all = w.pids.clone();
        all.extend(end_pids.iter().filter(|p| !w.pids.contains(p)));
        let end = ProcSnapshot::take(&all);
        let secs = w.at.elapsed().as_secs_f64();
        let wake: String = env
            .monitor
            .query_one("SELECT outbox_wake_mode()", &[])
            .await?
            .get(0);
        let x = xacts(env.monitor, &env.db.name).await?;
        let run = IdleRun {
            server,
            wake,
            secs,
            backends: (w.pids.len(), end_pids.len()),
            db_cpu_secs: (!end.0.is_empty()).then(|| end.cpu_secs_since(&w.snap)),
            relay_cpu_secs: match (w.relay, proc_ticks(relay.pid())) {
                (Some(a), Some(b)) => Some(b.saturating_sub(a) as f64 / clk_tck()),
                _ => None,
            },
            xacts: Some(x - w.xacts),
        };
        progress!(
            "    -> {server} (`{}`): {} backend(s), DB CPU {} % of a core",
            run.wake,
            run.backends.1,
            run.pct()
                .map(|p| format!("{p:.3}"))
                .unwrap_or_else(|| "n/a".into())
        );
        r.idle.push(run);
    }
    for relay in relays {
        relay.stop()?;
    }
    Ok(())
}

pub fn markdown(p: &Profile, r: &Results) -> String {
    if r.idle.is_empty() {
        return not_run(r);
    }
    let mut t = Table::new(&[
        "server (wake-up mode)",
        "window s",
        "relay backends (start / end)",
        "DB backends' CPU s",
        "% of one core",
        "≈ transactions/s",
        "relay process CPU % of one core",
    ]);
    for i in &r.idle {
        t.row(vec![
            format!("{} (`{}`)", i.server, i.wake),
            format!("{:.1}", i.secs),
            format!("{} / {}", i.backends.0, i.backends.1),
            i.db_cpu_secs
                .map(|c| format!("{c:.2}"))
                .unwrap_or_else(|| "n/a".into()),
            i.pct()
                .map(|c| format!("{c:.2} %"))
                .unwrap_or_else(|| "n/a".into()),
            i.xacts
                .map(|x| format!("{:.1}", x as f64 / i.secs))
                .unwrap_or_else(|| "n/a".into()),
            i.relay_cpu_secs
                .map(|c| format!("{:.2} %", 100.0 * c / i.secs))
                .unwrap_or_else(|| "n/a".into()),
        ]);
    }
    format!(
        "A relay with default settings (`outbox-worker run --brokers …`, nothing else) on an empty \
         outbox, on each server, watched over the same {:.0} s window after it logged that its \
         wake-up session waits (plus 2 s for start-up). **How it was measured:** the relay's \
         database sessions are the rows of `pg_stat_activity` with `application_name = '{}'` in \
         the bench database; their CPU is utime + stime read from `/proc/<pid>/stat` before and \
         after the window (10 ms ticks), divided by the window: % of one core. Transactions/s is \
         the bench database's `xact_commit + xact_rollback` delta from `pg_stat_database` \
         (approximate). With the preload the wake-up session's `outbox_wait` sleeps on its latch \
         and looks at the queue every 250 ms; without, every `outbox.wait_poll_interval` (10 ms); \
         each call lasts up to 1 s, and the claim loops poll every {} s.\n\n{}",
        p.idle_time.as_secs_f64(),
        defaults::CLIENT_ID,
        defaults::POLL_INTERVAL.as_secs(),
        t.render()
    )
}
