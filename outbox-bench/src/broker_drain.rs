//! Drain through the relay to the local broker (report section 2): claim loops, batch sizes and
//! `linger.ms` settings, with the CPU of the database, the relay and the broker.

use anyhow::{bail, Result};
use std::time::{Duration, Instant};

use crate::db::{self, DbCpu};
use crate::relay_env::RelayEnv;
use crate::report::{not_run, num, Table};
use crate::results::Results;
use crate::sys::{HostMeter, ProcSnapshot};
use crate::Profile;

/// The topic of the drain's backlog (RocketMQ allows no dot in a topic name).
pub const DRAIN_TOPIC: &str = "bench_drain";

/// A configuration that drains slower than this (events/s) runs once: it is slow, not disturbed.
const REPEAT_ABOVE: f64 = 2_500.0;

pub struct BrokerDrain {
    pub loops: usize,
    pub settings: String,
    pub default_settings: bool,
    pub drained: i64,
    /// First claim to last ack, from the rows' own timestamps (excludes relay start-up).
    pub secs: f64,
    /// Relay start to "nothing due, nothing in flight" seen by polling.
    pub wall_secs: f64,
    pub complete: bool,
    pub db_cpu_secs: Option<f64>,
    pub relay_cpu_secs: f64,
    pub broker_cpu_secs: f64,
    pub host_busy_pct: f64,
    pub other_pct: f64,
}

impl BrokerDrain {
    pub fn rate(&self) -> f64 {
        self.drained as f64 / self.secs.max(1e-9)
    }
    fn per_event(&self, secs: f64) -> String {
        format!("{:.1}", secs * 1e6 / self.drained.max(1) as f64)
    }
}
/// Drains a fresh backlog through `outbox-worker run --concurrency loops <extra>`.
pub async fn drain(
    env: &RelayEnv<'_>,
    backlog: i64,
    cap: Duration,
    loops: usize,
    extra: &[String],
    tag: &str,
) -> Result<BrokerDrain> {
    db::fill_backlog(env.monitor, backlog, DRAIN_TOPIC).await?;
    drain_filled(env, backlog, cap, loops, extra, tag).await
}

/// Drains the `backlog` events already in the table (and nothing else: the caller emptied it
/// before filling) through `outbox-worker run --concurrency loops <extra>`; the fill stays out of
/// every figure.
pub async fn drain_filled(
    env: &RelayEnv<'_>,
    backlog: i64,
    cap: Duration,
    loops: usize,
    extra: &[String],
    tag: &str,
) -> Result<BrokerDrain> {
    let m = env.monitor;
    let mut args = vec!["--concurrency".to_string(), loops.to_string()];
    args.extend(extra.iter().cloned());
    // Stream events keep no claim or ack time (their row is never rewritten): the stream's
    // batches are logged as they are created and settled, for the span below.
    m.batch_execute(STREAM_BATCH_LOG).await?;
    let cpu = DbCpu::start(m, &env.db.name).await?;
    let broker_pid = env.sink.pid.map_or(0, |p| p as i32);
    let b0 = ProcSnapshot::take(&[broker_pid]);
    let host0 = HostMeter::start();
    let start = Instant::now();
    let mut relay = env.start_relay(&args, tag)?;
    let complete = db::wait_drained(m, cap).await?;
    let wall_secs = start.elapsed().as_secs_f64();
    let db_cpu = cpu.stop(m, &env.db.name).await?;
    let relay_cpu = ProcSnapshot::take(&[relay.pid()]).cpu_secs_since(&ProcSnapshot::default());
    let broker_cpu = ProcSnapshot::take(&[broker_pid]).cpu_secs_since(&b0);
    let (host_busy, other_pct) = host0.stop(db_cpu.unwrap_or(0.0) + relay_cpu + broker_cpu);
    let running = relay.is_running();
    let tail = relay.log_tail();
    relay.stop()?;
    if !running {
        bail!("the relay died during the drain; {tail}");
    }
    let r = m
        .query_one(
            "SELECT (SELECT count(*) FROM outbox_event WHERE status = 'SUCCESS'),
                    (SELECT count(*) FROM outbox_event WHERE status = 'FAIL'),
                    coalesce(extract(epoch FROM
                        greatest((SELECT max(updated_at) FROM outbox_scheduled WHERE status = 'SUCCESS'),
                                 (SELECT max(at) FROM bench_stream_batch_log))
                        - least((SELECT min(claimed_at) FROM outbox_scheduled),
                                (SELECT min(at) FROM bench_stream_batch_log)))::float8, 0)",
            &[],
        )
        .await?;
    let (ok, failed, span): (i64, i64, f64) = (r.get(0), r.get(1), r.get(2));
    progress!(
        "    -> {:.0} events/s ({ok} events, {span:.2} s first claim to last ack, {wall_secs:.1} s wall)",
        ok as f64 / span.max(1e-9)
    );
    if failed > 0 {
        bail!("{failed} events were dead-lettered during the drain to the broker; {tail}");
    }
    if complete && ok != backlog {
        bail!("drain to the broker ended with {ok} SUCCESS rows for {backlog} events; {tail}");
    }
    Ok(BrokerDrain {
        loops,
        settings: if args.len() > 2 {
            format!("`{}`", args[2..].join(" "))
        } else {
            "defaults".into()
        },
        default_settings: extra.is_empty(),
        drained: ok,
        secs: if span > 0.0 { span } else { wall_secs },
        wall_secs,
        complete,
        db_cpu_secs: db_cpu,
        relay_cpu_secs: relay_cpu,
        broker_cpu_secs: broker_cpu,
        host_busy_pct: host_busy,
        other_pct,
    })
}

