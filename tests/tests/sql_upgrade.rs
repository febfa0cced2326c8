//! Upgrades (docs/reference.md, "Upgrades"): 1.0.0 is the first release; every release after it
//! ships one step from the release before it (sql/outbox--A--B.sql, with A's install script frozen
//! as sql/outbox--A.sql). A database on A with a claim in flight is updated with
//! `ALTER EXTENSION outbox UPDATE`: the claim still settles, everything drains in key order, and
//! the updated catalog is exactly what a fresh install creates.

use std::collections::BTreeMap;

use outbox_tests::build::{self, FIRST_RELEASE};
use outbox_tests::db::{scalar, TestDb};
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

/// The versions the server offers besides this release, each with its update path to it.
async fn earlier_releases(c: &Client) -> Vec<(String, Option<String>)> {
    c.query(
        "SELECT v.version, p.path FROM pg_available_extension_versions v \
           LEFT JOIN pg_extension_update_paths('outbox') p ON p.source = v.version AND p.target = $1 \
          WHERE v.name = 'outbox' AND v.version <> $1 ORDER BY 1",
        &[&CURRENT],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1)))
    .collect()
}

/// One step per release: every earlier release reaches this one by a single step, and a release
/// after the first has a step from the one before it. 1.0.0 has none.
#[tokio::test]
async fn every_earlier_release_is_one_step_from_this_one() {
    if build::sql_only() {
        println!("skipped: sql_only::the_previous_release_updates_with_events_in_flight covers it");
        return;
    }
    let db = TestDb::empty();
    let c = db.connect().await;
    let earlier = earlier_releases(&c).await;
    for (from, path) in &earlier {
        assert_eq!(
            path.as_deref(),
            Some(format!("{from}--{CURRENT}").as_str()),
            "outbox {from} must update to {CURRENT} in one step"
        );
    }
    if CURRENT == FIRST_RELEASE {
        assert!(
            earlier.is_empty(),
            "the first release has no steps: {earlier:?}"
        );
    } else {
        assert!(
            !earlier.is_empty(),
            "{CURRENT} ships no step from the release before it"
        );
    }
}

#[tokio::test]
async fn every_earlier_release_updates_with_events_in_flight() {
    if build::sql_only() {
        println!("skipped: sql_only::the_previous_release_updates_with_events_in_flight covers it");
        return;
    }
    let db = TestDb::empty();
    let releases = earlier_releases(&db.connect().await).await;
    for (from, _) in releases {
        update_with_events_in_flight(&from).await;
    }
}

async fn update_with_events_in_flight(from: &str) {
    let db = TestDb::empty();
    let c = db.connect().await;
    c.batch_execute(&format!("CREATE EXTENSION outbox VERSION '{from}'"))
        .await
        .unwrap();
    let token = in_flight::enqueue_and_claim(&c, 6).await;
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
    in_flight::settle_and_drain(&c, token).await;

    let fresh = TestDb::create();
    let installed = catalog(&fresh.connect().await).await;
    let upgraded = catalog(&c).await;
    for (object, definition) in &installed {
        assert_eq!(
            upgraded.get(object),
            Some(definition),
            "{object} differs between outbox updated from {from} and a fresh install"
        );
    }
    let extra: Vec<_> = upgraded
        .keys()
        .filter(|k| !installed.contains_key(*k))
        .collect();
    assert!(
        extra.is_empty(),
        "left over by the update from {from}: {extra:?}"
    );
}

/// The comparison sees the whole catalog: it would miss nothing a step can get wrong.
#[tokio::test]
async fn the_catalog_comparison_sees_every_kind_of_object() {
    if build::sql_only() {
        println!("skipped: the SQL-only build has no pg_extension row to list its objects by");
        return;
    }
    let db = TestDb::create();
    let installed = catalog(&db.connect().await).await;
    for prefix in [
        "function ",
        "column ",
        "index ",
        "table options ",
        "view ",
        "trigger ",
        "type ",
        "dumped with pg_dump: ",
    ] {
        assert!(
            installed.keys().any(|k| k.starts_with(prefix)),
            "the catalog query finds no {prefix:?}: {installed:?}"
        );
    }
}
