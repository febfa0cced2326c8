//! The upgrade chain (sql/outbox--A--B.sql): a database on the first release with events in
//! flight is updated with `ALTER EXTENSION outbox UPDATE`, the relay's held claims still settle,
//! everything drains, and the updated catalog is exactly what a fresh install creates.
//! Every schema change adds its step to the chain, and this test starts from every earlier
//! release. A relay role's grants carry over to the functions a new relay calls.

use std::collections::BTreeMap;

use outbox_tests::build;
use outbox_tests::db::{batch_floor, psql_admin, scalar, TestDb};
use outbox_tests::in_flight;
use tokio_postgres::Client;

const CURRENT: &str = env!("CARGO_PKG_VERSION");

/// The extension's tables and views (its members in pg_class, sequences aside): their columns,
/// indexes, options, view definitions and triggers are compared.
const EXT_RELS: &str =
    "SELECT c.oid FROM pg_class c JOIN pg_depend d ON d.classid = 'pg_class'::regclass \
     AND d.objid = c.oid AND d.deptype = 'e' \
     JOIN pg_extension x ON x.oid = d.refobjid AND x.extname = 'outbox' \
     WHERE c.relkind IN ('r', 'p', 'v')";

/// Everything the extension defines, as text keyed by object, for comparing two databases.
async fn catalog(c: &Client) -> BTreeMap<String, String> {
    let queries = [
        // Functions with their whole definition (body, volatility, SET clauses) and grants.
        "SELECT 'function ' || p.oid::regprocedure::text, \
                pg_get_functiondef(p.oid) || coalesce(p.proacl::text, '') \
           FROM pg_proc p JOIN pg_depend d ON d.classid = 'pg_proc'::regclass AND d.objid = p.oid \
           JOIN pg_extension x ON x.oid = d.refobjid AND d.deptype = 'e' AND x.extname = 'outbox'",
        "WITH ext_rel AS ({EXT_RELS}) \
         SELECT 'column ' || a.attrelid::regclass::text || ' ' || a.attnum || ' ' || a.attname, \
                format_type(a.atttypid, a.atttypmod) || ' notnull=' || a.attnotnull \
                || ' default=' || coalesce(pg_get_expr(ad.adbin, ad.adrelid), '') \
           FROM pg_attribute a LEFT JOIN pg_attrdef ad ON ad.adrelid = a.attrelid AND ad.adnum = a.attnum \
          WHERE a.attrelid IN (SELECT oid FROM ext_rel) AND a.attnum > 0 AND NOT a.attisdropped",
        "WITH ext_rel AS ({EXT_RELS}) \
         SELECT 'index ' || c.relname, pg_get_indexdef(c.oid) \
           FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid \
          WHERE i.indrelid IN (SELECT oid FROM ext_rel)",
        "WITH ext_rel AS ({EXT_RELS}) \
         SELECT 'table options ' || relname, 'kind=' || relkind::text || ' ' || coalesce(array_to_string(reloptions, ','), '') \
                || ' acl=' || coalesce(relacl::text, '') \
           FROM pg_class WHERE oid IN (SELECT oid FROM ext_rel)",
        "WITH ext_rel AS ({EXT_RELS}) \
         SELECT 'view ' || c.relname, pg_get_viewdef(c.oid) \
           FROM pg_class c WHERE c.oid IN (SELECT oid FROM ext_rel) AND c.relkind = 'v'",
        "WITH ext_rel AS ({EXT_RELS}) \
         SELECT 'trigger ' || t.tgrelid::regclass::text || ' ' || t.tgname, pg_get_triggerdef(t.oid) \
           FROM pg_trigger t WHERE t.tgrelid IN (SELECT oid FROM ext_rel) AND NOT t.tgisinternal",
        "SELECT 'type ' || t.typname, string_agg(e.enumlabel, ',' ORDER BY e.enumsortorder) \
           FROM pg_type t JOIN pg_enum e ON e.enumtypid = t.oid \
          WHERE t.typname = 'outbox_status' GROUP BY t.typname",
        "SELECT 'dumped with pg_dump', array_to_string(ARRAY(SELECT c::regclass::text FROM unnest(extconfig) c ORDER BY 1), ',') \
           FROM pg_extension WHERE extname = 'outbox'",
        "SELECT 'dumped with pg_dump: ' || u.rel::regclass::text, u.cond \
           FROM pg_extension x, unnest(x.extconfig, x.extcondition) AS u(rel, cond) \
          WHERE x.extname = 'outbox'",
    ];
    let mut out = BTreeMap::new();
    for q in queries {
        let q = q.replace("{EXT_RELS}", EXT_RELS);
        for row in c
            .query(&q, &[])
            .await
            .unwrap_or_else(|e| panic!("{q}: {e:?}"))
        {
            out.insert(row.get(0), row.get(1));
        }
    }
    out
}

