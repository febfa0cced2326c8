//! The relay from the `outbox` extension's table to Kafka, and the operator commands, as a
//! library: the `outbox-worker` binary only parses its command line and calls [`execute`].
//! Tests and benchmarks import the relay's defaults and wire names from here instead of copying
//! them.

pub mod admin;
pub mod breaker;
pub mod broker_tls;
pub mod claim;
pub mod cli;
pub mod config;
pub mod db;
pub mod defaults;
pub mod error;
pub mod fleet;
pub mod guarantees;
pub mod health;
pub mod hosts;
pub mod kafka_metrics;
pub mod lanes;
pub mod logging;
pub mod maintenance;
pub mod message;
pub mod metrics;
pub mod nats;
pub mod publisher;
pub mod relay;
pub mod rocketmq;
pub mod shutdown;
pub mod sink;
pub mod store;
pub mod tasks;
pub mod tls;
pub mod unknown;
pub mod wakeup;

use std::process::ExitCode;

use cli::{Cli, Command, InboxCommand, LogFormat};

pub use message::{
    HEADER_EVENT_ID, HEADER_EVENT_KEY, HEADER_EVENT_TYPE, HEADER_OUTBOX_ID, RESERVED_HEADERS,
};
pub use wakeup::READY as WAKEUP_READY;

/// A reason to stop with one line on stderr.
#[derive(Debug)]
pub struct Fatal {
    pub message: String,
    /// 2: bad configuration or usage; 1: the database or broker failed.
    pub code: u8,
}

impl Fatal {
    pub fn usage(m: impl Into<String>) -> Fatal {
        Fatal {
            message: m.into(),
            code: 2,
        }
    }
    pub fn runtime(m: impl Into<String>) -> Fatal {
        Fatal {
            message: m.into(),
            code: 1,
        }
    }
}

/// Runs one parsed command line to the end: sets up logging and the runtime, runs the command,
/// prints a failure as one line on stderr and returns the exit code.
pub fn execute(cli: Cli) -> ExitCode {
    let json = cli.log_format == LogFormat::Json;
    if let Err(e) = logging::init(cli.log_level.as_deref(), cli.log_format) {
        eprintln!("outbox-worker: error: {e}");
        return ExitCode::from(2);
    }

    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("outbox-worker: error: cannot start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    let result = rt.block_on(async move {
        match cli.command {
            Command::Run(a) => relay::run(a).await,
            Command::Stats(a) => admin::stats(a).await,
            Command::DeadLetters(a) => admin::dead_letters(a).await,
            Command::Requeue(a) => admin::requeue(a).await,
            Command::Blocked(a) => admin::blocked(a).await,
            Command::Skip(a) => admin::skip(a).await,
            Command::Relays(a) => admin::relays(a).await,
            Command::Purge(a) => admin::purge(a).await,
            Command::Inbox(InboxCommand::Stats(a)) => admin::inbox_stats(a).await,
            Command::Tail(a) => tokio::task::spawn_blocking(move || admin::tail(a))
                .await
                .unwrap_or_else(|e| Err(Fatal::runtime(format!("tail: {e}")))),
        }
    });
    // Don't wait for detached tasks (e.g. a connection being driven) at exit.
    rt.shutdown_timeout(std::time::Duration::from_millis(200));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => {
            // In JSON, the last line is a JSON object like every other one.
            if json {
                tracing::error!(exit_code = f.code, "{}", f.message);
            } else {
                eprintln!("outbox-worker: error: {}", f.message);
            }
            ExitCode::from(f.code)
        }
    }
}
