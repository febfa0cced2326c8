//! Bad start-up inputs: each exits non-zero with one clear line on stderr, and never prints a
//! password.

use std::process::Output;

use outbox_tests::broker::free_port;
use outbox_tests::db::TestDb;
use outbox_tests::worker::run_cmd;

fn one_line_failure(out: &Output, must_contain: &[&str]) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "expected failure, got success: {stderr}"
    );
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "exactly one line expected, got: {stderr}");
    for m in must_contain {
        assert!(lines[0].contains(m), "{:?} should mention {m:?}", lines[0]);
    }
}

#[test]
fn unreachable_database() {
    let port = free_port();
    let url = format!("postgres://postgres:hunter2@127.0.0.1:{port}/nowhere?connect_timeout=3");
    let out = run_cmd(&["run", "--database-url", &url]);
    one_line_failure(&out, &["cannot connect to the database", &port.to_string()]);
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!all.contains("hunter2"), "password leaked: {all}");
}

#[test]
fn database_without_the_extension() {
    let db = TestDb::create();
    db.psql("DROP EXTENSION outbox");
    let out = run_cmd(&["run", "--database-url", &db.url()]);
    one_line_failure(&out, &["outbox extension is not installed", &db.name]);
}

#[test]
fn send_timeout_not_well_below_lease() {
    let db = TestDb::create();
    let out = run_cmd(&[
        "run",
        "--database-url",
        &db.url(),
        "--send-timeout",
        "5s",
        "--lease",
        "10s",
    ]);
    one_line_failure(&out, &["--send-timeout", "--lease"]);
}

#[test]
fn malformed_kafka_property() {
    let db = TestDb::create();
    let out = run_cmd(&[
        "run",
        "--database-url",
        &db.url(),
        "--kafka-property",
        "linger.ms",
    ]);
    one_line_failure(&out, &["malformed Kafka property", "linger.ms"]);
}

#[test]
fn unknown_kafka_property() {
    let db = TestDb::create();
    let out = run_cmd(&[
        "run",
        "--database-url",
        &db.url(),
        "--kafka-property",
        "no.such.thing=1",
    ]);
    one_line_failure(&out, &["invalid Kafka property", "no.such.thing"]);
}

#[test]
fn missing_database_url() {
    let out = std::process::Command::new(outbox_tests::worker::worker_bin())
        .arg("run")
        .env_remove("OUTBOX_DATABASE_URL")
        .output()
        .expect("run");
    one_line_failure(&out, &["OUTBOX_DATABASE_URL"]);
}
