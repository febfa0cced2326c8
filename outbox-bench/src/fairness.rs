//! Fairness between the databases of one relay (issue 32): one `run --config` relay serves two
//! databases through one producer; the steady one is offered a fixed rate, first alone, then
//! while the other works off a large backlog. Its commit-to-ack p99 beside the backlog should
//! stay within 2× of alone. Written to its own report: `scripts/bench --only fairness`.

use anyhow::{anyhow, Result};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tokio_postgres::Client;

use outbox_tests::db::TestDb;
use outbox_tests::relay::{write_config, ConfigDb};

use crate::db::BenchDb;
use crate::latency::{latency, unix_us, LatencyRun, MAIN_SERVER};
use crate::relay_env::RelayEnv;
use crate::report::{ms, num, Table};
use crate::results::Results;
use crate::Profile;

const BACKLOG_TOPIC: &str = "bench.fair.backlog";
/// The goal: p99 beside the backlog at most this many times p99 alone.
pub const GOAL_RATIO: f64 = 2.0;

/// The steady database's run, and what the backlog did meanwhile.
struct Side {
    run: LatencyRun,
    /// Events of the other database due when the relay started, and when the window ended.
    backlog_start: i64,
    backlog_end: i64,
    /// From the relay's start until the other database had nothing due, and until the steady
    /// run ended.
    drained_in: Duration,
    run_ended: Duration,
    /// Commit→ack p99 (µs) of the steady events committed before the backlog drained, and how
    /// many there were: the figure the goal judges.
    overlap: (f64, usize),
    /// Peak resident memory of the relay process(es), MiB, summed.
    peak_rss_mib: f64,
}

pub async fn run(p: &Profile, env: &RelayEnv<'_>, r: &mut Results) -> Result<()> {
    let steady = TestDb::create_on(&env.db.server, "outbox_bench");
    let monitor = steady.client().await?;
    let steady_env = RelayEnv {
        db: &steady,
        monitor: &monitor,
        ..*env
    };
    let shared = fleet_config(env, &steady, "fairness.toml", &[]);
    let own = fleet_config(env, &steady, "fairness-own.toml", &["producer = \"own\""]);
    env.broker
        .try_create_topic(BACKLOG_TOPIC)
        .map_err(|e| anyhow!(e))?;
    let envs = (&steady_env, env);
    let alone = side(p, envs, "alone", Some(&shared)).await?;
    seed_backlog(p, env.monitor).await?;
    let beside = side(p, envs, "beside", Some(&shared)).await?;
    seed_backlog(p, env.monitor).await?;
    let own_producer = side(p, envs, "own", Some(&own)).await?;
    seed_backlog(p, env.monitor).await?;
    let apart = side(p, envs, "separate", None).await?;
    let ratio = beside.overlap.0 / alone.run.commit_to_ack[1];
    if ratio > GOAL_RATIO {
        r.failures.push(format!(
            "fairness: commit-to-ack p99 beside the backlog is {ratio:.2}× alone (goal ≤ {GOAL_RATIO}×)"
        ));
    }
    r.fairness_md = Some(render(p, [&alone, &beside, &own_producer, &apart], ratio));
    r.fairness = Some(json!({
        "rate": p.fair_rate, "backlog": p.fair_backlog, "ratio_p99": ratio,
        "alone": side_json(&alone), "beside": side_json(&beside),
        "beside_own_producer": side_json(&own_producer),
        "beside_separate_relays": side_json(&apart),
    }));
    Ok(())
}

/// The config file of a relay over both databases, `steady` (the steady one's extra lines).
fn fleet_config(env: &RelayEnv<'_>, steady_db: &TestDb, file: &str, steady: &[&str]) -> PathBuf {
    let path = env.workdir.join(file);
    let db = |name, url, extra| ConfigDb { name, url, extra };
    let dbs = [
        db("backlog", env.db.url(), &[][..]),
        db("steady", steady_db.url(), steady),
    ];
    write_config(&path, &dbs);
    path
}

async fn seed_backlog(p: &Profile, c: &Client) -> Result<()> {
    progress!(
        "  seeding {} events in the backlog database",
        num(p.fair_backlog as f64)
    );
    c.execute(
        "SELECT outbox_enqueue($1::text, jsonb_build_object('n', g)) \
         FROM generate_series(1, $2::bigint) g",
        &[&BACKLOG_TOPIC, &p.fair_backlog],
    )
    .await?;
    Ok(())
}

