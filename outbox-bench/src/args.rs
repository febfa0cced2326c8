//! The command line: profile, database, output files, sections.

use clap::{Parser, ValueEnum};
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    version,
    about = "Benchmarks of the outbox extension and relay (issue 5)"
)]
pub struct Args {
    /// Quick profile (default): backlogs of 100k-200k events, under 10 minutes.
    #[arg(long, conflicts_with_all = ["long", "smoke"])]
    pub quick: bool,
    /// Long profile: 1M-event backlogs and longer latency runs.
    #[arg(long, conflicts_with = "smoke")]
    pub long: bool,
    /// Smallest case of every harness path, in seconds; fails if any path fails.
    #[arg(long)]
    pub smoke: bool,
    /// Admin connection (the bench creates and drops its own database). Default: PGHOST, PGPORT,
    /// PGUSER, PGPASSWORD or 127.0.0.1:5432 user postgres.
    #[arg(long, env = "OUTBOX_BENCH_DATABASE_URL")]
    pub database_url: Option<String>,
    /// Also write the report to this file (scripts/bench passes reports/BENCHMARKS.md, or
    /// reports/INDEXES.md with `--only indexes`: see reports/README.md).
    #[arg(long)]
    pub output: Option<PathBuf>,
    /// Also write every figure as JSON to this file. Default with `--output X.md`: `X.json`.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Skip everything that needs the broker and the relay.
    #[arg(long)]
    pub no_broker: bool,
    /// Run only these sections (comma-separated). `indexes`, `fairness` and `sinks` are not in
    /// the default set: alone each writes its own report (`scripts/bench --only indexes` writes
    /// reports/INDEXES.md, `--only sinks` reports/sinks/drain.md).
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<Section>,
    /// The null sink's claim loops send unnamed statements, parsed and planned on every call (as
    /// the relay does, for PgBouncer's transaction mode), instead of prepared ones.
    #[arg(long)]
    pub unnamed_statements: bool,
    /// Partitions of the latency section's topics (default 4): a round's events go to Kafka in
    /// one produce request per partition they touch.
    #[arg(long, value_parser = clap::value_parser!(i32).range(1..=1000))]
    pub latency_partitions: Option<i32>,
    /// `--kafka-connections N` for every relay the run starts on Kafka (the relay's default
    /// otherwise): its producers, each with its own broker connections.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub kafka_connections: Option<u16>,
    /// Runs the latency section's default rates on the main server this many times, the rates
    /// taking turns; goals read the run of median commit → append p50 (default 1).
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=20))]
    pub latency_repeat: Option<u16>,
    /// Adds, to each repetition of the latency section's default rates, a run at the goal's rate
    /// with this many plain INSERTs per second beside it (a table no relay reads): the machine
    /// as busy as at a higher rate, the relay's work the same.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=20_000))]
    pub latency_background: Option<u32>,
    /// Print the provenance table (date, checkout, machine, server, settings, load) that every
    /// report starts with, and exit: for reports written by scripts (sql/bench/).
    #[arg(long, conflicts_with_all = ["output", "json", "only"])]
    pub provenance: bool,
    /// With `--provenance`: the load average when the script started (`/proc/loadavg`).
    #[arg(long, requires = "provenance")]
    pub load_start: Option<String>,
}

impl Args {
    /// Where the JSON figures go, if anywhere.
    /// Whether section `s` runs: the selected ones, else all but `indexes`, which only the smoke
    /// run adds (its report is INDEXES.md, not BENCHMARKS.md).
    pub fn wants(&self, s: Section) -> bool {
        if self.only.is_empty() {
            !matches!(s, Section::Indexes | Section::Fairness | Section::Sinks) || self.smoke
        } else {
            self.only.contains(&s)
        }
    }

    /// `--only indexes`, `fairness` or `sinks`: the run writes that section's own report instead
    /// of the benchmark report.
    pub fn own_report(&self) -> Option<Section> {
        match self.only.as_slice() {
            [s @ (Section::Indexes | Section::Fairness | Section::Sinks)] => Some(*s),
            _ => None,
        }
    }

    /// The selection flags of this run as `scripts/bench` takes them (for the report's header).
    pub fn flags(&self) -> String {
        let mut s = String::new();
        if self.no_broker {
            s += " --no-broker";
        }
        if self.unnamed_statements {
            s += " --unnamed-statements";
        }
        if let Some(n) = self.latency_partitions {
            s += &format!(" --latency-partitions {n}");
        }
        if let Some(n) = self.kafka_connections {
            s += &format!(" --kafka-connections {n}");
        }
        if let Some(n) = self.latency_repeat {
            s += &format!(" --latency-repeat {n}");
        }
        if let Some(n) = self.latency_background {
            s += &format!(" --latency-background {n}");
        }
        if !self.only.is_empty() {
            let names: Vec<String> = self
                .only
                .iter()
                .filter_map(|x| x.to_possible_value().map(|v| v.get_name().to_string()))
                .collect();
            s += &format!(" --only {}", names.join(","));
        }
        s
    }

    pub fn json_path(&self) -> Option<PathBuf> {
        self.json
            .clone()
            .or_else(|| self.output.as_ref().map(|o| o.with_extension("json")))
    }
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum, Debug)]
pub enum Section {
    Enqueue,
    Drain,
    Health,
    Contention,
    Seed,
    Broker,
    Latency,
    /// Per-key order: ordered vs unordered drain to the broker, claim cost at a hot key.
    Ordering,
    /// Idle relay's CPU on the database server, both wake-up modes (issue 10).
    Idle,
    /// Partial vs the seed's composite indexes (reports/INDEXES.md).
    Indexes,
    /// The life cycle of an event: WAL per phase, drain rate and size, per schema version (issue 9).
    Lifecycle,
    /// Long transactions: steady load with a REPEATABLE READ transaction held open (issue 9).
    #[value(name = "held_snapshot", alias = "held-snapshot")]
    HeldSnapshot,
    /// Two databases on one relay, one with a backlog (reports/FAIRNESS.md).
    Fairness,
    /// The consumer's inbox: accept vs a plain INSERT, WAL per accept (issue 31).
    Inbox,
    /// The drain to each sink: Kafka, NATS JetStream, RocketMQ (reports/sinks/drain.md).
    Sinks,
}
