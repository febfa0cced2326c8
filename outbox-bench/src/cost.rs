//! Server-side cost of an enqueued row against a plain INSERT of the same row (per statement as
//! an application issues it, and set-based), and the bulk form `outbox_enqueue_many` against
//! single calls (issue 10). Runs inside the enqueue section, after the producer rounds.

use anyhow::{bail, Result};
use std::time::Instant;
use tokio_postgres::Client;

use outbox_tests::db::TestDb;

use crate::db::{backend_pid, BenchDb, TRUNCATE_OUTBOX};
use crate::enqueue::TOPIC;
use crate::report::{median, num, Table};
use crate::sys::{clk_tck, proc_ticks};
use crate::Profile;

pub struct CostResult {
    pub statements: i64,
    /// Backend CPU µs per statement (median of the rounds): plain INSERT, `outbox_enqueue`;
    /// None when /proc does not show the backend (server on another machine).
    pub stmt_insert_us: Option<f64>,
    pub stmt_enqueue_us: Option<f64>,
    /// Client-observed µs per statement (round trip included).
    pub stmt_insert_wall_us: f64,
    pub stmt_enqueue_wall_us: f64,
    pub set_rows: i64,
    /// Set-based µs per row (one statement of `set_rows` rows), median of the rounds: order row,
    /// plain INSERT of the event row, `outbox_enqueue` per row, `outbox_enqueue_many`.
    pub set_order_us: f64,
    pub set_insert_us: f64,
    pub set_enqueue_us: f64,
    pub set_many_us: f64,
    pub markdown: String,
}

impl CostResult {
    pub fn stmt_ratio(&self) -> Option<f64> {
        Some(self.stmt_enqueue_us? / self.stmt_insert_us?)
    }
    pub fn set_ratio(&self) -> f64 {
        self.set_enqueue_us / self.set_insert_us
    }
}

pub struct BulkResult {
    pub rows: i64,
    /// Seconds per batch (median): 10,000 single calls, one `outbox_enqueue_many` call.
    pub single_secs: f64,
    pub many_secs: f64,
    pub single_rounds: Vec<f64>,
    pub many_rounds: Vec<f64>,
    /// Backend CPU seconds per batch (median), if /proc shows the backend.
    pub single_cpu_secs: Option<f64>,
    pub many_cpu_secs: Option<f64>,
    pub markdown: String,
}

impl BulkResult {
    pub fn speedup(&self) -> f64 {
        self.single_secs / self.many_secs
    }
}

/// The row `outbox_enqueue` writes for a keyed event on an ordered topic: an `outbox_stream` row.
const INSERT_ROW: &str = "INSERT INTO outbox_stream (topic, event_key, key_hash, event_type, payload, headers)
     VALUES ('bench.orders', $2::text, outbox_key_hash('bench.orders', $2::text), 'OrderCreated', $1::jsonb, '{}')";
const ENQUEUE_ROW: &str =
    "SELECT outbox_enqueue('bench.orders', $1::jsonb, $2::text, 'OrderCreated')";

fn payload(round: usize, i: i64) -> (serde_json::Value, String) {
    let id = round as i64 * 10_000_000 + i;
    (
        serde_json::json!({"order_id": id, "customer": format!("customer-{}", i % 977), "amount": 42.5}),
        format!("order-{id}"),
    )
}

fn ticks(pid: i32) -> Option<u64> {
    proc_ticks(pid)
}

fn cpu_secs(a: Option<u64>, b: Option<u64>) -> Option<f64> {
    Some(b?.saturating_sub(a?) as f64 / clk_tck())
}

/// `n` single-row statements in one transaction (rolled back), after a warm-up of 200: backend
/// CPU µs and client-observed µs per statement.
async fn statements(
    c: &mut Client,
    pid: i32,
    sql: &str,
    n: i64,
    round: usize,
) -> Result<(Option<f64>, f64)> {
    let stmt = c.prepare(sql).await?;
    let tx = c.transaction().await?;
    for i in 0..200 {
        let (p, k) = payload(round, -1 - i);
        tx.execute(&stmt, &[&p, &k]).await?;
    }
    let rows: Vec<(serde_json::Value, String)> = (0..n).map(|i| payload(round, i)).collect();
    let t0 = Instant::now();
    let c0 = ticks(pid);
    for (p, k) in &rows {
        tx.execute(&stmt, &[p, k]).await?;
    }
    let c1 = ticks(pid);
    let wall = t0.elapsed().as_secs_f64() * 1e6 / n as f64;
    tx.rollback().await?;
    c.batch_execute(TRUNCATE_OUTBOX).await?;
    Ok((cpu_secs(c0, c1).map(|s| s * 1e6 / n as f64), wall))
}

