//! Enqueue cost (report section 1): producer throughput of the order transaction with the outbox
//! against the same transaction writing its event row with a plain INSERT (issue 10), then the
//! server-side cost per row and the bulk form (`cost.rs`).

use anyhow::Result;
use hdrhistogram::Histogram;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use outbox_tests::db::TestDb;

use crate::cost::{self, BulkResult, CostResult};
use crate::db::{BenchDb, DbCpu};
use crate::report::{median, ms, num, pct, Table};
use crate::Profile;

/// Topic of the bench's order events (ordered: keyed events take the per-key path).
pub const TOPIC: &str = "bench.orders";

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Variant {
    OrderOnly,
    /// The event row written with a plain INSERT into `bench_event` (same shape and indexes).
    PlainInsert,
    /// `outbox_enqueue` with the shipped defaults, a session waiting in `outbox_wait`.
    Outbox,
    /// `outbox_enqueue` with `outbox.notify = on` and a LISTENing session: the contrast.
    OutboxNotify,
}

impl Variant {
    pub fn label(self) -> &'static str {
        match self {
            Variant::OrderOnly => "order row only",
            Variant::PlainInsert => {
                "order row + plain INSERT of the event row (`bench_event`, same shape and indexes)"
            }
            Variant::Outbox => "order row + `outbox_enqueue` (defaults, a waiter in `outbox_wait`)",
            Variant::OutboxNotify => {
                "order row + `outbox_enqueue`, `outbox.notify = on`, a session LISTENs (contrast)"
            }
        }
    }
    pub fn key(self) -> &'static str {
        match self {
            Variant::OrderOnly => "order_only",
            Variant::PlainInsert => "plain_insert",
            Variant::Outbox => "outbox_defaults",
            Variant::OutboxNotify => "outbox_notify_on",
        }
    }
}

pub struct EnqueueResult {
    pub variant: Variant,
    pub tx: u64,
    pub secs: f64,
    pub hist: Histogram<u64>,
    pub db_cpu_secs: Option<f64>,
    /// tx/s of each round.
    pub rounds: Vec<f64>,
}

impl EnqueueResult {
    /// Median over the rounds (the machine is shared: one disturbed round must not decide).
    pub fn tps(&self) -> f64 {
        median(&self.rounds)
    }
}

pub struct EnqueueSummary {
    pub results: Vec<EnqueueResult>,
    pub clients: usize,
    pub markdown: String,
    /// The waiter's `outbox_wait` calls that returned true during the default variant, and the
    /// wake-up mode of the server (`outbox_wake_mode()`).
    pub waiter_wakes: u64,
    pub wake_mode: String,
    pub cost: CostResult,
    pub bulk: BulkResult,
}

impl EnqueueSummary {
    pub fn tps(&self, v: Variant) -> f64 {
        self.results
            .iter()
            .find(|r| r.variant == v)
            .map(|r| r.tps())
            .unwrap_or(f64::NAN)
    }
    /// 1 - tps(v) / tps(order only), in percent.
    pub fn overhead_pct(&self, v: Variant) -> f64 {
        100.0 * (1.0 - self.tps(v) / self.tps(Variant::OrderOnly))
    }
    /// Median tx/s of the default outbox transaction ÷ that of the plain-INSERT one (issue 10).
    pub fn producer_ratio(&self) -> f64 {
        self.tps(Variant::Outbox) / self.tps(Variant::PlainInsert)
    }
}

const VARIANTS: [Variant; 4] = [
    Variant::OrderOnly,
    Variant::PlainInsert,
    Variant::Outbox,
    Variant::OutboxNotify,
];

const TRUNCATE: &str =
    "TRUNCATE bench_order, bench_event, outbox_scheduled, outbox_stream, outbox_stream_batch, outbox_key";

/// A relay's wake-up session: `outbox_wait('1 s')` in a loop, in a database of its own on the
/// same server whose outbox stays empty. Every commit that enqueued in the bench database looks
/// for its own database's waiters (the whole of a commit's work for them) and leaves this one
/// asleep; a waiter in the bench database would find the undrained events due and return at once.
struct Waiter {
    stop: Arc<AtomicBool>,
    wakes: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
    _db: TestDb,
}

impl Waiter {
    async fn start(server: &str) -> Result<(Waiter, String)> {
        let server = server.to_string();
        let wdb =
            tokio::task::spawn_blocking(move || TestDb::create_on(&server, "outbox_bench_waiter"))
                .await
                .map_err(|e| anyhow::anyhow!("creating the waiter's database: {e}"))?;
        let c = wdb.client().await?;
        let mode: String = c.query_one("SELECT outbox_wake_mode()", &[]).await?.get(0);
        let stop = Arc::new(AtomicBool::new(false));
        let wakes = Arc::new(AtomicU64::new(0));
        let (s, w) = (stop.clone(), wakes.clone());
        let task = tokio::spawn(async move {
            let Ok(stmt) = c.prepare("SELECT outbox_wait('1 second')").await else {
                return;
            };
            while !s.load(Ordering::Relaxed) {
                match c.query_one(&stmt, &[]).await {
                    Ok(r) if r.get::<_, bool>(0) => {
                        w.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(_) => {}
                    Err(_) => return,
                }
            }
        });
        Ok((
            Waiter {
                stop,
                wakes,
                task,
                _db: wdb,
            },
            mode,
        ))
    }

    fn wakes(&self) -> u64 {
        self.wakes.load(Ordering::Relaxed)
    }

    async fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = tokio::time::timeout(Duration::from_secs(3), self.task).await;
    }
}

