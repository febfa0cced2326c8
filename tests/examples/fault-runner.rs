//! Runs the fault suite by hand and prints its report; exits 1 if an invariant broke.
//!
//! cargo run --release -p outbox-tests --example fault-runner -- --profile long [--seed N]
//!     [--events N] [--workers K]

use outbox_tests::fault::{clock_seed, run, Profile};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let get = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let seed = get("--seed")
        .map(|s| s.parse().expect("--seed N"))
        .unwrap_or_else(clock_seed);
    let mut p = match get("--profile").as_deref().unwrap_or("ci") {
        "ci" => Profile::ci(seed),
        "long" => Profile::long(seed),
        other => {
            eprintln!("unknown profile {other}: ci or long");
            std::process::exit(2);
        }
    };
    if let Some(e) = get("--events") {
        p.events = e.parse().expect("--events N");
    }
    if let Some(k) = get("--workers") {
        p.workers = k.parse().expect("--workers K");
    }
    let report = run(&p);
    println!("{report}");
    std::process::exit(if report.ok() { 0 } else { 1 });
}
