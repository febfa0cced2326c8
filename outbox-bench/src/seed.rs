//! Seed design baseline (report section 5): the seed's table shape and algorithm (SELECT candidates
//! without a lock, one conditional UPDATE and one ack per row, a fixed delay) on the same harness.

use anyhow::Result;
use std::time::{Duration, Instant};
use tokio_postgres::Client;

use outbox_tests::db::TestDb;

use crate::db::{self, BenchDb};
use crate::null_sink::{self, check_drain};
use crate::report::{num, Table};
use crate::results::Results;
use crate::sys::ProcSnapshot;
use crate::Profile;

/// Candidates the seed design selects per round (its `LIMIT`), and the batch this project is
/// compared at.
pub const SEED_BATCH: i32 = 20;

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
        .prepare(&format!(
            "SELECT id, topic, event_key, event_type, payload::text, headers::text FROM seed_event
              WHERE status = 'WAIT' AND next_retry_time <= now()
              ORDER BY next_retry_time LIMIT {SEED_BATCH}"
        ))
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

pub async fn run(p: &Profile, db: &TestDb, monitor: &Client, r: &mut Results) -> Result<()> {
    let smoke = p.name == "smoke";
    progress!("==> 5. seed design baseline");
    create_seed_table(monitor).await?;
    for &loops in &p.seed_loops {
        progress!("  seed, {loops} instance(s), no delay");
        let s = seed(db, monitor, loops, p.seed_backlog, p.seed_cap, None, None).await?;
        if s.double_sends > 0 {
            r.failures.push(format!(
                "seed design with {loops} instances sent {} events twice",
                s.double_sends
            ));
        }
        r.seed.push(s);
    }
    progress!(
        "  seed, 1 instance, {:?} fixed delay, {} rounds",
        p.seed_delay,
        p.seed_delay_rounds
    );
    let s = seed(
        db,
        monitor,
        1,
        p.seed_backlog,
        Duration::from_secs(600),
        Some(p.seed_delay),
        Some(p.seed_delay_rounds),
    )
    .await?;
    r.seed.push(s);
    // This project on the same footing: one loop, batch 20, same backlog and cap.
    progress!("  this project, 1 loop, batch {SEED_BATCH}, same backlog and cap");
    let run = null_sink::drain(
        db,
        monitor,
        1,
        SEED_BATCH,
        p.seed_backlog,
        p.seed_cap,
        p.sessions(false),
    )
    .await?;
    check_drain(
        &run,
        "project drain for the seed comparison",
        smoke,
        &mut r.failures,
    );
    r.seed_compare = Some(run);
    Ok(())
}

pub fn markdown(p: &Profile, r: &Results) -> String {
    let mut s = String::new();
    if r.seed.is_empty() {
        s += "Not run.\n";
    } else {
        s += &format!(
            "Same harness, same columns and backlog ({} events), the seed's table shape (status as \
             text, composite indexes `(status, next_retry_time)` and `(status, claimed_at)`) and \
             algorithm: SELECT {SEED_BATCH} candidates without a lock, one conditional `UPDATE … WHERE id = $1 \
             AND status = 'WAIT'` per row, one ack UPDATE per row, each statement its own transaction; \
             then the fixed delay. Null sink.\n\n",
            num(p.seed_backlog as f64)
        );
        let mut t = Table::new(&[
            "design",
            "instances",
            "delay",
            "events",
            "events/s",
            "lost claim races",
            "DB CPU µs/event",
        ]);
        for sr in &r.seed {
            t.row(vec![
                "seed".into(),
                sr.loops.to_string(),
                sr.delay
                    .map(|d| format!("{:.1} s fixed, {} rounds", d.as_secs_f64(), sr.rounds))
                    .unwrap_or_else(|| "none".into()),
                num(sr.drained as f64),
                format!("{:.1}", sr.rate()),
                sr.lost_races.to_string(),
                sr.db_cpu_secs
                    .map(|c| format!("{:.0}", c * 1e6 / sr.drained.max(1) as f64))
                    .unwrap_or_else(|| "n/a".into()),
            ]);
        }
        if let Some(c) = &r.seed_compare {
            t.row(vec![
                format!("this project (`outbox_claim`/`outbox_ack`, batch {SEED_BATCH})"),
                "1".into(),
                "none".into(),
                num(c.drained as f64),
                format!("{:.1}", c.rate()),
                "0 (SKIP LOCKED)".into(),
                c.cpu_us_per_event()
                    .map(|x| format!("{x:.0}"))
                    .unwrap_or_else(|| "n/a".into()),
            ]);
        }
        s += &t.render();
        let seed_nodelay = r.seed.iter().find(|x| x.delay.is_none() && x.loops == 1);
        let seed_delay = r.seed.iter().find(|x| x.delay.is_some());
        let best = r
            .matrix
            .iter()
            .chain(r.headline.iter())
            .map(|m| m.rate())
            .fold(0.0, f64::max);
        s += "\n";
        if let Some(d) = seed_delay {
            let cfg = d.delay.unwrap_or_default().as_secs_f64();
            s += &format!(
                "- As configured ({cfg:.1} s delay) the seed moves at most {SEED_BATCH} events per round: implied \
                 ceiling {:.1} events/s, measured {:.1} events/s.\n",
                f64::from(SEED_BATCH) / cfg,
                d.rate()
            );
            if best > 0.0 {
                s += &format!(
                    "- Best null-sink drain of this project ({} events/s) is **{}×** the seed as configured.\n",
                    num(best),
                    num(best / d.rate())
                );
            }
        }
        if let (Some(n), Some(c)) = (seed_nodelay, &r.seed_compare) {
            s += &format!(
                "- With no delay, same batch of {SEED_BATCH} and one instance: this project {} vs seed {} events/s \
                 (**{:.1}×**); best configuration vs seed without delay: **{:.1}×**.\n",
                num(c.rate()),
                num(n.rate()),
                c.rate() / n.rate(),
                best.max(c.rate()) / n.rate()
            );
        }
    }
    s
}
