//! Ordered events the broker rejects: the runner commits, for a few keys of the topic
//! [`LIMITED_TOPIC`] (created with `max.message.bytes` = [`REJECTING_LIMIT`]), a head too large
//! for the topic but within `outbox.max_payload_bytes`, then smaller events of the same key. The
//! broker refuses each head (MessageSizeTooLarge, permanent): the relay nacks it, an attempt
//! counted, and retries it after its backoff while its key's later events wait. Once every head
//! was refused twice the runner raises the topic's limit, as an operator would, and the heads go
//! through on their next retry. The analysis then holds them to the run's invariants: nothing
//! lost or dead-lettered, and per key first arrivals in commit order, so a later event of the key
//! that reached the topic before its rejected head (written in the same round) is a violation.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::producer::Produced;
use super::runner::Runner;
use crate::kafka;

/// The topic whose limit rejects the heads; ordered like the producers' topics.
pub const LIMITED_TOPIC: &str = "limited";
/// Its `max.message.bytes` while it rejects: above a small event with its headers (about 300
/// bytes), below a head.
pub const REJECTING_LIMIT: &str = "1024";
/// A head's pad: above the relays' `batch.size` ([`RELAY_BATCH_BYTES`]), so librdkafka sends it
/// in a record batch of its own and its key's later events in the next one. In one batch with
/// them the broker would refuse them all, and a later event could never get ahead of its head.
pub(super) const HEAD_PAD: i32 = 20_000;
/// The relays' librdkafka `batch.size` in fault runs.
pub const RELAY_BATCH_BYTES: &str = "16384";
/// Kafka's default, set once the heads were refused twice.
const FIXED_LIMIT: &str = "1048588";
/// Keys with a rejected head, and events per key (the head included).
pub(super) const KEYS: i64 = 3;
pub(super) const PER_KEY: i64 = 3;
/// The index `Produced.committed` and the analysis give the topic.
pub(super) const TOPIC_INDEX: u8 = 3;

/// Event `j` of rejected key `i`: negative, so it meets no producer's `n`; `n % 97` (the
/// producers' key rule, `k-` || n % 97) is `-(i + 1)` for every `j`.
fn n_of(i: i64, j: i64) -> i64 {
    -(i + 1) - 97 * j
}

impl Runner<'_> {
    /// Commits the keys' events (heads first, in one transaction), waits until every head was
    /// refused twice (60 s at most), then lifts the topic's limit.
    pub(super) fn reject(&mut self, produced: &Mutex<Produced>) {
        let heads = self.enqueue_rejected(produced);
        let deadline = Instant::now() + Duration::from_secs(60);
        let refused = loop {
            let refused = self.query_i64(
                "SELECT count(*) FROM outbox_event WHERE id = ANY($1) AND retry_count >= 2",
                &[&heads],
            );
            if refused == KEYS || Instant::now() > deadline {
                break refused;
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        let addr = format!("127.0.0.1:{}", self.port);
        kafka::alter_topic_config(&addr, LIMITED_TOPIC, &[("max.message.bytes", FIXED_LIMIT)])
            .unwrap_or_else(|e| panic!("{e}"));
        self.report.rejections += 1;
        self.log(format!(
            "{refused} of {KEYS} oversized heads of ordered keys refused twice by the broker \
             ({LIMITED_TOPIC} max.message.bytes {REJECTING_LIMIT}); limit raised to {FIXED_LIMIT}"
        ));
    }

    /// The heads' ids.
    fn enqueue_rejected(&self, produced: &Mutex<Produced>) -> Vec<i64> {
        let mut heads = Vec::new();
        let mut rows = Vec::new();
        self.rt
            .block_on(async {
                self.admin.batch_execute("BEGIN").await?;
                for j in 0..PER_KEY {
                    for i in 0..KEYS {
                        let n = n_of(i, j);
                        let pad = if j == 0 { HEAD_PAD } else { 10 };
                        let id: i64 = self
                            .admin
                            .query_one(
                                "SELECT outbox_enqueue($1::text, \
                                 jsonb_build_object('n', $2::bigint, 'pad', repeat('x', $3::int)), \
                                 'k-' || ($2::bigint % 97), 'Fault')",
                                &[&LIMITED_TOPIC, &n, &pad],
                            )
                            .await?
                            .get(0);
                        rows.push((id, n));
                        if j == 0 {
                            heads.push(id);
                        }
                    }
                }
                self.admin.batch_execute("COMMIT").await
            })
            .unwrap_or_else(|e| panic!("enqueueing the rejected events: {e}"));
        let mut p = produced.lock().expect("produced");
        for (id, n) in rows {
            p.committed.insert(id, (n, TOPIC_INDEX));
        }
        heads
    }
}
