//! Facts about the machine (the report's environment table) and per-process CPU time, read from
//! /proc (Linux only).

use std::collections::HashMap;
use std::fs;

use anyhow::Result;
use outbox_tests::db::TestDb;
use outbox_tests::{kafka, provenance};

use crate::db::BenchDb;
use crate::Profile;

/// Clock ticks per second for /proc/<pid>/stat times.
pub fn clk_tck() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as f64
    } else {
        100.0
    }
}

/// utime + stime of a process (all its threads), in clock ticks.
pub fn proc_ticks(pid: i32) -> Option<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may contain spaces: parse after the last ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // rest starts at field 3 (state); utime is field 14, stime field 15.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(utime + stime)
}

/// CPU seconds used by a set of processes between two snapshots.
#[derive(Default, Clone)]
pub struct ProcSnapshot(pub HashMap<i32, u64>);

impl ProcSnapshot {
    pub fn take(pids: &[i32]) -> Self {
        ProcSnapshot(
            pids.iter()
                .filter_map(|&p| proc_ticks(p).map(|t| (p, t)))
                .collect(),
        )
    }

    /// Seconds of CPU used since `earlier` by the processes in `self` (processes that started in
    /// between count from zero).
    pub fn cpu_secs_since(&self, earlier: &ProcSnapshot) -> f64 {
        let ticks: u64 = self
            .0
            .iter()
            .map(|(pid, t)| t.saturating_sub(*earlier.0.get(pid).unwrap_or(&0)))
            .sum();
        ticks as f64 / clk_tck()
    }
}

/// Whole-machine CPU counters (/proc/stat first line): (busy, total) in ticks.
pub fn host_cpu() -> (u64, u64) {
    let Ok(s) = fs::read_to_string("/proc/stat") else {
        return (0, 0);
    };
    let Some(line) = s.lines().next() else {
        return (0, 0);
    };
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    let total: u64 = v.iter().take(8).sum();
    let idle = v.get(3).copied().unwrap_or(0) + v.get(4).copied().unwrap_or(0);
    (total - idle, total)
}

/// First line of `cmd args` stdout (or stderr), for version strings.
pub fn command_line(cmd: &std::path::Path, args: &[&str]) -> Option<String> {
    let out = std::process::Command::new(cmd).args(args).output().ok()?;
    let text = if out.stdout.is_empty() {
        out.stderr
    } else {
        out.stdout
    };
    String::from_utf8_lossy(&text)
        .lines()
        .next()
        .map(|l| l.trim().to_string())
        .filter(|l| !l.is_empty())
}

/// Whole-machine CPU over an interval, split into what the measured processes (plus this
/// process) used and what everything else on the machine used: the machine is shared, and a
/// row measured while other work ran is marked by a high "other load".
pub struct HostMeter {
    host: (u64, u64),
    me: u64,
}

impl HostMeter {
    pub fn start() -> HostMeter {
        HostMeter {
            host: host_cpu(),
            me: proc_ticks(std::process::id() as i32).unwrap_or(0),
        }
    }

    /// (busy %, other processes' %) of all CPUs; `ours_secs` is the CPU of the measured processes.
    pub fn stop(&self, ours_secs: f64) -> (f64, f64) {
        let h = host_cpu();
        let me = proc_ticks(std::process::id() as i32).unwrap_or(0);
        let total = h.1.saturating_sub(self.host.1) as f64;
        if total == 0.0 {
            return (0.0, 0.0);
        }
        let busy = h.0.saturating_sub(self.host.0) as f64;
        let ours = ours_secs * clk_tck() + me.saturating_sub(self.me) as f64;
        (
            100.0 * busy / total,
            (100.0 * (busy - ours) / total).max(0.0),
        )
    }
}

/// The broker line of the report: the installed Kafka's own version (`scripts/broker install`
/// records it), else the pinned one.
pub fn kafka_version() -> String {
    let home = kafka::home();
    let v = std::fs::read_to_string(home.join("version"))
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| kafka::version().to_string());
    format!(
        "Apache Kafka {v} (one JVM, KRaft broker+controller, {}, log on local disk)",
        home.display()
    )
}

/// The report's provenance table (see [`outbox_tests::provenance`]) with the bench's own rows.
pub async fn environment(
    p: &Profile,
    db: &TestDb,
    load_start: &str,
    broker: &str,
    relay: &str,
) -> Result<String> {
    let c = db.client().await?;
    let extra = [
        ("profile", format!("`{}`", p.name)),
        ("broker", broker.to_string()),
        ("relay", relay.to_string()),
    ];
    Ok(provenance::table(&c, load_start, &extra).await?)
}
