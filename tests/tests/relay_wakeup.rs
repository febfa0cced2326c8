//! The wake-up (`outbox_wait`, no LISTEN/NOTIFY): with a 60 s poll interval, an event committed
//! while the relay is idle reaches a consumer long before the poll would have found it, on the
//! shared server (preloaded: commits wake the relay) and on a server without
//! `shared_preload_libraries` (the relay's wait polls the queue). How fast is the latency
//! benchmark's figure (`scripts/bench`), not a bound this test can hold on a loaded machine.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use outbox_tests::broker::{Broker, Follower};
use outbox_tests::db::TestDb;
use outbox_tests::events::enqueue;
use outbox_tests::pg_cluster::PgCluster;
use outbox_tests::relay::Relay;
use outbox_worker::WAKEUP_READY;
use serde_json::json;
use tokio_postgres::Client;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn event_committed_while_idle_wakes_the_relay_on_a_preloaded_server() {
    woken_not_polled(&TestDb::create(), "commit").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn event_committed_while_idle_wakes_the_relay_without_preload() {
    let pg = PgCluster::start("", &[]);
    let db = TestDb::create_on(
        &format!("host=127.0.0.1 port={} user=postgres", pg.port),
        "outbox_wake",
    );
    woken_not_polled(&db, "polling").await;
}

/// A broker with the topic `orders` and its follower, a client of `db`, and a relay run with
/// `args` once it has started waiting in `outbox_wait` (its log line also carries `mark`).
async fn waiting_relay(
    db: &TestDb,
    args: &[&str],
    mark: &str,
) -> (Broker, Client, Follower, Relay) {
    let broker = Broker::start();
    broker.create_topic("orders");
    let client = db.connect().await;
    let follower = broker.follow("orders");
    let worker = Relay::spawn(&db.url(), &broker.addr(), args);
    assert!(
        worker
            .wait_log(&[WAKEUP_READY, mark], Duration::from_secs(15))
            .is_some(),
        "the relay never started waiting ({mark}): {}",
        worker.logs()
    );
    (broker, client, follower, worker)
}

async fn woken_not_polled(db: &TestDb, mode: &str) {
    let mode = format!("mode={mode}");
    let (_broker, client, follower, worker) =
        waiting_relay(db, &["--poll-interval", "60s"], &mode).await;

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
        // The relay is idle once the round of the last event ended: from then on only the
        // wake-up (or the poll, 60 s later) starts the next one.
        wait_rounds_done(&worker, i + 1).await;
        let within = Duration::from_secs(5);
        latencies.push(commit_to_consumer(&client, &follower, &worker, i, within).await);
    }
    eprintln!("commit-to-consumer latencies while idle: {latencies:?}");
    // The 5 s limit of wait_for above is 12 times shorter than the poll interval: each event
    // arrived because outbox_wait woke the relay.
    assert_eq!(latencies.len(), 5);
}

/// Enqueues event `i` (key `k{i}`) and returns the time from the enqueue to its arrival at the
/// consumer, which must come `within`.
async fn commit_to_consumer(
    client: &Client,
    follower: &Follower,
    worker: &Relay,
    i: usize,
    within: Duration,
) -> Duration {
    let t0 = Instant::now();
    let key = format!("k{i}");
    let e = enqueue(
        client,
        "orders",
        &key,
        "OrderCreated",
        &json!({"i": i}),
        &BTreeMap::new(),
    )
    .await;
    let (arrived, m) = follower.wait_for(e.id, within).unwrap_or_else(|| {
        panic!(
            "event {} did not arrive within {within:?}: {}",
            e.id,
            worker.logs()
        )
    });
    assert_eq!(m.key.as_deref(), Some(key.as_str()));
    arrived.duration_since(t0)
}

/// Waits until the relay logged `n` rounds that relayed one event (one per event so far).
async fn wait_rounds_done(worker: &Relay, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(20);
    let done = || {
        let logs = worker.logs();
        logs.lines()
            .filter(|l| l.contains("round done") && l.contains("events=1 "))
            .count()
    };
    while done() < n {
        assert!(
            Instant::now() < deadline,
            "the relay never ended the round of event {n}: {}",
            worker.logs()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Several claim loops: a wake-up that one loop serves while the others find nothing is not an
/// empty wake-up. Were it taken for one, the wake-up session would pause more and more between
/// looks (up to 100 ms): events 25 ms apart then waited 72-84 ms each, against about 5 ms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_claim_loops_do_not_slow_the_wake_up_down() {
    let db = TestDb::create();
    let args = ["--poll-interval", "60s", "--concurrency", "4"];
    let (_broker, client, follower, worker) = waiting_relay(&db, &args, "mode=").await;
    let mut latencies = Vec::new();
    for i in 0..40 {
        let latency =
            commit_to_consumer(&client, &follower, &worker, i, Duration::from_secs(20)).await;
        // The first ones warm up the producer and the consumer.
        if i >= 10 {
            latencies.push(latency);
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    latencies.sort();
    let median = latencies[latencies.len() / 2];
    eprintln!("commit-to-consumer latencies, 4 claim loops: {latencies:?}");
    assert!(
        median < Duration::from_millis(40),
        "median commit-to-consumer latency {median:?} with 4 claim loops (expected a few ms): \
         {latencies:?}"
    );
}
