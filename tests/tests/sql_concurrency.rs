//! Concurrent sessions (separate backends) against one table: no row is claimed twice, claimers do
//! not wait on each other's locks, a reclaim racing an ack never overwrites SUCCESS, and NOTIFY
//! is one per committing transaction.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use futures_util::{stream, StreamExt};
use outbox_tests::db::{self, scalar, TestDb};
/// The channel of `outbox.notify = on` (for a LISTEN client of the application's own).
const CHANNEL: &str = "outbox";
use tokio_postgres::{AsyncMessage, NoTls};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_claimers_never_receive_the_same_row() {
    let db = TestDb::create();
    let setup = db.connect().await;
    let total = 5_000i64;
    setup
        .execute("SELECT outbox_enqueue('orders', jsonb_build_object('n', g)) FROM generate_series(1, $1::int) g", &[&(total as i32)])
        .await
        .unwrap();

    let mut tasks = Vec::new();
    for claimer in 0..6 {
        let url = db.url();
        tasks.push(tokio::spawn(async move {
            let c = db::connect(&url).await;
            let owner = format!("claimer-{claimer}");
            let mut mine = Vec::new();
            loop {
                let rows = c
                    .query(
                        "SELECT id, claim_token FROM outbox_claim($1, 37)",
                        &[&owner],
                    )
                    .await
                    .unwrap();
                if rows.is_empty() {
                    break;
                }
                let token: i64 = rows[0].get(1);
                let ids: Vec<i64> = rows.iter().map(|r| r.get(0)).collect();
                let n: i32 =
                    scalar(&c, "SELECT outbox_ack($1, $2, $3)", &[&owner, &token, &ids]).await;
                assert_eq!(n as usize, ids.len(), "every claimed row is ours to ack");
                mine.extend(ids);
            }
            mine
        }));
    }
    let mut seen = HashSet::new();
    let mut claimed = 0;
    let mut busy_claimers = 0;
    for t in tasks {
        let mine = t.await.unwrap();
        busy_claimers += usize::from(!mine.is_empty());
        claimed += mine.len();
        for id in mine {
            assert!(seen.insert(id), "row {id} was claimed twice");
        }
    }
    assert_eq!(claimed as i64, total);
    assert!(busy_claimers > 1, "the claimers really ran side by side");
    let succeeded: i64 = scalar(
        &setup,
        "SELECT count(*) FROM outbox_event WHERE status = 'SUCCESS'",
        &[],
    )
    .await;
    assert_eq!(succeeded, total);
}

#[tokio::test]
async fn a_claimer_skips_rows_locked_by_another_instead_of_waiting() {
    let db = TestDb::create();
    let mut a = db.connect().await;
    let b = db.connect().await;
    let ids =
        |rows: Vec<tokio_postgres::Row>| -> Vec<i64> { rows.iter().map(|r| r.get(0)).collect() };
    // Four unkeyed events (the stream, read by one claim at a time) ...
    a.execute(
        "SELECT outbox_enqueue('orders', '{}') FROM generate_series(1, 4)",
        &[],
    )
    .await
    .unwrap();
    let tx = a.transaction().await.unwrap();
    let first = ids(tx
        .query("SELECT id FROM outbox_claim('a', 2)", &[])
        .await
        .unwrap());
    assert_eq!(first, vec![1, 2]);
    // ... and four that were due a moment later (scheduled rows, claimed row by row, SKIP LOCKED).
    b.execute(
        "SELECT outbox_enqueue('orders', '{}', key => 'k' || g,
                               deliver_at => clock_timestamp() + interval '100 milliseconds')
           FROM generate_series(1, 4) g",
        &[],
    )
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(150)).await;
    // While a's claim is uncommitted, b gets the scheduled events without waiting for their rows.
    // The stream's read position is a's until it commits: b waits for it at most a second,
    // then returns without stream events (lock_timeout would end a longer wait with an error).
    b.batch_execute("SET lock_timeout = '3s'").await.unwrap();
    let started = Instant::now();
    let second = ids(b
        .query("SELECT id FROM outbox_claim('b', 10)", &[])
        .await
        .unwrap());
    assert!(started.elapsed() < Duration::from_secs(2));
    assert_eq!(second, vec![5, 6, 7, 8]);
    let timeout: String = scalar(&b, "SHOW lock_timeout", &[]).await;
    assert_eq!(timeout, "3s", "the caller's lock_timeout is back");
    tx.commit().await.unwrap();
    // Once a committed, the stream goes on for b.
    let third = ids(b
        .query("SELECT id FROM outbox_claim('b', 10)", &[])
        .await
        .unwrap());
    assert_eq!(third, vec![3, 4]);
}

