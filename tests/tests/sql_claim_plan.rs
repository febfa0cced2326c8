//! outbox_claim's plan on EVERY call of a long-lived relay session, not only on a fresh one: a
//! claim must read about as many rows of outbox_scheduled as it returns, however big the backlog has
//! grown since the last ANALYZE. The backlog is of scheduled rows (retries and delayed events,
//! claimed through the status indexes); fresh unordered events are outbox_stream's, handed out by
//! its cursor, whose claim reads no status index.
//!
//! PL/pgSQL caches the claim statement: the first five executions in a session get custom plans
//! (planned for the actual `max_events` and `stamp`), later ones may get a generic plan. Either
//! kind can join the claimed ids against every WAIT row (a hash join whose hash table holds the
//! whole backlog): the planner cannot know that the ids it joins are all WAIT rows, so when a
//! batch is a sizeable part of the backlog, hashing the backlog looks cheaper than one primary-key
//! probe per id. That read grows with the backlog instead of the batch and spills once the backlog
//! outgrows work_mem. auto_explain, loaded in the relay's session with its plans sent to the
//! client as NOTICEs, shows the plan each call really ran.
//!
//! Buffers are printed but are not the yardstick: the UPDATE's own writes (row lock, new row
//! version, two index entries) cost ~15 buffers per claimed row, so a 2,000-row batch touches more
//! buffers than the whole table has pages, whatever the plan. Rows read are proportional or not.

use std::sync::{Arc, Mutex};

use outbox_tests::build;
use outbox_tests::db::{connect_with_notices, scalar, TestDb};
use serde_json::Value;
use tokio_postgres::Client;

/// The session's notices, as `connect_with_notices` collects them.
type Notices = Arc<Mutex<Vec<String>>>;

/// Due WAIT rows when the statistics are taken (the only ANALYZE of a test).
const BACKLOG: i32 = 20_000;
const BATCH: i32 = 2_000;
/// Enqueued between two claims: the backlog outgrows what the statistics say (to ~220k rows).
const GROWTH: i32 = 20_000;
/// Well past the five custom plans after which the plan cache may go generic.
const CALLS: usize = 12;
/// A claim reads each claimed row twice (pick and lock it, then update it by id): allow 3x.
const MAX_ROWS_READ: i64 = 3 * BATCH as i64;

/// What one claim's UPDATE statement ran, from its auto_explain plan.
struct ClaimPlan {
    /// The plan below the UPDATE, without the InitPlan that picks and locks the due ids.
    shape: String,
    /// Planned for unknown parameters: the due scan compares with `$n`, not the call's clock.
    generic: bool,
    /// Rows the statement read from outbox_scheduled, over all scan nodes and loops.
    rows_read: i64,
    /// Shared hit + read blocks of the UPDATE (which includes its children).
    buffers: i64,
    temp_blocks: i64,
    seq_scan_on_events: bool,
}

/// `history` SUCCESS rows and a due WAIT backlog inserted directly into outbox_scheduled (as
/// superuser), then ANALYZE once. Autovacuum is off for the table: no ANALYZE or VACUUM happens
/// between the claims.
fn seed(db: &TestDb, history: i32) {
    db.psql(&format!(
        "ALTER TABLE outbox_scheduled SET (autovacuum_enabled = off);
         INSERT INTO outbox_scheduled (topic, payload, status, next_retry_time, created_at, updated_at)
         SELECT 'orders', jsonb_build_object('n', g, 'pad', repeat('x', 200)), 'SUCCESS',
                now() - interval '2 days', now() - interval '2 days', now() - interval '2 days'
           FROM generate_series(1, {history}) g;
         INSERT INTO outbox_scheduled (topic, payload, status, next_retry_time)
         SELECT 'orders', jsonb_build_object('n', g), 'WAIT', now() - interval '1 hour'
           FROM generate_series(1, {BACKLOG}) g;"
    ));
    db.psql("VACUUM ANALYZE outbox_scheduled");
}

/// A test database with `history` SUCCESS rows and the analyzed backlog.
fn queue_db(history: i32) -> TestDb {
    let db = TestDb::create();
    seed(&db, history);
    db
}

