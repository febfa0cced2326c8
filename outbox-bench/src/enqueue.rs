//! Enqueue cost (report section 1): business transactions per second with and without the outbox.

use anyhow::Result;
use hdrhistogram::Histogram;
use std::time::Instant;

use outbox_tests::db::TestDb;

use crate::db::{BenchDb, DbCpu};
use crate::report::{ms, num, pct, Table};
use crate::Profile;

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Variant {
    OrderOnly,
    Outbox,
    OutboxNoNotify,
    OutboxOneStatement,
}

impl Variant {
    pub fn label(self) -> &'static str {
        match self {
            Variant::OrderOnly => "insert order row",
            Variant::Outbox => "order row + `outbox_enqueue` (notify on)",
            Variant::OutboxNoNotify => "order row + `outbox_enqueue`, `outbox.notify = off`",
            Variant::OutboxOneStatement => {
                "order row + `outbox_enqueue` in one statement (notify on)"
            }
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
        let mut v = self.rounds.clone();
        v.sort_by(f64::total_cmp);
        match v.len() {
            0 => f64::NAN,
            n if n % 2 == 1 => v[n / 2],
            n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
        }
    }
}

pub struct EnqueueSummary {
    pub results: Vec<EnqueueResult>,
    pub markdown: String,
    /// Server-side µs per row: order insert, plain outbox insert, outbox_enqueue notify off, on.
    pub per_row_us: Vec<f64>,
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
}

const VARIANTS: [Variant; 4] = [
    Variant::OrderOnly,
    Variant::Outbox,
    Variant::OutboxNoNotify,
    Variant::OutboxOneStatement,
];

pub async fn run(db: &TestDb, p: &Profile) -> Result<EnqueueSummary> {
    let admin = db.client().await?;
    admin
        .batch_execute(
            "CREATE TABLE bench_order (
                 id bigserial PRIMARY KEY,
                 customer text NOT NULL,
                 amount numeric(12,2) NOT NULL,
                 created_at timestamptz NOT NULL DEFAULT now())",
        )
        .await?;
    // A relay would be listening: NOTIFY costs more with a listener to signal.
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
    for round in 0..p.enqueue_rounds {
        for (i, &v) in VARIANTS.iter().enumerate() {
            admin
                .batch_execute("TRUNCATE bench_order, outbox_event")
                .await?;
            progress!(
                "  enqueue round {}/{}: {} x{} for {:?}",
                round + 1,
                p.enqueue_rounds,
                v.label(),
                p.enqueue_clients,
                p.enqueue_time
            );
            let (tx, secs, hist, cpu) = run_variant(db, &admin, v, p).await?;
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
    drop(listener);
    admin
        .batch_execute("TRUNCATE bench_order, outbox_event")
        .await?;

    let base = results[0].tps();
    let mut t = Table::new(&[
        "transaction",
        "tx/s (median)",
        "tx/s per round",
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
                format!("{} overhead", pct(100.0 * (1.0 - r.tps() / base)))
            },
            ms(r.hist.value_at_quantile(0.5) as f64),
            ms(r.hist.value_at_quantile(0.99) as f64),
            r.db_cpu_secs
                .map(|c| format!("{:.0}", c * 1e6 / r.tx.max(1) as f64))
                .unwrap_or_else(|| "n/a".into()),
        ]);
    }
    let markdown = format!(
        "{} concurrent clients, {} round(s) of {:.1} s per variant (interleaved), one transaction = \
         BEGIN; INSERT order; [SELECT outbox_enqueue(...)]; COMMIT with a ~80-byte JSON payload built by \
         the client; one session LISTENs on `outbox` as a relay would. Overhead = 1 − median tx/s ÷ \
         median tx/s of the order-only transaction.\n\n{}",
        p.enqueue_clients,
        p.enqueue_rounds,
        p.enqueue_time.as_secs_f64(),
        t.render()
    );
    let (bd, per_row_us) = breakdown(db, p.enqueue_breakdown_rows).await?;
    let markdown = format!("{markdown}\n{bd}");
    Ok(EnqueueSummary {
        results,
        markdown,
        per_row_us,
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
        if v == Variant::OutboxNoNotify {
            c.batch_execute("SET outbox.notify = off").await?;
        }
        clients.push(c);
    }
    // Fresh sessions are slow for their first transactions (catalog caches, plan caches): each
    // client runs a warm-up that is not counted.
    let warmup = (p.enqueue_time / 10).max(std::time::Duration::from_millis(200));
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
    mut c: tokio_postgres::Client,
    v: Variant,
    measure_from: Instant,
    deadline: Instant,
    client_no: usize,
) -> Result<(u64, Histogram<u64>, tokio_postgres::Client)> {
    let ins = c
        .prepare("INSERT INTO bench_order (customer, amount) VALUES ($1, $2::float8) RETURNING id")
        .await?;
    let enq = c
        .prepare("SELECT outbox_enqueue('bench.orders', $1::jsonb, $2::text, 'OrderCreated')")
        .await?;
    let one = c
        .prepare(
            "WITH o AS (INSERT INTO bench_order (customer, amount) VALUES ($1, $2::float8) RETURNING id)
             SELECT outbox_enqueue('bench.orders', $3::jsonb || jsonb_build_object('order_id', o.id),
                                   'order-' || o.id, 'OrderCreated') FROM o",
        )
        .await?;
    let mut hist = crate::report::hist();
    let mut n: u64 = 0;
    while Instant::now() < deadline {
        let customer = format!("customer-{client_no}-{}", n % 1000);
        let amount = 10.0 + (n % 500) as f64;
        let t0 = Instant::now();
        match v {
            Variant::OrderOnly => {
                let tx = c.transaction().await?;
                tx.query_one(&ins, &[&customer, &amount]).await?;
                tx.commit().await?;
            }
            Variant::Outbox | Variant::OutboxNoNotify => {
                let tx = c.transaction().await?;
                let id: i64 = tx.query_one(&ins, &[&customer, &amount]).await?.get(0);
                let payload =
                    serde_json::json!({"order_id": id, "customer": customer, "amount": amount});
                let key = format!("order-{id}");
                tx.query_one(&enq, &[&payload, &key]).await?;
                tx.commit().await?;
            }
            Variant::OutboxOneStatement => {
                let payload = serde_json::json!({"customer": customer, "amount": amount});
                c.query_one(&one, &[&customer, &amount, &payload]).await?;
            }
        }
        if t0 >= measure_from {
            hist.saturating_record(t0.elapsed().as_micros() as u64);
            n += 1;
        }
    }
    Ok((n, hist, c))
}

