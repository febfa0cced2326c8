//! The consumer's inbox (docs/inbox.md): an event id is new once per consumer, concurrent
//! duplicates never both get true, each consumer role reaches its own inbox only, bad input has
//! its SQLSTATE, and purge keeps what is younger than its cutoff.

use std::time::Duration;

use outbox_tests::db::{db_error, lock_wait, scalar, sqlstate, TestDb};
use outbox_tests::roles::{grant_recipe, Roles};
use tokio_postgres::Client;

const ACCEPT: &str = "SELECT outbox_inbox_accept($1, $2::text::uuid)";

/// A fresh event id, as text (the tests' client has no uuid type).
async fn new_id(c: &Client) -> String {
    scalar(c, "SELECT gen_random_uuid()::text", &[]).await
}

async fn accept(c: &Client, consumer: &str, id: &str) -> bool {
    scalar(c, ACCEPT, &[&consumer, &id]).await
}

/// Inbox rows of `consumer`, read as the superuser.
async fn rows_of(c: &Client, consumer: &str) -> i64 {
    scalar(
        c,
        "SELECT count(*) FROM outbox_inbox WHERE consumer = $1",
        &[&consumer],
    )
    .await
}

#[tokio::test]
async fn an_event_is_new_once_per_consumer_and_a_rollback_forgets_it() {
    let roles;
    let db = TestDb::create();
    roles = Roles::create(&db, &["audit"]);
    let (loyalty, audit) = (roles.name("consumer"), roles.name("audit"));
    let c = db.connect().await;
    let id = new_id(&c).await;

    assert!(accept(&c, &loyalty, &id).await, "first delivery is new");
    assert!(
        !accept(&c, &loyalty, &id).await,
        "redelivery is a duplicate"
    );
    assert!(
        accept(&c, &audit, &id).await,
        "another consumer has its own inbox"
    );

    // The accept belongs to the caller's transaction: rolled back, the event is new again.
    let other = new_id(&c).await;
    c.batch_execute("BEGIN").await.unwrap();
    assert!(accept(&c, &loyalty, &other).await);
    c.batch_execute("ROLLBACK").await.unwrap();
    assert!(accept(&c, &loyalty, &other).await, "new after a rollback");
    assert_eq!(rows_of(&c, &loyalty).await, 2);
}

