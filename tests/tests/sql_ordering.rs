//! Per-key order (docs/reference.md, "Per-key order"): within one (topic, key) an event is never
//! claimed before every earlier event of that key is SUCCESS (or skipped), where "earlier" is
//! commit order; events without a key, and keyed events of unordered topics, stay parallel.

use std::time::{Duration, Instant};

use outbox_tests::build;
use outbox_tests::db::{batch_floor, lock_wait, scalar, TestDb};
use tokio_postgres::Client;

async fn enqueue(c: &Client, key: &str) -> i64 {
    scalar(
        c,
        "SELECT outbox_enqueue('orders', '{}', key => $1)",
        &[&key],
    )
    .await
}

/// Claims for `owner`: the ids in the order returned, and the token.
async fn claim(c: &Client, owner: &str, max: i32) -> (Vec<i64>, i64) {
    let rows = c
        .query(
            "SELECT id, claim_token FROM outbox_claim($1, $2)",
            &[&owner, &max],
        )
        .await
        .unwrap();
    let token = rows.first().map(|r| r.get(1)).unwrap_or(0);
    (rows.iter().map(|r| r.get(0)).collect(), token)
}

async fn settle(c: &Client, call: &str, owner: &str, token: i64, ids: &[i64]) -> i32 {
    scalar(
        c,
        &format!("SELECT {call}($1, $2, $3)"),
        &[&owner, &token, &ids],
    )
    .await
}

