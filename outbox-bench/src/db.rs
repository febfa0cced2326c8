//! Connections, the throw-away benchmark database, backlog creation and CPU accounting of the
//! PostgreSQL backends that serve it.

use anyhow::{bail, Context, Result};
use std::time::Duration;
use tokio_postgres::config::Host;
use tokio_postgres::{Client, Config, NoTls};

use crate::sys::ProcSnapshot;

/// Admin connection settings: `--database-url`, else PGHOST/PGPORT/PGUSER/PGPASSWORD (libpq
/// defaults otherwise), database `postgres`.
pub fn admin_config(url: Option<&str>) -> Result<Config> {
    if let Some(u) = url {
        let mut c: Config = u.parse().context("parsing --database-url")?;
        if c.get_dbname().is_none() {
            c.dbname("postgres");
        }
        return Ok(c);
    }
    let mut c = Config::new();
    c.host(std::env::var("PGHOST").unwrap_or_else(|_| "127.0.0.1".into()));
    c.port(
        std::env::var("PGPORT")
            .ok()
            .and_then(|p| p.parse().ok())
            .unwrap_or(5432),
    );
    c.user(std::env::var("PGUSER").unwrap_or_else(|_| "postgres".into()));
    if let Ok(pw) = std::env::var("PGPASSWORD") {
        c.password(pw);
    }
    c.dbname("postgres");
    Ok(c)
}

pub async fn connect(cfg: &Config) -> Result<Client> {
    let (client, conn) = cfg
        .connect(NoTls)
        .await
        .with_context(|| format!("connecting to PostgreSQL ({})", describe(cfg)))?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(client)
}

/// host:port/db without secrets.
pub fn describe(cfg: &Config) -> String {
    let host = match cfg.get_hosts().first() {
        Some(Host::Tcp(h)) => h.clone(),
        Some(Host::Unix(p)) => p.display().to_string(),
        None => "localhost".into(),
    };
    let port = cfg.get_ports().first().copied().unwrap_or(5432);
    format!(
        "{}@{host}:{port}/{}",
        cfg.get_user().unwrap_or("?"),
        cfg.get_dbname().unwrap_or("?")
    )
}

fn pct_encode(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// A postgresql:// URL for the relay binary (it holds the password if one was configured; it is
/// passed in the child's environment, never printed).
pub fn url(cfg: &Config) -> String {
    let user = pct_encode(cfg.get_user().unwrap_or("postgres"));
    let auth = match cfg.get_password() {
        Some(pw) => format!("{user}:{}", pct_encode(&String::from_utf8_lossy(pw))),
        None => user,
    };
    let port = cfg.get_ports().first().copied().unwrap_or(5432);
    let db = pct_encode(cfg.get_dbname().unwrap_or("postgres"));
    match cfg.get_hosts().first() {
        Some(Host::Unix(p)) => format!(
            "postgresql://{auth}@/{db}?host={}&port={port}",
            pct_encode(&p.display().to_string())
        ),
        Some(Host::Tcp(h)) => format!("postgresql://{auth}@{h}:{port}/{db}"),
        None => format!("postgresql://{auth}@localhost:{port}/{db}"),
    }
}

/// The benchmark's own database: created with a unique name, dropped at the end.
pub struct BenchDb {
    pub admin: Config,
    pub cfg: Config,
    pub name: String,
}

impl BenchDb {
    pub async fn create(admin: &Config) -> Result<BenchDb> {
        let a = connect(admin).await?;
        let avail: Option<String> = a
            .query_opt(
                "SELECT default_version FROM pg_available_extensions WHERE name = 'outbox'",
                &[],
            )
            .await?
            .map(|r| r.get(0));
        if avail.is_none() {
            bail!(
                "the outbox extension is not installed in this PostgreSQL server ({}): run scripts/setup first",
                describe(admin)
            );
        }
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_millis();
        let name = format!("outbox_bench_{}_{}", std::process::id(), stamp);
        a.batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .with_context(|| format!("CREATE DATABASE {name}"))?;
        let mut cfg = admin.clone();
        cfg.dbname(&name);
        let db = BenchDb {
            admin: admin.clone(),
            cfg,
            name,
        };
        let c = connect(&db.cfg).await?;
        c.batch_execute("CREATE EXTENSION outbox")
            .await
            .context("CREATE EXTENSION outbox")?;
        Ok(db)
    }

    pub async fn drop_db(&self) -> Result<()> {
        let a = connect(&self.admin).await?;
        a.batch_execute(&format!(
            "DROP DATABASE IF EXISTS {} WITH (FORCE)",
            self.name
        ))
        .await?;
        Ok(())
    }

    pub async fn connect(&self) -> Result<Client> {
        connect(&self.cfg).await
    }

    pub fn url(&self) -> String {
        url(&self.cfg)
    }

    /// The server runs on this machine (loopback or a Unix socket): one clock for both sides.
    pub fn is_local(&self) -> bool {
        match self.cfg.get_hosts().first() {
            Some(Host::Tcp(h)) => matches!(h.as_str(), "127.0.0.1" | "localhost" | "::1"),
            Some(Host::Unix(_)) | None => true,
        }
    }
}

/// Empties the outbox and loads `n` due WAIT rows in one statement (oldest first, distinct
/// `next_retry_time`s), then VACUUM ANALYZE so every run starts from the same state.
pub async fn fill_backlog(c: &Client, n: i64, topic: &str) -> Result<()> {
    c.batch_execute("TRUNCATE outbox_event").await?;
    insert_backlog(c, n, topic).await?;
    // Report the insert to the statistics before VACUUM sets the absolute counts, or the pending
    // insert count lands on top of them later and n_live_tup reads double.
    c.batch_execute("SELECT pg_stat_force_next_flush()").await?;
    c.batch_execute("SELECT 1").await?;
    c.batch_execute("VACUUM ANALYZE outbox_event").await?;
    Ok(())
}

/// Inserts `n` due WAIT rows (payload like a small order event, ~90 bytes of JSON).
pub async fn insert_backlog(c: &Client, n: i64, topic: &str) -> Result<()> {
    c.execute(
        "INSERT INTO outbox_event (topic, event_key, event_type, payload, headers, status, next_retry_time)
         SELECT $1, 'order-' || g, 'OrderCreated',
                jsonb_build_object('order_id', g, 'customer', 'c' || (g % 977), 'amount', 42.50),
                '{}', 'WAIT', now() - ($2 - g) * interval '1 microsecond'
           FROM generate_series(1, $2::bigint) g",
        &[&topic, &n],
    )
    .await
    .context("creating the backlog")?;
    Ok(())
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

/// Waits until nothing is due or in flight; returns false on timeout. Polls a cheap EXISTS probe
/// every 20 ms (counting a large backlog 50 times a second would steal CPU from the drain) and
/// confirms with `outbox_stats()` (due_wait = 0 and sending = 0).
pub async fn wait_drained(c: &Client, timeout: Duration) -> Result<bool> {
    let deadline = tokio::time::Instant::now() + timeout;
    let probe = c
        .prepare(
            "SELECT EXISTS (SELECT 1 FROM outbox_event WHERE status = 'WAIT' AND next_retry_time <= clock_timestamp())
                 OR EXISTS (SELECT 1 FROM outbox_event WHERE status = 'SENDING')",
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
