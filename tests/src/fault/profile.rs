//! What a fault run does: the sizes, the fault schedule and the relay settings of a profile, and
//! the seed that makes a run's choices replayable.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

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
    /// When the runner enqueues the ordered events the broker rejects (see `runner::reject`).
    pub reject_at: Option<Duration>,
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
            reject_at: Some(Duration::from_secs(14)),
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
            reject_at: Some(Duration::from_secs(65)),
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

/// The seed of a run: `OUTBOX_FAULT_SEED` when set (to replay a failed run: sizes, victims and
/// schedule; the OS's timing still differs), else one from the clock. The run prints it first.
pub fn seed_from_env() -> u64 {
    match std::env::var("OUTBOX_FAULT_SEED") {
        Ok(s) => s
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("OUTBOX_FAULT_SEED={s}: not a number")),
        Err(_) => clock_seed(),
    }
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