#[tokio::test]
async fn update_from_0_1_0_with_events_in_flight() {
    update_with_events_in_flight("0.1.0").await;
}

#[tokio::test]
async fn update_from_0_2_0_with_events_in_flight() {
    update_with_events_in_flight("0.2.0").await;
}

#[tokio::test]
async fn update_from_0_3_0_with_events_in_flight() {
    update_with_events_in_flight("0.3.0").await;
}

#[tokio::test]
async fn update_from_0_4_0_with_events_in_flight() {
    update_with_events_in_flight("0.4.0").await;
}

#[tokio::test]
async fn update_from_0_5_0_with_events_in_flight() {
    update_with_events_in_flight("0.5.0").await;
}

#[tokio::test]
async fn update_from_0_6_0_with_events_in_flight() {
    update_with_events_in_flight("0.6.0").await;
}

#[tokio::test]
async fn update_from_0_7_0_with_events_in_flight() {
    update_with_events_in_flight("0.7.0").await;
}

#[tokio::test]
async fn update_from_0_8_0_with_events_in_flight() {
    update_with_events_in_flight("0.8.0").await;
}

#[tokio::test]
async fn update_from_0_9_0_with_events_in_flight() {
    update_with_events_in_flight("0.9.0").await;
}

#[tokio::test]
async fn update_from_0_10_0_with_events_in_flight() {
    update_with_events_in_flight("0.10.0").await;
}

#[tokio::test]
async fn update_from_0_11_0_with_events_in_flight() {
    update_with_events_in_flight("0.11.0").await;
}

#[tokio::test]
async fn update_from_0_12_0_with_events_in_flight() {
    update_with_events_in_flight("0.12.0").await;
}

#[tokio::test]
async fn update_from_0_13_0_with_events_in_flight() {
    update_with_events_in_flight("0.13.0").await;
}

#[tokio::test]
async fn update_from_0_7_0_with_keyed_stream_events_waiting() {
    update_with_keyed_stream_events_waiting("0.7.0").await;
}

#[tokio::test]
async fn update_from_0_8_0_with_keyed_stream_events_waiting() {
    update_with_keyed_stream_events_waiting("0.8.0").await;
}

#[tokio::test]
async fn update_from_0_9_0_with_keyed_stream_events_waiting() {
    update_with_keyed_stream_events_waiting("0.9.0").await;
}

#[tokio::test]
async fn update_from_0_10_0_with_keyed_stream_events_waiting() {
    update_with_keyed_stream_events_waiting("0.10.0").await;
}

#[tokio::test]
async fn update_from_0_11_0_with_keyed_stream_events_waiting() {
    update_with_keyed_stream_events_waiting("0.11.0").await;
}

#[tokio::test]
async fn update_from_0_12_0_with_keyed_stream_events_waiting() {
    update_with_keyed_stream_events_waiting("0.12.0").await;
}

#[tokio::test]
async fn update_from_0_13_0_with_keyed_stream_events_waiting() {
    update_with_keyed_stream_events_waiting("0.13.0").await;
}

