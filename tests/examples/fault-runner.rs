//! Runs the fault suite by hand and prints its report; exits 1 if an invariant broke.
//!
//! cargo run --release -p outbox-tests --example fault-runner -- --profile long [--seed N]
//!     [--events N] [--workers K] [--send-timeout-ms MS] [--lease-ms MS] [--max-retry N]
//!     [--batch-size N] [--output reports/FAULTS.md]
//!
//! Without `--seed`, `OUTBOX_FAULT_SEED` or else the clock gives the seed; the run prints it.

use outbox_tests::fault::{doc, run, seed_from_env, Profile};
use outbox_tests::{db, provenance};

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
        .unwrap_or_else(seed_from_env);
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
    let load_start = provenance::loadavg();
    let report = run(&p);
    println!("{report}");
    if let Some(path) = get("--output") {
        let machine = machine(&load_start);
        std::fs::write(&path, doc::render(&p, &report, &args, &machine))
            .unwrap_or_else(|e| panic!("writing {path}: {e}"));
        eprintln!("wrote {path}");
    }
    std::process::exit(if report.ok() { 0 } else { 1 });
}

/// The report's provenance table, from the server the run used.
fn machine(load_start: &str) -> String {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    rt.block_on(async {
        let c = db::connect(&format!("{} dbname=postgres", db::server_params())).await;
        provenance::table(&c, load_start, &[])
            .await
            .unwrap_or_else(|e| format!("(could not query the server: {e})\n"))
    })
}
