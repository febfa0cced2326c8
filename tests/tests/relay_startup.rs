//! Bad start-up inputs: each exits non-zero with one clear line on stderr, and never prints a
//! password. Also the relay's exit without a broker: a configuration error met by a task, and a
//! prompt SIGTERM.

use std::process::Output;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use outbox_tests::broker::free_port;
use outbox_tests::db::TestDb;
use outbox_tests::pg_cluster::PgCluster;
use outbox_tests::relay::{relay_bin, run_cmd, Relay};
use outbox_tests::roles::Roles;

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
    assert_eq!(out.status.code(), Some(2), "a configuration error");
}

/// Starts a relay on `url` and stops it: it must get as far as its first (empty) claim.
fn starts_and_stops(url: &str) {
    let brokers = format!("127.0.0.1:{}", free_port());
    let mut w = Relay::spawn(url, &brokers, &[]);
    assert!(
        w.wait_log(&["claim returned no due events"], Duration::from_secs(15))
            .is_some(),
        "{}",
        w.logs()
    );
    let st = w.terminate(Duration::from_secs(10)).expect("stops");
    assert!(st.success(), "{}", w.logs());
}

/// A relay needs the calls of extension 1.0.0: against an older one (its catalog row says so) it
/// refuses to start with one line naming both versions and the fix, exit 2, and runs once the
/// extension is at 1.0.0.
#[test]
fn extension_older_than_the_relay_needs_is_refused_until_updated() {
    let db = TestDb::create();
    let set_version = |v: &str| {
        db.psql(&format!(
            "UPDATE pg_extension SET extversion = '{v}' WHERE extname = 'outbox'"
        ))
    };
    set_version("0.14.0");
    let out = run_cmd(&[
        "run",
        "--database-url",
        &db.url(),
        "--brokers",
        &format!("127.0.0.1:{}", free_port()),
    ]);
    one_line_failure(
        &out,
        &[
            "extension version 0.14.0",
            "1.0.0 or later",
            "ALTER EXTENSION outbox UPDATE",
            &db.name,
        ],
    );
    assert_eq!(out.status.code(), Some(2), "a configuration error");

    set_version(env!("CARGO_PKG_VERSION"));
    starts_and_stops(&db.url());
}

/// A login the server refuses (an unknown role; a wrong password) is a configuration error: a
/// restart does not fix it. One line, exit 2, the password never printed.
#[test]
fn unknown_role_exits_2() {
    let db = TestDb::create();
    let role = format!("outbox_no_such_role_{}", std::process::id());
    let url = format!("{} user={role}", db.url());
    let out = run_cmd(&["run", "--database-url", &url]);
    one_line_failure(&out, &["cannot connect to the database", &role, "28000"]);
    assert_eq!(out.status.code(), Some(2), "a configuration error");
}

#[test]
fn wrong_password_exits_2_and_is_not_printed() {
    // The shared server trusts loopback logins, so a cluster of its own that asks for passwords.
    let hba = std::env::temp_dir().join(format!("outbox-test-hba-{}.conf", std::process::id()));
    std::fs::write(
        &hba,
        "local all all trust\nhost all all 127.0.0.1/32 scram-sha-256\nhost all all ::1/128 scram-sha-256\n",
    )
    .expect("write hba");
    let pg = PgCluster::start(&format!("hba_file = '{}'", hba.display()), &[]);
    pg.psql("postgres", "ALTER ROLE postgres PASSWORD 'right-password'");
    let base = format!("{} connect_timeout=5", pg.params("127.0.0.1", "postgres"));
    let out = run_cmd(&[
        "run",
        "--database-url",
        &format!("{base} password=wrong-password"),
    ]);
    one_line_failure(&out, &["cannot connect to the database", "28P01"]);
    assert_eq!(out.status.code(), Some(2), "a configuration error");
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!all.contains("wrong-password"), "password leaked: {all}");
    // The right password gets past the login: the next check (no extension here) fails instead.
    let out = run_cmd(&[
        "run",
        "--database-url",
        &format!("{base} password=right-password"),
    ]);
    one_line_failure(&out, &["outbox extension is not installed"]);
    let _ = std::fs::remove_file(&hba);
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

/// A `--kafka-property` without `=` is named by its position, never echoed: it may be a secret
/// (a password's second line in a newline-separated OUTBOX_KAFKA_PROPERTIES).
#[test]
fn malformed_kafka_property() {
    let db = TestDb::create();
    let out = run_cmd(&[
        "run",
        "--database-url",
        &db.url(),
        "--kafka-property",
        "linger.ms=5",
        "--kafka-property",
        "sasl.password:hunter2",
    ]);
    one_line_failure(&out, &["malformed Kafka property #2", "KEY=VALUE"]);
    assert_eq!(out.status.code(), Some(2), "a configuration error");
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!all.contains("hunter2"), "value leaked: {all}");
}

