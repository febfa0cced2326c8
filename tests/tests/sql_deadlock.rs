//! The extension's calls never wait for each other in a cycle (docs/design.md, "Lock order"):
//! claims race nacks, releases, acks, reclaims and producers (single and multi-key, due now and
//! later) on a few hot keys, round after round, and no session is ever chosen as a deadlock victim.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use outbox_tests::db::{self, TestDb};
use tokio_postgres::error::SqlState;
use tokio_postgres::Client;

const KEYS: i64 = 6;
const RUN: Duration = Duration::from_secs(20);

/// A deadlock is the failure under test; any other error is a bug in the test or the extension.
fn check(what: &str, r: Result<impl Sized, tokio_postgres::Error>, deadlocks: &AtomicU64) {
    if let Err(e) = r {
        if e.code() == Some(&SqlState::T_R_DEADLOCK_DETECTED) {
            deadlocks.fetch_add(1, Ordering::Relaxed);
            eprintln!("{what}: {e:?}");
        } else {
            panic!("{what}: {e:?}");
        }
    }
}

/// Enqueues for one to three keys in one transaction, in either order (producers take no lock of
/// the extension's), now and then due a few milliseconds later.
async fn produce(c: Client, stop: Arc<AtomicBool>, deadlocks: Arc<AtomicU64>, seed: i64) {
    let mut n = seed;
    while !stop.load(Ordering::Relaxed) {
        n += 7;
        let keys: Vec<String> = (0..1 + n % 3)
            .map(|i| format!("k{}", (n + i) % KEYS))
            .collect();
        let later = n % 5 == 0;
        let r = async {
            c.batch_execute("BEGIN").await?;
            c.execute(
                "SELECT outbox_enqueue('orders', jsonb_build_object('n', $2::bigint), k, NULL, '{}',
                                       CASE WHEN $3 THEN clock_timestamp() + interval '5 ms' END)
                   FROM (SELECT k FROM unnest($1::text[]) WITH ORDINALITY u(k, i)
                          ORDER BY CASE WHEN $2::bigint % 2 = 0 THEN i ELSE -i END) u",
                &[&keys, &n, &later],
            )
            .await?;
            c.batch_execute("COMMIT").await
        }
        .await;
        if r.is_err() {
            let _ = c.batch_execute("ROLLBACK").await;
        }
        check("enqueue", r, &deadlocks);
    }
}

/// Claims and settles each batch one of three ways: ack, nack or release, part of it or all.
async fn relay(c: Client, stop: Arc<AtomicBool>, deadlocks: Arc<AtomicU64>, me: usize) {
    let owner = format!("relay-{me}");
    let mut round = 0u64;
    while !stop.load(Ordering::Relaxed) {
        round += 1;
        let rows = c
            .query("SELECT id, claim_token FROM outbox_claim($1, 8)", &[&owner])
            .await;
        let rows = match rows {
            Ok(rows) => rows,
            Err(e) => {
                check("claim", Err::<(), _>(e), &deadlocks);
                continue;
            }
        };
        let Some(first) = rows.first() else {
            tokio::time::sleep(Duration::from_millis(2)).await;
            continue;
        };
        let token: i64 = first.get(1);
        let mut ids: Vec<i64> = rows.iter().map(|r| r.get(0)).collect();
        if round.is_multiple_of(4) {
            ids.truncate(ids.len().div_ceil(2));
        }
        let settle = match round % 3 {
            0 => "SELECT outbox_ack($1, $2, $3)",
            1 => "SELECT outbox_nack($1, $2, $3, 'test')",
            _ => "SELECT outbox_release($1, $2, $3)",
        };
        let r = c.execute(settle, &[&owner, &token, &ids]).await;
        check(settle, r, &deadlocks);
    }
}

/// Takes back whatever is held, at once: its key rows race the claims' and the settles'.
async fn reclaim(c: Client, stop: Arc<AtomicBool>, deadlocks: Arc<AtomicU64>) {
    while !stop.load(Ordering::Relaxed) {
        let r = c
            .execute("SELECT outbox_reclaim('1 millisecond')", &[])
            .await;
        check("reclaim", r, &deadlocks);
        tokio::time::sleep(Duration::from_millis(3)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn claims_settles_reclaims_and_producers_never_deadlock() {
    let db = TestDb::create();
    // Deadlocks are found after deadlock_timeout: a short one finds them while the test runs.
    db.set(&[("deadlock_timeout", "20ms"), ("outbox.max_retry", "1000")]);
    let stop = Arc::new(AtomicBool::new(false));
    let deadlocks = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for i in 0..3 {
        let c = db::connect(&db.url()).await;
        tasks.push(tokio::spawn(produce(c, stop.clone(), deadlocks.clone(), i)));
    }
    for i in 0..3 {
        let c = db::connect(&db.url()).await;
        tasks.push(tokio::spawn(relay(c, stop.clone(), deadlocks.clone(), i)));
    }
    let c = db::connect(&db.url()).await;
    tasks.push(tokio::spawn(reclaim(c, stop.clone(), deadlocks.clone())));
    tokio::time::sleep(RUN).await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
    let c = db.connect().await;
    for r in c
        .query("SELECT status::text, retry_count, count(*) FROM outbox_event GROUP BY 1, 2 ORDER BY 1, 2", &[])
        .await
        .unwrap()
    {
        eprintln!("{} {} {}", r.get::<_, String>(0), r.get::<_, i32>(1), r.get::<_, i64>(2));
    }
    let handled: i64 = db::scalar(
        &c,
        "SELECT count(*) FROM outbox_event WHERE status = 'SUCCESS' OR retry_count > 0",
        &[],
    )
    .await;
    assert!(
        handled > 100,
        "the race really ran: {handled} events settled or retried"
    );
    assert_eq!(
        deadlocks.load(Ordering::Relaxed),
        0,
        "sessions chosen as deadlock victims"
    );
}
