//! pg_dump / pg_restore keeps the outbox: a restored order database still publishes what it owed,
//! keeps issuing ids and fencing tokens above the ones it held, and never reissues an event_id,
//! even when it is restored to a state older than events already published; a consumer's inbox
//! keeps refusing the events it applied.

use std::process::Command;

use outbox_tests::build;
use outbox_tests::db::{psql_admin, scalar, TestDb};

/// `pg_dump -Fc` of the source database into a temporary file.
fn dump(source: &TestDb) -> std::path::PathBuf {
    let file = std::env::temp_dir().join(format!("{}.dump", source.name));
    let out = Command::new("pg_dump")
        .args(["-Fc", "-f"])
        .arg(&file)
        .arg(source.url())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "pg_dump: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    file
}

/// `pg_restore` of that file into a new database `<source>_restored` (the file is removed).
fn restore(source: &TestDb, file: &std::path::Path, single_transaction: bool) -> TestDb {
    let target = TestDb {
        name: format!("{}_restored", source.name),
        server: source.server.clone(),
    };
    psql_admin(&format!("CREATE DATABASE {}", target.name));
    let mut restore = Command::new("pg_restore");
    restore.arg("--exit-on-error");
    if single_transaction {
        restore.arg("--single-transaction");
    }
    let out = restore
        .arg("-d")
        .arg(target.url())
        .arg(file)
        .output()
        .unwrap();
    let _ = std::fs::remove_file(file);
    assert!(
        out.status.success(),
        "pg_restore: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    target
}

#[tokio::test]
async fn dump_and_restore_keep_owed_events_and_sequences() {
    let source = TestDb::create();
    let c = source.connect().await;
    // Events due a moment later: scheduled rows, whose status can be set by hand.
    c.batch_execute(
        "SELECT outbox_enqueue('orders', jsonb_build_object('n', g), key => 'k' || g,
                               deliver_at => clock_timestamp() + interval '100 milliseconds')
           FROM generate_series(1, 5) g",
    )
    .await
    .unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(150)).await;
    c.batch_execute(
        "SELECT * FROM outbox_claim('relay-a', 2);
         UPDATE outbox_scheduled SET status = 'FAIL' WHERE id = 5;",
    )
    .await
    .unwrap();
    let snapshot = "SELECT string_agg(format('%s|%s|%s|%s|%s|%s', id, status, payload, event_key, claim_token, event_id), ';' ORDER BY id) \
                    FROM outbox_event";
    let before: String = scalar(&c, snapshot, &[]).await;
    let max_token: i64 = scalar(&c, "SELECT max(claim_token) FROM outbox_event", &[]).await;

    let file = dump(&source);

    // After the dump the source goes on publishing; the restore then rewinds to the dump, as a
    // point-in-time recovery would. Consumers have already seen these event_ids.
    c.batch_execute("SELECT outbox_enqueue('orders', '{}') FROM generate_series(1, 3)")
        .await
        .unwrap();
    let published_after_dump: Vec<String> = c
        .query("SELECT event_id::text FROM outbox_event WHERE id > 5", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();

    let target = restore(&source, &file, false);

    let r = target.connect().await;
    let after: String = scalar(&r, snapshot, &[]).await;
    assert_eq!(after, before, "every outbox row survives the round trip");
    let new_id: i64 = scalar(&r, "SELECT outbox_enqueue('orders', '{}')", &[]).await;
    assert!(
        new_id > 5,
        "ids continue after the restored ones, got {new_id}"
    );
    let new_event_id: String = scalar(
        &r,
        "SELECT event_id::text FROM outbox_event WHERE id = $1",
        &[&new_id],
    )
    .await;
    assert!(
        !published_after_dump.contains(&new_event_id),
        "the restored database reissued event_id {new_event_id} (outbox_id {new_id})"
    );
    let claimed = r
        .query(
            "SELECT id, claim_token FROM outbox_claim('relay-b', 10)",
            &[],
        )
        .await
        .unwrap();
    let ids: Vec<i64> = claimed.iter().map(|row| row.get(0)).collect();
    assert_eq!(
        ids,
        vec![3, 4, new_id],
        "the restored database still owes events 3 and 4"
    );
    assert!(
        claimed[0].get::<_, i64>(1) > max_token,
        "fencing tokens are never reissued"
    );
}

