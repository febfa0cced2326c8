//! The fault runner's CI profile (issue 4): K = 3 workers, E = 20k events, SIGKILLs every few
//! seconds, one zombie, one broker outage, one broker restart, pg_terminate_backend of the
//! workers' connections, poison events. Prints the report; fails on any broken invariant.
//! `OUTBOX_FAULT_SEED` replays a seed (timings still differ between runs).

use outbox_tests::fault::{run, seed_from_env, Profile};

#[test]
fn fault_suite_ci_profile() {
    let report = run(&Profile::ci(seed_from_env()));
    println!("{report}");
    eprintln!("{report}");
    assert!(
        report.ok(),
        "fault run broke invariants (replay: OUTBOX_FAULT_SEED={}): {:?}",
        report.seed,
        report.violations()
    );
    assert!(report.kills >= 5, "only {} kills", report.kills);
    assert!(report.zombie.is_some(), "no zombie was made");
    assert_eq!(report.restarts, 1);
    assert!(report.committed >= 20_000);
    assert_eq!(
        report.acks_audited, report.success_rows,
        "the ack audit must see every row turn SUCCESS"
    );
}
