//! Faults: graceful stop during a burst, a crashed relay whose claims another relay reclaims (after
//! the lease, or at once when the crashed relay stops beating), a relay stuck on the broker that
//! keeps its claims, an unknown topic, a paused and a restarted broker (broker outages and dead
//! letters: relay_outage.rs).

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use outbox_tests::broker::Broker;
use outbox_tests::db::TestDb;
use outbox_tests::events::{
    assert_succeeded_arrived, enqueue, enqueue_burst, ids_in, status_counts, wait_counts,
};
use outbox_tests::relay::Relay;
use outbox_tests::sinks::TestSink;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_a_burst_settles_every_claimed_row() {
    sigterm_settles(TestSink::kafka()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_a_burst_settles_every_claimed_row_nats() {
    sigterm_settles(TestSink::nats()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_a_burst_settles_every_claimed_row_rocketmq() {
    sigterm_settles(TestSink::rocketmq()).await;
}

async fn sigterm_settles(broker: TestSink) {
    let db = TestDb::create();
    broker.create_topic("orders");
    let client = db.connect().await;
    let n = 20_000i64;
    enqueue_burst(&client, "orders", n).await;
    let mut worker = broker.spawn_relay(&db.url(), &["--batch-size", "500", "--concurrency", "2"]);
    let c = wait_counts(&client, Duration::from_secs(30), |c| c["SUCCESS"] > 0).await;
    assert!(c["SUCCESS"] > 0, "nothing delivered: {}", worker.logs());
    worker.signal(libc::SIGTERM);
    let st = worker
        .wait_exit(Duration::from_secs(20))
        .unwrap_or_else(|| panic!("worker did not exit after SIGTERM: {}", worker.logs()));
    assert!(st.success(), "exit status {st}: {}", worker.logs());
    let counts = status_counts(&client).await;
    assert_eq!(
        counts["SENDING"], 0,
        "SENDING rows left after a graceful stop: {counts:?}"
    );
    assert_eq!(counts["SUCCESS"] + counts["WAIT"], n, "{counts:?}");
    assert!(
        counts["WAIT"] > 0,
        "the burst should not have finished before SIGTERM: {counts:?}"
    );
    assert!(worker.logs().contains("relay stopped"), "{}", worker.logs());

    // Every acked row really is on the broker.
    let acked: BTreeSet<i64> = ids_in(&client, "SUCCESS").await.into_iter().collect();
    let got: BTreeSet<i64> = broker
        .consume_all("orders", Duration::from_secs(3))
        .iter()
        .map(|m| m.outbox_id())
        .collect();
    let missing: Vec<_> = acked.difference(&got).take(10).collect();
    assert!(
        missing.is_empty(),
        "acked but not on the broker: {missing:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_relay_claims_are_reclaimed_and_delivered_by_another() {
    let db = TestDb::create();
    let broker = Broker::start();
    broker.create_topic("orders");
    let client = db.connect().await;
    let n = 300i64;
    enqueue_burst(&client, "orders", n).await;

    // A never beats, like a hand-written claimer: only the lease frees its claims.
    let held_ids = kill_relay_a_holding_claims(&db, &broker, &["--heartbeat-timeout", "0s"]).await;
    let held = held_ids.len() as i64;

    // Worker B with a short lease reclaims them (one failed attempt each) and delivers everything.
    let b = Relay::spawn(
        &db.url(),
        &broker.addr(),
        &[
            "--owner",
            "relay-b",
            "--lease",
            "4s",
            "--send-timeout",
            "1s",
            "--reclaim-interval",
            "300ms",
            "--poll-interval",
            "200ms",
        ],
    );
    let counts = wait_counts(&client, Duration::from_secs(30), |c| c["SUCCESS"] == n).await;
    assert_eq!(counts["SUCCESS"], n, "{counts:?}\n{}", b.logs());
    let reclaimed = b.wait_metric("outbox_reclaimed_total", Duration::from_secs(5), |v| {
        v >= held as f64
    });
    assert_eq!(reclaimed, Some(held as f64), "B reclaimed what A held");
    let retried: i64 = client
        .query_one(
            "SELECT count(*) FROM outbox_event WHERE id = ANY($1) AND retry_count >= 1",
            &[&held_ids],
        )
        .await
        .expect("query")
        .get(0);
    assert_eq!(retried, held, "a reclaim counts as one attempt");
    assert_succeeded_arrived(&client, &broker, "orders").await;
}

/// Starts relay-a (`extra` flags added) with the broker frozen, so that its claims stay open,
/// SIGKILLs it once it holds some, thaws the broker and returns the ids it held.
async fn kill_relay_a_holding_claims(db: &TestDb, broker: &Broker, extra: &[&str]) -> Vec<i64> {
    let client = db.connect().await;
    broker.freeze();
    let mut args = vec![
        "--owner",
        "relay-a",
        "--batch-size",
        "100",
        "--send-timeout",
        "30s",
        "--lease",
        "10m",
    ];
    args.extend_from_slice(extra);
    let mut a = Relay::spawn(&db.url(), &broker.addr(), &args);
    let c = wait_counts(&client, Duration::from_secs(20), |c| c["SENDING"] > 0).await;
    assert!(c["SENDING"] > 0, "relay A claimed nothing: {}", a.logs());
    a.signal(libc::SIGKILL);
    a.wait_exit(Duration::from_secs(5)).expect("A killed");
    let held = held_by(&client, "relay-a").await;
    assert!(!held.is_empty());
    broker.thaw();
    held
}

/// SENDING rows held by `owner`.
async fn held_by(client: &tokio_postgres::Client, owner: &str) -> Vec<i64> {
    client
        .query(
            "SELECT id FROM outbox_event WHERE status::text = 'SENDING' AND claim_owner = $1 ORDER BY id",
            &[&owner],
        )
        .await
        .expect("query")
        .iter()
        .map(|r| r.get(0))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_relay_claims_go_back_when_its_heartbeat_runs_out_not_its_lease() {
    let db = TestDb::create();
    let broker = Broker::start();
    broker.create_topic("orders");
    let client = db.connect().await;
    let n = 300i64;
    enqueue_burst(&client, "orders", n).await;

    // A claims, then is SIGKILLed (the OOM killer, a lost node).
    let held = kill_relay_a_holding_claims(&db, &broker, &["--heartbeat-timeout", "2s"]).await;

    // B has the same 10-minute lease: only A's silence can free A's claims within the test.
    let killed_at = Instant::now();
    let b = Relay::spawn(
        &db.url(),
        &broker.addr(),
        &[
            "--owner",
            "relay-b",
            "--lease",
            "10m",
            "--heartbeat-timeout",
            "2s",
            "--reclaim-interval",
            "300ms",
            "--poll-interval",
            "200ms",
        ],
    );
    let counts = wait_counts(&client, Duration::from_secs(60), |c| c["SUCCESS"] == n).await;
    assert_eq!(counts["SUCCESS"], n, "{counts:?}\n{}", b.logs());
    let reclaimed = b.wait_metric("outbox_reclaimed_total", Duration::from_secs(5), |v| {
        v >= held.len() as f64
    });
    assert_eq!(
        reclaimed,
        Some(held.len() as f64),
        "B reclaimed what A held"
    );
    let why: Vec<String> = client
        .query(
            "SELECT DISTINCT split_part(last_error, ' at ', 1) FROM outbox_event WHERE id = ANY($1)",
            &[&held],
        )
        .await
        .expect("query")
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(
        why,
        vec!["owner gone: claimed by relay-a"],
        "reclaimed because A stopped beating"
    );
    eprintln!(
        "A's {} claims delivered {:.1} s after it was killed (heartbeat timeout 2 s, lease 10 min)",
        held.len(),
        killed_at.elapsed().as_secs_f64()
    );
    assert_succeeded_arrived(&client, &broker, "orders").await;
}

/// Two live relays given one `--owner` (a copied configuration): the one started last takes the
/// owner over, and the first finds out at its next beat and stops with exit 2 and one line that
/// says why. The second goes on, and every event arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_whose_owner_another_relay_took_over_stops_with_exit_2() {
    let db = TestDb::create();
    let broker = Broker::start();
    broker.create_topic("orders");
    let client = db.connect().await;
    let args = [
        "--owner",
        "relay-twin",
        "--heartbeat-timeout",
        "2s",
        "--poll-interval",
        "200ms",
    ];
    let mut first = Relay::spawn(&db.url(), &broker.addr(), &args);
    first.wait_ready(Duration::from_secs(30));
    enqueue_burst(&client, "orders", 200).await;
    let mut second = Relay::spawn(&db.url(), &broker.addr(), &args);
    second.wait_ready(Duration::from_secs(30));

    let status = first.wait_exit(Duration::from_secs(10));
    assert_eq!(
        status.and_then(|s| s.code()),
        Some(2),
        "the first relay stops with exit 2\n{}",
        first.log_tail(20)
    );
    assert!(
        first
            .logs()
            .contains("another relay took over --owner relay-twin"),
        "{}",
        first.log_tail(20)
    );
    enqueue_burst(&client, "orders", 100).await;
    let counts = wait_counts(&client, Duration::from_secs(60), |c| c["SUCCESS"] == 300).await;
    assert_eq!(
        counts["SUCCESS"],
        300,
        "{counts:?}\n{}",
        second.log_tail(20)
    );
    assert!(second.is_running(), "the second relay goes on");
    assert_succeeded_arrived(&client, &broker, "orders").await;
}

/// A relay stopped (SIGTERM) after another process took its owner over, before a beat of its
/// loop found out: its last beat finds out, so it exits 2 and releases nothing, and the claims
/// the owner holds stay the new holder's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_stopped_after_its_owner_was_taken_over_releases_nothing() {
    let db = TestDb::create();
    let broker = Broker::start();
    broker.create_topic("orders");
    let client = db.connect().await;
    // Beats every 20 s: none falls between the take-over and the stop.
    let args = ["--owner", "relay-twin", "--heartbeat-timeout", "120s"];
    let mut relay = Relay::spawn(&db.url(), &broker.addr(), &args);
    relay.wait_ready(Duration::from_secs(30));

    // Frozen, the relay claims nothing while another process takes the owner over and claims.
    relay.signal(libc::SIGSTOP);
    // A claim it sent just before may still be on its way or running in the server: let it end.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let settled = Instant::now() + Duration::from_secs(10);
    while Instant::now() < settled {
        let busy: i64 = client
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
                 AND pid <> pg_backend_pid() AND state = 'active' AND query NOT LIKE '%outbox_wait%'",
                &[],
            )
            .await
            .expect("activity")
            .get(0);
        if busy == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    client
        .execute("SELECT outbox_heartbeat('relay-twin', '120 seconds')", &[])
        .await
        .expect("take over");
    enqueue_burst(&client, "orders", 5).await;
    let held: Vec<i64> = client
        .query("SELECT id FROM outbox_claim('relay-twin', 10)", &[])
        .await
        .expect("claim")
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(
        held.len(),
        5,
        "{:?}\n{}",
        status_counts(&client).await,
        relay.log_tail(20)
    );
    relay.signal(libc::SIGTERM);
    relay.signal(libc::SIGCONT);

    let status = relay.wait_exit(Duration::from_secs(30));
    assert_eq!(
        status.and_then(|s| s.code()),
        Some(2),
        "{}",
        relay.log_tail(20)
    );
    assert!(
        relay
            .logs()
            .contains("another relay took over --owner relay-twin"),
        "{}",
        relay.log_tail(20)
    );
    let counts = status_counts(&client).await;
    assert_eq!(
        counts["SENDING"], 5,
        "the new holder's claims stay: {counts:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_stuck_on_the_broker_keeps_its_claims_while_it_beats_and_says_when_it_stops() {
    let db = TestDb::create();
    let broker = Broker::start();
    broker.create_topic("orders");
    let client = db.connect().await;
    let n = 50i64;
    enqueue_burst(&client, "orders", n).await;

    broker.freeze();
    let mut a = Relay::spawn(
        &db.url(),
        &broker.addr(),
        &[
            "--owner",
            "relay-a",
            "--send-timeout",
            "30s",
            "--lease",
            "10m",
            "--heartbeat-timeout",
            "1s",
        ],
    );
    let c = wait_counts(&client, Duration::from_secs(20), |c| c["SENDING"] > 0).await;
    assert!(c["SENDING"] > 0, "A claimed nothing: {}", a.logs());
    let held = held_by(&client, "relay-a").await;
    let b = Relay::spawn(
        &db.url(),
        &broker.addr(),
        &[
            "--owner",
            "relay-b",
            "--lease",
            "10m",
            "--heartbeat-timeout",
            "1s",
            "--reclaim-interval",
            "200ms",
        ],
    );
    // Five heartbeat timeouts with a publish stuck in A: its beats go on, its claims stay.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(
        held_by(&client, "relay-a").await,
        held,
        "a live relay's claims were taken: {}",
        b.logs()
    );
    assert_eq!(b.metric("outbox_reclaimed_total"), Some(0.0));

    broker.thaw();
    let counts = wait_counts(&client, Duration::from_secs(30), |c| c["SUCCESS"] == n).await;
    assert_eq!(counts["SUCCESS"], n, "{counts:?}\n{}", a.logs());
    // A clean stop ends with a beat that says A is gone: anything it could not settle would be
    // reclaimed at once.
    let status = a.terminate(Duration::from_secs(30)).expect("A stops");
    assert!(status.success(), "{status:?}\n{}", a.logs());
    let gone: bool = client
        .query_one(
            "SELECT expires_at <= clock_timestamp() FROM outbox_owner WHERE owner = 'relay-a'",
            &[],
        )
        .await
        .expect("A's heartbeat row")
        .get(0);
    assert!(gone, "A's last beat says it stopped");
    let alive: bool = client
        .query_one(
            "SELECT expires_at > clock_timestamp() FROM outbox_owner WHERE owner = 'relay-b'",
            &[],
        )
        .await
        .expect("B's heartbeat row")
        .get(0);
    assert!(alive, "B still beats");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_topic_is_nacked_naming_the_topic_then_dead_lettered() {
    let db = TestDb::create();
    db.set(&[("outbox.backoff_base", "50ms"), ("outbox.max_retry", "1")]);
    let broker = Broker::start();
    broker.create_topic("orders");
    let client = db.connect().await;
    let good = enqueue(
        &client,
        "orders",
        "A",
        "T",
        &json!({"ok": true}),
        &BTreeMap::new(),
    )
    .await;
    let bad = enqueue(
        &client,
        "no-such-topic",
        "B",
        "T",
        &json!({"ok": false}),
        &BTreeMap::new(),
    )
    .await;
    let worker = Relay::spawn(
        &db.url(),
        &broker.addr(),
        &[
            "--poll-interval",
            "100ms",
            "--send-timeout",
            "1s",
            "--lease",
            "10s",
        ],
    );
    let c = wait_counts(&client, Duration::from_secs(30), |c| {
        c["FAIL"] == 1 && c["SUCCESS"] == 1
    })
    .await;
    assert_eq!(
        (c["SUCCESS"], c["FAIL"]),
        (1, 1),
        "{c:?}\n{}",
        worker.logs()
    );
    let row = client
        .query_one(
            "SELECT status::text, last_error FROM outbox_event WHERE id = $1",
            &[&bad.id],
        )
        .await
        .expect("query");
    assert_eq!(row.get::<_, String>(0), "FAIL");
    let err: String = row.get(1);
    assert!(
        err.contains("no-such-topic"),
        "error must name the topic: {err}"
    );
    assert!(
        worker
            .wait_log(
                &[
                    "ERROR",
                    "dead letter",
                    &format!("event {} ", bad.id),
                    "no-such-topic"
                ],
                Duration::from_secs(5)
            )
            .is_some(),
        "{}",
        worker.logs()
    );
    let got: Vec<i64> = broker
        .consume_all("orders", Duration::from_secs(2))
        .iter()
        .map(|m| m.outbox_id())
        .collect();
    assert_eq!(got, vec![good.id]);
}

/// Retries every 100 ms to 1 s, `max_retry` times: an outage of a few seconds then costs many
/// attempts, so a relay that counts broker-wide failures as the event's would dead-letter it.
fn retry_quickly(db: &TestDb, max_retry: i32) {
    db.set(&[
        ("outbox.backoff_base", "100ms"),
        ("outbox.backoff_max", "1s"),
        ("outbox.max_retry", &max_retry.to_string()),
    ]);
}

/// A broker pause longer than the send timeout: the events in flight time out (released, no
/// attempt counted) and are delivered once the broker answers again, so the pause does not burn
/// the backlog's retry budget.
///
/// Against tansu (the broker these tests used before Apache Kafka) such a pause left the relay
/// with a fenced producer (docs/fault-findings.md, finding 1). Apache Kafka does not fence it, so
/// no pause can make the relay's replacement of a fenced producer happen: librdkafka (2.12) answers
/// an in-flight timeout of its idempotent producer by draining the partitions and bumping the
/// epoch *itself* (`debug=eos` logs "All partitions drained, bumped epoch to
/// PID{Id:0,Epoch:1}", no request to the broker), and Kafka accepts a non-transactional
/// producer's higher epoch with its sequence starting over (tansu answered it with
/// ProducerFenced). librdkafka raises a fatal error only on a sequence desynchronisation that
/// Kafka does not produce, or when `enable.gapless.guarantee` is set:
/// `fatal_producer_error_replaces_the_producer` below uses that to make the replacement
/// deterministic. Here the pause must just not burn the backlog.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_pause_longer_than_send_timeout_does_not_burn_the_backlog() {
    let db = TestDb::create();
    retry_quickly(&db, 20);
    let broker = Broker::start();
    broker.create_topic("orders");
    let client = db.connect().await;
    let worker = Relay::spawn(
        &db.url(),
        &broker.addr(),
        &[
            "--send-timeout",
            "1s",
            "--lease",
            "5s",
            "--poll-interval",
            "100ms",
        ],
    );
    let n = 80i64;
    let producer = {
        let url = db.url();
        tokio::spawn(async move {
            let c = outbox_tests::db::connect(&url).await;
            for i in 0..n {
                enqueue(
                    &c,
                    "orders",
                    &format!("k{}", i % 7),
                    "T",
                    &json!({"i": i}),
                    &BTreeMap::new(),
                )
                .await;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    // Frozen once the relay delivered something (its producer is connected, with a producer id),
    // for four times the send timeout while events keep coming.
    let c = wait_counts(&client, Duration::from_secs(30), |c| c["SUCCESS"] >= 5).await;
    assert!(c["SUCCESS"] >= 5, "{c:?}\n{}", worker.logs());
    broker.freeze();
    tokio::time::sleep(Duration::from_secs(4)).await;
    broker.thaw();
    producer.await.expect("producer task");

    let counts = wait_counts(&client, Duration::from_secs(60), |c| c["SUCCESS"] == n).await;
    assert_eq!(counts["SUCCESS"], n, "{counts:?}\n{}", worker.logs());
    // The pause was felt (publishes failed) and cost no event an attempt.
    let transient = worker
        .metric_where("outbox_failed_total", r#"class="transient""#)
        .unwrap_or(0.0);
    assert!(
        transient >= 1.0,
        "no publish failed during the pause: {}",
        worker.logs()
    );
    assert_eq!(
        worker.metric_where("outbox_failed_total", r#"class="permanent""#),
        None,
        "{}",
        worker.logs()
    );
    let max_retry: i32 = client
        .query_one("SELECT max(retry_count) FROM outbox_event", &[])
        .await
        .expect("query")
        .get(0);
    assert_eq!(
        max_retry,
        0,
        "events churned through attempts: {}",
        worker.logs()
    );
    let got: BTreeSet<i64> = broker
        .consume_all("orders", Duration::from_secs(3))
        .iter()
        .map(|m| m.outbox_id())
        .collect();
    assert_eq!(got.len() as i64, n, "every event arrives");
}

/// A producer librdkafka declares fatally broken must be replaced, or every later publish fails.
/// Made deterministic against the real broker: with `enable.gapless.guarantee=true` librdkafka
/// raises a fatal error (`_GAPLESS_GUARANTEE`) as soon as the broker rejects a batch with a
/// permanent error, here a message above its topic's `max.message.bytes`. That event is the
/// event's own fault (nacked, an attempt counted, a dead letter in the end); every attempt breaks
/// the producer again. The events of a healthy topic committed afterwards can only be delivered
/// by a replacement: the broken producer refuses everything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fatal_producer_error_replaces_the_producer() {
    let db = TestDb::create();
    db.set(&[("outbox.backoff_base", "200ms"), ("outbox.max_retry", "3")]);
    let broker = Broker::start();
    broker.create_topic("orders");
    broker.create_topic_with("small", &[("max.message.bytes", "1024")]);
    let client = db.connect().await;
    let worker = Relay::spawn(
        &db.url(),
        &broker.addr(),
        &[
            "--send-timeout",
            "2s",
            "--lease",
            "10s",
            "--poll-interval",
            "100ms",
            "--kafka-property",
            "enable.gapless.guarantee=true",
        ],
    );
    let big = enqueue(
        &client,
        "small",
        "big",
        "T",
        &json!({"blob": "x".repeat(4000)}),
        &BTreeMap::new(),
    )
    .await;
    let replaced = |w: &Relay, reason: &str| {
        w.metric_where(
            "outbox_producer_replaced_total",
            &format!(r#"reason="{reason}""#),
        )
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while replaced(&worker, "fatal").unwrap_or(0.0) < 1.0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        replaced(&worker, "fatal"),
        Some(1.0),
        "the broken producer was not replaced: {}",
        worker.logs()
    );

    let mut ids = BTreeSet::new();
    for i in 0..20 {
        let e = enqueue(
            &client,
            "orders",
            &format!("k{i}"),
            "T",
            &json!({"i": i}),
            &BTreeMap::new(),
        )
        .await;
        ids.insert(e.id);
    }
    let c = wait_counts(&client, Duration::from_secs(60), |c| {
        c["SUCCESS"] == 20 && c["FAIL"] == 1
    })
    .await;
    assert_eq!(
        (c["SUCCESS"], c["FAIL"]),
        (20, 1),
        "{c:?}\n{}",
        worker.logs()
    );
    let row = client
        .query_one(
            "SELECT retry_count, last_error FROM outbox_event WHERE id = $1",
            &[&big.id],
        )
        .await
        .expect("query");
    let (attempts, err): (i32, String) = (row.get(0), row.get(1));
    assert!(err.contains("small"), "{err}");
    // One broken producer per attempt of the oversized event, each replaced; nothing else.
    assert_eq!(
        replaced(&worker, "fatal"),
        Some(f64::from(attempts)),
        "{}",
        worker.logs()
    );
    assert_eq!(replaced(&worker, "fenced"), Some(0.0));
    assert_eq!(replaced(&worker, "timeouts"), Some(0.0));
    let healthy_retries: i64 = client
        .query_one(
            "SELECT count(*) FROM outbox_event WHERE topic = 'orders' AND retry_count > 0",
            &[],
        )
        .await
        .expect("query")
        .get(0);
    assert_eq!(
        healthy_retries, 0,
        "a healthy event paid for the broken producer"
    );
    let got: BTreeSet<i64> = broker
        .consume_all("orders", Duration::from_secs(3))
        .iter()
        .map(|m| m.outbox_id())
        .collect();
    assert_eq!(got, ids, "every healthy event arrives");
}

/// Each of the relay's Kafka producers (`--kafka-connections`) that breaks is counted: two
/// oversized unkeyed events of one round go to the two producers (by id), each breaks fatally
/// (`enable.gapless.guarantee`), and the counter says 2, not one per round.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_producer_broken_in_a_round_is_counted() {
    let db = TestDb::create();
    db.set(&[("outbox.max_retry", "0")]);
    let broker = Broker::start();
    broker.create_topic_with("small", &[("max.message.bytes", "1024")]);
    db.psql(
        "SELECT outbox_enqueue_many('small', ARRAY[jsonb_build_object('blob', repeat('x', 4000)), \
         jsonb_build_object('blob', repeat('y', 4000))])",
    );
    let args = [
        "--kafka-connections",
        "2",
        "--kafka-property",
        "enable.gapless.guarantee=true",
    ];
    let worker = Relay::spawn(&db.url(), &broker.addr(), &args);
    let client = db.connect().await;
    let c = wait_counts(&client, Duration::from_secs(30), |c| c["FAIL"] == 2).await;
    assert_eq!(c["FAIL"], 2, "{c:?}\n{}", worker.logs());
    // Claimed together: one round of two events.
    let rounds = (
        worker.metric("outbox_claim_batch_size_count"),
        worker.metric("outbox_claim_batch_size_sum"),
    );
    let fatal = worker.metric_where("outbox_producer_replaced_total", r#"reason="fatal""#);
    assert_eq!(
        (rounds, fatal),
        ((Some(1.0), Some(2.0)), Some(2.0)),
        "one round broke both producers\n{}",
        worker.logs()
    );
}

/// A broker restart (clean stop, same data) while the relay runs: the messages delivered before
/// are still there at the same offsets, and events committed while the broker is down arrive once
/// it is back, without dead letters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_restart_keeps_delivered_messages_and_the_relay_resumes() {
    let db = TestDb::create();
    retry_quickly(&db, 50);
    let mut broker = Broker::start();
    broker.create_topic("orders");
    let client = db.connect().await;
    let worker = Relay::spawn(
        &db.url(),
        &broker.addr(),
        &[
            "--send-timeout",
            "1s",
            "--lease",
            "5s",
            "--poll-interval",
            "100ms",
            "--kafka-property",
            "reconnect.backoff.max.ms=200",
        ],
    );
    let enqueue_n = |c: tokio_postgres::Client, from: i64, n: i64, every: Duration| async move {
        let mut ids = Vec::new();
        for i in from..from + n {
            let e = enqueue(
                &c,
                "orders",
                &format!("k{}", i % 5),
                "T",
                &json!({"i": i}),
                &BTreeMap::new(),
            )
            .await;
            ids.push(e.id);
            tokio::time::sleep(every).await;
        }
        ids
    };
    let first = enqueue_n(db.connect().await, 0, 10, Duration::ZERO).await;
    let c = wait_counts(&client, Duration::from_secs(30), |c| c["SUCCESS"] == 10).await;
    assert_eq!(c["SUCCESS"], 10, "{c:?}\n{}", worker.logs());
    let before: BTreeSet<(i64, i64, i64)> = broker
        .consume_all("orders", Duration::from_secs(3))
        .iter()
        .map(|m| (m.partition, m.offset, m.outbox_id()))
        .collect();
    let first_set: BTreeSet<i64> = first.iter().copied().collect();
    let got: BTreeSet<i64> = before.iter().map(|m| m.2).collect();
    assert_eq!(got, first_set);

    // 30 more events over ~6 s while the broker stops and starts again.
    let producer = tokio::spawn(enqueue_n(
        db.connect().await,
        10,
        30,
        Duration::from_millis(200),
    ));
    let t = Instant::now();
    tokio::task::block_in_place(|| broker.restart());
    let restart = t.elapsed();
    let second = producer.await.expect("producer task");
    let c = wait_counts(&client, Duration::from_secs(60), |c| c["SUCCESS"] == 40).await;
    assert_eq!(
        (c["SUCCESS"], c["FAIL"]),
        (40, 0),
        "{c:?} (broker restart took {restart:?})\n{}",
        worker.logs()
    );

    let after = broker.consume_all("orders", Duration::from_secs(3));
    let after_set: BTreeSet<(i64, i64, i64)> = after
        .iter()
        .map(|m| (m.partition, m.offset, m.outbox_id()))
        .collect();
    let lost: Vec<_> = before.difference(&after_set).collect();
    assert!(
        lost.is_empty(),
        "messages gone or moved after the restart: {lost:?}"
    );
    let all: BTreeSet<i64> = first.iter().chain(&second).copied().collect();
    let got: BTreeSet<i64> = after.iter().map(|m| m.outbox_id()).collect();
    assert_eq!(got, all, "every event arrives (at least once)");
}

/// The first SIGTERM or SIGINT waits for the round in flight (here stuck on a frozen broker); a
/// second one exits at once with 128 + its number, what a shell reports for a process the signal
/// killed: 143 for SIGTERM, 130 for SIGINT.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_signal_exits_at_once_with_128_plus_its_number() {
    let db = TestDb::create();
    let broker = Broker::start();
    // A topic per round: the first round's keys stay busy, held by its killed relay.
    let topics = ["orders", "payments"];
    for t in topics {
        broker.create_topic(t);
    }
    let client = db.connect().await;
    broker.freeze();
    for (n, (sig, name, code)) in [
        (libc::SIGTERM, "SIGTERM", 143),
        (libc::SIGINT, "SIGINT", 130),
    ]
    .into_iter()
    .enumerate()
    {
        enqueue_burst(&client, topics[n], 5).await;
        let owner = format!("relay-{name}");
        let mut relay = Relay::spawn(
            &db.url(),
            &broker.addr(),
            &["--owner", &owner, "--send-timeout", "30s", "--lease", "10m"],
        );
        let held = wait_counts(&client, Duration::from_secs(20), |c| {
            c["SENDING"] as usize > n * 5
        })
        .await;
        assert!(held["SENDING"] as usize > n * 5, "{}", relay.logs());
        relay.signal(sig);
        assert!(
            relay
                .wait_log(&[name, "received"], Duration::from_secs(5))
                .is_some(),
            "{}",
            relay.logs()
        );
        assert!(
            relay.is_running(),
            "the first {name} waits for the round in flight"
        );
        let sent = Instant::now();
        relay.signal(sig);
        let status = relay.wait_exit(Duration::from_secs(5));
        assert_eq!(
            status.and_then(|s| s.code()),
            Some(code),
            "{name}: {status:?}\n{}",
            relay.logs()
        );
        assert!(
            sent.elapsed() < Duration::from_secs(2),
            "{name}: not at once"
        );
        assert!(relay
            .logs()
            .contains(&format!("second {name}: exiting now")));
    }
}
