//! Every row of the error table (docs/reference.md, "Errors"): bad input gets its SQLSTATE, a message naming the argument,
//! and changes nothing.

use outbox_tests::build;
use outbox_tests::db::{db_error, rejects, row_count, scalar, sqlstate, TestDb};
use outbox_worker::RESERVED_HEADERS;

#[tokio::test]
async fn enqueue_rejects_bad_topics() {
    let db = TestDb::create();
    let c = db.connect().await;
    let long = "t".repeat(250);
    let ok_249 = "t".repeat(249);
    for topic in [
        None,
        Some(""),
        Some(long.as_str()),
        Some("orders created"),
        Some("ordérs"),
        Some("a/b"),
        Some("."),
        Some(".."),
    ] {
        rejects(
            &c,
            "SELECT outbox_enqueue($1, '{}')",
            &[&topic],
            "22023",
            "topic",
        )
        .await;
    }
    assert_eq!(row_count(&c).await, 0);
    c.execute("SELECT outbox_enqueue($1, '{}')", &[&ok_249])
        .await
        .unwrap();
    c.execute("SELECT outbox_enqueue('Orders.v1_created-x', '{}')", &[])
        .await
        .unwrap();
    assert_eq!(row_count(&c).await, 2);
}

#[tokio::test]
async fn enqueue_rejects_bad_payloads_and_headers() {
    let db = TestDb::create();
    let c = db.connect().await;
    rejects(
        &c,
        "SELECT outbox_enqueue('orders', NULL)",
        &[],
        "22004",
        "payload",
    )
    .await;
    // The names the relay sets itself (it would drop them anyway) are refused at enqueue.
    let reserved = RESERVED_HEADERS.map(|name| format!("{{\"{name}\": \"1\"}}"));
    for headers in [
        "[]",
        "\"x\"",
        "{\"a\": 1}",
        "{\"a\": \"ok\", \"b\": null}",
        "{\"a\": {\"b\": \"c\"}}",
    ]
    .into_iter()
    .chain(reserved.iter().map(String::as_str))
    {
        rejects(
            &c,
            "SELECT outbox_enqueue('orders', '{}', headers => $1::text::jsonb)",
            &[&headers],
            "22023",
            "header",
        )
        .await;
    }
    c.execute("SET outbox.max_payload_bytes = 20", &[])
        .await
        .unwrap();
    rejects(
        &c,
        "SELECT outbox_enqueue('orders', '{\"text\": \"more than twenty bytes\"}')",
        &[],
        "54000",
        "outbox.max_payload_bytes",
    )
    .await;
    // At the limit is fine; NULL headers mean none.
    c.execute(
        "SELECT outbox_enqueue('orders', '{\"t\": \"0123456789\"}', headers => NULL)",
        &[],
    )
    .await
    .unwrap();
    assert_eq!(row_count(&c).await, 1);
}

#[tokio::test]
async fn relay_calls_reject_bad_owners() {
    let db = TestDb::create();
    let c = db.connect().await;
    c.execute("SELECT outbox_enqueue('orders', '{}')", &[])
        .await
        .unwrap();
    let long = "o".repeat(201);
    let ids: Vec<i64> = vec![1];
    for owner in [
        None,
        Some(""),
        Some(long.as_str()),
        Some("relay\n1"),
        Some("tab\there"),
    ] {
        rejects(
            &c,
            "SELECT * FROM outbox_claim($1, 10)",
            &[&owner],
            "22023",
            "owner",
        )
        .await;
        for f in ["outbox_ack", "outbox_nack", "outbox_renew"] {
            rejects(
                &c,
                &format!("SELECT {f}($1, 1, $2)"),
                &[&owner, &ids],
                "22023",
                "owner",
            )
            .await;
        }
    }
    let ok_200 = "o".repeat(200);
    assert_eq!(
        c.query("SELECT * FROM outbox_claim($1, 10)", &[&ok_200])
            .await
            .unwrap()
            .len(),
        1
    );
}

#[tokio::test]
async fn claim_rejects_out_of_range_batch_sizes() {
    let db = TestDb::create();
    let c = db.connect().await;
    c.execute("SELECT outbox_enqueue('orders', '{}')", &[])
        .await
        .unwrap();
    for max in [Some(0), Some(-1), Some(10_001), None] {
        rejects(
            &c,
            "SELECT * FROM outbox_claim('r', $1)",
            &[&max],
            "22023",
            "max_events",
        )
        .await;
    }
    c.execute("SET outbox.max_claim = 5", &[]).await.unwrap();
    rejects(
        &c,
        "SELECT * FROM outbox_claim('r', 6)",
        &[],
        "22023",
        "between 1 and 5",
    )
    .await;
    assert_eq!(
        c.query("SELECT * FROM outbox_claim('r', 5)", &[])
            .await
            .unwrap()
            .len(),
        1
    );
}

