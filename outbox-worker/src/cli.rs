//! Command line: every flag also reads an `OUTBOX_*` environment variable.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::defaults::{self, LEASE_TO_SEND_TIMEOUT_RATIO, MAX_CONCURRENCY};
use crate::{guarantees, Fatal};

#[derive(Parser, Debug)]
#[command(
    name = "outbox-worker",
    version,
    about = "Relays outbox events from PostgreSQL to Kafka"
)]
pub struct Cli {
    /// Log filter: a level (error, warn, info, debug, trace, off) or RUST_LOG-style directives,
    /// e.g. `info,librdkafka=debug`; librdkafka's own log level follows the filter of target
    /// `librdkafka`. Default: RUST_LOG if set, else info.
    #[arg(long, env = "OUTBOX_LOG", global = true)]
    pub log_level: Option<String>,

    /// Log lines as text or as one JSON object a line (level, target, message, fields).
    #[arg(long, env = "OUTBOX_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text, global = true)]
    pub log_format: LogFormat,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

// Parsed once per process: the size of `run`'s arguments costs nothing worth a Box.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run the relay: claim events, publish them to Kafka, ack or nack them.
    Run(RunArgs),
    /// Print the outbox counters (outbox_stats()).
    Stats(StatsArgs),
    /// List dead letters (FAIL rows), oldest id first.
    DeadLetters(DeadLettersArgs),
    /// Put dead letters back to WAIT (retry count 0, due now); a key blocked by one resumes in order.
    Requeue(RequeueArgs),
    /// List keys held back by a dead head event (outbox_blocked_keys()).
    Blocked(BlockedArgs),
    /// Let the keys of these dead letters go on without them (they stay dead letters).
    Skip(SkipArgs),
    /// List the relays (claim owners): alive or gone by their heartbeat, and what each holds.
    Relays(RelaysArgs),
    /// Delete delivered (SUCCESS) rows older than a given age.
    Purge(PurgeArgs),
    /// Print the messages of a Kafka topic (all partitions, from the beginning).
    Tail(TailArgs),
    /// The consumers' inbox (docs/inbox.md).
    #[command(subcommand)]
    Inbox(InboxCommand),
}

#[derive(Subcommand, Debug)]
pub enum InboxCommand {
    /// Print each consumer's inbox size and span (outbox_inbox_stats()).
    Stats(StatsArgs),
}

#[derive(Args, Debug, Clone)]
pub struct DbArgs {
    /// PostgreSQL connection string (URL or `key=value` form). Prefer the environment variable or
    /// --database-url-file: a password on the command line is visible to other local users. TLS
    /// as in libpq: sslmode=disable|prefer (default)|require|verify-ca|verify-full, sslrootcert
    /// (CA file; `system` or unset: the system's CAs), sslcert and sslkey (client certificate).
    #[arg(long, env = "OUTBOX_DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<String>,

    /// File whose content (trimmed) is the connection string.
    #[arg(long, env = "OUTBOX_DATABASE_URL_FILE")]
    pub database_url_file: Option<PathBuf>,

    /// Config file (TOML) listing databases by name (docs/relay.md, "Many databases"): `run`
    /// serves them all; an operator command works on the one --database names.
    #[arg(long, env = "OUTBOX_CONFIG")]
    pub config: Option<PathBuf>,

    /// The database of --config an operator command works on (not needed when it lists one).
    #[arg(long, env = "OUTBOX_DATABASE")]
    pub database: Option<String>,
}

/// The Kafka connection of `run` (producer) and `tail` (consumer).
#[derive(Args, Debug, Clone)]
pub struct KafkaArgs {
    /// Kafka bootstrap servers (librdkafka `bootstrap.servers`).
    #[arg(long, env = "OUTBOX_BROKERS", default_value = defaults::BROKERS)]
    pub brokers: String,

    /// librdkafka property KEY=VALUE, repeatable; overrides the command's own settings. In the
    /// environment: several KEY=VALUE separated by newlines.
    #[arg(
        long = "kafka-property",
        env = "OUTBOX_KAFKA_PROPERTIES",
        value_name = "KEY=VALUE",
        value_delimiter = '\n',
        hide_env_values = true
    )]
    pub kafka_properties: Vec<String>,
}

