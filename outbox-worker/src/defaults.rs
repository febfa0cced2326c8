//! The relay's defaults in one place: the command line shows them, and the tests and the
//! benchmark import them instead of copying the values.

use std::time::Duration;

/// `--brokers`: librdkafka's `bootstrap.servers`.
pub const BROKERS: &str = "localhost:9092";
/// `--nats-url`.
pub const NATS_URL: &str = "nats://localhost:4222";
/// `--nats-subject`: the event's topic.
pub const NATS_SUBJECT: &str = "{topic}";
/// `--rocketmq-proxy`: the gRPC endpoint of a RocketMQ 5 proxy.
pub const ROCKETMQ_PROXY: &str = "localhost:8081";

/// `--batch-size`: events claimed per round (see README: large enough that a backlog drains at
/// broker speed, small enough that a round finishes well inside the send timeout).
pub const BATCH_SIZE: i32 = 500;

/// `--concurrency`: claim loops in one process.
pub const CONCURRENCY: usize = 1;

/// Upper bound of `--concurrency`.
pub const MAX_CONCURRENCY: usize = 256;

/// `--poll-interval`: the wait after a round that claimed nothing.
pub const POLL_INTERVAL: Duration = Duration::from_secs(5);

/// `--claim-cooldown`: none, the lowest latency (issue 29's goal is judged with it).
pub const CLAIM_COOLDOWN: Duration = Duration::ZERO;

/// `--lease`: claims older than this are reclaimed.
pub const LEASE: Duration = Duration::from_secs(10 * 60);

/// `--send-timeout`: librdkafka's `message.timeout.ms`.
pub const SEND_TIMEOUT: Duration = Duration::from_secs(3);

/// `--send-timeout` may be at most `--lease` divided by this, so a round always ends well before
/// its lease could expire.
pub const LEASE_TO_SEND_TIMEOUT_RATIO: u32 = 4;

/// The circuit breaker's first wait before probing an unreachable broker (doubles per failed
/// probe, ±20 % jitter).
pub const BREAKER_BACKOFF_MIN: Duration = Duration::from_secs(1);

/// The circuit breaker's longest wait between probes: the longest an outage is noticed late.
pub const BREAKER_BACKOFF_MAX: Duration = Duration::from_secs(15);

/// How long events whose publish failed for a broker-wide reason wait before the next claim may
/// take them (`outbox_release` delay): no attempt is counted, the delay only stops a hot loop.
pub const RELEASE_DELAY: Duration = Duration::from_secs(1);

/// Failures with an error code the relay does not classify that an event is released without an
/// attempt (in case the broker is at fault); each later one counts as an attempt.
pub const UNKNOWN_ERROR_GRACE: u32 = 5;

/// `--reclaim-interval`: how often expired leases, and claims of relays whose heartbeat ran out,
/// are reclaimed. With [`HEARTBEAT_TIMEOUT`] it bounds how long a killed relay's events wait.
pub const RECLAIM_INTERVAL: Duration = Duration::from_secs(15);

/// `--heartbeat-timeout`: a relay that has not said it is alive for this long counts as gone, and
/// its claims are reclaimed without waiting for their lease. It beats every sixth of it.
pub const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(30);

/// Beats per `--heartbeat-timeout`: five can fail in a row before the relay counts as gone.
pub const BEATS_PER_HEARTBEAT_TIMEOUT: u32 = 6;

/// `--stats-interval`: how often `outbox_stats()` feeds the gauges.
pub const STATS_INTERVAL: Duration = Duration::from_secs(5);

/// `--live-timeout`: `/live` fails once a claim loop has not completed a round for this long.
pub const LIVE_TIMEOUT: Duration = Duration::from_secs(120);

/// `--statement-timeout`: PostgreSQL's statement_timeout on the relay's sessions. The extension's
/// calls take milliseconds; this only ends a statement stuck on a lock or a sick server, far
/// below the lease.
pub const STATEMENT_TIMEOUT: Duration = Duration::from_secs(10);

/// `--pool-timeout`: the longest wait for a pooled connection (opening it included).
pub const POOL_TIMEOUT: Duration = Duration::from_secs(10);

/// `--shutdown-timeout`: after SIGTERM, the longest wait for rounds in flight; below
/// Kubernetes' default grace period of 30 s, so the relay exits on its own terms.
pub const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(25);

/// Connect timeout of each database session unless the connection string sets `connect_timeout`.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// A database call's client-side bound is its statement timeout plus this: past it the server
/// would have cancelled the statement, so the connection stopped answering and is dropped.
pub const CALL_MARGIN: Duration = Duration::from_secs(5);

/// TCP keepalive of each database session: a peer that stopped answering is noticed after
/// idle + interval × retries (25 s), whether the session is idle or waits for a reply.
pub const KEEPALIVE_IDLE: Duration = Duration::from_secs(10);
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
pub const KEEPALIVE_RETRIES: u32 = 3;

/// TCP_USER_TIMEOUT of each database session: sent data unacknowledged this long ends the
/// connection (Linux would retransmit for about 15 minutes).
pub const TCP_USER_TIMEOUT: Duration = Duration::from_secs(20);

/// Log filter when neither `--log-level` nor `RUST_LOG` is set.
pub const LOG_LEVEL: &str = "info";

/// The producer's `linger.ms`: a round waits for every delivery report of its events before it
/// settles them, so lingering only delays the round (docs/relay.md, "Flags").
pub const LINGER_MS: u32 = 0;

/// The producer's `acks`.
pub const ACKS: &str = "all";

/// The producer's `partitioner`: murmur2 of the key, as the Java client's default, so a key lands
/// where a Java producer (Kafka Streams, Connect) would put it; librdkafka's default (CRC32) does
/// not. Keyless events go to a random partition.
pub const PARTITIONER: &str = "murmur2_random";

/// librdkafka producers per Kafka producer of the relay (docs/relay.md, "Partitions per broker
/// and latency").
pub const KAFKA_CONNECTIONS: u16 = 2;

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