/// Ordered events enqueued by 0.13.0 carry no bound on their key's earlier events (0.14.0 dropped
/// the stream's index by key and reads the owed events up to such a bound instead): a late stream
/// event (its transaction drew its txid before an earlier event of its key committed) and a
/// tracked event due later, each behind an earlier event of its key still in the stream. After
/// the update both still go out after that earlier event, one event per claim.
#[tokio::test]
async fn update_from_0_13_0_keeps_the_key_order_of_events_enqueued_before_it() {
    if build::sql_only() {
        println!("skipped: this tree cannot make a SQL-only 0.13.0 install to update from");
        return;
    }
    let db = TestDb::empty();
    let c = db.connect().await;
    c.batch_execute("CREATE EXTENSION outbox VERSION '0.13.0'")
        .await
        .unwrap();
    async fn enqueue(c: &Client, key: &str) -> i64 {
        scalar::<i64>(
            c,
            "SELECT outbox_enqueue('orders', '{}', key => $1)",
            &[&key],
        )
        .await
    }
    // Key a: the later commit has the lower txid, so the walk meets it first.
    let started_first = db.connect().await;
    started_first
        .batch_execute("BEGIN; SELECT pg_current_xact_id()")
        .await
        .unwrap();
    let a_first = enqueue(&c, "a").await;
    let a_second = enqueue(&started_first, "a").await;
    started_first.batch_execute("COMMIT").await.unwrap();
    // Key b: an event in the stream, then one due a moment later, a tracked row.
    let b_first = enqueue(&c, "b").await;
    let b_later: i64 = scalar(
        &c,
        "SELECT outbox_enqueue('orders', '{}', key => 'b', deliver_at => clock_timestamp() + interval '100 milliseconds')",
        &[],
    )
    .await;
    let marked: Vec<(i64, Option<bool>)> = c
        .query("SELECT id, late FROM outbox_stream ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        marked,
        [
            (a_first, Some(false)),
            (a_second, Some(true)),
            (b_first, Some(false))
        ],
        "the case under test: a late event of key a"
    );

    c.batch_execute("ALTER EXTENSION outbox UPDATE")
        .await
        .unwrap();
    let unbounded: i64 = scalar(
        &c,
        "SELECT (SELECT count(*) FROM outbox_stream WHERE late_bound IS NULL) \
              + (SELECT count(*) FROM outbox_tracked WHERE stream_bound IS NULL)",
        &[],
    )
    .await;
    assert_eq!(unbounded, 4, "rows from before the update have no bound");
    tokio::time::sleep(std::time::Duration::from_millis(150)).await;
    let mut arrived = Vec::new();
    for _ in 0..6 {
        let rows = c
            .query(
                "SELECT id, claim_token FROM outbox_claim('relay-a', 1)",
                &[],
            )
            .await
            .unwrap();
        let ids: Vec<i64> = rows.iter().map(|r| r.get(0)).collect();
        if let Some(token) = rows.first().map(|r| r.get::<_, i64>(1)) {
            let n: i32 = scalar(&c, "SELECT outbox_ack('relay-a', $1, $2)", &[&token, &ids]).await;
            assert_eq!(n as usize, ids.len());
        }
        arrived.extend(ids);
    }
    let of = |key: &[i64]| -> Vec<i64> {
        arrived
            .iter()
            .copied()
            .filter(|id| key.contains(id))
            .collect()
    };
    assert_eq!(
        of(&[a_first, a_second]),
        [a_first, a_second],
        "key a in commit order: {arrived:?}"
    );
    assert_eq!(
        of(&[b_first, b_later]),
        [b_first, b_later],
        "key b in commit order: {arrived:?}"
    );
    assert_eq!(arrived.len(), 4, "each event once: {arrived:?}");
}

