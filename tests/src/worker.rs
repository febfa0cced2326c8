//! The release `outbox-worker` binary run as a real process: logs captured, metrics scraped,
//! signals sent, killed on drop.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::broker::free_port;

/// `OUTBOX_WORKER_BIN`, else `$CARGO_TARGET_DIR/release/outbox-worker`, else the workspace's
/// `target/release/outbox-worker`.
pub fn worker_bin() -> PathBuf {
    if let Ok(p) = std::env::var("OUTBOX_WORKER_BIN") {
        return p.into();
    }
    let target = std::env::var("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"));
    let p = target.join("release/outbox-worker");
    assert!(
        p.exists(),
        "{} not found: build it with cargo build --release -p outbox-worker (or set OUTBOX_WORKER_BIN)",
        p.display()
    );
    p
}

/// Runs an `outbox-worker` subcommand to completion.
pub fn run_cmd(args: &[&str]) -> Output {
    Command::new(worker_bin())
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run outbox-worker")
}

pub struct Worker {
    child: Child,
    logs: Arc<Mutex<Vec<String>>>,
    readers: Vec<std::thread::JoinHandle<()>>,
    pub metrics_port: u16,
}

impl Worker {
    /// `outbox-worker run --database-url URL --brokers BROKERS --metrics-addr 127.0.0.1:<free>`
    /// plus `extra`, logging at debug level.
    pub fn spawn(db_url: &str, brokers: &str, extra: &[&str]) -> Worker {
        let mut args = vec!["run", "--database-url", db_url, "--brokers", brokers];
        args.extend_from_slice(extra);
        Worker::spawn_args(&args)
    }

    /// `outbox-worker --log-level debug ARGS --metrics-addr 127.0.0.1:<free>` (ARGS start with
    /// the subcommand, `run`).
    pub fn spawn_args(args: &[&str]) -> Worker {
        let metrics_port = free_port();
        let mut child = Command::new(worker_bin())
            .args(["--log-level", "debug"])
            .args(args)
            .arg("--metrics-addr")
            .arg(format!("127.0.0.1:{metrics_port}"))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn outbox-worker");
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
                        eprintln!("[worker {pid}] {line}");
                    }
                    logs.lock().expect("logs").push(line);
                }
            }));
        }
        Worker {
            child,
            logs,
            readers,
            metrics_port,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Everything the worker logged so far.
    pub fn logs(&self) -> String {
        self.logs.lock().expect("logs").join("\n")
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

    /// GET a path of the metrics server; (status line, body).
    pub fn http_get(&self, path: &str) -> Option<(String, String)> {
        let mut s = TcpStream::connect(("127.0.0.1", self.metrics_port)).ok()?;
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

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
