//! Commit-to-broker latency (report section 3): open-loop single-event transactions at fixed rates
//! while the relay runs with its defaults, timed from the statement to a consumer's arrival and to
//! the row's ack; on the main server (preloaded: commits wake the relay's `outbox_wait`) and on a
//! throwaway server without `shared_preload_libraries` (the wait polls the queue).

use anyhow::{anyhow, bail, Result};
use hdrhistogram::Histogram;
use outbox_worker::defaults;
use std::time::{Duration, Instant};
use tokio_postgres::Client;

use crate::arrivals::{Arrivals, FETCH_WAIT_MAX_MS};
use crate::db::BenchDb;
use crate::goals::LATENCY_GOAL_RATE;
use crate::relay_env::{BenchRelay, RelayEnv};
use crate::report::{ms, not_run, num, Table};
use crate::results::Results;
use crate::stages::StageHists;
use crate::sys::{HostMeter, ProcSnapshot};
use crate::Profile;

/// One producer connection per this many offered events/s, at most `MAX_PRODUCERS`.
const EVENTS_PER_PRODUCER: f64 = 100.0;
const MAX_PRODUCERS: usize = 16;

pub struct LatencyRun {
    pub rate: f64,
    /// Which server: `MAIN_SERVER` or `POLLING_SERVER`.
    pub server: &'static str,
    /// `outbox_wake_mode()` on that server: "commit" or "polling".
    pub wake: String,
    /// The producers set `outbox.notify = on` (a contrast: the relay does not LISTEN).
    pub producer_notify: bool,
    /// Plain INSERTs per second beside the events (`--latency-background`), else 0.
    pub background: f64,
    pub settings: String,
    pub sent: i64,
    pub achieved_rate: f64,
    pub missing: i64,
    pub duplicates: u64,
    /// Commit (the producer saw its statement complete) to arrival at the consumer, µs.
    pub hist: Histogram<u64>,
    /// Statement issued (autocommit: one statement = one transaction) to arrival, µs: the goal's
    /// "statement→consumer".
    pub stmt_hist: Histogram<u64>,
    /// From the rows' own timestamps (database clock), p50 and p99 in µs: transaction start
    /// (`created_at`, ≈ commit for a one-statement transaction) to claim, and claim to ack.
    pub to_claim: (f64, f64),
    pub to_ack: (f64, f64),
    /// Transaction start to ack (database clock): p50, p99, p99.9, max in µs. The ack follows the
    /// broker's delivery report, so this is the "commit to delivery report" plus the ack's
    /// round trip, and over-states it by the enqueue statement's own time.
    pub commit_to_ack: [f64; 4],
    pub ack_source: &'static str,
    /// Server CPU of the relay's database sessions per event offered, µs (None: the server's
    /// processes are not visible here).
    pub relay_db_cpu_us: Option<f64>,
    /// The whole machine's CPU busy over the run (producers start to last arrival), % of all cores.
    pub machine_busy_pct: f64,
    /// Per event, when the database runs on this machine: (commit as Unix µs, commit to ack µs).
    pub acks: Vec<(f64, f64)>,
    /// Commit seen by the client to the broker's append (the topic stamps messages with
    /// LogAppendTime, milliseconds): p50, p99 in µs.
    pub to_append: (f64, f64),
    /// Where the time went, p50 and p99 in µs: commit seen by the client to the claim's start
    /// (the claim's own clock_timestamp; one machine clock), then the relay's stages
    /// ([`crate::stages::STAGES`], from its metrics).
    pub commit_to_claim: (f64, f64),
    pub stages: Vec<(&'static str, f64, f64)>,
}

impl LatencyRun {
    pub fn q(&self, q: f64) -> f64 {
        self.hist.value_at_quantile(q) as f64
    }
    /// Statement→consumer quantile, µs.
    pub fn sq(&self, q: f64) -> f64 {
        self.stmt_hist.value_at_quantile(q) as f64
    }
    /// Relay defaults, producers with the shipped settings: the runs the goals judge.
    pub fn is_default(&self) -> bool {
        self.settings == "defaults" && !self.producer_notify
    }
}

/// What a run offers: single-event transactions per second through the outbox, plain INSERTs per
/// second beside them (`--latency-background`), and whether its producers set `outbox.notify`.
#[derive(Clone, Copy)]
pub struct Offer {
    pub rate: f64,
    pub background: f64,
    pub notify: bool,
}

impl Offer {
    /// `rate` events/s alone, producers with the shipped settings.
    pub fn plain(rate: f64) -> Self {
        Offer {
            rate,
            background: 0.0,
            notify: false,
        }
    }
}

pub const MAIN_SERVER: &str = "main server";
pub const POLLING_SERVER: &str = "throwaway server, no preload";
pub const PRELOADED_SERVER: &str = "throwaway server, preloaded";

/// Offers `rate` single-event transactions per second for `secs` to `topic` (the relay must be
/// running) and measures commit (client sees COMMIT done) to arrival at a consumer.
#[allow(clippy::too_many_arguments)]
pub async fn latency(
    env: &RelayEnv<'_>,
    relay: &BenchRelay,
    topic: &str,
    partitions: i32,
    offer: Offer,
    secs: f64,
    settle: Duration,
    settings: &str,
    server: &'static str,
) -> Result<LatencyRun> {
    let wake: String = env
        .monitor
        .query_one("SELECT outbox_wake_mode()", &[])
        .await?
        .get(0);
    // Broker timestamps: a message's timestamp is its append time (commit → append).
    outbox_tests::kafka::create_topics_with(
        &env.broker.addr(),
        &[topic],
        partitions,
        &[("message.timestamp.type", "LogAppendTime")],
    )
    .map_err(|e| anyhow!(e))?;
    env.monitor.batch_execute(STREAM_ACK_LOG).await?;
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
    let Offer {
        rate,
        background,
        notify: producer_notify,
    } = offer;
    let total = (rate * secs).round().max(1.0) as i64;
    let producers = ((rate / EVENTS_PER_PRODUCER).ceil() as usize).clamp(1, MAX_PRODUCERS);
    let mut clients = Vec::new();
    for _ in 0..producers {
        let c = env.db.client().await?;
        if producer_notify {
            c.batch_execute("SET outbox.notify = on").await?;
        }
        clients.push(c);
    }
    let stages_before = StageHists::parse(&relay.metrics().unwrap_or_default());
    let relay_sessions = crate::idle::relay_pids(env.monitor, &env.db.name).await?;
    let relay_cpu = ProcSnapshot::take(&relay_sessions);
    let machine = HostMeter::start();
    let start = tokio::time::Instant::now() + Duration::from_millis(50);
    let beside = background_load(env, background, secs, start).await?;
    let mut tasks = Vec::new();
    for (k, c) in clients.into_iter().enumerate() {
        tasks.push(tokio::spawn(producer(
            c,
            ENQUEUE,
            topic.to_string(),
            k as i64,
            producers as i64,
            total,
            rate,
            start,
            true,
        )));
    }
    let mut commits: Vec<Option<(Instant, Instant)>> = vec![None; total as usize];
    let mut commit_wall: Vec<(i64, f64)> = Vec::with_capacity(total as usize);
    let mut wall_of_seq: Vec<f64> = vec![f64::NAN; total as usize];
    let mut last_commit = start.into_std();
    for t in tasks {
        for (seq, issued, at, id, wall) in t.await?? {
            commits[seq as usize] = Some((issued, at));
            wall_of_seq[seq as usize] = wall;
            commit_wall.push((id, wall));
            if at > last_commit {
                last_commit = at;
            }
        }
    }
    let achieved_rate = total as f64 / (last_commit - start.into_std()).as_secs_f64().max(1e-9);
    for t in beside {
        t.await??;
    }
    // Wait while events keep arriving: a backlog the relay is still working off arrives late, not
    // never. Missing means nothing arrived for `settle` (or the hard cap passed).
    let cap = Instant::now() + settle * 8;
    let mut deadline = Instant::now() + settle;
    let mut seen_before = 0;
    loop {
        let seen = arrivals.seen.load(std::sync::atomic::Ordering::Relaxed) as i64;
        if seen >= total || Instant::now() >= deadline.min(cap) {
            break;
        }
        if seen > seen_before {
            seen_before = seen;
            deadline = Instant::now() + settle;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let relay_db_cpu_us = (!relay_cpu.0.is_empty()).then(|| {
        ProcSnapshot::take(&relay_sessions).cpu_secs_since(&relay_cpu) * 1e6 / total as f64
    });
    let machine_busy_pct = machine.stop(0.0).0;
    // A little longer to catch duplicates.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let got = arrivals.finish()?;
    let stages_after = StageHists::parse(&relay.metrics().unwrap_or_default());
    let mut first: Vec<Option<Instant>> = vec![None; total as usize];
    let mut duplicates = 0;
    let mut append_hist = crate::report::hist();
    for (seq, at, appended) in got {
        if seq < 0 || seq >= total {
            continue;
        }
        match first[seq as usize] {
            None => {
                first[seq as usize] = Some(at);
                // The append time has millisecond resolution: the middle of its millisecond.
                if let Some(ms) = appended {
                    let us = ms as f64 * 1e3 + 500.0 - wall_of_seq[seq as usize];
                    if us.is_finite() {
                        append_hist.saturating_record(us.max(0.0) as u64);
                    }
                }
            }
            Some(_) => duplicates += 1,
        }
    }
    let q = |h: &Histogram<u64>, q: f64| {
        if h.is_empty() {
            f64::NAN
        } else {
            h.value_at_quantile(q) as f64
        }
    };
    let to_append = (q(&append_hist, 0.5), q(&append_hist, 0.99));
    let stages = crate::stages::STAGES
        .iter()
        .map(|st| {
            let at = |p| {
                stages_after
                    .quantile_since(&stages_before, st, p)
                    .unwrap_or(f64::NAN)
            };
            (*st, at(0.5), at(0.99))
        })
        .collect();
    let mut hist = crate::report::hist();
    let mut stmt_hist = crate::report::hist();
    let mut received = 0;
    for (c, a) in commits.iter().zip(&first) {
        if let (Some((issued, c)), Some(a)) = (c, a) {
            hist.saturating_record(a.saturating_duration_since(*c).as_micros() as u64);
            stmt_hist.saturating_record(a.saturating_duration_since(*issued).as_micros() as u64);
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
                            (extract(epoch FROM acked_at - claimed_at) * 1e6)::float8 AS a,
                            (extract(epoch FROM acked_at - created_at) * 1e6)::float8 AS t
                       FROM (ACKED) e
                      WHERE (payload->>'seq')::bigint >= 0) s".replace("ACKED", ACKED).as_str(),
            &[&topic],
        )
        .await?;
    let f = |i: usize| split.get::<_, Option<f64>>(i).unwrap_or(f64::NAN);
    // Commit (the client saw COMMIT complete) to ack, per event: the client's clock against the
    // row's ack timestamp. Valid when the database runs on this machine (one clock); otherwise
    // the database-only measure (transaction start to ack) is used.
    let mut commit_to_ack = [f(4), f(5), f(6), f(7)];
    let mut ack_source = "DB clock: transaction start → ack";
    let mut samples = Vec::new();
    let mut commit_to_claim = (f64::NAN, f64::NAN);
    if env.db.is_local() {
        let acks: std::collections::HashMap<i64, (f64, f64)> = env
            .monitor
            .query(
                format!(
                    "SELECT id, (extract(epoch FROM acked_at) * 1e6)::float8, \
                            (extract(epoch FROM claimed_at) * 1e6)::float8 FROM ({ACKED}) e"
                )
                .as_str(),
                &[&topic],
            )
            .await?
            .iter()
            .map(|r| (r.get(0), (r.get(1), r.get(2))))
            .collect();
        let mut h = crate::report::hist();
        let mut claims = crate::report::hist();
        for (id, wall) in &commit_wall {
            if let Some((a, c)) = acks.get(id) {
                h.saturating_record((a - wall).max(0.0) as u64);
                claims.saturating_record((c - wall).max(0.0) as u64);
                samples.push((*wall, (a - wall).max(0.0)));
            }
        }
        commit_to_claim = (q(&claims, 0.5), q(&claims, 0.99));
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
        "    -> achieved {:.0}/s; statement to consumer p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms; commit to append p50 {:.2} ms, p99 {:.2} ms; commit to ack p50 {:.2} ms; {} of {total} arrived",
        achieved_rate,
        stmt_hist.value_at_quantile(0.5) as f64 / 1000.0,
        stmt_hist.value_at_quantile(0.99) as f64 / 1000.0,
        stmt_hist.max() as f64 / 1000.0,
        to_append.0 / 1000.0,
        to_append.1 / 1000.0,
        commit_to_ack[0] / 1000.0,
        received
    );
    Ok(LatencyRun {
        to_claim: (f(0), f(1)),
        to_ack: (f(2), f(3)),
        commit_to_ack,
        ack_source,
        relay_db_cpu_us,
        machine_busy_pct,
        acks: samples,
        to_append,
        commit_to_claim,
        stages,
        rate,
        server,
        wake,
        producer_notify,
        background,
        settings: settings.to_string(),
        sent: total,
        achieved_rate,
        missing: total - received as i64,
        duplicates,
        hist,
        stmt_hist,
    })
}

/// (sequence number, statement issued, commit seen by the client, event id, commit as Unix µs)
pub type Commit = (i64, Instant, Instant, i64, f64);

/// A producer's statement: one event, `$1` topic, `$2` payload, `$3` key; returns its id.
pub const ENQUEUE: &str = "SELECT outbox_enqueue($1::text, $2::jsonb, $3::text, 'OrderCreated')";
/// The same row as a plain INSERT into a table no relay reads (`--latency-background`).
const PLAIN_INSERT: &str = "INSERT INTO bench_background (topic, payload, event_key, event_type) \
                            VALUES ($1, $2, $3, 'OrderCreated') RETURNING id";

/// `rate` plain INSERTs per second of an event's row for `secs` from `start`, one connection per
/// `EVENTS_PER_PRODUCER`: the producers' load on the machine without the relay's work.
async fn background_load(
    env: &RelayEnv<'_>,
    rate: f64,
    secs: f64,
    start: tokio::time::Instant,
) -> Result<Vec<tokio::task::JoinHandle<Result<Vec<Commit>>>>> {
    if rate <= 0.0 {
        return Ok(Vec::new());
    }
    env.monitor
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS bench_background (LIKE outbox_stream INCLUDING ALL)",
        )
        .await?;
    let total = (rate * secs).round().max(1.0) as i64;
    let n = ((rate / EVENTS_PER_PRODUCER).ceil() as usize).clamp(1, MAX_PRODUCERS);
    let mut tasks = Vec::new();
    for k in 0..n {
        let c = env.db.client().await?;
        let (k, n) = (k as i64, n as i64);
        let topic = "bench.background".to_string();
        tasks.push(tokio::spawn(producer(
            c,
            PLAIN_INSERT,
            topic,
            k,
            n,
            total,
            rate,
            start,
            true,
        )));
    }
    Ok(tasks)
}

/// When each stream event was claimed and acked: a stream row keeps neither (its batch row
/// does until the ack deletes it), so a trigger in the benchmark's database logs the ids a
/// batch row gives up, with the batch's claim time. A nacked or released id has a scheduled copy,
/// whose own columns count instead.
const STREAM_ACK_LOG: &str = "
    CREATE TABLE IF NOT EXISTS bench_stream_ack_log (
        id bigint NOT NULL, claimed_at timestamptz NOT NULL,
        acked_at timestamptz NOT NULL DEFAULT clock_timestamp());
    CREATE OR REPLACE FUNCTION bench_log_stream_ack() RETURNS trigger LANGUAGE plpgsql
    -- It fires inside the extension's functions, whose search_path is pinned to pg_catalog.
    SET search_path FROM CURRENT AS $$
    BEGIN
        INSERT INTO bench_stream_ack_log (id, claimed_at)
        SELECT o.id, OLD.claimed_at FROM unnest(OLD.pending) o(id)
         WHERE TG_OP = 'DELETE' OR NOT o.id = ANY (NEW.pending);
        RETURN NULL;
    END $$;
    DROP TRIGGER IF EXISTS bench_log_stream_ack ON outbox_stream_batch;
    CREATE TRIGGER bench_log_stream_ack AFTER UPDATE OR DELETE ON outbox_stream_batch
        FOR EACH ROW EXECUTE FUNCTION bench_log_stream_ack();";

/// The delivered events of topic `$1` with their creation, claim and ack times: scheduled rows by
/// their columns, stream events by the ack log above.
const ACKED: &str = "
    SELECT t.id, t.payload, t.created_at, t.claimed_at, t.updated_at AS acked_at
      FROM outbox_scheduled t WHERE t.topic = $1 AND t.status = 'SUCCESS'
    UNION ALL
    SELECT s.id, s.payload, s.created_at, l.claimed_at, l.acked_at
      FROM outbox_stream s JOIN bench_stream_ack_log l ON l.id = s.id
     WHERE s.topic = $1 AND NOT EXISTS (SELECT 1 FROM outbox_scheduled t WHERE t.id = s.id)";

pub fn unix_us() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64() * 1e6)
        .unwrap_or(0.0)
}