/// Keyed events in the stream across the update: a claim holds the first event of two keys, after
/// claims settled before it, and the rest wait in the stream (from 0.7.0 with no late mark: NULL,
/// which the claim reads as late). After the update the floor of the stream's batches is at or
/// below the held claim (0 from 0.7.0 and 0.8.0, kept from 0.9.0 on), whose keys stay busy; it
/// settles, the rest go out in key order, the floor follows the unsettled claim, and a fresh keyed
/// event is marked.
async fn update_with_keyed_stream_events_waiting(from: &str) {
    if build::sql_only() {
        println!("skipped: this tree cannot make a SQL-only {from} install to update from");
        return;
    }
    let db = TestDb::empty();
    let c = db.connect().await;
    c.batch_execute(&format!("CREATE EXTENSION outbox VERSION '{from}'"))
        .await
        .unwrap();
    let enqueue = |key: &'static str| {
        let c = &c;
        async move {
            scalar::<i64>(
                c,
                "SELECT outbox_enqueue('orders', '{}', key => $1)",
                &[&key],
            )
            .await
        }
    };
    let claim = |owner: &'static str, max: i32| {
        let c = &c;
        async move {
            let rows = c
                .query(
                    "SELECT id, claim_token FROM outbox_claim($1, $2)",
                    &[&owner, &max],
                )
                .await
                .unwrap();
            let ids: Vec<i64> = rows.iter().map(|r| r.get(0)).collect();
            (ids, rows.first().map(|r| r.get::<_, i64>(1)))
        }
    };
    let ack = |owner: &'static str, token: Option<i64>, ids: Vec<i64>| {
        let c = &c;
        async move {
            let n: i32 = scalar(c, "SELECT outbox_ack($1, $2, $3)", &[&owner, &token, &ids]).await;
            assert_eq!(n as usize, ids.len(), "{owner} acks {ids:?}");
        }
    };
    // Settled claims before the held one: their batch rows are gone.
    for key in ["a", "b"] {
        let id = enqueue(key).await;
        let (ids, token) = claim("relay-w", 10).await;
        assert_eq!(ids, [id]);
        ack("relay-w", token, ids).await;
    }
    let mut by_key: BTreeMap<&str, Vec<i64>> = BTreeMap::new();
    for key in ["a", "b", "a", "b", "a"] {
        by_key.entry(key).or_default().push(enqueue(key).await);
    }
    let (held, token_x) = claim("relay-x", 2).await;
    assert_eq!(held, [by_key["a"][0], by_key["b"][0]]);

    c.batch_execute("ALTER EXTENSION outbox UPDATE")
        .await
        .unwrap();
    if from == "0.7.0" {
        let unmarked: i64 = scalar(
            &c,
            "SELECT count(*) FROM outbox_stream WHERE late IS NULL",
            &[],
        )
        .await;
        assert_eq!(unmarked, 7, "rows from before the update have no mark");
    }
    let floor = batch_floor(&c).await;
    if matches!(from, "0.7.0" | "0.8.0") {
        assert_eq!(floor, 0, "the update's floor is below every batch");
    } else {
        let held_token = token_x.unwrap();
        assert!(
            floor <= held_token,
            "the floor kept across the update ({floor}) is at or below the held claim ({held_token})"
        );
    }

    let (ids, _) = claim("relay-y", 10).await;
    assert!(
        ids.is_empty(),
        "keys a and b are held by relay-x's claim: {ids:?}"
    );
    ack("relay-x", token_x, held.clone()).await;
    let mut arrived = held;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while arrived.len() < 5 {
        assert!(
            std::time::Instant::now() < deadline,
            "only {arrived:?} went out"
        );
        let (ids, token) = claim("relay-y", 10).await;
        if ids.is_empty() {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            continue;
        }
        ack("relay-y", token, ids.clone()).await;
        arrived.extend(ids);
    }
    for (key, want) in &by_key {
        let got: Vec<i64> = arrived
            .iter()
            .copied()
            .filter(|id| want.contains(id))
            .collect();
        assert_eq!(&got, want, "key {key} in commit order");
    }
    let success: i64 = scalar(
        &c,
        "SELECT count(*) FROM outbox_event WHERE status = 'SUCCESS'",
        &[],
    )
    .await;
    assert_eq!(success, 7);

    // A fresh event of an idle key (a and b keep their key rows until a claim finds them idle) on
    // the updated database: its own insert drew its transaction's txid, so it is not late.
    let fresh = enqueue("c").await;
    let late: Option<bool> = scalar(
        &c,
        "SELECT late FROM outbox_stream WHERE id = $1",
        &[&fresh],
    )
    .await;
    assert_eq!(late, Some(false));
    let (ids, token) = claim("relay-y", 10).await;
    assert_eq!(ids, [fresh]);
    // The rest went out as tracked rows (their keys were busy): this is the first stream batch
    // since the update, and its claim moves the floor up to it.
    assert_eq!(
        Some(batch_floor(&c).await),
        token,
        "relay-y's claim is the only unsettled one"
    );
    ack("relay-y", token, ids).await;
}