/// The relays while the steady database is offered `p.fair_rate`: one over both databases
/// (`config`), or one per database (None, the control: no shared producer, same machine).
async fn side(
    p: &Profile,
    (steady, backlog_env): (&RelayEnv<'_>, &RelayEnv<'_>),
    tag: &str,
    config: Option<&Path>,
) -> Result<Side> {
    progress!("  {} ev/s for {:?}, {tag}", num(p.fair_rate), p.fair_time);
    let backlog = backlog_env.monitor;
    let log = format!("fairness-{tag}");
    let relays = match config {
        Some(config) => vec![steady.start_fleet(config, &log)?],
        None => vec![
            steady.start_relay(&[], &log)?,
            backlog_env.start_relay(&[], &format!("{log}-backlog"))?,
        ],
    };
    let started = Instant::now();
    let backlog_start = due(backlog).await?;
    let topic = format!("bench.fair.{tag}");
    let (run, drained_in) = tokio::join!(
        latency(
            steady,
            &topic,
            p.fair_rate,
            p.fair_time.as_secs_f64(),
            false,
            Duration::from_secs(15),
            "fleet of two databases",
            MAIN_SERVER,
        ),
        drained(backlog, started)
    );
    let (run, (drained_in, drained_at)) = (run?, drained_in?);
    let overlap = p99_before(&run, drained_at);
    let run_ended = started.elapsed();
    let backlog_end = due(backlog).await?;
    let peak_rss_mib = relays.iter().filter_map(|r| r.peak_rss_kib()).sum::<u64>() as f64 / 1024.0;
    for relay in relays {
        relay.stop()?;
    }
    Ok(Side {
        run,
        backlog_start,
        backlog_end,
        drained_in,
        run_ended,
        overlap,
        peak_rss_mib,
    })
}

/// When the database had nothing due or claimed any more: counted from `since`, and as Unix µs.
async fn drained(c: &Client, since: Instant) -> Result<(Duration, f64)> {
    while due(c).await? > 0 && since.elapsed() < Duration::from_secs(600) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok((since.elapsed(), unix_us()))
}

/// p99 commit→ack (µs) and count of the events committed before `until` (Unix µs).
fn p99_before(run: &LatencyRun, until: f64) -> (f64, usize) {
    let mut h = crate::report::hist();
    for (_, lat) in run.acks.iter().filter(|(at, _)| *at < until) {
        h.saturating_record(*lat as u64);
    }
    (h.value_at_quantile(0.99) as f64, h.len() as usize)
}

/// Events due or claimed in a database.
async fn due(c: &Client) -> Result<i64> {
    let row = c
        .query_one("SELECT due_wait + sending FROM outbox_stats()", &[])
        .await?;
    Ok(row.get(0))
}

fn side_json(s: &Side) -> Value {
    json!({
        "sent": s.run.sent, "achieved_rate": s.run.achieved_rate, "missing": s.run.missing,
        "commit_to_ack_us": s.run.commit_to_ack, "ack_source": s.run.ack_source,
        "statement_to_consumer_p99_us": s.run.sq(0.99),
        "backlog_start": s.backlog_start, "backlog_end": s.backlog_end,
        "backlog_drained_secs": s.drained_in.as_secs_f64(),
        "steady_run_ended_secs": s.run_ended.as_secs_f64(),
        "p99_while_backlog_us": s.overlap.0, "events_while_backlog": s.overlap.1,
        "relay_peak_rss_mib": s.peak_rss_mib,
    })
}

fn render(p: &Profile, [alone, beside, own, apart]: [&Side; 4], ratio: f64) -> String {
    let mut t = Table::new(&[
        "steady database",
        "events",
        "achieved ev/s",
        "commit→ack p50 ms",
        "p99 ms",
        "max ms",
        "p99 ms of the events committed while the backlog drained (events)",
        "statement→consumer p99 ms",
        "other database due at start / end of window",
        "relay peak RSS MiB (all relays)",
    ]);
    let rows = [
        ("alone", alone),
        ("beside the backlog, one relay", beside),
        ("beside the backlog, one relay, `producer = \"own\"`", own),
        ("beside the backlog, a relay each (control)", apart),
    ];
    for (name, s) in rows {
        t.row(vec![
            name.into(),
            num(s.run.sent as f64),
            num(s.run.achieved_rate),
            ms(s.run.commit_to_ack[0]),
            ms(s.run.commit_to_ack[1]),
            ms(s.run.commit_to_ack[3]),
            match s.overlap.1 {
                0 => "no backlog".to_string(),
                n => format!("{} ({})", ms(s.overlap.0), num(n as f64)),
            },
            ms(s.run.sq(0.99)),
            format!(
                "{} / {}",
                num(s.backlog_start as f64),
                num(s.backlog_end as f64)
            ),
            format!("{:.1}", s.peak_rss_mib),
        ]);
    }
    let ratio_of = |s: &Side| s.overlap.0 / alone.run.commit_to_ack[1];
    let (own, control) = (ratio_of(own), ratio_of(apart));
    format!(
        "One relay (`run --config`, defaults: one shared producer, each database its own claim \
         loops) serves two databases on the same server. The steady database is offered {} \
         single-event transactions per second for {:?}; beside, the other database starts with \
         a backlog of {} events, which the relay worked off in {:.1} s from its start; the \
         steady run (warm-up, window, arrivals) ended {:.1} s after the start. The control runs \
         the same backlog with a relay per database (no shared producer): what is left of the \
         slowdown there is the machine (database, broker and relays on 2 cores), not the \
         sharing. Commit→ack: {}.\n\n{}\n\
         **p99 of the events committed while the backlog drained / p99 alone: {ratio:.2}×** \
         (goal ≤ {GOAL_RATIO}×: {}); with its own producer: {own:.2}×; with a relay per database: \
         {control:.2}×.\n",
        num(p.fair_rate),
        p.fair_time,
        num(p.fair_backlog as f64),
        beside.drained_in.as_secs_f64(),
        beside.run_ended.as_secs_f64(),
        alone.run.ack_source,
        t.render(),
        if ratio <= GOAL_RATIO {
            "met"
        } else {
            "NOT met"
        }
    )
}
