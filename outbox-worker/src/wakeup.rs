//! The `LISTEN outbox` session: a direct connection (not from the pool, so it also works when the
//! pool goes through a transaction-mode pooler) that reconnects by itself. Each notification bumps
//! a counter the claim loops watch; the loops keep polling anyway in case one is lost.

use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::{mpsc, watch};
use tokio_postgres::AsyncMessage;
use tokio_util::sync::CancellationToken;

use crate::db::{one_line, Target};

pub const CHANNEL: &str = "outbox";

pub async fn listen(target: Target, wake: watch::Sender<u64>, cancel: CancellationToken) {
    let mut backoff = Duration::from_millis(500);
    let mut connected_before = false;
    loop {
        match target.cfg.connect(target.tls.clone()).await {
            Ok((client, mut conn)) => {
                let (tx, mut rx) = mpsc::unbounded_channel::<Result<(), String>>();
                let driver = tokio::spawn(async move {
                    let mut stream = futures_util::stream::poll_fn(move |cx| conn.poll_message(cx));
                    while let Some(msg) = stream.next().await {
                        match msg {
                            Ok(AsyncMessage::Notification(_)) => {
                                if tx.send(Ok(())).is_err() {
                                    return;
                                }
                            }
                            Ok(_) => {}
                            Err(e) => {
                                let _ = tx.send(Err(one_line(&e)));
                                return;
                            }
                        }
                    }
                    let _ = tx.send(Err("connection closed".to_string()));
                });
                match client.batch_execute(&format!("LISTEN {CHANNEL}")).await {
                    Ok(()) => {
                        if connected_before {
                            tracing::info!("LISTEN {CHANNEL} connection re-established");
                        } else {
                            tracing::debug!("listening for NOTIFY {CHANNEL}");
                        }
                        connected_before = true;
                        backoff = Duration::from_millis(500);
                        // Anything committed while we were not listening is picked up now.
                        wake.send_modify(|g| *g = g.wrapping_add(1));
                        loop {
                            tokio::select! {
                                _ = cancel.cancelled() => { driver.abort(); return; }
                                msg = rx.recv() => match msg {
                                    Some(Ok(())) => {
                                        tracing::trace!("NOTIFY {CHANNEL}");
                                        wake.send_modify(|g| *g = g.wrapping_add(1));
                                    }
                                    Some(Err(e)) => {
                                        tracing::warn!("LISTEN connection lost ({e}); reconnecting, polling meanwhile");
                                        break;
                                    }
                                    None => break,
                                }
                            }
                        }
                    }
                    Err(e) => {
                        tracing::warn!("LISTEN {CHANNEL} failed: {}; retrying", one_line(&e));
                    }
                }
                driver.abort();
            }
            Err(e) => {
                tracing::warn!(
                    "LISTEN connection failed: {}; retrying in {:?}, polling meanwhile",
                    one_line(&e),
                    backoff
                );
            }
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(Duration::from_secs(30));
    }
}