/// A role granted calls of an earlier release (nack, reclaim, stats, requeue, claim, dead letters);
/// dropped on drop.
struct OldRelayRole(String);

impl Drop for OldRelayRole {
    fn drop(&mut self) {
        psql_admin(&format!("DROP ROLE IF EXISTS {}", self.0));
    }
}

async fn update_with_events_in_flight(from: &str) {
    if build::sql_only() {
        // The SQL-only build starts at 0.5.0 (scripts/sql-only, FIRST_SQL_ONLY), and this tree
        // generates only the current install script: there is no SQL-only {from} to start from.
        // tests/tests/sql_only.rs applies this tree's steps to a SQL-only database.
        println!("skipped: this tree cannot make a SQL-only {from} install to update from");
        return;
    }
    let db = TestDb::empty();
    let role = OldRelayRole(format!(
        "outbox_old_relay_{}",
        db.name.trim_start_matches("outbox_test_")
    ));
    let c = db.connect().await;
    c.batch_execute(&format!("CREATE EXTENSION outbox VERSION '{from}'"))
        .await
        .unwrap();
    // What that release's recipe (sql/examples/grant-roles.sql) granted: 0.3.0 added the
    // _returning forms, which the 0.2.0 -> 0.3.0 step grants to whoever could nack and reclaim;
    // 0.4.0 the operator's blocked_keys and skip; 0.5.0 the wake-up and the bulk enqueue; 0.6.0 to
    // 0.12.0 the same as 0.5.0; 0.13.0 the heartbeat and the relays' list.
    let returning = match from {
        "0.3.0" => {
            ", outbox_nack_returning(text, bigint, bigint[], text), outbox_reclaim_returning(interval)"
        }
        "0.4.0" => {
            ", outbox_nack_returning(text, bigint, bigint[], text), outbox_reclaim_returning(interval), \
             outbox_blocked_keys(int), outbox_skip(bigint[])"
        }
        "0.5.0" | "0.6.0" | "0.7.0" | "0.8.0" | "0.9.0" | "0.10.0" | "0.11.0" | "0.12.0" => {
            ", outbox_nack_returning(text, bigint, bigint[], text), outbox_reclaim_returning(interval), \
             outbox_blocked_keys(int), outbox_skip(bigint[]), outbox_wait(interval), outbox_wake_mode(), \
             outbox_enqueue_many(text, jsonb[], text[], text[], jsonb[], timestamptz)"
        }
        "0.13.0" => {
            ", outbox_nack_returning(text, bigint, bigint[], text), outbox_reclaim_returning(interval), \
             outbox_blocked_keys(int), outbox_skip(bigint[]), outbox_wait(interval), outbox_wake_mode(), \
             outbox_enqueue_many(text, jsonb[], text[], text[], jsonb[], timestamptz), \
             outbox_heartbeat(text, interval), outbox_owners(int)"
        }
        _ => "",
    };
    c.batch_execute(&format!(
        "CREATE ROLE {0} NOLOGIN; GRANT EXECUTE ON FUNCTION outbox_nack(text, bigint, bigint[], text), \
         outbox_reclaim(interval), outbox_stats(), outbox_requeue(bigint[]), outbox_claim(text, int), \
         outbox_dead_letters(int, bigint), outbox_enqueue(text, jsonb, text, text, jsonb, timestamptz){returning} \
         TO {0}",
        role.0
    ))
    .await
    .unwrap();
    // Since 0.4.0 a claim takes whole runs per key: all six.
    let per_key = !matches!(from, "0.1.0" | "0.2.0" | "0.3.0");
    let token = in_flight::enqueue_and_claim(&c, if per_key { 6 } else { 4 }).await;

    c.batch_execute("ALTER EXTENSION outbox UPDATE")
        .await
        .unwrap();
    let version: String = scalar(
        &c,
        "SELECT extversion FROM pg_extension WHERE extname = 'outbox'",
        &[],
    )
    .await;
    assert_eq!(version, CURRENT);
    // outbox_claim and outbox_dead_letters are dropped and created anew by 0.6.0 -> 0.7.0, which
    // replays their grants: the role keeps them from every release. 0.12.0 -> 0.13.0 grants the
    // heartbeat to whoever may claim, and outbox_owners to whoever may list blocked keys.
    for f in [
        "outbox_claim(text, integer)",
        "outbox_dead_letters(integer, bigint)",
        "outbox_nack_returning(text, bigint, bigint[], text)",
        "outbox_reclaim_returning(interval)",
        "outbox_stats()",
        "outbox_blocked_keys(integer)",
        "outbox_skip(bigint[])",
        "outbox_wait(interval)",
        "outbox_wake_mode()",
        "outbox_enqueue_many(text, jsonb[], text[], text[], jsonb[], timestamptz)",
        "outbox_heartbeat(text, interval)",
        "outbox_owners(integer)",
    ] {
        let may: bool = scalar(
            &c,
            "SELECT has_function_privilege($1, $2, 'EXECUTE')",
            &[&role.0, &f],
        )
        .await;
        assert!(may, "{} may no longer call {f} after the update", role.0);
    }
    c.batch_execute(&format!(
        "REVOKE ALL ON FUNCTION outbox_nack(text, bigint, bigint[], text), outbox_reclaim(interval), \
         outbox_nack_returning(text, bigint, bigint[], text), outbox_reclaim_returning(interval), \
         outbox_stats(), outbox_requeue(bigint[]), outbox_blocked_keys(int), outbox_skip(bigint[]), \
         outbox_claim(text, int), outbox_dead_letters(int, bigint), \
         outbox_enqueue(text, jsonb, text, text, jsonb, timestamptz), \
         outbox_wait(interval), outbox_wake_mode(), outbox_heartbeat(text, interval), outbox_owners(int), \
         outbox_enqueue_many(text, jsonb[], text[], text[], jsonb[], timestamptz) FROM {}",
        role.0
    ))
    .await
    .unwrap();
    let distinct_ids: i64 =
        scalar(&c, "SELECT count(DISTINCT event_id) FROM outbox_event", &[]).await;
    assert_eq!(
        distinct_ids, 6,
        "rows from before the update get their own event_id"
    );

    // The claim taken before the update is still held: settle it, then drain in key order.
    in_flight::settle_and_drain(&c, token, per_key).await;

    // The new path works on the updated database: a fresh unkeyed event goes to the stream, is
    // handed out by the cursor the update started, acked, and reads SUCCESS through the view.
    let id: i64 = scalar(
        &c,
        "SELECT outbox_enqueue('orders', '{\"n\": 7}'::jsonb)",
        &[],
    )
    .await;
    let placed: String = scalar(
        &c,
        "SELECT (SELECT count(*) FROM outbox_stream WHERE id = $1) || ' stream, ' \
             || (SELECT count(*) FROM outbox_tracked WHERE id = $1) || ' tracked'",
        &[&id],
    )
    .await;
    assert_eq!(placed, "1 stream, 0 tracked", "where event {id} went");
    let status = |want: &'static str| {
        let c = &c;
        async move {
            let got: String = scalar(
                c,
                "SELECT string_agg(status::text, ',') FROM outbox_event WHERE id = $1",
                &[&id],
            )
            .await;
            assert_eq!(got, want, "event {id} through the view");
        }
    };
    status("WAIT").await;
    let rows = c
        .query(
            "SELECT id, claim_token FROM outbox_claim('relay-c', 10)",
            &[],
        )
        .await
        .unwrap();
    let ids: Vec<i64> = rows.iter().map(|r| r.get(0)).collect();
    assert_eq!(ids, vec![id], "the claim hands out the fresh event only");
    let stream_token: i64 = rows[0].get(1);
    status("SENDING").await;
    let acked: i32 = scalar(
        &c,
        "SELECT outbox_ack('relay-c', $1, $2)",
        &[&stream_token, &ids],
    )
    .await;
    assert_eq!(acked, 1);
    status("SUCCESS").await;
    let unsettled: i64 = scalar(
        &c,
        "SELECT count(*) FROM outbox_event WHERE status <> 'SUCCESS'",
        &[],
    )
    .await;
    assert_eq!(unsettled, 0, "every event is settled");
    let total: i64 = scalar(&c, "SELECT count(*) FROM outbox_event", &[]).await;
    assert_eq!(total, 7, "the six from before the update and the fresh one");
    let batches: i64 = scalar(&c, "SELECT count(*) FROM outbox_stream_batch", &[]).await;
    assert_eq!(batches, 0, "acking the whole claim deletes its batch row");

    let fresh = TestDb::create();
    let upgraded = catalog(&c).await;
    let installed = catalog(&fresh.connect().await).await;
    // In 0.14.0: 44 functions (0.13.0: 42), 65 columns (0.13.0: 63), 12 indexes (0.13.0: 13), 7 tables
    // and views, the view's definition, 2 triggers, the enum and 6 pg_dump rows (137 in all).
    assert!(
        installed.len() > 110,
        "the catalog query found too little to compare: {installed:?}"
    );
    for object in [
        "column outbox_tracked 1 id",
        "column outbox_stream 2 txid",
        "column outbox_stream_cursor 2 prev_snap",
        "column outbox_stream_cursor 7 batch_floor",
        "column outbox_stream_batch 4 pending",
        "column outbox_key 1 topic",
        "column outbox_owner 4 expires_at",
        "column outbox_event 7 status",
        "index outbox_tracked_key_pending_idx",
        "index outbox_stream_txid_idx",
        "index outbox_stream_cursor_pkey",
        "index outbox_stream_batch_pkey",
        "index outbox_key_due_idx",
        "index outbox_owner_pkey",
        "table options outbox_tracked",
        "table options outbox_stream",
        "table options outbox_stream_cursor",
        "table options outbox_stream_batch",
        "table options outbox_key",
        "table options outbox_owner",
        "table options outbox_event",
        "view outbox_event",
        "trigger outbox_stream outbox_stream_restamp",
        "dumped with pg_dump: outbox_tracked",
        "dumped with pg_dump: outbox_stream",
        "dumped with pg_dump: outbox_key",
    ] {
        assert!(
            installed.contains_key(object),
            "the catalog query misses {object}: {installed:?}"
        );
    }
    for (object, definition) in &installed {
        assert_eq!(
            upgraded.get(object),
            Some(definition),
            "{object} differs between the updated and a fresh install"
        );
    }
    let extra: Vec<_> = upgraded
        .keys()
        .filter(|k| !installed.contains_key(*k))
        .collect();
    assert!(extra.is_empty(), "left over by the update: {extra:?}");
}