/// Waits until `pid` waits for a lock (a producer queued behind another one on its order row).
async fn wait_until_blocked(c: &Client, pid: i32) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if lock_wait(c, pid).await == Some(true) {
            return;
        }
        assert!(Instant::now() < deadline, "backend {pid} never waited");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn commit_order_decides_not_start_order() {
    // The case: T2 starts first, waits for T1's lock on the order row, and enqueues
    // OrderPaid after T1 committed OrderCreated. Before 0.4.0 the claim returned OrderPaid first.
    let db = TestDb::create();
    let setup = db.connect().await;
    setup
        .batch_execute("CREATE TABLE orders (id int PRIMARY KEY, state text); INSERT INTO orders VALUES (1, 'new')")
        .await
        .unwrap();
    let t2 = db.connect().await;
    let t1 = db.connect().await;
    t2.batch_execute("BEGIN; SELECT now()").await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    t1.batch_execute("BEGIN; UPDATE orders SET state = 'created' WHERE id = 1")
        .await
        .unwrap();
    let t2_pid: i32 = scalar(&t2, "SELECT pg_backend_pid()", &[]).await;
    let paid = tokio::spawn(async move {
        t2.batch_execute(
            "UPDATE orders SET state = 'paid' WHERE id = 1; \
             SELECT outbox_enqueue('orders', '{}', key => 'order-1', event_type => 'OrderPaid'); COMMIT",
        )
        .await
        .unwrap();
    });
    wait_until_blocked(&setup, t2_pid).await;
    t1.batch_execute(
        "SELECT outbox_enqueue('orders', '{}', key => 'order-1', event_type => 'OrderCreated'); COMMIT",
    )
    .await
    .unwrap();
    paid.await.unwrap();

    let types: Vec<String> = setup
        .query("SELECT event_type FROM outbox_claim('relay-a', 10)", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(types, ["OrderCreated", "OrderPaid"]);
}

/// Producers of one key take no lock of the extension's: a second one commits while the first is
/// still open, and what has committed goes out first; the first follows once it commits (and once
/// the key's earlier claim is settled). A rolled-back producer leaves nothing behind.
#[tokio::test]
async fn producers_of_one_key_never_wait_for_each_other() {
    let db = TestDb::create();
    let watch = db.connect().await;
    let first = db.connect().await;
    let second = db.connect().await;
    first.batch_execute("BEGIN").await.unwrap();
    let first_id = enqueue(&first, "k").await;
    second
        .batch_execute("SET lock_timeout = '1s'; BEGIN")
        .await
        .unwrap();
    let second_id = enqueue(&second, "k").await;
    second.batch_execute("COMMIT").await.unwrap();
    let rolled_back = db.connect().await;
    rolled_back.batch_execute("BEGIN").await.unwrap();
    enqueue(&rolled_back, "k").await;
    rolled_back.batch_execute("ROLLBACK").await.unwrap();

    let (ids, token) = claim(&watch, "relay-a", 10).await;
    assert_eq!(
        ids,
        [second_id],
        "only the committed event, though its id is higher"
    );
    first.batch_execute("COMMIT").await.unwrap();
    let (ids2, _) = claim(&watch, "relay-b", 10).await;
    assert!(
        ids2.is_empty(),
        "key k is busy until relay-a settles: {ids2:?}"
    );
    settle(&watch, "outbox_ack", "relay-a", token, &ids).await;
    let (ids, _) = claim(&watch, "relay-a", 10).await;
    assert_eq!(ids, [first_id]);
}

#[tokio::test]
async fn a_key_is_claimed_by_one_caller_at_a_time_and_unkeyed_events_in_parallel() {
    let db = TestDb::create();
    let c = db.connect().await;
    let mut k = Vec::new();
    for _ in 0..4 {
        k.push(enqueue(&c, "k").await);
    }
    let (a, _) = claim(&c, "relay-a", 2).await;
    assert_eq!(a, k[..2], "the head of the key and the next, in order");
    let (b, _) = claim(&c, "relay-b", 2).await;
    assert!(b.is_empty(), "the key is held by relay-a: {b:?}");

    let mut free = Vec::new();
    for _ in 0..4 {
        free.push(scalar::<i64>(&c, "SELECT outbox_enqueue('orders', '{}')", &[]).await);
    }
    let (a, _) = claim(&c, "relay-a", 2).await;
    let (b, _) = claim(&c, "relay-b", 2).await;
    assert_eq!((a.len(), b.len()), (2, 2), "unkeyed events go to both");

    // An unordered topic's keyed events are claimed in parallel too, and say so.
    c.batch_execute("SET outbox.unordered_topics = 'metrics, logs.*'")
        .await
        .unwrap();
    for _ in 0..4 {
        scalar::<i64>(
            &c,
            "SELECT outbox_enqueue('logs.app', '{}', key => 'k')",
            &[],
        )
        .await;
    }
    let ordered: i64 = scalar(
        &c,
        "SELECT count(*) FROM outbox_event WHERE topic = 'logs.app' AND ordered",
        &[],
    )
    .await;
    assert_eq!(ordered, 0);
    let (a, _) = claim(&c, "relay-a", 2).await;
    let (b, _) = claim(&c, "relay-b", 2).await;
    assert_eq!((a.len(), b.len()), (2, 2));
    // A malformed list is refused at use, like outbox.allowed_topics' entries (the SET itself
    // succeeds in both builds: a string setting).
    c.batch_execute("SET outbox.unordered_topics = 'bad topic'")
        .await
        .unwrap();
    let err = c
        .query_one("SELECT outbox_enqueue('orders', '{}', key => 'x')", &[])
        .await
        .unwrap_err();
    assert_eq!(err.code().unwrap().code(), "22023", "{err}");
}

#[tokio::test]
async fn a_nacked_head_holds_its_key_until_its_backoff_ends() {
    let db = TestDb::create();
    let c = db.connect().await;
    c.batch_execute("SET outbox.backoff_base = '300ms'")
        .await
        .unwrap();
    let a1 = enqueue(&c, "A").await;
    let a2 = enqueue(&c, "A").await;
    let b1 = enqueue(&c, "B").await;
    let (ids, token) = claim(&c, "relay-a", 1).await;
    assert_eq!(ids, [a1]);
    assert_eq!(settle(&c, "outbox_nack", "relay-a", token, &ids).await, 1);
    let (ids, token) = claim(&c, "relay-a", 10).await;
    assert_eq!(
        ids,
        [b1],
        "A's next event waits behind its backing-off head"
    );
    settle(&c, "outbox_ack", "relay-a", token, &ids).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    let (ids, _) = claim(&c, "relay-a", 10).await;
    assert_eq!(
        ids,
        [a1, a2],
        "after the backoff: the head, then the rest, in order"
    );
}

/// A claimed run where the head failed for good and the relay released the rest of the run.
async fn dead_head(c: &Client) -> (i64, i64, i64, i64) {
    c.batch_execute("SET outbox.max_retry = 0").await.unwrap();
    let a1 = enqueue(c, "A").await;
    let a2 = enqueue(c, "A").await;
    let a3 = enqueue(c, "A").await;
    let b1 = enqueue(c, "B").await;
    let (ids, token) = claim(c, "relay-a", 10).await;
    assert_eq!(ids, [a1, a2, a3, b1]);
    assert_eq!(settle(c, "outbox_nack", "relay-a", token, &[a1]).await, 1);
    assert_eq!(
        settle(c, "outbox_release", "relay-a", token, &[a2, a3]).await,
        2
    );
    assert_eq!(settle(c, "outbox_ack", "relay-a", token, &[b1]).await, 1);
    (a1, a2, a3, b1)
}

#[tokio::test]
async fn a_dead_head_blocks_its_key_until_requeued_and_shows_as_blocked() {
    let db = TestDb::create();
    let c = db.connect().await;
    let (a1, a2, a3, _) = dead_head(&c).await;
    let a4 = enqueue(&c, "A").await;
    let b2 = enqueue(&c, "B").await;
    let (ids, token) = claim(&c, "relay-a", 10).await;
    assert_eq!(
        ids,
        [b2],
        "key A is blocked by its dead head, key B goes on"
    );
    settle(&c, "outbox_ack", "relay-a", token, &ids).await;

    let blocked = c
        .query(
            "SELECT topic, event_key, head_id, waiting, last_error IS NULL FROM outbox_blocked_keys()",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(blocked.len(), 1);
    let r = &blocked[0];
    assert_eq!(
        (
            r.get::<_, String>(0),
            r.get::<_, String>(1),
            r.get::<_, i64>(2),
            r.get::<_, i64>(3)
        ),
        ("orders".into(), "A".into(), a1, 3)
    );
    let (keys, age): (i64, bool) = {
        let r = c
            .query_one(
                "SELECT blocked_keys, oldest_blocked_age >= interval '0' FROM outbox_stats()",
                &[],
            )
            .await
            .unwrap();
        (r.get(0), r.get(1))
    };
    assert_eq!((keys, age), (1, true));

    assert_eq!(
        scalar::<i32>(&c, "SELECT outbox_requeue($1)", &[&vec![a1]]).await,
        1
    );
    let (ids, _) = claim(&c, "relay-a", 10).await;
    assert_eq!(ids, [a1, a2, a3, a4], "the key resumes in order");
    let blocked: i64 = scalar(&c, "SELECT blocked_keys FROM outbox_stats()", &[]).await;
    assert_eq!(blocked, 0);
}

#[tokio::test]
async fn skipping_a_dead_head_lets_its_key_go_on_and_keeps_the_dead_letter() {
    let db = TestDb::create();
    let c = db.connect().await;
    let (a1, a2, a3, _) = dead_head(&c).await;
    let (ids, _) = claim(&c, "relay-a", 10).await;
    assert!(ids.is_empty(), "blocked: {ids:?}");
    assert_eq!(
        scalar::<i32>(&c, "SELECT outbox_skip($1)", &[&vec![a1, a2]]).await,
        1,
        "only dead letters are skipped"
    );
    let (ids, token) = claim(&c, "relay-a", 10).await;
    assert_eq!(ids, [a2, a3]);
    settle(&c, "outbox_ack", "relay-a", token, &ids).await;
    let dead: Vec<i64> = c
        .query("SELECT id FROM outbox_dead_letters()", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(dead, [a1], "a skipped event is still a dead letter");
    // Nothing is left to do: the key rows are gone.
    claim(&c, "relay-a", 10).await;
    let keys: i64 = scalar(&c, "SELECT count(*) FROM outbox_key", &[]).await;
    assert_eq!(keys, 0);
}

#[tokio::test]
async fn the_skip_policy_lets_a_key_go_on_past_its_dead_head() {
    let db = TestDb::create();
    let c = db.connect().await;
    c.batch_execute("SET outbox.head_of_line = 'skip'")
        .await
        .unwrap();
    let (_, a2, a3, _) = dead_head(&c).await;
    let (ids, _) = claim(&c, "relay-a", 10).await;
    assert_eq!(ids, [a2, a3]);
    let blocked: i64 = scalar(&c, "SELECT count(*) FROM outbox_blocked_keys()", &[]).await;
    assert_eq!(blocked, 0);
    // A bad value: refused at SET by the native build, at the next claim by the SQL-only build
    // (no registered settings there: docs/sql-only.md).
    let err = if build::sql_only() {
        c.batch_execute("SET outbox.head_of_line = 'sometimes'")
            .await
            .unwrap();
        c.query("SELECT * FROM outbox_claim('relay-a', 1)", &[])
            .await
            .unwrap_err()
    } else {
        c.batch_execute("SET outbox.head_of_line = 'sometimes'")
            .await
            .unwrap_err()
    };
    assert_eq!(err.code().unwrap().code(), "22023", "{err}");
}

/// A key row lives as long as its key has events in row state; producers never touch it (they
/// only append to the stream), so the claim that finds the key idle deletes it at once, and an
/// event a producer is committing meanwhile goes out through the stream.
#[tokio::test]
async fn an_idle_key_row_is_deleted_and_producers_never_need_it() {
    let db = TestDb::create();
    let c = db.connect().await;
    let producer = db.connect().await;
    let e1 = enqueue(&c, "k").await;
    // Released once, the key's events live in outbox_scheduled behind a key row.
    let (ids, token) = claim(&c, "relay-a", 10).await;
    assert_eq!(ids, [e1]);
    assert_eq!(
        settle(&c, "outbox_release", "relay-a", token, &ids).await,
        1
    );
    let keys: i64 = scalar(&c, "SELECT count(*) FROM outbox_key", &[]).await;
    assert_eq!(keys, 1, "a released keyed event waits behind a key row");
    let (ids, token) = claim(&c, "relay-a", 10).await;
    assert_eq!(ids, [e1]);
    settle(&c, "outbox_ack", "relay-a", token, &ids).await;

    producer.batch_execute("BEGIN").await.unwrap();
    let e2 = enqueue(&producer, "k").await;
    let (ids, _) = claim(&c, "relay-a", 10).await;
    assert!(ids.is_empty());
    let keys: i64 = scalar(&c, "SELECT count(*) FROM outbox_key", &[]).await;
    assert_eq!(keys, 0, "the idle key's row is gone");
    producer.batch_execute("COMMIT").await.unwrap();
    let (ids, token) = claim(&c, "relay-a", 10).await;
    assert_eq!(ids, [e2]);
    settle(&c, "outbox_ack", "relay-a", token, &ids).await;
}

#[tokio::test]
async fn a_reclaimed_run_goes_back_to_its_key_in_order() {
    let db = TestDb::create();
    let c = db.connect().await;
    let k: Vec<i64> = {
        let mut v = Vec::new();
        for _ in 0..3 {
            v.push(enqueue(&c, "k").await);
        }
        v
    };
    let (ids, _) = claim(&c, "relay-dead", 10).await;
    assert_eq!(ids, k);
    tokio::time::sleep(Duration::from_millis(20)).await;
    let n: i32 = scalar(&c, "SELECT outbox_reclaim('1 millisecond')", &[]).await;
    assert_eq!(n, 3);
    let (ids, _) = claim(&c, "relay-b", 10).await;
    assert_eq!(ids, k);
}

/// Two producers of one key, the second of which began (and drew its txid) before the first but
/// enqueued after the first committed, as a producer waiting for the key's aggregate row does: the
/// cursor hands out a window in id order, so the first commit goes out first, and a batch never
/// exceeds max_events.
#[tokio::test]
async fn an_event_committed_first_goes_out_first_though_its_transaction_started_later() {
    let db = TestDb::create();
    let c = db.connect().await;
    let started_first = db.connect().await;
    started_first
        .batch_execute("BEGIN; SELECT pg_current_xact_id()")
        .await
        .unwrap();
    let committed_first = enqueue(&c, "k").await;
    let committed_second = enqueue(&started_first, "k").await;
    started_first.batch_execute("COMMIT").await.unwrap();
    let other = enqueue(&c, "other").await;
    let in_txid_order: Vec<i64> = c
        .query("SELECT id FROM outbox_stream ORDER BY txid, id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(
        in_txid_order,
        [committed_second, committed_first, other],
        "the case under test: the later commit has the lower txid"
    );

    let (ids, token) = claim(&c, "relay-a", 1).await;
    assert_eq!(
        ids,
        [committed_first],
        "one event: max_events is a hard cap"
    );
    let (ids2, token2) = claim(&c, "relay-b", 10).await;
    assert_eq!(ids2, [other], "key k is busy until relay-a settles");
    settle(&c, "outbox_ack", "relay-a", token, &ids).await;
    settle(&c, "outbox_ack", "relay-b", token2, &ids2).await;
    let (ids, token) = claim(&c, "relay-a", 10).await;
    assert_eq!(ids, [committed_second]);
    settle(&c, "outbox_ack", "relay-a", token, &ids).await;
    let (ids, _) = claim(&c, "relay-a", 10).await;
    assert!(ids.is_empty(), "{ids:?}");
    let states: Vec<String> = c
        .query("SELECT status::text FROM outbox_event ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(states, ["SUCCESS", "SUCCESS", "SUCCESS"]);
}

/// While a claim holds events of a key, a second claim hands out none of its later events: they
/// wait as scheduled rows, and go out, in order, as soon as the first claim is settled.
#[tokio::test]
async fn later_events_of_a_key_in_flight_wait_until_its_claim_is_settled() {
    let db = TestDb::create();
    let c = db.connect().await;
    let first = [enqueue(&c, "k").await, enqueue(&c, "k").await];
    let (ids, token) = claim(&c, "relay-a", 10).await;
    assert_eq!(ids, first);
    let later = [enqueue(&c, "k").await, enqueue(&c, "k").await];
    let free = enqueue(&c, "other").await;
    let (ids2, token2) = claim(&c, "relay-b", 10).await;
    assert_eq!(ids2, [free], "key k is busy in relay-a's claim");
    let waiting: Vec<(i64, String)> = c
        .query(
            "SELECT id, status::text FROM outbox_scheduled ORDER BY id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        waiting,
        [(later[0], "WAIT".into()), (later[1], "WAIT".into())]
    );
    let (ids3, _) = claim(&c, "relay-b", 10).await;
    assert!(ids3.is_empty(), "still busy: {ids3:?}");
    settle(&c, "outbox_ack", "relay-b", token2, &ids2).await;
    assert_eq!(settle(&c, "outbox_ack", "relay-a", token, &ids).await, 2);
    let (ids, _) = claim(&c, "relay-b", 10).await;
    assert_eq!(
        ids, later,
        "due at once when the claim holding the key is settled"
    );
}

/// Claims read the stream's batches from the cursor's floor on (the oldest unsettled batch), not
/// the whole table: the claim that writes a batch moves the floor up past settled ones, and never
/// above an unsettled one, whatever order the tokens were drawn in.
#[tokio::test]
async fn the_batch_floor_follows_the_oldest_unsettled_claim_and_keys_below_it_stay_busy() {
    let db = TestDb::create();
    let c = db.connect().await;
    // Tokens from 1001 on, so that tokens below them are free for the claim drawn below the floor.
    c.batch_execute("SELECT setval('outbox_claim_token_seq', 1000)")
        .await
        .unwrap();
    let a1 = enqueue(&c, "a").await;
    let (ids_a, token_a) = claim(&c, "relay-a", 10).await;
    assert_eq!(ids_a, [a1]);
    assert_eq!(batch_floor(&c).await, token_a, "the only unsettled batch");
    let b1 = enqueue(&c, "b").await;
    let (ids_b, token_b) = claim(&c, "relay-b", 10).await;
    assert_eq!(ids_b, [b1]);
    assert_eq!(
        batch_floor(&c).await,
        token_a,
        "relay-a's batch is still unsettled"
    );
    assert_eq!(
        settle(&c, "outbox_ack", "relay-a", token_a, &ids_a).await,
        1
    );
    let c1 = enqueue(&c, "c").await;
    let (ids_c, token_c) = claim(&c, "relay-c", 10).await;
    assert_eq!(ids_c, [c1]);
    assert_eq!(
        batch_floor(&c).await,
        token_b,
        "up to relay-b's, the oldest unsettled"
    );

    // A claim whose token is below the floor (here the sequence is set back; in production a
    // claim draws its token, then waits for the stream's lock while a later token writes first)
    // lowers the floor to its own batch, so its keys stay busy for the claims after it.
    c.batch_execute("SELECT setval('outbox_claim_token_seq', 1)")
        .await
        .unwrap();
    let d1 = enqueue(&c, "d").await;
    let (ids_d, token_d) = claim(&c, "relay-d", 10).await;
    assert_eq!(ids_d, [d1]);
    assert!(
        token_d < token_b,
        "token {token_d} was drawn below the floor {token_b}"
    );
    assert_eq!(batch_floor(&c).await, token_d);
    let d2 = enqueue(&c, "d").await;
    let (ids, _) = claim(&c, "relay-e", 10).await;
    assert!(ids.is_empty(), "key d is busy in relay-d's claim: {ids:?}");
    assert_eq!(
        settle(&c, "outbox_ack", "relay-d", token_d, &ids_d).await,
        1
    );
    let (ids, _) = claim(&c, "relay-e", 10).await;
    assert_eq!(ids, [d2], "due once relay-d's claim is settled");
    for (owner, token, ids) in [("relay-b", token_b, &ids_b), ("relay-c", token_c, &ids_c)] {
        assert_eq!(settle(&c, "outbox_ack", owner, token, ids).await, 1);
    }
}

/// An event due later takes no part in its key's order: a reminder due in an hour does not hold
/// back the key's events enqueued after it, and goes out itself when it is due.
#[tokio::test]
async fn an_event_due_later_does_not_hold_its_key() {
    let db = TestDb::create();
    let c = db.connect().await;
    let later: i64 = scalar(
        &c,
        "SELECT outbox_enqueue('orders', '{}', key => 'k', deliver_at => clock_timestamp() + interval '300 milliseconds')",
        &[],
    )
    .await;
    let now = enqueue(&c, "k").await;
    let (ids, token) = claim(&c, "relay-a", 10).await;
    assert_eq!(ids, [now]);
    settle(&c, "outbox_ack", "relay-a", token, &ids).await;
    tokio::time::sleep(Duration::from_millis(350)).await;
    let (ids, _) = claim(&c, "relay-a", 10).await;
    assert_eq!(ids, [later]);
}
