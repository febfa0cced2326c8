//! The fault runner (issue 4): the whole input set against the whole output set, under hard kills.
//!
//! Producers commit E events in transactions of random size (a share rolled back, a few with a
//! poison topic that does not exist on the broker) while K `outbox-worker` processes relay them to
//! a local Apache Kafka broker. Meanwhile the runner injects faults:
//! - SIGKILL of a random worker every `kill_every`, restarted at once under a new owner name;
//! - a zombie: SIGSTOP of a worker holding claims until every row it held was reclaimed by the
//!   others (longer than the lease), then SIGCONT; its late acks must count 0;
//! - a broker outage: SIGSTOP of the broker for `outage` (longer than the send timeout), SIGCONT;
//! - a broker restart: SIGTERM of the broker while the workers keep running, then the same
//!   broker started again on the same ports and data (what it acknowledged must still be there);
//! - `pg_terminate_backend` of every worker connection (application_name outbox-worker).
//!
//! At the end it waits for quiescence (no WAIT or SENDING rows), stops the workers with SIGTERM,
//! reads every topic back and checks: lost = 0, phantoms = 0, no WAIT/SENDING rows, dead letters
//! = the poison events exactly, the zombie's late acks took no effect, every message's topic and
//! payload match its event. Duplicates are counted and attributed to a cause where the final row
//! tells it (lease expiry after a kill, the zombie, a publish that failed after the broker had
//! stored the message).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rdkafka::message::Headers;
use rdkafka::Message;
use tokio::runtime::Runtime;
use tokio_postgres::Client;

use crate::broker::{read_to_end, Broker};
use crate::db::{connect, TestDb};
use crate::relay::Relay;

/// Topics the events go to; the poison topic is never created on the broker.
pub const TOPICS: [&str; 2] = ["orders", "payments"];
pub const POISON_TOPIC: &str = "poison-missing";

#[derive(Debug, Clone)]
pub struct Profile {
    pub name: String,
    pub seed: u64,
    /// Worker processes (K).
    pub workers: usize,
    /// Committed events (E), poison included.
    pub events: usize,
    /// Producer sessions committing concurrently.
    pub producers: usize,
    /// Spread the commits over about this long (zero: as fast as possible).
    pub produce_over: Duration,
    /// Events per transaction: uniform in 1..=tx_max.
    pub tx_max: usize,
    /// Share of transactions rolled back, percent.
    pub rollback_pct: u32,
    /// Transactions that carry `poison_per_tx` poison events each (spread over the run).
    pub poison_txs: usize,
    pub poison_per_tx: usize,
    pub kill_every: Duration,
    pub min_kills: usize,
    /// When the one-off faults start (after the run started).
    pub zombie_at: Option<Duration>,
    pub outage_at: Option<Duration>,
    pub outage_for: Duration,
    pub restart_at: Option<Duration>,
    pub terminate_at: Vec<Duration>,
    pub lease: Duration,
    pub send_timeout: Duration,
    pub reclaim_interval: Duration,
    pub poll_interval: Duration,
    pub batch_size: usize,
    pub concurrency: usize,
    /// outbox.max_retry of the test database (high enough that faults alone never dead-letter).
    pub max_retry: i32,
    /// outbox.backoff_base / backoff_max: the retry budget must outlast every fault window.
    pub backoff_base: Duration,
    pub backoff_max: Duration,
    pub quiesce_timeout: Duration,
}

impl Profile {
    /// K = 3, E = 20k, ≥ 5 kills, 1 zombie, 1 outage, 1 restart, 2 connection kills: < 5 min.
    pub fn ci(seed: u64) -> Profile {
        Profile {
            name: "ci".into(),
            seed,
            workers: 3,
            events: 20_000,
            producers: 2,
            produce_over: Duration::from_secs(45),
            tx_max: 40,
            rollback_pct: 10,
            poison_txs: 3,
            poison_per_tx: 4,
            kill_every: Duration::from_secs(5),
            min_kills: 6,
            zombie_at: Some(Duration::from_secs(8)),
            outage_at: Some(Duration::from_secs(24)),
            outage_for: Duration::from_secs(4),
            restart_at: Some(Duration::from_secs(34)),
            terminate_at: vec![Duration::from_secs(18), Duration::from_secs(42)],
            lease: Duration::from_secs(5),
            send_timeout: Duration::from_secs(1),
            reclaim_interval: Duration::from_secs(1),
            poll_interval: Duration::from_millis(250),
            batch_size: 200,
            concurrency: 2,
            max_retry: 8,
            backoff_base: Duration::from_millis(500),
            backoff_max: Duration::from_secs(4),
            quiesce_timeout: Duration::from_secs(120),
        }
    }