pub async fn per_row(db: &TestDb, p: &Profile) -> Result<CostResult> {
    let mut c = db.client().await?;
    let pid = backend_pid(&c).await?;
    c.batch_execute(TRUNCATE_OUTBOX).await?;
    c.batch_execute("VACUUM ANALYZE outbox_scheduled, outbox_stream, outbox_key")
        .await?;
    let n = p.cost_statements;
    let (mut ins_cpu, mut enq_cpu, mut ins_wall, mut enq_wall) = (vec![], vec![], vec![], vec![]);
    for round in 0..p.cost_rounds {
        progress!(
            "  enqueue CPU round {}/{}: {} single-row statements each",
            round + 1,
            p.cost_rounds,
            num(n as f64)
        );
        // Alternate which goes first.
        for k in 0..2 {
            let enqueue = (round + k) % 2 == 1;
            let (cpu, wall) = statements(
                &mut c,
                pid,
                if enqueue { ENQUEUE_ROW } else { INSERT_ROW },
                n,
                round,
            )
            .await?;
            let (cv, wv) = if enqueue {
                (&mut enq_cpu, &mut enq_wall)
            } else {
                (&mut ins_cpu, &mut ins_wall)
            };
            if let Some(x) = cpu {
                cv.push(x);
            }
            wv.push(wall);
        }
    }
    let opt = |v: &Vec<f64>| (v.len() == p.cost_rounds).then(|| median(v));
    let (stmt_insert_us, stmt_enqueue_us) = (opt(&ins_cpu), opt(&enq_cpu));

    // Set-based: one statement of n rows.
    let set_rows = p.enqueue_breakdown_rows;
    let cases: [(&str, String); 4] = [
        (
            "INSERT order rows",
            "INSERT INTO bench_order (customer, amount) SELECT 'customer-' || g, 42.5 FROM generate_series(1, $1::bigint) g".into(),
        ),
        (
            "plain INSERT into `outbox_stream` (the rows `outbox_enqueue` writes, same table and indexes)",
            format!("INSERT INTO outbox_stream (topic, event_key, key_hash, event_type, payload, headers)
             SELECT '{TOPIC}', 'order-' || g, outbox_key_hash('{TOPIC}', 'order-' || g), 'OrderCreated',
                    jsonb_build_object('order_id', g, 'customer', 'customer-' || g, 'amount', 42.5), '{{}}'
               FROM generate_series(1, $1::bigint) g"),
        ),
        (
            "`outbox_enqueue(...)` once per row (keyed)",
            format!("SELECT count(outbox_enqueue('{TOPIC}', jsonb_build_object('order_id', g, 'customer', 'customer-' || g, 'amount', 42.5),
                                         'order-' || g, 'OrderCreated'))
               FROM generate_series(1, $1::bigint) g"),
        ),
        (
            "`outbox_enqueue_many(...)`, one call with arrays of all the rows (keyed)",
            format!("SELECT count(*) FROM outbox_enqueue_many('{TOPIC}',
                    ARRAY(SELECT jsonb_build_object('order_id', g, 'customer', 'customer-' || g, 'amount', 42.5)
                            FROM generate_series(1, $1::bigint) g ORDER BY g),
                    ARRAY(SELECT 'order-' || g FROM generate_series(1, $1::bigint) g ORDER BY g),
                    array_fill('OrderCreated'::text, ARRAY[$1::int]))"),
        ),
    ];
    let mut set = vec![Vec::new(); cases.len()];
    for round in 0..p.cost_rounds {
        progress!(
            "  set-based round {}/{}: {} rows per statement",
            round + 1,
            p.cost_rounds,
            num(set_rows as f64)
        );
        for (i, (_, sql)) in cases.iter().enumerate() {
            c.batch_execute(&format!("{TRUNCATE_OUTBOX}, bench_order"))
                .await?;
            let tx = c.transaction().await?;
            let t0 = Instant::now();
            tx.execute(sql.as_str(), &[&set_rows]).await?;
            set[i].push(t0.elapsed().as_secs_f64() * 1e6 / set_rows as f64);
            tx.rollback().await?;
        }
    }
    c.batch_execute(&format!("{TRUNCATE_OUTBOX}, bench_order"))
        .await?;
    let set_us: Vec<f64> = set.iter().map(|v| median(v)).collect();

    let f = |x: Option<f64>| x.map(|v| format!("{v:.1}")).unwrap_or_else(|| "n/a".into());
    let mut t = Table::new(&[
        "statement (one row each)",
        "backend CPU µs/statement (median)",
        "client µs/statement (round trip included)",
        "÷ plain INSERT (CPU)",
    ]);
    t.row(vec![
        "`INSERT INTO outbox_stream … VALUES (…)` (the row `outbox_enqueue` writes)".into(),
        f(stmt_insert_us),
        format!("{:.1}", median(&ins_wall)),
        "1.00".into(),
    ]);
    t.row(vec![
        "`SELECT outbox_enqueue(…)` (keyed, defaults)".into(),
        f(stmt_enqueue_us),
        format!("{:.1}", median(&enq_wall)),
        match (stmt_enqueue_us, stmt_insert_us) {
            (Some(a), Some(b)) => format!("{:.2}", a / b),
            _ => "n/a".into(),
        },
    ]);
    let mut s = Table::new(&[
        "one statement of many rows",
        "µs/row (median)",
        "÷ plain INSERT",
    ]);
    for (i, (label, _)) in cases.iter().enumerate() {
        s.row(vec![
            (*label).into(),
            format!("{:.1}", set_us[i]),
            if i == 0 {
                "—".into()
            } else {
                format!("{:.2}", set_us[i] / set_us[1])
            },
        ]);
    }
    let markdown = format!(
        "### Enqueue CPU per row\n\n**Per statement, as an application issues it:** one session, \
         {} prepared single-row statements in one transaction (rolled back; commit costs the same \
         either way), after 200 not counted; backend CPU is the server process's utime + stime \
         from `/proc/<pid>/stat` around the statements (10 ms ticks), \
         median of {} interleaved rounds. Both write the same row, keyed, into `outbox_stream` \
         (every event due now goes there).\n\n{}\n\
         **Set-based:** one statement of {} rows (what `sql/bench/enqueue-cost.sh` measures), \
         timed by the client in a transaction rolled back after, median of {} rounds. A \
         set-based INSERT pays its executor start once for all the rows; `outbox_enqueue` is a \
         PL/pgSQL function whose own INSERT runs once per call, so it pays one per row, as in \
         the per-statement case where both pay one per row.\n\n{}",
        num(n as f64),
        p.cost_rounds,
        t.render(),
        num(set_rows as f64),
        p.cost_rounds,
        s.render()
    );
    Ok(CostResult {
        statements: n,
        stmt_insert_us,
        stmt_enqueue_us,
        stmt_insert_wall_us: median(&ins_wall),
        stmt_enqueue_wall_us: median(&enq_wall),
        set_rows,
        set_order_us: set_us[0],
        set_insert_us: set_us[1],
        set_enqueue_us: set_us[2],
        set_many_us: set_us[3],
        markdown,
    })
}

