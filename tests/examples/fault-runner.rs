//! Runs the fault suite by hand and prints its report; exits 1 if an invariant broke.
//!
//! cargo run --release -p outbox-tests --example fault-runner -- --profile long [--seed N]
//!     [--events N] [--workers K] [--send-timeout-ms MS] [--lease-ms MS] [--max-retry N]
//!     [--batch-size N]

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
    let ms = |s: String| std::time::Duration::from_millis(s.parse().expect("milliseconds"));
    if let Some(v) = get("--send-timeout-ms") {
        p.send_timeout = ms(v);
    }
    if let Some(v) = get("--lease-ms") {
        p.lease = ms(v);
    }
    if let Some(v) = get("--max-retry") {
        p.max_retry = v.parse().expect("--max-retry N");
    }
    if let Some(v) = get("--batch-size") {
        p.batch_size = v.parse().expect("--batch-size N");
    }
    let report = run(&p);
    println!("{report}");
    std::process::exit(if report.ok() { 0 } else { 1 });
}
