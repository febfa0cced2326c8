//! The event life cycle through the SQL API, one session at a time: enqueue, claim, ack, nack
//! with backoff, release, renew, reclaim, requeue, purge, delayed delivery and stats.

use outbox_tests::db::{scalar, TestDb};
use tokio_postgres::Client;

async fn enqueue(c: &Client, topic: &str) -> i64 {
    scalar(
        c,
        "SELECT outbox_enqueue($1, '{\"n\":1}'::jsonb)",
        &[&topic],
    )
    .await
}

/// Claims up to `max` rows; returns (token, ids in claim order).
async fn claim(c: &Client, owner: &str, max: i32) -> (Option<i64>, Vec<i64>) {
    let rows = c
        .query(
            "SELECT id, claim_token FROM outbox_claim($1, $2)",
            &[&owner, &max],
        )
        .await
        .unwrap();
    let token = rows.first().map(|r| r.get::<_, i64>(1));
    assert!(
        rows.iter().all(|r| Some(r.get::<_, i64>(1)) == token),
        "one token per call"
    );
    (token, rows.iter().map(|r| r.get(0)).collect())
}

async fn status_of(c: &Client, id: i64) -> (String, i32, Option<String>) {
    let r = c
        .query_one(
            "SELECT status::text, retry_count, claim_owner FROM outbox_event WHERE id = $1",
            &[&id],
        )
        .await
        .unwrap();
    (r.get(0), r.get(1), r.get(2))
}

