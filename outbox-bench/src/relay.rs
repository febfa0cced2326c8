//! 2b. Drain through the real relay binary to the local broker; 3. commit-to-broker latency.

use anyhow::{anyhow, bail, Result};
use hdrhistogram::Histogram;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};
use tokio_postgres::Client;

use outbox_tests::broker::Broker;
use outbox_tests::db::TestDb;
use outbox_tests::relay::Relay;

use crate::broker::Arrivals;
use crate::db::{self, BenchDb, DbCpu};
use crate::report::{ms, num, Table};
use crate::sys::{HostMeter, ProcSnapshot};

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

pub struct RelayEnv<'a> {
    pub db: &'a TestDb,
    pub monitor: &'a Client,
    pub broker: &'a Broker,
    pub relay_bin: &'a Path,
    pub workdir: &'a Path,
}

impl RelayEnv<'_> {
    /// `outbox-worker run --brokers BROKERS <extra>` on the bench database, with no `OUTBOX_*`
    /// variable of the caller ("default settings" means defaults) and the URL in the environment
    /// (a password never shows in `ps`); its log is written to `relay-<tag>.log` in the workdir.
    pub fn start_relay(&self, extra: &[String], tag: &str) -> Result<BenchRelay> {
        let mut cmd = Command::new(self.relay_bin);
        cmd.arg("run")
            .arg("--brokers")
            .arg(self.broker.addr())
            .args(extra);
        for (k, _) in std::env::vars_os() {
            if k.to_string_lossy().starts_with("OUTBOX_") {
                cmd.env_remove(k);
            }
        }
        cmd.env("OUTBOX_DATABASE_URL", self.db.url());
        let relay =
            Relay::start(cmd).map_err(|e| anyhow!("starting {}: {e}", self.relay_bin.display()))?;
        let mut r = BenchRelay {
            relay,
            log: self.workdir.join(format!("relay-{tag}.log")),
        };
        if let Some(st) = r.relay.wait_exit(Duration::from_millis(200)) {
            bail!("the relay exited at start ({st}); {}", r.log_tail());
        }
        Ok(r)
    }
}

/// A relay started by the bench: stopped with SIGTERM (graceful) by `stop`, killed on drop, its
/// log kept in the workdir either way.
pub struct BenchRelay {
    relay: Relay,
    log: PathBuf,
}

impl BenchRelay {
    pub fn pid(&self) -> i32 {
        self.relay.pid() as i32
    }

    pub fn is_running(&mut self) -> bool {
        self.relay.is_running()
    }

    pub fn log_tail(&self) -> String {
        format!("log {}:\n{}", self.log.display(), self.relay.log_tail(15))
    }

    /// SIGTERM and wait; an error if it had to be killed or exited with a failure.
    pub fn stop(mut self) -> Result<()> {
        let st = self
            .relay
            .terminate(Duration::from_secs(20))
            .map_err(|e| anyhow!("{e}; {}", self.log_tail()))?;
        if !st.success() {
            bail!(
                "the relay exited with {st} after SIGTERM; {}",
                self.log_tail()
            );
        }
        Ok(())
    }
}