/// One open-loop producer: events `k`, `k + step`, … below `total`, event `seq` sent at
/// `start + seq / rate` (at once when behind), each `SELECT outbox_enqueue(…)` keyed `order-<seq>`
/// in its own transaction (autocommit).
/// `keyed`: each event gets its own key `order-<seq>` (an ordered event), else none (the stream).
#[allow(clippy::too_many_arguments)]
pub async fn producer(
    c: Client,
    sql: &'static str,
    topic: String,
    k: i64,
    step: i64,
    total: i64,
    rate: f64,
    start: tokio::time::Instant,
    keyed: bool,
) -> Result<Vec<Commit>> {
    let stmt = c.prepare(sql).await?;
    // Sized up front: a vector that doubles while the clock runs copies itself mid-run.
    let mut out = Vec::with_capacity(((total - k).max(0) / step.max(1) + 1) as usize);
    let mut seq = k;
    while seq < total {
        tokio::time::sleep_until(start + Duration::from_secs_f64(seq as f64 / rate)).await;
        let payload = serde_json::json!({"seq": seq, "order_id": seq, "amount": 42.5});
        let key = keyed.then(|| format!("order-{seq}"));
        let issued = Instant::now();
        let id: i64 = c.query_one(&stmt, &[&topic, &payload, &key]).await?.get(0);
        out.push((seq, issued, Instant::now(), id, unix_us()));
        seq += step;
    }
    Ok(out)
}

