//! A Kafka consumer that timestamps arrivals (the latency section); the broker itself is
//! the tests' (`outbox_tests::broker`).

use anyhow::{Context, Result};
use outbox_tests::broker::PARTITIONS;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{ClientConfig, Message, Offset, Timestamp, TopicPartitionList};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long the consumer lets the broker hold a fetch for more data: as short as possible, so the
/// arrival time is the message's, not the fetch's.
pub const FETCH_WAIT_MAX_MS: u32 = 1;

/// (sequence number from the payload, when the consumer got it, the broker's append time in Unix
/// milliseconds when the topic stamps it: `message.timestamp.type=LogAppendTime`)
type Arrival = (i64, Instant, Option<i64>);

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
            .set("fetch.wait.max.ms", FETCH_WAIT_MAX_MS.to_string())
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
                                let appended = match m.timestamp() {
                                    Timestamp::LogAppendTime(ms) => Some(ms),
                                    _ => None,
                                };
                                out.push((q, at, appended));
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
