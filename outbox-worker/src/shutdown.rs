//! SIGTERM/SIGINT: the first one stops claiming (in-flight rows are settled, the producer flushed,
//! exit 0); a second one exits at once (held rows are reclaimed after their lease).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use tokio::signal::unix::{signal, SignalKind};
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;

pub fn spawn_signal_handler(cancel: CancellationToken, metrics: Arc<Metrics>) {
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
    tokio::spawn(async move {
        let name = tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        };
        tracing::info!("{name} received: stopping claims, settling in-flight events");
        metrics.stopping.store(true, Ordering::Relaxed);
        cancel.cancel();
        let name = tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        };
        tracing::warn!(
            "second {name}: exiting now; events still claimed are reclaimed after their lease"
        );
        std::process::exit(130);
    });
}
