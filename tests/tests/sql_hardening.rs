//! Safe in a production order database: producer guards that producers cannot lift, the
//! isolation rule of the row-locking calls, one lock order, purge cost, and the small contract
//! fixes (nack keeps its last error, error-raising helpers are not IMMUTABLE).

use std::time::{Duration, Instant};

use outbox_tests::build;
use outbox_tests::db::{db_error, lock_wait, rejects, row_count, scalar, sqlstate, TestDb};
use outbox_tests::pg_cluster::PgCluster;
use outbox_tests::roles::{grant_recipe, Roles};
use tokio_postgres::Client;

#[tokio::test]
async fn producers_cannot_lift_the_producer_guards() {
    let roles;
    let db = TestDb::create();
    roles = Roles::create(&db, &[]);
    let producer = roles.name("producer");
    let c = db.connect().await;
    c.execute("SELECT outbox_enqueue('orders', '{}')", &[])
        .await
        .unwrap();
    c.batch_execute(&format!("SET ROLE {producer}"))
        .await
        .unwrap();
    if build::sql_only() {
        return sql_only_producers_cannot_lift_the_producer_guards(&db, &producer).await;
    }
    for set in [
        "SET outbox.max_payload_bytes = '100MB'",
        "SET outbox.allowed_topics = ''",
    ] {
        assert_eq!(sqlstate(c.batch_execute(set).await), "42501", "{set}");
    }

    // Set before the library is loaded (a placeholder): the value must not survive the load. A
    // server that preloads the library (this one, after scripts/setup) has no placeholders, so
    // this part runs on a throwaway cluster that loads it on first use.
    let pg = PgCluster::start("", &[]);
    let lazy = TestDb::create_on(
        &format!("host=127.0.0.1 port={} user=postgres", pg.port),
        "outbox_guard",
    );
    // The privilege recipe's roles on that cluster (Roles creates them on the main server).
    pg.psql(
        "postgres",
        "CREATE ROLE guard_producer NOLOGIN; CREATE ROLE guard_relay NOLOGIN; \
         CREATE ROLE guard_admin NOLOGIN",
    );
    grant_recipe(
        &lazy.url(),
        "guard_producer",
        "guard_relay",
        "guard_admin",
        None,
    );
    let fresh = lazy.connect().await;
    fresh
        .batch_execute("SET ROLE guard_producer; SET outbox.max_payload_bytes = 100000000")
        .await
        .unwrap();
    let big = format!("{{\"blob\": \"{}\"}}", "x".repeat(2_000_000));
    let (code, message) = db_error(
        fresh
            .query("SELECT outbox_enqueue('orders', $1::text::jsonb)", &[&big])
            .await,
    );
    assert_eq!(code, "54000", "{message}");
    assert!(message.contains("allows at most 1000000"), "{message}");
    assert_eq!(row_count(&lazy.connect().await).await, 0, "nothing written");
}