#[tokio::test]
async fn a_reclaim_racing_an_ack_never_overwrites_success() {
    let db = TestDb::create();
    let mut relay = db.connect().await;
    let reclaimer = db.connect().await;
    let id: i64 = scalar(&relay, "SELECT outbox_enqueue('orders', '{}')", &[]).await;
    let token: i64 = scalar(
        &relay,
        "SELECT claim_token FROM outbox_claim('relay-a', 1)",
        &[],
    )
    .await;
    tokio::time::sleep(Duration::from_millis(20)).await;

    // The ack is in flight (row locked, not committed) when the reclaim of an expired lease starts.
    let tx = relay.transaction().await.unwrap();
    let n: i32 = tx
        .query_one(
            "SELECT outbox_ack('relay-a', $1, ARRAY[$2::bigint])",
            &[&token, &id],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, 1);
    // The reclaim skips the row being settled (SKIP LOCKED: waiting could deadlock) instead of
    // taking it back from under the ack.
    let skipped: i32 = scalar(&reclaimer, "SELECT outbox_reclaim('1 millisecond')", &[]).await;
    assert_eq!(skipped, 0, "a row locked by its ack is not reclaimed");
    // Skipped is not lost: had the ack rolled back, the next reclaim takes the row.
    tx.rollback().await.unwrap();
    let taken: i32 = scalar(&reclaimer, "SELECT outbox_reclaim('1 millisecond')", &[]).await;
    assert_eq!(
        taken, 1,
        "an expired lease whose ack rolled back is reclaimed"
    );
    let token: i64 = scalar(
        &relay,
        "SELECT claim_token FROM outbox_claim('relay-a', 1)",
        &[],
    )
    .await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    let tx = relay.transaction().await.unwrap();
    let n: i32 = scalar(
        &tx,
        "SELECT outbox_ack('relay-a', $1, ARRAY[$2::bigint])",
        &[&token, &id],
    )
    .await;
    assert_eq!(n, 1);
    let skipped: i32 = scalar(&reclaimer, "SELECT outbox_reclaim('1 millisecond')", &[]).await;
    assert_eq!(skipped, 0, "a row locked by its ack is not reclaimed");
    tx.commit().await.unwrap();
    let after: i32 = scalar(&reclaimer, "SELECT outbox_reclaim('1 millisecond')", &[]).await;
    assert_eq!(after, 0, "the acked row is SUCCESS, not reclaimable");
    let r = relay
        .query_one(
            "SELECT status::text, retry_count FROM outbox_event WHERE id = $1",
            &[&id],
        )
        .await
        .unwrap();
    assert_eq!(
        (r.get::<_, String>(0), r.get::<_, i32>(1)),
        ("SUCCESS".into(), 1),
        "acked once, after one reclaimed attempt"
    );
}

/// Counts `NOTIFY outbox` messages received by a listening session until `quiet` passes without one.
async fn listen_while<F: std::future::Future<Output = ()>>(db: &TestDb, work: F) -> usize {
    let (listener, mut conn) = tokio_postgres::connect(&db.url(), NoTls).await.unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let mut messages = stream::poll_fn(move |cx| conn.poll_message(cx));
    tokio::spawn(async move {
        while let Some(Ok(msg)) = messages.next().await {
            if let AsyncMessage::Notification(n) = msg {
                let _ = tx.send(n.channel().to_string());
            }
        }
    });
    listener
        .batch_execute(&format!("LISTEN {CHANNEL}"))
        .await
        .unwrap();
    work.await;
    let mut count = 0;
    while let Ok(Some(channel)) = tokio::time::timeout(Duration::from_millis(500), rx.recv()).await
    {
        assert_eq!(channel, CHANNEL);
        count += 1;
    }
    count
}

#[tokio::test]
async fn notify_when_enabled_is_one_per_committing_transaction_and_none_on_rollback() {
    let db = TestDb::create();
    let mut c = db.connect().await;

    // Off by default: relays wait with outbox_wait, and NOTIFY would serialize commits.
    let n = listen_while(&db, async {
        c.execute("SELECT outbox_enqueue('orders', '{}')", &[])
            .await
            .unwrap();
    })
    .await;
    assert_eq!(n, 0, "outbox.notify is off by default");
    c.batch_execute("SET outbox.notify = on").await.unwrap();

    let n = listen_while(&db, async {
        let tx = c.transaction().await.unwrap();
        for _ in 0..50 {
            tx.execute("SELECT outbox_enqueue('orders', '{}')", &[])
                .await
                .unwrap();
        }
        // A savepoint level too: still one notification at commit.
        tx.batch_execute("SAVEPOINT s; SELECT outbox_enqueue('orders', '{}'); RELEASE s")
            .await
            .unwrap();
        tx.commit().await.unwrap();
    })
    .await;
    assert_eq!(n, 1, "50 enqueues in one transaction wake relays once");

    let n = listen_while(&db, async {
        let tx = c.transaction().await.unwrap();
        tx.execute("SELECT outbox_enqueue('orders', '{}')", &[])
            .await
            .unwrap();
        tx.rollback().await.unwrap();
    })
    .await;
    assert_eq!(n, 0, "a rolled-back transaction notifies nothing");

    let n = listen_while(&db, async {
        c.batch_execute(
            "SET outbox.notify = off; SELECT outbox_enqueue('orders', '{}'); SET outbox.notify = on",
        )
        .await
        .unwrap();
    })
    .await;
    assert_eq!(n, 0, "outbox.notify = off sends nothing");

    let n = listen_while(&db, async {
        for _ in 0..3 {
            c.execute("SELECT outbox_enqueue('orders', '{}')", &[])
                .await
                .unwrap();
        }
    })
    .await;
    assert_eq!(n, 3, "three autocommit enqueues are three transactions");
}
