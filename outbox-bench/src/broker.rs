//! The local Kafka-protocol broker (tansu), the relay binary, and a Kafka consumer that timestamps
//! arrivals: 2. drain to the broker and 3. commit-to-broker latency.

use anyhow::{bail, Context, Result};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub const PARTITIONS: i32 = 4;

fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

fn log_tail(path: &Path) -> String {
    let s = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

fn signal(pid: i32, sig: i32) {
    // SAFETY: kill(2) on a child we started.
    unsafe {
        libc::kill(pid, sig);
    }
}

/// Waits up to `timeout` for the child to exit; true if it did.
fn wait_exit(child: &mut Child, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

/// A tansu broker with in-memory storage on a free loopback port, stopped on drop.
pub struct Broker {
    child: Child,
    pub port: u16,
    bin: PathBuf,
    log: PathBuf,
}

impl Broker {
    pub fn start(bin: &Path, workdir: &Path) -> Result<Broker> {
        let port = free_port()?;
        let url = format!("tcp://127.0.0.1:{port}");
        let log = workdir.join("tansu.log");
        let out = File::create(&log)?;
        let child = Command::new(bin)
            .args([
                "broker",
                "--listener-url",
                &url,
                "--advertised-listener-url",
                &url,
                "--storage-engine",
                "memory://tansu/",
            ])
            .env_remove("CLUSTER_ID")
            .env_remove("STORAGE_ENGINE")
            .stdout(out.try_clone()?)
            .stderr(out)
            .stdin(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let mut b = Broker {
            child,
            port,
            bin: bin.to_path_buf(),
            log,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                break;
            }
            if let Ok(Some(st)) = b.child.try_wait() {
                bail!("tansu exited ({st}):\n{}", log_tail(&b.log));
            }
            if Instant::now() > deadline {
                bail!(
                    "tansu did not listen on {port} within 30 s:\n{}",
                    log_tail(&b.log)
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(b)
    }

    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    pub fn create_topic(&self, name: &str) -> Result<()> {
        let out = Command::new(&self.bin)
            .args([
                "topic",
                "create",
                name,
                "--broker",
                &format!("tcp://127.0.0.1:{}", self.port),
                "--partitions",
                &PARTITIONS.to_string(),
            ])
            .output()
            .context("tansu topic create")?;
        if !out.status.success() {
            bail!(
                "tansu topic create {name} failed: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        signal(self.pid(), libc::SIGTERM);
        if !wait_exit(&mut self.child, Duration::from_secs(5)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A running `outbox-worker run`, stopped with SIGTERM (graceful) by `stop`, killed on drop.
pub struct Worker {
    child: Child,
    log: PathBuf,
}

impl Worker {
    pub fn start(
        bin: &Path,
        db_url: &str,
        brokers: &str,
        extra: &[String],
        log: &Path,
    ) -> Result<Worker> {
        let out = File::create(log)?;
        let mut cmd = Command::new(bin);
        cmd.arg("run")
            .arg("--brokers")
            .arg(brokers)
            .args(extra)
            .stdout(out.try_clone()?)
            .stderr(out)
            .stdin(Stdio::null());
        // "Default settings" means defaults: no OUTBOX_* variable from the caller leaks in.
        for (k, _) in std::env::vars_os() {
            if k.to_string_lossy().starts_with("OUTBOX_") {
                cmd.env_remove(k);
            }
        }
        // The URL goes through the environment so a password never shows in `ps`.
        cmd.env("OUTBOX_DATABASE_URL", db_url);
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let mut w = Worker {
            child,
            log: log.to_path_buf(),
        };
        std::thread::sleep(Duration::from_millis(200));
        if let Ok(Some(st)) = w.child.try_wait() {
            bail!(
                "outbox-worker exited at start ({st}), log {}:\n{}",
                w.log.display(),
                log_tail(&w.log)
            );
        }
        Ok(w)
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    pub fn log_tail(&self) -> String {
        format!("log {}:\n{}", self.log.display(), log_tail(&self.log))
    }

    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// SIGTERM and wait; returns the exit status or an error if it had to be killed.
    pub fn stop(mut self) -> Result<()> {
        signal(self.pid(), libc::SIGTERM);
        if !wait_exit(&mut self.child, Duration::from_secs(20)) {
            let _ = self.child.kill();
            bail!(
                "outbox-worker did not exit within 20 s of SIGTERM; {}",
                self.log_tail()
            );
        }
        let st = self.child.wait()?;
        if !st.success() {
            bail!(
                "outbox-worker exited with {st} after SIGTERM; {}",
                self.log_tail()
            );
        }
        Ok(())
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// (sequence number from the payload, when the consumer got it)
type Arrival = (i64, Instant);

/// Reads a topic from offset 0 with assigned partitions (no group join) and records when each
/// message carrying a `"seq"` number in its JSON payload arrived.
pub struct Arrivals {
    stop: Arc<AtomicBool>,
    pub seen: Arc<AtomicU64>,
    pub warm: Arc<AtomicBool>,
    handle: Option<std::thread::JoinHandle<Result<Vec<Arrival>>>>,
}

impl Arrivals {
    pub fn start(brokers: &str, topic: &str) -> Result<Arrivals> {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .set("group.id", "outbox-bench")
            .set("enable.auto.commit", "false")
            .set("fetch.wait.max.ms", "1")
            .set("fetch.error.backoff.ms", "10")
            .create()
            .context("creating the Kafka consumer")?;
        let mut tpl = TopicPartitionList::new();
        for p in 0..PARTITIONS {
            tpl.add_partition_offset(topic, p, Offset::Beginning)?;
        }
        consumer.assign(&tpl)?;
        let stop = Arc::new(AtomicBool::new(false));
        let seen = Arc::new(AtomicU64::new(0));
        let warm = Arc::new(AtomicBool::new(false));
        let (s, n, w) = (stop.clone(), seen.clone(), warm.clone());
        let handle = std::thread::spawn(move || -> Result<Vec<Arrival>> {
            let mut out = Vec::new();
            while !s.load(Ordering::Relaxed) {
                match consumer.poll(Duration::from_millis(50)) {
                    Some(Ok(m)) => {
                        let at = Instant::now();
                        let seq = m
                            .payload()
                            .and_then(|p| serde_json::from_slice::<serde_json::Value>(p).ok())
                            .and_then(|v| v.get("seq").and_then(|x| x.as_i64()));
                        match seq {
                            Some(q) if q < 0 => w.store(true, Ordering::Relaxed),
                            Some(q) => {
                                out.push((q, at));
                                n.fetch_add(1, Ordering::Relaxed);
                            }
                            None => {}
                        }
                    }
                    Some(Err(e)) => progress!("  consumer: {e}"),
                    None => {}
                }
            }
            Ok(out)
        });
        Ok(Arrivals {
            stop,
            seen,
            warm,
            handle: Some(handle),
        })
    }

    pub fn finish(mut self) -> Result<Vec<Arrival>> {
        self.stop.store(true, Ordering::Relaxed);
        match self.handle.take() {
            Some(h) => h
                .join()
                .map_err(|_| anyhow::anyhow!("consumer thread panicked"))?,
            None => Ok(Vec::new()),
        }
    }
}

impl Drop for Arrivals {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}
