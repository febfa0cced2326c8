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

#[test]
fn secrets_from_files_are_used_and_never_logged() {
    use std::time::Duration;
    let db = TestDb::create();
    let dir = std::env::temp_dir().join(format!("outbox-secrets-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let url_file = dir.join("db-url");
    std::fs::write(&url_file, format!("{} password=topsecret-db\n", db.url())).expect("write");
    let props = dir.join("kafka.properties");
    std::fs::write(
        &props,
        "# SASL for the broker\nsecurity.protocol=sasl_plaintext\nsasl.mechanism=PLAIN\n\
         sasl.username=relay\nsasl.password=topsecret-kafka\n",
    )
    .expect("write");
    let brokers = format!("127.0.0.1:{}", free_port());
    let mut w = outbox_tests::worker::Worker::spawn_args(&[
        "run",
        "--brokers",
        &brokers,
        "--database-url-file",
        url_file.to_str().expect("utf-8 path"),
        "--kafka-properties-file",
        props.to_str().expect("utf-8 path"),
    ]);
    assert!(
        w.wait_log(&["relay started"], Duration::from_secs(15))
            .is_some(),
        "{}",
        w.logs()
    );
    // Let librdkafka try (and fail) to connect with the SASL settings, then stop.
    w.wait_log(&["librdkafka"], Duration::from_secs(3));
    w.signal(libc::SIGTERM);
    let st = w
        .wait_exit(Duration::from_secs(10))
        .expect("exit after SIGTERM");
    assert!(st.success(), "{}", w.logs());
    let all = w.logs();
    assert!(!all.contains("topsecret"), "a secret was logged: {all}");

    // A malformed line in the properties file is reported by line number, not echoed.
    std::fs::write(&props, "sasl.password topsecret-kafka\n").expect("write");
    let out = run_cmd(&[
        "run",
        "--database-url-file",
        url_file.to_str().expect("utf-8 path"),
        "--kafka-properties-file",
        props.to_str().expect("utf-8 path"),
    ]);
    one_line_failure(&out, &["line 1"]);
    assert!(!String::from_utf8_lossy(&out.stderr).contains("topsecret"));
    let _ = std::fs::remove_dir_all(&dir);
}
