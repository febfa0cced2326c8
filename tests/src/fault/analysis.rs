//! Reading every topic back and comparing it, and the final rows, with what the producers
//! committed: lost, phantoms, corrupt messages, dead letters, duplicates and their causes.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::fmt::Write as _;
use std::time::Duration;

use rdkafka::message::Headers;
use rdkafka::Message;

use super::producer::Produced;
use super::runner::Runner;
use crate::broker::read_to_end;

/// One message read back.
#[derive(Debug, Clone)]
pub(super) struct Seen {
    topic: u8,
    partition: i64,
    offset: i64,
    id: i64,
    /// The payload's `n`, -1 if it has none.
    n: i64,
}

/// Reads a topic up to its high watermarks, streaming, so a million messages need no more than
/// their compact records.
pub(super) fn read_topic(
    addr: &str,
    topic: &str,
    topic_index: u8,
    out: &mut Vec<Seen>,
) -> Result<(), String> {
    fn text(b: Option<&[u8]>) -> Option<&str> {
        b.and_then(|b| std::str::from_utf8(b).ok())
    }
    read_to_end(addr, topic, Duration::from_secs(10), |m| {
        let id = m
            .headers()
            .and_then(|hs| hs.iter().find(|h| h.key == outbox_worker::HEADER_OUTBOX_ID))
            .and_then(|h| text(h.value))
            .and_then(|s| s.parse().ok())
            .unwrap_or(i64::MIN);
        let n = text(m.payload())
            .and_then(|s| serde_json::from_str::<serde_json::Value>(s).ok())
            .and_then(|p| p["n"].as_i64())
            .unwrap_or(-1);
        out.push(Seen {
            topic: topic_index,
            partition: i64::from(m.partition()),
            offset: m.offset(),
            id,
            n,
        });
    })
}

/// Per-key order (docs/reference.md, "Per-key order"): the first arrival of each event, per
/// (topic, key) in partition order, must come in id (= commit) order. The producers' key is
/// `k-` || n % 97; the poison topic is unordered. Returns the first arrivals that came after a
/// later event of their key, by topic index.
fn out_of_order(produced: &Produced, seen: &[Seen]) -> Vec<u8> {
    let mut by_position: Vec<&Seen> = seen.iter().collect();
    by_position.sort_by_key(|s| (s.topic, s.partition, s.offset));
    let mut first: HashSet<i64> = HashSet::new();
    let mut last_of_key: HashMap<(u8, i64), i64> = HashMap::new();
    let mut late = Vec::new();
    for s in by_position {
        let ordered = produced.committed.get(&s.id).is_some_and(|v| v.1 != 2);
        if !ordered || !first.insert(s.id) {
            continue;
        }
        let last = last_of_key.entry((s.topic, s.n % 97)).or_insert(i64::MIN);
        if s.id < *last {
            late.push(s.topic);
        } else {
            *last = s.id;
        }
    }
    late
}