/// Unkeyed events live in the append-only stream. The native build does not dump its cursor (its
/// snapshots mean nothing to another cluster): the dump carries the stream events still owed, and
/// the restored database hands each of them out again, with a fresh cursor, whether pg_restore
/// runs one transaction per object or a single one. The SQL-only build dumps every row, the
/// cursor included, and a restore in the same cluster goes on where the dump was.
#[tokio::test]
async fn stream_events_still_owed_survive_a_restore() {
    for single_transaction in [false, true] {
        let source = TestDb::create();
        let c = source.connect().await;
        // 1, 2 delivered; 3 released (a scheduled copy, due now); 4 held by a claim; 5, 6 waiting.
        c.batch_execute("SELECT outbox_enqueue('orders', jsonb_build_object('n', g)) FROM generate_series(1, 6) g")
            .await
            .unwrap();
        let token: i64 = scalar(
            &c,
            "SELECT max(claim_token) FROM outbox_claim('relay-a', 4)",
            &[],
        )
        .await;
        let acked: i32 = scalar(&c, "SELECT outbox_ack('relay-a', $1, '{1,2}')", &[&token]).await;
        assert_eq!(acked, 2);
        let released: i32 =
            scalar(&c, "SELECT outbox_release('relay-a', $1, '{3}')", &[&token]).await;
        assert_eq!(released, 1);
        let owed = "SELECT string_agg(format('%s|%s|%s', id, status, event_id), ';' ORDER BY id) \
                    FROM outbox_event WHERE status <> 'SUCCESS'";
        let before: String = scalar(&c, owed, &[]).await;

        let file = dump(&source);
        let target = restore(&source, &file, single_transaction);

        let r = target.connect().await;
        let after: String = scalar(&r, owed, &[]).await;
        let history: i64 = scalar(
            &r,
            "SELECT count(*) FROM outbox_event WHERE id IN (1, 2)",
            &[],
        )
        .await;
        let fresh: i64 = scalar(&r, "SELECT outbox_enqueue('orders', '{}')", &[]).await;
        let claimed: Vec<i64> = r
            .query("SELECT id FROM outbox_claim('relay-b', 10)", &[])
            .await
            .unwrap()
            .iter()
            .map(|row| row.get(0))
            .collect();
        let how = format!("single transaction: {single_transaction}");
        if build::sql_only() {
            // Ordinary tables: every row is dumped, the cursor and the claims with them, and
            // the restore (same cluster) goes on where the dump was: 4 is still relay-a's.
            assert_eq!(after, before, "{how}");
            assert_eq!(history, 2, "the delivered history is dumped too");
            assert_eq!(claimed, vec![3, 5, 6, fresh], "{how}");
            let acked: i32 = scalar(&r, "SELECT outbox_ack('relay-a', $1, '{4}')", &[&token]).await;
            assert_eq!(
                acked, 1,
                "the claim restored with the dump is still its relay's"
            );
        } else {
            // The held event comes back waiting (its claim was not dumped): delivered again,
            // at least once.
            assert_eq!(after, before.replace("|SENDING|", "|WAIT|"), "{how}");
            assert_eq!(history, 0, "the stream's delivered history is not dumped");
            assert_eq!(
                claimed,
                vec![3, 4, 5, 6, fresh],
                "every owed event and the new one, once ({how})"
            );
        }
        let again = r
            .query("SELECT id FROM outbox_claim('relay-b', 10)", &[])
            .await
            .unwrap();
        assert!(again.is_empty(), "nothing is handed out twice");
    }
}

