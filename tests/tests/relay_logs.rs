//! `--log-format json`: every line the relay writes is one JSON object with level, target and
//! message, librdkafka's lines included, and so is the final error line.

use std::time::Duration;

use outbox_tests::broker::free_port;
use outbox_tests::db::TestDb;
use outbox_tests::relay::{run_cmd, Relay};
use serde_json::Value;

fn parse(line: &str) -> Value {
    let v: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
    for field in ["level", "target", "message", "timestamp"] {
        assert!(v[field].is_string(), "no {field} in {line}");
    }
    v
}

#[test]
fn json_logs_are_one_object_a_line() {
    let db = TestDb::create();
    // Nothing listens there: librdkafka logs its connection failures.
    let brokers = format!("127.0.0.1:{}", free_port());
    let mut w = Relay::spawn(&db.url(), &brokers, &["--log-format", "json"]);
    assert!(
        w.wait_log(&["claim returned no due events"], Duration::from_secs(15))
            .is_some(),
        "{}",
        w.logs()
    );
    assert!(
        w.wait_log(&["\"target\":\"librdkafka\""], Duration::from_secs(15))
            .is_some(),
        "{}",
        w.logs()
    );
    w.signal(libc::SIGTERM);
    assert!(w
        .wait_exit(Duration::from_secs(10))
        .expect("exit")
        .success());

    let lines: Vec<Value> = w.logs().lines().map(parse).collect();
    let started = lines
        .iter()
        .find(|v| v["message"] == "relay started")
        .expect("relay started line");
    assert_eq!(started["level"], "INFO");
    assert_eq!(started["target"], "outbox_worker::relay");
    assert_eq!(started["batch_size"], 500, "{started}");
    assert!(lines.iter().any(|v| v["level"] == "DEBUG"));
}

#[test]
fn json_error_line_and_filters() {
    let port = free_port();
    let url = format!("postgres://postgres@127.0.0.1:{port}/nowhere?connect_timeout=2");
    let out = run_cmd(&["--log-format", "json", "run", "--database-url", &url]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<Value> = stderr.lines().map(parse).collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert_eq!(lines[0]["level"], "ERROR");
    assert!(lines[0]["message"]
        .as_str()
        .unwrap()
        .contains("cannot connect to the database"));

    let out = run_cmd(&["--log-level", "info,librdkafka=loud", "stats"]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.contains("invalid log filter"), "{stderr}");
}