impl KafkaArgs {
    /// The `--kafka-property` values as pairs. The error names a bad one by its position only:
    /// without a `=` there is no key to name, and the text may be (part of) a secret.
    pub fn properties(&self) -> Result<Vec<(String, String)>, Fatal> {
        self.kafka_properties
            .iter()
            .filter(|s| !s.trim().is_empty())
            .enumerate()
            .map(|(n, s)| {
                parse_property(s).ok_or_else(|| {
                    Fatal::usage(format!(
                        "malformed Kafka property #{} of --kafka-property (OUTBOX_KAFKA_PROPERTIES): expected KEY=VALUE (the text is not shown: it may hold a secret)",
                        n + 1
                    ))
                })
            })
            .collect()
    }
}

/// The broker `run` publishes to.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum SinkKind {
    /// Apache Kafka (librdkafka's idempotent producer).
    Kafka,
    /// NATS JetStream.
    Nats,
    /// Apache RocketMQ 5 (through its gRPC proxy).
    Rocketmq,
}

impl SinkKind {
    /// The broker's name in `/ready` and the log.
    pub fn broker_name(self) -> &'static str {
        match self {
            SinkKind::Kafka => "Kafka",
            SinkKind::Nats => "NATS",
            SinkKind::Rocketmq => "RocketMQ",
        }
    }
}

/// The NATS JetStream connection of `run --sink nats`.
#[derive(Args, Debug, Clone)]
pub struct NatsArgs {
    /// NATS server URLs, comma-separated (nats://host:port).
    #[arg(long, env = "OUTBOX_NATS_URL", default_value = defaults::NATS_URL)]
    pub nats_url: String,

    /// The subject of an event: `{topic}` and `{key}` are replaced by the event's topic and key
    /// (an event without a key gets `_`). A subject must be captured by a JetStream stream.
    #[arg(long, env = "OUTBOX_NATS_SUBJECT", default_value = defaults::NATS_SUBJECT)]
    pub nats_subject: String,

    /// PEM file of the CA(s) that signed the NATS servers' certificates: TLS is then required,
    /// and a certificate they did not sign stops the start with exit 2.
    #[arg(long, env = "OUTBOX_NATS_TLS_CA")]
    pub nats_tls_ca: Option<PathBuf>,

    /// User name for the NATS server (with --nats-password).
    #[arg(long, env = "OUTBOX_NATS_USER", requires = "nats_password")]
    pub nats_user: Option<String>,

    /// Password of --nats-user; set it in the environment, not on the command line.
    #[arg(
        long,
        env = "OUTBOX_NATS_PASSWORD",
        hide_env_values = true,
        requires = "nats_user"
    )]
    pub nats_password: Option<String>,
}

/// The RocketMQ connection of `run --sink rocketmq`.
#[derive(Args, Debug, Clone)]
pub struct RocketMqArgs {
    /// HOST:PORT of a RocketMQ 5 proxy's gRPC endpoint (the broker's proxy in local mode, or a
    /// proxy cluster). Topics must exist and be FIFO topics.
    #[arg(long, env = "OUTBOX_ROCKETMQ_PROXY", default_value = defaults::ROCKETMQ_PROXY)]
    pub rocketmq_proxy: String,
}

/// Duration defaults are written as text (that is what `--help` shows); a test keeps them equal to
/// the constants in `defaults`.
#[derive(Args, Debug, Clone)]
pub struct RunArgs {
    #[command(flatten)]
    pub db: DbArgs,

    /// The broker events are published to.
    #[arg(long, env = "OUTBOX_SINK", value_enum, default_value_t = SinkKind::Kafka)]
    pub sink: SinkKind,

    #[command(flatten)]
    pub kafka: KafkaArgs,

    #[command(flatten)]
    pub nats: NatsArgs,

    #[command(flatten)]
    pub rocketmq: RocketMqArgs,

    /// File with librdkafka properties, one KEY=VALUE a line (# comments); for secrets such as
    /// sasl.password. Applied before --kafka-property.
    #[arg(long, env = "OUTBOX_KAFKA_PROPERTIES_FILE")]
    pub kafka_properties_file: Option<PathBuf>,