/// The SQL-only build's pg_dump carries the stream's cursor (its tables are ordinary tables).
/// Restored into another cluster whose transaction ids are behind, its snapshots would count every
/// new event as handed out. Simulated here by moving the cursor and the stream's txids a billion
/// transactions ahead: the next claim notices, and every event owed (waiting, held, or enqueued
/// after the restore) is delivered, none twice; the held claim can still be acked.
#[tokio::test]
async fn a_cursor_ahead_of_the_cluster_is_rebased_without_losing_events() {
    let db = TestDb::create();
    let c = db.connect().await;
    let ids =
        |rows: Vec<tokio_postgres::Row>| -> Vec<i64> { rows.iter().map(|r| r.get(0)).collect() };
    c.batch_execute(
        "SELECT outbox_enqueue('orders', jsonb_build_object('n', g)) FROM generate_series(1, 4) g",
    )
    .await
    .unwrap();
    let token: i64 = scalar(
        &c,
        "SELECT max(claim_token) FROM outbox_claim('relay-a', 2)",
        &[],
    )
    .await;
    let acked: i32 = scalar(&c, "SELECT outbox_ack('relay-a', $1, '{1}')", &[&token]).await;
    assert_eq!(acked, 1);
    c.batch_execute(
        "CREATE FUNCTION pg_temp.ahead(s pg_snapshot) RETURNS pg_snapshot LANGUAGE sql AS $$
             SELECT format('%s:%s:%s', pg_snapshot_xmin(s)::text::bigint + 1000000000,
                           pg_snapshot_xmax(s)::text::bigint + 1000000000,
                           coalesce((SELECT string_agg((x::text::bigint + 1000000000)::text, ',' ORDER BY x)
                                       FROM pg_snapshot_xip(s) x), ''))::pg_snapshot $$;
         UPDATE outbox_stream SET txid = (txid::text::bigint + 1000000000)::text::xid8;
         UPDATE outbox_stream_cursor
            SET prev_snap = pg_temp.ahead(prev_snap), cur_snap = pg_temp.ahead(cur_snap);",
    )
    .await
    .unwrap();
    let fresh: i64 = scalar(&c, "SELECT outbox_enqueue('orders', '{}')", &[]).await;
    assert_eq!(fresh, 5);
    // The claim that notices rebases; the owed events are scheduled rows from then on.
    let first = ids(c
        .query("SELECT id FROM outbox_claim('relay-b', 10)", &[])
        .await
        .unwrap());
    let second = ids(c
        .query("SELECT id FROM outbox_claim('relay-b', 10)", &[])
        .await
        .unwrap());
    let mut delivered: Vec<i64> = first.iter().chain(&second).copied().collect();
    delivered.sort();
    assert_eq!(delivered, vec![3, 4, 5], "waiting and new events, once");
    let acked: i32 = scalar(&c, "SELECT outbox_ack('relay-a', $1, '{2}')", &[&token]).await;
    assert_eq!(
        acked, 1,
        "the claim held across the rebase is still its relay's to ack"
    );
    let again = c
        .query("SELECT id FROM outbox_claim('relay-b', 10)", &[])
        .await
        .unwrap();
    assert!(again.is_empty(), "nothing is handed out twice");
    // The fresh cursor goes on.
    let next: i64 = scalar(&c, "SELECT outbox_enqueue('orders', '{}')", &[]).await;
    let got = ids(c
        .query("SELECT id FROM outbox_claim('relay-b', 10)", &[])
        .await
        .unwrap());
    assert_eq!(got, vec![next]);
}

/// The consumer's inbox (docs/inbox.md) is in the dump: a restored consumer database still says
/// false for the events it applied before the dump, and true for new ones.
#[tokio::test]
async fn a_restored_inbox_still_refuses_the_events_it_applied() {
    let source = TestDb::create();
    let c = source.connect().await;
    let accept = "SELECT outbox_inbox_accept(current_user, $1::text::uuid)";
    let applied: String = scalar(&c, "SELECT gen_random_uuid()::text", &[]).await;
    assert!(scalar::<bool>(&c, accept, &[&applied]).await);
    let target = restore(&source, &dump(&source), false);
    let r = target.connect().await;
    assert!(
        !scalar::<bool>(&r, accept, &[&applied]).await,
        "the restored inbox holds the event"
    );
    let new: String = scalar(&r, "SELECT gen_random_uuid()::text", &[]).await;
    assert!(scalar::<bool>(&r, accept, &[&new]).await);
}
