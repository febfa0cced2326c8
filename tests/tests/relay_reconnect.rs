//! The relay survives losing its database sessions: the wake-up session reconnects by itself (and
//! commits wake it again), the pool replaces terminated connections, /health says when the
//! database is gone.

use std::collections::BTreeMap;
use std::time::Duration;

use outbox_tests::broker::Broker;
use outbox_tests::db::TestDb;
use outbox_tests::events::enqueue;
use outbox_tests::relay::Relay;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wake_up_session_and_pool_reconnect_after_their_backends_are_terminated() {
    let db = TestDb::create();
    let broker = Broker::start();
    broker.create_topic("orders");
    let client = db.connect().await;
    let follower = broker.follow("orders");
    let worker = Relay::spawn(
        &db.url(),
        &broker.addr(),
        &["--poll-interval", "60s", "--stats-interval", "200ms"],
    );
    worker.wait_ready(Duration::from_secs(15));
    let warm = enqueue(&client, "orders", "w", "Warm", &json!({}), &BTreeMap::new()).await;
    assert!(follower
        .wait_for(warm.id, Duration::from_secs(20))
        .is_some());

    // Kill every session of the relay (pool and wake-up).
    let killed: i64 = client
        .query_one(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
             WHERE datname = current_database() AND application_name = 'outbox-worker'",
            &[],
        )
        .await
        .expect("terminate")
        .get(0);
    assert!(
        killed >= 2,
        "expected the pool and wake-up sessions, killed {killed}"
    );
    assert!(
        worker
            .wait_log(&["wake-up", "re-established"], Duration::from_secs(15))
            .is_some(),
        "wake-up session did not come back: {}",
        worker.logs()
    );

    // NOTIFY works again, and the claim loop gets a fresh pooled connection.
    for i in 0..3 {
        let e = enqueue(
            &client,
            "orders",
            &format!("k{i}"),
            "T",
            &json!({"i": i}),
            &BTreeMap::new(),
        )
        .await;
        assert!(
            follower.wait_for(e.id, Duration::from_secs(3)).is_some(),
            "event {} not delivered after the reconnect: {}",
            e.id,
            worker.logs()
        );
    }
    let (status, _) = worker.http_get("/health").expect("health");
    assert!(status.contains("200"), "{status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_reports_an_unreachable_database() {
    let db = TestDb::create();
    let broker = Broker::start();
    broker.create_topic("orders");
    let worker = Relay::spawn(
        &db.url(),
        &broker.addr(),
        &["--poll-interval", "100ms", "--stats-interval", "100ms"],
    );
    assert!(worker
        .wait_log(&["relay started"], Duration::from_secs(15))
        .is_some());
    let (status, _) = worker.http_get("/health").expect("health");
    assert!(status.contains("200"), "{status}");
    // Sessions that can't reconnect: the database refuses new connections.
    outbox_tests::db::psql_admin(&format!(
        "ALTER DATABASE {} WITH ALLOW_CONNECTIONS false",
        db.name
    ));
    outbox_tests::db::psql_admin(&format!(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{}'",
        db.name
    ));
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut last = String::new();
    while std::time::Instant::now() < deadline {
        last = worker
            .http_get("/health")
            .map(|(s, _)| s)
            .unwrap_or_default();
        if last.contains("503") {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        last.contains("503"),
        "health still {last:?}: {}",
        worker.logs()
    );
    outbox_tests::db::psql_admin(&format!(
        "ALTER DATABASE {} WITH ALLOW_CONNECTIONS true",
        db.name
    ));
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while std::time::Instant::now() < deadline {
        last = worker
            .http_get("/health")
            .map(|(s, _)| s)
            .unwrap_or_default();
        if last.contains("200") {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(last.contains("200"), "health did not recover: {last:?}");
}
