//! The relay (the `outbox-worker` binary) run as a real process: logs captured, metrics
//! scraped, signals sent, killed on drop. Used by the tests and by outbox-bench.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The relay binary, found as `scripts/env.sh` finds it: `OUTBOX_RELAY_BIN`, else
/// `$CARGO_TARGET_DIR/$OUTBOX_PROFILE/outbox-worker` (the workspace's `target/`, `release`
/// when unset).
pub fn find_relay_bin() -> Result<PathBuf, String> {
    if let Ok(p) = std::env::var("OUTBOX_RELAY_BIN") {
        return Ok(p.into());
    }
    let target = std::env::var("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"));
    let profile = relay_profile();
    let p = target.join(&profile).join("outbox-worker");
    if !p.exists() {
        return Err(format!(
            "{} not found: build it with cargo build --profile {profile} -p outbox-worker (or set OUTBOX_RELAY_BIN)",
            p.display()
        ));
    }
    Ok(p)
}

/// The cargo profile of the relay binary: `OUTBOX_PROFILE`, `release` when unset.
fn relay_profile() -> String {
    std::env::var("OUTBOX_PROFILE").unwrap_or_else(|_| "release".into())
}

/// Which relay [`find_relay_bin`] picks, for reports: "<profile> build", or the binary's path when
/// `OUTBOX_RELAY_BIN` names it.
pub fn relay_build() -> String {
    match std::env::var("OUTBOX_RELAY_BIN") {
        Ok(p) => format!("binary {p}"),
        Err(_) => format!("{} build", relay_profile()),
    }
}

/// [`find_relay_bin`], panicking (failing the test) when the binary is missing.
pub fn relay_bin() -> PathBuf {
    find_relay_bin().unwrap_or_else(|e| panic!("{e}"))
}

/// Runs an `outbox-worker` subcommand to completion.
pub fn run_cmd(args: &[&str]) -> Output {
    Command::new(relay_bin())
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run outbox-worker")
}

pub struct Relay {
    child: Child,
    logs: Arc<Mutex<Vec<String>>>,
    readers: Vec<std::thread::JoinHandle<()>>,
}

impl Relay {
    /// `outbox-worker run --database-url URL --brokers BROKERS --metrics-addr 127.0.0.1:0` plus
    /// `extra`, logging at debug level.
    pub fn spawn(db_url: &str, brokers: &str, extra: &[&str]) -> Relay {
        let mut args = vec!["run", "--database-url", db_url, "--brokers", brokers];
        args.extend_from_slice(extra);
        Relay::spawn_args(&args)
    }

    /// `outbox-worker --log-level debug ARGS --metrics-addr 127.0.0.1:0` (ARGS start with the
    /// subcommand, `run`): the relay binds a free port itself and logs it, so no other process
    /// can take the port between its choice and the bind.
    pub fn spawn_args(args: &[&str]) -> Relay {
        let mut cmd = Command::new(relay_bin());
        cmd.args(["--log-level", "debug"])
            .args(args)
            .args(["--metrics-addr", "127.0.0.1:0"]);
        Relay::start(cmd).expect("spawn outbox-worker")
    }

    /// The port of the metrics server, from the relay's "metrics at http://…" line; None
    /// before it is logged.
    pub fn metrics_port(&self) -> Option<u16> {
        let logs = self.logs.lock().expect("logs");
        let line = logs.iter().find(|l| l.contains("metrics at http://"))?;
        let rest = &line[line.find("metrics at http://")? + "metrics at http://".len()..];
        let addr = &rest[..rest.find("/metrics")?];
        addr.rsplit(':').next()?.parse().ok()
    }

