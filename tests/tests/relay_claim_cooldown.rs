//! `--claim-cooldown` (docs/relay.md, "Claim cooldown"): a trickle of events goes out in fewer,
//! larger rounds, every event delivered; a backlog drains in full batches without waiting.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use outbox_tests::broker::Broker;
use outbox_tests::db::TestDb;
use outbox_tests::events::{enqueue, enqueue_burst, wait_counts};
use outbox_tests::relay::Relay;
use serde_json::json;

/// Rounds that claimed something: the relay's histogram of claim sizes counts one per round.
const ROUNDS: &str = "outbox_claim_batch_size_count";

/// A broker with the topic `orders`, and a database of the test's own.
fn broker_and_db() -> (Broker, TestDb) {
    let broker = Broker::start();
    broker.create_topic("orders");
    (broker, TestDb::create())
}

/// A relay with `extra`, ready and its wake-up session waiting.
fn relay(db: &TestDb, broker: &Broker, extra: &[&str]) -> Relay {
    let relay = Relay::spawn(&db.url(), &broker.addr(), extra);
    relay.wait_ready(Duration::from_secs(15));
    relay
}

/// Enqueues `n` events one transaction at a time, `gap` apart; returns how long it took.
async fn trickle(db: &TestDb, n: usize, gap: Duration) -> Duration {
    let client = db.connect().await;
    let start = Instant::now();
    for i in 0..n {
        let payload = json!({ "i": i });
        enqueue(
            &client,
            "orders",
            &format!("k{i}"),
            "OrderCreated",
            &payload,
            &BTreeMap::new(),
        )
        .await;
        tokio::time::sleep(gap).await;
    }
    start.elapsed()
}

/// Waits until `n` events are SUCCESS; returns the relay's rounds so far.
async fn delivered(db: &TestDb, relay: &Relay, n: i64) -> f64 {
    let client = db.connect().await;
    let counts = wait_counts(&client, Duration::from_secs(30), |c| c["SUCCESS"] == n).await;
    assert_eq!(
        counts["SUCCESS"],
        n,
        "not every event delivered: {counts:?}; {}",
        relay.log_tail(40)
    );
    relay.metric(ROUNDS).expect("the relay's /metrics")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cooldown_gathers_a_trickle_into_fewer_rounds() {
    const N: usize = 60;
    let gap = Duration::from_millis(20);
    let cooldown = Duration::from_millis(300);
    let (broker, plain_db) = broker_and_db();
    let plain = relay(&plain_db, &broker, &[]);
    trickle(&plain_db, N, gap).await;
    let plain_rounds = delivered(&plain_db, &plain, N as i64).await;

    let db = TestDb::create();
    let cooled = relay(&db, &broker, &["--claim-cooldown", "300ms"]);
    let took = trickle(&db, N, gap).await;
    let rounds = delivered(&db, &cooled, N as i64).await;

    // A claim starts at most once per cooldown while events trickle in, plus the last round.
    let bound = (took.as_secs_f64() / cooldown.as_secs_f64()).ceil() + 2.0;
    eprintln!("{N} events over {took:?}: {plain_rounds} rounds without a cooldown, {rounds} with 300ms (at most {bound})");
    assert!(
        rounds <= bound,
        "{rounds} rounds with a 300 ms cooldown over {took:?}, more than {bound}: {}",
        cooled.log_tail(40)
    );
    assert!(
        plain_rounds > bound,
        "without a cooldown only {plain_rounds} rounds: the trickle does not tell the two apart"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_drains_in_full_batches_without_the_cooldown() {
    let (broker, db) = broker_and_db();
    enqueue_burst(&db.connect().await, "orders", 2_000).await;

    // 20 full batches: waiting 2 s after each would take 40 s.
    let start = Instant::now();
    let relay = relay(
        &db,
        &broker,
        &["--batch-size", "100", "--claim-cooldown", "2s"],
    );
    let rounds = delivered(&db, &relay, 2_000).await;
    let took = start.elapsed();
    assert!(
        took < Duration::from_secs(20),
        "2,000 events took {took:?} with full batches of 100: {}",
        relay.log_tail(40)
    );
    assert!(
        rounds >= 20.0,
        "{rounds} rounds for 2,000 events in batches of 100"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_does_not_wait_for_the_cooldown() {
    let (broker, db) = broker_and_db();
    let mut relay = relay(&db, &broker, &["--claim-cooldown", "5s"]);
    trickle(&db, 1, Duration::ZERO).await;
    delivered(&db, &relay, 1).await;

    // The loop now waits 5 s before its next claim; SIGTERM ends the wait.
    let stop = Instant::now();
    relay.signal(libc::SIGTERM);
    let status = relay
        .wait_exit(Duration::from_secs(10))
        .expect("the relay exits");
    assert!(
        status.success(),
        "exit status {status:?}: {}",
        relay.log_tail(20)
    );
    assert!(
        stop.elapsed() < Duration::from_secs(3),
        "the stop took {:?}: {}",
        stop.elapsed(),
        relay.log_tail(20)
    );
}
