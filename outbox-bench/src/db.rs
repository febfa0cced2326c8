//! Connections, the throw-away benchmark database, backlog creation and CPU accounting of the
//! PostgreSQL backends that serve it.

use anyhow::{Context, Result};
use std::time::Duration;
use tokio_postgres::config::Host;
use tokio_postgres::{Client, Config};

use outbox_tests::db::{conninfo_value, try_connect, TestDb};

use crate::sys::ProcSnapshot;

/// The server the bench creates its database on, as libpq parameters without a database name:
/// `--database-url` (a URL or key=value string), else the tests' `server_params()` (PGHOST,
/// PGPORT, PGUSER, PGPASSWORD with `scripts/env.sh`'s defaults).
pub fn server(url: Option<&str>) -> Result<String> {
    let Some(u) = url else {
        return Ok(outbox_tests::db::server_params());
    };
    let c: Config = u.parse().context("parsing --database-url")?;
    let mut p = match c.get_hosts().first() {
        Some(Host::Tcp(h)) => format!("host={}", conninfo_value(h)),
        Some(Host::Unix(d)) => format!("host={}", conninfo_value(&d.to_string_lossy())),
        None => "host=127.0.0.1".into(),
    };
    p += &format!(" port={}", c.get_ports().first().copied().unwrap_or(5432));
    if let Some(user) = c.get_user() {
        p += &format!(" user={}", conninfo_value(user));
    }
    if let Some(pw) = c.get_password() {
        p += &format!(" password={}", conninfo_value(&String::from_utf8_lossy(pw)));
    }
    Ok(p)
}

/// What the bench needs of its scratch database beyond the tests' [`TestDb`].
pub trait BenchDb {
    /// A new session, its failure an error of the run rather than a panic.
    async fn client(&self) -> Result<Client>;
    /// The server runs on this machine (loopback or a Unix socket): one clock for both sides.
    fn is_local(&self) -> bool;
}

impl BenchDb for TestDb {
    async fn client(&self) -> Result<Client> {
        try_connect(&self.url())
            .await
            .with_context(|| format!("connecting to database {}", self.name))
    }

    fn is_local(&self) -> bool {
        let cfg: Option<Config> = self.url().parse().ok();
        match cfg.as_ref().and_then(|c| c.get_hosts().first().cloned()) {
            Some(Host::Tcp(h)) => matches!(h.as_str(), "127.0.0.1" | "localhost" | "::1"),
            Some(Host::Unix(_)) | None => true,
        }
    }
}

/// Every table of events and claims, emptied between runs. The stream's cursor stays: its newest
/// version must, and an emptied stream behind an old position is handed out as any new events.
pub const TRUNCATE_OUTBOX: &str =
    "TRUNCATE outbox_scheduled, outbox_stream, outbox_stream_batch, outbox_key";

/// Empties the outbox and loads `n` fresh events in one statement (handed out in id order), then
/// VACUUM ANALYZE so every run starts from the same state.
pub async fn fill_backlog(c: &Client, n: i64, topic: &str) -> Result<()> {
    c.batch_execute(TRUNCATE_OUTBOX).await?;
    insert_backlog(c, n, topic).await?;
    // Report the insert to the statistics before VACUUM sets the absolute counts, or the pending
    // insert count lands on top of them later and n_live_tup reads double.
    c.batch_execute("SELECT pg_stat_force_next_flush()").await?;
    c.batch_execute("SELECT 1").await?;
    c.batch_execute("VACUUM ANALYZE outbox_scheduled, outbox_stream")
        .await?;
    Ok(())
}

/// Inserts `n` fresh unordered events (payload like a small order event, ~90 bytes of JSON, keyed
/// by order): rows of `outbox_stream`, where `outbox_enqueue` puts an event due now that keeps no
/// key order.
pub async fn insert_backlog(c: &Client, n: i64, topic: &str) -> Result<()> {
    c.execute(
        "INSERT INTO outbox_stream (topic, event_key, event_type, payload, headers)
         SELECT $1, 'order-' || g, 'OrderCreated',
                jsonb_build_object('order_id', g, 'customer', 'c' || (g % 977), 'amount', 42.50), '{}'
           FROM generate_series(1, $2::bigint) g
          ORDER BY g",
        &[&topic, &n],
    )
    .await
    .context("creating the backlog")?;
    Ok(())
}

/// Events per transaction of a keyed fill. Each distinct key of a transaction holds an advisory
/// lock until commit (`outbox_enqueue` on an ordered topic), and the server's shared lock table
/// holds about max_locks_per_transaction × max_connections locks (64 × 100 by default): one
/// transaction enqueuing for 100,000 keys fails with "out of shared memory".
pub const KEYED_FILL_TX: i64 = 1_000;

