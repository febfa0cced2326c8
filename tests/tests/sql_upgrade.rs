//! The upgrade chain (sql/outbox--A--B.sql): a database on the first release with events in
//! flight is updated with `ALTER EXTENSION outbox UPDATE`, the relay's held claims still settle,
//! everything drains, and the updated catalog is exactly what a fresh install creates.
//! Every schema change adds its step to the chain, and this test starts from every earlier
//! release. A relay role's grants carry over to the functions a new relay calls.

use std::collections::BTreeMap;

use outbox_tests::build;
use outbox_tests::db::{psql_admin, scalar, TestDb};
use tokio_postgres::Client;

const CURRENT: &str = env!("CARGO_PKG_VERSION");

/// Everything the extension defines, as text keyed by object, for comparing two databases.
async fn catalog(c: &Client) -> BTreeMap<String, String> {
    let queries = [
        // Functions with their whole definition (body, volatility, SET clauses) and grants.
        "SELECT 'function ' || p.oid::regprocedure::text, \
                pg_get_functiondef(p.oid) || coalesce(p.proacl::text, '') \
           FROM pg_proc p JOIN pg_depend d ON d.classid = 'pg_proc'::regclass AND d.objid = p.oid \
           JOIN pg_extension x ON x.oid = d.refobjid AND d.deptype = 'e' AND x.extname = 'outbox'",
        "SELECT 'column ' || a.attrelid::regclass::text || ' ' || a.attnum || ' ' || a.attname, \
                format_type(a.atttypid, a.atttypmod) || ' notnull=' || a.attnotnull \
                || ' default=' || coalesce(pg_get_expr(ad.adbin, ad.adrelid), '') \
           FROM pg_attribute a LEFT JOIN pg_attrdef ad ON ad.adrelid = a.attrelid AND ad.adnum = a.attnum \
          WHERE a.attrelid IN ('outbox_event'::regclass, 'outbox_key'::regclass) AND a.attnum > 0 AND NOT a.attisdropped",
        "SELECT 'index ' || c.relname, pg_get_indexdef(c.oid) \
           FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid \
          WHERE i.indrelid IN ('outbox_event'::regclass, 'outbox_key'::regclass)",
        "SELECT 'table options ' || relname, coalesce(array_to_string(reloptions, ','), '') || ' acl=' || coalesce(relacl::text, '') \
           FROM pg_class WHERE oid IN ('outbox_event'::regclass, 'outbox_key'::regclass)",
        "SELECT 'type ' || t.typname, string_agg(e.enumlabel, ',' ORDER BY e.enumsortorder) \
           FROM pg_type t JOIN pg_enum e ON e.enumtypid = t.oid \
          WHERE t.typname = 'outbox_status' GROUP BY t.typname",
        "SELECT 'dumped with pg_dump', array_to_string(ARRAY(SELECT c::regclass::text FROM unnest(extconfig) c ORDER BY 1), ',') \
           FROM pg_extension WHERE extname = 'outbox'",
    ];
    let mut out = BTreeMap::new();
    for q in queries {
        for row in c.query(q, &[]).await.unwrap_or_else(|e| panic!("{q}: {e}")) {
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

/// A role granted calls of an earlier release (nack, reclaim, stats, requeue); dropped on drop.
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
    // 0.4.0 the operator's blocked_keys and skip; 0.5.0 the wake-up and the bulk enqueue.
    let returning = match from {
        "0.3.0" => {
            ", outbox_nack_returning(text, bigint, bigint[], text), outbox_reclaim_returning(interval)"
        }
        "0.4.0" => {
            ", outbox_nack_returning(text, bigint, bigint[], text), outbox_reclaim_returning(interval), \
             outbox_blocked_keys(int), outbox_skip(bigint[])"
        }
        "0.5.0" => {
            ", outbox_nack_returning(text, bigint, bigint[], text), outbox_reclaim_returning(interval), \
             outbox_blocked_keys(int), outbox_skip(bigint[]), outbox_wait(interval), outbox_wake_mode(), \
             outbox_enqueue_many(text, jsonb[], text[], text[], jsonb[], timestamptz)"
        }
        _ => "",
    };
    c.batch_execute(&format!(
        "CREATE ROLE {0} NOLOGIN; GRANT EXECUTE ON FUNCTION outbox_nack(text, bigint, bigint[], text), \
         outbox_reclaim(interval), outbox_stats(), outbox_requeue(bigint[]), outbox_claim(text, int), \
         outbox_enqueue(text, jsonb, text, text, jsonb, timestamptz){returning} TO {0}",
        role.0
    ))
    .await
    .unwrap();
    c.batch_execute(
        "SELECT outbox_enqueue('orders', jsonb_build_object('n', g), key => 'k' || (g % 3)) \
         FROM generate_series(1, 6) g",
    )
    .await
    .unwrap();
    // Since 0.4.0 a claim takes whole runs per key (k1: 1 4, k2: 2 5, k0: 3 6): all six.
    let per_key = !matches!(from, "0.1.0" | "0.2.0" | "0.3.0");
    let held = if per_key { 6 } else { 4 };
    let token: i64 = scalar(
        &c,
        "SELECT max(claim_token) FROM outbox_claim('relay-a', $1)",
        &[&held],
    )
    .await;

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
    for f in [
        "outbox_nack_returning(text, bigint, bigint[], text)",
        "outbox_reclaim_returning(interval)",
        "outbox_stats()",
        "outbox_blocked_keys(integer)",
        "outbox_skip(bigint[])",
        "outbox_wait(interval)",
        "outbox_wake_mode()",
        "outbox_enqueue_many(text, jsonb[], text[], text[], jsonb[], timestamptz)",
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
         outbox_claim(text, int), outbox_enqueue(text, jsonb, text, text, jsonb, timestamptz), \
         outbox_wait(interval), outbox_wake_mode(), \
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

    // The claim taken before the update is still held: ack, nack and renew it.
    let settle = |sql: &'static str| {
        let c = &c;
        async move { scalar::<i32>(c, sql, &[&token]).await }
    };
    assert_eq!(settle("SELECT outbox_ack('relay-a', $1, '{1,2}')").await, 2);
    assert_eq!(
        settle("SELECT outbox_nack('relay-a', $1, '{3}', 'x')").await,
        1
    );
    assert_eq!(settle("SELECT outbox_renew('relay-a', $1, '{4}')").await, 1);
    assert_eq!(settle("SELECT outbox_ack('relay-a', $1, '{4}')").await, 1);
    if per_key {
        // 5 was delivered; 6 comes after the failed 3 in its key, so the relay releases it.
        assert_eq!(settle("SELECT outbox_ack('relay-a', $1, '{5}')").await, 1);
        assert_eq!(
            settle("SELECT outbox_release('relay-a', $1, '{6}', '0', 'held back')").await,
            1
        );
    }

    // Drain what is left through the new code, in per-key order. Keys: 1 k1, 2 k2, 3 k0, 4 k1,
    // 5 k2, 6 k0. Event 3 backs off after its nack, and holds back 6, the next event of k0.
    let claim = || {
        let c = &c;
        async move {
            let rows = c
                .query(
                    "SELECT id, claim_token FROM outbox_claim('relay-b', 10)",
                    &[],
                )
                .await
                .unwrap();
            let ids: Vec<i64> = rows.iter().map(|r| r.get(0)).collect();
            (ids, rows.first().map(|r| r.get::<_, i64>(1)))
        }
    };
    let ack = |ids: Vec<i64>, token: Option<i64>| {
        let c = &c;
        async move {
            let n: i32 = scalar(c, "SELECT outbox_ack('relay-b', $1, $2)", &[&token, &ids]).await;
            assert_eq!(n as usize, ids.len());
        }
    };
    if !per_key {
        let (ids, token) = claim().await;
        assert_eq!(ids, vec![5], "event 6 waits for 3, the head of its key");
        ack(ids, token).await;
    }
    let (ids, _) = claim().await;
    assert!(
        ids.is_empty(),
        "event 6 waits for 3, the head of its key: {ids:?}"
    );
    // The backoff ends now (for the event and for its key's next look).
    c.batch_execute(
        "UPDATE outbox_event SET next_retry_time = now() WHERE status = 'WAIT'; \
         UPDATE outbox_key SET due_at = now()",
    )
    .await
    .unwrap();
    let (ids, token) = claim().await;
    assert_eq!(ids, vec![3, 6], "k0's run, in commit order");
    ack(ids, token).await;
    let success: i64 = scalar(
        &c,
        "SELECT count(*) FROM outbox_event WHERE status = 'SUCCESS'",
        &[],
    )
    .await;
    assert_eq!(success, 6);

    let fresh = TestDb::create();
    let upgraded = catalog(&c).await;
    let installed = catalog(&fresh.connect().await).await;
    assert!(
        installed.len() > 40,
        "the catalog query found too little to compare: {installed:?}"
    );
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
