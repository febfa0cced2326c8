//! `outbox-bench`: throughput, latency and cost of the outbox, side by side with the seed design,
//! in one run on one machine. Prints a markdown report (and writes it with `--output`).
//!
//! Profiles: `--quick` (default, under 10 minutes), `--long` (1M-event backlogs), `--smoke` (every
//! harness path with tiny sizes, in seconds; exits non-zero if any path fails, for the test suite).

/// Progress line on stderr, prefixed with the seconds since the bench started.
macro_rules! progress {
    ($($arg:tt)*) => {
        eprintln!("[{:6.1}s] {}", $crate::started().elapsed().as_secs_f64(), format_args!($($arg)*))
    };
}

static STARTED: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();

pub fn started() -> Instant {
    *STARTED.get_or_init(Instant::now)
}

mod args;
mod arrivals;
mod broker_drain;
mod contention;
mod cost;
mod db;
mod enqueue;
mod ext_rels;
mod fairness;
mod goals;
mod health;
mod held_snapshot;
mod hot_key;
mod idle;
mod inbox;
mod indexes;
mod latency;
mod lifecycle;
mod null_sink;
mod ordering;
mod polling;
mod profile;
mod relay_env;
mod report;
mod results;
mod seed;
mod sinks;
mod stages;
mod suite;
mod sys;
mod wal;

use anyhow::Result;
use clap::Parser;
use std::process::ExitCode;
use std::time::Instant;

use outbox_tests::db::{try_connect, TestDb};
use outbox_tests::provenance;

use crate::null_sink::Statements;

pub use crate::args::{Args, Section};
pub use crate::profile::Profile;

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    started();
    match run(&args).await {
        Ok(failures) if failures.is_empty() => ExitCode::SUCCESS,
        Ok(failures) => {
            for f in failures {
                eprintln!("outbox-bench: FAILED: {f}");
            }
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("outbox-bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: &Args) -> Result<Vec<String>> {
    let mut profile = if args.smoke {
        Profile::smoke()
    } else if args.long {
        Profile::long()
    } else {
        Profile::quick()
    };
    if args.unnamed_statements {
        profile.statements = Statements::Unnamed;
    }
    if let Some(n) = args.latency_partitions {
        profile.latency_partitions = n;
    }
    if let Some(n) = args.latency_repeat {
        profile.latency_repeat = usize::from(n);
    }
    profile.latency_background = args.latency_background.map(f64::from);
    let server = db::server(args.database_url.as_deref())?;
    if args.provenance {
        let load_start = args.load_start.clone().unwrap_or_else(provenance::loadavg);
        let c = try_connect(&format!("{server} dbname=postgres")).await?;
        print!("{}", provenance::table(&c, &load_start, &[]).await?);
        return Ok(Vec::new());
    }
    let db = TestDb::create_on(&server, "outbox_bench");
    progress!(
        "==> outbox-bench {} profile, database {}",
        profile.name,
        db.name
    );
    let workdir = std::env::temp_dir().join(&db.name);
    std::fs::create_dir_all(&workdir)?;
    let res = tokio::select! {
        r = suite::run(args, &profile, &db, &workdir) => r,
        _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted")),
    };
    drop(db);
    let res = res?;
    if res.is_empty() {
        let _ = std::fs::remove_dir_all(&workdir);
    } else {
        eprintln!("outbox-bench: logs kept in {}", workdir.display());
    }
    Ok(res)
}
