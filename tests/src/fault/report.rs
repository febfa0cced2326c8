//! The report of a run: what happened, printed for a human, and the broken invariants.

use std::collections::BTreeMap;
use std::time::Duration;

use super::POISON_TOPIC;

#[derive(Debug, Default, Clone)]
pub struct ZombieResult {
    pub owner: String,
    pub held: usize,
    pub tokens: Vec<i64>,
    pub stopped_for: Duration,
    pub ids: Vec<i64>,
    /// Rows it held that no other relay had reclaimed when the runner gave up waiting.
    pub unreclaimed: i64,
    /// The first warnings/errors it logged after SIGCONT (for the reader; nothing is judged on
    /// the log's wording).
    pub late_log: Vec<String>,
    /// From the ack audit: rows it held that its own session turned SUCCESS under its stale
    /// tokens after they were reclaimed, or while another relay held them.
    pub late_acks_in_db: i64,
}

#[derive(Debug, Default)]
pub struct Report {
    pub profile: String,
    pub seed: u64,
    pub workers: usize,
    pub committed: usize,
    pub committed_tx: usize,
    pub rolled_back: usize,
    pub rolled_back_tx: usize,
    pub poison: usize,
    pub delivered_distinct: usize,
    pub lost: Vec<i64>,
    pub lost_count: usize,
    /// Of the lost: rows that ended FAIL (dead-lettered, recoverable with outbox_requeue), and
    /// rows that the database says were delivered (SUCCESS) but the broker does not hold.
    pub lost_dead_lettered: usize,
    /// Of the lost: rows still WAIT or SENDING at the end (not delivered in time, or stuck).
    pub lost_unfinished: usize,
    pub lost_silently: Vec<i64>,
    pub phantoms: usize,
    /// First arrivals that came after a later event of their key (per-key order broken).
    pub out_of_order: usize,
    /// Of those: events of `reject.rs`'s keys (a head the broker refused, behind a later event of
    /// its key that was written in the same round).
    pub out_of_order_rejected: usize,
    /// Producer transactions retried after a deadlock between per-key locks.
    pub deadlock_retries: usize,
    pub unknown_ids: usize,
    pub corrupt: usize,
    pub messages_read: usize,
    pub duplicates: usize,
    pub duplicated_events: usize,
    pub duplicates_by_cause: BTreeMap<String, usize>,
    /// The duplicates the faults explain, by fault (`analysis::duplicate_budget`).
    pub duplicate_budget: Vec<(String, usize)>,
    /// Rounds of broker-rejected ordered heads (`reject.rs`).
    pub rejections: usize,
    pub left_wait: i64,
    pub left_sending: i64,
    pub success_rows: i64,
    pub dead_letters: usize,
    pub dead_letters_not_poison: Vec<i64>,
    pub poison_not_dead: Vec<i64>,
    pub rows_retried: i64,
    pub max_retry_count_non_poison: i32,
    pub kills: usize,
    pub unexpected_exits: Vec<String>,
    pub zombie: Option<ZombieResult>,
    pub outages: usize,
    pub restarts: usize,
    pub terminated_connections: Vec<i64>,
    pub faults: Vec<String>,
    pub produce_time: Duration,
    pub drain_time: Duration,
    pub wall_time: Duration,
    pub sigterm_exit_failures: Vec<String>,
    /// last_error of FAIL rows that are not poison (first 120 characters) -> rows.
    pub unexpected_dead_letter_errors: BTreeMap<String, usize>,
    /// From the relays' own /metrics (last scrape before each was killed or stopped): failed
    /// publishes by class, summed over the relays.
    pub failed_transient: u64,
    pub failed_permanent: u64,
    /// Publishes the relays blamed on their producer (fenced, epoch or sequence rejected,
    /// fatal), and the relays that had such failures.
    pub producer_failures: u64,
    pub producer_failure_workers: Vec<String>,
    /// Producer replacements by reason (fenced, fatal, timeouts).
    pub replacements: BTreeMap<String, u64>,
    /// Relays with publishes blamed on their producer that never replaced it.
    pub not_replaced: Vec<String>,
    /// Scrapes that answered without a metric the runner relies on.
    pub metrics_problems: Vec<String>,
    /// Relays killed or exited before they answered a single scrape.
    pub unscraped: Vec<String>,
    /// From the ack audit: rows whose turn to SUCCESS was made by a session (application_name =
    /// relay owner) other than the claim's owner, and the first of their ids.
    pub acks_audited: i64,
    pub acks_by_non_holder: i64,
    pub acks_by_non_holder_ids: Vec<i64>,
    pub notes: Vec<String>,
}

