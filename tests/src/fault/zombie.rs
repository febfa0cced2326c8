//! The zombie fault: a relay frozen (SIGSTOP) while it holds claims, until the others reclaimed
//! every row it held, then thawed (SIGCONT) so its late acks meet the fence.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use super::report::ZombieResult;
use super::runner::{field, Runner};

impl Runner<'_> {
    pub(super) fn zombie(&mut self) {
        let i = self.rng.below(self.slots.len() as u64) as usize;
        let owner = self.slots[i].owner.clone();
        let mut held: Vec<(i64, i64)> = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            let n = self.query_i64(
                "SELECT count(*) FROM outbox_event WHERE status = 'SENDING' AND claim_owner = $1",
                &[&owner],
            );
            if n > 0 {
                self.slots[i].worker.signal(libc::SIGSTOP);
                // Let a statement already on the wire finish.
                std::thread::sleep(Duration::from_millis(300));
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
        let deadline = Instant::now() + self.p.lease * 6 + Duration::from_secs(30);
        loop {
            let still = self.query_i64(
                "SELECT count(*) FROM outbox_event WHERE id = ANY($1) AND status = 'SENDING' \
                 AND claim_owner = $2 AND claim_token = ANY($3)",
                &[&ids, &owner, &tokens],
            );
            if still == 0 && stopped.elapsed() > self.p.lease + Duration::from_millis(500) {
                break;
            }
            if Instant::now() > deadline {
                self.report.notes.push(format!(
                    "zombie: {still} of its rows were still not reclaimed after {:.0} s",
                    stopped.elapsed().as_secs_f64()
                ));
                break;
            }
            // Other workers keep being reaped meanwhile.
            std::thread::sleep(Duration::from_millis(200));
        }
        let mark = self.slots[i].worker.logs().lines().count();
        let stopped_for = stopped.elapsed();
        self.slots[i].worker.signal(libc::SIGCONT);
        self.log(format!(
            "SIGCONT {owner} after {:.1} s: every row it held had been reclaimed by others",
            stopped_for.as_secs_f64()
        ));
        // Its round finishes within the send timeout plus the settle call.
        std::thread::sleep(self.p.send_timeout + Duration::from_secs(3));
        let logs = self.slots[i].worker.logs();
        let mut z = ZombieResult {
            owner: owner.clone(),
            held: held.len(),
            tokens,
            stopped_for,
            ids,
            ..Default::default()
        };
        for line in logs.lines().skip(mark) {
            if line.contains("no longer held by this relay") {
                z.late_acks_counted += field(line, "acked=").unwrap_or(0);
                z.late_acks_attempted += field(line, "delivered=").unwrap_or(0);
            } else if line.contains("publish failed") {
                z.late_nacks_attempted += field(line, "count=").unwrap_or(0);
            }
            if (line.contains("WARN") || line.contains("ERROR")) && z.late_log.len() < 4 {
                z.late_log.push(line.chars().take(300).collect());
            }
        }
        self.killed_owners.insert(owner);
        self.report.zombie = Some(z);
    }
}
