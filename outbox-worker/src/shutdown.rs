//! SIGTERM/SIGINT: the first one stops claiming (in-flight rows are settled, the producer flushed,
//! exit 0); a second one exits at once with 128 + its number, what a shell reports for a process
//! the signal killed (143 for SIGTERM, 130 for SIGINT): the stop was not clean, held rows are
//! reclaimed once the heartbeat runs out (after their lease with heartbeats off). Either way the
//! stop is bounded: past the shutdown timeout the process exits 1 whatever it was waiting for.

use std::time::Duration;

use tokio::signal::unix::{signal, SignalKind};
use tokio_util::sync::CancellationToken;

/// `on_stop` runs at the first signal (readiness says "stopping" from then on).
pub fn spawn_signal_handler(cancel: CancellationToken, on_stop: impl FnOnce() + Send + 'static) {
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
    tokio::spawn(async move {
        let name = tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        };
        tracing::info!("{name} received: stopping claims, settling in-flight events");
        on_stop();
        cancel.cancel();
        let (name, number) = tokio::select! {
            _ = term.recv() => ("SIGTERM", libc::SIGTERM),
            _ = int.recv() => ("SIGINT", libc::SIGINT),
        };
        tracing::warn!(
            "second {name}: exiting now; events still claimed are reclaimed once this relay's heartbeat runs out (after their lease with heartbeats off)"
        );
        std::process::exit(128 + number);
    });
}

/// Once `cancel` fires (a signal or a failed task), gives the relay `timeout` to stop; then logs
/// and exits 1: a round still in flight (a hung statement or delivery) may leave its rows
/// SENDING until their lease expires, and the supervisor should see that the stop was not clean.
pub fn spawn_deadline(cancel: CancellationToken, timeout: Duration) {
    tokio::spawn(async move {
        cancel.cancelled().await;
        tokio::time::sleep(timeout).await;
        tracing::error!(
            "shutdown timeout ({}) passed with work in flight: exiting now; events still claimed are reclaimed once this relay's heartbeat runs out (after their lease with heartbeats off)",
            humantime::format_duration(timeout)
        );
        std::process::exit(1);
    });
}

/// SIGHUP re-reads `--config` (`fleet.rs`); a relay without one has nothing to re-read, and a
/// reload signal sent to every relay must not stop it.
pub fn ignore_hangup() {
    let mut hup = signal(SignalKind::hangup()).expect("SIGHUP handler");
    tokio::spawn(async move {
        while hup.recv().await.is_some() {
            tracing::info!("SIGHUP ignored: this relay has no --config to re-read");
        }
    });
}
