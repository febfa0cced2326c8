//! End to end: events committed in many transactions reach the broker exactly as enqueued;
//! rolled-back ones never do. The first test runs against every sink.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use outbox_tests::broker::Broker;
use outbox_tests::db::TestDb;
use outbox_tests::events::{enqueue, wait_counts, Expected};
use outbox_tests::relay::Relay;
use outbox_tests::sinks::TestSink;
use outbox_worker::{HEADER_EVENT_KEY, HEADER_EVENT_TYPE};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn committed_events_arrive_exactly_with_key_value_and_headers() {
    committed_events_arrive(TestSink::kafka()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn committed_events_arrive_exactly_with_key_value_and_headers_nats() {
    committed_events_arrive(TestSink::nats()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn committed_events_arrive_exactly_with_key_value_and_headers_rocketmq() {
    committed_events_arrive(TestSink::rocketmq()).await;
}

async fn committed_events_arrive(broker: TestSink) {
    let db = TestDb::create();
    broker.create_topic("orders");
    broker.create_topic("payments");
    let mut client = db.connect().await;

    // The worker runs while events are committed, with a short poll so the test does not depend
    // on NOTIFY (tested separately).
    let worker = broker.spawn_relay(&db.url(), &["--poll-interval", "200ms"]);

    let mut expected: BTreeMap<i64, Expected> = BTreeMap::new();
    let mut rolled_back = BTreeSet::new();
    for t in 0..60i64 {
        let tx = client.transaction().await.expect("begin");
        for i in 0..5i64 {
            let n = t * 5 + i;
            let topic = if n % 3 == 0 { "payments" } else { "orders" };
            let mut headers = BTreeMap::new();
            headers.insert("trace".to_string(), format!("trace-{n}"));
            headers.insert("tenant".to_string(), "acme".to_string());
            let e = enqueue(
                &tx,
                topic,
                &format!("ORD-{}", n % 17),
                "OrderCreated",
                &json!({"order": n, "lines": [1, 2, 3], "note": "ünïcode \"quoted\""}),
                &headers,
            )
            .await;
            expected.insert(e.id, e);
        }
        tx.commit().await.expect("commit");
        if t % 10 == 0 {
            let tx = client.transaction().await.expect("begin");
            let e = enqueue(
                &tx,
                "orders",
                "ROLLED-BACK",
                "OrderCreated",
                &json!({"rolled_back": true}),
                &BTreeMap::new(),
            )
            .await;
            rolled_back.insert(e.id);
            tx.rollback().await.expect("rollback");
        }
    }
    let n = expected.len() as i64;

    let counts = wait_counts(&client, Duration::from_secs(60), |c| c["SUCCESS"] == n).await;
    assert_eq!(
        counts["SUCCESS"],
        n,
        "all committed events acked: {counts:?}\n{}",
        worker.logs()
    );
    assert_eq!(
        counts["WAIT"] + counts["SENDING"] + counts["FAIL"],
        0,
        "{counts:?}"
    );

    let mut seen = BTreeMap::new();
    for topic in ["orders", "payments"] {
        for m in broker.consume_all(topic, Duration::from_secs(3)) {
            let id = m.outbox_id();
            assert!(
                !rolled_back.contains(&id),
                "rolled-back event {id} was published"
            );
            let e = expected
                .get(&id)
                .unwrap_or_else(|| panic!("unexpected event {id} on the broker: {m:?}"));
            assert_eq!(e.topic, topic, "event {id} went to the wrong topic");
            assert_eq!(m.key.as_deref(), Some(e.key.as_str()), "key of {id}");
            let value: serde_json::Value = serde_json::from_str(&m.value).expect("value is JSON");
            assert_eq!(value, e.payload, "value of {id}");
            assert_eq!(m.event_id(), e.event_id, "event_id header of {id}");
            if let TestSink::Nats(_) = broker {
                // JetStream's duplicate window drops a redelivery by this id.
                assert_eq!(m.headers.get("Nats-Msg-Id"), Some(&e.event_id), "{id}");
            }
            if let TestSink::RocketMq(_) = broker {
                // The message keys (consumers deduplicate by the event_id), the tag and the
                // message group (the FIFO order of a key), as the broker stored them.
                let keys = m.headers.get("KEYS").map(String::as_str).unwrap_or("");
                assert_eq!(keys, format!("{} {}", e.event_id, e.key), "keys of {id}");
                assert_eq!(
                    m.headers.get("TAGS").map(String::as_str),
                    Some("OrderCreated")
                );
                assert_eq!(
                    m.headers.get("__SHARDINGKEY"),
                    Some(&e.key),
                    "group of {id}"
                );
            }
            assert_eq!(
                m.headers.get(HEADER_EVENT_TYPE).map(String::as_str),
                Some("OrderCreated")
            );
            assert_eq!(
                m.headers.get(HEADER_EVENT_KEY),
                Some(&e.key),
                "event_key header of {id}"
            );
            for (k, v) in &e.headers {
                assert_eq!(m.headers.get(k), Some(v), "header {k} of {id}");
            }
            *seen.entry(id).or_insert(0) += 1;
        }
    }
    let want: BTreeSet<i64> = expected.keys().copied().collect();
    let have: BTreeSet<i64> = seen.keys().copied().collect();
    assert_eq!(have, want, "exactly the committed event ids arrive");
    let dups: Vec<_> = seen.iter().filter(|(_, c)| **c > 1).collect();
    assert!(dups.is_empty(), "duplicates in a clean run: {dups:?}");

    // Metrics tell the same story.
    let published = worker.wait_metric("outbox_published_total", Duration::from_secs(5), |v| {
        v >= n as f64
    });
    assert_eq!(published, Some(n as f64));
    // No publish failed for the event's sake or for a reason the relay cannot classify. A
    // transient failure (a broker slow to answer on a loaded machine) is released and retried
    // without an attempt counted: the arrivals above, exactly once each, cover it.
    for class in ["permanent", "unknown"] {
        let label = format!("class=\"{class}\"");
        let failed = worker.metric_where("outbox_failed_total", &label);
        assert_eq!(
            failed.unwrap_or(0.0),
            0.0,
            "{class} failures: {}",
            worker.log_tail(40)
        );
    }
    if let Some(transient) = worker.metric_where("outbox_failed_total", "class=\"transient\"") {
        eprintln!(
            "{transient} transient failures, retried: {}",
            worker.log_tail(20)
        );
    }
    assert!(
        worker
            .metric("outbox_claim_batch_size_count")
            .unwrap_or(0.0)
            >= 1.0
    );
    assert!(
        worker
            .metric("outbox_publish_latency_seconds_count")
            .unwrap_or(0.0)
            >= n as f64
    );
    assert!(
        worker
            .metric("outbox_commit_to_ack_lag_seconds_count")
            .unwrap_or(0.0)
            >= n as f64
    );
    let (status, body) = worker.http_get("/health").expect("health endpoint");
    assert!(status.contains("200"), "{status} {body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_relays_share_the_work_without_duplicates() {
    let db = TestDb::create();
    let broker = Broker::start();
    broker.create_topic("orders");
    let client = db.connect().await;
    let n = 6000i64;
    let spawn = |owner: &str| {
        Relay::spawn(
            &db.url(),
            &broker.addr(),
            &[
                "--owner",
                owner,
                "--batch-size",
                "100",
                "--concurrency",
                "2",
                "--poll-interval",
                "100ms",
            ],
        )
    };
    let relays = [spawn("relay-a"), spawn("relay-b")];
    // Both relays wait for work before it comes, so sharing it does not race their start-up.
    for r in &relays {
        r.wait_ready(Duration::from_secs(30));
    }
    outbox_tests::events::enqueue_burst(&client, "orders", n).await;
    let want: BTreeSet<i64> = client
        .query("SELECT id FROM outbox_event", &[])
        .await
        .expect("ids")
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(want.len() as i64, n);
    let counts = wait_counts(&client, Duration::from_secs(60), |c| c["SUCCESS"] == n).await;
    assert_eq!(counts["SUCCESS"], n, "{counts:?}");

    // Both relays delivered, and their counts add up to the events: each relay's metric is at
    // least what the database attributes to it (an acked scheduled row keeps its claim_owner; an
    // acked stream event keeps no owner, since its row is never rewritten). Polled: the metric
    // moves just after the ack.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while relays
        .iter()
        .map(|r| r.metric("outbox_published_total").unwrap_or(0.0))
        .sum::<f64>()
        < n as f64
        && std::time::Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(100));
    }
    let mut published_total = 0.0;
    for (r, owner) in relays.iter().zip(["relay-a", "relay-b"]) {
        let acked: i64 = client
            .query_one(
                "SELECT count(*) FROM outbox_scheduled WHERE status = 'SUCCESS' AND claim_owner = $1",
                &[&owner],
            )
            .await
            .expect("count")
            .get(0);
        let published = r
            .wait_metric("outbox_published_total", Duration::from_secs(10), |v| {
                v >= acked as f64 && v > 0.0
            })
            .unwrap_or(0.0);
        assert!(
            published >= acked as f64 && published > 0.0,
            "{owner} published {published}, the database says it acked {acked} scheduled rows: {}",
            r.logs()
        );
        published_total += published;
    }
    assert_eq!(
        published_total, n as f64,
        "the relays' counts add up to the events"
    );
    let msgs = broker.consume_all("orders", Duration::from_secs(3));
    let ids: BTreeSet<i64> = msgs.iter().map(|m| m.outbox_id()).collect();
    assert_eq!(ids, want, "exactly the enqueued ids arrive");
    assert_eq!(msgs.len() as i64, n, "no duplicates");
}