/// The SQL-only build's guards are placeholders anyone may SET: a producer's value counts only
/// where it narrows the database's (ALTER DATABASE ... SET); a wider one fails the call with
/// 42501 at use instead of at SET (docs/sql-only.md).
async fn sql_only_producers_cannot_lift_the_producer_guards(db: &TestDb, producer: &str) {
    db.set(&[
        ("outbox.allowed_topics", "orders, payments.*"),
        ("outbox.unordered_topics", "metrics"),
    ]);
    let c = db.connect().await;
    c.batch_execute(&format!("SET ROLE {producer}"))
        .await
        .unwrap();
    let big = format!("{{\"blob\": \"{}\"}}", "x".repeat(2_000_000));
    let enqueue = "SELECT outbox_enqueue('orders', $1::text::jsonb, key => 'k')";
    // Wider than the database's: refused whatever the call's input.
    for set in [
        "SET outbox.max_payload_bytes = '100MB'",
        "SET outbox.max_payload_bytes = 100000000",
        "SET outbox.unordered_topics = '*'",
        "SET outbox.unordered_topics = 'orders'",
    ] {
        c.batch_execute(&format!("RESET ALL; {set}")).await.unwrap();
        let (code, message) = db_error(c.query(enqueue, &[&"{}"]).await);
        assert_eq!(code, "42501", "{set}: {message}");
        assert!(
            message.contains("permission denied to set parameter"),
            "{set}: {message}"
        );
    }
    // An allow-list of its own applies on top of the database's.
    c.batch_execute("RESET ALL; SET outbox.allowed_topics = '*'")
        .await
        .unwrap();
    let (code, message) = db_error(
        c.query("SELECT outbox_enqueue('internal', '{}')", &[])
            .await,
    );
    assert_eq!(code, "22023", "{message}");
    assert!(
        message.contains("not in outbox.allowed_topics"),
        "{message}"
    );
    c.batch_execute("RESET ALL; SET outbox.allowed_topics = 'payments.*'")
        .await
        .unwrap();
    let (code, message) = db_error(c.query(enqueue, &[&"{}"]).await);
    assert_eq!(code, "22023", "narrowed to payments.*: {message}");
    c.execute("SELECT outbox_enqueue('payments.eu', '{}')", &[])
        .await
        .unwrap();
    // Lower is allowed, and the default still holds without a SET.
    c.batch_execute("RESET ALL; SET outbox.max_payload_bytes = 10")
        .await
        .unwrap();
    let (code, message) = db_error(c.query(enqueue, &[&"{\"n\": 12345}"]).await);
    assert_eq!(code, "54000", "{message}");
    c.batch_execute("RESET ALL").await.unwrap();
    let (code, message) = db_error(c.query(enqueue, &[&big]).await);
    assert_eq!(code, "54000", "{message}");
    assert!(message.contains("allows at most 1000000"), "{message}");
    // The owner (here the superuser who applied the script) may set them in its session.
    let admin = db.connect().await;
    admin
        .batch_execute("SET outbox.allowed_topics = '*'; SET outbox.max_payload_bytes = '4MB'")
        .await
        .unwrap();
    admin.query(enqueue, &[&big]).await.unwrap();
    admin
        .query("SELECT outbox_enqueue('internal', '{}')", &[])
        .await
        .unwrap();
    assert_eq!(
        row_count(&admin).await,
        4,
        "the owner's two, payments.eu and the first"
    );
}

#[tokio::test]
async fn the_size_limit_counts_payload_key_and_headers_exactly() {
    let db = TestDb::create();
    let c = db.connect().await;
    c.batch_execute("SET outbox.max_payload_bytes = 100")
        .await
        .unwrap();
    // payload {"a": "xx…"} is 9 + n bytes as JSON text, key "k1" 2 bytes, headers {"h": "v"} 10.
    let payload = |n: usize| format!("{{\"a\": \"{}\"}}", "x".repeat(n));
    let at_limit = payload(100 - 9 - 2 - 10);
    assert_eq!(at_limit.len() + 2 + 10, 100);
    let enqueue = "SELECT outbox_enqueue('orders', $1::text::jsonb, key => 'k1', headers => '{\"h\": \"v\"}')";
    c.execute(enqueue, &[&at_limit]).await.unwrap();
    let over = payload(100 - 9 - 2 - 10 + 1);
    rejects(&c, enqueue, &[&over], "54000", "message is 101 bytes").await;

    // A huge key or header under a small payload limit is refused like a huge payload.
    c.batch_execute("SET outbox.max_payload_bytes = '1MB'")
        .await
        .unwrap();
    let five_mb = "k".repeat(5_000_000);
    rejects(
        &c,
        "SELECT outbox_enqueue('orders', '{}', key => $1)",
        &[&five_mb],
        "54000",
        "key 5000000",
    )
    .await;
    let header = serde_json::json!({ "trace": five_mb }).to_string();
    rejects(
        &c,
        "SELECT outbox_enqueue('orders', '{}', headers => $1::text::jsonb)",
        &[&header],
        "54000",
        "headers 50000",
    )
    .await;
    assert_eq!(row_count(&c).await, 1);
}

#[tokio::test]
async fn deliver_at_must_be_finite() {
    let db = TestDb::create();
    let c = db.connect().await;
    for at in ["infinity", "-infinity"] {
        rejects(
            &c,
            "SELECT outbox_enqueue('orders', '{}', deliver_at => $1::text::timestamptz)",
            &[&at],
            "22023",
            "deliver_at",
        )
        .await;
    }
}