/// Grows the scheduled backlog through the API: events with a deliver_at are scheduled rows, and one
/// millisecond ahead they are due by the next claim (an event due now would go to the stream).
async fn enqueue(c: &Client, n: i32) {
    c.execute(
        "SELECT count(outbox_enqueue('orders', jsonb_build_object('n', g), \
                                     deliver_at => now() + interval '1 millisecond')) \
         FROM generate_series(1, $1) g",
        &[&n],
    )
    .await
    .unwrap();
}

/// Every statement of this session, nested ones included, reports its executed plan as a NOTICE.
async fn log_plans_as_notices(c: &Client) {
    c.batch_execute(
        "LOAD 'auto_explain';
         SET auto_explain.log_min_duration = 0;
         SET auto_explain.log_nested_statements = on;
         SET auto_explain.log_analyze = on;
         SET auto_explain.log_buffers = on;
         SET auto_explain.log_timing = off;
         SET auto_explain.log_format = json;
         SET auto_explain.log_level = notice;",
    )
    .await
    .unwrap();
}

/// Claims a batch as 'relay' and returns the plan of the claim's UPDATE, drained from `notices`.
async fn claim_and_explain(c: &Client, notices: &Notices) -> ClaimPlan {
    let claimed: i64 = scalar(
        c,
        "SELECT count(*) FROM outbox_claim('relay', $1)",
        &[&BATCH],
    )
    .await;
    assert_eq!(
        claimed,
        i64::from(BATCH),
        "the backlog always holds a batch"
    );
    // Notices precede the statement's result on the wire, so they are all queued by now.
    // The claim's UPDATE of outbox_scheduled (the stream's part writes other tables).
    let is_update =
        |n: &Value| n["Node Type"] == "ModifyTable" && n["Relation Name"] == "outbox_scheduled";
    let mut claim = None;
    for text in std::mem::take(&mut *notices.lock().unwrap()) {
        let Some(json) = text.find('{').map(|at| &text[at..]) else {
            continue;
        };
        let explain: Value = serde_json::from_str(json).unwrap();
        if find_node(&explain["Plan"], &is_update).is_some() {
            claim = Some(explain["Plan"].clone());
        }
    }
    let statement = claim.expect("auto_explain reported the claim's UPDATE");
    let update = find_node(&statement, &is_update).unwrap();
    let field = |key: &str| update[key].as_i64().unwrap_or(0);
    ClaimPlan {
        shape: children(update)
            .filter(|c| c["Parent Relationship"] != "InitPlan")
            .map(shape)
            .collect(),
        generic: find_node(&statement, &|n| {
            n["Index Name"] == "outbox_scheduled_wait_due_idx"
                && n["Index Cond"].as_str().is_some_and(|c| c.contains('$'))
        })
        .is_some(),
        rows_read: rows_read(&statement),
        buffers: field("Shared Hit Blocks") + field("Shared Read Blocks"),
        temp_blocks: field("Temp Read Blocks") + field("Temp Written Blocks"),
        seq_scan_on_events: find_node(&statement, &|n| {
            n["Node Type"] == "Seq Scan" && n["Relation Name"] == "outbox_scheduled"
        })
        .is_some(),
    }
}

fn children(node: &Value) -> impl Iterator<Item = &Value> {
    node["Plans"].as_array().into_iter().flatten()
}

fn find_node<'a>(node: &'a Value, pred: &dyn Fn(&Value) -> bool) -> Option<&'a Value> {
    if pred(node) {
        return Some(node);
    }
    children(node).find_map(|c| find_node(c, pred))
}

/// The plan tree in one line, e.g. `Hash Join(CTE Scan due, Hash(Seq Scan outbox_scheduled))`.
fn shape(node: &Value) -> String {
    let mut s = node["Node Type"].as_str().unwrap_or("?").to_string();
    if let Some(name) = ["Index Name", "Relation Name", "CTE Name"]
        .iter()
        .find_map(|key| node[*key].as_str())
    {
        s = format!("{s} {name}");
    }
    let inner: Vec<String> = children(node).map(shape).collect();
    if inner.is_empty() {
        s
    } else {
        format!("{s}({})", inner.join(", "))
    }
}