    /// Claim owner recorded on the rows (default: hostname-pid-random).
    #[arg(long, env = "OUTBOX_OWNER")]
    pub owner: Option<String>,

    /// Events claimed per round and claim loop.
    #[arg(long, env = "OUTBOX_BATCH_SIZE", default_value_t = defaults::BATCH_SIZE)]
    pub batch_size: i32,

    /// Claim loops in this process (they share the Kafka producers).
    #[arg(long, env = "OUTBOX_CONCURRENCY", default_value_t = defaults::CONCURRENCY)]
    pub concurrency: usize,

    /// Wait after a round that claimed nothing (the wake-up session's `outbox_wait` ends it early).
    #[arg(long, env = "OUTBOX_POLL_INTERVAL", default_value = "5s", value_parser = parse_duration)]
    pub poll_interval: Duration,

    /// Least time between the starts of two claims of a claim loop, unless the first one filled
    /// its batch: events committed meanwhile wait and go in one round, which costs the database
    /// less CPU per event for that much more latency (docs/relay.md, "Claim cooldown"). At most
    /// --poll-interval.
    #[arg(long, env = "OUTBOX_CLAIM_COOLDOWN", default_value = "0s", value_parser = parse_duration)]
    pub claim_cooldown: Duration,

    /// Claims older than this are reclaimed (by any relay) as one failed attempt.
    #[arg(long, env = "OUTBOX_LEASE", default_value = "10m", value_parser = parse_duration)]
    pub lease: Duration,

    /// Delivery timeout of one message (librdkafka message.timeout.ms); at most lease/4.
    #[arg(long, env = "OUTBOX_SEND_TIMEOUT", default_value = "3s", value_parser = parse_duration)]
    pub send_timeout: Duration,

    /// Kafka producers per producer of the relay, each with its own broker connections: a round's
    /// events go to the one of their partition, so its partitions are written side by side
    /// (librdkafka writes one partition per request, one request at a time per connection).
    #[arg(
        long,
        env = "OUTBOX_KAFKA_CONNECTIONS",
        default_value_t = defaults::KAFKA_CONNECTIONS,
        value_parser = clap::value_parser!(u16).range(1..=64)
    )]
    pub kafka_connections: u16,

    /// How often expired leases, and claims of relays whose heartbeat ran out, are reclaimed.
    #[arg(long, env = "OUTBOX_RECLAIM_INTERVAL", default_value = "15s", value_parser = parse_duration)]
    pub reclaim_interval: Duration,

    /// A relay that has not said it is alive (outbox_heartbeat, every sixth of this) for this
    /// long counts as gone: any relay's reclaim then takes back its claims without waiting for
    /// their lease. Below --lease; 0 turns heartbeats off (the lease alone) [default: 30s, or
    /// lease/4 when shorter].
    #[arg(long, env = "OUTBOX_HEARTBEAT_TIMEOUT", value_parser = parse_duration)]
    pub heartbeat_timeout: Option<Duration>,

    /// How often outbox_stats() is read for the backlog gauges.
    #[arg(long, env = "OUTBOX_STATS_INTERVAL", default_value = "5s", value_parser = parse_duration)]
    pub stats_interval: Duration,

    /// Address for the Prometheus /metrics and the /live, /ready (and /health) endpoints (off
    /// when not set), e.g. 127.0.0.1:9187.
    #[arg(long, env = "OUTBOX_METRICS_ADDR")]
    pub metrics_addr: Option<SocketAddr>,

    /// /live answers 503 once a claim loop has not completed a round for this long; at least
    /// twice --poll-interval + --send-timeout [default: 2m, or that when longer].
    #[arg(long, env = "OUTBOX_LIVE_TIMEOUT", value_parser = parse_duration)]
    pub live_timeout: Option<Duration>,

    /// Server-side limit of each of the relay's statements (PostgreSQL statement_timeout; 0: the
    /// server's setting); at most lease/4. A statement stuck on a lock is cancelled and retried
    /// [default: 10s, or lease/4 when shorter].
    #[arg(long, env = "OUTBOX_STATEMENT_TIMEOUT", value_parser = parse_duration)]
    pub statement_timeout: Option<Duration>,

    /// Longest wait for a connection from the relay's pool (opening it included); at most
    /// lease/4 [default: 10s, or lease/4 when shorter].
    #[arg(long, env = "OUTBOX_POOL_TIMEOUT", value_parser = parse_duration)]
    pub pool_timeout: Option<Duration>,

    /// After SIGTERM (or a failed task), the longest wait for the rounds in flight to settle;
    /// then the relay exits 1 anyway (rows still claimed are reclaimed at the next reclaim, or
    /// after the lease with heartbeats off).
    #[arg(long, env = "OUTBOX_SHUTDOWN_TIMEOUT", default_value = "25s", value_parser = parse_duration)]
    pub shutdown_timeout: Duration,
}