pub fn latency_table(runs: &[LatencyRun]) -> String {
    let mut t = Table::new(&[
        "server (wake-up mode)",
        "offered ev/s (achieved)",
        "producers' `outbox.notify`",
        "relay settings",
        "events",
        "statement→consumer p50 / p99 / p99.9 / max ms",
        "commit→consumer p50 / p99 ms",
        "commit→ack p50 / p99 ms",
        "start→claim / claim→ack p50 ms",
        "relay's DB CPU µs/event",
        "missing / dup",
    ]);
    for r in runs {
        let c = &r.commit_to_ack;
        t.row(vec![
            format!("{} (`{}`)", r.server, r.wake),
            format!("{} ({})", num(r.rate), num(r.achieved_rate)),
            if r.producer_notify {
                "on (contrast)".into()
            } else {
                "off (default)".into()
            },
            r.settings.clone(),
            num(r.sent as f64),
            format!(
                "{} / {} / {} / {}",
                ms(r.sq(0.5)),
                ms(r.sq(0.99)),
                ms(r.sq(0.999)),
                ms(r.stmt_hist.max() as f64)
            ),
            format!("{} / {}", ms(r.q(0.5)), ms(r.q(0.99))),
            format!("{} / {}", ms(c[0]), ms(c[1])),
            format!("{} / {}", ms(r.to_claim.0), ms(r.to_ack.0)),
            r.relay_db_cpu_us.map_or("n/a".into(), num),
            format!("{} / {}", r.missing, r.duplicates),
        ]);
    }
    t.render()
}