/// Session `b` accepts while `a`'s accept of the same id is uncommitted: `b` waits, then gets
/// the opposite of what became of `a`'s row (false after a commit, true after a rollback).
/// `watch` sees `b` wait (a transaction's view of pg_stat_activity would not change).
async fn race_one([a, b, watch]: [&Client; 3], consumer: &str, a_commits: bool) -> (bool, bool) {
    let id = new_id(a).await;
    a.batch_execute("BEGIN").await.unwrap();
    let first = accept(a, consumer, &id).await;
    let b_pid: i32 = scalar(b, "SELECT pg_backend_pid()", &[]).await;
    let (second, ()) = tokio::join!(accept(b, consumer, &id), async {
        while lock_wait(watch, b_pid).await != Some(true) {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let end = if a_commits { "COMMIT" } else { "ROLLBACK" };
        a.batch_execute(end).await.unwrap();
    });
    (first, second)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_concurrent_duplicate_waits_and_never_also_gets_true() {
    let roles;
    let db = TestDb::create();
    roles = Roles::create(&db, &[]);
    let consumer = roles.name("consumer");
    let (a, b, watch) = (db.connect().await, db.connect().await, db.connect().await);
    for _ in 0..20 {
        let sessions = [&a, &b, &watch];
        assert_eq!(race_one(sessions, &consumer, true).await, (true, false));
        assert_eq!(race_one(sessions, &consumer, false).await, (true, true));
    }
    // Only the committed halves left rows: 20 from the commits, 20 from b after the rollbacks.
    assert_eq!(rows_of(&a, &consumer).await, 40);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn many_sessions_racing_on_each_event_get_exactly_one_true() {
    let roles;
    let db = TestDb::create();
    roles = Roles::create(&db, &[]);
    let consumer = roles.name("consumer");
    let sessions = 4;
    let mut clients = Vec::new();
    for _ in 0..sessions {
        clients.push(std::sync::Arc::new(db.connect().await));
    }
    for round in 0..300 {
        let id = new_id(&clients[0]).await;
        let tasks: Vec<_> = clients
            .iter()
            .map(|c| {
                let (c, consumer, id) = (c.clone(), consumer.clone(), id.clone());
                tokio::spawn(async move {
                    c.batch_execute("BEGIN").await.unwrap();
                    let new = accept(&c, &consumer, &id).await;
                    c.batch_execute("COMMIT").await.unwrap();
                    new
                })
            })
            .collect();
        let mut trues = 0;
        for t in tasks {
            trues += usize::from(t.await.unwrap());
        }
        assert_eq!(trues, 1, "round {round}: {trues} sessions got true");
    }
    assert_eq!(rows_of(&clients[0], &consumer).await, 300);
}

#[tokio::test]
async fn under_repeatable_read_a_concurrent_duplicate_fails_to_serialize() {
    let roles;
    let db = TestDb::create();
    roles = Roles::create(&db, &[]);
    let consumer = roles.name("consumer");
    let (a, b) = (db.connect().await, db.connect().await);
    let id = new_id(&a).await;
    b.batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT 1")
        .await
        .unwrap();
    assert!(accept(&a, &consumer, &id).await);
    // b's snapshot predates a's row: it can neither see it nor insert its own, so it must retry.
    assert_eq!(
        sqlstate(b.query_one(ACCEPT, &[&consumer, &id]).await),
        "40001"
    );
    b.batch_execute("ROLLBACK").await.unwrap();
    assert!(
        !accept(&b, &consumer, &id).await,
        "the retry sees the duplicate"
    );
}

#[tokio::test]
async fn a_consumer_role_reaches_its_own_inbox_only() {
    let roles;
    let db = TestDb::create();
    roles = Roles::create(&db, &["rival", "service", "nobody"]);
    let [consumer, rival, service, admin, nobody] =
        ["consumer", "rival", "service", "admin", "nobody"].map(|k| roles.name(k));
    let [producer, relay] = ["producer", "relay"].map(|k| roles.name(k));
    grant_recipe(&db.url(), &producer, &relay, &admin, Some(&rival));
    let c = db.connect().await;
    c.batch_execute(&format!("GRANT {consumer} TO {service}"))
        .await
        .unwrap();
    let rival_id = new_id(&c).await;
    assert!(accept(&c, &rival, &rival_id).await);

    // A member of the consumer role (the service's login role) accepts and reads its rows only.
    c.batch_execute(&format!("SET ROLE {service}"))
        .await
        .unwrap();
    let id = new_id(&c).await;
    assert!(accept(&c, &consumer, &id).await);
    assert!(!accept(&c, &consumer, &id).await);
    let visible: Vec<String> = c
        .query("SELECT consumer FROM outbox_inbox", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(visible, std::slice::from_ref(&consumer));
    let (state, message) = db_error(c.query_one(ACCEPT, &[&rival, &id]).await);
    assert_eq!((state.as_str(), message.contains(&rival)), ("42501", true));
    for denied in [
        format!("INSERT INTO outbox_inbox VALUES ('{rival}', gen_random_uuid())"),
        "DELETE FROM outbox_inbox".into(),
        "UPDATE outbox_inbox SET accepted_at = now()".into(),
        "SELECT outbox_inbox_purge()".into(),
        "SELECT * FROM outbox_inbox_stats()".into(),
        "SELECT * FROM outbox_claim('c', 1)".into(),
    ] {
        assert_eq!(
            sqlstate(c.batch_execute(&denied).await),
            "42501",
            "{denied}"
        );
    }

    // The admin sees every consumer's size and purges; it accepts for no one.
    c.batch_execute(&format!("RESET ROLE; SET ROLE {admin}"))
        .await
        .unwrap();
    let sizes: Vec<(String, i64)> = c
        .query("SELECT consumer, events FROM outbox_inbox_stats()", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let mut want = vec![(consumer.clone(), 1), (rival.clone(), 1)];
    want.sort();
    assert_eq!(sizes, want);
    c.execute("SELECT outbox_inbox_purge('1 day')", &[])
        .await
        .unwrap();
    assert_eq!(
        sqlstate(c.query_one(ACCEPT, &[&consumer, &new_id(&c).await]).await),
        "42501"
    );

    c.batch_execute(&format!("RESET ROLE; SET ROLE {nobody}"))
        .await
        .unwrap();
    for denied in [
        "SELECT outbox_inbox_accept('x', gen_random_uuid())",
        "SELECT * FROM outbox_inbox",
    ] {
        assert_eq!(sqlstate(c.batch_execute(denied).await), "42501", "{denied}");
    }
    c.batch_execute("RESET ROLE").await.unwrap();
}

#[tokio::test]
async fn bad_input_is_refused_with_its_sqlstate_and_writes_nothing() {
    let roles;
    let db = TestDb::create();
    roles = Roles::create(&db, &[]);
    let consumer = roles.name("consumer");
    let c = db.connect().await;
    let id = new_id(&c).await;
    let purge = "SELECT outbox_inbox_purge($1::text::interval, $2::text::int)";
    for (sql, first, second, needle) in [
        (ACCEPT, None, Some(id.as_str()), "consumer"),
        (ACCEPT, Some(""), Some(&id), "consumer"),
        (ACCEPT, Some(&consumer), None, "event_id"),
        (
            ACCEPT,
            Some("no_such_role"),
            Some(&id),
            "no_such_role is not a role",
        ),
        (purge, Some("-1 day"), Some("1"), "older_than"),
        (purge, None, Some("1"), "older_than"),
        (purge, Some("1 day"), Some("0"), "max_rows"),
    ] {
        let (state, message) = db_error(c.query_one(sql, &[&first, &second]).await);
        assert_eq!(state, "22023", "{sql} {first:?} {second:?}: {message}");
        assert!(message.contains(needle), "{message:?} should name {needle}");
    }
    assert_eq!(
        scalar::<i64>(&c, "SELECT count(*) FROM outbox_inbox", &[]).await,
        0
    );
}

#[tokio::test]
async fn purge_deletes_what_is_older_than_its_cutoff_at_most_max_rows_at_a_time() {
    let roles;
    let db = TestDb::create();
    roles = Roles::create(&db, &[]);
    let consumer = roles.name("consumer");
    let c = db.connect().await;
    for _ in 0..5 {
        accept(&c, &consumer, &new_id(&c).await).await;
    }
    c.execute(
        "UPDATE outbox_inbox SET accepted_at = now() - interval '40 days'",
        &[],
    )
    .await
    .unwrap();
    let young = new_id(&c).await;
    assert!(accept(&c, &consumer, &young).await);

    let purge = "SELECT outbox_inbox_purge('30 days', 2)";
    let purged: Vec<i64> = [
        scalar(&c, purge, &[]).await,
        scalar(&c, purge, &[]).await,
        scalar(&c, purge, &[]).await,
        scalar(&c, purge, &[]).await,
    ]
    .into();
    assert_eq!(purged, [2, 2, 1, 0]);
    assert!(
        !accept(&c, &consumer, &young).await,
        "the young row is kept"
    );
    let (events, oldest_is_young): (i64, bool) = {
        let r = c
            .query_one(
                "SELECT events, oldest_accepted_at > now() - interval '1 day' \
                 FROM outbox_inbox_stats() WHERE consumer = $1",
                &[&consumer],
            )
            .await
            .unwrap();
        (r.get(0), r.get(1))
    };
    assert_eq!((events, oldest_is_young), (1, true));
}