impl Report {
    /// Every broken invariant, one line each (empty: the run passed).
    pub fn violations(&self) -> Vec<String> {
        let mut v = Vec::new();
        if self.lost_count > 0 {
            v.push(format!(
                "LOST {} committed events: {} dead-lettered (FAIL rows, not poison), {} still WAIT or SENDING, {} SUCCESS rows missing from the broker (first ids {:?})",
                self.lost_count,
                self.lost_dead_lettered,
                self.lost_unfinished,
                self.lost_silently.len(),
                self.lost
            ));
        }
        let budget: usize = self.duplicate_budget.iter().map(|b| b.1).sum();
        if self.duplicates > budget {
            v.push(format!(
                "{} duplicates, more than the {budget} the faults explain ({})",
                self.duplicates,
                self.duplicate_budget
                    .iter()
                    .map(|(what, n)| format!("{what}: {n}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        if self.phantoms > 0 {
            v.push(format!(
                "{} rolled-back events reached the broker",
                self.phantoms
            ));
        }
        if self.out_of_order > 0 {
            v.push(format!(
                "{} events arrived for the first time after a later event of their key ({} of \
                 them heads the broker refused while a later event of their key was written)",
                self.out_of_order, self.out_of_order_rejected
            ));
        }
        if self.unknown_ids > 0 {
            v.push(format!(
                "{} messages carry an event id nobody enqueued",
                self.unknown_ids
            ));
        }
        if self.corrupt > 0 {
            v.push(format!(
                "{} messages whose topic or payload do not match their event",
                self.corrupt
            ));
        }
        if self.left_wait + self.left_sending > 0 {
            v.push(format!(
                "rows left: {} WAIT, {} SENDING",
                self.left_wait, self.left_sending
            ));
        }
        if !self.dead_letters_not_poison.is_empty() || !self.poison_not_dead.is_empty() {
            v.push(format!(
                "dead letters != poison events: {} FAIL rows not poison (first {:?}), {} poison rows not FAIL (first {:?})",
                self.dead_letters_not_poison.len(),
                &self.dead_letters_not_poison[..self.dead_letters_not_poison.len().min(10)],
                self.poison_not_dead.len(),
                &self.poison_not_dead[..self.poison_not_dead.len().min(10)]
            ));
        }
        if self.acks_by_non_holder > 0 {
            v.push(format!(
                "{} rows turned SUCCESS by a relay session that did not hold their claim (first ids {:?})",
                self.acks_by_non_holder, self.acks_by_non_holder_ids
            ));
        }
        if let Some(z) = &self.zombie {
            if z.late_acks_in_db > 0 {
                v.push(format!(
                    "zombie acks took effect: {} rows it had held turned SUCCESS by its session under its stale tokens",
                    z.late_acks_in_db
                ));
            }
            if z.unreclaimed > 0 {
                v.push(format!(
                    "{} rows of the frozen zombie {} were never reclaimed",
                    z.unreclaimed, z.owner
                ));
            }
        }
        if !self.unexpected_exits.is_empty() {
            v.push(format!(
                "relays exited without a fault causing it: {}",
                self.unexpected_exits.join("; ")
            ));
        }
        if !self.sigterm_exit_failures.is_empty() {
            v.push(format!(
                "SIGTERM did not end in exit 0: {}",
                self.sigterm_exit_failures.join("; ")
            ));
        }
        if !self.not_replaced.is_empty() {
            v.push(format!(
                "producers fenced or broken and never replaced (every later publish fails): {}",
                self.not_replaced.join(", ")
            ));
        }
        if !self.metrics_problems.is_empty() {
            v.push(format!(
                "the relays' metrics cannot be counted: {}",
                self.metrics_problems.join("; ")
            ));
        }
        // The poison events can only become dead letters through failed publishes, most of
        // them nacked: a sum of 0 means the counting broke, not that nothing failed.
        let poison_dead = self.poison - self.poison_not_dead.len().min(self.poison);
        if poison_dead > 0 && self.failed_permanent == 0 {
            v.push(format!(
                "the relays' metrics counted no permanent publish failure although {poison_dead} poison events were dead-lettered"
            ));
        }
        v
    }

    pub fn ok(&self) -> bool {
        self.violations().is_empty()
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let secs = |d: Duration| format!("{:.1} s", d.as_secs_f64());
        let non_poison = self.committed - self.poison;
        writeln!(
            f,
            "== outbox fault run: profile {}, seed {} ==",
            self.profile, self.seed
        )?;
        writeln!(
            f,
            "committed E            {} events in {} transactions ({} of them poison, topic {POISON_TOPIC}; {} transactions retried after a deadlock of per-key locks)",
            self.committed, self.committed_tx, self.poison, self.deadlock_retries
        )?;
        writeln!(
            f,
            "rolled back R          {} events in {} transactions",
            self.rolled_back, self.rolled_back_tx
        )?;
        writeln!(
            f,
            "distinct delivered D   {} of {} deliverable ({} messages read back)",
            self.delivered_distinct, non_poison, self.messages_read
        )?;
        writeln!(
            f,
            "lost (E-P)-D           {} ({} of them dead-lettered FAIL rows, {} still WAIT or SENDING, {} acked SUCCESS but not on the broker)",
            self.lost_count,
            self.lost_dead_lettered,
            self.lost_unfinished,
            self.lost_silently.len()
        )?;
        writeln!(
            f,
            "phantoms               {} rolled-back ids seen, {} unknown ids seen",
            self.phantoms, self.unknown_ids
        )?;
        writeln!(
            f,
            "out of order           {} first arrivals after a later event of their key ({} of them heads the broker refused)",
            self.out_of_order, self.out_of_order_rejected
        )?;
        writeln!(f, "corrupt messages       {}", self.corrupt)?;
        let rate = if self.delivered_distinct > 0 {
            100.0 * self.duplicates as f64 / self.delivered_distinct as f64
        } else {
            0.0
        };
        writeln!(
            f,
            "duplicates             {} extra copies of {} events ({rate:.3} % of D)",
            self.duplicates, self.duplicated_events
        )?;
        for (cause, n) in &self.duplicates_by_cause {
            writeln!(f, "    {n:>8}  {cause}")?;
        }
        let budget: usize = self.duplicate_budget.iter().map(|b| b.1).sum();
        writeln!(
            f,
            "duplicate budget       {budget} (what the faults explain):"
        )?;
        for (what, n) in &self.duplicate_budget {
            writeln!(f, "    {n:>8}  {what}")?;
        }
        writeln!(
            f,
            "rows left              {} WAIT, {} SENDING ({} SUCCESS)",
            self.left_wait, self.left_sending, self.success_rows
        )?;
        writeln!(
            f,
            "dead letters           {} (poison {}: {} FAIL rows not poison, {} poison rows not FAIL)",
            self.dead_letters,
            self.poison,
            self.dead_letters_not_poison.len(),
            self.poison_not_dead.len()
        )?;
        writeln!(
            f,
            "retried rows           {} rows with retry_count > 0; max retry_count of a non-poison row {}",
            self.rows_retried, self.max_retry_count_non_poison
        )?;
        writeln!(
            f,
            "faults                 {} SIGKILLs of {} workers (restarted), {} zombie, {} broker outage(s), {} broker restart(s), {} pg_terminate_backend rounds ({} connections)",
            self.kills,
            self.workers,
            usize::from(self.zombie.is_some()),
            self.outages,
            self.restarts,
            self.terminated_connections.len(),
            self.terminated_connections.iter().sum::<i64>()
        )?;
        if let Some(z) = &self.zombie {
            writeln!(
                f,
                "zombie                 {} held {} rows (tokens {:?}), stopped {} until the lease expired and the runner reclaimed them",
                z.owner,
                z.held,
                z.tokens,
                secs(z.stopped_for)
            )?;
            writeln!(
                f,
                "zombie acks            {} rows it had held turned SUCCESS by its session under its stale tokens (ack audit); {} never reclaimed",
                z.late_acks_in_db, z.unreclaimed
            )?;
            for l in &z.late_log {
                writeln!(f, "    zombie log: {l}")?;
            }
        }
        // Unexpected exits and failed SIGTERMs are printed as violations below.
        writeln!(
            f,
            "ack audit              {} rows turned SUCCESS, {} of them by a session that did not hold the claim",
            self.acks_audited, self.acks_by_non_holder
        )?;
        let total = self.produce_time.max(self.drain_time);
        writeln!(
            f,
            "throughput             {:.0} events/s committed ({} to commit), {:.0} events/s relayed end to end ({} from the first commit to quiescence)",
            self.committed as f64 / self.produce_time.as_secs_f64().max(0.001),
            secs(self.produce_time),
            self.committed as f64 / total.as_secs_f64().max(0.001),
            secs(total)
        )?;
        writeln!(f, "wall time              {}", secs(self.wall_time))?;
        writeln!(
            f,
            "failed publishes       {} transient (released), {} permanent (nacked), as the relays counted them (/metrics)",
            self.failed_transient, self.failed_permanent
        )?;
        let by_reason: Vec<String> = self
            .replacements
            .iter()
            .map(|(reason, n)| format!("{reason} {n}"))
            .collect();
        writeln!(
            f,
            "producers              {} publishes blamed on the producer ({} workers{}), producers replaced: {}",
            self.producer_failures,
            self.producer_failure_workers.len(),
            if self.producer_failure_workers.is_empty() {
                String::new()
            } else {
                format!(": {}", self.producer_failure_workers.join(", "))
            },
            by_reason.join(", ")
        )?;
        if !self.unscraped.is_empty() {
            writeln!(
                f,
                "not counted            {} relays killed or exited before their first scrape: {}",
                self.unscraped.len(),
                self.unscraped.join(", ")
            )?;
        }
        for (e, n) in &self.unexpected_dead_letter_errors {
            writeln!(f, "non-poison FAIL        {n:>6} rows, last_error: {e}")?;
        }
        for n in &self.notes {
            writeln!(f, "note                   {n}")?;
        }
        writeln!(f, "fault timeline:")?;
        for l in &self.faults {
            writeln!(f, "    {l}")?;
        }
        let v = self.violations();
        if v.is_empty() {
            writeln!(f, "RESULT: PASS (every invariant held)")?;
        } else {
            for l in &v {
                writeln!(f, "VIOLATION: {l}")?;
            }
            writeln!(
                f,
                "RESULT: FAIL (replay with seed {}; timings differ between runs)",
                self.seed
            )?;
        }
        Ok(())
    }
}