/// Where each run's time went per event: commit → broker append, commit → the claim that took the
/// event, then the relay's stages (its `outbox_event_stage_seconds` over the run).
pub fn stages_table(runs: &[LatencyRun]) -> String {
    let mut head = vec![
        "server (wake-up mode)".to_string(),
        "offered ev/s (achieved)".into(),
        "relay settings".into(),
        "commit→append p50 / p99 ms".into(),
        "commit→claim p50 / p99 ms".into(),
    ];
    head.extend(
        crate::stages::STAGES
            .iter()
            .map(|s| format!("{s} p50 / p99 ms")),
    );
    head.push("machine CPU busy".into());
    let head: Vec<&str> = head.iter().map(String::as_str).collect();
    let mut t = Table::new(&head);
    for r in runs.iter().filter(|r| !r.producer_notify) {
        let mut row = vec![
            format!("{} (`{}`)", r.server, r.wake),
            format!("{} ({})", num(r.rate), num(r.achieved_rate)),
            r.settings.clone(),
            format!("{} / {}", ms(r.to_append.0), ms(r.to_append.1)),
            format!("{} / {}", ms(r.commit_to_claim.0), ms(r.commit_to_claim.1)),
        ];
        row.extend(
            r.stages
                .iter()
                .map(|(_, p50, p99)| format!("{} / {}", ms(*p50), ms(*p99))),
        );
        row.push(format!("{:.0} %", r.machine_busy_pct));
        t.row(row);
    }
    t.render()
}