#[tokio::test]
async fn the_topic_allow_list_is_enforced_at_enqueue() {
    let db = TestDb::create();
    let c = db.connect().await;
    c.batch_execute("SET outbox.allowed_topics = 'orders, payments.*'")
        .await
        .unwrap();
    for ok in ["orders", "payments.v1", "payments.refunds"] {
        c.execute("SELECT outbox_enqueue($1, '{}')", &[&ok])
            .await
            .unwrap_or_else(|e| panic!("{ok}: {e}"));
    }
    for refused in ["payments", "orders.v2", "__consumer_offsets", "billing"] {
        rejects(
            &c,
            "SELECT outbox_enqueue($1, '{}')",
            &[&refused],
            "22023",
            &format!("topic \"{refused}\" is not in outbox.allowed_topics"),
        )
        .await;
    }
    c.batch_execute("SET outbox.allowed_topics = 'orders, or*ders'")
        .await
        .unwrap();
    rejects(
        &c,
        "SELECT outbox_enqueue('orders', '{}')",
        &[],
        "22023",
        "entry \"or*ders\"",
    )
    .await;
    c.batch_execute("RESET outbox.allowed_topics")
        .await
        .unwrap();
    c.execute("SELECT outbox_enqueue('billing', '{}')", &[])
        .await
        .unwrap();
    assert_eq!(row_count(&c).await, 4);
}

#[tokio::test]
async fn row_locking_calls_require_read_committed() {
    let db = TestDb::create();
    let c = db.connect().await;
    // Two statements, two transactions: a claim refuses a transaction that has written.
    c.batch_execute("SELECT outbox_enqueue('orders', '{}') FROM generate_series(1, 3)")
        .await
        .unwrap();
    c.batch_execute("SELECT outbox_claim('relay-a', 1)")
        .await
        .unwrap();
    for call in [
        "SELECT * FROM outbox_claim('relay-a', 10)",
        "SELECT outbox_ack('relay-a', 1, '{1}')",
        "SELECT outbox_nack('relay-a', 1, '{1}', 'e')",
        "SELECT outbox_renew('relay-a', 1, '{1}')",
        "SELECT outbox_release('relay-a', 1, '{1}')",
        "SELECT outbox_reclaim('1 second')",
        "SELECT outbox_requeue('{1}')",
        "SELECT outbox_purge('0 seconds')",
    ] {
        for level in ["REPEATABLE READ", "SERIALIZABLE"] {
            c.batch_execute(&format!("BEGIN ISOLATION LEVEL {level}"))
                .await
                .unwrap();
            let (code, message) = db_error(c.query(call, &[]).await);
            c.batch_execute("ROLLBACK").await.unwrap();
            assert_eq!(code, "25000", "{call} at {level}: {message}");
            assert!(
                message.contains("READ COMMITTED") && message.contains(level),
                "{call}: {message}"
            );
        }
    }
    // Producers may use any isolation level: enqueue only inserts.
    c.batch_execute(
        "BEGIN ISOLATION LEVEL SERIALIZABLE; SELECT outbox_enqueue('orders', '{}'); COMMIT",
    )
    .await
    .unwrap();
    assert_eq!(row_count(&c).await, 4);
}

/// Polls until `pid` waits for a lock (or `done()` says its call returned, or its backend is gone).
async fn until_blocked_or_done(watch: &Client, pid: i32, done: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if done() {
            return;
        }
        // A backend that is gone has returned too: the task dropped its client after the call.
        if lock_wait(watch, pid).await.unwrap_or(true) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("backend {pid} neither blocked nor finished within 20 s");
}