/// The delivery guarantee cannot be switched off by a flag: each of these exits 2 with one line
/// naming the property, before connecting to anything (the broker here does not exist).
#[test]
fn kafka_properties_that_break_the_guarantee_are_refused() {
    let db = TestDb::create();
    let brokers = format!("127.0.0.1:{}", free_port());
    for (prop, says) in [
        ("acks=1", "acks=all"),
        ("acks=0", "acks=all"),
        ("topic.request.required.acks=1", "acks=all"),
        ("enable.idempotence=false", "idempotent producer"),
        ("max.in.flight.requests.per.connection=10", "in flight"),
        ("enable.gapless.guarantee=false", "out of commit order"),
        ("queuing.strategy=lifo", "fifo"),
        ("partitioner=random", "order"),
        ("delivery.report.only.error=true", "delivery report"),
        ("transactional.id=relay", "transactional"),
    ] {
        let out = run_with_timeout(
            &[
                "run",
                "--database-url",
                &db.url(),
                "--brokers",
                &brokers,
                "--kafka-property",
                prop,
            ],
            Duration::from_secs(20),
        );
        one_line_failure(&out, &[&format!("Kafka property {prop} is refused"), says]);
        assert_eq!(out.status.code(), Some(2), "{prop}: a configuration error");
    }
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
    let out = Command::new(relay_bin())
        .arg("run")
        .env_remove("OUTBOX_DATABASE_URL")
        .output()
        .expect("run");
    one_line_failure(&out, &["OUTBOX_DATABASE_URL"]);
}

#[test]
fn secrets_from_files_are_used_and_never_logged() {
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
    let mut w = Relay::spawn_args(&[
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
    // librdkafka must have tried (and failed) to connect with the SASL settings, and logged it,
    // before the absence of the secrets in the log means anything.
    assert!(
        w.wait_log(&["librdkafka"], Duration::from_secs(10))
            .is_some(),
        "librdkafka logged nothing: {}",
        w.logs()
    );
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

/// Runs `outbox-worker ARGS` to completion, killing it after `timeout` (a relay that retries
/// forever would never end).
fn run_with_timeout(args: &[&str], timeout: Duration) -> Output {
    let mut child = Command::new(relay_bin())
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn outbox-worker");
    let deadline = Instant::now() + timeout;
    while child.try_wait().expect("try_wait").is_none() {
        if Instant::now() >= deadline {
            let _ = child.kill();
            let out = child.wait_with_output().expect("output");
            panic!(
                "still running after {timeout:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().expect("output")
}

/// A relay role without EXECUTE on outbox_claim passes the start-up checks (outbox_stats is
/// granted) and fails at its first claim with 42501: a configuration error that no retry fixes,
/// so the relay exits 2 with one line instead of retrying forever. The same role with the
/// recipe's grants runs, and stops with 0 on SIGTERM. No broker is needed: nothing is claimed.
#[test]
fn relay_role_without_execute_on_claim_exits_non_zero() {
    let roles;
    let db = TestDb::create();
    roles = Roles::create(&db, &[]);
    let relay = roles.name("relay");
    db.psql(&format!("ALTER ROLE {relay} LOGIN"));
    let url = format!("{} user={relay}", db.url());
    let brokers = format!("127.0.0.1:{}", free_port());

    let mut w = Relay::spawn_args(&["run", "--database-url", &url, "--brokers", &brokers]);
    assert!(
        w.wait_log(&["claim returned no due events"], Duration::from_secs(15))
            .is_some(),
        "{}",
        w.logs()
    );
    w.signal(libc::SIGTERM);
    let st = w.wait_exit(Duration::from_secs(10)).expect("exit");
    assert!(st.success(), "{}", w.logs());

    db.psql(&format!(
        "REVOKE EXECUTE ON FUNCTION outbox_claim(text, int) FROM {relay}"
    ));
    let out = run_with_timeout(
        &[
            "--log-level",
            "error",
            "run",
            "--database-url",
            &url,
            "--brokers",
            &brokers,
        ],
        Duration::from_secs(20),
    );
    one_line_failure(
        &out,
        &["claim loop 0", "outbox_claim", "42501", "configuration"],
    );
    assert_eq!(out.status.code(), Some(2));
}

/// SIGTERM ends idle claim loops at once, not after their poll interval: each waits for a
/// wake-up, the shutdown or the interval, whichever comes first. (A loop that found the wake-up
/// channel closed by the stopping listener used to sleep the whole interval.) Several loops, so
/// that one of them meets the race.
#[test]
fn sigterm_stops_idle_claim_loops_at_once() {
    let db = TestDb::create();
    let brokers = format!("127.0.0.1:{}", free_port());
    let mut w = Relay::spawn(
        &db.url(),
        &brokers,
        &["--poll-interval", "60s", "--concurrency", "4"],
    );
    let idle = || w.logs().matches("claim returned no due events").count() >= 4;
    let deadline = Instant::now() + Duration::from_secs(15);
    while !idle() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(idle(), "{}", w.logs());
    let sent = Instant::now();
    w.signal(libc::SIGTERM);
    let st = w
        .wait_exit(Duration::from_secs(10))
        .expect("exit after SIGTERM");
    assert!(st.success(), "{}", w.logs());
    assert!(
        sent.elapsed() < Duration::from_secs(5),
        "took {:?}",
        sent.elapsed()
    );
}
