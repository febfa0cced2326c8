//! The wake-up session: a direct connection (not from the pool, so it holds no pool slot while it
//! waits) that calls `outbox_wait` in a loop and wakes a claim loop whenever events may be
//! claimable. No LISTEN/NOTIFY: NOTIFY would make the producers' commits take turns
//! (docs/reference.md, "Wake-up"). One unnamed statement per wait, so it also works through a
//! transaction-mode pooler. The claim loops keep polling anyway, and it reconnects by itself.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{watch, Notify};
use tokio_postgres::types::{ToSql, Type};
use tokio_util::sync::CancellationToken;

use crate::db::{one_line, Target};

/// Logged (info) once the first wait is about to start, with the server's wake-up mode.
pub const READY: &str = "wake-up ready";

/// How long one `outbox_wait` call may block: it holds a snapshot meanwhile, so keep it short.
const WAIT_TIMEOUT: Duration = Duration::from_secs(1);

/// A call without an answer this long means the connection stopped answering: reconnect.
const ANSWER_TIMEOUT: Duration = WAIT_TIMEOUT.saturating_add(crate::defaults::CALL_MARGIN);

/// One statement's row within [`ANSWER_TIMEOUT`], or why not, in one line.
async fn answer(
    client: &tokio_postgres::Client,
    sql: &str,
    params: &[(&(dyn ToSql + Sync), Type)],
) -> Result<tokio_postgres::Row, String> {
    match tokio::time::timeout(ANSWER_TIMEOUT, client.query_typed_one(sql, params)).await {
        Ok(row) => row.map_err(|e| one_line(&e)),
        Err(_) => Err(format!("no answer within {ANSWER_TIMEOUT:?}")),
    }
}

/// The longest pause after wake-ups that claimed nothing (doubling from 1 ms): a streak means
/// something is due that this relay cannot take (rows locked elsewhere), and `outbox_wait` would
/// answer at once, again and again. One empty round is normal (a claim retiring a key).
const EMPTY_WAKE_PAUSE_MAX: Duration = Duration::from_millis(100);

/// After a wake-up: wakes one claim loop, and one more after every round that filled its batch
/// (an idle loop may help), until a round finds nothing. Waking every loop at once would make the
/// others claim nothing. Whether any round claimed; None once cancelled or the loops are gone.
async fn follow_rounds(
    wake: &Notify,
    rounds: &mut Rounds,
    cancel: &CancellationToken,
) -> Option<bool> {
    let mut claimed_any = false;
    wake.notify_one();
    loop {
        let claimed = tokio::select! {
            _ = cancel.cancelled() => return None,
            r = tokio::time::timeout(WAIT_TIMEOUT, rounds.done.changed()) => match r {
                Ok(Ok(())) => *rounds.done.borrow_and_update(),
                Ok(Err(_)) => return None,
                Err(_) => 0,
            },
        };
        if claimed == 0 {
            return Some(claimed_any);
        }
        claimed_any = true;
        // With one loop the permit would only outlast the round: a claim that finds nothing.
        if claimed >= rounds.full && rounds.loops > 1 {
            wake.notify_one();
        }
    }
}

/// What the wake-up session follows of the claim loops.
pub struct Rounds {
    /// The number of events the last finished round took.
    pub done: watch::Receiver<usize>,
    /// A full batch.
    pub full: usize,
    /// How many claim loops there are.
    pub loops: usize,
}

pub async fn run(
    target: Target,
    schema: String,
    wake: Arc<Notify>,
    mut rounds: Rounds,
    cancel: CancellationToken,
) {
    let mut backoff = Duration::from_millis(500);
    let mut connected_before = false;
    let wait_sql = format!("SELECT {schema}.outbox_wait(make_interval(secs => $1))");
    let mode_sql = format!("SELECT {schema}.outbox_wake_mode()");
    loop {
        match target.connect().await {
            Ok((client, conn)) => {
                let driver = tokio::spawn(conn);
                match answer(&client, &mode_sql, &[]).await {
                    Ok(row) => {
                        let mode: String = row.get(0);
                        if connected_before {
                            tracing::info!("wake-up connection re-established");
                        } else {
                            // "polling": no shared_preload_libraries = 'outbox' (managed
                            // PostgreSQL); waits end within outbox.wait_poll_interval.
                            tracing::info!(mode = %mode, "{READY}");
                        }
                        connected_before = true;
                        backoff = Duration::from_millis(500);
                        // Anything committed while we were not waiting is picked up now.
                        wake.notify_one();
                        let secs = WAIT_TIMEOUT.as_secs_f64();
                        let mut empty_streak: u32 = 0;
                        loop {
                            let params: [(&(dyn ToSql + Sync), Type); 1] = [(&secs, Type::FLOAT8)];
                            let woken = tokio::select! {
                                _ = cancel.cancelled() => { driver.abort(); return; }
                                r = answer(&client, &wait_sql, &params) => r,
                            };
                            match woken {
                                Ok(row) if row.get::<_, bool>(0) => {
                                    tracing::trace!("woken");
                                    rounds.done.borrow_and_update();
                                    let Some(claimed_any) =
                                        follow_rounds(&wake, &mut rounds, &cancel).await
                                    else {
                                        driver.abort();
                                        return;
                                    };
                                    if claimed_any {
                                        empty_streak = 0;
                                        continue;
                                    }
                                    let pause = (Duration::from_millis(1)
                                        * 2u32.pow(empty_streak.min(7)))
                                    .min(EMPTY_WAKE_PAUSE_MAX);
                                    empty_streak += 1;
                                    tokio::select! {
                                        _ = cancel.cancelled() => { driver.abort(); return; }
                                        _ = tokio::time::sleep(pause) => {}
                                    }
                                }
                                Ok(_) => empty_streak = 0,
                                Err(e) => {
                                    tracing::warn!(
                                        "wake-up connection lost ({e}); reconnecting, polling meanwhile"
                                    );
                                    break;
                                }
                            }
                        }
                    }
                    Err(e) => {
                        tracing::warn!("wake-up: outbox_wake_mode() failed: {e}; retrying");
                    }
                }
                driver.abort();
            }
            Err(e) => {
                tracing::warn!(
                    "wake-up connection failed: {}; retrying in {:?}, polling meanwhile",
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