#[tokio::test]
async fn reclaim_purge_and_id_lists_reject_nonsense() {
    let db = TestDb::create();
    let c = db.connect().await;
    // '300000 years' used to escape as 22008 (timestamp out of range) from deep inside reclaim.
    for lease in ["0", "-1 minute", "300000 years"] {
        rejects(
            &c,
            "SELECT outbox_reclaim($1::text::interval)",
            &[&lease],
            "22023",
            "lease",
        )
        .await;
    }
    rejects(
        &c,
        "SELECT outbox_purge('-1 day')",
        &[],
        "22023",
        "older_than",
    )
    .await;
    rejects(&c, "SELECT outbox_purge(NULL)", &[], "22023", "older_than").await;
    rejects(
        &c,
        "SELECT outbox_purge('300000 years')",
        &[],
        "22023",
        "older_than",
    )
    .await;
    rejects(
        &c,
        "SELECT outbox_purge('1 day', 0)",
        &[],
        "22023",
        "max_rows",
    )
    .await;
    rejects(&c, "SELECT outbox_ack('r', 1, NULL)", &[], "22023", "ids").await;
    rejects(
        &c,
        "SELECT outbox_ack('r', NULL, '{1}')",
        &[],
        "22023",
        "claim_token",
    )
    .await;
    rejects(&c, "SELECT outbox_requeue(NULL)", &[], "22023", "ids").await;
    for delay in ["-1 second", "300000 years"] {
        rejects(
            &c,
            "SELECT outbox_release('r', 1, '{1}', $1::text::interval)",
            &[&delay],
            "22023",
            "delay",
        )
        .await;
    }
    // Unknown ids are not an error, just not counted.
    let n: i32 = scalar(&c, "SELECT outbox_requeue('{1,2,3}')", &[]).await;
    assert_eq!(n, 0);
    let n: i32 = scalar(&c, "SELECT outbox_ack('r', 7, '{1,2,3}')", &[]).await;
    assert_eq!(n, 0);
}

