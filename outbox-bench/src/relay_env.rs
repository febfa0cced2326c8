//! What the broker sections share: the bench database, the broker, the sink the relay publishes
//! to and a way to start the relay with default settings and its log kept in the workdir.

use anyhow::{anyhow, bail, Result};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;
use tokio_postgres::Client;

use outbox_tests::broker::Broker;
use outbox_tests::db::TestDb;
use outbox_tests::relay::Relay;
use outbox_tests::sinks::TestSink;

/// The broker a relay publishes to: its name, the relay flags that reach it and its process (for
/// its CPU time).
#[derive(Clone)]
pub struct SinkTarget {
    pub name: &'static str,
    pub args: Vec<String>,
    pub pid: Option<u32>,
}

impl SinkTarget {
    pub fn kafka(broker: &Broker) -> SinkTarget {
        SinkTarget {
            name: "Kafka",
            args: vec!["--brokers".into(), broker.addr()],
            pid: broker.pid(),
        }
    }

    pub fn of(sink: &TestSink) -> SinkTarget {
        SinkTarget {
            name: sink.name(),
            args: sink.relay_args(),
            pid: sink.pid(),
        }
    }
}

pub struct RelayEnv<'a> {
    pub db: &'a TestDb,
    pub monitor: &'a Client,
    /// The Kafka broker of the sections that read it back (latency, fairness).
    pub broker: &'a Broker,
    /// Where the relays of this environment publish.
    pub sink: &'a SinkTarget,
    pub relay_bin: &'a Path,
    pub workdir: &'a Path,
}

impl RelayEnv<'_> {
    /// `outbox-worker run <sink flags> <extra>` on the bench database, with no `OUTBOX_*`
    /// variable of the caller ("default settings" means defaults) and the URL in the environment
    /// (a password never shows in `ps`); its log is written to `relay-<tag>.log` in the workdir.
    pub fn start_relay(&self, extra: &[String], tag: &str) -> Result<BenchRelay> {
        self.spawn(extra, tag, Some(self.db.url()))
    }

    /// `outbox-worker run <sink flags> --config CONFIG`: the databases of the file.
    pub fn start_fleet(&self, config: &Path, tag: &str) -> Result<BenchRelay> {
        let extra = ["--config".to_string(), config.display().to_string()];
        self.spawn(&extra, tag, None)
    }

    fn spawn(&self, extra: &[String], tag: &str, url: Option<String>) -> Result<BenchRelay> {
        // Its /metrics tell where an event's time went (the latency section).
        let mut cmd = Command::new(self.relay_bin);
        cmd.arg("run")
            .args(&self.sink.args)
            .args(["--metrics-addr", "127.0.0.1:0"])
            .args(extra);
        for (k, _) in std::env::vars_os() {
            if k.to_string_lossy().starts_with("OUTBOX_") {
                cmd.env_remove(k);
            }
        }
        if let Some(url) = url {
            cmd.env("OUTBOX_DATABASE_URL", url);
        }
        let relay =
            Relay::start(cmd).map_err(|e| anyhow!("starting {}: {e}", self.relay_bin.display()))?;
        let mut r = BenchRelay {
            relay,
            log: self.workdir.join(format!("relay-{tag}.log")),
        };
        if let Some(st) = r.relay.wait_exit(Duration::from_millis(200)) {
            bail!("the relay exited at start ({st}); {}", r.log_tail());
        }
        Ok(r)
    }
}

/// A relay started by the bench: stopped with SIGTERM (graceful) by `stop`, killed on drop, its
/// log kept in the workdir either way.
pub struct BenchRelay {
    relay: Relay,
    log: PathBuf,
}

impl BenchRelay {
    pub fn pid(&self) -> i32 {
        self.relay.pid() as i32
    }

    /// The relay process's peak resident memory so far (VmHWM), in KiB; None once it is gone.
    pub fn peak_rss_kib(&self) -> Option<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).ok()?;
        let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
        line.split_whitespace().nth(1)?.parse().ok()
    }

    /// Its `/metrics` page (Prometheus text), or None when it did not answer.
    pub fn metrics(&self) -> Option<String> {
        self.relay.http_get("/metrics").map(|(_, body)| body)
    }

    pub fn is_running(&mut self) -> bool {
        self.relay.is_running()
    }

    /// Whether a log line containing every needle appeared within `timeout`.
    pub fn wait_log(&self, needles: &[&str], timeout: Duration) -> bool {
        self.relay.wait_log(needles, timeout).is_some()
    }

    pub fn log_tail(&self) -> String {
        format!("log {}:\n{}", self.log.display(), self.relay.log_tail(15))
    }

    /// SIGTERM and wait; an error if it had to be killed or exited with a failure.
    pub fn stop(mut self) -> Result<()> {
        let st = self
            .relay
            .terminate(Duration::from_secs(20))
            .map_err(|e| anyhow!("{e}; {}", self.log_tail()))?;
        if !st.success() {
            bail!(
                "the relay exited with {st} after SIGTERM; {}",
                self.log_tail()
            );
        }
        Ok(())
    }
}

impl Drop for BenchRelay {
    fn drop(&mut self) {
        let _ = std::fs::write(&self.log, self.relay.logs());
    }
}