/// Where the enqueue time goes, server side: per-row cost of N rows in one statement (one
/// transaction, so commit and NOTIFY delivery are excluded).
pub async fn breakdown(db: &TestDb, n: i64) -> Result<(String, Vec<f64>)> {
    let c = db.client().await?;
    let cases: [(&str, &str, bool); 4] = [
        (
            "INSERT order row",
            "INSERT INTO bench_order (customer, amount) SELECT 'customer-' || g, 42.5 FROM generate_series(1, $1::bigint) g",
            true,
        ),
        (
            "plain INSERT into `outbox_event` (same row, same indexes, no function)",
            "INSERT INTO outbox_event (topic, event_key, event_type, payload, headers, status, next_retry_time)
             SELECT 'bench.orders', 'order-' || g, 'OrderCreated',
                    jsonb_build_object('order_id', g, 'customer', 'customer-' || g, 'amount', 42.5), '{}', 'WAIT', now()
               FROM generate_series(1, $1::bigint) g",
            true,
        ),
        (
            "`outbox_enqueue(...)`, `outbox.notify = off`",
            "SELECT count(outbox_enqueue('bench.orders', jsonb_build_object('order_id', g, 'customer', 'customer-' || g, 'amount', 42.5),
                                         'order-' || g, 'OrderCreated'))
               FROM generate_series(1, $1::bigint) g",
            false,
        ),
        (
            "`outbox_enqueue(...)`, notify on (folded to one NOTIFY per transaction)",
            "SELECT count(outbox_enqueue('bench.orders', jsonb_build_object('order_id', g, 'customer', 'customer-' || g, 'amount', 42.5),
                                         'order-' || g, 'OrderCreated'))
               FROM generate_series(1, $1::bigint) g",
            true,
        ),
    ];
    let mut t = Table::new(&["statement, per row", "µs/row"]);
    let mut per_row = Vec::new();
    for (label, sql, notify) in cases {
        c.batch_execute("TRUNCATE bench_order, outbox_event")
            .await?;
        c.batch_execute("VACUUM ANALYZE outbox_event").await?;
        c.batch_execute(if notify {
            "SET outbox.notify = on"
        } else {
            "SET outbox.notify = off"
        })
        .await?;
        // Best of three: the machine is shared.
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            c.batch_execute("TRUNCATE bench_order, outbox_event")
                .await?;
            let t0 = Instant::now();
            c.execute(sql, &[&n]).await?;
            best = best.min(t0.elapsed().as_secs_f64() * 1e6 / n as f64);
        }
        t.row(vec![label.into(), format!("{best:.1}")]);
        per_row.push(best);
    }
    c.batch_execute("RESET outbox.notify; TRUNCATE bench_order, outbox_event")
        .await?;
    Ok((
        format!(
            "Server-side cost per row, {} rows in one statement (best of 3; no commit, no round trips):\n\n{}",
            num(n as f64),
            t.render()
        ),
        per_row,
    ))
}