pub async fn run(db: &TestDb, p: &Profile) -> Result<EnqueueSummary> {
    let admin = db.client().await?;
    admin
        .batch_execute(
            "CREATE TABLE bench_order (
                 id bigserial PRIMARY KEY,
                 customer text NOT NULL,
                 amount numeric(12,2) NOT NULL,
                 created_at timestamptz NOT NULL DEFAULT now());
             CREATE TABLE bench_event (LIKE outbox_stream INCLUDING ALL);",
        )
        .await?;
    // A relay waits in outbox_wait throughout; the notify-on contrast also gets a listener, as
    // NOTIFY costs more with a listener to signal.
    let (waiter, wake_mode) = Waiter::start(&db.server).await?;
    let listener = db.client().await?;
    listener.batch_execute("LISTEN outbox").await?;

    let mut results: Vec<EnqueueResult> = VARIANTS
        .iter()
        .map(|&v| EnqueueResult {
            variant: v,
            tx: 0,
            secs: 0.0,
            hist: crate::report::hist(),
            db_cpu_secs: Some(0.0),
            rounds: Vec::new(),
        })
        .collect();
    let mut waiter_wakes = 0;
    for round in 0..p.enqueue_rounds {
        // Interleaved, and each round starts with another variant, so a slow spell of the
        // machine does not always hit the same one.
        for k in 0..VARIANTS.len() {
            let i = (round + k) % VARIANTS.len();
            let v = VARIANTS[i];
            admin.batch_execute(TRUNCATE).await?;
            progress!(
                "  producer round {}/{}: {} x{} for {:?}",
                round + 1,
                p.enqueue_rounds,
                v.label(),
                p.enqueue_clients,
                p.enqueue_time
            );
            let wakes0 = waiter.wakes();
            let (tx, secs, hist, cpu) = run_variant(db, &admin, v, p).await?;
            if v == Variant::Outbox {
                waiter_wakes += waiter.wakes() - wakes0;
            }
            let r = &mut results[i];
            r.tx += tx;
            r.secs += secs;
            r.rounds.push(tx as f64 / secs);
            r.hist.add(&hist).expect("histogram add");
            r.db_cpu_secs = match (r.db_cpu_secs, cpu) {
                (Some(a), Some(b)) => Some(a + b),
                _ => None,
            };
        }
    }
    waiter.stop().await;
    drop(listener);
    admin.batch_execute(TRUNCATE).await?;

    let plain = results[1].tps();
    let base = results[0].tps();
    let mut t = Table::new(&[
        "transaction",
        "tx/s (median)",
        "tx/s per round",
        "÷ plain INSERT",
        "vs order only",
        "p50 tx ms",
        "p99 tx ms",
        "DB CPU µs/tx",
    ]);
    for r in &results {
        t.row(vec![
            r.variant.label().into(),
            num(r.tps()),
            r.rounds
                .iter()
                .map(|x| num(*x))
                .collect::<Vec<_>>()
                .join(", "),
            if r.variant == Variant::OrderOnly {
                "—".into()
            } else {
                format!("{:.2}", r.tps() / plain)
            },
            if r.variant == Variant::OrderOnly {
                "—".into()
            } else {
                format!("{} overhead", pct(100.0 * (1.0 - r.tps() / base)))
            },
            ms(r.hist.value_at_quantile(0.5) as f64),
            ms(r.hist.value_at_quantile(0.99) as f64),
            r.db_cpu_secs
                .map(|c| format!("{:.0}", c * 1e6 / r.tx.max(1) as f64))
                .unwrap_or_else(|| "n/a".into()),
        ]);
    }
    let outbox_tx = results[2].tx.max(1);
    let markdown = format!(
        "### Producer throughput\n\n{} concurrent clients, {} round(s) of {:.1} s per variant \
         (interleaved, the starting variant rotating; a warm-up per run is not counted); **tx/s is \
         the median of the rounds** (the machine is shared). One transaction = BEGIN; INSERT the \
         order row; write its event (~80-byte JSON built by the client, keyed by the order id, \
         topic `{TOPIC}` — keyed events take the per-key path); COMMIT. The plain-INSERT \
         variant writes the same event row (with its key's hash) into `bench_event`, created `LIKE \
         outbox_stream INCLUDING ALL` (the table every event due now goes to). Throughout, one session loops on `outbox_wait('1 second')` \
         as a relay's wake-up session does, in a second database of the server whose outbox stays \
         empty: every commit that enqueued looks for waiters of its own database (server wake-up \
         mode `{wake_mode}`; this waiter, of another database, was woken {} times during the \
         default variant, {:.2} per outbox transaction). No relay drains meanwhile (its claims \
         are the relay's cost, not the producer's). The notify-on contrast row sets \
         `outbox.notify = on` in the producers while a session LISTENs on `outbox`.\n\n{}",
        p.enqueue_clients,
        p.enqueue_rounds,
        p.enqueue_time.as_secs_f64(),
        num(waiter_wakes as f64),
        waiter_wakes as f64 / outbox_tx as f64,
        t.render()
    );
    let cost = cost::per_row(db, p).await?;
    let bulk = cost::bulk(db, p).await?;
    let markdown = format!("{markdown}\n{}\n{}", cost.markdown, bulk.markdown);
    Ok(EnqueueSummary {
        results,
        clients: p.enqueue_clients,
        markdown,
        waiter_wakes,
        wake_mode,
        cost,
        bulk,
    })
}

