//! Commit-to-broker latency (report section 3): open-loop single-event transactions at fixed rates
//! while the relay runs, timed to the row's ack and to a consumer's arrival.

use anyhow::{anyhow, bail, Result};
use hdrhistogram::Histogram;
use outbox_worker::defaults;
use std::time::{Duration, Instant};
use tokio_postgres::Client;

use crate::arrivals::{Arrivals, FETCH_WAIT_MAX_MS};
use crate::db::BenchDb;
use crate::goals::LATENCY_GOAL_RATE;
use crate::relay_env::RelayEnv;
use crate::report::{ms, not_run, num, Table};
use crate::results::Results;
use crate::Profile;

/// One producer connection per this many offered events/s, at most `MAX_PRODUCERS`.
const EVENTS_PER_PRODUCER: f64 = 100.0;
const MAX_PRODUCERS: usize = 16;

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
    let producers = ((rate / EVENTS_PER_PRODUCER).ceil() as usize).clamp(1, MAX_PRODUCERS);
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

pub async fn run(p: &Profile, env: &RelayEnv<'_>, r: &mut Results) -> Result<()> {
    progress!("==> 3. commit-to-broker latency");
    let settle = Duration::from_secs(15);
    let mut configs: Vec<Vec<String>> = vec![vec![]];
    for &l in &p.linger_ms {
        configs.push(vec!["--kafka-property".into(), format!("linger.ms={l}")]);
    }
    let mut n = 0;
    for (ci, extra) in configs.iter().enumerate() {
        let relay = env.start_relay(extra, &format!("latency-{ci}"))?;
        let settings = if extra.is_empty() {
            "defaults".to_string()
        } else {
            format!("`{}`", extra.join(" "))
        };
        // Settings variants only at the rate the goal names.
        let (rates, modes): (Vec<f64>, Vec<bool>) = if extra.is_empty() {
            (p.latency_rates.clone(), vec![true, false])
        } else {
            (vec![LATENCY_GOAL_RATE], vec![true])
        };
        for &notify in &modes {
            for &rate in &rates {
                n += 1;
                progress!(
                    "  {} ev/s for {:?}, {}, relay {settings}",
                    num(rate),
                    p.latency_time,
                    if notify { "NOTIFY" } else { "polling only" }
                );
                let run = latency(
                    env,
                    &format!("bench.lat.{n}"),
                    rate,
                    p.latency_time.as_secs_f64(),
                    notify,
                    settle,
                    &settings,
                )
                .await?;
                if run.missing > 0 {
                    r.failures.push(format!(
                        "latency at {} ev/s ({}): {} of {} events never reached the consumer",
                        run.rate,
                        if notify { "notify" } else { "polling" },
                        run.missing,
                        run.sent
                    ));
                }
                r.latency.push(run);
            }
        }
        relay.stop()?;
    }
    Ok(())
}

/// Producers offered `rate` with and without NOTIFY: how much of it they achieved. PostgreSQL
/// holds a database-wide lock from a notifying transaction's pre-commit through its commit record
/// flush, so notifying commits run one at a time.
pub fn notify_cap_note(r: &Results, rate: f64) -> Option<String> {
    let on = r
        .latency
        .iter()
        .find(|l| l.notify && l.rate == rate && l.settings == "defaults")?;
    let off = r
        .latency
        .iter()
        .find(|l| !l.notify && l.rate == rate && l.settings == "defaults")?;
    if on.achieved_rate >= 0.95 * rate {
        return None;
    }
    Some(format!(
        "With NOTIFY the producers committed only {} of the {} events/s offered ({} with \
         `outbox.notify = off`): notifying commits are serialised by PostgreSQL's global notify \
         lock, held through the commit's WAL flush.",
        num(on.achieved_rate),
        num(rate),
        num(off.achieved_rate)
    ))
}

pub fn markdown(p: &Profile, r: &Results) -> String {
    let mut s = String::new();
    if r.latency.is_empty() {
        s += &not_run(r);
    } else {
        s += &format!(
            "Open-loop load: one event per transaction (`SELECT outbox_enqueue(...)`, autocommit) on a \
             fixed schedule from one connection per {EVENTS_PER_PRODUCER} events/s (at most {MAX_PRODUCERS}), {:.0} s per run, relay with default settings \
             (poll interval {} s) unless noted. **commit→ack** ({}): from the moment the producer saw \
             its COMMIT complete to the row's ack timestamp; the relay acks right after the broker's \
             delivery reports, so this is the issue's \"commit to delivery report\" plus one ack \
             statement. **commit→consumer**: arrival at a Kafka consumer (assigned partitions, \
             `fetch.wait.max.ms={FETCH_WAIT_MAX_MS}`), matched by a sequence number in the payload; HdrHistogram, µs \
             resolution. The split columns come from the rows' own timestamps (`created_at` = \
             transaction start, `claimed_at`, ack). \"Polling only\" sets `outbox.notify = off` in the \
             producers.\n\n",
            p.latency_time.as_secs_f64(),
            defaults::POLL_INTERVAL.as_secs(),
            r.latency
                .first()
                .map(|l| l.ack_source)
                .unwrap_or("n/a")
        );
        s += &latency_table(&r.latency);
        let caps: Vec<String> = p
            .latency_rates
            .iter()
            .filter_map(|&rate| notify_cap_note(r, rate))
            .collect();
        if !caps.is_empty() {
            s += &format!("\n**Enqueue rate limited by NOTIFY.** {}\n", caps.join(" "));
        }
        s += "\n\"start→claim\" begins at the enqueueing transaction's start, so it also holds that \
              transaction's own commit (including any wait for the notify lock); commit→ack does not.\n";
    }
    s
}