impl Drop for BenchRelay {
    fn drop(&mut self) {
        let _ = std::fs::write(&self.log, self.relay.logs());
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
    let m = env.monitor;
    db::fill_backlog(m, backlog, "bench.drain").await?;
    let mut args = vec!["--concurrency".to_string(), loops.to_string()];
    args.extend(extra.iter().cloned());
    let cpu = DbCpu::start(m, &env.db.name).await?;
    let broker_pid = env.broker.pid().map_or(0, |p| p as i32);
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
            "SELECT count(*) FILTER (WHERE status = 'SUCCESS'),
                    count(*) FILTER (WHERE status = 'FAIL'),
                    coalesce(extract(epoch FROM max(updated_at) FILTER (WHERE status = 'SUCCESS')
                                             - min(claimed_at))::float8, 0)
               FROM outbox_event",
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

pub struct LatencyRun {
    pub rate: f64,
    pub notify: bool,
    pub settings: String,
    pub sent: i64,
    pub achieved_rate: f64,
    pub missing: i64,
    pub duplicates: u64,
    pub hist: Histogram<u64>,
    /// From the rows' own timestamps (database clock), p50 and p99 in µs: transaction start
    /// (`created_at`, ≈ commit for a one-statement transaction) to claim, and claim to ack.
    pub to_claim: (f64, f64),
    pub to_ack: (f64, f64),
    /// Transaction start to ack (database clock): p50, p99, p99.9, max in µs. The ack follows the
    /// broker's delivery report, so this is the "commit to delivery report" plus the ack's
    /// round trip, and over-states it by the enqueue statement's own time.
    pub commit_to_ack: [f64; 4],
    pub ack_source: &'static str,
}

impl LatencyRun {
    pub fn q(&self, q: f64) -> f64 {
        self.hist.value_at_quantile(q) as f64
    }
}

/// Offers `rate` single-event transactions per second for `secs` to `topic` (the relay must be
/// running) and measures commit (client sees COMMIT done) to arrival at a consumer.
#[allow(clippy::too_many_arguments)]
pub async fn latency(
    env: &RelayEnv<'_>,
    topic: &str,
    rate: f64,
    secs: f64,
    notify: bool,
    settle: Duration,
    settings: &str,
) -> Result<LatencyRun> {
    env.broker.try_create_topic(topic).map_err(|e| anyhow!(e))?;
    let arrivals = Arrivals::start(&env.broker.addr(), topic)?;
    // Warm-up: one event must make it through before the clock starts.
    env.monitor
        .query_one(
            "SELECT outbox_enqueue($1::text, '{\"seq\": -1}'::jsonb)",
            &[&topic],
        )
        .await?;
    let warm_deadline = Instant::now() + Duration::from_secs(30);
    while !arrivals.warm.load(std::sync::atomic::Ordering::Relaxed) {
        if Instant::now() > warm_deadline {
            bail!("the warm-up event for {topic} did not reach the consumer within 30 s");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let total = (rate * secs).round().max(1.0) as i64;
    let producers = ((rate / 100.0).ceil() as usize).clamp(1, 16);
    let mut clients = Vec::new();
    for _ in 0..producers {
        let c = env.db.client().await?;
        if !notify {
            c.batch_execute("SET outbox.notify = off").await?;
        }
        clients.push(c);
    }
    let start = tokio::time::Instant::now() + Duration::from_millis(50);
    let mut tasks = Vec::new();
    for (k, c) in clients.into_iter().enumerate() {
        tasks.push(tokio::spawn(producer(
            c,
            topic.to_string(),
            k as i64,
            producers as i64,
            total,
            rate,
            start,
        )));
    }
    let mut commits: Vec<Option<Instant>> = vec![None; total as usize];
    let mut commit_wall: Vec<(i64, f64)> = Vec::with_capacity(total as usize);
    let mut last_commit = start.into_std();
    for t in tasks {
        for (seq, at, id, wall) in t.await?? {
            commits[seq as usize] = Some(at);
            commit_wall.push((id, wall));
            if at > last_commit {
                last_commit = at;
            }
        }
    }
    let achieved_rate = total as f64 / (last_commit - start.into_std()).as_secs_f64().max(1e-9);
    let deadline = Instant::now() + settle;
    while (arrivals.seen.load(std::sync::atomic::Ordering::Relaxed) as i64) < total
        && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A little longer to catch duplicates.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let got = arrivals.finish()?;
    let mut first: Vec<Option<Instant>> = vec![None; total as usize];
    let mut duplicates = 0;
    for (seq, at) in got {
        if seq < 0 || seq >= total {
            continue;
        }
        match first[seq as usize] {
            None => first[seq as usize] = Some(at),
            Some(_) => duplicates += 1,
        }
    }
    let mut hist = crate::report::hist();
    let mut received = 0;
    for (c, a) in commits.iter().zip(&first) {
        if let (Some(c), Some(a)) = (c, a) {
            hist.saturating_record(a.saturating_duration_since(*c).as_micros() as u64);
            received += 1;
        }
    }
    let split = env
        .monitor
        .query_one(
            "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY c), percentile_cont(0.99) WITHIN GROUP (ORDER BY c),
                    percentile_cont(0.5) WITHIN GROUP (ORDER BY a), percentile_cont(0.99) WITHIN GROUP (ORDER BY a),
                    percentile_cont(0.5) WITHIN GROUP (ORDER BY t), percentile_cont(0.99) WITHIN GROUP (ORDER BY t),
                    percentile_cont(0.999) WITHIN GROUP (ORDER BY t), max(t)
               FROM (SELECT (extract(epoch FROM claimed_at - created_at) * 1e6)::float8 AS c,
                            (extract(epoch FROM updated_at - claimed_at) * 1e6)::float8 AS a,
                            (extract(epoch FROM updated_at - created_at) * 1e6)::float8 AS t
                       FROM outbox_event
                      WHERE topic = $1 AND status = 'SUCCESS' AND (payload->>'seq')::bigint >= 0) s",
            &[&topic],
        )
        .await?;
    let f = |i: usize| split.get::<_, Option<f64>>(i).unwrap_or(f64::NAN);
    // Commit (the client saw COMMIT complete) to ack, per event: the client's clock against the
    // row's ack timestamp. Valid when the database runs on this machine (one clock); otherwise
    // the database-only measure (transaction start to ack) is used.
    let mut commit_to_ack = [f(4), f(5), f(6), f(7)];
    let mut ack_source = "DB clock: transaction start → ack";
    if env.db.is_local() {
        let acks: std::collections::HashMap<i64, f64> = env
            .monitor
            .query(
                "SELECT id, (extract(epoch FROM updated_at) * 1e6)::float8 FROM outbox_event
                  WHERE topic = $1 AND status = 'SUCCESS'",
                &[&topic],
            )
            .await?
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        let mut h = crate::report::hist();
        for (id, wall) in &commit_wall {
            if let Some(a) = acks.get(id) {
                h.saturating_record((a - wall).max(0.0) as u64);
            }
        }
        if !h.is_empty() {
            commit_to_ack = [
                h.value_at_quantile(0.5) as f64,
                h.value_at_quantile(0.99) as f64,
                h.value_at_quantile(0.999) as f64,
                h.max() as f64,
            ];
            ack_source = "commit seen by the client → ack, one machine clock";
        }
    }
    progress!(
        "    -> commit to ack p50 {:.2} ms p99 {:.2} ms; to consumer p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms; {} of {total} arrived",
        commit_to_ack[0] / 1000.0,
        commit_to_ack[1] / 1000.0,
        hist.value_at_quantile(0.5) as f64 / 1000.0,
        hist.value_at_quantile(0.99) as f64 / 1000.0,
        hist.max() as f64 / 1000.0,
        received
    );
    Ok(LatencyRun {
        to_claim: (f(0), f(1)),
        to_ack: (f(2), f(3)),
        commit_to_ack,
        ack_source,
        rate,
        notify,
        settings: settings.to_string(),
        sent: total,
        achieved_rate,
        missing: total - received as i64,
        duplicates,
        hist,
    })
}

/// (sequence number, commit seen by the client, event id, commit as Unix µs)
type Commit = (i64, Instant, i64, f64);

fn unix_us() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64() * 1e6)
        .unwrap_or(0.0)
}

async fn producer(
    c: Client,
    topic: String,
    k: i64,
    step: i64,
    total: i64,
    rate: f64,
    start: tokio::time::Instant,
) -> Result<Vec<Commit>> {
    let stmt = c
        .prepare("SELECT outbox_enqueue($1::text, $2::jsonb, $3::text, 'OrderCreated')")
        .await?;
    let mut out = Vec::new();
    let mut seq = k;
    while seq < total {
        tokio::time::sleep_until(start + Duration::from_secs_f64(seq as f64 / rate)).await;
        let payload = serde_json::json!({"seq": seq, "order_id": seq, "amount": 42.5});
        let key = format!("order-{seq}");
        let id: i64 = c.query_one(&stmt, &[&topic, &payload, &key]).await?.get(0);
        out.push((seq, Instant::now(), id, unix_us()));
        seq += step;
    }
    Ok(out)
}

pub fn latency_table(runs: &[LatencyRun]) -> String {
    let mut t = Table::new(&[
        "offered ev/s (achieved)",
        "wake-up",
        "relay settings",
        "events",
        "commit→ack p50 / p99 / p99.9 / max ms",
        "commit→consumer p50 / p99 / p99.9 / max ms",
        "start→claim / claim→ack p50 ms",
        "missing / dup",
    ]);
    for r in runs {
        let c = &r.commit_to_ack;
        t.row(vec![
            format!("{} ({})", num(r.rate), num(r.achieved_rate)),
            if r.notify {
                "NOTIFY".into()
            } else {
                "polling only".into()
            },
            r.settings.clone(),
            num(r.sent as f64),
            format!("{} / {} / {} / {}", ms(c[0]), ms(c[1]), ms(c[2]), ms(c[3])),
            format!(
                "{} / {} / {} / {}",
                ms(r.q(0.5)),
                ms(r.q(0.99)),
                ms(r.q(0.999)),
                ms(r.hist.max() as f64)
            ),
            format!("{} / {}", ms(r.to_claim.0), ms(r.to_ack.0)),
            format!("{} / {}", r.missing, r.duplicates),
        ]);
    }
    t.render()
}
