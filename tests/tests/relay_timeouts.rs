//! Every wait of the relay is bounded: a Kafka delivery timeout above the lease is refused at
//! start-up, a statement stuck on a lock is cancelled by the statement timeout and the relay
//! carries on, and SIGTERM ends the process within the shutdown timeout even with a round stuck.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use outbox_tests::broker::{free_port, Broker};
use outbox_tests::db::TestDb;
use outbox_tests::events::enqueue;
use outbox_tests::relay::{run_cmd, Relay};
use serde_json::json;
use tokio_postgres::Client;

#[test]
fn a_delivery_timeout_property_above_the_lease_is_refused() {
    let url = format!("host=127.0.0.1 port={} connect_timeout=1", free_port());
    for prop in ["message.timeout.ms=700000", "delivery.timeout.ms=0"] {
        let out = run_cmd(&["run", "--database-url", &url, "--kafka-property", prop]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
        assert!(
            stderr.contains(prop) && stderr.contains("--lease"),
            "{stderr}"
        );
    }
}

/// Locks the outbox's tracked table in a transaction of the test's own session (every claim reads
/// it first, so every round waits); released when the returned transaction is dropped or rolled
/// back. One table, not the outbox_event view: locking the view takes both of its tables in turn,
/// and a claim taking them in the other order is a deadlock.
async fn lock_outbox(client: &mut Client) -> tokio_postgres::Transaction<'_> {
    let tx = client.transaction().await.expect("begin");
    tx.batch_execute("LOCK TABLE outbox_tracked IN ACCESS EXCLUSIVE MODE")
        .await
        .expect("lock");
    tx
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_stuck_on_a_lock_is_cancelled_and_the_relay_carries_on() {
    let db = TestDb::create();
    let broker = Broker::start();
    broker.create_topic("orders");
    let follower = broker.follow("orders");
    let mut w = Relay::spawn(
        &db.url(),
        &broker.addr(),
        &["--poll-interval", "200ms", "--statement-timeout", "1s"],
    );
    assert!(w
        .wait_log(&["claim returned no due events"], Duration::from_secs(15))
        .is_some());

    let mut locker = db.connect().await;
    let tx = lock_outbox(&mut locker).await;
    let line = w.wait_log(
        &["claim failed", "statement timeout", "57014"],
        Duration::from_secs(10),
    );
    assert!(line.is_some(), "{}", w.logs());
    // Enqueued by the lock holder itself, delivered once it commits.
    let ev = enqueue(&tx, "orders", "k", "Created", &json!({}), &BTreeMap::new()).await;
    tx.commit().await.expect("commit");
    assert!(
        follower.wait_for(ev.id, Duration::from_secs(20)).is_some(),
        "{}",
        w.logs()
    );
    assert!(w.wait_exit(Duration::ZERO).is_none(), "the relay exited");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_ends_the_relay_within_the_shutdown_timeout() {
    let db = TestDb::create();
    let brokers = format!("127.0.0.1:{}", free_port());
    let mut w = Relay::spawn(
        &db.url(),
        &brokers,
        &[
            "--poll-interval",
            "200ms",
            "--statement-timeout",
            "0s",
            "--shutdown-timeout",
            "1s",
        ],
    );
    assert!(w
        .wait_log(&["claim returned no due events"], Duration::from_secs(15))
        .is_some());
    let mut locker = db.connect().await;
    let _tx = lock_outbox(&mut locker).await;
    // Wait until the claim loop's statement is queued behind the lock: the wake-up session's
    // outbox_wait queues there too, but a relay whose claim loop sleeps stops cleanly.
    let watcher = db.connect().await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let waiting: i64 = watcher
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
                 AND application_name = 'outbox-worker' AND wait_event_type = 'Lock' \
                 AND query LIKE '%outbox_claim%'",
                &[],
            )
            .await
            .expect("pg_stat_activity")
            .get(0);
        if waiting > 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no claim of the relay waits on the lock"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let start = Instant::now();
    w.signal(libc::SIGTERM);
    let st = w
        .wait_exit(Duration::from_secs(10))
        .unwrap_or_else(|| panic!("still running 10 s after SIGTERM: {}", w.logs()));
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
    assert_eq!(st.code(), Some(1), "{}", w.logs());
    assert!(
        w.logs().contains("shutdown timeout (1s) passed"),
        "{}",
        w.logs()
    );
}
