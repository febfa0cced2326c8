//! Table health (report section 6): sizes, dead tuples and the cost of an empty claim and of
//! `outbox_stats()` after the headline drain, after `outbox_purge`, and after VACUUM. Every table
//! of the extension is measured (`ext_rels`): events live in `outbox_scheduled` and `outbox_stream`.

use anyhow::Result;
use outbox_worker::defaults;
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use tokio_postgres::Client;

use crate::ext_rels::{self, ExtRels};
use crate::report::{bytes, ms, num, Table};
use crate::results::Results;

struct Health {
    rels: ExtRels,
    empty_claim_us: f64,
    stats_us: f64,
}

impl Health {
    /// Per table (`tables`: sizes, tuples, autovacuum runs) and per index (`index_bytes`), as
    /// `ExtRels` reports them, with the two timings.
    fn json(&self) -> Value {
        let mut v = self.rels.json();
        v["empty_claim_us"] = json!(self.empty_claim_us);
        v["stats_us"] = json!(self.stats_us);
        v
    }

    /// The named table's figures (zeros when it is missing).
    fn table(&self, name: &str) -> ext_rels::TableStat {
        self.rels
            .tables
            .iter()
            .find(|t| t.name == name)
            .cloned()
            .unwrap_or(ext_rels::TableStat {
                name: name.to_string(),
                heap: 0,
                indexes: 0,
                live: 0,
                dead: 0,
                autovacuums: 0,
                autoanalyzes: 0,
            })
    }
}

async fn health_snapshot(c: &Client) -> Result<Health> {
    c.batch_execute("SELECT pg_stat_force_next_flush()").await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let rels = ext_rels::snapshot(c).await?;
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
        rels,
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
    let tables = ext_rels::table_list(monitor).await?;
    monitor.batch_execute(&format!("VACUUM {tables}")).await?;
    let vacuum_secs = t1.elapsed().as_secs_f64();
    let c = health_snapshot(monitor).await?;

    let mut t = Table::new(&[
        "",
        "after drain",
        "after outbox_purge loop",
        "after purge + VACUUM",
    ]);
    // Each table of the extension (events: outbox_scheduled and outbox_stream), then each index.
    let names: Vec<String> = a.rels.tables.iter().map(|x| x.name.clone()).collect();
    for name in &names {
        let (ta, tb, tc) = (a.table(name), b.table(name), c.table(name));
        t.row(vec![
            format!("table `{name}` size (heap, TOAST, maps)"),
            bytes(ta.heap),
            bytes(tb.heap),
            bytes(tc.heap),
        ]);
    }
    for (name, size) in &a.rels.indexes {
        let at = |h: &Health| bytes(h.rels.index_size(name).unwrap_or(0));
        t.row(vec![
            format!("index `{name}`"),
            bytes(*size),
            at(&b),
            at(&c),
        ]);
    }
    for name in &names {
        let (ta, tb, tc) = (a.table(name), b.table(name), c.table(name));
        t.row(vec![
            format!("`{name}` n_live_tup / n_dead_tup"),
            format!("{} / {}", num(ta.live as f64), num(ta.dead as f64)),
            format!("{} / {}", num(tb.live as f64), num(tb.dead as f64)),
            format!("{} / {}", num(tc.live as f64), num(tc.dead as f64)),
        ]);
    }
    for name in &names {
        let (ta, tb, tc) = (a.table(name), b.table(name), c.table(name));
        t.row(vec![
            format!("autovacuum runs on `{name}` so far"),
            ta.autovacuums.to_string(),
            tb.autovacuums.to_string(),
            tc.autovacuums.to_string(),
        ]);
    }
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
