//! Sizes and durations of the quick, long and smoke profiles.

use std::time::Duration;

use crate::goals::{LATENCY_GOAL_RATE, LATENCY_HIGH_RATE, LATENCY_MID_RATE};
use crate::null_sink::{Sessions, Statements};

/// Sizes and durations of one profile.
pub struct Profile {
    pub name: &'static str,
    /// How the null sink's claim loops send their statements (`--unnamed-statements`).
    pub statements: Statements,
    pub enqueue_clients: usize,
    pub enqueue_time: Duration,
    pub enqueue_rounds: usize,
    pub enqueue_breakdown_rows: i64,
    /// Enqueue CPU: single-row statements per run, rounds (also the bulk section's rounds).
    pub cost_statements: i64,
    pub cost_rounds: usize,
    /// Bulk: events per batch (single calls vs one `outbox_enqueue_many`).
    pub bulk_rows: i64,
    pub matrix_backlog: i64,
    pub matrix_cap: Duration,
    pub loops: Vec<usize>,
    pub batches: Vec<i32>,
    pub headline_backlog: i64,
    pub contention_backlog: i64,
    pub claimers: Vec<usize>,
    pub contention_batch: i32,
    pub seed_backlog: i64,
    pub seed_cap: Duration,
    pub seed_loops: Vec<usize>,
    pub seed_delay: Duration,
    pub seed_delay_rounds: u64,
    /// Runs per drain configuration (null sink and broker); the report keeps the fastest, the
    /// one least disturbed by other work on the machine.
    pub repeats: usize,
    pub broker_backlog: i64,
    pub broker_cap: Duration,
    pub broker_loops: Vec<usize>,
    pub broker_batches: Vec<i32>,
    pub linger_ms: Vec<u32>,
    /// `--claim-cooldown` settings (ms) run at the latency goal's rate besides the default (0).
    pub claim_cooldown_ms: Vec<u32>,
    pub latency_rates: Vec<f64>,
    pub latency_time: Duration,
    /// Partitions of the latency runs' topics (`--latency-partitions`).
    pub latency_partitions: i32,
    /// Times the main server's default rates are run, the rates taking turns (`--latency-repeat`).
    pub latency_repeat: usize,
    /// Plain INSERTs per second beside an extra run at the goal's rate (`--latency-background`).
    pub latency_background: Option<f64>,
    /// Rates offered to the throwaway server without `shared_preload_libraries` (polling mode).
    pub polling_rates: Vec<f64>,
    /// How long an idle relay is watched (issue 10: at least 30 s).
    pub idle_time: Duration,
    /// Per-key order: a keyed backlog drained ordered and unordered over each number of keys
    /// (capped at the backlog), and a hot key's backlogs for the claim cost, with calls per size.
    pub ordering_backlog: i64,
    pub ordering_keys: Vec<i64>,
    pub ordering_cap: Duration,
    pub claim_cost_backlogs: Vec<i64>,
    pub claim_cost_calls: usize,
    /// Index comparison: SUCCESS history, SENDING leases, WAIT backlog, time per query.
    pub index_history: i64,
    pub index_sending: i64,
    pub index_backlog: i64,
    pub index_time: Duration,
    /// Life cycle (issue 9): events per run, and whether keyed runs follow the unkeyed ones.
    pub lifecycle_events: i64,
    pub lifecycle_keyed: bool,
    /// Long transactions (issue 9): offered events/s, duration of each run (held, control),
    /// reporting interval, and the load before the measured part (the transaction opens after
    /// it; see held_snapshot.rs).
    pub held_rate: f64,
    pub held_time: Duration,
    pub held_interval: Duration,
    pub held_warmup: Duration,
    /// Fairness (issue 32): the other database's backlog, the steady one's rate and duration,
    /// and how many rounds of every set-up.
    pub fair_backlog: i64,
    pub fair_rounds: usize,
    /// Rounds of the drain per sink (`--only sinks`), the sinks alternating.
    pub sink_rounds: usize,
    /// Whether the sinks section drains to RocketMQ too (its JVMs take seconds to start).
    pub sink_rocketmq: bool,
    pub fair_rate: f64,
    pub fair_time: Duration,
    /// The inbox (issue 31): calls per measured variant (accept, plain INSERT).
    pub inbox_calls: i64,
}

impl Profile {
    /// The null sink's sessions, with `synchronous_commit = off` or not.
    pub fn sessions(&self, sync_off: bool) -> Sessions {
        Sessions {
            sync_off,
            statements: self.statements,
        }
    }

