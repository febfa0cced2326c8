//! `outbox_enqueue_many`: many events of one topic in one call. Ids come back in array order,
//! per-key order follows array order, and one bad element fails the whole call with an error
//! naming its position, leaving nothing behind.

use outbox_tests::db::{db_error, scalar, TestDb};
use tokio_postgres::Client;

async fn count(c: &Client) -> i64 {
    scalar(c, "SELECT count(*) FROM outbox_event", &[]).await
}

#[tokio::test]
async fn returns_ids_in_array_order_and_stores_every_field() {
    let db = TestDb::create();
    let c = db.connect().await;
    let ids: Vec<i64> = c
        .query(
            "SELECT * FROM outbox_enqueue_many('orders', \
               ARRAY['{\"n\": 1}', '{\"n\": 2}', '{\"n\": 3}']::jsonb[], \
               keys => ARRAY['a', NULL, 'a'], \
               event_types => ARRAY['OrderCreated', 'Ping', 'OrderPaid'], \
               headers => ARRAY['{\"trace\": \"t1\"}', NULL, '{}']::jsonb[])",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(ids.len(), 3);
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "{ids:?}");
    let rows = c
        .query(
            "SELECT payload->>'n', event_key, event_type, headers::text, ordered, status::text \
               FROM outbox_event WHERE id = ANY($1) ORDER BY id",
            &[&ids],
        )
        .await
        .unwrap();
    let got: Vec<(String, Option<String>, String, String, bool, String)> = rows
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4), r.get(5)))
        .collect();
    assert_eq!(
        got,
        vec![
            (
                "1".into(),
                Some("a".into()),
                "OrderCreated".into(),
                r#"{"trace": "t1"}"#.into(),
                true,
                "WAIT".into()
            ),
            (
                "2".into(),
                None,
                "Ping".into(),
                "{}".into(),
                false,
                "WAIT".into()
            ),
            (
                "3".into(),
                Some("a".into()),
                "OrderPaid".into(),
                "{}".into(),
                true,
                "WAIT".into()
            ),
        ]
    );
    // Key a's run comes out of the claim in array order, and the unkeyed event beside it.
    let claimed: Vec<i64> = c
        .query("SELECT id FROM outbox_claim('r', 10)", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(claimed, ids);

    // An empty array enqueues nothing and is no error.
    let none: i64 = scalar(
        &c,
        "SELECT count(*) FROM outbox_enqueue_many('orders', '{}'::jsonb[])",
        &[],
    )
    .await;
    assert_eq!(none, 0);
}

#[tokio::test]
async fn one_bad_element_fails_the_call_naming_its_position_and_writes_nothing() {
    let db = TestDb::create();
    let c = db.connect().await;
    c.batch_execute("SET outbox.max_payload_bytes = 100")
        .await
        .unwrap();
    let big = "x".repeat(200);
    let cases: Vec<(String, &str, &str)> = vec![
        (
            "SELECT outbox_enqueue_many('orders', ARRAY['{}', NULL, '{}']::jsonb[])".into(),
            "22004",
            "payloads[2] is NULL",
        ),
        (
            "SELECT outbox_enqueue_many('orders', NULL)".into(),
            "22004",
            "payloads must be an array",
        ),
        (
            format!(
                "SELECT outbox_enqueue_many('orders', ARRAY['{{}}', '{{}}', '\"{big}\"']::jsonb[])"
            ),
            "54000",
            "payloads[3]: message is 202 bytes",
        ),
        (
            "SELECT outbox_enqueue_many('orders', ARRAY['{}', '{}']::jsonb[], \
               headers => ARRAY['{}', '{\"n\": 1}']::jsonb[])"
                .into(),
            "22023",
            "headers[2] must be a JSON object whose values are strings",
        ),
        (
            "SELECT outbox_enqueue_many('orders', ARRAY['{}', '{}']::jsonb[], \
               headers => ARRAY['{\"event_id\": \"x\"}', '{}']::jsonb[])"
                .into(),
            "22023",
            "headers[1]: header 'event_id' is set by the relay",
        ),
        (
            "SELECT outbox_enqueue_many('orders', ARRAY['{}', '{}']::jsonb[], keys => ARRAY['a'])"
                .into(),
            "22023",
            "keys has 1 elements, payloads 2",
        ),
        (
            "SELECT outbox_enqueue_many('orders', ARRAY[['{}'], ['{}']]::jsonb[])".into(),
            "22023",
            "one-dimensional",
        ),
        (
            "SELECT outbox_enqueue_many('bad topic', ARRAY['{}']::jsonb[])".into(),
            "22023",
            "topic must be 1 to 249 characters",
        ),
        (
            "SELECT outbox_enqueue_many('orders', ARRAY['{}']::jsonb[], deliver_at => 'infinity')"
                .into(),
            "22023",
            "deliver_at must be a finite timestamp",
        ),
    ];
    for (sql, code, message) in cases {
        let (got_code, got_message) = db_error(c.execute(sql.as_str(), &[]).await);
        assert_eq!(got_code, code, "{sql}: {got_message}");
        assert!(
            got_message.contains(message),
            "{sql}: {got_message:?} should say {message:?}"
        );
        assert_eq!(count(&c).await, 0, "{sql} left rows behind");
    }
    let keys: i64 = scalar(&c, "SELECT count(*) FROM outbox_key", &[]).await;
    assert_eq!(keys, 0, "no key rows either");
}

#[tokio::test]
async fn a_bulk_call_keeps_array_order_and_waits_for_no_other_producer() {
    // Two producers of one key, each in its own transaction, neither waiting for the other: the
    // single enqueue commits first and goes out first; the bulk call's events follow in array
    // order once it commits and the key's earlier claim is settled.
    let db = TestDb::create();
    let mut bulk = db.connect().await;
    let single = db.connect().await;
    let tx = bulk.transaction().await.unwrap();
    tx.execute(
        "SELECT outbox_enqueue_many('orders', ARRAY['{\"n\": 1}', '{\"n\": 2}']::jsonb[], \
           keys => ARRAY['k', 'k'])",
        &[],
    )
    .await
    .unwrap();
    single
        .batch_execute("SET lock_timeout = '1s'")
        .await
        .unwrap();
    single
        .execute(
            "SELECT outbox_enqueue('orders', '{\"n\": 3}', key => 'k')",
            &[],
        )
        .await
        .unwrap();
    let first = claim_payloads(&single).await;
    assert_eq!(first.0, vec!["3"]);
    tx.commit().await.unwrap();
    let acked: i32 = scalar(
        &single,
        "SELECT outbox_ack('r', $1, $2)",
        &[&first.1, &first.2],
    )
    .await;
    assert_eq!(acked, 1);
    assert_eq!(claim_payloads(&single).await.0, vec!["1", "2"]);
}

/// The payloads' "n" a claim by 'r' returns, with its token and ids.
async fn claim_payloads(c: &Client) -> (Vec<String>, i64, Vec<i64>) {
    let rows = c
        .query(
            "SELECT payload->>'n', claim_token, id FROM outbox_claim('r', 10)",
            &[],
        )
        .await
        .unwrap();
    (
        rows.iter().map(|r| r.get(0)).collect(),
        rows.first().map(|r| r.get(1)).unwrap_or(0),
        rows.iter().map(|r| r.get(2)).collect(),
    )
}