/// One latency run, its failure (events lost) recorded.
#[allow(clippy::too_many_arguments)]
async fn one(
    p: &Profile,
    env: &RelayEnv<'_>,
    relay: &BenchRelay,
    r: &mut Results,
    n: &mut usize,
    offer: Offer,
    settings: &str,
    server: &'static str,
) -> Result<()> {
    *n += 1;
    let rate = offer.rate;
    progress!(
        "  {} ev/s for {:?} on the {server}, producers' outbox.notify {}, relay {settings}",
        num(rate),
        p.latency_time,
        if offer.notify { "on" } else { "off" }
    );
    let run = latency(
        env,
        relay,
        &format!("bench.lat.{}.{n}", server.replace([' ', ','], "")),
        p.latency_partitions,
        offer,
        p.latency_time.as_secs_f64(),
        Duration::from_secs(15),
        settings,
        server,
    )
    .await?;
    if run.missing > 0 {
        r.failures.push(format!(
            "latency at {} ev/s ({server}, `{}`): {} of {} events did not reach the consumer \
             (none arrived for 15 s, or 2 minutes passed)",
            run.rate, run.wake, run.missing, run.sent
        ));
    }
    r.latency.push(run);
    // A run the relay could not keep up with leaves a backlog: let it drain before the next run
    // measures anything.
    if !crate::db::wait_drained(env.monitor, Duration::from_secs(60)).await? {
        r.failures.push(format!(
            "latency at {} ev/s ({server}): the backlog had not drained 60 s after the run; \
             the next run started behind it",
            num(rate)
        ));
    }
    Ok(())
}

