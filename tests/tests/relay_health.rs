//! `/live` and `/ready` of the real relay, as Kubernetes probes them: ready while the database and
//! the broker answer, not ready while the broker is frozen and ready again once it is back, live
//! throughout; not ready while its circuit breaker is open, though the broker answers again; not
//! live while its claim loop is stuck on a lock; and a metrics listener out of file descriptors
//! that waits instead of spinning.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use outbox_tests::broker::{free_port, Broker};
use outbox_tests::db::TestDb;
use outbox_tests::events::enqueue;
use outbox_tests::relay::Relay;
use outbox_tests::sinks::TestSink;
use serde_json::json;

/// Polls `path` until its status line contains `want`; returns the last (status, body).
fn wait_status(w: &Relay, path: &str, want: &str, timeout: Duration) -> (String, String) {
    let deadline = Instant::now() + timeout;
    loop {
        let got = w.http_get(path).unwrap_or_default();
        if got.0.contains(want) || Instant::now() >= deadline {
            return got;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A relay on `db` and `broker` (fast polls and stats, `send_timeout`), once it is ready.
fn ready_relay(db: &TestDb, broker: &Broker, send_timeout: &str) -> Relay {
    let w = Relay::spawn(
        &db.url(),
        &broker.addr(),
        &[
            "--poll-interval",
            "200ms",
            "--stats-interval",
            "500ms",
            "--send-timeout",
            send_timeout,
        ],
    );
    let (status, body) = wait_status(&w, "/ready", "200", Duration::from_secs(20));
    assert!(status.contains("200"), "{status} {body}\n{}", w.logs());
    w
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_follows_the_broker_and_live_stays_up() {
    let db = TestDb::create();
    let broker = Broker::start();
    broker.create_topic("orders");
    let client = db.connect().await;
    let follower = broker.follow("orders");
    let w = ready_relay(&db, &broker, "2s");
    let ev = enqueue(
        &client,
        "orders",
        "k",
        "Created",
        &json!({}),
        &BTreeMap::new(),
    )
    .await;
    assert!(follower.wait_for(ev.id, Duration::from_secs(20)).is_some());

    broker.freeze();
    let (status, body) = wait_status(&w, "/ready", "503", Duration::from_secs(20));
    broker.thaw();
    assert!(status.contains("503"), "{status} {body}\n{}", w.logs());
    // The metadata watch or the circuit breaker, whichever notices first.
    assert!(body.starts_with("Kafka unreachable"), "{body}");
    let (status, body) = wait_status(&w, "/live", "200", Duration::from_secs(1));
    assert!(
        status.contains("200"),
        "live while the broker was frozen: {status} {body}"
    );

    let (status, body) = wait_status(&w, "/ready", "200", Duration::from_secs(30));
    assert!(status.contains("200"), "{status} {body}\n{}", w.logs());
    let (status, _) = w.http_get("/live").expect("live");
    assert!(status.contains("200"), "{status}");
}

/// While the circuit breaker is open the relay claims nothing, so it is not ready and says why;
/// once the prober reaches the broker again it is ready and delivers. (That a metadata request
/// answered meanwhile does not make it ready is health.rs's unit test: here the window between
/// the two depends on the prober's jittered backoff.)
/// `/ready` names the broker of the sink in use, here a NATS server that went away.
#[test]
fn not_ready_names_the_unreachable_nats_server() {
    let db = TestDb::create();
    let mut nats = TestSink::nats();
    let w = nats.spawn_relay(
        &db.url(),
        &[
            "--poll-interval",
            "200ms",
            "--stats-interval",
            "500ms",
            "--send-timeout",
            "2s",
        ],
    );
    let (status, body) = wait_status(&w, "/ready", "200", Duration::from_secs(20));
    assert!(status.contains("200"), "{status} {body}\n{}", w.logs());
    nats.stop();
    let (status, body) = wait_status(&w, "/ready", "503", Duration::from_secs(20));
    assert!(status.contains("503"), "{status} {body}\n{}", w.logs());
    assert_eq!(body.trim(), "NATS unreachable", "{}", w.logs());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn not_ready_while_the_circuit_breaker_is_open() {
    let db = TestDb::create();
    let broker = Broker::start();
    broker.create_topic("orders");
    let client = db.connect().await;
    let follower = broker.follow("orders");
    let w = ready_relay(&db, &broker, "1s");

    broker.freeze();
    let ev = enqueue(
        &client,
        "orders",
        "k",
        "Created",
        &json!({}),
        &BTreeMap::new(),
    )
    .await;
    let open = w.wait_metric("outbox_broker_circuit_open", Duration::from_secs(20), |v| {
        v == 1.0
    });
    let (status, body) = w.http_get("/ready").unwrap_or_default();
    broker.thaw();
    assert_eq!(open, Some(1.0), "the breaker did not open\n{}", w.logs());
    assert!(status.contains("503"), "{status} {body}\n{}", w.logs());
    assert_eq!(
        body.trim(),
        "Kafka unreachable: circuit breaker open, not claiming"
    );

    let (status, body) = wait_status(&w, "/ready", "200", Duration::from_secs(30));
    assert!(status.contains("200"), "{status} {body}\n{}", w.logs());
    assert_eq!(w.metric("outbox_broker_circuit_open"), Some(0.0));
    assert!(follower.wait_for(ev.id, Duration::from_secs(30)).is_some());
}

/// A claim that waits on a lock (no statement timeout) stops the rounds: /live turns 503 after
/// --live-timeout, and 200 again once the lock is released. Readiness is not the point here, so
/// no broker is needed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_fails_while_a_claim_loop_is_stuck() {
    let db = TestDb::create();
    let brokers = format!("127.0.0.1:{}", free_port());
    let w = Relay::spawn(
        &db.url(),
        &brokers,
        &[
            "--poll-interval",
            "200ms",
            "--send-timeout",
            "1s",
            "--live-timeout",
            "3s",
            "--statement-timeout",
            "0s",
        ],
    );
    assert!(w
        .wait_log(&["claim returned no due events"], Duration::from_secs(15))
        .is_some());
    let (status, _) = w.http_get("/live").expect("live");
    assert!(status.contains("200"), "{status}");

    let mut locker = db.connect().await;
    let tx = locker.transaction().await.expect("begin");
    // One table, not the outbox_event view: locking the view takes both of its tables in turn,
    // and a claim taking them in the other order is a deadlock (PostgreSQL cancels one side).
    tx.batch_execute("LOCK TABLE outbox_scheduled IN ACCESS EXCLUSIVE MODE")
        .await
        .expect("lock");
    let (status, body) = wait_status(&w, "/live", "503", Duration::from_secs(15));
    assert!(status.contains("503"), "{status} {body}\n{}", w.logs());
    assert!(
        body.starts_with("claim loop 0 has not completed a round"),
        "{body}"
    );
    tx.rollback().await.expect("release the lock");
    let (status, body) = wait_status(&w, "/live", "200", Duration::from_secs(10));
    assert!(status.contains("200"), "{status} {body}");
}

/// User plus system CPU of process `pid` so far, in clock ticks (1/100 s).
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("stat");
    // Fields after the command name (which may hold spaces): utime and stime are the 12th and
    // 13th of them.
    let rest = &stat[stat.rfind(')').expect("comm") + 2..];
    let fields: Vec<&str> = rest.split(' ').collect();
    fields[11].parse::<u64>().expect("utime") + fields[12].parse::<u64>().expect("stime")
}

/// Out of file descriptors, every accept of the metrics listener fails at once (EMFILE): the
/// relay must wait for one to be freed, not spin on a core. Its limit is lowered to what it uses
/// plus 5, and 40 connections are left open on the metrics port for 2 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metrics_listener_does_not_spin_when_out_of_file_descriptors() {
    let db = TestDb::create();
    let broker = Broker::start();
    broker.create_topic("orders");
    let w = ready_relay(&db, &broker, "2s");
    let pid = w.pid();
    let open = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("fds")
        .count();
    let limit = format!("--nofile={0}:{0}", open + 5);
    let out = std::process::Command::new("prlimit")
        .args(["--pid", &pid.to_string(), &limit])
        .output()
        .expect("prlimit");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let port = w
        .metrics_port()
        .expect("the relay logged its metrics address");
    let conns: Vec<std::net::TcpStream> = (0..40)
        .filter_map(|_| std::net::TcpStream::connect(("127.0.0.1", port)).ok())
        .collect();
    assert!(conns.len() > 10, "only {} connections", conns.len());
    let before = cpu_ticks(pid);
    std::thread::sleep(Duration::from_secs(2));
    let used = cpu_ticks(pid) - before;
    drop(conns);
    assert!(used < 50, "the relay used {used} ticks of CPU in 2 s");
}