    /// K = 8, E = 1M, committed as fast as the producers go, faults spread over the run.
    pub fn long(seed: u64) -> Profile {
        Profile {
            name: "long".into(),
            workers: 8,
            events: 1_000_000,
            producers: 2,
            produce_over: Duration::ZERO,
            tx_max: 100,
            poison_txs: 5,
            kill_every: Duration::from_secs(8),
            min_kills: 20,
            zombie_at: Some(Duration::from_secs(20)),
            outage_at: Some(Duration::from_secs(50)),
            outage_for: Duration::from_secs(5),
            restart_at: Some(Duration::from_secs(80)),
            terminate_at: vec![Duration::from_secs(40), Duration::from_secs(110)],
            batch_size: 500,
            quiesce_timeout: Duration::from_secs(1800),
            ..Profile::ci(seed)
        }
    }
}

/// A seed from the clock (printed in the report so a run can be replayed).
pub fn clock_seed() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(1)
}

/// splitmix64: small, seedable, good enough for choosing sizes and victims.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in 0..n (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// What the producers did.
#[derive(Debug, Default)]
struct Produced {
    /// id -> (n, topic index; 2 = poison)
    committed: HashMap<i64, (i64, u8)>,
    rolled_back: HashSet<i64>,
    tx_committed: usize,
    tx_rolled_back: usize,
    poison_txs_done: usize,
    done: usize,
    error: Option<String>,
}

/// One message read back.
#[derive(Debug, Clone)]
struct Seen {
    topic: u8,
    partition: i64,
    offset: i64,
    id: i64,
    /// The payload's `n`, -1 if it has none.
    n: i64,
}

#[derive(Debug, Default, Clone)]
pub struct ZombieResult {
    pub owner: String,
    pub held: usize,
    pub tokens: Vec<i64>,
    pub stopped_for: Duration,
    /// From the zombie's log after SIGCONT: delivered events it tried to ack, and how many the
    /// database counted.
    pub late_acks_attempted: u64,
    pub late_acks_counted: u64,
    /// Publishes that failed after SIGCONT (these are nacked under the stale token).
    pub late_nacks_attempted: u64,
    /// The first warnings/errors it logged after SIGCONT.
    pub late_log: Vec<String>,
    /// From the database at the end: rows the zombie held that ended SUCCESS under its old token.
    pub stale_acks_in_db: i64,
    pub ids: Vec<i64>,
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
    pub lost_silently: Vec<i64>,
    pub phantoms: usize,
    pub unknown_ids: usize,
    pub corrupt: usize,
    pub messages_read: usize,
    pub duplicates: usize,
    pub duplicated_events: usize,
    pub duplicates_by_cause: BTreeMap<String, usize>,
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
    /// Workers whose producer was fenced (every publish failing with ProducerFenced), and the
    /// events they failed that way.
    pub fenced_workers: Vec<String>,
    pub fenced_failures: u64,
    /// How often a worker replaced its unusable (fenced) producer and went on.
    pub producer_replacements: u64,
    pub notes: Vec<String>,
}

