//! Privileges (docs/reference.md) with the GRANT recipe, and a hostile search_path.

use outbox_tests::build;
use outbox_tests::db::{scalar, sqlstate, TestDb};
use outbox_tests::roles::Roles;

#[tokio::test]
async fn each_role_can_do_exactly_its_part() {
    let roles;
    let db = TestDb::create();
    roles = Roles::create(&db, &["nobody"]);
    let c = db.connect().await;
    let as_role = |kind: &str| format!("SET ROLE {}", roles.name(kind));

    // Producer: enqueue only.
    c.batch_execute(&as_role("producer")).await.unwrap();
    c.execute("SELECT outbox_enqueue('orders', '{\"secret\": 1}')", &[])
        .await
        .unwrap();
    for denied in [
        "SELECT * FROM outbox_event",
        "SELECT * FROM outbox_claim('p', 1)",
        "SELECT * FROM outbox_stats()",
        "SELECT outbox_requeue('{1}')",
        "UPDATE outbox_scheduled SET status = 'FAIL'",
        "DELETE FROM outbox_stream",
    ] {
        assert_eq!(
            sqlstate(c.batch_execute(denied).await),
            "42501",
            "producer: {denied}"
        );
    }

    // Relay: claim, ack, nack, renew, reclaim, stats; no enqueue, requeue, purge or table access.
    c.batch_execute(&format!("RESET ROLE; {}", as_role("relay")))
        .await
        .unwrap();
    let r = c
        .query_one(
            "SELECT id, claim_token FROM outbox_claim('relay-1', 5)",
            &[],
        )
        .await
        .unwrap();
    let (id, token): (i64, i64) = (r.get(0), r.get(1));
    c.execute(
        "SELECT outbox_renew('relay-1', $1, ARRAY[$2::bigint])",
        &[&token, &id],
    )
    .await
    .unwrap();
    c.execute(
        "SELECT outbox_release('relay-1', $1, ARRAY[$2::bigint])",
        &[&token, &id],
    )
    .await
    .unwrap();
    let r = c
        .query_one(
            "SELECT id, claim_token FROM outbox_claim('relay-1', 5)",
            &[],
        )
        .await
        .unwrap();
    let (id, token): (i64, i64) = (r.get(0), r.get(1));
    c.execute(
        "SELECT outbox_nack('relay-1', $1, ARRAY[$2::bigint], 'x')",
        &[&token, &id],
    )
    .await
    .unwrap();
    c.execute(
        "SELECT outbox_ack('relay-1', $1, ARRAY[$2::bigint])",
        &[&token, &id],
    )
    .await
    .unwrap();
    c.execute("SELECT outbox_reclaim()", &[]).await.unwrap();
    c.execute("SELECT * FROM outbox_stats()", &[])
        .await
        .unwrap();
    for denied in [
        "SELECT outbox_enqueue('orders', '{}')",
        "SELECT outbox_requeue('{1}')",
        "SELECT outbox_purge()",
        "SELECT * FROM outbox_dead_letters()",
        "SELECT * FROM outbox_event",
    ] {
        assert_eq!(
            sqlstate(c.batch_execute(denied).await),
            "42501",
            "relay: {denied}"
        );
    }

    // Admin: the relay's rights plus dead letters, requeue and purge.
    c.batch_execute(&format!("RESET ROLE; {}", as_role("admin")))
        .await
        .unwrap();
    c.execute("SELECT * FROM outbox_dead_letters()", &[])
        .await
        .unwrap();
    c.execute("SELECT outbox_requeue('{1}')", &[])
        .await
        .unwrap();
    c.execute("SELECT outbox_purge()", &[]).await.unwrap();
    c.execute("SELECT * FROM outbox_claim('admin', 1)", &[])
        .await
        .unwrap();

    // A role with no grants can call nothing: nothing is granted to PUBLIC.
    c.batch_execute(&format!("RESET ROLE; {}", as_role("nobody")))
        .await
        .unwrap();
    for denied in [
        "SELECT outbox_enqueue('orders', '{}')",
        "SELECT * FROM outbox_stats()",
        "SELECT * FROM outbox_config()",
    ] {
        assert_eq!(
            sqlstate(c.batch_execute(denied).await),
            "42501",
            "nobody: {denied}"
        );
    }
    c.batch_execute("RESET ROLE").await.unwrap();
    let public_callable: Vec<String> = c
        .query(
            &format!(
                "SELECT p.oid::regprocedure::text FROM pg_proc p WHERE p.oid IN ({}) \
                 AND has_function_privilege('public', p.oid, 'EXECUTE')",
                build::objects("pg_proc")
            ),
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    // The SQL-only build's version marker reads nothing: the relay finds the outbox by it, as it
    // reads pg_extension.extversion (world-readable) in the native build.
    let expected: &[&str] = if build::sql_only() {
        &["outbox_sql_only_version()"]
    } else {
        &[]
    };
    assert_eq!(public_callable, expected, "callable by PUBLIC");
    drop(db);
    drop(roles);
}

#[tokio::test]
async fn a_hostile_search_path_changes_nothing() {
    let db = TestDb::create();
    let c = db.connect().await;
    c.batch_execute(
        r#"
        CREATE SCHEMA evil;
        CREATE TABLE evil.outbox_event (LIKE public.outbox_event);
        CREATE TABLE evil.outbox_scheduled (LIKE public.outbox_scheduled);
        CREATE TABLE evil.outbox_stream (LIKE public.outbox_stream);
        CREATE TABLE evil.outbox_stream_batch (LIKE public.outbox_stream_batch);
        CREATE FUNCTION evil.hijacked() RETURNS void LANGUAGE plpgsql AS
            $$ BEGIN RAISE EXCEPTION 'hijacked'; END $$;
        CREATE FUNCTION evil.outbox_config() RETURNS TABLE (max_retry int) LANGUAGE sql AS
            $$ SELECT 1 FROM evil.hijacked() $$;
        CREATE FUNCTION evil.outbox_check_owner(text, text) RETURNS void LANGUAGE sql AS
            $$ SELECT evil.hijacked() $$;
        CREATE FUNCTION evil.pg_notify(text, text) RETURNS void LANGUAGE sql AS $$ SELECT evil.hijacked() $$;
        CREATE FUNCTION evil.now() RETURNS timestamptz LANGUAGE sql AS $$ SELECT 'epoch'::timestamptz FROM evil.hijacked() $$;
        CREATE FUNCTION evil.clock_timestamp() RETURNS timestamptz LANGUAGE sql AS $$ SELECT 'epoch'::timestamptz FROM evil.hijacked() $$;
        CREATE FUNCTION evil.jsonb_typeof(jsonb) RETURNS text LANGUAGE sql AS $$ SELECT 'evil' FROM evil.hijacked() $$;
        CREATE FUNCTION evil.nextval(regclass) RETURNS bigint LANGUAGE sql AS $$ SELECT 1::bigint FROM evil.hijacked() $$;
        CREATE FUNCTION evil.random() RETURNS float8 LANGUAGE sql AS $$ SELECT 0::float8 FROM evil.hijacked() $$;
        CREATE FUNCTION evil.make_interval(years int DEFAULT 0, months int DEFAULT 0, weeks int DEFAULT 0,
            days int DEFAULT 0, hours int DEFAULT 0, mins int DEFAULT 0, secs float8 DEFAULT 0)
            RETURNS interval LANGUAGE sql AS $$ SELECT interval '0' FROM evil.hijacked() $$;
        SET search_path = evil, pg_catalog, public;
        "#,
    )
    .await
    .unwrap();

    let id: i64 = scalar(
        &c,
        "SELECT public.outbox_enqueue('orders', '{}', headers => '{\"a\":\"b\"}')",
        &[],
    )
    .await;
    let token: i64 = scalar(
        &c,
        "SELECT claim_token FROM public.outbox_claim('r', 5)",
        &[],
    )
    .await;
    let n: i32 = scalar(
        &c,
        "SELECT public.outbox_nack('r', $1, ARRAY[$2::bigint], 'x')",
        &[&token, &id],
    )
    .await;
    assert_eq!(n, 1);
    c.batch_execute(
        "SELECT public.outbox_reclaim(); SELECT * FROM public.outbox_stats(); \
         SELECT public.outbox_requeue('{1}'); SELECT public.outbox_purge(); \
         SELECT * FROM public.outbox_dead_letters();",
    )
    .await
    .unwrap();

    let r = c
        .query_one(
            "SELECT (SELECT count(*) FROM evil.outbox_event) + (SELECT count(*) FROM evil.outbox_scheduled) \
                    + (SELECT count(*) FROM evil.outbox_stream) + (SELECT count(*) FROM evil.outbox_stream_batch), \
                    (SELECT count(*) FROM public.outbox_event WHERE status = 'WAIT' AND retry_count = 1 \
                     AND next_retry_time > pg_catalog.now())",
            &[],
        )
        .await
        .unwrap();
    assert_eq!((r.get::<_, i64>(0), r.get::<_, i64>(1)), (0, 1));
}

/// The `outbox_*` names in code spans of `text`.
fn outbox_names(text: &str) -> std::collections::BTreeSet<String> {
    text.split('`')
        .skip(1)
        .step_by(2)
        .filter_map(|code| {
            let name: String = code
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            name.starts_with("outbox_").then_some(name)
        })
        .collect()
}

/// The table rows of the section of docs/`page` that starts with `heading`: first cell → rest.
fn doc_table(page: &str, heading: &str) -> Vec<(String, String)> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../docs")
        .join(page);
    let text = std::fs::read_to_string(&path).expect("the page");
    text.lines()
        .skip_while(|l| !l.starts_with(heading))
        .skip(1)
        .take_while(|l| !l.starts_with("## "))
        .filter(|l| l.starts_with("| ") && !l.starts_with("|---"))
        .skip(1)
        .map(|l| {
            let (first, rest) = l[2..].split_once(" | ").unwrap_or((l, ""));
            (first.to_string(), rest.to_string())
        })
        .collect()
}

