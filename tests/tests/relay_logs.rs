//! `--log-format json`: every line the relay writes is one JSON object with level, target and
//! message, librdkafka's lines included, and so is the final error line. A relay whose stderr
//! went away (a log shipper that died) goes on and stops cleanly.

use std::process::{Command, Stdio};
use std::time::Duration;

use outbox_tests::broker::free_port;
use outbox_tests::db::TestDb;
use outbox_tests::relay::{relay_bin, run_cmd, Relay};
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

/// Writing a log line to a closed stderr fails (EPIPE). The relay must not panic on it (exit
/// 101), nor lose its signal handling (a panic in the task that logs the first SIGTERM left a
/// relay that no SIGTERM could stop): it runs on and exits 0 on SIGTERM.
#[test]
fn a_relay_whose_stderr_is_closed_runs_on_and_stops_cleanly() {
    let db = TestDb::create();
    // Nothing listens there: librdkafka logs its connection failures, several a second.
    let brokers = format!("127.0.0.1:{}", free_port());
    let mut child = Command::new(relay_bin())
        .args(["--log-level", "debug", "run", "--database-url", &db.url()])
        .args(["--brokers", &brokers, "--poll-interval", "100ms"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn outbox-worker");
    drop(child.stderr.take());
    std::thread::sleep(Duration::from_secs(3));
    assert!(
        child.try_wait().expect("try_wait").is_none(),
        "the relay exited when its stderr closed: {:?}",
        child.try_wait()
    );
    // SAFETY: kill(2) on our own child's pid.
    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    let status = loop {
        if let Some(st) = child.try_wait().expect("try_wait") {
            break Some(st);
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(
        status.and_then(|s| s.code()),
        Some(0),
        "SIGTERM with stderr closed: {status:?}"
    );
}
