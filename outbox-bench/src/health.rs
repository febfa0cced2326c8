//! Table health (report section 6): sizes, dead tuples and the cost of an empty claim and of
//! `outbox_stats()` after the headline drain, after `outbox_purge`, and after VACUUM.

use anyhow::Result;
use outbox_worker::defaults;
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use tokio_postgres::Client;

use crate::report::{bytes, ms, num, Table};
use crate::results::Results;

struct Health {
    table: i64,
    indexes: Vec<(String, i64)>,
    live: i64,
    dead: i64,
    autovacuums: i64,
    empty_claim_us: f64,
    stats_us: f64,
}

impl Health {
    fn json(&self) -> Value {
        json!({
            "table_bytes": self.table,
            "index_bytes": self.indexes.iter().map(|(n, b)| (n.clone(), json!(b))).collect::<serde_json::Map<_, _>>(),
            "live_tuples": self.live,
            "dead_tuples": self.dead,
            "autovacuum_runs": self.autovacuums,
            "empty_claim_us": self.empty_claim_us,
            "stats_us": self.stats_us,
        })
    }
}

async fn health_snapshot(c: &Client) -> Result<Health> {
    c.batch_execute("SELECT pg_stat_force_next_flush()").await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    c.batch_execute("SELECT pg_stat_clear_snapshot()").await?;
    let table: i64 = c
        .query_one("SELECT pg_relation_size('outbox_event')", &[])
        .await?
        .get(0);
    let indexes = c
        .query(
            "SELECT i.indexrelid::regclass::text, pg_relation_size(i.indexrelid)
               FROM pg_index i WHERE i.indrelid = 'outbox_event'::regclass ORDER BY 1",
            &[],
        )
        .await?
        .iter()
        .map(|r| (r.get::<_, String>(0), r.get::<_, i64>(1)))
        .collect();
    let r = c
        .query_one(
            "SELECT n_live_tup, n_dead_tup, autovacuum_count FROM pg_stat_user_tables
              WHERE relid = 'outbox_event'::regclass",
            &[],
        )
        .await?;
    let probe = c
        .prepare(&format!(
            "SELECT count(*) FROM outbox_claim('health-probe', {})",
            defaults::BATCH_SIZE
        ))
        .await?;
    let t0 = Instant::now();
    for _ in 0..20 {
        c.query_one(&probe, &[]).await?;
    }
    let empty_claim_us = t0.elapsed().as_micros() as f64 / 20.0;
    let t1 = Instant::now();
    for _ in 0..5 {
        c.query_one("SELECT * FROM outbox_stats()", &[]).await?;
    }
    let stats_us = t1.elapsed().as_micros() as f64 / 5.0;
    Ok(Health {
        table,
        indexes,
        live: r.get(0),
        dead: r.get(1),
        autovacuums: r.get(2),
        empty_claim_us,
        stats_us,
    })
}

/// Sizes and dead tuples after the drain that just ran, then after `outbox_purge('0')` in a loop,
/// then after VACUUM.
pub async fn health(monitor: &Client, drained: i64) -> Result<(String, bool, Value)> {
    // The claim loops have disconnected: give their backends time to report their statistics.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let a = health_snapshot(monitor).await?;
    let t0 = Instant::now();
    let mut purged: i64 = 0;
    let mut calls = 0;
    loop {
        let n: i64 = monitor
            .query_one("SELECT outbox_purge('0', $1)", &[&defaults::PURGE_MAX_ROWS])
            .await?
            .get(0);
        calls += 1;
        purged += n;
        if n == 0 {
            break;
        }
    }
    let purge_secs = t0.elapsed().as_secs_f64();
    let b = health_snapshot(monitor).await?;
    let t1 = Instant::now();
    monitor.batch_execute("VACUUM outbox_event").await?;
    let vacuum_secs = t1.elapsed().as_secs_f64();
    let c = health_snapshot(monitor).await?;

    let mut t = Table::new(&[
        "",
        "after drain",
        "after outbox_purge loop",
        "after purge + VACUUM",
    ]);
    t.row(vec![
        "table (heap) size".into(),
        bytes(a.table),
        bytes(b.table),
        bytes(c.table),
    ]);
    for (i, (name, size)) in a.indexes.iter().enumerate() {
        t.row(vec![
            format!("index `{name}`"),
            bytes(*size),
            bytes(b.indexes.get(i).map(|x| x.1).unwrap_or(0)),
            bytes(c.indexes.get(i).map(|x| x.1).unwrap_or(0)),
        ]);
    }
    t.row(vec![
        "n_live_tup / n_dead_tup".into(),
        format!("{} / {}", num(a.live as f64), num(a.dead as f64)),
        format!("{} / {}", num(b.live as f64), num(b.dead as f64)),
        format!("{} / {}", num(c.live as f64), num(c.dead as f64)),
    ]);
    t.row(vec![
        "autovacuum runs on the table so far".into(),
        a.autovacuums.to_string(),
        b.autovacuums.to_string(),
        c.autovacuums.to_string(),
    ]);
    t.row(vec![
        format!("empty `outbox_claim(…, {})` ms", defaults::BATCH_SIZE),
        ms(a.empty_claim_us),
        ms(b.empty_claim_us),
        ms(c.empty_claim_us),
    ]);
    t.row(vec![
        "`outbox_stats()` ms".into(),
        ms(a.stats_us),
        ms(b.stats_us),
        ms(c.stats_us),
    ]);
    let ok = purged == drained;
    let autovacuum: String = monitor
        .query_one("SELECT current_setting('autovacuum')", &[])
        .await?
        .get(0);
    let av = if autovacuum == "on" {
        "autovacuum on".to_string()
    } else {
        "**autovacuum is off on this server** (`autovacuum = off` in its configuration), so nothing \
         reclaims dead tuples during the drain: the 'after drain' column is the worst case"
            .to_string()
    };
    let md = format!(
        "After the headline null-sink drain of {} events ({av}). \
         `outbox_purge('0', {})` was called {calls} times and deleted {} SUCCESS rows in {:.2} s \
         ({} rows/s); VACUUM then took {:.2} s.\n\n{}",
        num(drained as f64),
        defaults::PURGE_MAX_ROWS,
        num(purged as f64),
        purge_secs,
        num(purged as f64 / purge_secs.max(1e-9)),
        vacuum_secs,
        t.render()
    );
    let figures = json!({
        "drained": drained,
        "after_drain": a.json(),
        "after_purge": b.json(),
        "after_vacuum": c.json(),
        "purge_calls": calls,
        "purged": purged,
        "purge_secs": purge_secs,
        "vacuum_secs": vacuum_secs,
    });
    Ok((md, ok, figures))
}

/// Measures the table after a drain of `drained` events; a purge that leaves SUCCESS rows fails
/// the run.
pub async fn run(monitor: &Client, drained: i64, r: &mut Results) -> Result<()> {
    progress!("==> 6. table health");
    let (md, ok, figures) = health(monitor, drained).await?;
    r.health = Some(figures);
    if !ok {
        r.failures
            .push("outbox_purge did not delete every SUCCESS row of the drain".into());
    }
    r.health_md = Some(md);
    Ok(())
}