/// One batch of `n` events in one transaction: `n` single calls of a prepared `outbox_enqueue`,
/// or one `outbox_enqueue_many`. (wall seconds including the commit, backend CPU seconds).
async fn batch(
    c: &mut Client,
    pid: i32,
    many: bool,
    n: i64,
    round: usize,
) -> Result<(f64, Option<f64>)> {
    let single = c.prepare(ENQUEUE_ROW).await?;
    let bulk = c
        .prepare(&format!(
            "SELECT count(*) FROM outbox_enqueue_many('{TOPIC}', $1::jsonb[], $2::text[], $3::text[])"
        ))
        .await?;
    let (payloads, keys): (Vec<serde_json::Value>, Vec<String>) =
        (0..n).map(|i| payload(round, i)).unzip();
    let types = vec!["OrderCreated".to_string(); n as usize];
    let t0 = Instant::now();
    let c0 = ticks(pid);
    let tx = c.transaction().await?;
    if many {
        let got: i64 = tx
            .query_one(&bulk, &[&payloads, &keys, &types])
            .await?
            .get(0);
        if got != n {
            bail!("outbox_enqueue_many returned {got} ids for {n} events");
        }
    } else {
        for (p, k) in payloads.iter().zip(&keys) {
            tx.query_one(&single, &[p, k]).await?;
        }
    }
    tx.commit().await?;
    let c1 = ticks(pid);
    let secs = t0.elapsed().as_secs_f64();
    c.batch_execute(TRUNCATE_OUTBOX).await?;
    Ok((secs, cpu_secs(c0, c1)))
}

