//! Operator commands: stats, dead-letters, blocked, relays, requeue, skip, purge, inbox stats.

use outbox_tests::db::TestDb;
use outbox_tests::events::status_counts;
use outbox_tests::relay::run_cmd;
use outbox_tests::roles::Roles;

fn ok(args: &[&str]) -> String {
    let out = run_cmd(args);
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A scratch database where the first nack makes a dead letter (`outbox.max_retry = 0`).
async fn first_failure_kills() -> (TestDb, String, tokio_postgres::Client) {
    let db = TestDb::create();
    let url = db.url();
    db.set(&[("outbox.max_retry", "0")]);
    let client = db.connect().await;
    (db, url, client)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_dead_letters_requeue_and_purge() {
    let (_db, url, client) = first_failure_kills().await;
    // 3 delivered, 2 dead letters (max_retry 0: the first nack kills), 1 waiting. One
    // transaction per statement: a claim hands out committed events only.
    for step in [
        "SELECT outbox_enqueue('orders', jsonb_build_object('n', g)) FROM generate_series(1, 3) g",
        "SELECT outbox_ack('t', c.claim_token, array_agg(c.id) OVER ()) FROM outbox_claim('t', 3) c LIMIT 1",
        "SELECT outbox_enqueue('bad.topic', '{\"x\":1}', key => 'K1', event_type => 'E')",
        "SELECT outbox_enqueue('bad.topic', '{\"x\":2}', key => 'K2', event_type => 'E')",
        "SELECT outbox_nack('t', min(c.claim_token), array_agg(c.id), 'topic bad.topic does not exist') FROM outbox_claim('t', 2) c",
        "SELECT outbox_enqueue('orders', '{}', deliver_at => now() + interval '1 hour')",
    ] {
        client.batch_execute(step).await.expect(step);
    }
    let c = status_counts(&client).await;
    assert_eq!((c["SUCCESS"], c["FAIL"], c["WAIT"]), (3, 2, 1), "{c:?}");

    let v: serde_json::Value =
        serde_json::from_str(ok(&["stats", "--json", "--database-url", &url]).trim())
            .expect("json");
    assert_eq!(v["failed"], 2);
    assert_eq!(v["delayed_wait"], 1);
    assert_eq!(v["due_wait"], 0);
    assert_eq!(v["sending"], 0);
    let text = ok(&["stats", "--database-url", &url]);
    assert!(
        text.contains("failed") && text.contains("due_wait"),
        "{text}"
    );

    let text = ok(&["dead-letters", "--database-url", &url]);
    assert!(
        text.contains("bad.topic") && text.contains("does not exist"),
        "{text}"
    );
    assert!(text.contains("(2 dead letters)"), "{text}");
    let lines: Vec<serde_json::Value> = ok(&[
        "dead-letters",
        "--json",
        "--limit",
        "1",
        "--database-url",
        &url,
    ])
    .lines()
    .map(|l| serde_json::from_str(l).expect("json"))
    .collect();
    assert_eq!(lines.len(), 1);
    assert_eq!(lines[0]["key"], "K1");
    assert_eq!(lines[0]["payload"]["x"], 1);
    let first = lines[0]["id"].as_i64().expect("id");

    // Requeue one by id (an unknown id is not counted), then the rest with --all.
    let out = ok(&[
        "requeue",
        "--database-url",
        &url,
        &first.to_string(),
        "999999",
    ]);
    assert!(out.contains("requeued 1 of 2"), "{out}");
    let out = ok(&["requeue", "--all", "--database-url", &url]);
    assert!(out.contains("requeued 1 of 1"), "{out}");
    let c = status_counts(&client).await;
    assert_eq!((c["FAIL"], c["WAIT"]), (0, 3), "{c:?}");

    // Purge: delivered rows only.
    let out = ok(&[
        "purge",
        "--older-than",
        "0s",
        "--max-rows",
        "2",
        "--database-url",
        &url,
    ]);
    assert!(out.contains("purged 3"), "{out}");
    let c = status_counts(&client).await;
    assert_eq!((c["SUCCESS"], c["WAIT"]), (0, 3), "{c:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocked_lists_keys_behind_a_dead_head_and_skip_lets_them_go_on() {
    let (_db, url, client) = first_failure_kills().await;
    // K1's head dies (max_retry 0); two more K1 events wait behind it; K2 is delivered. One
    // transaction per statement: a claim never hands out its own transaction's fresh events.
    for step in [
        "SELECT outbox_enqueue('orders', '{\"n\":1}', key => 'K1')",
        "SELECT outbox_nack('t', c.claim_token, ARRAY[c.id], 'too large') FROM outbox_claim('t', 1) c",
        "SELECT outbox_enqueue('orders', jsonb_build_object('n', g), key => 'K1') FROM generate_series(2, 3) g",
        "SELECT outbox_enqueue('orders', '{}', key => 'K2')",
        "SELECT outbox_ack('t', min(c.claim_token), array_agg(c.id)) FROM outbox_claim('t', 10) c",
    ] {
        client.batch_execute(step).await.expect("set-up");
    }

    let v: serde_json::Value =
        serde_json::from_str(ok(&["stats", "--json", "--database-url", &url]).trim())
            .expect("json");
    assert_eq!(v["blocked_keys"], 1, "{v}");
    let lines: Vec<serde_json::Value> = ok(&["blocked", "--json", "--database-url", &url])
        .lines()
        .map(|l| serde_json::from_str(l).expect("json"))
        .collect();
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(
        (
            &lines[0]["key"],
            &lines[0]["waiting"],
            &lines[0]["last_error"]
        ),
        (&"K1".into(), &2.into(), &"too large".into())
    );
    let head = lines[0]["head_id"].as_i64().expect("head_id");
    let text = ok(&["blocked", "--database-url", &url]);
    assert!(text.contains("(1 blocked keys"), "{text}");

    assert_eq!(
        ok(&["skip", "--database-url", &url, &head.to_string()]).trim(),
        "skipped 1 of 1 dead letters"
    );
    let n: i64 =
        outbox_tests::db::scalar(&client, "SELECT count(*) FROM outbox_claim('t', 10)", &[]).await;
    assert_eq!(n, 2, "K1 goes on without its skipped head");
    let out = run_cmd(&["skip", "--database-url", &url]);
    assert!(!out.status.success(), "skip without ids must fail");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_lists_each_owner_alive_gone_or_without_heartbeat_and_what_it_holds() {
    let db = TestDb::create();
    let url = db.url();
    let client = db.connect().await;
    // relay-live beats and holds 2 events (a scheduled row and a stream event), relay-gone said it
    // stopped and holds 1, a script that never beat holds 1; relay-idle beats and holds nothing.
    for step in [
        "SELECT outbox_enqueue('orders', '{\"n\":1}', deliver_at => now() + interval '1 hour')",
        "UPDATE outbox_scheduled SET next_retry_time = now() - interval '1 second'",
        "SELECT outbox_enqueue('orders', '{\"n\":2}')",
        "SELECT outbox_heartbeat('relay-live', '1 hour'), outbox_heartbeat('relay-idle', '1 hour'), \
                outbox_heartbeat('relay-gone', '1 hour')",
        "SELECT count(*) FROM outbox_claim('relay-live', 10)",
        "SELECT outbox_enqueue('orders', '{\"n\":3}')",
        "SELECT count(*) FROM outbox_claim('relay-gone', 10)",
        "SELECT outbox_heartbeat('relay-gone', '0 seconds')",
        "SELECT outbox_enqueue('orders', '{\"n\":4}')",
        "SELECT count(*) FROM outbox_claim('a-script', 10)",
    ] {
        client.batch_execute(step).await.expect(step);
    }
    let lines: Vec<serde_json::Value> = ok(&["relays", "--json", "--database-url", &url])
        .lines()
        .map(|l| serde_json::from_str(l).expect("json"))
        .collect();
    let got: Vec<(String, String, i64, bool)> = lines
        .iter()
        .map(|l| {
            (
                l["owner"].as_str().expect("owner").to_string(),
                l["state"].as_str().expect("state").to_string(),
                l["held"].as_i64().expect("held"),
                l["oldest_claim_age_seconds"].is_number(),
            )
        })
        .collect();
    let want = [
        ("a-script", "no heartbeat", 1, true),
        ("relay-gone", "gone", 1, true),
        ("relay-idle", "alive", 0, false),
        ("relay-live", "alive", 2, true),
    ]
    .map(|(o, s, n, c)| (o.to_string(), s.to_string(), n, c));
    assert_eq!(got, want);
    assert!(
        lines[3]["last_beat_age_seconds"]
            .as_f64()
            .expect("beat age")
            < 60.0,
        "{lines:?}"
    );
    let text = ok(&["relays", "--database-url", &url]);
    assert!(
        text.contains("relay-live") && text.contains("(4 relays;"),
        "{text}"
    );
    let out = run_cmd(&["relays", "--limit", "0", "--database-url", &url]);
    assert!(!out.status.success(), "a limit of 0 must fail");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("max_rows must be between 1 and 100000"),
        "{err}"
    );
}

/// `inbox stats` as the recipe's admin: one line per consumer with its size, in text and JSON.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_stats_lists_each_consumer_with_its_size() {
    let roles;
    let db = TestDb::create();
    roles = Roles::create(&db, &["audit"]);
    let [consumer, audit, admin] = ["consumer", "audit", "admin"].map(|k| roles.name(k));
    let client = db.connect().await;
    client
        .batch_execute(&format!(
            "SELECT outbox_inbox_accept('{consumer}', gen_random_uuid()) FROM generate_series(1, 3);
             SELECT outbox_inbox_accept('{audit}', gen_random_uuid());
             ALTER ROLE {admin} LOGIN"
        ))
        .await
        .unwrap();
    let url = format!("{} user={admin}", db.url());
    let sizes: Vec<(String, i64)> = ok(&["inbox", "stats", "--json", "--database-url", &url])
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("a JSON line");
            (
                v["consumer"].as_str().unwrap().to_string(),
                v["events"].as_i64().unwrap(),
            )
        })
        .collect();
    let mut want = vec![(audit.clone(), 1), (consumer.clone(), 3)];
    want.sort();
    assert_eq!(sizes, want);
    let text = ok(&["inbox", "stats", "--database-url", &url]);
    assert!(
        text.lines()
            .any(|l| l.starts_with(&consumer) && l.contains(" 3 ")),
        "{text}"
    );
}
