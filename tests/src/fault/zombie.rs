//! The zombie fault: a relay frozen (SIGSTOP) while it holds claims, until the others reclaimed
//! every row it held, then thawed (SIGCONT) so its late acks meet the fence.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use super::report::ZombieResult;
use super::runner::Runner;

impl Runner<'_> {
    pub(super) fn zombie(&mut self) {
        let i = self.rng.below(self.slots.len() as u64) as usize;
        let owner = self.slots[i].owner.clone();
        let mut held: Vec<(i64, i64)> = Vec::new();
        let mut settled_before = None;
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            let n = self.query_i64(
                "SELECT count(*) FROM outbox_event WHERE status = 'SENDING' AND claim_owner = $1",
                &[&owner],
            );
            if n > 0 {
                // What it had settled so far: its stale round is over once it settled the rows
                // it holds now.
                self.scrape(i);
                settled_before = self.slots[i].counters.as_ref().map(|c| c.settled());
                self.slots[i].worker.signal(libc::SIGSTOP);
                // A statement already on the wire (a claim) still runs in its session: wait
                // until none of its sessions is active.
                self.wait_for_no_active_statement(&owner);
                held = self
                    .rt
                    .block_on(self.admin.query(
                        "SELECT id, claim_token FROM outbox_event \
                         WHERE status = 'SENDING' AND claim_owner = $1",
                        &[&owner],
                    ))
                    .expect("zombie rows")
                    .iter()
                    .map(|r| (r.get(0), r.get(1)))
                    .collect();
                if !held.is_empty() {
                    break;
                }
                self.slots[i].worker.signal(libc::SIGCONT);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        if held.is_empty() {
            self.report.notes.push(format!(
                "zombie: {owner} never held rows when checked; skipped"
            ));
            return;
        }
        let stopped = Instant::now();
        self.zombie_owner = Some(owner.clone());
        let tokens: BTreeSet<i64> = held.iter().map(|h| h.1).collect();
        let tokens: Vec<i64> = tokens.into_iter().collect();
        self.log(format!(
            "SIGSTOP {owner} (zombie) holding {} rows under tokens {tokens:?}",
            held.len()
        ));
        let ids: Vec<i64> = held.iter().map(|h| h.0).collect();
        // The runner reclaims the zombie's rows itself, with the relays' lease and the relays'
        // outbox_reclaim, and keeps them out of claims (due in an hour) until the zombie's stale
        // round ended: its late acks then certainly meet open rows it no longer holds, so an ack
        // that got past the fence would turn them SUCCESS and show in the ack audit. Locking the
        // rows first keeps the other relays' reclaim (SKIP LOCKED) off them meanwhile: its scheduled
        // rows, and the batch rows of its claims' stream events (a stream event's lease is its
        // batch's; outbox_event is a view and cannot be locked FOR UPDATE).
        let lease = format!("{} milliseconds", self.p.lease.as_millis());
        self.sql("BEGIN");
        let locked = self.ids_of(
            "WITH scheduled AS (SELECT id FROM outbox_scheduled \
                               WHERE id = ANY($1) AND status = 'SENDING' FOR UPDATE), \
                  batches AS (SELECT pending FROM outbox_stream_batch \
                               WHERE pending && $1 FOR UPDATE) \
             SELECT id FROM scheduled \
             UNION SELECT p FROM batches, unnest(batches.pending) p WHERE p = ANY($1)",
            &ids,
        );
        let claimed_at = self.query_i64(
            "SELECT coalesce(extract(epoch FROM max(claimed_at)) * 1000, 0)::bigint FROM outbox_event WHERE id = ANY($1)",
            &[&locked],
        );
        let now_ms = self.query_i64(
            "SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint",
            &[],
        );
        let expiry = Duration::from_millis((claimed_at - now_ms).max(0) as u64) + self.p.lease;
        // outbox_reclaim (the relays' own call, with their lease) until every row it held is
        // reclaimed: the lease expires by the database's clock, not the runner's.
        let deadline = Instant::now() + expiry + Duration::from_secs(10);
        loop {
            self.query_i64(
                "SELECT outbox_reclaim($1::text::interval)::bigint",
                &[&lease],
            );
            let open = self.query_i64(
                "SELECT count(*) FROM outbox_event WHERE id = ANY($1) AND status = 'SENDING'",
                &[&locked],
            );
            if open == 0 || Instant::now() > deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        // Reclaimed rows are scheduled rows (a stream event's reclaim makes its scheduled copy).
        let kept = self.ids_of(
            "UPDATE outbox_scheduled SET next_retry_time = now() + interval '1 hour' \
             WHERE id = ANY($1) AND status = 'WAIT' RETURNING id",
            &locked,
        );
        let unreclaimed = self.query_i64(
            "SELECT count(*) FROM outbox_event WHERE id = ANY($1) AND status = 'SENDING'",
            &[&locked],
        );
        self.sql("COMMIT");
        let mark = self.slots[i].worker.logs().lines().count();
        let stopped_for = stopped.elapsed();
        self.slots[i].worker.signal(libc::SIGCONT);
        self.log(format!(
            "SIGCONT {owner} after {:.1} s; {unreclaimed} of the rows it held were not reclaimed",
            stopped_for.as_secs_f64()
        ));
        // Before the next fault may pick it, its stale round ends: publish, then the late acks,
        // which meet the fence (the ack audit shows whether one took effect). Ended means: its
        // metrics count every row it held as settled (delivered or failed).
        let round_done = Instant::now() + self.p.send_timeout + Duration::from_secs(10);
        let target = settled_before.map(|b| b + held.len() as u64);
        loop {
            self.scrape(i);
            let settled = self.slots[i].counters.as_ref().map(|c| c.settled());
            if settled.is_some() && settled >= target && target.is_some() {
                break;
            }
            if Instant::now() > round_done {
                self.report.notes.push(format!(
                    "zombie: {owner} had not settled its stale round {} s after SIGCONT (settled {settled:?}, expected {target:?})",
                    round_done.duration_since(stopped).as_secs()
                ));
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let late_log: Vec<String> = self.slots[i]
            .worker
            .logs()
            .lines()
            .skip(mark)
            .filter(|l| l.contains("WARN") || l.contains("ERROR"))
            .take(4)
            .map(|l| l.chars().take(300).collect())
            .collect();
        // Their keys are due again too: a claim set each key's next look to its held-back
        // head's next_retry_time (docs/reference.md, "Per-key order": rows changed by hand).
        let due_again = self.ids_of(
            "WITH due AS (UPDATE outbox_scheduled SET next_retry_time = now() \
                           WHERE id = ANY($1) AND status = 'WAIT' \
                           RETURNING id, topic, event_key, ordered), \
                  woken AS (UPDATE outbox_key k SET state = 'waiting', due_at = now() \
                              FROM (SELECT DISTINCT topic, event_key FROM due WHERE ordered) d \
                             WHERE k.topic = d.topic AND k.event_key = d.event_key) \
             SELECT id FROM due",
            &kept,
        );
        self.log(format!(
            "{} of its rows reclaimed and kept from claims until its stale round ended; {} were still open then and are due again",
            kept.len(),
            due_again.len()
        ));
        let z = ZombieResult {
            owner: owner.clone(),
            held: held.len(),
            tokens,
            stopped_for,
            ids,
            unreclaimed,
            late_log,
            late_acks_in_db: 0,
        };
        self.killed_owners.insert(owner);
        self.report.zombie = Some(z);
    }

    /// Waits (at most 10 s) until no session of `owner` runs a statement.
    fn wait_for_no_active_statement(&self, owner: &str) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.query_i64(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND state = 'active'",
            &[&owner],
        ) > 0
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn sql(&self, sql: &str) {
        self.rt
            .block_on(self.admin.batch_execute(sql))
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }

    fn ids_of(&self, sql: &str, ids: &[i64]) -> Vec<i64> {
        self.rt
            .block_on(self.admin.query(sql, &[&ids]))
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
            .iter()
            .map(|r| r.get(0))
            .collect()
    }
}
