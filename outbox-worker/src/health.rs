//! Health as Kubernetes reads it. `/live`: every claim loop completed a round (successful or not)
//! within the live timeout, so the process is not stuck and a restart would not help otherwise.
//! `/ready`: the last database call succeeded, the broker is reachable, the circuit breaker is
//! closed (open, the relay claims nothing), and the relay is not stopping. The setters are called by the claim loops, the store's callers and whatever watches
//! the broker (the publisher's probe, the rounds' outcomes, a circuit breaker).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

pub struct Health {
    start: Instant,
    /// Per claim loop: milliseconds since `start` when its last round ended.
    rounds: Vec<AtomicU64>,
    live_timeout: Duration,
    db_ok: AtomicBool,
    /// False until a probe or a delivery shows the broker answering.
    broker_ok: AtomicBool,
    /// The circuit breaker is open: no claims, whatever a metadata request says meanwhile.
    breaker_open: AtomicBool,
    stopping: AtomicBool,
    /// The sink's broker as `/ready` and the log name it ("Kafka", "NATS").
    broker: &'static str,
}

impl Health {
    /// `loops` claim loops; `/live` fails once one of them has not ended a round for
    /// `live_timeout` (counted from start-up before the first round). `broker` names the sink's
    /// broker in `/ready`.
    pub fn new(loops: usize, live_timeout: Duration, broker: &'static str) -> Health {
        Health {
            start: Instant::now(),
            rounds: (0..loops).map(|_| AtomicU64::new(0)).collect(),
            live_timeout,
            db_ok: AtomicBool::new(true),
            broker_ok: AtomicBool::new(false),
            breaker_open: AtomicBool::new(false),
            stopping: AtomicBool::new(false),
            broker,
        }
    }

    fn now_ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    /// Claim loop `n` ended a round, or a wait that stands for one (e.g. an open circuit breaker).
    pub fn round_completed(&self, n: usize) {
        if let Some(r) = self.rounds.get(n) {
            r.store(self.now_ms(), Ordering::Relaxed);
        }
    }

    /// Every claim loop counts as having completed a round now: a fleet's database waiting to be
    /// started again waits on purpose, and a restart of the process would not help it.
    pub fn all_rounds_completed(&self) {
        for n in 0..self.rounds.len() {
            self.round_completed(n);
        }
    }

    /// Records whether the last database call succeeded.
    pub fn db_result(&self, ok: bool) {
        self.db_ok.store(ok, Ordering::Relaxed);
    }

    pub fn set_broker_reachable(&self, ok: bool) {
        let was = self.broker_ok.swap(ok, Ordering::Relaxed);
        if was && !ok {
            tracing::warn!(
                "{} unreachable: not ready until it answers again",
                self.broker
            );
        } else if !was && ok {
            tracing::debug!("{} reachable", self.broker);
        }
    }

    pub fn set_breaker_open(&self, open: bool) {
        self.breaker_open.store(open, Ordering::Relaxed);
    }

    pub fn set_stopping(&self) {
        self.stopping.store(true, Ordering::Relaxed);
    }

    pub fn stopping(&self) -> bool {
        self.stopping.load(Ordering::Relaxed)
    }

    pub fn db_ok(&self) -> bool {
        self.db_ok.load(Ordering::Relaxed)
    }

    /// `Ok` when live; otherwise why not.
    pub fn live(&self) -> Result<(), String> {
        let now = self.now_ms();
        let limit = self.live_timeout.as_millis() as u64;
        for (n, r) in self.rounds.iter().enumerate() {
            let idle = now.saturating_sub(r.load(Ordering::Relaxed));
            if idle > limit {
                return Err(format!(
                    "claim loop {n} has not completed a round for {}",
                    humantime::format_duration(Duration::from_millis(idle / 1000 * 1000))
                ));
            }
        }
        Ok(())
    }

    /// `Ok` when ready; otherwise why not.
    pub fn ready(&self) -> Result<(), String> {
        let broker = self.broker;
        if self.stopping() {
            Err("stopping".into())
        } else if !self.db_ok() {
            Err("database unreachable".into())
        } else if self.breaker_open.load(Ordering::Relaxed) {
            Err(format!(
                "{broker} unreachable: circuit breaker open, not claiming"
            ))
        } else if !self.broker_ok.load(Ordering::Relaxed) {
            Err(format!("{broker} unreachable"))
        } else {
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_needs_database_broker_and_no_stop() {
        let h = Health::new(1, Duration::from_secs(60), "NATS");
        assert_eq!(h.ready(), Err("NATS unreachable".into()));
        // A delivery (claim.rs) or an answered probe says reachable; the circuit breaker
        // opening (breaker.rs) says unreachable.
        h.set_broker_reachable(true);
        assert_eq!(h.ready(), Ok(()));
        h.set_broker_reachable(false);
        assert_eq!(h.ready(), Err("NATS unreachable".into()));
        h.set_broker_reachable(true);
        // A metadata request answered while the breaker is open: still not ready.
        h.set_breaker_open(true);
        assert_eq!(
            h.ready(),
            Err("NATS unreachable: circuit breaker open, not claiming".into())
        );
        h.set_breaker_open(false);
        assert_eq!(h.ready(), Ok(()));
        h.db_result(false);
        assert_eq!(h.ready(), Err("database unreachable".into()));
        h.db_result(true);
        h.set_stopping();
        assert_eq!(h.ready(), Err("stopping".into()));
    }

    #[test]
    fn live_needs_every_loop_to_complete_rounds() {
        let h = Health::new(2, Duration::from_millis(50), "Kafka");
        assert!(h.live().is_ok());
        std::thread::sleep(Duration::from_millis(80));
        h.round_completed(0);
        let e = h.live().expect_err("loop 1 is stuck");
        assert!(e.starts_with("claim loop 1 "), "{e}");
        h.round_completed(1);
        assert!(h.live().is_ok());
    }
}