pub fn drain_table(runs: &[BrokerDrain]) -> String {
    let mut t = Table::new(&[
        "claim loops",
        "relay settings",
        "events",
        "events/s",
        "wall s (incl. start)",
        "CPU µs/event DB / relay / broker",
        "host CPU busy (other load)",
    ]);
    for r in runs {
        t.row(vec![
            r.loops.to_string(),
            r.settings.clone(),
            format!(
                "{}{}",
                num(r.drained as f64),
                if r.complete { "" } else { " (time cap)" }
            ),
            num(r.rate()),
            format!("{:.1}", r.wall_secs),
            format!(
                "{} / {} / {}",
                r.db_cpu_secs
                    .map(|c| r.per_event(c))
                    .unwrap_or_else(|| "n/a".into()),
                r.per_event(r.relay_cpu_secs),
                r.per_event(r.broker_cpu_secs)
            ),
            format!("{:.0} % ({:.0} %)", r.host_busy_pct, r.other_pct),
        ]);
    }
    t.render()
}

pub async fn run(p: &Profile, env: &RelayEnv<'_>, r: &mut Results) -> Result<()> {
    progress!("==> 2. drain to the broker through outbox-worker");
    let mut configs: Vec<(usize, Vec<String>)> =
        p.broker_loops.iter().map(|&l| (l, vec![])).collect();
    for &b in &p.broker_batches {
        configs.push((1, vec!["--batch-size".into(), b.to_string()]));
    }
    for &l in &p.linger_ms {
        configs.push((1, vec!["--kafka-property".into(), format!("linger.ms={l}")]));
    }
    for (i, (loops, extra)) in configs.iter().enumerate() {
        progress!(
            "  {} events, {loops} loop(s) {}",
            num(p.broker_backlog as f64),
            extra.join(" ")
        );
        let mut best: Option<BrokerDrain> = None;
        for k in 0..p.repeats {
            let run = drain(
                env,
                p.broker_backlog,
                p.broker_cap,
                *loops,
                extra,
                &format!("drain-{i}-{k}"),
            )
            .await?;
            if p.name == "smoke" && !run.complete {
                r.failures.push(format!(
                    "drain to the broker ({loops} loops {}): not complete within {:?}",
                    extra.join(" "),
                    p.broker_cap
                ));
            }
            let slow = run.rate() < REPEAT_ABOVE;
            if best.as_ref().is_none_or(|b| run.rate() > b.rate()) {
                best = Some(run);
            }
            // A slow configuration (small batches) is not repeated: it is slow, not disturbed.
            if slow {
                break;
            }
        }
        r.broker.extend(best);
    }
    env.monitor.batch_execute(db::TRUNCATE_OUTBOX).await?;
    Ok(())
}

pub fn markdown(p: &Profile, r: &Results) -> String {
    let mut s = String::new();
    if r.broker.is_empty() {
        s += &not_run(r);
    } else {
        s += &format!(
            "`outbox-worker run` ({}) against a fresh backlog of {} events, topic with {} \
             partitions on a single-node Apache Kafka (KRaft, log on local disk) on the same machine. Events/s from the rows' own \
             timestamps (first `claimed_at` to last ack; stream events by a trigger log of their batches), so relay start-up is excluded; the end is \
             detected by polling until nothing is due or in flight and confirmed with `outbox_stats()`. \
             CPU from /proc for the database backends, the relay process and the broker process. \
             Best of {} run(s) per row (configurations under {} events/s run once).\n\n",
            outbox_tests::relay::relay_build(),
            num(p.broker_backlog as f64),
            outbox_tests::broker::PARTITIONS,
            p.repeats,
            num(REPEAT_ABOVE)
        );
        s += &drain_table(&r.broker);
    }
    s
}

/// A log of the stream's batches, created and settled (a trigger in the benchmark's own database).
const STREAM_BATCH_LOG: &str = "
    DROP TABLE IF EXISTS bench_stream_batch_log;
    CREATE TABLE bench_stream_batch_log (at timestamptz NOT NULL DEFAULT clock_timestamp());
    CREATE OR REPLACE FUNCTION bench_log_stream_batch() RETURNS trigger LANGUAGE plpgsql
    -- It fires inside the extension's functions, whose search_path is pinned to pg_catalog.
    SET search_path FROM CURRENT AS $$
    BEGIN
        INSERT INTO bench_stream_batch_log DEFAULT VALUES;
        RETURN NULL;
    END $$;
    DROP TRIGGER IF EXISTS bench_log_stream_batch ON outbox_stream_batch;
    CREATE TRIGGER bench_log_stream_batch AFTER INSERT OR DELETE ON outbox_stream_batch
        FOR EACH ROW EXECUTE FUNCTION bench_log_stream_batch();";