/// The main server: the rates of the profile with the relay's defaults (`latency_repeat` times,
/// the rates taking turns), the same at the highest
/// rate with `outbox.notify = on` in the producers (contrast), and the linger and claim cooldown
/// settings at the goal's rate.
pub async fn run(p: &Profile, env: &RelayEnv<'_>, r: &mut Results) -> Result<()> {
    let mut configs: Vec<Vec<String>> = vec![vec![]];
    for &l in &p.linger_ms {
        configs.push(vec!["--kafka-property".into(), format!("linger.ms={l}")]);
    }
    for &c in &p.claim_cooldown_ms {
        configs.push(vec!["--claim-cooldown".into(), format!("{c}ms")]);
    }
    warm_up(p, env).await?;
    let mut n = 0;
    for (ci, extra) in configs.iter().enumerate() {
        let relay = env.start_relay(extra, &format!("latency-{ci}"))?;
        let settings = if extra.is_empty() {
            "defaults".to_string()
        } else {
            format!("`{}`", extra.join(" "))
        };
        if extra.is_empty() {
            for _ in 0..p.latency_repeat {
                for &rate in &p.latency_rates {
                    let offer = Offer::plain(rate);
                    one(p, env, &relay, r, &mut n, offer, &settings, MAIN_SERVER).await?;
                }
                if let Some(background) = p.latency_background {
                    let offer = Offer {
                        background,
                        ..Offer::plain(LATENCY_GOAL_RATE)
                    };
                    let beside = background_settings(background);
                    one(p, env, &relay, r, &mut n, offer, &beside, MAIN_SERVER).await?;
                }
            }
            let top = p.latency_rates.iter().copied().fold(0.0, f64::max);
            let offer = Offer {
                notify: true,
                ..Offer::plain(top)
            };
            one(p, env, &relay, r, &mut n, offer, &settings, MAIN_SERVER).await?;
        } else {
            let offer = Offer::plain(LATENCY_GOAL_RATE);
            one(p, env, &relay, r, &mut n, offer, &settings, MAIN_SERVER).await?;
        }
        relay.stop()?;
    }
    Ok(())
}

/// The settings column of a run with plain INSERTs beside the relay's defaults.
pub fn background_settings(background: f64) -> String {
    format!("defaults, {} plain INSERTs/s beside", num(background))
}

/// How long the unreported warm-up run lasts.
pub const WARM_UP: Duration = Duration::from_secs(20);

