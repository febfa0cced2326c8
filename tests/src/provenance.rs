//! Where a report's figures came from: the machine, the checkout, the server and the date, as the
//! table every generated report (outbox-bench's, the fault runner's) starts with. Linux only.

use std::fs;

use tokio_postgres::Client;

pub fn cpu_model() -> String {
    fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}

pub fn cpus() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

pub fn mem_total_gib() -> f64 {
    fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map(|kb| kb / 1024.0 / 1024.0)
        .unwrap_or(0.0)
}

pub fn kernel() -> String {
    fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into())
}

/// The 1, 5 and 15 minute load averages: the machine is shared, and a figure measured under
/// load says so.
pub fn loadavg() -> String {
    fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

/// The commit checked out, marked when the work tree differs from it outside reports/.
pub fn checkout() -> String {
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    match (
        git(&["rev-parse", "--short", "HEAD"]),
        // Other reports being rewritten by the same session do not change what ran.
        git(&[
            "status",
            "--porcelain",
            "--untracked-files=no",
            "--",
            ".",
            ":!reports",
        ]),
    ) {
        (Some(c), Some(changes)) if !changes.is_empty() => format!("{c} with uncommitted changes"),
        (Some(c), _) => c,
        (None, _) => "unknown".into(),
    }
}

/// The PostgreSQL settings a figure depends on.
const SETTINGS: &str = "'shared_buffers', 'synchronous_commit', 'fsync', 'wal_level', \
    'max_connections', 'autovacuum', 'shared_preload_libraries', 'max_wal_size', \
    'checkpoint_timeout', 'max_locks_per_transaction'";

/// The provenance table: date, checkout, machine, server and its settings, the extension's
/// version (installed in `c`'s database, else the server's default), the `extra` rows, and the
/// load average at `load_start` and now.
pub async fn table(
    c: &Client,
    load_start: &str,
    extra: &[(&str, String)],
) -> Result<String, tokio_postgres::Error> {
    let one =
        |sql: String| async move { c.query_one(&sql, &[]).await.map(|r| r.get::<_, String>(0)) };
    let date = one("SELECT to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI \"UTC\"')".into())
        .await?;
    let pg = one("SELECT version()".into()).await?;
    let settings = one(format!(
        "SELECT string_agg(format('`%s = %s%s`', name, setting, coalesce(unit, '')), ', ' \
         ORDER BY name) FROM pg_settings WHERE name IN ({SETTINGS})"
    ))
    .await?;
    let ext = one("SELECT coalesce(\
        (SELECT extversion FROM pg_extension WHERE extname = 'outbox'), \
        (SELECT default_version || ' (the server''s default)' FROM pg_available_extensions \
          WHERE name = 'outbox'), 'not installed')"
        .into())
    .await?;
    let mut rows = vec![
        ("date", date),
        ("checkout", format!("`{}`", checkout())),
        ("CPU", format!("{} × {}", cpus(), cpu_model())),
        ("memory", format!("{:.1} GiB", mem_total_gib())),
        ("kernel", kernel()),
        ("PostgreSQL", pg),
        ("PostgreSQL settings", settings),
        ("outbox extension", ext),
    ];
    rows.extend(extra.iter().map(|(k, v)| (*k, v.clone())));
    let load = format!("{load_start} → {}", loadavg());
    rows.push(("load average (1/5/15 min) at start → end", load));
    let mut s = String::from("| | |\n|---|---|\n");
    for (k, v) in rows {
        s += &format!("| {k} | {v} |\n");
    }
    Ok(s)
}
