//! `outbox_wait`, the relay's wake-up without LISTEN/NOTIFY, on two servers of its own: one with
//! `shared_preload_libraries = 'outbox'` (commits wake waiters through shared memory) and one
//! without (waiters look at the queue every `outbox.wait_poll_interval`), both with
//! `max_prepared_transactions` for two-phase commit. Every scenario runs on both: a committed
//! enqueue wakes a waiter within 1 s, a rollback (whole or to a savepoint) or a commit in another
//! database wakes nobody, `COMMIT PREPARED` wakes, `ROLLBACK PREPARED` does not, a producer still
//! inside its transaction does not make waiters spin, and a waiter ends promptly when cancelled or
//! terminated. How many milliseconds a wake-up takes is the benchmark's figure, not this test's.

use std::time::{Duration, Instant};

use outbox_tests::build;
use outbox_tests::db::{connect, sqlstate, TestDb};
use outbox_tests::pg_cluster::PgCluster;
use tokio_postgres::Client;

/// A waiter ends this long after its wake-up at most.
const WAKE_BOUND: Duration = Duration::from_secs(1);

struct Server {
    _pg: PgCluster,
    db: TestDb,
}

fn server(preload: bool) -> Server {
    let conf = if preload {
        "shared_preload_libraries = 'outbox'\nmax_prepared_transactions = 10"
    } else {
        "max_prepared_transactions = 10"
    };
    let pg = PgCluster::start(conf, &[]);
    let db = TestDb::create_on(
        &format!("host=127.0.0.1 port={} user=postgres", pg.port),
        "outbox_wake",
    );
    Server { _pg: pg, db }
}

/// Starts `outbox_wait(timeout)` on a session of its own and returns once the server shows it
/// waiting, with the task that yields (result, when it returned).
async fn start_waiter(
    url: &str,
    timeout: &str,
) -> (
    i32,
    tokio::task::JoinHandle<(Result<bool, tokio_postgres::Error>, Instant)>,
) {
    let waiter = connect(url).await;
    let pid: i32 = waiter
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    let sql = format!("SELECT outbox_wait('{timeout}')");
    let task = tokio::spawn(async move {
        let r = waiter
            .query_one(&sql, &[])
            .await
            .map(|r| r.get::<_, bool>(0));
        (r, Instant::now())
    });
    let watcher = connect(url).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let waiting: bool = watcher
            .query_one(
                "SELECT count(*) = 1 FROM pg_stat_activity WHERE pid = $1 AND query LIKE '%outbox_wait%' \
                 AND state = 'active'",
                &[&pid],
            )
            .await
            .unwrap()
            .get(0);
        if waiting || task.is_finished() {
            break;
        }
        assert!(Instant::now() < deadline, "the waiter never started");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Past its first look at the queue, asleep.
    tokio::time::sleep(Duration::from_millis(100)).await;
    (pid, task)
}

/// The waiter returned true within WAKE_BOUND of `committed`.
async fn assert_woken(
    task: tokio::task::JoinHandle<(Result<bool, tokio_postgres::Error>, Instant)>,
    committed: Instant,
    what: &str,
) {
    let (r, at) = task.await.unwrap();
    assert!(r.unwrap(), "{what}: the waiter timed out instead");
    let took = at.saturating_duration_since(committed);
    assert!(
        took <= WAKE_BOUND,
        "{what}: woken {took:?} after the commit"
    );
}

async fn assert_not_woken(
    task: tokio::task::JoinHandle<(Result<bool, tokio_postgres::Error>, Instant)>,
    what: &str,
) {
    let (r, _) = task.await.unwrap();
    assert!(!r.unwrap(), "{what}: the waiter was woken");
}

/// Delivers everything due; the second claim deletes the rows of keys left with nothing to do
/// (an ack makes its keys due for that look).
async fn drain(c: &Client) {
    for _ in 0..2 {
        c.batch_execute(
            "SELECT outbox_ack('t', token, ids) \
               FROM (SELECT min(claim_token) AS token, array_agg(id) AS ids \
                       FROM outbox_claim('t', 1000)) c \
              WHERE ids IS NOT NULL",
        )
        .await
        .unwrap();
    }
}