pub(super) fn analyse(r: &mut Runner<'_>, produced: &Produced, seen: Vec<Seen>) {
    let rep = &mut r.report;
    rep.committed = produced.committed.len();
    rep.committed_tx = produced.tx_committed;
    rep.rolled_back = produced.rolled_back.len();
    rep.rolled_back_tx = produced.tx_rolled_back;
    rep.poison = produced.committed.values().filter(|v| v.1 == 2).count();

    // Distinct physical messages (a re-read of the same offset is not a duplicate).
    let mut physical: HashSet<(u8, i64, i64)> = HashSet::new();
    let mut copies: HashMap<i64, usize> = HashMap::new();
    for s in &seen {
        if !physical.insert((s.topic, s.partition, s.offset)) {
            continue;
        }
        rep.messages_read += 1;
        match produced.committed.get(&s.id) {
            Some(&(n, topic)) => {
                if n != s.n || topic != s.topic {
                    rep.corrupt += 1;
                }
                *copies.entry(s.id).or_default() += 1;
            }
            None if produced.rolled_back.contains(&s.id) => rep.phantoms += 1,
            None => rep.unknown_ids += 1,
        }
    }
    rep.delivered_distinct = copies.len();
    let late = out_of_order(produced, &seen);
    rep.out_of_order = late.len();
    rep.out_of_order_rejected = late
        .iter()
        .filter(|t| **t == super::reject::TOPIC_INDEX)
        .count();
    rep.deadlock_retries = produced.deadlock_retries;
    let mut lost: Vec<i64> = produced
        .committed
        .iter()
        .filter(|(id, v)| v.1 != 2 && !copies.contains_key(id))
        .map(|(id, _)| *id)
        .collect();
    lost.sort();
    rep.lost_count = lost.len();
    rep.lost = lost.iter().take(20).copied().collect();
    let lost_all = lost;

    // Final rows.
    let rows =
        r.rt.block_on(r.admin.query(
            "SELECT id, status::text, retry_count, coalesce(last_error, '') FROM outbox_event",
            &[],
        ))
        .expect("final rows");
    let mut fail: BTreeSet<i64> = BTreeSet::new();
    let mut unfinished: HashSet<i64> = HashSet::new();
    let mut last_error: HashMap<i64, (i32, String)> = HashMap::new();
    for row in &rows {
        let id: i64 = row.get(0);
        let status: String = row.get(1);
        let retry: i32 = row.get(2);
        let err: String = row.get(3);
        let poison = produced.committed.get(&id).is_some_and(|v| v.1 == 2);
        match status.as_str() {
            "WAIT" => {
                rep.left_wait += 1;
                unfinished.insert(id);
            }
            "SENDING" => {
                rep.left_sending += 1;
                unfinished.insert(id);
            }
            "SUCCESS" => rep.success_rows += 1,
            _ => {
                fail.insert(id);
                if !poison {
                    let e: String = err.chars().take(120).collect();
                    *rep.unexpected_dead_letter_errors.entry(e).or_default() += 1;
                }
            }
        }
        if retry > 0 {
            rep.rows_retried += 1;
        }
        if !poison {
            rep.max_retry_count_non_poison = rep.max_retry_count_non_poison.max(retry);
        }
        last_error.insert(id, (retry, err));
    }
    let poison_ids: BTreeSet<i64> = produced
        .committed
        .iter()
        .filter(|v| v.1 .1 == 2)
        .map(|v| *v.0)
        .collect();
    rep.dead_letters = fail.len();
    for id in &lost_all {
        if fail.contains(id) {
            rep.lost_dead_lettered += 1;
        } else if unfinished.contains(id) {
            rep.lost_unfinished += 1;
        } else {
            rep.lost_silently.push(*id);
        }
    }
    rep.dead_letters_not_poison = fail.difference(&poison_ids).copied().collect();
    rep.poison_not_dead = poison_ids.difference(&fail).copied().collect();

    // Duplicates and their causes.
    for (id, n) in &copies {
        if *n < 2 {
            continue;
        }
        rep.duplicated_events += 1;
        rep.duplicates += n - 1;
        let (retry, err) = last_error.get(id).cloned().unwrap_or((0, String::new()));
        // Reclaimed: its lease expired, or its owner's heartbeat ran out.
        let reclaimed = err
            .strip_prefix("lease expired: claimed by ")
            .map(|rest| ("lease expired", rest))
            .or_else(|| {
                err.strip_prefix("owner gone: claimed by ")
                    .map(|rest| ("heartbeat ran out", rest))
            });
        let cause = if let Some((how, rest)) = reclaimed {
            let owner = rest.split_whitespace().next().unwrap_or("");
            if r.zombie_owner.as_deref() == Some(owner) {
                format!("{how} while its worker was the SIGSTOPped zombie")
            } else if r.killed_owners.contains(owner) {
                format!("{how} after its worker was SIGKILLed (or exited)")
            } else {
                format!(
                    "{how} while its worker lived (a lost ack, or a publish slower than the lease)"
                )
            }
        } else if !err.is_empty() {
            "publish reported failed (timeout during the outage/restart) after the broker had stored it".to_string()
        } else if retry == 0 {
            "no failure recorded on the row".to_string()
        } else {
            "other".to_string()
        };
        *rep.duplicates_by_cause.entry(cause).or_default() += n - 1;
    }
    rep.duplicate_budget = duplicate_budget(r.p, rep);
    let mut buf = String::new();
    let _ = write!(buf, "{} workers killed or exited", r.killed_owners.len());
    r.report.notes.push(buf);
}

/// The duplicates the run's faults explain, item by item: a fault may get an event published
/// again only if it was in a round in flight, and a relay's rounds hold at most `concurrency ×
/// batch_size` events, each possibly on the broker already.
/// - A SIGKILL, or a relay's own exit: its rounds are reclaimed once its heartbeat runs out and
///   published again by another relay.
/// - The zombie: the same for the frozen relay.
/// - A broker outage or restart: every relay's rounds in flight may time out after the broker
///   stored them; they are released and published again.
/// - A `pg_terminate_backend` round: every relay loses its heartbeat session too, and may miss
///   its heartbeat timeout (a quarter of the short lease here) while it reconnects: its rounds
///   are then reclaimed from under it and published again.
/// - A rejected ordered head: each later event of its key may have been written in the head's
///   round (before the broker's refusal was known) and is published again after the head.
///
/// Anything beyond the sum is a relay publishing what no fault explains (e.g. everything twice).
fn duplicate_budget(p: &super::Profile, rep: &super::Report) -> Vec<(String, usize)> {
    let rounds = p.concurrency * p.batch_size;
    let every_relay = p.workers * rounds;
    let killed = rep.kills + rep.unexpected_exits.len();
    let zombies = usize::from(rep.zombie.is_some());
    let broker = rep.outages + rep.restarts;
    let terminations = rep.terminated_connections.len();
    let rejected = rep.rejections * (super::reject::KEYS * (super::reject::PER_KEY - 1)) as usize;
    vec![
        (
            format!("{killed} relays killed or exited × {rounds} in flight"),
            killed * rounds,
        ),
        (
            format!("{zombies} zombie × {rounds} in flight"),
            zombies * rounds,
        ),
        (
            format!("{broker} broker outages/restarts × {every_relay} in flight (all relays)"),
            broker * every_relay,
        ),
        (
            format!("{terminations} connection kills × {every_relay} in flight (all relays)"),
            terminations * every_relay,
        ),
        (
            format!("{rejected} later events of rejected heads"),
            rejected,
        ),
    ]
}
