//! `reports/FAULTS.md` as the fault runner writes it: a fixed intro, the machine, the profile that
//! ran (from the `Profile` itself, not restated) and the run's report. Judgments and history are hand-written
//! in `docs/fault-findings.md`.

use std::fmt::Write as _;
use std::time::Duration;

use super::{Profile, Report};

const INTRO: &str = "\
# Fault run: the latest report

Written by the fault runner, not by hand; to write it again:

    cargo run --release -p outbox-tests --example fault-runner -- --profile long --output reports/FAULTS.md

The runner commits events from concurrent producers while `outbox-worker` relays are SIGKILLed,
frozen as a zombie, cut off from PostgreSQL and from a stopped or restarted Apache Kafka broker,
then reads every topic back and checks the delivery guarantee (see `tests/src/fault/mod.rs`).
Exit status 1 and `RESULT: FAIL` when an invariant broke (the file is written either way). What the
runner checks and why, earlier runs and the findings they led to: [fault-findings.md](../docs/fault-findings.md).
The CI profile of the same runner is the test `tests/tests/fault_ci.rs`.
";

/// The whole file for one run started with `args` (the example's command line), on the machine
/// that `machine` (a provenance table) describes.
pub fn render(p: &Profile, report: &Report, args: &[String], machine: &str) -> String {
    let ms = |d: Duration| format!("{} ms", d.as_millis());
    let at =
        |d: Option<Duration>| d.map_or("never".to_string(), |d| format!("t = {} s", d.as_secs()));
    let mut s = String::from(INTRO);
    let _ = write!(s, "\n## Machine\n\n{machine}");
    let _ = writeln!(
        s,
        "\n## The run\n\n`fault-runner {}` (seed {}; `--seed {}` replays its sizes, victims and \
         schedule, the machine's timing differs)\n",
        args.join(" "),
        p.seed,
        p.seed
    );
    let rows: [(&str, String); 17] = [
        ("relays (K)", p.workers.to_string()),
        ("committed events (E)", p.events.to_string()),
        ("producer sessions", p.producers.to_string()),
        ("commits spread over", ms(p.produce_over)),
        ("events per transaction", format!("1..={}", p.tx_max)),
        ("transactions rolled back", format!("{} %", p.rollback_pct)),
        (
            "poison transactions",
            format!("{} × {} events", p.poison_txs, p.poison_per_tx),
        ),
        (
            "SIGKILL of a relay",
            format!("every {} (at least {})", ms(p.kill_every), p.min_kills),
        ),
        ("zombie", at(p.zombie_at)),
        (
            "broker outage",
            format!("{}, for {}", at(p.outage_at), ms(p.outage_for)),
        ),
        ("broker restart", at(p.restart_at)),
        ("pg_terminate_backend", format!("{:?}", p.terminate_at)),
        (
            "--lease / --send-timeout",
            format!("{} / {}", ms(p.lease), ms(p.send_timeout)),
        ),
        (
            "--reclaim-interval / --poll-interval",
            format!("{} / {}", ms(p.reclaim_interval), ms(p.poll_interval)),
        ),
        (
            "--batch-size / --concurrency",
            format!("{} / {}", p.batch_size, p.concurrency),
        ),
        ("outbox.max_retry", p.max_retry.to_string()),
        (
            "outbox.backoff_base / backoff_max",
            format!("{} / {}", ms(p.backoff_base), ms(p.backoff_max)),
        ),
    ];
    let _ = writeln!(s, "| profile {} | |\n|---|---|", p.name);
    for (k, v) in rows {
        let _ = writeln!(s, "| {k} | {v} |");
    }
    let _ = writeln!(s, "\n## The report\n\n```\n{}```", report);
    s
}
