//! The fault runner's CI profile (issue 4): K = 3 workers, E = 20k events, SIGKILLs every few
//! seconds, one zombie, one broker outage, one broker restart, pg_terminate_backend of the
//! workers' connections, poison events. Prints the report; fails on any broken invariant.
//! `OUTBOX_FAULT_SEED` replays a seed (timings still differ between runs).

use outbox_tests::fault::{clock_seed, run, Profile};

#[test]
fn fault_suite_ci_profile() {
    let seed = std::env::var("OUTBOX_FAULT_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(clock_seed);
    let report = run(&Profile::ci(seed));
    println!("{report}");
    eprintln!("{report}");
    assert!(
        report.ok(),
        "fault run broke invariants: {:?}",
        report.violations()
    );
    assert!(report.kills >= 5, "only {} kills", report.kills);
    assert!(report.zombie.is_some(), "no zombie was made");
    assert_eq!(report.restarts, 1);
    assert!(report.committed >= 20_000);
}