/// Ack takes rows in id order; reclaim used to take them in claimed_at order and wait, which
/// deadlocked (40P01) when an ack held a row that reclaim wanted and waited for one it held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reclaim_and_ack_never_deadlock() {
    let db = TestDb::create();
    let setup = db.connect().await;
    // Rows with a lease each, which ack and reclaim lock one by one: scheduled rows. A fresh
    // unordered event is a stream row (one batch row per claim); handed back once by a relay
    // (release, no attempt counted) it is a scheduled row, as any retried event is.
    setup
        .batch_execute("SELECT outbox_enqueue('orders', '{}') FROM generate_series(1, 2003)")
        .await
        .unwrap();
    let handed_out = setup
        .query(
            "SELECT id, claim_token FROM outbox_claim('relay-x', 2003)",
            &[],
        )
        .await
        .unwrap();
    let ids: Vec<i64> = handed_out.iter().map(|r| r.get(0)).collect();
    let released: i32 = scalar(
        &setup,
        "SELECT outbox_release('relay-x', $1, $2)",
        &[&handed_out[0].get::<_, i64>(1), &ids],
    )
    .await;
    assert_eq!(released, 2003);
    let token: i64 = scalar(
        &setup,
        "SELECT max(claim_token) FROM outbox_claim('relay-a', 3)",
        &[],
    )
    .await;
    // Their leases expired, oldest first: 3, then 1, then 2. Around them, 2,000 live claims of
    // another relay, so that the planner picks the plans of a production-sized table: ack by
    // primary key (id order), the old reclaim by the lease index (claimed_at order).
    setup
        .batch_execute(
            "UPDATE outbox_scheduled SET claimed_at = now() - interval '30 min' WHERE id = 3;
             UPDATE outbox_scheduled SET claimed_at = now() - interval '20 min' WHERE id = 1;
             UPDATE outbox_scheduled SET claimed_at = now() - interval '10 min' WHERE id = 2;",
        )
        .await
        .unwrap();
    setup
        .batch_execute("SELECT count(*) FROM outbox_claim('relay-b', 2000)")
        .await
        .unwrap();
    setup
        .batch_execute("ANALYZE outbox_scheduled")
        .await
        .unwrap();

    // A third session holds row 2 so that the ack stops between its rows.
    let blocker = db.connect().await;
    blocker
        .batch_execute("BEGIN; SELECT 1 FROM outbox_scheduled WHERE id = 2 FOR UPDATE")
        .await
        .unwrap();
    let acker = db.connect().await;
    let reclaimer = db.connect().await;
    let acker_pid: i32 = scalar(&acker, "SELECT pg_backend_pid()", &[]).await;
    let reclaimer_pid: i32 = scalar(&reclaimer, "SELECT pg_backend_pid()", &[]).await;

    let ack = tokio::spawn(async move {
        acker
            .query_one("SELECT outbox_ack('relay-a', $1, '{1,2,3}')", &[&token])
            .await
            .map(|r| r.get::<_, i32>(0))
    });
    until_blocked_or_done(&setup, acker_pid, || ack.is_finished()).await;
    let reclaim = tokio::spawn(async move {
        reclaimer
            .query_one("SELECT outbox_reclaim('1 second')", &[])
            .await
            .map(|r| r.get::<_, i32>(0))
    });
    until_blocked_or_done(&setup, reclaimer_pid, || reclaim.is_finished()).await;
    blocker.batch_execute("COMMIT").await.unwrap();

    let acked = ack.await.unwrap().expect("ack must not deadlock");
    let reclaimed = reclaim.await.unwrap().expect("reclaim must not deadlock");
    assert_eq!(acked + reclaimed, 3, "every row settled exactly once");
    let success: i64 = scalar(
        &setup,
        "SELECT count(*) FROM outbox_event WHERE status = 'SUCCESS'",
        &[],
    )
    .await;
    let back: i64 = scalar(
        &setup,
        "SELECT count(*) FROM outbox_event WHERE status = 'WAIT' AND retry_count = 1 AND id <= 3",
        &[],
    )
    .await;
    assert_eq!((success, back), (acked as i64, reclaimed as i64));
}

/// Rows an `outbox_purge` call read from the outbox's tables in this transaction: (sequential,
/// by index).
async fn purge_reads(c: &Client, call: &str) -> (i64, i64, i64) {
    c.batch_execute("BEGIN").await.unwrap();
    let deleted: i64 = scalar(c, call, &[]).await;
    let row = c
        .query_one(
            "SELECT coalesce(sum(seq_tup_read), 0)::bigint, coalesce(sum(idx_tup_fetch), 0)::bigint \
               FROM pg_stat_xact_user_tables \
              WHERE relid IN ('outbox_scheduled'::regclass, 'outbox_stream'::regclass)",
            &[],
        )
        .await
        .unwrap();
    c.batch_execute("COMMIT").await.unwrap();
    (deleted, row.get(0), row.get(1))
}