impl RunArgs {
    /// Start-up checks that need no connection: one clear line each.
    pub fn validate(&self) -> Result<(), Fatal> {
        if self.send_timeout.is_zero() {
            return Err(Fatal::usage("--send-timeout must be greater than 0"));
        }
        if self.send_timeout * LEASE_TO_SEND_TIMEOUT_RATIO > self.lease {
            return Err(Fatal::usage(format!(
                "--send-timeout ({}) must be at most a quarter of --lease ({}), so a round always ends well before its lease expires",
                humantime::format_duration(self.send_timeout),
                humantime::format_duration(self.lease)
            )));
        }
        if self.sink == SinkKind::Nats {
            crate::nats::check_subject_template(&self.nats.nats_subject)?;
        }
        if self.batch_size < 1 {
            return Err(Fatal::usage("--batch-size must be at least 1"));
        }
        if self.concurrency < 1 || self.concurrency > MAX_CONCURRENCY {
            return Err(Fatal::usage(format!(
                "--concurrency must be between 1 and {MAX_CONCURRENCY}"
            )));
        }
        if self.claim_cooldown > self.poll_interval {
            return Err(Fatal::usage(format!(
                "--claim-cooldown ({}) must be at most --poll-interval ({})",
                humantime::format_duration(self.claim_cooldown),
                humantime::format_duration(self.poll_interval)
            )));
        }
        if self.live_timeout() < self.idle_round_gap() * 2 {
            return Err(Fatal::usage(format!(
                "--live-timeout ({}) must be at least twice --poll-interval + --send-timeout ({}), or an idle relay would look stuck",
                humantime::format_duration(self.live_timeout()),
                humantime::format_duration(self.poll_interval + self.send_timeout)
            )));
        }
        for (name, d) in [
            ("--statement-timeout", self.statement_timeout),
            ("--pool-timeout", self.pool_timeout),
        ] {
            let Some(d) = d else { continue };
            if d * LEASE_TO_SEND_TIMEOUT_RATIO > self.lease {
                return Err(Fatal::usage(format!(
                    "{name} ({}) must be at most a quarter of --lease ({})",
                    humantime::format_duration(d),
                    humantime::format_duration(self.lease)
                )));
            }
        }
        for (name, d) in [
            ("--poll-interval", self.poll_interval),
            ("--reclaim-interval", self.reclaim_interval),
            ("--stats-interval", self.stats_interval),
            ("--pool-timeout", self.pool_timeout()),
            ("--shutdown-timeout", self.shutdown_timeout),
        ] {
            if d.is_zero() {
                return Err(Fatal::usage(format!("{name} must be greater than 0")));
            }
        }
        if let Some(d) = self.heartbeat_timeout.filter(|d| !d.is_zero()) {
            if d >= self.lease {
                return Err(Fatal::usage(format!(
                    "--heartbeat-timeout ({}) must be below --lease ({}), or 0 to turn heartbeats off",
                    humantime::format_duration(d),
                    humantime::format_duration(self.lease)
                )));
            }
            if d < Duration::from_millis(600) {
                return Err(Fatal::usage(
                    "--heartbeat-timeout must be at least 600ms (one beat every 100ms), or 0 to turn heartbeats off",
                ));
            }
        }
        if let Some(o) = &self.owner {
            if o.is_empty() || o.len() > 200 || o.chars().any(char::is_control) {
                return Err(Fatal::usage(
                    "--owner must be 1 to 200 characters without control characters",
                ));
            }
        }
        Ok(())
    }

    /// --poll-interval + --send-timeout: about the longest time between two rounds of a healthy
    /// claim loop.
    fn idle_round_gap(&self) -> Duration {
        self.poll_interval + self.send_timeout
    }