/// Rows every scan of outbox_scheduled produced or filtered away, times its loops.
fn rows_read(node: &Value) -> i64 {
    let n = |key: &str| node[key].as_i64().unwrap_or(0);
    let scan = node["Node Type"]
        .as_str()
        .is_some_and(|t| t.ends_with("Scan"));
    let own = if scan && node["Relation Name"] == "outbox_scheduled" {
        (n("Actual Rows") + n("Rows Removed by Filter") + n("Rows Removed by Index Recheck"))
            * n("Actual Loops")
    } else {
        0
    };
    own + children(node).map(rows_read).sum::<i64>()
}

/// Which outbox_claim the test runs: extension version and the function's SET options.
async fn claim_function(c: &Client) -> String {
    let version = if build::sql_only() {
        "(SELECT outbox_sql_only_version() || ' (SQL-only build)')"
    } else {
        "(SELECT extversion FROM pg_extension WHERE extname = 'outbox')"
    };
    scalar(
        c,
        &format!(
            "SELECT format('outbox %s, outbox_claim SET %s', {version}, p.proconfig) \
             FROM pg_proc p WHERE p.oid = 'outbox_claim(text, int)'::regprocedure"
        ),
        &[],
    )
    .await
}

/// Twelve claims of 2,000 rows in one relay session while a producer grows the backlog by
/// 20,000 rows between them; prints and checks each claim's plan.
async fn claims_stay_proportional(history: i32) {
    let db = queue_db(history);
    let producer = db.connect().await;
    let (relay, notices) = connect_with_notices(&db.url()).await;
    log_plans_as_notices(&relay).await;

    let mut plans = Vec::new();
    let mut report = format!(
        "{}: claims of {BATCH} rows, history of {history} SUCCESS rows\n",
        claim_function(&producer).await
    );
    for call in 1..=CALLS {
        let wait: i64 = scalar(
            &producer,
            "SELECT count(*) FROM outbox_event WHERE status = 'WAIT'",
            &[],
        )
        .await;
        let plan = claim_and_explain(&relay, &notices).await;
        report += &format!(
            "call {call:2}: backlog {wait:6}, read {:6} rows, {:5} buffers, {:3} temp blocks, \
             {:7} plan: {}\n",
            plan.rows_read,
            plan.buffers,
            plan.temp_blocks,
            if plan.generic { "generic" } else { "custom" },
            plan.shape
        );
        plans.push(plan);
        enqueue(&producer, GROWTH).await;
    }
    // One block per test: the two tests run in parallel.
    println!("{report}");

    // The first call ran a custom plan on fresh statistics.
    let first_buffers = plans[0].buffers;
    for (call, plan) in (1..).zip(&plans) {
        let what = format!("history {history}, call {call}: {}", plan.shape);
        assert!(
            plan.rows_read <= MAX_ROWS_READ,
            "{what} read {} rows for a batch of {BATCH}",
            plan.rows_read
        );
        assert!(!plan.seq_scan_on_events, "{what} scanned the whole table");
        assert_eq!(plan.temp_blocks, 0, "{what} spilled to disk");
        assert!(
            plan.buffers <= 3 * first_buffers,
            "{what} touched {} buffers, the first call {first_buffers}",
            plan.buffers
        );
    }
}

/// A long history (the table is ~11x the backlog): the planner reaches the backlog through the
/// partial index, but may still hash every WAIT row.
#[tokio::test]
async fn claims_read_rows_in_proportion_to_the_batch_with_a_long_history() {
    claims_stay_proportional(200_000).await;
}

/// A short history (the table is ~2x the backlog): a Seq Scan of the table competes.
#[tokio::test]
async fn claims_read_rows_in_proportion_to_the_batch_with_a_short_history() {
    claims_stay_proportional(20_000).await;
}