    /// Starts `cmd` (a relay command line) with its output captured line by line (echoed to
    /// stderr with `OUTBOX_TEST_ECHO` set).
    pub fn start(mut cmd: Command) -> std::io::Result<Relay> {
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        let logs = Arc::new(Mutex::new(Vec::new()));
        let pid = child.id();
        let out: Box<dyn Read + Send> = Box::new(child.stdout.take().expect("stdout"));
        let err: Box<dyn Read + Send> = Box::new(child.stderr.take().expect("stderr"));
        let mut readers = Vec::new();
        for stream in [out, err] {
            let logs = logs.clone();
            readers.push(std::thread::spawn(move || {
                for line in BufReader::new(stream).lines() {
                    let Ok(line) = line else { return };
                    if std::env::var_os("OUTBOX_TEST_ECHO").is_some() {
                        eprintln!("[relay {pid}] {line}");
                    }
                    logs.lock().expect("logs").push(line);
                }
            }));
        }
        Ok(Relay {
            child,
            logs,
            readers,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Everything the relay logged so far.
    pub fn logs(&self) -> String {
        self.logs.lock().expect("logs").join("\n")
    }

    /// The last `n` lines the relay logged.
    pub fn log_tail(&self, n: usize) -> String {
        let logs = self.logs.lock().expect("logs");
        logs[logs.len().saturating_sub(n)..].join("\n")
    }

    /// True while the process has not exited.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Waits until a log line contains every one of `needles`; returns that line.
    pub fn wait_log(&self, needles: &[&str], timeout: Duration) -> Option<String> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(l) = self
                .logs
                .lock()
                .expect("logs")
                .iter()
                .find(|l| needles.iter().all(|n| l.contains(n)))
            {
                return Some(l.clone());
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits until the relay's wake-up session is ready (it then claims and waits for commits);
    /// panics with its logs after `timeout`.
    pub fn wait_ready(&self, timeout: Duration) {
        assert!(
            self.wait_log(&[outbox_worker::WAKEUP_READY], timeout)
                .is_some(),
            "the relay was not ready within {timeout:?}: {}",
            self.logs()
        );
    }

    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe {
            libc::kill(self.child.id() as i32, sig);
        }
    }

    /// Waits for the process to exit.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(st) = self.child.try_wait().expect("try_wait") {
                // Its output is complete once the pipes are drained.
                for r in self.readers.drain(..) {
                    let _ = r.join();
                }
                return Some(st);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The graceful stop a service manager does: SIGTERM, then the exit status within `timeout`
    /// (SIGKILL and an error if the relay is still running by then).
    pub fn terminate(&mut self, timeout: Duration) -> Result<ExitStatus, String> {
        self.signal(libc::SIGTERM);
        match self.wait_exit(timeout) {
            Some(st) => Ok(st),
            None => {
                let _ = self.child.kill();
                let _ = self.child.wait();
                Err(format!(
                    "the relay did not exit within {} s of SIGTERM",
                    timeout.as_secs()
                ))
            }
        }
    }

    /// GET a path of the metrics server; (status line, body).
    pub fn http_get(&self, path: &str) -> Option<(String, String)> {
        let mut s = TcpStream::connect(("127.0.0.1", self.metrics_port()?)).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
        )
        .ok()?;
        let mut resp = String::new();
        s.read_to_string(&mut resp).ok()?;
        let (head, body) = resp.split_once("\r\n\r\n")?;
        Some((head.lines().next()?.to_string(), body.to_string()))
    }

    /// A metric's value (e.g. `outbox_claim_batch_size_count`), summed over its labelled series
    /// (`outbox_failed_total` counts every topic and class); None when the endpoint or the
    /// metric is missing (a labelled counter appears with its first series).
    pub fn metric(&self, name: &str) -> Option<f64> {
        self.metric_where(name, "")
    }

    /// The sum of the series of `name` whose labels contain `labels` (e.g. `class="transient"`).
    pub fn metric_where(&self, name: &str, labels: &str) -> Option<f64> {
        let (_, body) = self.http_get("/metrics")?;
        let values: Vec<f64> = body
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| {
                let (series, v) = l.rsplit_once(' ')?;
                let (n, labelset) = series.split_once('{').unwrap_or((series, ""));
                (n == name && labelset.contains(labels))
                    .then(|| v.trim().parse().ok())
                    .flatten()
            })
            .collect();
        (!values.is_empty()).then(|| values.iter().sum())
    }

    /// Waits until `metric(name)` satisfies `pred`; returns the last value seen.
    pub fn wait_metric(
        &self,
        name: &str,
        timeout: Duration,
        pred: impl Fn(f64) -> bool,
    ) -> Option<f64> {
        let deadline = Instant::now() + timeout;
        let mut last = None;
        loop {
            last = self.metric(name).or(last);
            if last.is_some_and(&pred) {
                return last;
            }
            if Instant::now() >= deadline {
                return last;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One `[databases.NAME]` table of a relay config file: its connection string and extra TOML
/// lines (`concurrency = 2`, `lease = "20s"`).
pub struct ConfigDb<'a> {
    pub name: &'a str,
    pub url: String,
    pub extra: &'a [&'a str],
}

/// Writes a relay config file (`run --config`) listing `dbs` to `path`.
pub fn write_config(path: &std::path::Path, dbs: &[ConfigDb<'_>]) {
    let mut text = String::new();
    for db in dbs {
        text += &format!("[databases.{}]\nurl = {:?}\n", db.name, db.url);
        for line in db.extra {
            text += &format!("{line}\n");
        }
    }
    std::fs::write(path, text).expect("write the relay config");
}