/// One unreported run at the goal's rate before the first measured one: a fresh broker's JVM
/// compiles its request path during its first minute, and the first runs measured that.
async fn warm_up(p: &Profile, env: &RelayEnv<'_>) -> Result<()> {
    progress!(
        "  warm-up: {} ev/s for {:?} on the {MAIN_SERVER}, not reported",
        num(LATENCY_GOAL_RATE),
        WARM_UP.max(p.latency_time)
    );
    let relay = env.start_relay(&[], "latency-warm-up")?;
    latency(
        env,
        &relay,
        "bench.lat.warm-up",
        p.latency_partitions,
        Offer::plain(LATENCY_GOAL_RATE),
        WARM_UP.max(p.latency_time).as_secs_f64(),
        Duration::from_secs(15),
        "defaults",
        MAIN_SERVER,
    )
    .await?;
    crate::db::wait_drained(env.monitor, Duration::from_secs(60)).await?;
    relay.stop()
}

/// A throwaway server (`POLLING_SERVER`: the relay's `outbox_wait` polls; `PRELOADED_SERVER`:
/// commits wake it, the control) at the goals' rates, relay defaults.
pub async fn run_throwaway(
    p: &Profile,
    env: &RelayEnv<'_>,
    r: &mut Results,
    server: &'static str,
) -> Result<()> {
    let relay = env.start_relay(&[], &format!("latency-{}", server.replace([' ', ','], "")))?;
    let mut n = 0;
    for &rate in &p.polling_rates {
        one(
            p,
            env,
            &relay,
            r,
            &mut n,
            Offer::plain(rate),
            "defaults",
            server,
        )
        .await?;
    }
    relay.stop()?;
    Ok(())
}

/// The producers at `rate` with `outbox.notify = on` against the defaults: how much of the offered
/// rate they achieved. PostgreSQL holds a database-wide lock from a notifying transaction's
/// pre-commit through its commit record flush, so notifying commits run one at a time.
pub fn notify_cap_note(r: &Results, rate: f64) -> Option<String> {
    let find = |notify: bool| {
        r.latency.iter().find(|l| {
            l.producer_notify == notify
                && l.rate == rate
                && l.settings == "defaults"
                && l.server == MAIN_SERVER
        })
    };
    let (on, off) = (find(true)?, find(false)?);
    Some(format!(
        "At {} events/s offered, producers with `outbox.notify = on` committed {} events/s, \
         with the default (off) {}: notifying commits are serialised by PostgreSQL's global notify \
         lock, held through the commit's WAL flush.",
        num(rate),
        num(on.achieved_rate),
        num(off.achieved_rate)
    ))
}