#[tokio::test]
async fn purge_reads_only_the_rows_it_deletes() {
    let db = TestDb::create();
    let c = db.connect().await;
    // A history of scheduled rows (delayed events, set SUCCESS by hand): the rows whose state
    // changes, read through the SUCCESS index by age.
    c.batch_execute(
        "SELECT outbox_enqueue('orders', jsonb_build_object('n', g), deliver_at => now() + interval '1 day')
           FROM generate_series(1, 20000) g;
         UPDATE outbox_scheduled SET status = 'SUCCESS', updated_at = now() - interval '1 hour';
         UPDATE outbox_scheduled SET updated_at = now() - interval '8 days' WHERE id <= 100;",
    )
    .await
    .unwrap();
    c.batch_execute("VACUUM ANALYZE outbox_scheduled, outbox_stream")
        .await
        .unwrap();
    // A new session: pg_stat_xact_* also shows a backend's not yet flushed counts of earlier
    // transactions (the set-up's UPDATEs scan the table).
    let c = db.connect().await;
    let (deleted, seq, fetched) = purge_reads(&c, "SELECT outbox_purge('7 days', 1000)").await;
    assert_eq!(deleted, 100);
    assert_eq!(seq, 0, "purge scanned the table");
    assert!(
        fetched <= 2 * 100 + 10,
        "purge fetched {fetched} rows to delete 100"
    );
    // Nothing left to delete among 19,900 rows: the call only steps over the index entries of
    // the rows just deleted (dead until vacuum), not over the history.
    let c = db.connect().await;
    let (deleted, seq, fetched) = purge_reads(&c, "SELECT outbox_purge('7 days', 1000)").await;
    assert_eq!((deleted, seq), (0, 0));
    assert!(
        fetched <= 2 * 100 + 10,
        "a purge with nothing to do fetched {fetched} rows"
    );
}

#[tokio::test]
async fn a_nack_without_a_reason_keeps_the_last_error() {
    let db = TestDb::create();
    let c = db.connect().await;
    c.batch_execute("SET outbox.backoff_base = '1ms'; SELECT outbox_enqueue('orders', '{}')")
        .await
        .unwrap();
    for error in [Some("broker down"), None] {
        let token: i64 = scalar(
            &c,
            "SELECT claim_token FROM outbox_claim('relay-a', 1)",
            &[],
        )
        .await;
        let n: i32 = scalar(
            &c,
            "SELECT outbox_nack('relay-a', $1, '{1}', $2)",
            &[&token, &error],
        )
        .await;
        assert_eq!(n, 1);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let last: Option<String> =
        scalar(&c, "SELECT last_error FROM outbox_event WHERE id = 1", &[]).await;
    assert_eq!(last.as_deref(), Some("broker down"));
}

#[tokio::test]
async fn no_extension_function_that_raises_is_immutable() {
    let db = TestDb::create();
    let c = db.connect().await;
    let immutable: Vec<String> = c
        .query(
            &format!(
                "SELECT p.oid::regprocedure::text FROM pg_proc p WHERE p.oid IN ({}) \
                 AND p.provolatile = 'i' AND p.prosrc ~* 'RAISE'",
                build::objects("pg_proc")
            ),
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert!(
        immutable.is_empty(),
        "IMMUTABLE functions may be folded at plan time, raising errors out of place: {immutable:?}"
    );
}

#[tokio::test]
async fn truncate_restart_identity_never_reissues_an_event_id() {
    let db = TestDb::create();
    let c = db.connect().await;
    let first: Vec<(i64, String)> = enqueue_and_read(&c, 3).await;
    // The id sequence belongs to outbox_scheduled.id: RESTART IDENTITY resets it with that table.
    c.batch_execute(
        "TRUNCATE outbox_scheduled, outbox_stream, outbox_stream_batch, outbox_key RESTART IDENTITY",
    )
    .await
    .unwrap();
    let second = enqueue_and_read(&c, 3).await;
    let ids = |v: &[(i64, String)]| v.iter().map(|(i, _)| *i).collect::<Vec<_>>();
    assert_eq!(ids(&first), ids(&second), "the bigint ids are reissued");
    for (_, uuid) in &second {
        assert!(
            !first.iter().any(|(_, u)| u == uuid),
            "event_id {uuid} reissued"
        );
        assert_eq!(&uuid[14..15], "7", "UUID version 7: {uuid}");
    }
}

/// Enqueues `n` events and returns their (id, event_id) in id order.
async fn enqueue_and_read(c: &Client, n: i64) -> Vec<(i64, String)> {
    c.execute(
        "SELECT outbox_enqueue('orders', '{}') FROM generate_series(1, $1::bigint)",
        &[&n],
    )
    .await
    .unwrap();
    c.query(
        "SELECT id, event_id::text FROM outbox_event ORDER BY id DESC LIMIT $1",
        &[&n],
    )
    .await
    .unwrap()
    .iter()
    .rev()
    .map(|r| (r.get(0), r.get(1)))
    .collect()
}