    /// `--live-timeout`, or its default: [`defaults::LIVE_TIMEOUT`], longer when the poll
    /// interval needs it.
    pub fn live_timeout(&self) -> Duration {
        self.live_timeout
            .unwrap_or_else(|| defaults::LIVE_TIMEOUT.max(self.idle_round_gap() * 2))
    }

    /// `--statement-timeout`, or its default bounded by the lease.
    pub fn statement_timeout(&self) -> Duration {
        self.statement_timeout
            .unwrap_or_else(|| self.within_lease(defaults::STATEMENT_TIMEOUT))
    }

    /// A database call's client-side bound: the statement timeout (the server's cancels the
    /// statement by then; zero, the server's own setting: a quarter of the lease) plus a margin.
    pub fn call_timeout(&self) -> Duration {
        let statement = self.statement_timeout();
        let statement = if statement.is_zero() {
            self.lease / LEASE_TO_SEND_TIMEOUT_RATIO
        } else {
            statement
        };
        statement + defaults::CALL_MARGIN
    }

    /// `--pool-timeout`, or its default bounded by the lease.
    pub fn pool_timeout(&self) -> Duration {
        self.pool_timeout
            .unwrap_or_else(|| self.within_lease(defaults::POOL_TIMEOUT))
    }

    /// `--heartbeat-timeout`, or its default bounded by the lease; zero: no heartbeats.
    pub fn heartbeat_timeout(&self) -> Duration {
        self.heartbeat_timeout
            .unwrap_or_else(|| self.within_lease(defaults::HEARTBEAT_TIMEOUT))
    }

    fn within_lease(&self, d: Duration) -> Duration {
        d.min(self.lease / LEASE_TO_SEND_TIMEOUT_RATIO)
    }

    /// The producer's properties: --kafka-properties-file first, then --kafka-property.
    pub fn producer_properties(&self) -> Result<Vec<(String, String)>, Fatal> {
        let mut props = Vec::new();
        if let Some(p) = &self.kafka_properties_file {
            props.extend(read_properties_file(p)?);
        }
        props.extend(self.kafka.properties()?);
        check_delivery_timeout(&props, self.lease)?;
        guarantees::check(&props)?;
        Ok(props)
    }
}

/// librdkafka's delivery timeout (`message.timeout.ms`, alias `delivery.timeout.ms`) given as a
/// property replaces --send-timeout, so it obeys the same bound: a round must end well before its
/// lease expires. 0 (librdkafka: wait forever) is refused.
fn check_delivery_timeout(props: &[(String, String)], lease: Duration) -> Result<(), Fatal> {
    for (k, v) in props {
        if guarantees::canonical(k) != "message.timeout.ms" {
            continue;
        }
        let ms: u64 = v.parse().map_err(|_| {
            Fatal::usage(format!(
                "invalid Kafka property {k}: {v:?} is not a number of milliseconds"
            ))
        })?;
        let d = Duration::from_millis(ms);
        if ms == 0 || d * LEASE_TO_SEND_TIMEOUT_RATIO > lease {
            return Err(Fatal::usage(format!(
                "Kafka property {k}={v} must be between 1 and a quarter of --lease ({}), so a round always ends well before its lease expires; prefer --send-timeout",
                humantime::format_duration(lease)
            )));
        }
    }
    Ok(())
}

/// Reads `KEY=VALUE` lines (blank lines and `#` comments skipped).
fn read_properties_file(path: &Path) -> Result<Vec<(String, String)>, Fatal> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        Fatal::usage(format!(
            "cannot read --kafka-properties-file {}: {e}",
            path.display()
        ))
    })?;
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        // Don't echo the line: it may hold a secret.
        let (k, v) = parse_property(line).ok_or_else(|| {
            Fatal::usage(format!(
                "malformed Kafka property on line {} of {}: expected KEY=VALUE",
                n + 1,
                path.display()
            ))
        })?;
        out.push((k, v));
    }
    Ok(out)
}

