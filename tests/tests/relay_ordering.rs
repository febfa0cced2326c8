//! Per-key order end to end: producers racing on shared keys, two relays with two claim loops
//! each and small batches; per key, the first arrivals on the broker are in commit order, and
//! every committed event arrives.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use outbox_tests::broker::Broker;
use outbox_tests::db::{self, TestDb};
use outbox_tests::events::wait_counts;
use outbox_tests::relay::Relay;
use outbox_tests::sinks::TestSink;

const KEYS: i64 = 12;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn first_arrivals_of_each_key_are_in_commit_order() {
    first_arrivals_in_commit_order(TestSink::kafka()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn first_arrivals_of_each_key_are_in_commit_order_nats() {
    first_arrivals_in_commit_order(TestSink::nats()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn first_arrivals_of_each_key_are_in_commit_order_rocketmq() {
    first_arrivals_in_commit_order(TestSink::rocketmq()).await;
}

async fn first_arrivals_in_commit_order(broker: TestSink) {
    let db = TestDb::create();
    broker.create_topic("orders");
    // A relay killed holds claims: with heartbeats every 1/6 s, another relay takes them back
    // within about a second instead of the lease.
    let spawn = || {
        broker.spawn_relay(
            &db.url(),
            &[
                "--concurrency",
                "2",
                "--batch-size",
                "7",
                "--poll-interval",
                "100ms",
                "--heartbeat-timeout",
                "1s",
                "--reclaim-interval",
                "500ms",
            ],
        )
    };
    let mut relays: Vec<Relay> = (0..2).map(|_| spawn()).collect();

    // Four producers commit 1 to 3 events per transaction on keys they share, each first locking
    // its orders' rows (in key order) as an order service does: who commits first is decided by
    // the race, and the ids follow it within each key.
    db.psql(&format!(
        "CREATE TABLE orders_agg (key text PRIMARY KEY); \
         INSERT INTO orders_agg SELECT 'order-' || k FROM generate_series(0, {}) k",
        KEYS - 1
    ));
    let mut producers = Vec::new();
    for p in 0..4i64 {
        let url = db.url();
        producers.push(tokio::spawn(async move {
            let mut c = db::connect(&url).await;
            let mut committed = Vec::new();
            for t in 0..60i64 {
                let tx = c.transaction().await.unwrap();
                let keys: Vec<String> = (0..(1 + (p + t) % 3))
                    .map(|i| format!("order-{}", (p * 7 + t * 5 + i) % KEYS))
                    .collect();
                tx.execute(
                    "SELECT 1 FROM orders_agg WHERE key = ANY ($1) ORDER BY key FOR UPDATE",
                    &[&keys],
                )
                .await
                .unwrap();
                let mut ids = Vec::new();
                for key in &keys {
                    let id: i64 = tx
                        .query_one(
                            "SELECT outbox_enqueue('orders', jsonb_build_object('p', $1::int8, 't', $2::int8), key => $3)",
                            &[&p, &t, key],
                        )
                        .await
                        .unwrap()
                        .get(0);
                    ids.push(id);
                }
                if t % 11 == 5 {
                    tx.rollback().await.unwrap();
                } else {
                    tx.commit().await.unwrap();
                    committed.extend(ids);
                }
            }
            committed
        }));
    }
    // While the producers commit, relays are killed (SIGKILL, claims held) and replaced.
    for k in 0..3 {
        tokio::time::sleep(Duration::from_millis(700)).await;
        relays[k % 2] = spawn();
    }
    let mut committed = BTreeSet::new();
    for p in producers {
        committed.extend(p.await.unwrap());
    }
    let client = db.connect().await;
    let total = committed.len() as i64;
    let counts = wait_counts(&client, Duration::from_secs(90), |c| {
        c.get("SUCCESS").copied().unwrap_or(0) == total
    })
    .await;
    assert_eq!(
        counts.get("SUCCESS").copied(),
        Some(total),
        "not all delivered: {counts:?}"
    );
    for mut r in relays {
        assert!(r.is_running(), "a relay died: {}", r.log_tail(20));
        r.terminate(Duration::from_secs(20)).unwrap();
    }

    let msgs = broker.consume_all("orders", Duration::from_secs(10));
    let mut first_arrivals: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    let mut seen = BTreeSet::new();
    for m in &msgs {
        let id = m.outbox_id();
        if seen.insert(id) {
            first_arrivals
                .entry(m.key.clone().expect("keyed"))
                .or_default()
                .push(id);
        }
    }
    assert_eq!(
        seen, committed,
        "arrived ids differ from the committed ones"
    );
    let mut out_of_order = Vec::new();
    for (key, ids) in &first_arrivals {
        for w in ids.windows(2) {
            if w[0] > w[1] {
                out_of_order.push(format!("{key}: {} before {}", w[0], w[1]));
            }
        }
    }
    assert!(
        out_of_order.is_empty(),
        "first arrivals out of commit order: {out_of_order:?}"
    );
    assert_eq!(first_arrivals.len() as i64, KEYS);
    let keys_left: i64 = db::scalar(&client, "SELECT count(*) FROM outbox_key", &[]).await;
    assert!(keys_left <= KEYS, "{keys_left} key rows");
}

/// Events of `key` read back from `topic`, first arrivals only, in arrival order.
fn first_arrivals(broker: &Broker, topic: &str, key: &str) -> Vec<i64> {
    let mut msgs = broker.consume_all(topic, Duration::from_secs(10));
    msgs.sort_by_key(|m| (m.partition, m.offset));
    let mut seen = BTreeSet::new();
    msgs.iter()
        .filter(|m| m.key.as_deref() == Some(key))
        .map(|m| m.outbox_id())
        .filter(|id| seen.insert(*id))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_event_holds_back_the_rest_of_its_key_until_skipped() {
    // The producer refuses messages over 2,000 bytes (librdkafka's message.max.bytes), below the
    // extension's limit: the second event of key K fails in the middle of its run, for good.
    let db = TestDb::create();
    db.set(&[("outbox.max_retry", "0")]);
    let broker = Broker::start();
    broker.create_topic("orders");
    let client = db.connect().await;
    let mut ids = Vec::new();
    for (key, size) in [("K", 10), ("K", 3_000), ("K", 10), ("L", 10), ("K", 10)] {
        let id: i64 = client
            .query_one(
                "SELECT outbox_enqueue('orders', jsonb_build_object('pad', repeat('x', $1)), key => $2)",
                &[&size, &key],
            )
            .await
            .unwrap()
            .get(0);
        ids.push(id);
    }
    let (k1, k2, k3, l1, k4) = (ids[0], ids[1], ids[2], ids[3], ids[4]);
    let mut relay = Relay::spawn(
        &db.url(),
        &broker.addr(),
        &[
            "--poll-interval",
            "100ms",
            "--kafka-property",
            "message.max.bytes=2000",
        ],
    );
    // K's head k1 and L go out; k2 is dead (max_retry 0) and blocks K.
    let counts = wait_counts(&client, Duration::from_secs(30), |c| {
        c.get("SUCCESS") == Some(&2) && c.get("FAIL") == Some(&1)
    })
    .await;
    assert_eq!(
        (
            counts.get("SUCCESS"),
            counts.get("FAIL"),
            counts.get("WAIT")
        ),
        (Some(&2), Some(&1), Some(&2)),
        "{counts:?}"
    );
    // The relay's next claim finds the dead head and marks the key blocked.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let blocked = loop {
        let b: i64 = db::scalar(&client, "SELECT blocked_keys FROM outbox_stats()", &[]).await;
        if b == 1 || std::time::Instant::now() > deadline {
            break b;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(blocked, 1);
    assert_eq!(first_arrivals(&broker, "orders", "K"), [k1]);
    assert_eq!(first_arrivals(&broker, "orders", "L"), [l1]);

    // The operator skips the dead event: the rest of K follows, in order.
    let n: i32 = db::scalar(&client, "SELECT outbox_skip($1)", &[&vec![k2]]).await;
    assert_eq!(n, 1);
    let counts = wait_counts(&client, Duration::from_secs(30), |c| {
        c.get("SUCCESS") == Some(&4)
    })
    .await;
    assert_eq!(counts.get("SUCCESS"), Some(&4), "{counts:?}");
    assert_eq!(first_arrivals(&broker, "orders", "K"), [k1, k3, k4]);
    assert!(relay.is_running(), "{}", relay.log_tail(20));
    relay.terminate(Duration::from_secs(20)).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_rejection_lets_no_later_event_of_its_key_onto_the_wire() {
    // The topic refuses batches over 4,096 bytes, the extension allows larger events: the broker
    // rejects K's first event after the relay handed the whole round to the producer. One message
    // per produce request (as when a key's events are queued while earlier requests are in
    // flight): K's later events travel in requests of their own, behind the rejected one.
    let db = TestDb::create();
    db.set(&[("outbox.max_retry", "0")]);
    let broker = Broker::start();
    broker.create_topic_with("sized", &[("max.message.bytes", "4096")]);
    let client = db.connect().await;
    let tx_events: Vec<(&str, i32)> = std::iter::once(("K", 8_000))
        .chain((0..12).map(|i| (if i % 3 == 2 { "L" } else { "K" }, 10)))
        .collect();
    let mut ids: BTreeMap<&str, Vec<i64>> = BTreeMap::new();
    let mut c = db.connect().await;
    let tx = c.transaction().await.unwrap();
    for (key, size) in &tx_events {
        let id: i64 = tx
            .query_one(
                "SELECT outbox_enqueue('sized', jsonb_build_object('pad', repeat('x', $1)), key => $2)",
                &[size, key],
            )
            .await
            .unwrap()
            .get(0);
        ids.entry(key).or_default().push(id);
    }
    tx.commit().await.unwrap();
    let head = ids["K"][0];
    let mut relay = Relay::spawn(
        &db.url(),
        &broker.addr(),
        &[
            "--poll-interval",
            "100ms",
            "--kafka-property",
            "batch.num.messages=1",
        ],
    );
    // K's head is rejected for good (max_retry 0): the rest of K waits behind it.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let dead: i64 = db::scalar(
            &client,
            "SELECT count(*) FROM outbox_event WHERE id = $1 AND status::text = 'FAIL'",
            &[&head],
        )
        .await;
        let blocked: i64 =
            db::scalar(&client, "SELECT blocked_keys FROM outbox_stats()", &[]).await;
        if (dead == 1 && blocked >= 1) || std::time::Instant::now() > deadline {
            assert_eq!((dead, blocked >= 1), (1, true), "{}", relay.log_tail(30));
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let early = first_arrivals(&broker, "sized", "K");
    assert!(
        early.is_empty(),
        "later events of K reached the broker although its first event was rejected: {early:?}"
    );

    // The operator skips the rejected event: the rest of K follows in commit order.
    let n: i32 = db::scalar(&client, "SELECT outbox_skip($1)", &[&vec![head]]).await;
    assert_eq!(n, 1);
    let rest = ids["K"][1..].to_vec();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let arrived = first_arrivals(&broker, "sized", "K");
        if arrived.len() >= rest.len() || std::time::Instant::now() > deadline {
            let states: Vec<(i64, String, Option<String>)> = client
                .query(
                    "SELECT id, status::text, last_error FROM outbox_event ORDER BY id",
                    &[],
                )
                .await
                .unwrap()
                .iter()
                .map(|r| (r.get(0), r.get(1), r.get(2)))
                .collect();
            assert_eq!(arrived, rest, "{states:?}\n{}", relay.log_tail(30));
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let l = first_arrivals(&broker, "sized", "L");
    assert!(l.windows(2).all(|w| w[0] < w[1]), "L out of order: {l:?}");
    assert!(relay.is_running(), "{}", relay.log_tail(20));
    relay.terminate(Duration::from_secs(20)).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heads_refused_again_and_again_let_no_later_event_of_their_key_onto_the_wire() {
    // The fault runner's rejection phase without its other faults, repeated: three keys, each a
    // head too large for its topic and later events in the same transaction. Each refusal makes
    // the producer fatal and the relay replaces it, so every retry goes out on a new producer id,
    // whose first batch the broker accepts at any sequence: a later event handed to librdkafka
    // before its head's delivery report could be written although the head was refused.
    const REFUSALS: i32 = 4;
    let db = TestDb::create();
    db.set(&[
        ("outbox.max_retry", "100"),
        ("outbox.backoff_base", "50ms"),
        ("outbox.backoff_max", "200ms"),
    ]);
    let broker = Broker::start();
    broker.create_topic_with("limited", &[("max.message.bytes", "1024")]);
    let keys = ["A", "B", "C"];
    let mut ids: BTreeMap<&str, Vec<i64>> = BTreeMap::new();
    let mut c = db.connect().await;
    let tx = c.transaction().await.unwrap();
    for j in 0..3 {
        for key in keys {
            let pad: i32 = if j == 0 { 20_000 } else { 10 };
            let id: i64 = tx
                .query_one(
                    "SELECT outbox_enqueue('limited', jsonb_build_object('pad', repeat('x', $1)), key => $2)",
                    &[&pad, &key],
                )
                .await
                .unwrap()
                .get(0);
            ids.entry(key).or_default().push(id);
        }
    }
    tx.commit().await.unwrap();
    let heads: Vec<i64> = keys.iter().map(|k| ids[k][0]).collect();
    // A head above batch.size travels in a record batch of its own, its key's later events in
    // the next one (in one batch with them the broker would refuse them all).
    let mut relay = Relay::spawn(
        &db.url(),
        &broker.addr(),
        &[
            "--poll-interval",
            "100ms",
            "--kafka-property",
            "batch.size=16384",
        ],
    );
    let client = db.connect().await;
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    loop {
        let refused: i64 = db::scalar(
            &client,
            "SELECT count(*) FROM outbox_event WHERE id = ANY($1) AND retry_count >= $2",
            &[&heads, &REFUSALS],
        )
        .await;
        if refused == keys.len() as i64 || std::time::Instant::now() > deadline {
            assert_eq!(refused, keys.len() as i64, "{}", relay.log_tail(30));
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let replaced = relay
        .metric_where("outbox_producer_replaced_total", "reason=\"fatal\"")
        .unwrap_or(0.0);
    for key in keys {
        let early = first_arrivals(&broker, "limited", key);
        assert!(
            early.is_empty(),
            "later events of {key} reached the broker while its head was refused \
             ({replaced} producers replaced): {early:?}"
        );
    }

    // The operator raises the topic's limit: the heads go through, then the rest, in order.
    outbox_tests::kafka::alter_topic_config(
        &broker.addr(),
        "limited",
        &[("max.message.bytes", "1048588")],
    )
    .unwrap();
    let total = (keys.len() * 3) as i64;
    let counts = wait_counts(&client, Duration::from_secs(60), |c| {
        c.get("SUCCESS").copied().unwrap_or(0) == total
    })
    .await;
    assert_eq!(counts.get("SUCCESS"), Some(&total), "{counts:?}");
    for key in keys {
        assert_eq!(
            first_arrivals(&broker, "limited", key),
            ids[key],
            "key {key}"
        );
    }
    assert!(relay.is_running(), "{}", relay.log_tail(20));
    relay.terminate(Duration::from_secs(20)).unwrap();
}
