//! Helpers for the relay tests: enqueueing events and reading their states.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use tokio_postgres::Client;

/// One enqueued event as the test expects it on the broker.
#[derive(Debug, Clone, PartialEq)]
pub struct Expected {
    pub id: i64,
    /// The event's UUID, expected in the `event_id` header.
    pub event_id: String,
    pub topic: String,
    pub key: String,
    pub event_type: String,
    pub payload: serde_json::Value,
    pub headers: BTreeMap<String, String>,
}

/// `outbox_enqueue` inside the caller's transaction (or autocommit); returns the event id.
pub async fn enqueue(
    client: &impl tokio_postgres::GenericClient,
    topic: &str,
    key: &str,
    event_type: &str,
    payload: &serde_json::Value,
    headers: &BTreeMap<String, String>,
) -> Expected {
    let payload_text = payload.to_string();
    let headers_text = serde_json::to_string(headers).expect("headers json");
    let id: i64 = client
        .query_one(
            "SELECT outbox_enqueue(topic => $1::text, payload => $2::text::jsonb, key => $3::text, \
             event_type => $4::text, headers => $5::text::jsonb)",
            &[&topic, &payload_text, &key, &event_type, &headers_text],
        )
        .await
        .expect("outbox_enqueue")
        .get(0);
    let row = client
        .query_one(
            "SELECT id, event_id::text FROM outbox_event WHERE id = $1",
            &[&id],
        )
        .await
        .expect("read back the event_id");
    Expected {
        id: row.get(0),
        event_id: row.get(1),
        topic: topic.to_string(),
        key: key.to_string(),
        event_type: event_type.to_string(),
        payload: payload.clone(),
        headers: headers.clone(),
    }
}

/// Enqueues `n` events in ONE transaction with one statement (a burst).
pub async fn enqueue_burst(client: &Client, topic: &str, n: i64) {
    client
        .execute(
            "SELECT outbox_enqueue(topic => $1::text, payload => jsonb_build_object('n', g), \
             key => 'k-' || (g % 97)) FROM generate_series(1, $2::bigint) g",
            &[&topic, &n],
        )
        .await
        .expect("burst enqueue");
}

/// Row counts by status (WAIT, SENDING, SUCCESS, FAIL; missing ones are 0).
pub async fn status_counts(client: &Client) -> BTreeMap<String, i64> {
    let mut m: BTreeMap<String, i64> = ["WAIT", "SENDING", "SUCCESS", "FAIL"]
        .iter()
        .map(|s| (s.to_string(), 0))
        .collect();
    for r in client
        .query(
            "SELECT status::text, count(*) FROM outbox_event GROUP BY 1",
            &[],
        )
        .await
        .expect("status counts")
    {
        m.insert(r.get(0), r.get(1));
    }
    m
}

/// Polls `status_counts` until `pred` holds; returns the last counts (the caller asserts).
pub async fn wait_counts(
    client: &Client,
    timeout: Duration,
    pred: impl Fn(&BTreeMap<String, i64>) -> bool,
) -> BTreeMap<String, i64> {
    let deadline = Instant::now() + timeout;
    loop {
        let c = status_counts(client).await;
        if pred(&c) || Instant::now() >= deadline {
            return c;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Ids of the rows in a status.
pub async fn ids_in(client: &Client, status: &str) -> Vec<i64> {
    client
        .query(
            "SELECT id FROM outbox_event WHERE status::text = $1 ORDER BY id",
            &[&status],
        )
        .await
        .expect("ids by status")
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// Asserts that every SUCCESS event of the outbox is on the broker's `topic`: at least once, so
/// copies fold into one.
pub async fn assert_succeeded_arrived(
    client: &Client,
    broker: &crate::broker::Broker,
    topic: &str,
) {
    let got: BTreeSet<i64> = broker
        .consume_all(topic, Duration::from_secs(3))
        .iter()
        .map(|m| m.outbox_id())
        .collect();
    let all: BTreeSet<i64> = ids_in(client, "SUCCESS").await.into_iter().collect();
    assert_eq!(got, all, "every event arrives (at least once)");
}