pub async fn bulk(db: &TestDb, p: &Profile) -> Result<BulkResult> {
    let mut c = db.client().await?;
    let pid = backend_pid(&c).await?;
    let n = p.bulk_rows;
    c.batch_execute(TRUNCATE_OUTBOX).await?;
    // Warm-up of both paths (plan caches), not counted.
    batch(&mut c, pid, false, 100.min(n), 99).await?;
    batch(&mut c, pid, true, 100.min(n), 98).await?;
    let (mut s_secs, mut m_secs, mut s_cpu, mut m_cpu) = (vec![], vec![], vec![], vec![]);
    for round in 0..p.cost_rounds {
        progress!(
            "  bulk round {}/{}: {} events, single calls vs outbox_enqueue_many",
            round + 1,
            p.cost_rounds,
            num(n as f64)
        );
        for k in 0..2 {
            let many = (round + k) % 2 == 1;
            let (secs, cpu) = batch(&mut c, pid, many, n, round).await?;
            if many {
                m_secs.push(secs);
                m_cpu.extend(cpu);
            } else {
                s_secs.push(secs);
                s_cpu.extend(cpu);
            }
        }
    }
    let opt = |v: &Vec<f64>| (v.len() == p.cost_rounds).then(|| median(v));
    let (single_secs, many_secs) = (median(&s_secs), median(&m_secs));
    let (single_cpu_secs, many_cpu_secs) = (opt(&s_cpu), opt(&m_cpu));
    let mut t = Table::new(&[
        "one transaction of the same events",
        "ms (median)",
        "ms per round",
        "events/s",
        "backend CPU ms",
    ]);
    let fmt_rounds = |v: &[f64]| {
        v.iter()
            .map(|x| format!("{:.0}", x * 1e3))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let cpu = |x: Option<f64>| {
        x.map(|v| format!("{:.0}", v * 1e3))
            .unwrap_or_else(|| "n/a".into())
    };
    t.row(vec![
        format!(
            "{} single `SELECT outbox_enqueue(…)` calls (prepared)",
            num(n as f64)
        ),
        format!("{:.0}", single_secs * 1e3),
        fmt_rounds(&s_secs),
        num(n as f64 / single_secs),
        cpu(single_cpu_secs),
    ]);
    t.row(vec![
        format!(
            "one `outbox_enqueue_many(…)` of {} (arrays as parameters)",
            num(n as f64)
        ),
        format!("{:.0}", many_secs * 1e3),
        fmt_rounds(&m_secs),
        num(n as f64 / many_secs),
        cpu(many_cpu_secs),
    ]);
    let markdown = format!(
        "### Bulk enqueue\n\nOne client, one transaction (BEGIN … COMMIT timed by the client), \
         {} keyed events of topic `{TOPIC}`, the same payloads and keys both ways; median of {} \
         interleaved rounds: **{:.1}× faster** in one call.\n\n{}",
        num(n as f64),
        p.cost_rounds,
        single_secs / many_secs,
        t.render()
    );
    Ok(BulkResult {
        rows: n,
        single_secs,
        many_secs,
        single_rounds: s_secs,
        many_rounds: m_secs,
        single_cpu_secs,
        many_cpu_secs,
        markdown,
    })
}
