//! The relay's defaults in one place: the command line shows them, and the tests and the
//! benchmark import them instead of copying the values.

use std::time::Duration;

/// `--brokers`: librdkafka's `bootstrap.servers`.
pub const BROKERS: &str = "localhost:9092";

/// `--batch-size`: events claimed per round (see README: large enough that a backlog drains at
/// broker speed, small enough that a round finishes well inside the send timeout).
pub const BATCH_SIZE: i32 = 500;

/// `--concurrency`: claim loops in one process.
pub const CONCURRENCY: usize = 1;

/// Upper bound of `--concurrency`.
pub const MAX_CONCURRENCY: usize = 256;

/// `--poll-interval`: the wait after a round that claimed less than a full batch.
pub const POLL_INTERVAL: Duration = Duration::from_secs(5);

/// `--lease`: claims older than this are reclaimed.
pub const LEASE: Duration = Duration::from_secs(10 * 60);

/// `--send-timeout`: librdkafka's `message.timeout.ms`.
pub const SEND_TIMEOUT: Duration = Duration::from_secs(3);

/// `--send-timeout` may be at most `--lease` divided by this, so a round always ends well before
/// its lease could expire.
pub const LEASE_TO_SEND_TIMEOUT_RATIO: u32 = 4;

/// `--reclaim-interval`: how often expired leases are reclaimed.
pub const RECLAIM_INTERVAL: Duration = Duration::from_secs(60);

/// `--stats-interval`: how often `outbox_stats()` feeds the gauges.
pub const STATS_INTERVAL: Duration = Duration::from_secs(5);

/// `--log-level`.
pub const LOG_LEVEL: &str = "info";

/// The producer's `linger.ms`: a round hands its whole batch to librdkafka at once and waits for
/// every delivery report, so lingering only delays the round (docs/relay.md has the measurement).
pub const LINGER_MS: u32 = 0;

/// The producer's `acks`.
pub const ACKS: &str = "all";

/// The producer's `partitioner`: murmur2 of the key like the Java client's default partitioner,
/// so a key lands on the partition a Java producer (Kafka Streams, Connect) would choose;
/// librdkafka's own default, `consistent_random` (CRC32), does not. Keyless events go to a random
/// partition.
pub const PARTITIONER: &str = "murmur2_random";

/// The producer's `statistics.interval.ms`: how often librdkafka's statistics refresh the
/// `outbox_kafka_*` gauges (0 turns them off).
pub const STATISTICS_INTERVAL_MS: u32 = 15_000;

/// The `content-type` header the relay adds to every message unless the row's headers have one:
/// the value is the row's jsonb payload as JSON text.
pub const CONTENT_TYPE: &str = "application/json";

/// The producer's `client.id`, and the database sessions' `application_name`.
pub const CLIENT_ID: &str = "outbox-worker";

/// `dead-letters --limit`.
pub const DEAD_LETTERS_LIMIT: i32 = 100;

/// `purge --older-than`.
pub const PURGE_OLDER_THAN: Duration = Duration::from_secs(7 * 24 * 3600);

/// `purge --max-rows`.
pub const PURGE_MAX_ROWS: i32 = 10_000;

/// `tail --idle`.
pub const TAIL_IDLE: Duration = Duration::from_secs(3);