async fn scenarios(preload: bool) {
    let s = server(preload);
    let url = s.db.url();
    let c = connect(&url).await;
    let mode: String = c
        .query_one("SELECT outbox_wake_mode()", &[])
        .await
        .unwrap()
        .get(0);
    // The SQL-only build has no shared memory: it polls even where the library is preloaded.
    let commit_wakes = preload && !build::sql_only();
    assert_eq!(mode, if commit_wakes { "commit" } else { "polling" });

    // Nothing due: the wait runs to its timeout.
    let t0 = Instant::now();
    let (_, w) = start_waiter(&url, "1 s").await;
    assert_not_woken(w, "empty queue").await;
    assert!(t0.elapsed() >= Duration::from_millis(900));

    // Something already due: at once.
    c.execute("SELECT outbox_enqueue('orders', '{}')", &[])
        .await
        .unwrap();
    let (_, w) = start_waiter(&url, "10 s").await;
    assert_woken(w, Instant::now(), "event due before the wait").await;
    drain(&c).await;

    // A commit while waiting (keyed and not).
    for sql in [
        "SELECT outbox_enqueue('orders', '{}')",
        "SELECT outbox_enqueue('orders', '{}', key => 'order-1')",
        "SELECT outbox_enqueue_many('orders', ARRAY['{}', '{}']::jsonb[], ARRAY['a', 'b'])",
    ] {
        let (_, w) = start_waiter(&url, "10 s").await;
        c.execute(sql, &[]).await.unwrap();
        assert_woken(w, Instant::now(), sql).await;
        drain(&c).await;
    }

    // A commit in another database of the server: its relay has work, this one has none.
    let other = TestDb::create_on(&s.db.server, "outbox_wake_other");
    let (_, w) = start_waiter(&url, "1500 ms").await;
    connect(&other.url())
        .await
        .execute("SELECT outbox_enqueue('orders', '{}')", &[])
        .await
        .unwrap();
    assert_not_woken(w, "a commit in another database").await;

    // Rolled back, whole or to a savepoint: nobody wakes.
    for sql in [
        "BEGIN; SELECT outbox_enqueue('orders', '{}'); ROLLBACK",
        "BEGIN; SAVEPOINT s; SELECT outbox_enqueue('orders', '{}'); ROLLBACK TO SAVEPOINT s; COMMIT",
        "BEGIN; SAVEPOINT a; SAVEPOINT b; SELECT outbox_enqueue('orders', '{}', key => 'k'); \
         RELEASE b; ROLLBACK TO SAVEPOINT a; COMMIT",
    ] {
        let (_, w) = start_waiter(&url, "1500 ms").await;
        c.batch_execute(sql).await.unwrap();
        assert_not_woken(w, sql).await;
    }
    // A released savepoint is part of the commit: it wakes.
    let (_, w) = start_waiter(&url, "10 s").await;
    c.batch_execute("BEGIN; SAVEPOINT s; SELECT outbox_enqueue('orders', '{}'); RELEASE s; COMMIT")
        .await
        .unwrap();
    assert_woken(w, Instant::now(), "released savepoint").await;
    drain(&c).await;

    // Two-phase commit: PREPARE is not a commit; COMMIT PREPARED (here from another session)
    // wakes, ROLLBACK PREPARED does not.
    let gid = format!("outbox-wake-{}", std::process::id());
    c.batch_execute(&format!(
        "BEGIN; SELECT outbox_enqueue('orders', '{{}}'); PREPARE TRANSACTION '{gid}'"
    ))
    .await
    .unwrap();
    let (_, w) = start_waiter(&url, "1500 ms").await;
    assert_not_woken(w, "prepared, not committed").await;
    let (_, w) = start_waiter(&url, "10 s").await;
    connect(&url)
        .await
        .batch_execute(&format!("COMMIT PREPARED '{gid}'"))
        .await
        .unwrap();
    assert_woken(w, Instant::now(), "COMMIT PREPARED").await;
    drain(&c).await;
    c.batch_execute(&format!(
        "BEGIN; SELECT outbox_enqueue('orders', '{{}}'); PREPARE TRANSACTION '{gid}'"
    ))
    .await
    .unwrap();
    let (_, w) = start_waiter(&url, "1500 ms").await;
    c.batch_execute(&format!("ROLLBACK PREPARED '{gid}'"))
        .await
        .unwrap();
    assert_not_woken(w, "ROLLBACK PREPARED").await;

    // A key whose events are all delivered, while a producer of it is still inside its
    // transaction: the claim cannot delete the key's row yet, and waiters must not take that
    // row for work (they would answer at once, again and again). The producer's commit wakes.
    c.execute("SELECT outbox_enqueue('orders', '{}', key => 'busy')", &[])
        .await
        .unwrap();
    drain(&c).await;
    let mut producer = connect(&url).await;
    let tx = producer.transaction().await.unwrap();
    tx.execute("SELECT outbox_enqueue('orders', '{}', key => 'busy')", &[])
        .await
        .unwrap();
    drain(&c).await;
    let (_, w) = start_waiter(&url, "1 s").await;
    assert_not_woken(w, "a producer in flight on an idle key").await;
    let (_, w) = start_waiter(&url, "10 s").await;
    tx.commit().await.unwrap();
    assert_woken(w, Instant::now(), "the in-flight producer's commit").await;
    drain(&c).await;

    // Cancel and terminate end a wait at once.
    for (kill, code) in [
        ("pg_cancel_backend", "57014"),
        ("pg_terminate_backend", "57P01"),
    ] {
        let (pid, w) = start_waiter(&url, "1 hour").await;
        let t0 = Instant::now();
        c.execute(&format!("SELECT {kill}($1)"), &[&pid])
            .await
            .unwrap();
        let (r, at) = w.await.unwrap();
        assert_eq!(sqlstate(r), code, "{kill}");
        assert!(at.duration_since(t0) <= WAKE_BOUND, "{kill} took long");
    }
    // A new session waits as before, and is woken as before.
    let (_, w) = start_waiter(&url, "10 s").await;
    c.execute("SELECT outbox_enqueue('orders', '{}')", &[])
        .await
        .unwrap();
    assert_woken(w, Instant::now(), "after a terminated waiter").await;
    drain(&c).await;

    // statement_timeout bounds a wait too.
    let bounded = connect(&url).await;
    bounded
        .batch_execute("SET statement_timeout = '200ms'")
        .await
        .unwrap();
    let r = bounded.query_one("SELECT outbox_wait('1 hour')", &[]).await;
    assert_eq!(sqlstate(r), "57014");

    // Bad arguments: one clear error, and nothing waits.
    for (sql, code) in [
        ("SELECT outbox_wait(NULL)", "22023"),
        ("SELECT outbox_wait('-1 s')", "22023"),
        ("SELECT outbox_wait('2 hours')", "22023"),
        (
            "BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT outbox_wait('1 s')",
            "25000",
        ),
    ] {
        let r = c.batch_execute(sql).await;
        assert_eq!(sqlstate(r), code, "{sql}");
        let _ = c.batch_execute("ROLLBACK").await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_shared_preload_libraries_commits_wake_waiters() {
    scenarios(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_shared_preload_libraries_waiters_poll() {
    scenarios(false).await;
}