#[tokio::test]
async fn settings_reject_nonsense_values() {
    let db = TestDb::create();
    let c = db.connect().await;
    if build::sql_only() {
        return sql_only_settings_reject_nonsense_values_at_use(&c).await;
    }
    // Settings are validated once the library is loaded: by the first outbox call of the session,
    // by LOAD, or at connection start with session_preload_libraries = 'outbox' (see README).
    c.batch_execute("LOAD 'outbox'").await.unwrap();
    for set in [
        "SET outbox.max_retry = 'many'",
        "SET outbox.max_retry = -1",
        "SET outbox.backoff_base = '5 parsecs'",
        "SET outbox.backoff_base = 0",
        "SET outbox.backoff_jitter = 1.5",
        "SET outbox.lease = '-10min'",
        "SET outbox.max_claim = 0",
        "SET outbox.max_payload_bytes = '1kB per day'",
        "SET outbox.notify = 'sometimes'",
        "SET outbox.max_retries = 3",
    ] {
        let result = c.batch_execute(set).await;
        assert!(result.is_err(), "{set} was accepted");
        let code = sqlstate(result);
        assert!(
            ["22023", "22P02", "42602"].contains(&code.as_str()),
            "{set}: {code}"
        );
    }
    c.batch_execute("SET outbox.lease = '30s'; SET outbox.backoff_max = '2h'")
        .await
        .unwrap();
    let r = c
        .query_one(
            "SELECT current_setting('outbox.lease'), current_setting('outbox.backoff_max')",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(
        (r.get::<_, String>(0), r.get::<_, String>(1)),
        ("30s".into(), "2h".into())
    );
}

/// The SQL-only build registers no settings: every SET succeeds (a placeholder) and the value is
/// checked when a call reads it, with the native build's SQLSTATE (22023) and a message naming
/// the setting. A misspelt name is not detected (docs/sql-only.md).
async fn sql_only_settings_reject_nonsense_values_at_use(c: &tokio_postgres::Client) {
    for (set, setting) in [
        ("SET outbox.max_retry = 'many'", "outbox.max_retry"),
        ("SET outbox.max_retry = -1", "outbox.max_retry"),
        (
            "SET outbox.backoff_base = '5 parsecs'",
            "outbox.backoff_base",
        ),
        ("SET outbox.backoff_base = 0", "outbox.backoff_base"),
        ("SET outbox.backoff_jitter = 1.5", "outbox.backoff_jitter"),
        ("SET outbox.lease = '-10min'", "outbox.lease"),
        ("SET outbox.max_claim = 0", "outbox.max_claim"),
        (
            "SET outbox.max_payload_bytes = '1kB per day'",
            "outbox.max_payload_bytes",
        ),
        ("SET outbox.notify = 'sometimes'", "outbox.notify"),
        (
            "SET outbox.head_of_line = 'sometimes'",
            "outbox.head_of_line",
        ),
    ] {
        c.batch_execute(&format!("RESET ALL; {set}"))
            .await
            .unwrap_or_else(|e| panic!("{set}: {e}"));
        for call in [
            "SELECT * FROM outbox_config()",
            "SELECT * FROM outbox_claim('r', 1)",
        ] {
            let (code, message) = db_error(c.query(call, &[]).await);
            assert_eq!(code, "22023", "{set}; {call}: {message}");
            assert!(message.contains(setting), "{set}; {call}: {message}");
        }
    }
    c.batch_execute("RESET ALL; SET outbox.max_retries = 3")
        .await
        .unwrap();
    c.query("SELECT * FROM outbox_config()", &[])
        .await
        .expect("a misspelt name is not detected in the SQL-only build");
    c.batch_execute("RESET ALL; SET outbox.lease = '30s'; SET outbox.backoff_max = '2h'")
        .await
        .unwrap();
    let r = c
        .query_one(
            "SELECT current_setting('outbox.lease'), current_setting('outbox.backoff_max'), \
                    lease_ms, backoff_max_ms FROM outbox_config()",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(
        (
            r.get::<_, String>(0),
            r.get::<_, String>(1),
            r.get::<_, i64>(2),
            r.get::<_, i64>(3)
        ),
        ("30s".into(), "2h".into(), 30_000, 7_200_000)
    );
}

/// A claim never hands out its own transaction's events: in a transaction that has written (here
/// an enqueue: delayed and due by the claim, keyed, or plain) it is refused with 25001 and its
/// hint names the rule, so the events can never go out and then vanish with a rollback.
#[tokio::test]
async fn claim_in_a_transaction_that_wrote_is_refused() {
    let db = TestDb::create();
    let c = db.connect().await;
    for enqueue in [
        "SELECT outbox_enqueue('t.a', '{\"n\":1}', deliver_at => clock_timestamp() + interval '50 ms')",
        "SELECT outbox_enqueue('t.a', '{\"n\":1}', key => 'k')",
        "SELECT outbox_enqueue('t.a', '{\"n\":1}')",
    ] {
        c.batch_execute(&format!("BEGIN; {enqueue}; SELECT pg_sleep(0.1)"))
            .await
            .unwrap();
        let err = c
            .query("SELECT id, status::text FROM outbox_claim('r', 10)", &[])
            .await
            .expect_err("a claim after a write in the same transaction");
        let e = err.as_db_error().expect("a server error");
        assert_eq!(e.code().code(), "25001", "{enqueue}: {}", e.message());
        assert!(e.message().contains("already written"), "{}", e.message());
        assert!(
            e.hint().unwrap_or("").contains("one claim per transaction"),
            "{:?}",
            e.hint()
        );
        c.batch_execute("ROLLBACK").await.unwrap();
    }
    assert_eq!(row_count(&c).await, 0, "every enqueue was rolled back");

    // First in its transaction, a claim runs; committed, its events are the committed ones.
    let id: i64 = scalar(&c, "SELECT outbox_enqueue('t.a', '{\"n\":2}')", &[]).await;
    c.batch_execute("BEGIN").await.unwrap();
    let claimed: Vec<i64> = c
        .query("SELECT id FROM outbox_claim('r', 10)", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    c.batch_execute("COMMIT").await.unwrap();
    assert_eq!(claimed, [id]);
}

/// docs/reference.md's settings table lists every registered setting with its default and who may
/// set it (the native build registers them; the SQL-only build has none to compare).
#[tokio::test]
async fn the_documented_settings_are_the_registered_ones() {
    if build::sql_only() {
        return;
    }
    let db = TestDb::create();
    let c = db.connect().await;
    c.batch_execute("LOAD 'outbox'").await.unwrap();
    let registered: std::collections::BTreeMap<String, (String, String)> = c
        .query(
            "SELECT name, current_setting(name), context FROM pg_settings
              WHERE name LIKE 'outbox.%'",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), (r.get(1), r.get(2))))
        .collect();
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/reference.md");
    let page = std::fs::read_to_string(path).unwrap();
    let rows: Vec<Vec<&str>> = page
        .lines()
        .skip_while(|l| !l.starts_with("## Settings"))
        .skip(1)
        .take_while(|l| !l.starts_with("## "))
        .filter(|l| l.starts_with("| `outbox."))
        .map(|l| l.trim_matches('|').split(" | ").map(str::trim).collect())
        .collect();
    let documented: std::collections::BTreeSet<String> = rows
        .iter()
        .map(|r| r[0].trim_matches('`').to_string())
        .collect();
    let names: std::collections::BTreeSet<String> = registered.keys().cloned().collect();
    assert_eq!(
        documented, names,
        "reference.md, Settings: rows vs registered settings"
    );
    for r in rows {
        let (shown, context) = &registered[r[0].trim_matches('`')];
        let default = r[1].split_whitespace().next().unwrap_or("");
        assert!(
            default == shown
                || format!("{default}B") == *shown
                || (shown.is_empty() && default == "empty"),
            "reference.md, Settings: {} defaults to {shown:?}, the table says {:?}",
            r[0],
            r[1]
        );
        let who = if context == "superuser" {
            "superusers"
        } else {
            "anyone"
        };
        assert!(
            r[2].starts_with(who),
            "reference.md, Settings: who may set {} ({context})",
            r[0]
        );
    }
}
