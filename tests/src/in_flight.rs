//! Events in flight across an upgrade (sql_upgrade for the native build, sql_only for the SQL-only
//! one): six keyed events claimed by one relay before the update, settled and drained in key
//! order by the updated code.

use tokio_postgres::Client;

use crate::db::scalar;

/// Enqueues six events of three keys (k1: 1 4, k2: 2 5, k0: 3 6) and claims `held` of them as
/// 'relay-a' (a claim takes whole runs per key: 6 claims all six); returns the claim's token.
pub async fn enqueue_and_claim(c: &Client, held: i32) -> i64 {
    c.batch_execute(
        "SELECT outbox_enqueue('orders', jsonb_build_object('n', g), key => 'k' || (g % 3)) \
         FROM generate_series(1, 6) g",
    )
    .await
    .unwrap();
    scalar(
        c,
        "SELECT max(claim_token) FROM outbox_claim('relay-a', $1)",
        &[&held],
    )
    .await
}

/// After the update: 'relay-a' still holds its claim of all six and settles it (ack 1 2, nack 3,
/// renew and ack 4, ack 5 and release 6, which comes after the failed 3 in its key). Then
/// 'relay-b' drains the rest in key order: 6 waits for 3 while 3 backs off, then k0's run comes
/// as [3, 6], and all six end SUCCESS.
pub async fn settle_and_drain(c: &Client, token: i64) {
    let settle = |sql: &'static str| async move { scalar::<i32>(c, sql, &[&token]).await };
    assert_eq!(settle("SELECT outbox_ack('relay-a', $1, '{1,2}')").await, 2);
    assert_eq!(
        settle("SELECT outbox_nack('relay-a', $1, '{3}', 'x')").await,
        1
    );
    assert_eq!(settle("SELECT outbox_renew('relay-a', $1, '{4}')").await, 1);
    assert_eq!(settle("SELECT outbox_ack('relay-a', $1, '{4}')").await, 1);
    assert_eq!(settle("SELECT outbox_ack('relay-a', $1, '{5}')").await, 1);
    assert_eq!(
        settle("SELECT outbox_release('relay-a', $1, '{6}', '0', 'held back')").await,
        1
    );

    let claim = || async move {
        let rows = c
            .query(
                "SELECT id, claim_token FROM outbox_claim('relay-b', 10)",
                &[],
            )
            .await
            .unwrap();
        let ids: Vec<i64> = rows.iter().map(|r| r.get(0)).collect();
        (ids, rows.first().map(|r| r.get::<_, i64>(1)))
    };
    let ack = |ids: Vec<i64>, token: Option<i64>| async move {
        let n: i32 = scalar(c, "SELECT outbox_ack('relay-b', $1, $2)", &[&token, &ids]).await;
        assert_eq!(n as usize, ids.len());
    };
    let (ids, _) = claim().await;
    assert!(
        ids.is_empty(),
        "event 6 waits for 3, the head of its key: {ids:?}"
    );
    // The backoff ends now (for the event and for its key's next look). Keyed events on an
    // ordered topic are scheduled rows.
    c.batch_execute(
        "UPDATE outbox_scheduled SET next_retry_time = now() WHERE status = 'WAIT'; \
         UPDATE outbox_key SET state = 'waiting', due_at = now()",
    )
    .await
    .unwrap();
    let (ids, token) = claim().await;
    assert_eq!(ids, vec![3, 6], "k0's run, in commit order");
    ack(ids, token).await;
    let success: i64 = scalar(
        c,
        "SELECT count(*) FROM outbox_event WHERE status = 'SUCCESS'",
        &[],
    )
    .await;
    assert_eq!(success, 6);
}