/// Runs `sql` until it returns a non-NULL value (within 30 s), and returns it.
async fn poll<T: tokio_postgres::types::FromSqlOwned>(
    c: &Client,
    sql: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    what: &str,
) -> T {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        if let Some(v) = scalar::<Option<T>>(c, sql, params).await {
            return v;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "waited 30 s for {what}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// Makes a WAIT row due now, as if its backoff had elapsed. Only scheduled rows (retried, delayed,
/// ordered events) have a next_retry_time: a fresh unordered event is a stream row, always due.
async fn make_due(c: &Client, id: i64) {
    c.execute(
        "UPDATE outbox_scheduled SET next_retry_time = now() - interval '1 second' WHERE id = $1",
        &[&id],
    )
    .await
    .unwrap();
}

/// Enqueues an unordered event as a scheduled row, due now: delivered later, then made due. Such a
/// row has a next_retry_time of its own, as a retried event has (a fresh one is a stream row).
async fn enqueue_scheduled(c: &Client, topic: &str) -> i64 {
    let id = scalar(
        c,
        "SELECT outbox_enqueue($1, '{\"n\":1}'::jsonb, deliver_at => now() + interval '1 hour')",
        &[&topic],
    )
    .await;
    make_due(c, id).await;
    id
}

/// Ages the lease `id` is held under by `age`: a scheduled row's own claimed_at, or the batch row of
/// the claim that handed out a stream event (one lease for that claim's stream events).
async fn age_lease(c: &Client, id: i64, age: &str) {
    for sql in [
        "UPDATE outbox_scheduled SET claimed_at = clock_timestamp() - $2::text::interval WHERE id = $1",
        "UPDATE outbox_stream_batch SET claimed_at = clock_timestamp() - $2::text::interval \
         WHERE $1 = ANY (pending)",
    ] {
        c.execute(sql, &[&id, &age]).await.unwrap();
    }
}

#[tokio::test]
async fn enqueue_stores_a_due_wait_row_with_all_fields() {
    let db = TestDb::create();
    let c = db.connect().await;
    let id: i64 = scalar(&c, "SELECT outbox_enqueue('orders', '{\"id\":1}', key => 'A-1', event_type => 'OrderCreated', \
             headers => '{\"trace\":\"t-1\"}')",
            &[]).await;
    let r = c
        .query_one(
            "SELECT topic, event_key, event_type, payload::text, headers::text, status::text, \
             retry_count, next_retry_time <= now(), claim_owner IS NULL AND claim_token IS NULL \
             FROM outbox_event WHERE id = $1",
            &[&id],
        )
        .await
        .unwrap();
    assert_eq!(r.get::<_, String>(0), "orders");
    assert_eq!(r.get::<_, Option<String>>(1).as_deref(), Some("A-1"));
    assert_eq!(
        r.get::<_, Option<String>>(2).as_deref(),
        Some("OrderCreated")
    );
    assert_eq!(r.get::<_, String>(3), "{\"id\": 1}");
    assert_eq!(r.get::<_, String>(4), "{\"trace\": \"t-1\"}");
    assert_eq!(r.get::<_, String>(5), "WAIT");
    assert_eq!(r.get::<_, i32>(6), 0);
    assert!(r.get::<_, bool>(7));
    assert!(r.get::<_, bool>(8));
}

#[tokio::test]
async fn enqueue_rolled_back_leaves_nothing() {
    let db = TestDb::create();
    let mut c = db.connect().await;
    let tx = c.transaction().await.unwrap();
    tx.execute("SELECT outbox_enqueue('orders', '{}')", &[])
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    let n: i64 = scalar(&c, "SELECT count(*) FROM outbox_event", &[]).await;
    assert_eq!(n, 0);
}

#[tokio::test]
async fn claim_takes_oldest_due_rows_first_and_stamps_the_lease() {
    let db = TestDb::create();
    let c = db.connect().await;
    let mut ids = Vec::new();
    for _ in 0..4 {
        ids.push(enqueue(&c, "orders").await);
    }
    ids.push(enqueue_scheduled(&c, "orders").await);
    // The newest row is made the oldest due one: the claim picks by next_retry_time, not id, and
    // returns its rows in id (publish) order. (A row with a next_retry_time: a scheduled one.)
    c.execute(
        "UPDATE outbox_scheduled SET next_retry_time = now() - interval '1 hour' WHERE id = $1",
        &[&ids[4]],
    )
    .await
    .unwrap();
    let (token, got) = claim(&c, "relay-a", 3).await;
    assert_eq!(got, vec![ids[0], ids[1], ids[4]]);
    let r = c
        .query_one(
            "SELECT count(*) FILTER (WHERE status = 'SENDING' AND claim_owner = 'relay-a' \
             AND claim_token = $1 AND claimed_at IS NOT NULL), count(*) FILTER (WHERE status = 'WAIT') \
             FROM outbox_event",
            &[&token.unwrap()],
        )
        .await
        .unwrap();
    assert_eq!((r.get::<_, i64>(0), r.get::<_, i64>(1)), (3, 2));

    // A second call gets the rest with a new token; a third gets nothing, which is no error.
    let (token2, rest) = claim(&c, "relay-a", 10).await;
    assert_eq!(rest, vec![ids[2], ids[3]]);
    assert_ne!(token, token2);
    assert_eq!(claim(&c, "relay-a", 10).await.1, Vec::<i64>::new());
}

#[tokio::test]
async fn a_claim_commits_without_waiting_for_its_wal_flush_and_the_ack_does_wait() {
    let db = TestDb::create();
    let mut c = db.connect().await;
    // The session's own setting, whatever the server's: the ack is to keep it.
    c.batch_execute("SET synchronous_commit = on")
        .await
        .unwrap();
    let id = enqueue(&c, "orders").await;
    let setting = "SELECT current_setting('synchronous_commit')";
    let tx = c.transaction().await.unwrap();
    let row = tx
        .query_one("SELECT id, claim_token FROM outbox_claim('r', 10)", &[])
        .await
        .unwrap();
    assert_eq!(row.get::<_, i64>(0), id);
    let token: i64 = row.get(1);
    assert_eq!(scalar::<String>(&tx, setting, &[]).await, "off");
    tx.commit().await.unwrap();
    // Only for the claim's transaction: the session's next one (the ack) commits durably.
    assert_eq!(scalar::<String>(&c, setting, &[]).await, "on");
    let tx = c.transaction().await.unwrap();
    tx.execute(
        "SELECT outbox_ack('r', $1, ARRAY[$2::bigint])",
        &[&token, &id],
    )
    .await
    .unwrap();
    assert_eq!(scalar::<String>(&tx, setting, &[]).await, "on");
    tx.commit().await.unwrap();
    assert_eq!(status_of(&c, id).await.0, "SUCCESS");
}

#[tokio::test]
async fn ack_settles_only_rows_held_with_the_same_owner_and_token() {
    let db = TestDb::create();
    let c = db.connect().await;
    let a = enqueue(&c, "orders").await;
    let b = enqueue(&c, "orders").await;
    let (token, _) = claim(&c, "relay-a", 10).await;
    let token = token.unwrap();
    let stale = token - 1;
    let both = vec![a, b];
    let unknown = vec![a, 999_999];

    for (sql, owner, tok) in [
        ("SELECT outbox_ack($1, $2, $3)", "relay-b", token),
        ("SELECT outbox_ack($1, $2, $3)", "relay-a", stale),
        ("SELECT outbox_nack($1, $2, $3, 'x')", "relay-b", token),
        ("SELECT outbox_nack($1, $2, $3, 'x')", "relay-a", stale),
        ("SELECT outbox_renew($1, $2, $3)", "relay-b", token),
        ("SELECT outbox_renew($1, $2, $3)", "relay-a", stale),
    ] {
        let n: i32 = scalar(&c, sql, &[&owner, &tok, &both]).await;
        assert_eq!(n, 0, "{sql} as {owner}/{tok} must count 0");
    }
    for id in [a, b] {
        assert_eq!(
            status_of(&c, id).await,
            ("SENDING".into(), 0, Some("relay-a".into()))
        );
    }

    let n: i32 = scalar(
        &c,
        "SELECT outbox_ack('relay-a', $1, $2)",
        &[&token, &unknown],
    )
    .await;
    assert_eq!(n, 1, "unknown ids are not counted");
    assert_eq!(status_of(&c, a).await.0, "SUCCESS");
    // A late second ack of the same row is a no-op.
    let n: i32 = scalar(&c, "SELECT outbox_ack('relay-a', $1, $2)", &[&token, &both]).await;
    assert_eq!(n, 1);
    let n: i32 = scalar(&c, "SELECT outbox_ack('relay-a', $1, $2)", &[&token, &both]).await;
    assert_eq!(n, 0);
}

/// The ids `outbox_ack_returning(owner, token, ids)` settled, in ascending order.
async fn ack_returning(c: &Client, owner: &str, token: i64, ids: &[i64]) -> Vec<i64> {
    let mut got: Vec<i64> = c
        .query(
            "SELECT id FROM outbox_ack_returning($1, $2, $3) AS id",
            &[&owner, &token, &ids],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    got.sort_unstable();
    got
}

/// `outbox_ack_returning` returns exactly the ids it settled (what the relay counts as
/// published): none under another owner or an old token, none reclaimed from under its holder,
/// none already acked; scheduled rows and stream events alike. `outbox_ack` is its count.
#[tokio::test]
async fn ack_returning_returns_only_the_ids_it_settled_under_its_owner_and_token() {
    let db = TestDb::create();
    let c = db.connect().await;
    let scheduled = enqueue_scheduled(&c, "orders").await;
    let reclaimed = enqueue_scheduled(&c, "orders").await;
    let stream = enqueue(&c, "orders").await;
    let (token, ids) = claim(&c, "relay-a", 10).await;
    let token = token.unwrap();
    assert_eq!(ids.len(), 3);
    let all = [scheduled, reclaimed, stream, 999_999];

    assert_eq!(
        ack_returning(&c, "relay-b", token, &all).await,
        Vec::<i64>::new()
    );
    assert_eq!(
        ack_returning(&c, "relay-a", token - 1, &all).await,
        Vec::<i64>::new()
    );
    for id in [scheduled, reclaimed, stream] {
        assert_eq!(status_of(&c, id).await.0, "SENDING", "event {id}");
    }

    // Its lease ends and another relay takes it: relay-a's late ack must not report it.
    age_lease(&c, reclaimed, "1 hour").await;
    let n: i32 = scalar(&c, "SELECT outbox_reclaim('1 minute')", &[]).await;
    assert_eq!(n, 1);
    let (token_b, got) = claim(&c, "relay-b", 10).await;
    assert_eq!(got, vec![reclaimed]);

    assert_eq!(
        ack_returning(&c, "relay-a", token, &all).await,
        vec![scheduled, stream]
    );
    assert_eq!(
        ack_returning(&c, "relay-a", token, &all).await,
        Vec::<i64>::new()
    );
    assert_eq!(status_of(&c, reclaimed).await.0, "SENDING");
    let n: i32 = scalar(
        &c,
        "SELECT outbox_ack('relay-b', $1, $2)",
        &[&token_b.unwrap(), &all.to_vec()],
    )
    .await;
    assert_eq!(n, 1, "the count form settles relay-b's row");
    assert_eq!(status_of(&c, reclaimed).await.0, "SUCCESS");
}

#[tokio::test]
async fn nack_backs_off_5_20_45_seconds_then_dead_letters_after_the_4th_failure() {
    let db = TestDb::create();
    let c = db.connect().await;
    let id = enqueue(&c, "orders").await;
    for (attempt, expected_secs) in [(1, Some(5.0)), (2, Some(20.0)), (3, Some(45.0)), (4, None)] {
        make_due(&c, id).await;
        let (token, got) = claim(&c, "relay-a", 1).await;
        assert_eq!(got, vec![id], "attempt {attempt} claims the row");
        let n: i32 = scalar(
            &c,
            "SELECT outbox_nack('relay-a', $1, ARRAY[$2::bigint], $3)",
            &[&token.unwrap(), &id, &format!("boom {attempt}")],
        )
        .await;
        assert_eq!(n, 1);
        let r = c
            .query_one(
                "SELECT status::text, retry_count, \
                 extract(epoch FROM next_retry_time - updated_at)::float8, last_error, \
                 claim_owner IS NULL AND claim_token IS NULL AND claimed_at IS NULL \
                 FROM outbox_event WHERE id = $1",
                &[&id],
            )
            .await
            .unwrap();
        assert_eq!(r.get::<_, i32>(1), attempt);
        assert_eq!(r.get::<_, String>(3), format!("boom {attempt}"));
        assert!(r.get::<_, bool>(4), "lease cleared");
        match expected_secs {
            Some(secs) => {
                assert_eq!(r.get::<_, String>(0), "WAIT");
                assert!(
                    (r.get::<_, f64>(2) - secs).abs() < 1e-3,
                    "backoff {}",
                    r.get::<_, f64>(2)
                );
                // Not claimable before its backoff elapsed.
                assert!(claim(&c, "relay-a", 1).await.1.is_empty());
            }
            None => assert_eq!(r.get::<_, String>(0), "FAIL"),
        }
    }
}

#[tokio::test]
async fn backoff_follows_settings_with_cap_and_jitter() {
    let db = TestDb::create();
    let c = db.connect().await;
    c.batch_execute(
        "SET outbox.backoff_base = '1s'; SET outbox.backoff_max = '3s'; \
         SET outbox.backoff_jitter = 0.5; SET outbox.max_retry = 10",
    )
    .await
    .unwrap();
    let id = enqueue(&c, "orders").await;
    let mut delays = Vec::new();
    for _ in 0..8 {
        make_due(&c, id).await;
        let (token, _) = claim(&c, "r", 1).await;
        c.execute(
            "SELECT outbox_nack('r', $1, ARRAY[$2::bigint])",
            &[&token.unwrap(), &id],
        )
        .await
        .unwrap();
        let secs: f64 = scalar(&c, "SELECT extract(epoch FROM next_retry_time - updated_at)::float8 FROM outbox_event WHERE id = $1",
                &[&id]).await;
        delays.push(secs);
    }
    // n^2 * 1s capped at 3s, each within [0.5, 1.5] of its nominal value.
    let nominal = [1.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0];
    for (d, nominal) in delays.iter().zip(nominal) {
        assert!(
            *d >= nominal * 0.5 - 1e-3 && *d <= nominal * 1.5 + 1e-3,
            "{delays:?}"
        );
    }
    // The ranges above also hold without jitter: the jitter must show. Seven capped delays drawn
    // uniformly from [1.5 s, 4.5 s] all within 0.3 s of each other: odds about 1e-5.
    let capped = &delays[1..];
    let spread = capped.iter().cloned().fold(f64::MIN, f64::max)
        - capped.iter().cloned().fold(f64::MAX, f64::min);
    assert!(spread > 0.3, "no jitter in the capped delays: {delays:?}");
}

#[tokio::test]
async fn release_hands_rows_back_without_counting_an_attempt() {
    let db = TestDb::create();
    let c = db.connect().await;
    c.batch_execute("SET outbox.max_retry = 0").await.unwrap();
    let id = enqueue(&c, "orders").await;
    // With max_retry 0 a single nack would dead-letter; released five times, it never does.
    for round in 0..5 {
        let (token, ids) = claim(&c, "relay-a", 10).await;
        assert_eq!(ids, vec![id], "round {round}");
        let wrong: i32 = scalar(
            &c,
            "SELECT outbox_release('relay-b', $1, $2)",
            &[&token, &ids],
        )
        .await;
        assert_eq!(wrong, 0, "fenced: not relay-b's claim");
        let n: i32 = scalar(
            &c,
            "SELECT outbox_release('relay-a', $1, $2, error => 'broker unreachable')",
            &[&token, &ids],
        )
        .await;
        assert_eq!(n, 1);
        let stale: i32 = scalar(
            &c,
            "SELECT outbox_release('relay-a', $1, $2)",
            &[&token, &ids],
        )
        .await;
        assert_eq!(stale, 0, "a second release of the same claim is a no-op");
    }
    assert_eq!(status_of(&c, id).await, ("WAIT".into(), 0, None));
    let reason: String = scalar(
        &c,
        "SELECT last_error FROM outbox_event WHERE id = $1",
        &[&id],
    )
    .await;
    assert_eq!(reason, "broker unreachable");
    // A delay keeps the row out of claims until it passes.
    let (token, ids) = claim(&c, "relay-a", 10).await;
    let n: i32 = scalar(
        &c,
        "SELECT outbox_release('relay-a', $1, $2, delay => '1 hour')",
        &[&token, &ids],
    )
    .await;
    assert_eq!(n, 1);
    assert_eq!(claim(&c, "relay-a", 10).await.1, Vec::<i64>::new());
    let due_in: f64 = scalar(
        &c,
        "SELECT extract(epoch FROM next_retry_time - now())::float8 FROM outbox_event WHERE id = $1",
        &[&id],
    )
    .await;
    assert!((3590.0..3610.0).contains(&due_in), "due in {due_in} s");
}

#[tokio::test]
async fn renew_extends_the_lease_of_held_rows() {
    let db = TestDb::create();
    let c = db.connect().await;
    let id = enqueue(&c, "orders").await;
    let (token, _) = claim(&c, "relay-a", 1).await;
    age_lease(&c, id, "1 hour").await;
    let n: i32 = scalar(
        &c,
        "SELECT outbox_renew('relay-a', $1, ARRAY[$2::bigint])",
        &[&token.unwrap(), &id],
    )
    .await;
    assert_eq!(n, 1);
    let fresh: bool = scalar(&c, "SELECT claimed_at > clock_timestamp() - interval '1 minute' FROM outbox_event WHERE id = $1",
            &[&id]).await;
    assert!(fresh);
    // A renewed lease is not reclaimed.
    let n: i32 = scalar(&c, "SELECT outbox_reclaim('10 minutes')", &[]).await;
    assert_eq!(n, 0);
}

#[tokio::test]
async fn reclaim_uses_claimed_at_not_next_retry_time_and_counts_an_attempt() {
    let db = TestDb::create();
    let c = db.connect().await;
    // `fresh` has a next_retry_time of its own (a scheduled row); `stale` is a stream event.
    let fresh = enqueue_scheduled(&c, "orders").await;
    let stale = enqueue(&c, "orders").await;
    assert_eq!(claim(&c, "relay-a", 10).await.1.len(), 2);
    // `fresh` was due long ago but its lease is new; `stale` holds a lease older than 10 minutes.
    c.execute(
        "UPDATE outbox_scheduled SET next_retry_time = now() - interval '1 day' WHERE id = $1",
        &[&fresh],
    )
    .await
    .unwrap();
    age_lease(&c, stale, "11 minutes").await;
    let n: i32 = scalar(&c, "SELECT outbox_reclaim()", &[]).await;
    assert_eq!(n, 1);
    assert_eq!(
        status_of(&c, fresh).await,
        ("SENDING".into(), 0, Some("relay-a".into()))
    );
    assert_eq!(status_of(&c, stale).await, ("WAIT".into(), 1, None));
    let err: String = scalar(
        &c,
        "SELECT last_error FROM outbox_event WHERE id = $1",
        &[&stale],
    )
    .await;
    assert!(
        err.contains("lease expired") && err.contains("relay-a"),
        "{err}"
    );
    // Due now: another relay picks it up at once.
    assert_eq!(claim(&c, "relay-b", 10).await.1, vec![stale]);
}

#[tokio::test]
async fn reclaim_dead_letters_an_event_that_keeps_losing_its_lease() {
    let db = TestDb::create();
    let c = db.connect().await;
    let id = enqueue(&c, "orders").await;
    for round in 1..=4 {
        let (_, got) = claim(&c, "crashy", 1).await;
        assert_eq!(got, vec![id]);
        // The first claim's lease is its batch's (a stream event), later ones the scheduled copy's.
        age_lease(&c, id, "1 hour").await;
        let n: i32 = scalar(&c, "SELECT outbox_reclaim('1 minute')", &[]).await;
        assert_eq!(n, 1);
        let expect = if round < 4 { "WAIT" } else { "FAIL" };
        assert_eq!(status_of(&c, id).await.0, expect, "after reclaim {round}");
    }
}

/// The `_returning` forms say which settled rows became dead letters (the relay logs and counts
/// exactly those), and the rows of another holder are not reported.
#[tokio::test]
async fn nack_and_reclaim_returning_report_each_settled_row_and_its_dead_letters() {
    let db = TestDb::create();
    let c = db.connect().await;
    c.batch_execute("SET outbox.max_retry = 1").await.unwrap();
    // Scheduled rows (only they have a retry_count of their own to set).
    let fresh = enqueue_scheduled(&c, "orders").await;
    let tired = enqueue_scheduled(&c, "payments").await;
    c.execute(
        "UPDATE outbox_scheduled SET retry_count = 1 WHERE id = $1",
        &[&tired],
    )
    .await
    .unwrap();
    let (token, ids) = claim(&c, "relay-a", 10).await;
    assert_eq!(ids.len(), 2);
    let rows = c
        .query(
            "SELECT id, topic, status::text, retry_count FROM outbox_nack_returning('relay-a', $1, $2, 'boom')",
            &[&token, &vec![fresh, tired, 424_242]],
        )
        .await
        .unwrap();
    let got: Vec<(i64, String, String, i32)> = rows
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect();
    assert_eq!(
        got,
        vec![
            (fresh, "orders".into(), "WAIT".into(), 1),
            (tired, "payments".into(), "FAIL".into(), 2),
        ]
    );
    // Nothing held any more: a second nack reports nothing.
    let again = c
        .query(
            "SELECT id FROM outbox_nack_returning('relay-a', $1, $2)",
            &[&token, &vec![fresh, tired]],
        )
        .await
        .unwrap();
    assert!(again.is_empty());

    c.execute(
        "UPDATE outbox_scheduled SET next_retry_time = now() WHERE id = $1",
        &[&fresh],
    )
    .await
    .unwrap();
    let (_, got) = claim(&c, "crashy", 1).await;
    assert_eq!(got, vec![fresh]);
    age_lease(&c, fresh, "1 hour").await;
    let r = c
        .query_one(
            "SELECT id, topic, status::text, retry_count, expired_owner FROM outbox_reclaim_returning('1 minute')",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(
        (
            r.get::<_, i64>(0),
            r.get::<_, String>(1),
            r.get::<_, String>(2),
            r.get::<_, i32>(3)
        ),
        (fresh, "orders".to_string(), "FAIL".to_string(), 2),
        "second failed attempt with max_retry 1: a dead letter"
    );
    assert_eq!(r.get::<_, Option<String>>(4).as_deref(), Some("crashy"));
}

#[tokio::test]
async fn requeue_returns_dead_letters_only() {
    let db = TestDb::create();
    let c = db.connect().await;
    let dead = enqueue(&c, "orders").await;
    let waiting = enqueue(&c, "orders").await;
    // `dead` fails its only attempt (max_retry 0): a dead letter with its error, not due.
    c.batch_execute("SET outbox.max_retry = 0").await.unwrap();
    let (token, ids) = claim(&c, "relay-a", 1).await;
    assert_eq!(ids, vec![dead]);
    let n: i32 = scalar(
        &c,
        "SELECT outbox_nack('relay-a', $1, ARRAY[$2::bigint], 'boom')",
        &[&token.unwrap(), &dead],
    )
    .await;
    assert_eq!(n, 1);
    c.batch_execute("RESET outbox.max_retry").await.unwrap();
    assert_eq!(status_of(&c, dead).await.0, "FAIL");
    let listed: Vec<i64> = c
        .query("SELECT id FROM outbox_dead_letters()", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(listed, vec![dead]);
    let n: i32 = scalar(
        &c,
        "SELECT outbox_requeue($1)",
        &[&vec![dead, waiting, 424_242]],
    )
    .await;
    assert_eq!(n, 1);
    let r = c
        .query_one(
            "SELECT status::text, retry_count, next_retry_time <= clock_timestamp(), last_error \
             FROM outbox_event WHERE id = $1",
            &[&dead],
        )
        .await
        .unwrap();
    assert_eq!(r.get::<_, String>(0), "WAIT");
    assert_eq!(r.get::<_, i32>(1), 0);
    assert!(r.get::<_, bool>(2), "due now");
    assert_eq!(
        r.get::<_, Option<String>>(3).as_deref(),
        Some("boom"),
        "history kept"
    );
    assert_eq!(status_of(&c, waiting).await.0, "WAIT");
}

#[tokio::test]
async fn purge_deletes_old_success_rows_only_and_is_bounded() {
    let db = TestDb::create();
    let c = db.connect().await;
    for _ in 0..5 {
        enqueue(&c, "orders").await;
    }
    let (token, ids) = claim(&c, "r", 5).await;
    c.execute("SELECT outbox_ack('r', $1, $2)", &[&token.unwrap(), &ids])
        .await
        .unwrap();
    // Every other state, all of them old: a dead letter (its only attempt failed, max_retry 0),
    // a held event and a waiting one. Old: a scheduled row by its updated_at, a stream row (never
    // rewritten) by its created_at.
    c.batch_execute(
        "SELECT outbox_enqueue('orders', '{}') FROM generate_series(1, 3); \
         SET outbox.max_retry = 0",
    )
    .await
    .unwrap();
    let (token, ids) = claim(&c, "x", 1).await;
    let n: i32 = scalar(
        &c,
        "SELECT outbox_nack('x', $1, $2, 'boom')",
        &[&token.unwrap(), &ids],
    )
    .await;
    assert_eq!(n, 1);
    assert_eq!(claim(&c, "x", 1).await.1.len(), 1);
    c.batch_execute(
        "RESET outbox.max_retry; \
         UPDATE outbox_scheduled SET updated_at = now() - interval '30 days'; \
         UPDATE outbox_stream SET created_at = now() - interval '30 days'",
    )
    .await
    .unwrap();
    let n: i64 = scalar(&c, "SELECT outbox_purge('7 days', 2)", &[]).await;
    assert_eq!(n, 2, "bounded by max_rows");
    let n: i64 = scalar(&c, "SELECT outbox_purge()", &[]).await;
    assert_eq!(n, 3);
    let left: Vec<String> = c
        .query(
            "SELECT e.status::text FROM outbox_event e ORDER BY e.status",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(left, vec!["WAIT", "SENDING", "FAIL"]);
    // Young SUCCESS rows stay.
    let id = enqueue(&c, "orders").await;
    let (token, _) = claim(&c, "r", 1).await;
    c.execute(
        "SELECT outbox_ack('r', $1, ARRAY[$2::bigint])",
        &[&token.unwrap(), &id],
    )
    .await
    .unwrap();
    let n: i64 = scalar(&c, "SELECT outbox_purge('1 hour')", &[]).await;
    assert_eq!(n, 0);
}

#[tokio::test]
async fn delayed_delivery_is_not_claimable_before_deliver_at() {
    let db = TestDb::create();
    let c = db.connect().await;
    let later: i64 = scalar(
        &c,
        "SELECT outbox_enqueue('orders', '{}', deliver_at => now() + interval '1 hour')",
        &[],
    )
    .await;
    let past: i64 = scalar(
        &c,
        "SELECT outbox_enqueue('orders', '{}', deliver_at => now() - interval '1 hour')",
        &[],
    )
    .await;
    let due_at_enqueue: bool = scalar(
        &c,
        "SELECT next_retry_time >= now() - interval '1 minute' FROM outbox_event WHERE id = $1",
        &[&past],
    )
    .await;
    assert!(
        due_at_enqueue,
        "a past deliver_at means due now, not in the past"
    );
    let s = c
        .query_one("SELECT due_wait, delayed_wait FROM outbox_stats()", &[])
        .await
        .unwrap();
    assert_eq!((s.get::<_, i64>(0), s.get::<_, i64>(1)), (1, 1));
    assert_eq!(claim(&c, "r", 10).await.1, vec![past]);
    make_due(&c, later).await;
    assert_eq!(claim(&c, "r", 10).await.1, vec![later]);
}

#[tokio::test]
async fn stats_count_every_state_and_report_ages() {
    let db = TestDb::create();
    let c = db.connect().await;
    for _ in 0..6 {
        enqueue(&c, "orders").await;
    }
    c.execute(
        "SELECT outbox_enqueue('orders', '{}', deliver_at => now() + interval '1 day')",
        &[],
    )
    .await
    .unwrap();
    let (token, ids) = claim(&c, "r", 3).await;
    let token = token.unwrap();
    c.execute(
        "SELECT outbox_ack('r', $1, $2)",
        &[&token, &ids[..1].to_vec()],
    )
    .await
    .unwrap();
    // A dead letter: its only attempt failed (max_retry 0).
    c.batch_execute("SET outbox.max_retry = 0").await.unwrap();
    c.execute(
        "SELECT outbox_nack('r', $1, ARRAY[$2::bigint])",
        &[&token, &ids[1]],
    )
    .await
    .unwrap();
    c.batch_execute("RESET outbox.max_retry").await.unwrap();
    // The due WAIT events waited 90 s: a scheduled row by its next_retry_time, a stream event (due
    // since its enqueue) by its created_at.
    c.batch_execute(
        "UPDATE outbox_scheduled SET next_retry_time = now() - interval '90 seconds' WHERE status = 'WAIT' \
         AND next_retry_time <= now(); \
         UPDATE outbox_stream SET created_at = now() - interval '90 seconds' \
          WHERE id IN (SELECT id FROM outbox_event WHERE status = 'WAIT' AND next_retry_time <= now())",
    )
    .await
    .unwrap();
    let s = c
        .query_one(
            "SELECT due_wait, delayed_wait, sending, failed, succeeded, \
             extract(epoch FROM oldest_due_age)::float8, extract(epoch FROM oldest_lease_age)::float8 \
             FROM outbox_stats()",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(s.get::<_, i64>(0), 3);
    assert_eq!(s.get::<_, i64>(1), 1);
    assert_eq!(s.get::<_, i64>(2), 1);
    assert_eq!(s.get::<_, i64>(3), 1);
    assert_eq!(s.get::<_, i64>(4), 1);
    assert!(s.get::<_, f64>(5) >= 90.0 && s.get::<_, f64>(5) < 120.0);
    assert!(s.get::<_, f64>(6) >= 0.0 && s.get::<_, f64>(6) < 60.0);
}

/// Claims and settles with `settle` ('ack' or 'nack') every event a claim hands out, 1,000 at a
/// time; returns how many.
async fn settle_all(c: &Client, settle: &str) -> i64 {
    let sql = format!(
        "SELECT coalesce(sum(a.n), 0)::bigint FROM (SELECT {} AS n \
         FROM outbox_claim('r', 1000) c GROUP BY c.claim_token) a",
        match settle {
            "ack" => "outbox_ack('r', c.claim_token, array_agg(c.id))",
            _ => "outbox_nack('r', c.claim_token, array_agg(c.id), 'broker down')",
        }
    );
    let mut settled = 0i64;
    loop {
        let n: i64 = scalar(c, &sql, &[]).await;
        if n == 0 {
            return settled;
        }
        settled += n;
    }
}

/// A delivered history past 8 MB: 40,000 events enqueued, claimed and acked; returns how many.
async fn deliver_history(c: &Client) -> i64 {
    let total = 40_000i64;
    c.execute(
        "SELECT count(outbox_enqueue('orders', jsonb_build_object('n', g, 'note', repeat('x', 100)))) \
         FROM generate_series(1, $1::bigint) g",
        &[&total],
    )
    .await
    .unwrap();
    assert_eq!(
        settle_all(c, "ack").await,
        total,
        "every event is delivered"
    );
    total
}

/// The shared buffers (hit or read) one run of `sql` touches, from EXPLAIN (ANALYZE, BUFFERS).
async fn buffers_read(c: &Client, sql: &str) -> i64 {
    let plan: serde_json::Value = scalar(
        c,
        &format!("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {sql}"),
        &[],
    )
    .await;
    let top = &plan[0]["Plan"];
    top["Shared Hit Blocks"].as_i64().unwrap() + top["Shared Read Blocks"].as_i64().unwrap()
}

/// Past 8 MB outbox_stats estimates the delivered history (SUCCESS) from the planner's statistics
/// instead of counting it, also when a table was never analyzed (reltuples -1): here the scheduled
/// table, which never holds a row while no key is busy and nothing fails. Before 0.10.0 that one
/// table sent every call to the exact count, which read the whole stream: a relay calls it every
/// 5 s, and the 10-minute bench's once-a-second sampler ended up using most of a core.
#[tokio::test]
async fn stats_estimate_the_history_past_8_mb_even_with_a_table_never_analyzed() {
    let db = TestDb::create();
    let c = db.connect().await;
    let total = deliver_history(&c).await;
    c.batch_execute("ANALYZE outbox_stream").await.unwrap();
    let scheduled_tuples: f32 = scalar(
        &c,
        "SELECT reltuples FROM pg_class WHERE oid = 'outbox_scheduled'::regclass",
        &[],
    )
    .await;
    assert_eq!(
        scheduled_tuples, -1.0,
        "the scheduled table was never analyzed"
    );
    let stream_pages: i64 =
        scalar(&c, "SELECT pg_relation_size('outbox_stream') / 8192", &[]).await;
    assert!(
        stream_pages >= 1024,
        "the stream is past 8 MB: {stream_pages} pages"
    );

    // A session's first call also fills its catalog caches (~1,600 buffers, even on an empty
    // outbox): measure the second.
    let _: i64 = scalar(&c, "SELECT succeeded FROM outbox_stats()", &[]).await;
    let buffers = buffers_read(&c, "SELECT * FROM outbox_stats()").await;
    assert!(
        buffers < stream_pages / 4,
        "outbox_stats read {buffers} buffers over a stream of {stream_pages} pages: it counted the history"
    );
    let succeeded: i64 = scalar(&c, "SELECT succeeded FROM outbox_stats()", &[]).await;
    assert!(
        (succeeded - total).abs() <= total / 10,
        "succeeded {succeeded} is an estimate of the {total} delivered events"
    );
}

/// outbox_wait looks at the queue with outbox_work_due() between empty claims (every
/// outbox.wait_poll_interval, 10 ms, without the library): a look must cost a few index probes
/// whatever the delivered history, the events in backoff and the keys that wait for a backoff.
/// Before 0.11.0 the stream's probe was an EXISTS that the planner ran as a sequential scan from
/// the stream's first page (it guesses that a third of the stream lies past the cursor), so an
/// idle outbox read its whole history at every look (1.46 million delivered events: 350–390 ms
/// and 38,800 buffers, which stalled the 10-minute bench's claim loop), and the backoff probe, bounded
/// by clock_timestamp(), read every event in backoff. Here 0.10.0 reads about 2,550 buffers.
#[tokio::test]
async fn a_look_at_the_queue_costs_a_few_pages_whatever_the_history_and_the_backoffs() {
    let db = TestDb::create();
    let c = db.connect().await;
    // An empty outbox: false, not NULL (outbox_wait takes NULL for an error).
    let due: Option<bool> = scalar(&c, "SELECT outbox_work_due()", &[]).await;
    assert_eq!(due, Some(false), "nothing is due in an empty outbox");
    deliver_history(&c).await;
    let due: Option<bool> = scalar(&c, "SELECT outbox_work_due()", &[]).await;
    assert_eq!(
        due,
        Some(false),
        "nothing is due once everything is delivered"
    );
    // In backoff (the first retry waits 5 s): unkeyed events, and keyed ones, a key each.
    let backoff = 20_000i64;
    let keys = 5_000i64;
    c.execute(
        "SELECT count(outbox_enqueue('orders', jsonb_build_object('n', g))) FROM generate_series(1, $1::bigint) g",
        &[&backoff],
    )
    .await
    .unwrap();
    c.execute(
        "SELECT count(outbox_enqueue('orders', jsonb_build_object('n', g), key => 'order-' || g)) \
         FROM generate_series(1, $1::bigint) g",
        &[&keys],
    )
    .await
    .unwrap();
    assert_eq!(settle_all(&c, "nack").await, backoff + keys);
    c.batch_execute("ANALYZE outbox_stream; ANALYZE outbox_scheduled; ANALYZE outbox_key")
        .await
        .unwrap();
    let (stream_pages, waiting_keys): (i64, i64) = {
        let r = c
            .query_one(
                "SELECT pg_relation_size('outbox_stream') / 8192, (SELECT count(*) FROM outbox_key)",
                &[],
            )
            .await
            .unwrap();
        (r.get(0), r.get(1))
    };
    assert!(
        stream_pages >= 1024,
        "the stream holds the history: {stream_pages} pages"
    );
    assert_eq!(waiting_keys, keys, "every key waits for its head's backoff");

    let due: bool = scalar(&c, "SELECT outbox_work_due()", &[]).await;
    assert!(
        !due,
        "nothing is due: everything is delivered or in backoff"
    );
    let buffers = buffers_read(&c, "SELECT outbox_work_due()").await;
    assert!(
        buffers <= 100,
        "a look at the queue read {buffers} buffers (stream of {stream_pages} pages, {backoff} events \
         and {keys} keys in backoff): a probe scanned instead of stopping at its first entry"
    );

    // And it still sees work: a fresh event, a key whose backoff is over, then an event whose
    // backoff is over.
    let fresh = enqueue(&c, "orders").await;
    let due: bool = scalar(&c, "SELECT outbox_work_due()", &[]).await;
    assert!(due, "a fresh event {fresh} is due");
    assert_eq!(settle_all(&c, "ack").await, 1);
    for (due_at, expected) in [("now()", true), ("now() + interval '1 hour'", false)] {
        c.batch_execute(&format!(
            "UPDATE outbox_key SET state = 'waiting', due_at = {due_at} WHERE event_key = 'order-1'"
        ))
        .await
        .unwrap();
        let due: bool = scalar(&c, "SELECT outbox_work_due()", &[]).await;
        assert_eq!(due, expected, "a key due at {due_at}");
    }
    c.execute(
        "UPDATE outbox_scheduled SET next_retry_time = now() WHERE id = (SELECT min(id) FROM outbox_scheduled WHERE NOT ordered)",
        &[],
    )
    .await
    .unwrap();
    let due: bool = scalar(&c, "SELECT outbox_work_due()", &[]).await;
    assert!(due, "an event whose backoff is over is due");
}

#[tokio::test]
async fn a_partial_ack_settles_only_the_ids_it_names_even_beside_a_null() {
    let db = TestDb::create();
    let c = db.connect().await;
    let mut ids = Vec::new();
    for _ in 0..3 {
        ids.push(enqueue(&c, "orders").await);
    }
    let (token, got) = claim(&c, "relay-a", 3).await;
    assert_eq!(got, ids);
    let token = token.unwrap();
    // A NULL never matches an event: the call settles the first event only.
    let n: i32 = scalar(
        &c,
        "SELECT outbox_ack('relay-a', $1, ARRAY[$2, NULL]::bigint[])",
        &[&token, &ids[0]],
    )
    .await;
    assert_eq!(n, 1);
    assert_eq!(status_of(&c, ids[0]).await.0, "SUCCESS");
    for id in &ids[1..] {
        assert_eq!(
            status_of(&c, *id).await.0,
            "SENDING",
            "event {id} is still held"
        );
    }
    let n: i32 = scalar(
        &c,
        "SELECT outbox_nack('relay-a', $1, $2, 'broker said no')",
        &[&token, &ids[1..].to_vec()],
    )
    .await;
    assert_eq!(n, 2, "the rest is still the claim's to settle");
}

/// A claim returns every row of its batch, in id order, whether the stream ids are consecutive
/// (read as one primary-key range) or spread out: here an event whose transaction stayed open
/// while 30 later ones were enqueued and half of them claimed.
#[tokio::test]
async fn a_claim_returns_its_stream_rows_whether_their_ids_are_consecutive_or_spread() {
    let db = TestDb::create();
    let c = db.connect().await;
    let long = db.connect().await;
    long.batch_execute("BEGIN").await.unwrap();
    let early: i64 = scalar(
        &long,
        "SELECT outbox_enqueue('orders', '{\"n\": 0}'::jsonb)",
        &[],
    )
    .await;
    let mut later = Vec::new();
    for n in 1..=30 {
        later.push(
            scalar::<i64>(
                &c,
                "SELECT outbox_enqueue('orders', jsonb_build_object('n', $1::int))",
                &[&n],
            )
            .await,
        );
    }
    let (token, ids) = claim(&c, "relay-a", 25).await;
    assert_eq!(
        ids,
        later[..25],
        "consecutive ids, the open transaction's left out"
    );
    let acked: i32 = scalar(&c, "SELECT outbox_ack('relay-a', $1, $2)", &[&token, &ids]).await;
    assert_eq!(acked, 25);
    long.batch_execute("COMMIT").await.unwrap();

    let rows = c
        .query(
            "SELECT id, payload->>'n', claim_token, status::text FROM outbox_claim('relay-a', 10)",
            &[],
        )
        .await
        .unwrap();
    let got: Vec<(i64, String)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    let mut want = vec![(early, "0".to_string())];
    want.extend(
        later[25..]
            .iter()
            .zip(26..)
            .map(|(&id, n)| (id, n.to_string())),
    );
    assert_eq!(got, want, "the spread batch: every row, in id order");
    assert!(rows
        .iter()
        .all(|r| r.get::<_, String>(3) == "SENDING"
            && r.get::<_, i64>(2) == rows[0].get::<_, i64>(2)));
}

/// A claim that PostgreSQL runs after its client died: a relay SIGKILLed with a claim in flight
/// (the server learns of the closed connection only when it answers, and would commit the
/// statement). Here a real `psql` whose statement sleeps before it claims is killed with SIGKILL
/// during the sleep. The native build rolls the claim back (`outbox_client_connected`), so the
/// event is due at once instead of held for the dead owner until the lease ends; the SQL-only
/// build cannot see the socket and commits it (docs/sql-only.md).
#[tokio::test]
async fn a_claim_whose_client_died_while_it_ran_holds_nothing() {
    let db = TestDb::create();
    let c = db.connect().await;
    assert!(
        scalar::<bool>(&c, "SELECT outbox_client_connected()", &[]).await,
        "a live session's client is connected"
    );
    let id = enqueue(&c, "orders").await;

    let app = format!("dead_claimer_{}", std::process::id());
    let mut victim = std::process::Command::new("psql")
        .arg(format!("{} application_name={app}", db.url()))
        .args(["-X", "-q", "-c"])
        // Seconds of sleep: the kill must land before the claim starts, even on a loaded machine.
        .arg("DO $$ BEGIN PERFORM pg_sleep(4); PERFORM outbox_claim('dead-claimer', 10); END $$")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("psql");
    let pid: i32 = poll(
        &c,
        "SELECT (SELECT pid FROM pg_stat_activity
                  WHERE application_name = $1 AND wait_event = 'PgSleep' LIMIT 1)",
        &[&app],
        "psql's backend sleeping",
    )
    .await;
    victim.kill().expect("SIGKILL psql");
    victim.wait().expect("reap psql");

    // The backend wakes up, runs the claim, and ends once it finds its client gone.
    let _: bool = poll(
        &c,
        "SELECT (SELECT true WHERE NOT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1))",
        &[&pid],
        "the dead client's backend ending",
    )
    .await;

    let (status, retries, owner) = status_of(&c, id).await;
    if outbox_tests::build::sql_only() {
        assert_eq!(
            (status.as_str(), owner.as_deref()),
            ("SENDING", Some("dead-claimer")),
            "the SQL-only build commits the dead client's claim"
        );
    } else {
        assert_eq!(
            (status.as_str(), retries, owner),
            ("WAIT", 0, None),
            "the dead client's claim was rolled back"
        );
        let (_, ids) = claim(&c, "alive", 10).await;
        assert_eq!(ids, vec![id], "a live relay gets the event at once");
    }
}

async fn heartbeat(c: &Client, owner: &str, timeout: &str) {
    c.execute(
        "SELECT outbox_heartbeat($1, $2::text::interval)",
        &[&owner, &timeout],
    )
    .await
    .unwrap();
}

/// (id, status, retry_count, expired_owner) of each row a reclaim with a 10-minute lease took.
async fn reclaim_10_minutes(c: &Client) -> Vec<(i64, String, i32, Option<String>)> {
    c.query(
        "SELECT id, status::text, retry_count, expired_owner \
         FROM outbox_reclaim_returning('10 minutes') ORDER BY id",
        &[],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
    .collect()
}

#[tokio::test]
async fn a_claim_whose_owner_stopped_beating_is_reclaimed_long_before_its_lease() {
    let db = TestDb::create();
    let c = db.connect().await;
    // A scheduled row, an unordered stream event and an ordered one: every kind a claim holds.
    let scheduled = enqueue_scheduled(&c, "orders").await;
    let stream = enqueue(&c, "orders").await;
    let keyed: i64 = scalar(
        &c,
        "SELECT outbox_enqueue('orders', '{\"n\":2}'::jsonb, key => 'order-7')",
        &[],
    )
    .await;
    heartbeat(&c, "relay-dead", "1 second").await;
    heartbeat(&c, "relay-live", "1 second").await;
    let (dead_token, mut held) = claim(&c, "relay-dead", 10).await;
    held.sort();
    assert_eq!(held, vec![scheduled, stream, keyed]);
    let other = enqueue(&c, "orders").await;
    assert_eq!(claim(&c, "relay-live", 10).await.1, vec![other]);

    // relay-live keeps beating, relay-dead does not: a second later its heartbeat has run out.
    tokio::time::sleep(std::time::Duration::from_millis(600)).await;
    heartbeat(&c, "relay-live", "1 second").await;
    tokio::time::sleep(std::time::Duration::from_millis(600)).await;
    heartbeat(&c, "relay-live", "1 second").await;
    let dead = Some("relay-dead".to_string());
    assert_eq!(
        reclaim_10_minutes(&c).await,
        vec![
            (scheduled, "WAIT".into(), 1, dead.clone()),
            (stream, "WAIT".into(), 1, dead.clone()),
            (keyed, "WAIT".into(), 1, dead.clone()),
        ],
        "the claims of the owner that stopped beating, as one failed attempt each, with a 10-minute lease"
    );
    assert_eq!(
        status_of(&c, other).await,
        ("SENDING".into(), 0, Some("relay-live".into())),
        "a live owner's claim stays its own"
    );
    let err: String = scalar(
        &c,
        "SELECT last_error FROM outbox_event WHERE id = $1",
        &[&stream],
    )
    .await;
    assert!(
        err.starts_with("owner gone: claimed by relay-dead") && err.contains("heartbeat ran out"),
        "{err}"
    );
    // If relay-dead was only slow, its late ack is a no-op: the events are someone else's now.
    let acked: i32 = scalar(
        &c,
        "SELECT outbox_ack('relay-dead', $1, $2)",
        &[&dead_token.unwrap(), &held],
    )
    .await;
    assert_eq!(acked, 0, "a reclaimed claim's ack settles nothing");
    let (_, mut again) = claim(&c, "relay-b", 10).await;
    again.sort();
    assert_eq!(again, held, "due at once for the next claim");
}

#[tokio::test]
async fn a_heartbeat_covers_only_the_claims_made_before_it_ran_out_and_a_new_beat_revives_them() {
    let db = TestDb::create();
    let c = db.connect().await;
    // An owner that said it stops (timeout 0) and then claims: that claim keeps its lease.
    heartbeat(&c, "relay-x", "0 seconds").await;
    let late = enqueue(&c, "orders").await;
    assert_eq!(claim(&c, "relay-x", 10).await.1, vec![late]);
    assert_eq!(reclaim_10_minutes(&c).await, vec![]);
    assert_eq!(
        status_of(&c, late).await,
        ("SENDING".into(), 0, Some("relay-x".into()))
    );
    // It stops again, after the claim: now the claim goes.
    heartbeat(&c, "relay-x", "0 seconds").await;
    assert_eq!(
        reclaim_10_minutes(&c).await,
        vec![(late, "WAIT".into(), 1, Some("relay-x".into()))]
    );

    // An owner whose heartbeat ran out and that beats again before a reclaim: alive, its claim
    // stays.
    heartbeat(&c, "relay-y", "1 second").await;
    let slow = enqueue(&c, "orders").await;
    assert_eq!(claim(&c, "relay-y", 10).await.1, vec![late, slow]);
    tokio::time::sleep(std::time::Duration::from_millis(1200)).await;
    heartbeat(&c, "relay-y", "1 hour").await;
    assert_eq!(reclaim_10_minutes(&c).await, vec![]);
    assert_eq!(
        status_of(&c, late).await,
        ("SENDING".into(), 1, Some("relay-y".into()))
    );
    assert_eq!(
        status_of(&c, slow).await,
        ("SENDING".into(), 0, Some("relay-y".into()))
    );
}

#[tokio::test]
async fn reclaim_forgets_owners_gone_longer_than_the_lease_and_bad_heartbeats_are_refused() {
    let db = TestDb::create();
    let c = db.connect().await;
    heartbeat(&c, "relay-gone", "0 seconds").await;
    heartbeat(&c, "relay-live", "1 hour").await;
    let expires: bool = scalar(
        &c,
        "SELECT outbox_heartbeat('relay-other', '30 seconds') \
         BETWEEN clock_timestamp() + interval '29 seconds' AND clock_timestamp() + interval '30 seconds'",
        &[],
    )
    .await;
    assert!(expires, "the heartbeat returns its expiry");
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    let n: i32 = scalar(&c, "SELECT outbox_reclaim('10 milliseconds')", &[]).await;
    assert_eq!(n, 0);
    let owners: Vec<String> = scalar(
        &c,
        "SELECT array_agg(owner ORDER BY owner) FROM outbox_owner",
        &[],
    )
    .await;
    assert_eq!(owners, vec!["relay-live", "relay-other"]);

    for (sql, needle) in [
        (
            "SELECT outbox_heartbeat('relay-1', '-1 second')",
            "timeout must be",
        ),
        (
            "SELECT outbox_heartbeat('relay-1', NULL)",
            "timeout must be",
        ),
        ("SELECT outbox_heartbeat('', '1 second')", "owner must be"),
        ("SELECT outbox_heartbeat(NULL)", "owner must be"),
    ] {
        outbox_tests::db::rejects(&c, sql, &[], "22023", needle).await;
    }
    let owners: i64 = scalar(&c, "SELECT count(*) FROM outbox_owner", &[]).await;
    assert_eq!(owners, 2, "a refused heartbeat writes nothing");
}

/// A beat that names its last expiry (`previous`) finds out that another process beat as its
/// owner since: 55006, and the other process's beat stays. The newest process keeps the owner.
#[tokio::test]
async fn a_beat_naming_its_last_expiry_finds_another_process_on_its_owner() {
    let db = TestDb::create();
    let c = db.connect().await;
    let beat = "SELECT outbox_heartbeat('relay-1', '30 seconds', $1)";
    let first: std::time::SystemTime = scalar(&c, beat, &[&None::<std::time::SystemTime>]).await;
    let second: std::time::SystemTime = scalar(&c, beat, &[&Some(first)]).await;
    assert!(second > first, "its own beat goes on");

    // Another process starts on the same owner: its first beat takes the owner over.
    let taken: std::time::SystemTime = scalar(&c, beat, &[&None::<std::time::SystemTime>]).await;
    let err = c.query_one(beat, &[&Some(second)]).await.unwrap_err();
    let d = err.as_db_error().expect("a server error");
    assert_eq!(d.code().code(), "55006", "{d:?}");
    assert!(
        d.message()
            .contains("another process beats as owner 'relay-1'"),
        "{}",
        d.message()
    );
    let kept: std::time::SystemTime = scalar(
        &c,
        "SELECT expires_at FROM outbox_owner WHERE owner = 'relay-1'",
        &[],
    )
    .await;
    assert_eq!(
        kept, taken,
        "the refused beat left the other process's beat"
    );
    let _: std::time::SystemTime = scalar(&c, beat, &[&Some(taken)]).await;
}

/// A claimer whose claim's reply was lost releases what it holds under tokens it does not know:
/// scheduled and stream events alike go back to WAIT, no attempt counted, with a last_error that
/// says why; the claims it keeps and other owners' claims stay as they are.
#[tokio::test]
async fn release_orphans_gives_back_only_the_claims_its_owner_does_not_keep() {
    let db = TestDb::create();
    let c = db.connect().await;
    let lost_stream = enqueue(&c, "orders").await;
    let (lost_token, ids) = claim(&c, "relay-a", 10).await;
    assert_eq!(ids, [lost_stream]);
    let lost_scheduled = enqueue_scheduled(&c, "orders").await;
    let (_, ids) = claim(&c, "relay-a", 10).await;
    assert_eq!(ids, [lost_scheduled]);
    let kept = enqueue(&c, "orders").await;
    let (kept_token, ids) = claim(&c, "relay-a", 10).await;
    assert_eq!(ids, [kept]);
    let others = enqueue(&c, "orders").await;
    let (_, ids) = claim(&c, "relay-b", 10).await;
    assert_eq!(ids, [others]);
    assert_ne!(lost_token, kept_token);

    let released: i32 = scalar(
        &c,
        "SELECT outbox_release_orphans('relay-a', ARRAY[$1::bigint])",
        &[&kept_token],
    )
    .await;
    assert_eq!(released, 2);
    for id in [lost_stream, lost_scheduled] {
        assert_eq!(
            status_of(&c, id).await,
            ("WAIT".into(), 0, None),
            "event {id}"
        );
        let error: Option<String> = scalar(
            &c,
            "SELECT last_error FROM outbox_event WHERE id = $1",
            &[&id],
        )
        .await;
        assert!(
            error.is_some_and(|e| e.starts_with("orphaned")),
            "event {id}"
        );
    }
    assert_eq!(
        status_of(&c, kept).await,
        ("SENDING".into(), 0, Some("relay-a".into()))
    );
    assert_eq!(
        status_of(&c, others).await,
        ("SENDING".into(), 0, Some("relay-b".into()))
    );
    let again: i32 = scalar(
        &c,
        "SELECT outbox_release_orphans('relay-a', ARRAY[$1::bigint])",
        &[&kept_token],
    )
    .await;
    assert_eq!(again, 0, "nothing left to release");
    let (_, ids) = claim(&c, "relay-c", 10).await;
    assert_eq!(
        ids,
        [lost_stream, lost_scheduled],
        "the released events are claimable"
    );
}

/// Claims of an idle outbox write no row: no cursor version, no batch, no key row, nothing
/// scheduled (only the token sequence logs WAL, once in 32 draws). After a delivered event and a
/// few empty claims, a hundred more leave every row as it was, versions and xmins alike.
#[tokio::test]
async fn claims_of_an_idle_outbox_write_no_row() {
    let db = TestDb::create();
    let c = db.connect().await;
    let id = enqueue(&c, "orders").await;
    let (token, ids) = claim(&c, "r", 10).await;
    assert_eq!(ids, vec![id]);
    let acked: i32 = scalar(
        &c,
        "SELECT outbox_ack('r', $1, $2)",
        &[&token.expect("token"), &ids],
    )
    .await;
    assert_eq!(acked, 1);
    for _ in 0..3 {
        assert!(claim(&c, "r", 10).await.1.is_empty());
    }
    let rows =
        "SELECT (SELECT string_agg(v.version || ':' || v.xmin::text, ',' ORDER BY v.version) \
                          FROM outbox_stream_cursor v) \
                || ' batches ' || (SELECT count(*) FROM outbox_stream_batch) \
                || ' keys ' || (SELECT count(*) FROM outbox_key) \
                || ' scheduled ' || (SELECT count(*) FROM outbox_scheduled)";
    let before: String = scalar(&c, rows, &[]).await;
    for _ in 0..100 {
        assert!(claim(&c, "r", 10).await.1.is_empty());
    }
    let after: String = scalar(&c, rows, &[]).await;
    assert_eq!(after, before, "an empty claim wrote a row");
}
