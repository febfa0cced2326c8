//! Per-key order end to end: producers racing on shared keys, two relays with two claim loops
//! each and small batches; per key, the first arrivals on the broker are in commit order, and
//! every committed event arrives.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use outbox_tests::broker::Broker;
use outbox_tests::db::{self, TestDb};
use outbox_tests::events::wait_counts;
use outbox_tests::relay::Relay;

const KEYS: i64 = 12;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn first_arrivals_of_each_key_are_in_commit_order() {
    let db = TestDb::create();
    let broker = Broker::start();
    broker.create_topic("orders");
    let relays: Vec<Relay> = (0..2)
        .map(|_| {
            Relay::spawn(
                &db.url(),
                &broker.addr(),
                &[
                    "--concurrency",
                    "2",
                    "--batch-size",
                    "7",
                    "--poll-interval",
                    "100ms",
                ],
            )
        })
        .collect();

    // Four producers commit 1 to 3 events per transaction on keys they share: who commits first
    // is decided by the race, and the ids must follow it within each key.
    let mut producers = Vec::new();
    for p in 0..4i64 {
        let url = db.url();
        producers.push(tokio::spawn(async move {
            let mut c = db::connect(&url).await;
            let mut committed = Vec::new();
            for t in 0..60i64 {
                let tx = c.transaction().await.unwrap();
                let mut ids = Vec::new();
                for i in 0..(1 + (p + t) % 3) {
                    let key = format!("order-{}", (p * 7 + t * 5 + i) % KEYS);
                    let id: i64 = tx
                        .query_one(
                            "SELECT outbox_enqueue('orders', jsonb_build_object('p', $1::int8, 't', $2::int8), key => $3)",
                            &[&p, &t, &key],
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

    let mut msgs = broker.consume_all("orders", Duration::from_secs(10));
    msgs.sort_by_key(|m| (m.partition, m.offset));
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