/// Empties the outbox (events and key rows) and enqueues `n` events over `keys` keys
/// (`'k' || g % keys`) through `outbox_enqueue`, `KEYED_FILL_TX` events per transaction, so the
/// `ordered` flags, the key rows and the id order are the real ones; with `unordered` the session
/// lists `topic` in `outbox.unordered_topics` first. Then VACUUM ANALYZE. Returns (ordered events,
/// key rows). Use a session of its own: the setting stays in it.
pub async fn fill_keyed(
    c: &Client,
    topic: &str,
    n: i64,
    keys: i64,
    unordered: bool,
) -> Result<(i64, i64)> {
    c.batch_execute(TRUNCATE_OUTBOX).await?;
    let list = if unordered { topic } else { "" };
    c.execute(
        "SELECT set_config('outbox.unordered_topics', $1, false)",
        &[&list],
    )
    .await?;
    let fill = c
        .prepare(
            "SELECT count(outbox_enqueue($1, jsonb_build_object('order_id', g, 'customer', 'c' || (g % 977), 'amount', 42.50),
                                         key => 'k' || (g % $4), event_type => 'OrderCreated'))
               FROM generate_series($2::bigint, $3::bigint) g",
        )
        .await?;
    let mut from = 1;
    while from <= n {
        let to = (from + KEYED_FILL_TX - 1).min(n);
        c.query_one(&fill, &[&topic, &from, &to, &keys])
            .await
            .context("enqueuing the keyed backlog")?;
        from = to + 1;
    }
    c.batch_execute("SELECT pg_stat_force_next_flush()").await?;
    c.batch_execute("SELECT 1").await?;
    c.batch_execute("VACUUM ANALYZE outbox_scheduled, outbox_stream, outbox_key")
        .await?;
    let r = c
        .query_one(
            "SELECT (SELECT count(*) FROM outbox_event WHERE ordered),
                    (SELECT count(*) FROM outbox_key)",
            &[],
        )
        .await?;
    Ok((r.get(0), r.get(1)))
}

pub async fn count_status(c: &Client, status: &str) -> Result<i64> {
    Ok(c.query_one(
        "SELECT count(*) FROM outbox_event WHERE status = $1::text::outbox_status",
        &[&status],
    )
    .await?
    .get(0))
}

/// (due_wait, sending) from outbox_stats().
pub async fn stats_pending(c: &Client) -> Result<(i64, i64)> {
    let r = c
        .query_one("SELECT due_wait, sending FROM outbox_stats()", &[])
        .await?;
    Ok((r.get(0), r.get(1)))
}

/// PIDs of the backends connected to `db`, except the caller's own.
pub async fn backend_pids(c: &Client, db: &str) -> Result<Vec<i32>> {
    Ok(c.query(
        "SELECT pid FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
        &[&db],
    )
    .await?
    .iter()
    .map(|r| r.get(0))
    .collect())
}

pub async fn backend_pid(c: &Client) -> Result<i32> {
    Ok(c.query_one("SELECT pg_backend_pid()", &[]).await?.get(0))
}

/// CPU of the PostgreSQL backends serving the benchmark database, measured from /proc (needs the
/// server on this machine; reported as unavailable otherwise).
pub struct DbCpu {
    start: ProcSnapshot,
}

impl DbCpu {
    pub async fn start(monitor: &Client, db: &str) -> Result<DbCpu> {
        let pids = backend_pids(monitor, db).await?;
        Ok(DbCpu {
            start: ProcSnapshot::take(&pids),
        })
    }

    /// CPU seconds since start, or None when /proc shows none of the backends.
    pub async fn stop(&self, monitor: &Client, db: &str) -> Result<Option<f64>> {
        let pids = backend_pids(monitor, db).await?;
        let end = ProcSnapshot::take(&pids);
        if end.0.is_empty() {
            return Ok(None);
        }
        Ok(Some(end.cpu_secs_since(&self.start)))
    }
}

/// Waits until nothing is due or in flight; returns false on timeout. Polls a cheap probe every
/// 20 ms (counting a large backlog 50 times a second would steal CPU from the drain) and confirms
/// with `outbox_stats()` (due_wait = 0 and sending = 0). The probe reads the tables, not the
/// `outbox_event` view (whose statuses of stream events are computed over the whole stream): due
/// work as `outbox_wait` looks for it (`outbox_work_due()`: index probes), scheduled rows in flight,
/// and claims with stream events not yet settled.
pub async fn wait_drained(c: &Client, timeout: Duration) -> Result<bool> {
    let deadline = tokio::time::Instant::now() + timeout;
    let probe = c
        .prepare(
            "SELECT outbox_work_due()
                 OR EXISTS (SELECT 1 FROM outbox_scheduled WHERE status = 'SENDING')
                 OR EXISTS (SELECT 1 FROM outbox_stream_batch)",
        )
        .await?;
    loop {
        let busy: bool = c.query_one(&probe, &[]).await?.get(0);
        if !busy {
            let (due, sending) = stats_pending(c).await?;
            if due == 0 && sending == 0 {
                return Ok(true);
            }
        }
        if tokio::time::Instant::now() > deadline {
            return Ok(false);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
