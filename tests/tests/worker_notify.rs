//! NOTIFY wake-up: with a 60 s poll interval, an event committed while the relay is idle reaches
//! a consumer within 1 s.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use outbox_tests::broker::Broker;
use outbox_tests::db::TestDb;
use outbox_tests::events::enqueue;
use outbox_tests::relay::Relay;
use outbox_worker::WAKEUP_CHANNEL;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn event_committed_while_idle_arrives_within_one_second() {
    let db = TestDb::create();
    let broker = Broker::start();
    broker.create_topic("orders");
    let client = db.connect().await;
    let follower = broker.follow("orders");
    let worker = Relay::spawn(&db.url(), &broker.addr(), &["--poll-interval", "60s"]);
    assert!(
        worker
            .wait_log(
                &[&format!("listening for NOTIFY {WAKEUP_CHANNEL}")],
                Duration::from_secs(15)
            )
            .is_some(),
        "worker never listened: {}",
        worker.logs()
    );

    // Warm-up: producer and consumer connected, metadata known.
    let warm = enqueue(
        &client,
        "orders",
        "warm",
        "Warm",
        &json!({"warm": 1}),
        &BTreeMap::new(),
    )
    .await;
    assert!(
        follower
            .wait_for(warm.id, Duration::from_secs(20))
            .is_some(),
        "warm-up event never arrived: {}",
        worker.logs()
    );

    let mut latencies = Vec::new();
    for i in 0..5 {
        // Let the relay go idle (its round ended; it now waits up to 60 s).
        tokio::time::sleep(Duration::from_millis(300)).await;
        let t0 = Instant::now();
        let e = enqueue(
            &client,
            "orders",
            &format!("k{i}"),
            "OrderCreated",
            &json!({"i": i}),
            &BTreeMap::new(),
        )
        .await;
        let (arrived, m) = follower
            .wait_for(e.id, Duration::from_secs(5))
            .unwrap_or_else(|| {
                panic!(
                    "event {} did not arrive within 5 s: {}",
                    e.id,
                    worker.logs()
                )
            });
        assert_eq!(m.key.as_deref(), Some(format!("k{i}").as_str()));
        latencies.push(arrived.duration_since(t0));
    }
    eprintln!("commit-to-consumer latencies while idle: {latencies:?}");
    for l in &latencies {
        assert!(
            *l < Duration::from_secs(1),
            "an idle event took {l:?} (> 1 s): {latencies:?}"
        );
    }
}