impl Report {
    /// Every broken invariant, one line each (empty: the run passed).
    pub fn violations(&self) -> Vec<String> {
        let mut v = Vec::new();
        if self.lost_count > 0 {
            v.push(format!(
                "LOST {} committed events: {} dead-lettered (FAIL rows, not poison), {} SUCCESS rows missing from the broker (first ids {:?})",
                self.lost_count,
                self.lost_dead_lettered,
                self.lost_silently.len(),
                self.lost
            ));
        }
        if self.phantoms > 0 {
            v.push(format!(
                "{} rolled-back events reached the broker",
                self.phantoms
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
        if let Some(z) = &self.zombie {
            if z.late_acks_counted > 0 || z.stale_acks_in_db > 0 {
                v.push(format!(
                    "zombie acks took effect: {} counted by outbox_ack, {} rows SUCCESS under its stale token",
                    z.late_acks_counted, z.stale_acks_in_db
                ));
            }
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
            "committed E            {} events in {} transactions ({} of them poison, topic {POISON_TOPIC})",
            self.committed, self.committed_tx, self.poison
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
            "lost (E-P)-D           {} ({} of them dead-lettered FAIL rows, {} acked SUCCESS but not on the broker)",
            self.lost_count,
            self.lost_dead_lettered,
            self.lost_silently.len()
        )?;
        writeln!(
            f,
            "phantoms               {} rolled-back ids seen, {} unknown ids seen",
            self.phantoms, self.unknown_ids
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
                "zombie                 {} held {} rows (tokens {:?}), stopped {} until all were reclaimed by others",
                z.owner,
                z.held,
                z.tokens,
                secs(z.stopped_for)
            )?;
            writeln!(
                f,
                "zombie acks rejected   {} of {} late acks (outbox_ack counted {}); {} publish failures logged in the 4 s after SIGCONT (stale batch + new claims, nacked); {} rows SUCCESS under its stale token",
                z.late_acks_attempted - z.late_acks_counted,
                z.late_acks_attempted,
                z.late_acks_counted,
                z.late_nacks_attempted,
                z.stale_acks_in_db
            )?;
            for l in &z.late_log {
                writeln!(f, "    zombie log: {l}")?;
            }
        }
        if !self.unexpected_exits.is_empty() {
            writeln!(
                f,
                "worker exits (not ours) {} (restarted): {}",
                self.unexpected_exits.len(),
                self.unexpected_exits.join("; ")
            )?;
        }
        if !self.sigterm_exit_failures.is_empty() {
            writeln!(
                f,
                "SIGTERM at the end     non-zero exits: {}",
                self.sigterm_exit_failures.join("; ")
            )?;
        }
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
        if !self.fenced_workers.is_empty() {
            writeln!(
                f,
                "fenced producers       {} workers failed {} publishes with ProducerFenced, replaced their producer {} times: {}",
                self.fenced_workers.len(),
                self.fenced_failures,
                self.producer_replacements,
                self.fenced_workers.join(", ")
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

struct Slot {
    index: usize,
    generation: usize,
    owner: String,
    worker: Relay,
}

struct Runner<'a> {
    p: &'a Profile,
    rt: &'a Runtime,
    db_url: String,
    admin: Client,
    broker: Option<Broker>,
    port: u16,
    slots: Vec<Slot>,
    rng: Rng,
    start: Instant,
    report: Report,
    /// Owners that were SIGKILLed / frozen as the zombie.
    killed_owners: HashSet<String>,
    zombie_owner: Option<String>,
}

impl Runner<'_> {
    fn t(&self) -> String {
        format!("t={:6.1}s", self.start.elapsed().as_secs_f64())
    }

    fn log(&mut self, line: String) {
        let line = format!("{} {line}", self.t());
        eprintln!("[fault] {line}");
        self.report.faults.push(line);
    }

    fn spawn(&self, index: usize, generation: usize) -> Slot {
        let owner = format!("fault-w{index}-g{generation}");
        let broker = format!("127.0.0.1:{}", self.port);
        let ms = |d: Duration| format!("{}ms", d.as_millis());
        let worker = Relay::spawn(
            &self.db_url,
            &broker,
            &[
                "--owner",
                &owner,
                "--lease",
                &ms(self.p.lease),
                "--send-timeout",
                &ms(self.p.send_timeout),
                "--reclaim-interval",
                &ms(self.p.reclaim_interval),
                "--poll-interval",
                &ms(self.p.poll_interval),
                "--stats-interval",
                "2s",
                "--batch-size",
                &self.p.batch_size.to_string(),
                "--concurrency",
                &self.p.concurrency.to_string(),
                "--kafka-property",
                "reconnect.backoff.max.ms=250",
            ],
        );
        Slot {
            index,
            generation,
            owner,
            worker,
        }
    }

    /// Collects what a worker's log tells before the worker is dropped.
    fn harvest(&mut self, i: usize) {
        let logs = self.slots[i].worker.logs();
        let mut fenced = 0;
        for l in logs.lines() {
            if l.contains("publish failed") && l.contains("ProducerFenced") {
                fenced += field(l, "count=").unwrap_or(0);
            }
            if l.contains("replaced by a new producer") {
                self.report.producer_replacements += 1;
            }
        }
        if fenced > 0 {
            self.report.fenced_failures += fenced;
            let owner = self.slots[i].owner.clone();
            self.report.fenced_workers.push(owner);
        }
    }

    fn respawn(&mut self, i: usize) {
        self.harvest(i);
        let (index, generation) = (self.slots[i].index, self.slots[i].generation + 1);
        let slot = self.spawn(index, generation);
        self.slots[i] = slot;
    }

    /// Restarts workers that exited on their own (e.g. a fatal producer error).
    fn reap(&mut self) {
        for i in 0..self.slots.len() {
            if let Some(st) = self.slots[i].worker.wait_exit(Duration::ZERO) {
                let owner = self.slots[i].owner.clone();
                let tail: Vec<String> = self.slots[i]
                    .worker
                    .logs()
                    .lines()
                    .rev()
                    .filter(|l| l.contains("ERROR") || l.contains("rror"))
                    .take(1)
                    .map(str::to_string)
                    .collect();
                self.report
                    .unexpected_exits
                    .push(format!("{owner} {st} {}", tail.join(" ")));
                self.log(format!("{owner} exited by itself ({st}); restarted"));
                self.killed_owners.insert(owner);
                self.respawn(i);
            }
        }
    }

    fn query_i64(&self, sql: &str, params: &[&(dyn tokio_postgres::types::ToSql + Sync)]) -> i64 {
        self.rt
            .block_on(self.admin.query_one(sql, params))
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
            .get(0)
    }

    fn kill_one(&mut self) {
        let i = self.rng.below(self.slots.len() as u64) as usize;
        let owner = self.slots[i].owner.clone();
        let held = self.query_i64(
            "SELECT count(*) FROM outbox_event WHERE status = 'SENDING' AND claim_owner = $1",
            &[&owner],
        );
        self.slots[i].worker.signal(libc::SIGKILL);
        self.slots[i].worker.wait_exit(Duration::from_secs(10));
        self.killed_owners.insert(owner.clone());
        self.report.kills += 1;
        self.log(format!(
            "SIGKILL {owner} (holding about {held} claimed rows); restarted"
        ));
        self.respawn(i);
    }

    fn terminate_connections(&mut self) {
        let n = self.query_i64(
            "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE datname = current_database() AND application_name = 'outbox-worker' \
             AND pid <> pg_backend_pid()) t",
            &[],
        );
        self.report.terminated_connections.push(n);
        self.log(format!("pg_terminate_backend of {n} worker connections"));
    }

    fn outage(&mut self) {
        if let Some(b) = &self.broker {
            b.freeze();
        }
        self.log(format!(
            "broker SIGSTOP (outage of {} s, send timeout {} ms)",
            self.p.outage_for.as_secs_f64(),
            self.p.send_timeout.as_millis()
        ));
        std::thread::sleep(self.p.outage_for);
        if let Some(b) = &self.broker {
            b.thaw();
        }
        self.report.outages += 1;
        self.log("broker SIGCONT".to_string());
    }

    fn restart_broker(&mut self) {
        let t = Instant::now();
        if let Some(b) = self.broker.as_mut() {
            b.restart();
        }
        self.report.restarts += 1;
        self.log(format!(
            "broker restart: SIGTERM, then the same broker started again on the same ports and data; answering again after {:.1} s, workers kept running",
            t.elapsed().as_secs_f64()
        ));
    }

    fn zombie(&mut self) {
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

/// `name=123` in a log line.
fn field(line: &str, name: &str) -> Option<u64> {
    let at = line.find(name)? + name.len();
    let digits: String = line[at..]
        .chars()
        .take_while(|c| c.is_ascii_digit())
        .collect();
    digits.parse().ok()
}

/// Reads a topic up to its high watermarks, streaming, so a million messages need no more than
/// their compact records.
fn read_topic(addr: &str, topic: &str, topic_index: u8, out: &mut Vec<Seen>) -> Result<(), String> {
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

/// One producer session: transactions of random size until its share of committed events is done.
async fn produce(
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
        let res: Result<Vec<(i64, i64)>, tokio_postgres::Error> = async {
            client.batch_execute("BEGIN").await?;
            let rows = client
                .query(
                    "SELECT u.n, outbox_enqueue(u.t, jsonb_build_object('n', u.n), 'k-' || (u.n % 97), 'Fault') \
                     FROM unnest($1::text[], $2::bigint[]) AS u(t, n)",
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
                for (j, (n, id)) in rows.iter().enumerate() {
                    let topic = TOPICS.iter().position(|t| *t == topics[j]).unwrap_or(2) as u8;
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

/// Runs one profile end to end and returns its report (the caller prints it and checks `ok()`).
pub fn run(p: &Profile) -> Report {
    let wall = Instant::now();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let db = TestDb::create();
    db.psql(&format!(
        "ALTER DATABASE {0} SET outbox.max_retry = {1}; \
         ALTER DATABASE {0} SET outbox.backoff_base = '{2}ms'; \
         ALTER DATABASE {0} SET outbox.backoff_max = '{3}ms'",
        db.name,
        p.max_retry,
        p.backoff_base.as_millis(),
        p.backoff_max.as_millis()
    ));
    let runner_url = format!("{} application_name=fault-runner", db.url());
    let admin = rt.block_on(async { connect(&runner_url).await });
    let broker = Broker::start();
    for t in TOPICS {
        broker.create_topic(t);
    }
    let port = broker.port;
    let mut r = Runner {
        p,
        rt: &rt,
        db_url: db.url(),
        admin,
        broker: Some(broker),
        port,
        slots: Vec::new(),
        rng: Rng::new(p.seed),
        start: Instant::now(),
        report: Report {
            profile: p.name.clone(),
            seed: p.seed,
            workers: p.workers,
            ..Default::default()
        },
        killed_owners: HashSet::new(),
        zombie_owner: None,
    };
    eprintln!(
        "[fault] profile {} seed {}: K={} E={} on {}",
        p.name, p.seed, p.workers, p.events, db.name
    );
    for i in 0..p.workers {
        let s = r.spawn(i, 0);
        r.slots.push(s);
    }

    // Producers.
    let shared = Arc::new(Mutex::new(Produced::default()));
    r.start = Instant::now();
    let mut handles = Vec::new();
    for me in 0..p.producers {
        let target = p.events / p.producers + usize::from(me < p.events % p.producers);
        let poison = p.poison_txs / p.producers + usize::from(me < p.poison_txs % p.producers);
        handles.push(rt.spawn(produce(
            runner_url.clone(),
            p.clone(),
            me,
            target,
            poison,
            shared.clone(),
        )));
    }

    // Faults.
    #[derive(Debug)]
    enum F {
        Zombie,
        Outage,
        Restart,
        Terminate,
    }
    let mut schedule: Vec<(Duration, F)> = Vec::new();
    if let Some(t) = p.zombie_at {
        schedule.push((t, F::Zombie));
    }
    if let Some(t) = p.outage_at {
        schedule.push((t, F::Outage));
    }
    if let Some(t) = p.restart_at {
        schedule.push((t, F::Restart));
    }
    for t in &p.terminate_at {
        schedule.push((*t, F::Terminate));
    }
    schedule.sort_by_key(|s| s.0);
    schedule.reverse();
    let mut next_kill = p.kill_every;
    let mut produce_time = None;
    loop {
        r.reap();
        let now = r.start.elapsed();
        let (done, err) = {
            let s = shared.lock().expect("produced");
            (s.done == p.producers, s.error.clone())
        };
        if let Some(e) = err {
            panic!("producer failed: {e}");
        }
        if done && produce_time.is_none() {
            produce_time = Some(now);
            r.log("producers done".to_string());
        }
        if schedule.last().is_some_and(|s| s.0 <= now) {
            let (_, f) = schedule.pop().expect("fault");
            match f {
                F::Zombie => r.zombie(),
                F::Outage => r.outage(),
                F::Restart => r.restart_broker(),
                F::Terminate => r.terminate_connections(),
            }
            continue;
        }
        if now >= next_kill {
            r.kill_one();
            next_kill = now + p.kill_every;
            continue;
        }
        if done && schedule.is_empty() && r.report.kills >= p.min_kills {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let produce_time = produce_time.unwrap_or_else(|| r.start.elapsed());
    for h in handles {
        let _ = rt.block_on(h);
    }

    // Quiescence: nothing WAIT or SENDING (poison rows end FAIL).
    let deadline = Instant::now() + p.quiesce_timeout;
    loop {
        r.reap();
        let open = r.query_i64(
            "SELECT count(*) FROM outbox_event WHERE status IN ('WAIT', 'SENDING')",
            &[],
        );
        if open == 0 {
            break;
        }
        if Instant::now() > deadline {
            r.report.notes.push(format!(
                "quiescence not reached within {} s: {open} rows open",
                p.quiesce_timeout.as_secs()
            ));
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let drain_time = r.start.elapsed();
    r.log("quiescent: no WAIT or SENDING rows".to_string());

    // Graceful stop.
    for s in &r.slots {
        s.worker.signal(libc::SIGTERM);
    }
    for s in &mut r.slots {
        match s.worker.wait_exit(Duration::from_secs(20)) {
            Some(st) if st.success() => {}
            other => r
                .report
                .sigterm_exit_failures
                .push(format!("{} {other:?}", s.owner)),
        }
    }

    for i in 0..r.slots.len() {
        r.harvest(i);
    }

    // Read everything back.
    let addr = format!("127.0.0.1:{}", r.port);
    let mut seen = Vec::new();
    for (ti, topic) in TOPICS.iter().enumerate() {
        read_topic(&addr, topic, ti as u8, &mut seen)
            .unwrap_or_else(|e| panic!("reading {topic} back: {e}"));
    }

    let produced = std::mem::take(&mut *shared.lock().expect("produced"));
    r.report.produce_time = produce_time;
    r.report.drain_time = drain_time;
    analyse(&mut r, &produced, seen);
    r.report.wall_time = wall.elapsed();
    drop(r.slots);
    let report = r.report;
    drop(r.broker);
    drop(db);
    report
}

fn analyse(r: &mut Runner<'_>, produced: &Produced, seen: Vec<Seen>) {
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
    let rows = r
        .rt
        .block_on(r.admin.query(
            "SELECT id, status::text, retry_count, coalesce(last_error, ''), claim_owner, claim_token \
             FROM outbox_event",
            &[],
        ))
        .expect("final rows");
    let mut fail: BTreeSet<i64> = BTreeSet::new();
    let mut last_error: HashMap<i64, (i32, String)> = HashMap::new();
    let zombie_tokens: HashSet<i64> = rep
        .zombie
        .as_ref()
        .map(|z| z.tokens.iter().copied().collect())
        .unwrap_or_default();
    let zombie_ids: HashSet<i64> = rep
        .zombie
        .as_ref()
        .map(|z| z.ids.iter().copied().collect())
        .unwrap_or_default();
    let mut stale = 0i64;
    for row in &rows {
        let id: i64 = row.get(0);
        let status: String = row.get(1);
        let retry: i32 = row.get(2);
        let err: String = row.get(3);
        let token: Option<i64> = row.get(5);
        let poison = produced.committed.get(&id).is_some_and(|v| v.1 == 2);
        match status.as_str() {
            "WAIT" => rep.left_wait += 1,
            "SENDING" => rep.left_sending += 1,
            "SUCCESS" => rep.success_rows += 1,
            _ => {
                fail.insert(id);
                if !poison {
                    let e: String = err.chars().take(120).collect();
                    *rep.unexpected_dead_letter_errors.entry(e).or_default() += 1;
                }
            }
        }
        if status == "SUCCESS"
            && zombie_ids.contains(&id)
            && token.is_some_and(|t| zombie_tokens.contains(&t))
        {
            stale += 1;
        }
        if retry > 0 {
            rep.rows_retried += 1;
        }
        if !poison {
            rep.max_retry_count_non_poison = rep.max_retry_count_non_poison.max(retry);
        }
        last_error.insert(id, (retry, err));
    }
    if let Some(z) = rep.zombie.as_mut() {
        z.stale_acks_in_db = stale;
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
        let cause = if let Some(rest) = err.strip_prefix("lease expired: claimed by ") {
            let owner = rest.split_whitespace().next().unwrap_or("");
            if r.zombie_owner.as_deref() == Some(owner) {
                "lease expired while its worker was the SIGSTOPped zombie".to_string()
            } else if r.killed_owners.contains(owner) {
                "lease expired after its worker was SIGKILLed (or exited)".to_string()
            } else {
                "lease expired while its worker lived (a lost ack, or a publish slower than the lease)".to_string()
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
    let mut buf = String::new();
    let _ = write!(buf, "{} workers killed or exited", r.killed_owners.len());
    rep.notes.push(buf);
}