#[derive(Args, Debug)]
pub struct StatsArgs {
    #[command(flatten)]
    pub db: DbArgs,
    /// Print one JSON object instead of text.
    #[arg(long, env = "OUTBOX_JSON")]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct DeadLettersArgs {
    #[command(flatten)]
    pub db: DbArgs,
    /// At most this many rows.
    #[arg(long, env = "OUTBOX_DEAD_LETTERS_LIMIT", default_value_t = defaults::DEAD_LETTERS_LIMIT)]
    pub limit: i32,
    /// Only ids above this one (paging).
    #[arg(long, env = "OUTBOX_DEAD_LETTERS_AFTER_ID", default_value_t = 0)]
    pub after_id: i64,
    /// Print JSON lines (with payload and headers) instead of a table.
    #[arg(long, env = "OUTBOX_JSON")]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct RequeueArgs {
    #[command(flatten)]
    pub db: DbArgs,
    /// Event ids to requeue.
    #[arg(required_unless_present = "all", conflicts_with = "all")]
    pub ids: Vec<i64>,
    /// Requeue every dead letter (deliberately no environment variable: command line only).
    #[arg(long)]
    pub all: bool,
}

#[derive(Args, Debug)]
pub struct BlockedArgs {
    #[command(flatten)]
    pub db: DbArgs,
    /// At most this many keys.
    #[arg(long, env = "OUTBOX_BLOCKED_LIMIT", default_value_t = defaults::DEAD_LETTERS_LIMIT)]
    pub limit: i32,
    /// Print JSON lines instead of a table.
    #[arg(long, env = "OUTBOX_JSON")]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct RelaysArgs {
    #[command(flatten)]
    pub db: DbArgs,
    /// At most this many relays.
    #[arg(long, env = "OUTBOX_RELAYS_LIMIT", default_value_t = defaults::DEAD_LETTERS_LIMIT)]
    pub limit: i32,
    /// Print JSON lines instead of a table.
    #[arg(long, env = "OUTBOX_JSON")]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct SkipArgs {
    #[command(flatten)]
    pub db: DbArgs,
    /// Ids of dead letters (the head_id that `blocked` lists).
    #[arg(required = true)]
    pub ids: Vec<i64>,
}

#[derive(Args, Debug)]
pub struct PurgeArgs {
    #[command(flatten)]
    pub db: DbArgs,
    /// Delete SUCCESS rows last updated longer ago than this.
    #[arg(long, env = "OUTBOX_PURGE_OLDER_THAN", default_value = "7days", value_parser = parse_duration)]
    pub older_than: Duration,
    /// Rows deleted per call; the command repeats calls until none is left.
    #[arg(long, env = "OUTBOX_PURGE_MAX_ROWS", default_value_t = defaults::PURGE_MAX_ROWS)]
    pub max_rows: i32,
}

#[derive(Args, Debug)]
pub struct TailArgs {
    #[command(flatten)]
    pub kafka: KafkaArgs,
    /// Topic to read (every partition, from offset 0).
    #[arg(long, env = "OUTBOX_TAIL_TOPIC")]
    pub topic: String,
    /// Stop after this long without a new message.
    #[arg(long, env = "OUTBOX_TAIL_IDLE", default_value = "3s", value_parser = parse_duration)]
    pub idle: Duration,
    /// Never stop (ignore --idle).
    #[arg(long, env = "OUTBOX_TAIL_FOLLOW")]
    pub follow: bool,
    /// Print JSON lines instead of text.
    #[arg(long, env = "OUTBOX_JSON")]
    pub json: bool,
}

/// clap's value parser for durations (clap takes the error as text).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| format!("{e} (examples: 500ms, 3s, 10m)"))
}