async fn run_variant(
    db: &TestDb,
    monitor: &tokio_postgres::Client,
    v: Variant,
    p: &Profile,
) -> Result<(u64, f64, Histogram<u64>, Option<f64>)> {
    // Connect all clients first, then start them together.
    let mut clients = Vec::new();
    for _ in 0..p.enqueue_clients {
        let c = db.client().await?;
        if v == Variant::OutboxNotify {
            c.batch_execute("SET outbox.notify = on").await?;
        }
        clients.push(c);
    }
    // Fresh sessions are slow for their first transactions (catalog caches, plan caches): each
    // client runs a warm-up that is not counted.
    let warmup = (p.enqueue_time / 10).max(Duration::from_millis(200));
    let start = Instant::now();
    let measure_from = start + warmup;
    let deadline = measure_from + p.enqueue_time;
    let mut tasks = Vec::new();
    for (n, c) in clients.into_iter().enumerate() {
        tasks.push(tokio::spawn(client_loop(c, v, measure_from, deadline, n)));
    }
    tokio::time::sleep_until(measure_from.into()).await;
    let cpu = DbCpu::start(monitor, &db.name).await?;
    let mut tx = 0;
    let mut hist = crate::report::hist();
    let mut keep = Vec::new();
    for t in tasks {
        let (n, h, c) = t.await??;
        tx += n;
        hist.add(&h).expect("histogram add");
        keep.push(c);
    }
    let secs = start.elapsed().as_secs_f64() - warmup.as_secs_f64();
    // Measure before the clients disconnect: an exited backend's CPU is gone from /proc.
    let cpu = cpu.stop(monitor, &db.name).await?;
    drop(keep);
    Ok((tx, secs, hist, cpu))
}

async fn client_loop(
    c: tokio_postgres::Client,
    v: Variant,
    measure_from: Instant,
    deadline: Instant,
    client_no: usize,
) -> Result<(u64, Histogram<u64>, tokio_postgres::Client)> {
    let mut c = c;
    let ins = c
        .prepare("INSERT INTO bench_order (customer, amount) VALUES ($1, $2::float8) RETURNING id")
        .await?;
    let enq = c
        .prepare(&format!(
            "SELECT outbox_enqueue('{TOPIC}', $1::jsonb, $2::text, 'OrderCreated')"
        ))
        .await?;
    // The row outbox_enqueue writes for a keyed event of an ordered topic.
    let plain = c
        .prepare(&format!(
            "INSERT INTO bench_event (topic, event_key, key_hash, event_type, payload, headers)
             VALUES ('{TOPIC}', $2::text, outbox_key_hash('{TOPIC}', $2::text), 'OrderCreated', $1::jsonb, '{{}}')"
        ))
        .await?;
    let mut hist = crate::report::hist();
    let mut n: u64 = 0;
    while Instant::now() < deadline {
        let customer = format!("customer-{client_no}-{}", n % 1000);
        let amount = 10.0 + (n % 500) as f64;
        let t0 = Instant::now();
        let tx = c.transaction().await?;
        let id: i64 = tx.query_one(&ins, &[&customer, &amount]).await?.get(0);
        if v != Variant::OrderOnly {
            let payload =
                serde_json::json!({"order_id": id, "customer": customer, "amount": amount});
            let key = format!("order-{id}");
            if v == Variant::PlainInsert {
                tx.execute(&plain, &[&payload, &key]).await?;
            } else {
                tx.query_one(&enq, &[&payload, &key]).await?;
            }
        }
        tx.commit().await?;
        if t0 >= measure_from {
            hist.saturating_record(t0.elapsed().as_micros() as u64);
            n += 1;
        }
    }
    Ok((n, hist, c))
}
