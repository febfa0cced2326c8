//! The relay's long-running tasks (claim loops, reclaimer, stats poller, wake-up session) under
//! one supervisor. Each runs until the shared cancellation token fires. One that fails, panics or
//! stops on its own cancels the others, which settle their in-flight rows, and the relay then
//! exits non-zero so that its supervisor (systemd, Kubernetes) restarts it: a relay with a dead
//! claim loop would otherwise go on looking healthy while nothing is delivered.

use std::collections::HashMap;
use std::future::Future;

use tokio::task::{Id, JoinError, JoinSet};
use tokio_util::sync::CancellationToken;

use crate::error::DbError;
use crate::Fatal;

pub struct Tasks {
    set: JoinSet<Result<(), DbError>>,
    names: HashMap<Id, String>,
    cancel: CancellationToken,
}

impl Tasks {
    /// Tasks that stop when `cancel` fires; a failing task fires it too.
    pub fn new(cancel: CancellationToken) -> Tasks {
        Tasks {
            set: JoinSet::new(),
            names: HashMap::new(),
            cancel,
        }
    }

    /// Starts a task; `name` (e.g. "claim loop 0") names it in the failure message.
    pub fn spawn<F>(&mut self, name: impl Into<String>, task: F)
    where
        F: Future<Output = Result<(), DbError>> + Send + 'static,
    {
        // A fleet's database runs in a span naming it: its tasks' lines carry the name.
        let handle = self.set.spawn(tracing::Instrument::in_current_span(task));
        self.names.insert(handle.id(), name.into());
    }

    /// Waits for every task. Returns the first failure (after the others have stopped); later
    /// failures with another cause are logged.
    pub async fn join(mut self) -> Result<(), Fatal> {
        let mut first: Option<(String, Fatal)> = None;
        while let Some(res) = self.set.join_next_with_id().await {
            let (id, failure) = match res {
                Ok((_, Ok(()))) if self.cancel.is_cancelled() => continue,
                Ok((id, Ok(()))) => (id, Fatal::runtime("stopped unexpectedly")),
                Ok((id, Err(e))) => (id, failure(&e)),
                Err(e) => (e.id(), join_failure(e)),
            };
            let name = self.names.get(&id).map_or("a task", String::as_str);
            let message = format!("{name} {}", failure.message);
            match &first {
                None => {
                    self.cancel.cancel();
                    first = Some((
                        failure.message,
                        Fatal {
                            message,
                            code: failure.code,
                        },
                    ));
                }
                // Several claim loops meeting the same revoked grant: one line is enough.
                Some((cause, _)) if *cause == failure.message => {}
                Some(_) => tracing::error!("{message}"),
            }
        }
        match first {
            None => Ok(()),
            Some((_, fatal)) => Err(fatal),
        }
    }
}

/// A task's database error: a configuration error (exit 2) or, should a task ever give up on a
/// transient one, a runtime failure (exit 1).
fn failure(e: &DbError) -> Fatal {
    if e.is_retriable() {
        Fatal::runtime(format!("failed: {e}"))
    } else {
        Fatal::usage(format!(
            "stopped: {e}; a configuration error (the relay's database role, its grants or settings), not retried"
        ))
    }
}

fn join_failure(e: JoinError) -> Fatal {
    if !e.is_panic() {
        return Fatal::runtime("was aborted");
    }
    let payload = e.into_panic();
    let text = payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".to_string());
    Fatal::runtime(format!("panicked: {text}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A task that runs until cancelled, like the claim loops.
    fn until_cancelled(cancel: &CancellationToken) -> impl Future<Output = Result<(), DbError>> {
        let cancel = cancel.clone();
        async move {
            cancel.cancelled().await;
            Ok(())
        }
    }

    #[tokio::test]
    async fn cancelled_tasks_end_cleanly() {
        let cancel = CancellationToken::new();
        let mut tasks = Tasks::new(cancel.clone());
        tasks.spawn("claim loop 0", until_cancelled(&cancel));
        tasks.spawn("reclaimer", until_cancelled(&cancel));
        cancel.cancel();
        assert!(tasks.join().await.is_ok());
    }

    #[tokio::test]
    async fn a_panicking_task_stops_the_others_and_fails() {
        let cancel = CancellationToken::new();
        let mut tasks = Tasks::new(cancel.clone());
        tasks.spawn("claim loop 0", until_cancelled(&cancel));
        tasks.spawn("stats poller", async {
            tokio::time::sleep(Duration::from_millis(10)).await;
            panic!("boom");
        });
        let e = tokio::time::timeout(Duration::from_secs(5), tasks.join())
            .await
            .expect("the other task was cancelled")
            .expect_err("failure");
        assert_eq!(e.code, 1);
        assert_eq!(e.message, "stats poller panicked: boom");
        assert!(cancel.is_cancelled());
    }

    #[tokio::test]
    async fn a_task_that_stops_on_its_own_is_a_failure() {
        let cancel = CancellationToken::new();
        let mut tasks = Tasks::new(cancel.clone());
        tasks.spawn("claim loop 0", until_cancelled(&cancel));
        tasks.spawn("wake-up session", async { Ok(()) });
        let e = tasks.join().await.expect_err("failure");
        assert_eq!(e.code, 1);
        assert_eq!(e.message, "wake-up session stopped unexpectedly");
    }

    #[tokio::test]
    async fn a_transient_database_error_that_ends_a_task_is_a_runtime_failure() {
        let cancel = CancellationToken::new();
        let mut tasks = Tasks::new(cancel.clone());
        tasks.spawn("reclaimer", async {
            Err(DbError::Connect(deadpool_postgres::PoolError::Closed))
        });
        let e = tasks.join().await.expect_err("failure");
        assert_eq!(e.code, 1);
        assert!(e
            .message
            .starts_with("reclaimer failed: no database connection"));
    }
}