/// The scans of outbox_scheduled below the UPDATE of the first statement `notices` reported that
/// updates outbox_scheduled (ack, nack, renew and release settle scheduled rows through one such
/// UPDATE).
fn settle_scans(notices: &Notices) -> Vec<String> {
    for text in std::mem::take(&mut *notices.lock().unwrap()) {
        let Some(json) = text.find('{').map(|at| &text[at..]) else {
            continue;
        };
        let explain: Value = serde_json::from_str(json).unwrap();
        let is_update =
            |n: &Value| n["Node Type"] == "ModifyTable" && n["Relation Name"] == "outbox_scheduled";
        if let Some(update) = find_node(&explain["Plan"], &is_update) {
            let mut scans = Vec::new();
            collect_scans(update, &mut scans);
            return scans;
        }
    }
    panic!("auto_explain reported no UPDATE of outbox_scheduled");
}

fn collect_scans(node: &Value, out: &mut Vec<String>) {
    if node["Relation Name"] == "outbox_scheduled" && node["Node Type"] != "ModifyTable" {
        out.push(shape(node));
    }
    children(node).for_each(|c| collect_scans(c, out));
}

/// Ack (both forms), nack, renew and release take their row locks in the UPDATE itself (no SELECT ... FOR
/// UPDATE first, which cost a WAL record per row), so the one lock order (id order) rests on the
/// UPDATE walking the primary key with the sorted ids: never the lease index (claimed_at, then
/// block order), a bitmap (block order) or a sequential scan. Checked with statistics that say no
/// row is SENDING (the steady state, where the lease index looks cheapest), many are, and a batch
/// is all the SENDING rows there are.
#[tokio::test]
async fn settles_lock_rows_through_the_primary_key() {
    let db = queue_db(20_000);
    let (relay, notices) = connect_with_notices(&db.url()).await;
    let mut tokens = Vec::new();
    for _ in 0..BACKLOG / BATCH {
        let rows = relay
            .query(
                "SELECT id, claim_token FROM outbox_claim('relay', $1)",
                &[&BATCH],
            )
            .await
            .unwrap();
        let ids: Vec<i64> = rows.iter().map(|r| r.get(0)).collect();
        tokens.push((rows[0].get::<_, i64>(1), ids));
    }
    log_plans_as_notices(&relay).await;

    let settles = [
        "SELECT outbox_ack('relay', $1, $2)",
        "SELECT outbox_nack('relay', $1, $2, 'x')",
        "SELECT outbox_renew('relay', $1, $2)",
        "SELECT outbox_release('relay', $1, $2)",
        "SELECT count(*) FROM outbox_ack_returning('relay', $1, $2)",
    ];
    let check = |what: String, scans: Vec<String>| {
        assert!(!scans.is_empty(), "{what}: no scan of outbox_scheduled");
        for scan in scans {
            assert_eq!(scan, "Index Scan outbox_scheduled_pkey", "{what}");
        }
    };
    let analyze = || relay.batch_execute("ANALYZE outbox_scheduled");
    // Each kind on 250 ids of its own batch, first with the seed's statistics (no SENDING row),
    // then with fresh ones (20,000 SENDING rows); the rest of the batch is acked.
    for (stats, range) in [("no SENDING row", 0..250), ("20,000 SENDING", 250..500)] {
        for (sql, (token, ids)) in settles.iter().zip(&tokens) {
            relay
                .execute(*sql, &[token, &ids[range.clone()].to_vec()])
                .await
                .unwrap();
            check(
                format!("{sql}, statistics: {stats}"),
                settle_scans(&notices),
            );
        }
        analyze().await.unwrap();
        notices.lock().unwrap().clear();
    }
    for (token, ids) in &tokens[..tokens.len() - 1] {
        relay.execute(settles[0], &[token, ids]).await.unwrap();
    }
    // Only the last batch is SENDING, and the statistics say so.
    analyze().await.unwrap();
    notices.lock().unwrap().clear();
    let (token, ids) = tokens.last().unwrap();
    for sql in [settles[2], settles[0]] {
        relay.execute(sql, &[token, ids]).await.unwrap();
        check(
            format!("{sql}, the {BATCH} SENDING rows"),
            settle_scans(&notices),
        );
    }
}
