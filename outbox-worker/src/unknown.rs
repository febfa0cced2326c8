//! Publish failures with a code the relay does not classify (`FailureClass::Unknown`): neither
//! known to be the event's fault nor the broker's. Each event gets a grace of a few such failures,
//! released without an attempt in case the broker is at fault; every later one counts as an
//! attempt, so the event dead-letters in the end instead of being retried unseen forever.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// At most this many events are tracked; past it (after dropping stale entries) a new event gets
/// no grace: its attempts count at once, the bounded side.
const MAX_TRACKED: usize = 100_000;

/// An entry not touched for this long is dropped when the map is full (its event was delivered
/// or settled by another relay).
const STALE: Duration = Duration::from_secs(600);

struct Seen {
    failures: u32,
    last: Instant,
}

/// Unknown failures per event id, in this relay's memory (a restart starts them again: at most
/// `grace` releases per event and relay process).
pub struct UnknownErrors {
    grace: u32,
    seen: Mutex<HashMap<i64, Seen>>,
}

impl UnknownErrors {
    pub fn new(grace: u32) -> UnknownErrors {
        UnknownErrors {
            grace,
            seen: Mutex::new(HashMap::new()),
        }
    }

    /// Records one unknown failure of event `id`. Returns its count when it is within the grace
    /// (release it without an attempt), None once past it (count the attempt).
    pub fn within_grace(&self, id: i64) -> Option<u32> {
        let mut seen = self.seen.lock().expect("unknown errors");
        if seen.len() >= MAX_TRACKED && !seen.contains_key(&id) {
            seen.retain(|_, s| s.last.elapsed() < STALE);
            if seen.len() >= MAX_TRACKED {
                return None;
            }
        }
        let s = seen.entry(id).or_insert(Seen {
            failures: 0,
            last: Instant::now(),
        });
        s.failures += 1;
        s.last = Instant::now();
        (s.failures <= self.grace).then_some(s.failures)
    }

    /// Forgets events that were delivered or became dead letters.
    pub fn forget(&self, ids: impl IntoIterator<Item = i64>) {
        let mut seen = self.seen.lock().expect("unknown errors");
        if seen.is_empty() {
            return;
        }
        for id in ids {
            seen.remove(&id);
        }
    }

    pub fn grace(&self) -> u32 {
        self.grace
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_is_released_within_the_grace_then_counted() {
        let u = UnknownErrors::new(3);
        assert_eq!(u.within_grace(7), Some(1));
        assert_eq!(u.within_grace(7), Some(2));
        assert_eq!(u.within_grace(8), Some(1), "per event");
        assert_eq!(u.within_grace(7), Some(3));
        assert_eq!(u.within_grace(7), None);
        assert_eq!(u.within_grace(7), None, "every later failure counts");
        u.forget([7]);
        assert_eq!(u.within_grace(7), Some(1), "a delivered event starts again");
    }

    #[test]
    fn a_full_map_gives_no_grace() {
        let u = UnknownErrors::new(3);
        for id in 0..MAX_TRACKED as i64 {
            assert_eq!(u.within_grace(id), Some(1));
        }
        assert_eq!(u.within_grace(-1), None, "no room: counted at once");
        assert_eq!(
            u.within_grace(0),
            Some(2),
            "tracked events keep their count"
        );
    }

    #[test]
    fn no_grace_counts_every_failure() {
        assert_eq!(UnknownErrors::new(0).within_grace(1), None);
    }
}