/// The outbox's functions, in either build (the SQL-only build is no extension): by name in the
/// schema the tests install it in.
const OURS: &str = "FROM pg_proc p WHERE p.pronamespace = 'public'::regnamespace \
                    AND p.proname LIKE 'outbox\\_%'";

/// docs/reference.md's privilege table is what `sql/examples/grant-roles.sql` grants, and every
/// function a role may call is documented in the SQL API tables (reference.md, inbox.md).
#[tokio::test]
async fn the_documented_privileges_are_the_granted_ones() {
    let db = TestDb::create();
    let roles = Roles::create(&db, &[]);
    let c = db.connect().await;
    let functions: std::collections::BTreeSet<String> = c
        .query(&format!("SELECT DISTINCT p.proname::text {OURS}"), &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let granted = |role: String| {
        let c = &c;
        async move {
            c.query(
                &format!(
                    "SELECT DISTINCT p.proname::text {OURS} \
                       AND has_function_privilege($1, p.oid, 'EXECUTE') \
                       AND p.proname <> 'outbox_sql_only_version'"
                ),
                &[&role],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| r.get::<_, String>(0))
            .collect::<std::collections::BTreeSet<String>>()
        }
    };
    let table = doc_table("reference.md", "## Privileges");
    let may = |kind: &str| {
        let (_, rest) = table
            .iter()
            .find(|(k, _)| k.starts_with(kind))
            .unwrap_or_else(|| panic!("reference.md, Privileges: no row for {kind}"));
        let cell = rest.split(" | ").next().unwrap_or("");
        let mut names: std::collections::BTreeSet<String> = outbox_names(cell)
            .into_iter()
            .filter(|n| functions.contains(n))
            .collect();
        if cell.starts_with("the relay's rights plus") {
            let relay = &table
                .iter()
                .find(|(k, _)| k == "relay")
                .expect("relay row")
                .1;
            let cell = relay.split(" | ").next().unwrap_or("");
            names.extend(
                outbox_names(cell)
                    .into_iter()
                    .filter(|n| functions.contains(n)),
            );
        }
        names
    };
    let mut any_role = std::collections::BTreeSet::new();
    for kind in ["producer", "relay", "admin", "consumer"] {
        let got = granted(roles.name(kind)).await;
        assert_eq!(
            may(kind),
            got,
            "reference.md, Privileges: the {kind}'s functions"
        );
        any_role.extend(got);
    }
    let mut documented = std::collections::BTreeSet::new();
    for (page, heading) in [("reference.md", "## SQL API"), ("inbox.md", "## SQL API")] {
        for (call, _) in doc_table(page, heading) {
            documented.extend(outbox_names(&call));
        }
    }
    let undocumented: Vec<_> = any_role.difference(&documented).collect();
    assert!(
        undocumented.is_empty(),
        "granted but not in a SQL API table: {undocumented:?}"
    );
    let unknown: Vec<_> = documented.difference(&functions).collect();
    assert!(
        unknown.is_empty(),
        "documented but not functions of the extension: {unknown:?}"
    );
}
