//! The local Apache Kafka broker (single node, KRaft, started like `scripts/broker start` by the
//! tests' `kafka.rs`), the relay binary, and a Kafka consumer that timestamps arrivals: 2. drain to
//! the broker and 3. commit-to-broker latency.

use anyhow::{anyhow, bail, Context, Result};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The tests' Kafka start-up, shared source (the bench uses less of it than the tests do).
#[path = "../../tests/src/kafka.rs"]
#[allow(dead_code)]
pub mod kafka;

pub const PARTITIONS: i32 = 4;

fn log_tail(path: &Path) -> String {
    kafka::log_tail(path, 15)
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

/// A Kafka broker on a free loopback port with its data in `workdir/kafka`, stopped cleanly
/// (SIGTERM) on drop.
pub struct Broker {
    kafka: kafka::Kafka,
    pub port: u16,
}

impl Broker {
    pub fn start(workdir: &Path) -> Result<Broker> {
        let port = kafka::free_port()?;
        let kafka = kafka::Kafka::start(&workdir.join("kafka"), port)
            .map_err(|e| anyhow!("starting Kafka: {e}"))?;
        Ok(Broker { kafka, port })
    }

    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub fn log(&self) -> PathBuf {
        self.kafka.log()
    }

    /// The broker JVM's pid (for its CPU time).
    pub fn pid(&self) -> i32 {
        self.kafka.pid().map_or(0, |p| p as i32)
    }

    pub fn create_topic(&self, name: &str) -> Result<()> {
        kafka::create_topics(&self.addr(), &[name], PARTITIONS).map_err(|e| {
            anyhow!(
                "{e}\nbroker log {}:\n{}",
                self.log().display(),
                log_tail(&self.log())
            )
        })
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        self.kafka.stop();
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
