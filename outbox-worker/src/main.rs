//! `outbox-worker`: parses the command line and hands it to the library (`lib.rs`).

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    outbox_worker::execute(outbox_worker::cli::Cli::parse())
}