pub fn markdown(p: &Profile, r: &Results) -> String {
    let mut s = String::new();
    if r.latency.is_empty() {
        s += &not_run(r);
    } else {
        s += &format!(
            "Open-loop load: one event per transaction (`SELECT outbox_enqueue(...)` keyed, \
             autocommit) on a fixed schedule from one connection per {EVENTS_PER_PRODUCER} events/s \
             (at most {MAX_PRODUCERS}), {:.0} s per run, topics of {} partitions (one broker: a round's \
             events leave in one produce request per partition they touch, one request at a time \
             per connection of the relay's producers), \
             relay ({}) with default settings (it waits in \
             `outbox_wait`; poll interval {} s as the safety net) unless noted. Rows: the **main \
             server** (`shared_preload_libraries = 'outbox'`: a commit that enqueued wakes the \
             relay at once, mode `commit`) and a **throwaway server without the preload** started \
             by the bench (`PgCluster`, default settings but `fsync = on`; `outbox_wait` looks at \
             the queue every `outbox.wait_poll_interval`, 10 ms; mode `polling`), and as a \
             control a **throwaway server with the preload** (same settings plus \
             `shared_preload_libraries = 'outbox'`, mode `commit`): the two throwaway servers \
             differ only in the wake-up, while the main server is shared with other work. \
             **statement→consumer** (the goals' figure): from the moment the producer issued its \
             statement to the arrival at a Kafka consumer (assigned partitions, \
             `fetch.wait.max.ms={FETCH_WAIT_MAX_MS}`), matched by a sequence number in the \
             payload; HdrHistogram, µs resolution. **commit→consumer** starts when the producer \
             saw the statement complete; **commit→ack** ({}) ends at the event's ack time. \
             The split columns come from the events' timestamps (`created_at` = transaction \
             start, `claimed_at`, ack): a scheduled row's own columns; for a stream event, whose \
             row keeps neither, its batch's claim time and the moment the ack took it out of the \
             batch (a trigger on `outbox_stream_batch` logs it in the benchmark's database). Achieved = events ÷ time from the first scheduled send to \
             the last commit. Before the first run, one unreported run of {:.0} s at {} \
             events/s warms the broker (a fresh JVM compiles its request path in its first \
             minute).\n\n",
            p.latency_time.as_secs_f64(),
            p.latency_partitions,
            outbox_tests::relay::relay_build(),
            defaults::POLL_INTERVAL.as_secs(),
            r.latency
                .first()
                .map(|l| l.ack_source)
                .unwrap_or("n/a"),
            WARM_UP.max(p.latency_time).as_secs_f64(),
            num(LATENCY_GOAL_RATE)
        );
        s += &latency_table(&r.latency);
        s += "\n**Where the time goes**, per event (the runs above without `outbox.notify`): \
              **commit→append** from the commit seen by the producer to the broker's append time \
              (the topics stamp messages with `LogAppendTime`, in milliseconds: each counts as \
              the middle of its millisecond); **commit→claim** to the start of the claim that \
              took the event (the claim's `clock_timestamp()`, one machine clock): the wake-up; \
              then the relay's own stages from its `outbox_event_stage_seconds` histograms \
              (read from `/metrics` before and after the run; quantiles interpolated within \
              their buckets): **claim** the claim call, **handoff** claim returned → handed to \
              librdkafka (waiting behind earlier events of its key included), **delivery** → \
              the delivery report, **ack** → `outbox_ack` returned (waiting for the round's \
              other reports included); **machine CPU busy**: all cores, producers' start to the \
              last arrival (/proc/stat; database, broker, relay, producers and consumer share \
              them).\n\n";
        s += &stages_table(&r.latency);
        s += &repeat_note(p, r).unwrap_or_default();
        let top = p.latency_rates.iter().copied().fold(0.0, f64::max);
        if let Some(note) = notify_cap_note(r, top) {
            s += &format!(
                "\n**Contrast, `outbox.notify = on` in the producers** (the relay does not \
                 LISTEN; nothing needs it). {note}\n"
            );
        }
        s += "\n\"start→claim\" begins at the enqueueing transaction's start, so it also holds that \
              transaction's own commit; commit→ack does not.\n";
    }
    s
}

/// The default run at a rate on a server (for goals.rs); of repeated runs, the one of median
/// commit → append p50 (the lower middle one of an even count).
pub fn default_run<'a>(r: &'a Results, server: &str, rate: f64) -> Option<&'a LatencyRun> {
    median_run(default_runs(r, server, rate))
}

/// The runs at the goal's rate with plain INSERTs beside them: the one of median commit → append
/// p50, and how many there were.
pub fn background_run(r: &Results) -> Option<(&LatencyRun, usize)> {
    let runs: Vec<&LatencyRun> = r.latency.iter().filter(|l| l.background > 0.0).collect();
    let n = runs.len();
    median_run(runs).map(|l| (l, n))
}

/// Of runs, the one of median commit → append p50 (the lower middle one of an even count).
fn median_run(mut runs: Vec<&LatencyRun>) -> Option<&LatencyRun> {
    runs.sort_by(|a, b| a.to_append.0.total_cmp(&b.to_append.0));
    runs.get(runs.len().saturating_sub(1) / 2).copied()
}

fn default_runs<'a>(r: &'a Results, server: &str, rate: f64) -> Vec<&'a LatencyRun> {
    r.latency
        .iter()
        .filter(|l| l.is_default() && l.server == server && l.rate == rate)
        .collect()
}

/// With repeated runs: each default rate's commit → append p50 over its runs, in run order.
pub fn repeat_note(p: &Profile, r: &Results) -> Option<String> {
    let lines: Vec<String> = p
        .latency_rates
        .iter()
        .map(|&rate| {
            let runs = default_runs(r, MAIN_SERVER, rate);
            let all: Vec<String> = runs.iter().map(|l| ms(l.to_append.0)).collect();
            let median =
                default_run(r, MAIN_SERVER, rate).map_or("n/a".into(), |l| ms(l.to_append.0));
            format!("{} ev/s: {} (median {median})", num(rate), all.join(", "))
        })
        .collect();
    (p.latency_repeat > 1).then(|| {
        format!(
            "\n**Repeated runs** ({} per rate on the {MAIN_SERVER}, relay defaults, the rates \
             taking turns; the goals read the run of median commit→append p50): commit→append \
             p50 ms by rate: {}.\n",
            p.latency_repeat,
            lines.join("; ")
        )
    })
}
