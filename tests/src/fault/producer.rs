//! The producer sessions: transactions of random size, some rolled back, a few carrying poison
//! events, paced over the profile's produce time.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::profile::{Profile, Rng};
use super::{POISON_TOPIC, TOPICS};
use crate::db::connect;

/// What the producers did.
#[derive(Debug, Default)]
pub(super) struct Produced {
    /// id -> (n, topic index; 2 = poison)
    pub committed: HashMap<i64, (i64, u8)>,
    pub rolled_back: HashSet<i64>,
    pub tx_committed: usize,
    pub tx_rolled_back: usize,
    pub poison_txs_done: usize,
    /// Transactions PostgreSQL aborted as deadlock victims (40P01) and the producer retried: none
    /// expected, since every producer locks its aggregates in key order.
    pub deadlock_retries: usize,
    pub done: usize,
    pub error: Option<String>,
}

/// One producer session: transactions of random size until its share of committed events is done.
pub(super) async fn produce(
    url: String,
    p: Profile,
    me: usize,
    target: usize,
    poison_txs: usize,
    shared: Arc<Mutex<Produced>>,
) {
    let client = connect(&url).await;
    let mut rng = Rng::new(p.seed ^ (0xA5A5_0000 + me as u64));
    let start = Instant::now();
    let mut committed = 0usize;
    let mut k: i64 = 0;
    // Poison transactions are spread evenly over the producer's share.
    let poison_every = if poison_txs > 0 {
        target / (poison_txs + 1)
    } else {
        usize::MAX
    };
    let mut poison_done = 0usize;
    while committed < target {
        let size = (1 + rng.below(p.tx_max as u64) as usize).min(target - committed);
        let rollback = rng.below(100) < p.rollback_pct as u64;
        let poison =
            !rollback && poison_done < poison_txs && committed >= poison_every * (poison_done + 1);
        let mut topics: Vec<String> = Vec::with_capacity(size);
        let mut ns: Vec<i64> = Vec::with_capacity(size);
        for j in 0..size {
            let t = if poison && j < p.poison_per_tx {
                POISON_TOPIC
            } else {
                TOPICS[rng.below(TOPICS.len() as u64) as usize]
            };
            topics.push(t.to_string());
            ns.push(k * p.producers as i64 + me as i64);
            k += 1;
        }
        let res = loop {
            let res: Result<Vec<(i64, i64)>, tokio_postgres::Error> = async {
            client.batch_execute("BEGIN").await?;
            // The keys' aggregates first, in key order (see audit::INSTALL), then the events.
            client
                .execute(
                    "SELECT 1 FROM public.fault_aggregate \
                      WHERE k IN (SELECT 'k-' || (n % 97) FROM unnest($1::bigint[]) n) ORDER BY k FOR UPDATE",
                    &[&ns],
                )
                .await?;
            let rows = client
                .query(
                    "SELECT u.n, outbox_enqueue(u.t, jsonb_build_object('n', u.n), u.k, 'Fault') \
                     FROM (SELECT t, n, 'k-' || (n % 97) AS k FROM unnest($1::text[], $2::bigint[]) AS v(t, n) \
                           ORDER BY n OFFSET 0) AS u",
                    &[&topics, &ns],
                )
                .await?;
            if rng.below(20) == 0 {
                // Now and then a transaction stays open while others commit.
                tokio::time::sleep(Duration::from_millis(rng.below(50))).await;
            }
            client
                .batch_execute(if rollback { "ROLLBACK" } else { "COMMIT" })
                .await?;
            Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
            }
            .await;
            match res {
                Err(e)
                    if e.code()
                        == Some(&tokio_postgres::error::SqlState::T_R_DEADLOCK_DETECTED) =>
                {
                    let _ = client.batch_execute("ROLLBACK").await;
                    shared.lock().expect("produced").deadlock_retries += 1;
                }
                other => break other,
            }
        };
        let rows = match res {
            Ok(r) => r,
            Err(e) => {
                let mut s = shared.lock().expect("produced");
                s.error = Some(format!("producer {me}: {e}"));
                s.done += 1;
                return;
            }
        };
        {
            let mut s = shared.lock().expect("produced");
            if rollback {
                s.tx_rolled_back += 1;
                s.rolled_back.extend(rows.iter().map(|r| r.1));
            } else {
                s.tx_committed += 1;
                if poison {
                    s.poison_txs_done += 1;
                }
                // Rows come back in lock order, not in the order of `ns`.
                let topic_of: HashMap<i64, &String> = ns.iter().copied().zip(&topics).collect();
                for (n, id) in &rows {
                    let topic = TOPICS.iter().position(|t| *t == *topic_of[n]).unwrap_or(2) as u8;
                    s.committed.insert(*id, (*n, topic));
                }
            }
        }
        if !rollback {
            committed += size;
            if poison {
                poison_done += 1;
            }
        }
        if !p.produce_over.is_zero() {
            let due = p.produce_over.mul_f64(committed as f64 / target as f64);
            if let Some(wait) = due.checked_sub(start.elapsed()) {
                tokio::time::sleep(wait).await;
            }
        }
    }
    shared.lock().expect("produced").done += 1;
}