/// Splits `KEY=VALUE` (both trimmed); None without a `=` or with an empty key.
pub fn parse_property(s: &str) -> Option<(String, String)> {
    match s.split_once('=') {
        Some((k, v)) if !k.trim().is_empty() => Some((k.trim().to_string(), v.trim().to_string())),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(argv: &[&str]) -> Command {
        Cli::try_parse_from(argv).expect("parse").command
    }

    #[test]
    fn defaults_are_the_exported_constants() {
        let Command::Run(a) = parse(&["outbox-worker", "run"]) else {
            unreachable!()
        };
        assert_eq!(a.kafka.brokers, defaults::BROKERS);
        assert_eq!(a.batch_size, defaults::BATCH_SIZE);
        assert_eq!(a.concurrency, defaults::CONCURRENCY);
        assert_eq!(a.poll_interval, defaults::POLL_INTERVAL);
        assert_eq!(a.claim_cooldown, defaults::CLAIM_COOLDOWN);
        assert_eq!(a.lease, defaults::LEASE);
        assert_eq!(a.send_timeout, defaults::SEND_TIMEOUT);
        assert_eq!(a.reclaim_interval, defaults::RECLAIM_INTERVAL);
        assert_eq!(a.heartbeat_timeout(), defaults::HEARTBEAT_TIMEOUT);
        assert_eq!(a.stats_interval, defaults::STATS_INTERVAL);
        assert_eq!(a.live_timeout(), defaults::LIVE_TIMEOUT);
        assert_eq!(a.statement_timeout(), defaults::STATEMENT_TIMEOUT);
        assert_eq!(a.pool_timeout(), defaults::POOL_TIMEOUT);
        assert_eq!(a.shutdown_timeout, defaults::SHUTDOWN_TIMEOUT);
        assert!(a.validate().is_ok());
        let Command::Purge(p) = parse(&["outbox-worker", "purge"]) else {
            unreachable!()
        };
        assert_eq!(p.older_than, defaults::PURGE_OLDER_THAN);
        assert_eq!(p.max_rows, defaults::PURGE_MAX_ROWS);
        let Command::DeadLetters(d) = parse(&["outbox-worker", "dead-letters"]) else {
            unreachable!()
        };
        assert_eq!(d.limit, defaults::DEAD_LETTERS_LIMIT);
        let Command::Tail(t) = parse(&["outbox-worker", "tail", "--topic", "t"]) else {
            unreachable!()
        };
        assert_eq!(t.idle, defaults::TAIL_IDLE);
        assert_eq!(t.kafka.brokers, defaults::BROKERS);
    }

    fn run_args(extra: &[&str]) -> RunArgs {
        let mut argv = vec!["outbox-worker", "run"];
        argv.extend_from_slice(extra);
        match parse(&argv) {
            Command::Run(a) => a,
            _ => unreachable!(),
        }
    }

    #[test]
    fn the_heartbeat_timeout_is_below_the_lease_or_off() {
        assert_eq!(
            run_args(&["--lease", "40s"]).heartbeat_timeout(),
            Duration::from_secs(10),
            "the default is bounded by the lease"
        );
        assert!(run_args(&["--lease", "40s", "--heartbeat-timeout", "39s"])
            .validate()
            .is_ok());
        let e = run_args(&["--lease", "40s", "--heartbeat-timeout", "40s"])
            .validate()
            .expect_err("error");
        assert!(
            e.message.contains("--heartbeat-timeout") && e.message.contains("--lease"),
            "{}",
            e.message
        );
        let e = run_args(&["--heartbeat-timeout", "500ms"])
            .validate()
            .expect_err("error");
        assert!(e.message.contains("at least 600ms"), "{}", e.message);
        let off = run_args(&["--heartbeat-timeout", "0s"]);
        assert!(off.validate().is_ok());
        assert!(off.heartbeat_timeout().is_zero());
    }

    #[test]
    fn send_timeout_must_be_a_quarter_of_the_lease_at_most() {
        assert!(run_args(&["--lease", "4s", "--send-timeout", "1s"])
            .validate()
            .is_ok());
        let e = run_args(&["--lease", "4s", "--send-timeout", "1001ms"])
            .validate()
            .expect_err("error");
        assert!(e.message.contains("--send-timeout") && e.message.contains("--lease"));
        assert!(run_args(&["--send-timeout", "0s"]).validate().is_err());
    }

    #[test]
    fn a_delivery_timeout_property_obeys_the_lease_like_send_timeout() {
        let ok = run_args(&[
            "--lease",
            "40s",
            "--kafka-property",
            "message.timeout.ms=10000",
        ]);
        assert!(ok.producer_properties().is_ok());
        for p in [
            "message.timeout.ms=10001",
            "delivery.timeout.ms=700000",
            "message.timeout.ms=0",
            "delivery.timeout.ms=soon",
        ] {
            let e = run_args(&["--lease", "40s", "--kafka-property", p])
                .producer_properties()
                .expect_err(p);
            assert_eq!(e.code, 2);
            assert!(
                e.message.contains(p.split('=').next().unwrap()),
                "{}",
                e.message
            );
        }
    }

    #[test]
    fn waits_are_bounded_by_the_lease_and_live_by_the_poll_interval() {
        for args in [
            &["--lease", "40s", "--statement-timeout", "11s"][..],
            &["--lease", "40s", "--pool-timeout", "11s"],
            &["--pool-timeout", "0s"],
            &["--shutdown-timeout", "0s"],
            &["--poll-interval", "1m", "--live-timeout", "2m"],
        ] {
            assert!(run_args(args).validate().is_err(), "{args:?}");
        }
        let slow = run_args(&["--poll-interval", "1m"]);
        assert!(slow.validate().is_ok());
        assert_eq!(slow.live_timeout(), Duration::from_secs(126));
        assert!(run_args(&["--statement-timeout", "0s"]).validate().is_ok());
        let short = run_args(&["--lease", "4s", "--send-timeout", "1s"]);
        assert_eq!(short.statement_timeout(), Duration::from_secs(1));
        assert_eq!(short.call_timeout(), Duration::from_secs(6));
        assert_eq!(
            run_args(&["--statement-timeout", "0s"]).call_timeout(),
            Duration::from_secs(600 / 4 + 5),
            "the server's own statement timeout: a quarter of the lease"
        );
        assert_eq!(short.pool_timeout(), Duration::from_secs(1));
    }

    #[test]
    fn a_claim_cooldown_is_at_most_the_poll_interval() {
        assert!(run_args(&["--claim-cooldown", "15ms"]).validate().is_ok());
        assert!(run_args(&["--claim-cooldown", "5s"]).validate().is_ok());
        let e = run_args(&["--claim-cooldown", "6s"])
            .validate()
            .unwrap_err();
        assert_eq!(
            e.message,
            "--claim-cooldown (6s) must be at most --poll-interval (5s)"
        );
    }

    #[test]
    fn kafka_options_are_shared_by_run_and_tail() {
        let p = ["--brokers", "b:1", "--kafka-property", "linger.ms=10"];
        let Command::Tail(t) =
            parse(&[&["outbox-worker", "tail", "--topic", "t"][..], &p].concat())
        else {
            unreachable!()
        };
        let r = run_args(&p);
        for k in [&t.kafka, &r.kafka] {
            assert_eq!(k.brokers, "b:1");
            assert_eq!(
                k.properties().expect("valid"),
                vec![("linger.ms".to_string(), "10".to_string())]
            );
        }
    }

    #[test]
    fn properties_must_be_key_value_and_a_bad_one_is_never_echoed() {
        for bad in ["sasl.password:hunter2", "=hunter2", "hunter2"] {
            let err = run_args(&["--kafka-property", "linger.ms=1", "--kafka-property", bad])
                .producer_properties()
                .expect_err(bad);
            assert_eq!(err.code, 2);
            assert!(
                err.message.contains("malformed Kafka property #2")
                    && err.message.contains("KEY=VALUE"),
                "{}",
                err.message
            );
            assert!(!err.message.contains("hunter2"), "{}", err.message);
        }
    }

    #[test]
    fn properties_that_break_the_guarantees_are_refused_from_flags_and_files() {
        let e = run_args(&["--kafka-property", "acks=1"])
            .producer_properties()
            .expect_err("acks=1");
        assert!(
            e.message.starts_with("Kafka property acks=1 is refused"),
            "{}",
            e.message
        );
        let file = std::env::temp_dir().join(format!("outbox-props-{}", std::process::id()));
        std::fs::write(&file, "# tuned\nenable.idempotence=false\n").expect("write");
        let e = run_args(&["--kafka-properties-file", file.to_str().expect("utf-8")])
            .producer_properties()
            .expect_err("enable.idempotence=false");
        let _ = std::fs::remove_file(&file);
        assert!(
            e.message
                .starts_with("Kafka property enable.idempotence=false is refused"),
            "{}",
            e.message
        );
        assert!(
            run_args(&["--kafka-property", "topic.message.timeout.ms=0"])
                .producer_properties()
                .is_err()
        );
    }
}