    pub fn quick() -> Profile {
        Profile {
            name: "quick",
            statements: Statements::Named,
            enqueue_clients: 16,
            enqueue_time: Duration::from_secs(3),
            enqueue_rounds: 5,
            enqueue_breakdown_rows: 20_000,
            cost_statements: 20_000,
            cost_rounds: 3,
            bulk_rows: 10_000,
            matrix_backlog: 100_000,
            matrix_cap: Duration::from_secs(15),
            loops: vec![1, 2, 4],
            batches: vec![20, 100, 500],
            headline_backlog: 200_000,
            contention_backlog: 50_000,
            claimers: vec![1, 4, 8],
            contention_batch: 100,
            seed_backlog: 50_000,
            seed_cap: Duration::from_secs(10),
            seed_loops: vec![1, 4],
            seed_delay: Duration::from_secs(5),
            seed_delay_rounds: 2,
            repeats: 2,
            broker_backlog: 100_000,
            broker_cap: Duration::from_secs(30),
            broker_loops: vec![1, 2, 4],
            broker_batches: vec![20, 100, 500],
            // The relay's own linger.ms (defaults::LINGER_MS) is its "defaults" row; compare the
            // alternatives.
            linger_ms: vec![1, 5, 20],
            claim_cooldown_ms: vec![5, 15, 25],
            latency_rates: vec![
                100.0,
                LATENCY_GOAL_RATE,
                LATENCY_MID_RATE,
                LATENCY_HIGH_RATE,
            ],
            latency_time: Duration::from_secs(5),
            latency_partitions: outbox_tests::broker::PARTITIONS,
            latency_repeat: 1,
            latency_background: None,
            polling_rates: vec![LATENCY_GOAL_RATE, LATENCY_HIGH_RATE],
            idle_time: Duration::from_secs(30),
            ordering_backlog: 20_000,
            ordering_keys: vec![1, 100, 10_000, 100_000],
            ordering_cap: Duration::from_secs(120),
            claim_cost_backlogs: vec![100, 1_000, 100_000],
            claim_cost_calls: 50,
            index_history: 1_000_000,
            index_sending: 1_000,
            index_backlog: 10_000,
            index_time: Duration::from_secs(10),
            lifecycle_events: 100_000,
            lifecycle_keyed: true,
            held_rate: 2_000.0,
            held_time: Duration::from_secs(120),
            held_interval: Duration::from_secs(10),
            held_warmup: Duration::from_secs(20),
            fair_backlog: 200_000,
            fair_rounds: 5,
            sink_rounds: 5,
            sink_rocketmq: true,
            fair_rate: 500.0,
            fair_time: Duration::from_secs(10),
            inbox_calls: 20_000,
        }
    }

    pub fn long() -> Profile {
        Profile {
            name: "long",
            enqueue_time: Duration::from_secs(10),
            enqueue_rounds: 5,
            idle_time: Duration::from_secs(60),
            matrix_backlog: 1_000_000,
            matrix_cap: Duration::from_secs(60),
            headline_backlog: 1_000_000,
            contention_backlog: 200_000,
            seed_backlog: 200_000,
            seed_cap: Duration::from_secs(30),
            seed_delay_rounds: 3,
            repeats: 1,
            broker_backlog: 1_000_000,
            broker_cap: Duration::from_secs(300),
            latency_time: Duration::from_secs(20),
            ordering_backlog: 100_000,
            ordering_cap: Duration::from_secs(300),
            held_time: Duration::from_secs(600),
            held_interval: Duration::from_secs(30),
            held_warmup: Duration::from_secs(150),
            fair_time: Duration::from_secs(30),
            fair_rounds: 9,
            sink_rounds: 5,
            sink_rocketmq: true,
            ..Profile::quick()
        }
    }

    pub fn smoke() -> Profile {
        Profile {
            name: "smoke",
            statements: Statements::Named,
            enqueue_clients: 2,
            enqueue_time: Duration::from_millis(500),
            enqueue_rounds: 1,
            enqueue_breakdown_rows: 1_000,
            cost_statements: 300,
            cost_rounds: 1,
            bulk_rows: 200,
            matrix_backlog: 2_000,
            matrix_cap: Duration::from_secs(20),
            loops: vec![2],
            batches: vec![100],
            headline_backlog: 3_000,
            contention_backlog: 3_000,
            claimers: vec![1, 8],
            contention_batch: 20,
            seed_backlog: 200,
            seed_cap: Duration::from_secs(5),
            seed_loops: vec![1, 2],
            seed_delay: Duration::from_millis(200),
            seed_delay_rounds: 2,
            repeats: 1,
            broker_backlog: 2_000,
            broker_cap: Duration::from_secs(30),
            broker_loops: vec![2],
            broker_batches: vec![],
            linger_ms: vec![],
            claim_cooldown_ms: vec![5],
            latency_rates: vec![200.0],
            latency_time: Duration::from_secs(1),
            latency_partitions: outbox_tests::broker::PARTITIONS,
            latency_repeat: 1,
            latency_background: None,
            polling_rates: vec![200.0],
            idle_time: Duration::from_secs(2),
            ordering_backlog: 1_000,
            ordering_keys: vec![1, 100, 100_000],
            ordering_cap: Duration::from_secs(20),
            claim_cost_backlogs: vec![100, 1_000, 2_000],
            claim_cost_calls: 5,
            index_history: 20_000,
            index_sending: 100,
            index_backlog: 1_000,
            index_time: Duration::from_millis(300),
            lifecycle_events: 500,
            lifecycle_keyed: true,
            held_rate: 200.0,
            held_time: Duration::from_secs(3),
            held_interval: Duration::from_secs(1),
            held_warmup: Duration::from_secs(1),
            fair_backlog: 2_000,
            fair_rounds: 1,
            sink_rounds: 1,
            sink_rocketmq: false,
            fair_rate: 100.0,
            fair_time: Duration::from_secs(1),
            inbox_calls: 200,
        }
    }
}
