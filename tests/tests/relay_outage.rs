//! Broker failures against the relay's defaults: a long broker outage is the broker's fault (no
//! attempt counted, no dead letter, claims stopped by the circuit breaker until the broker is
//! back), a missing topic is the event's (counted, dead-lettered, listed, requeued by an operator).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use outbox_tests::broker::Broker;
use outbox_tests::db::TestDb;
use outbox_tests::events::{enqueue, ids_in, status_counts, wait_counts};
use outbox_tests::proxy::Proxy;
use outbox_tests::relay::{run_cmd, Relay};
use outbox_tests::rocketmq::RocketMq;
use outbox_tests::sinks::TestSink;
use serde_json::json;

/// How long the broker is down: issue 11's figure, past every backoff of the default retry rule
/// (5 s, 20 s, 45 s: an 80 s outage used to dead-letter every due event).
const OUTAGE: Duration = Duration::from_secs(120);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_two_minute_broker_outage_dead_letters_nothing_and_loses_nothing() {
    broker_outage(TestSink::kafka(), OUTAGE).await;
}

/// NATS's client has no retry rule of its own to outlast: a shorter outage, past the breaker's
/// opening and several of its probes, keeps the suite's time modest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_outage_dead_letters_nothing_and_loses_nothing() {
    broker_outage(TestSink::nats(), Duration::from_secs(30)).await;
}

/// The same shorter outage for RocketMQ: its broker and proxy stop together (one JVM).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rocketmq_outage_dead_letters_nothing_and_loses_nothing() {
    broker_outage(TestSink::rocketmq(), Duration::from_secs(30)).await;
}

/// A RocketMQ topic created with `scripts/rocketmq topic` as the relay starts, with events
/// committed before and right after: the relay asks for the topic's route before the topic exists,
/// and the proxy keeps answering TOPIC_NOT_FOUND from its route cache for a while after it does.
/// A route not known yet is the broker's state, not the events' fault: every event arrives, none
/// has an attempt counted, none is a dead letter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rocketmq_topic_created_as_the_relay_starts_counts_no_attempt() {
    let rocketmq = tokio::task::block_in_place(RocketMq::start_with_script);
    let db = TestDb::create();
    let client = db.connect().await;
    // One key per event: the first rounds send many events of the topic at once.
    let enqueue_keys = |keys: std::ops::Range<i32>| {
        let client = &client;
        async move {
            let mut ids = BTreeSet::new();
            for k in keys {
                let e = enqueue(
                    client,
                    "orders",
                    &format!("order-{k}"),
                    "OrderCreated",
                    &json!({"k": k}),
                    &BTreeMap::new(),
                )
                .await;
                ids.insert(e.id);
            }
            ids
        }
    };
    let mut committed = enqueue_keys(0..40).await;

    let topic = rocketmq.topic_script("orders");
    let relay = rocketmq_relay(&db, &rocketmq.proxy_addr(), &[]);
    committed.extend(enqueue_keys(40..80).await);
    let created = tokio::task::block_in_place(|| topic.wait_with_output()).expect("topic script");
    assert!(
        created.status.success(),
        "scripts/rocketmq topic orders: {}",
        String::from_utf8_lossy(&created.stderr)
    );
    // The route error before the topic existed, and after: how many so far.
    let route_missing = |logs: &str| {
        logs.lines()
            .filter(|l| l.contains("released without counting an attempt"))
            .filter(|l| l.contains("TOPIC_NOT_FOUND"))
            .count()
    };
    let before_created = route_missing(&relay.logs());

    let n = committed.len() as i64;
    let c = wait_counts(&client, Duration::from_secs(90), |c| c["SUCCESS"] == n).await;
    let logs = relay.logs();
    assert_eq!(
        (c["SUCCESS"], c["FAIL"], c["WAIT"], c["SENDING"]),
        (n, 0, 0, 0),
        "every event delivered, none a dead letter\n{logs}"
    );
    assert_eq!(
        attempts_counted(&client).await,
        0,
        "events had attempts counted while their topic's route was not known\n{logs}"
    );
    let after_created = route_missing(&logs) - before_created;
    assert!(
        before_created > 0 && after_created > 0,
        "the relay did not meet the topic without a route both before ({before_created} rounds) \
         and after ({after_created} rounds) the topic was created: this run did not reproduce \
         the window\n{logs}"
    );
    assert_eq!(
        relay.metric_where("outbox_publish_errors_total", "class=\"unknown\""),
        None,
        "a route not known yet is transient, not unknown"
    );
    let got: BTreeSet<i64> = tokio::task::block_in_place(|| rocketmq.consume_all("orders"))
        .iter()
        .map(|m| m.outbox_id())
        .collect();
    assert_eq!(got, committed, "every committed event arrives");
    eprintln!(
        "the relay released the topic's events {before_created} times before it was created and \
         {after_created} times after, without counting an attempt"
    );
}

/// New RocketMQ topics whose first sends meet a stalled network: the relay's `--rocketmq-proxy` is
/// a TCP proxy that holds what it carries (route queries go there; sends go to the address a route
/// names), so their route queries outlast the relay's send timeout, which gives up on them. Once
/// the network is back every event of those topics arrives, with the same relay process, and none
/// has an attempt counted or is a dead letter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rocketmq_route_query_outlasting_the_send_timeout_leaves_its_topic_working() {
    // Several topics: each first send of a topic asks for its route.
    const TOPICS: usize = 8;
    const STALL: Duration = Duration::from_secs(12);
    let rocketmq = tokio::task::block_in_place(RocketMq::start_with_script);
    let topics: Vec<String> = (0..TOPICS).map(|i| format!("orders-{i}")).collect();
    for t in topics.iter().map(String::as_str).chain(["warm-up"]) {
        tokio::task::block_in_place(|| rocketmq.create_topic(t));
    }
    let proxy = Proxy::start(([127, 0, 0, 1], rocketmq.port).into());
    let db = TestDb::create();
    let client = db.connect().await;
    let proxy_addr = format!("127.0.0.1:{}", proxy.port);
    let mut relay = rocketmq_relay(&db, &proxy_addr, &["--send-timeout", "1s"]);
    let enqueue_one = |topic: &str, k: usize| {
        let (client, topic) = (&client, topic.to_string());
        async move {
            let key = format!("order-{}", k % 3);
            let payload = json!({ "k": k });
            enqueue(
                client,
                &topic,
                &key,
                "OrderCreated",
                &payload,
                &BTreeMap::new(),
            )
            .await
            .id
        }
    };
    // The producer started and its connection open before the stall.
    enqueue_one("warm-up", 0).await;
    let c = wait_counts(&client, Duration::from_secs(60), |c| c["SUCCESS"] == 1).await;
    assert_eq!(c["SUCCESS"], 1, "the warm-up event\n{}", relay.logs());

    proxy.stall();
    let mut committed: BTreeMap<String, BTreeSet<i64>> = BTreeMap::new();
    for k in 0..6 {
        for t in &topics {
            let id = enqueue_one(t, k).await;
            committed.entry(t.clone()).or_default().insert(id);
        }
    }
    tokio::time::sleep(STALL).await;
    let stalled_logs = relay.logs();
    proxy.resume();
    let timed_out = stalled_logs
        .lines()
        .filter(|l| l.contains("no send receipt within"))
        .count();
    assert!(
        timed_out > 0,
        "no send of the new topics timed out during the stall: this run did not reproduce a \
         route query outlasting --send-timeout\n{stalled_logs}"
    );

    // For contrast, a topic whose route the client knew before the stall.
    enqueue_one("warm-up", 1).await;
    let n = 2 + committed.values().map(BTreeSet::len).sum::<usize>() as i64;
    let c = wait_counts(&client, Duration::from_secs(60), |c| c["SUCCESS"] == n).await;
    let logs = relay.logs();
    let undelivered: Vec<(String, i64)> = client
        .query(
            "SELECT topic, count(*) FROM outbox_event WHERE status::text <> 'SUCCESS' \
             GROUP BY topic ORDER BY topic",
            &[],
        )
        .await
        .expect("query")
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        (c["SUCCESS"], c["FAIL"], c["WAIT"], c["SENDING"]),
        (n, 0, 0, 0),
        "60 s after the network came back, events of topics whose route query the send timeout \
         gave up on are still not delivered (topic, events): {undelivered:?}\n{logs}"
    );
    assert_eq!(
        attempts_counted(&client).await,
        0,
        "a stalled route query counted attempts\n{logs}"
    );
    assert_eq!(
        relay.metric_where("outbox_publish_errors_total", "class=\"unknown\""),
        None,
        "a route query that outlasted the send timeout is transient, not unknown\n{logs}"
    );
    assert!(relay.is_running(), "the relay exited\n{logs}");
    for (topic, ids) in &committed {
        let got: BTreeSet<i64> = tokio::task::block_in_place(|| rocketmq.consume_all(topic))
            .iter()
            .map(|m| m.outbox_id())
            .collect();
        assert_eq!(&got, ids, "every committed event of {topic} arrives");
    }
    eprintln!("{timed_out} sends of the new topics timed out during the {STALL:?} stall");
}

/// A relay publishing through the RocketMQ proxy at `proxy` (HOST:PORT), with `extra` flags.
fn rocketmq_relay(db: &TestDb, proxy: &str, extra: &[&str]) -> Relay {
    let url = db.url();
    let mut args = vec!["run", "--database-url", &url, "--sink", "rocketmq"];
    args.extend(["--rocketmq-proxy", proxy]);
    args.extend_from_slice(extra);
    Relay::spawn_args(&args)
}

async fn broker_outage(mut broker: TestSink, outage: Duration) {
    let db = TestDb::create();
    broker.create_topic("orders");
    let client = db.connect().await;
    // The relay's and the extension's defaults: send timeout, lease, retries, backoff, poll. A
    // short /live timeout, so that /live staying 200 through the outage means something.
    let mut relay = broker.spawn_relay(&db.url(), &["--live-timeout", "20s"]);

    // One event every 250 ms, before, during and after the outage.
    let stop_producing = Arc::new(AtomicBool::new(false));
    let producer = {
        let url = db.url();
        let stop = stop_producing.clone();
        tokio::spawn(async move {
            let c = outbox_tests::db::connect(&url).await;
            let mut ids = BTreeSet::new();
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                let e = enqueue(
                    &c,
                    "orders",
                    &format!("order-{}", i % 13),
                    "OrderCreated",
                    &json!({"i": i}),
                    &BTreeMap::new(),
                )
                .await;
                ids.insert(e.id);
                i += 1;
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            ids
        })
    };
    let c = wait_counts(&client, Duration::from_secs(30), |c| c["SUCCESS"] >= 10).await;
    assert!(c["SUCCESS"] >= 10, "{c:?}\n{}", relay.logs());

    // Attempts counted before the outage (a RocketMQ topic's route still on its way to the name
    // server) are not the outage's.
    let attempts_before = attempts_counted(&client).await;
    tokio::task::block_in_place(|| broker.stop());
    let down = Instant::now();
    // The breaker opens: the relay stops claiming instead of burning attempts.
    let open = relay.wait_metric("outbox_broker_circuit_open", Duration::from_secs(60), |v| {
        v == 1.0
    });
    assert_eq!(open, Some(1.0), "breaker never opened\n{}", relay.logs());
    while down.elapsed() < outage {
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(
            relay.is_running(),
            "the relay exited during the outage\n{}",
            relay.logs()
        );
        let attempts = attempts_counted(&client).await;
        assert_eq!(
            attempts,
            attempts_before,
            "an outage counted attempts after {:?}: {:?}\n{}",
            down.elapsed(),
            status_counts(&client).await,
            relay.logs()
        );
    }
    // Alive (a restart would not help) but not ready (the broker is not reachable).
    let live = relay.http_get("/live").map(|(status, _)| status);
    assert!(
        live.as_deref().is_some_and(|s| s.contains("200")),
        "/live during the outage: {live:?}"
    );
    let ready = relay.http_get("/ready").map(|(status, _)| status);
    assert!(
        ready.as_deref().is_some_and(|s| s.contains("503")),
        "/ready during the outage: {ready:?}"
    );
    let backlog = status_counts(&client).await;
    assert!(
        backlog["WAIT"] + backlog["SENDING"] >= 100,
        "events kept being committed during the outage: {backlog:?}"
    );

    tokio::task::block_in_place(|| broker.start_again());
    tokio::time::sleep(Duration::from_secs(5)).await;
    stop_producing.store(true, Ordering::Relaxed);
    let committed = producer.await.expect("producer task");
    let n = committed.len() as i64;
    let c = wait_counts(&client, Duration::from_secs(120), |c| c["SUCCESS"] == n).await;
    assert_eq!(
        (c["SUCCESS"], c["FAIL"], c["WAIT"], c["SENDING"]),
        (n, 0, 0, 0),
        "after the outage\n{}",
        relay.logs()
    );
    let max_attempts: i32 = client
        .query_one("SELECT max(retry_count) FROM outbox_event", &[])
        .await
        .expect("query")
        .get(0);
    assert_eq!(
        max_attempts, 0,
        "the outage counted as the events' failures"
    );
    let got: BTreeSet<i64> = broker
        .consume_all("orders", Duration::from_secs(10))
        .iter()
        .map(|m| m.outbox_id())
        .collect();
    assert_eq!(got, committed, "every committed event arrives");
    assert!(relay.is_running(), "the relay never exits");
    assert_eq!(relay.metric("outbox_broker_circuit_open"), Some(0.0));
    let ready = relay.http_get("/ready").map(|(status, _)| status);
    assert!(
        ready.as_deref().is_some_and(|s| s.contains("200")),
        "/ready after the outage: {ready:?}"
    );
    assert!(
        relay
            .metric_where("outbox_failed_total", "class=\"transient\"")
            .unwrap_or(0.0)
            >= 1.0,
        "the failed publishes are counted as transient"
    );
    assert_eq!(
        relay
            .metric_where("outbox_failed_total", "class=\"permanent\"")
            .unwrap_or(0.0),
        0.0
    );
    for needle in ["broker unreachable: claims stopped", "claiming resumed"] {
        assert!(relay.logs().contains(needle), "no log line {needle:?}");
    }
}

/// A topic that does not exist is the event's fault: counted, dead-lettered after
/// `outbox.max_retry`, loud (error log naming the event and the topic, metrics by topic),
/// listed by `dead-letters`, and delivered after the operator creates the topic and requeues.
/// Events of a topic that exists are not held back by it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_topic_dead_letters_only_its_events_then_requeue_delivers() {
    let db = TestDb::create();
    db.set(&[("outbox.backoff_base", "100ms"), ("outbox.max_retry", "2")]);
    let broker = Broker::start();
    broker.create_topic("payments");
    let client = db.connect().await;
    let relay = Relay::spawn(
        &db.url(),
        &broker.addr(),
        &["--poll-interval", "100ms", "--send-timeout", "1s"],
    );
    let mut orders = BTreeSet::new();
    let mut payments = BTreeSet::new();
    for i in 0..5 {
        for (topic, ids) in [("orders", &mut orders), ("payments", &mut payments)] {
            let e = enqueue(
                &client,
                topic,
                &format!("K{i}"),
                "Created",
                &json!({"i": i}),
                &BTreeMap::new(),
            )
            .await;
            ids.insert(e.id);
        }
    }

    // max_retry 2 = 3 attempts, then FAIL; the other topic's events are delivered meanwhile.
    let counts = wait_counts(&client, Duration::from_secs(60), |c| {
        c["FAIL"] == 5 && c["SUCCESS"] == 5
    })
    .await;
    assert_eq!(
        (counts["FAIL"], counts["SUCCESS"]),
        (5, 5),
        "{counts:?}\n{}",
        relay.logs()
    );
    let failed: BTreeSet<i64> = ids_in(&client, "FAIL").await.into_iter().collect();
    assert_eq!(
        failed, orders,
        "exactly the missing topic's events are dead letters"
    );
    for r in client
        .query(
            "SELECT retry_count, last_error FROM outbox_event WHERE status::text = 'FAIL'",
            &[],
        )
        .await
        .expect("query")
    {
        assert_eq!(r.get::<_, i32>(0), 3, "max_retry 2 = 3 attempts");
        let err: String = r.get(1);
        assert!(
            err.contains("topic orders does not exist"),
            "the error names the cause: {err}"
        );
    }

    let dead = relay.wait_metric("outbox_dead_lettered_total", Duration::from_secs(5), |v| {
        v >= 5.0
    });
    assert_eq!(dead, Some(5.0));
    assert_eq!(
        relay.metric_where("outbox_dead_lettered_total", "topic=\"orders\""),
        Some(5.0)
    );
    assert_eq!(
        relay.metric_where("outbox_failed_total", "class=\"permanent\""),
        Some(15.0),
        "3 counted attempts of 5 events"
    );
    let gauge = relay.wait_metric("outbox_dead_letter_events", Duration::from_secs(10), |v| {
        v >= 5.0
    });
    assert_eq!(gauge, Some(5.0));
    for id in &orders {
        assert!(
            relay
                .wait_log(
                    &[
                        "ERROR",
                        "dead letter",
                        &format!("event {id} for topic orders")
                    ],
                    Duration::from_secs(5),
                )
                .is_some(),
            "no dead-letter error log for event {id}: {}",
            relay.logs()
        );
    }

    let out = run_cmd(&["dead-letters", "--json", "--database-url", &db.url()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let listed: BTreeSet<i64> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).expect("json line")["id"]
                .as_i64()
                .expect("id")
        })
        .collect();
    assert_eq!(listed, orders);

    // The operator creates the topic and requeues: the events arrive.
    broker.create_topic("orders");
    let out = run_cmd(&["requeue", "--all", "--database-url", &db.url()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("requeued 5 of 5"));
    let counts = wait_counts(&client, Duration::from_secs(60), |c| c["SUCCESS"] == 10).await;
    assert_eq!(counts["SUCCESS"], 10, "{counts:?}\n{}", relay.logs());
    let got: BTreeSet<i64> = broker
        .consume_all("orders", Duration::from_secs(3))
        .iter()
        .map(|m| m.outbox_id())
        .collect();
    assert_eq!(got, orders);
    let got: BTreeSet<i64> = broker
        .consume_all("payments", Duration::from_secs(3))
        .iter()
        .map(|m| m.outbox_id())
        .collect();
    assert_eq!(got, payments);
}

/// Events with an attempt counted, or dead letters.
async fn attempts_counted(client: &tokio_postgres::Client) -> i64 {
    client
        .query_one(
            "SELECT count(*) FROM outbox_event WHERE retry_count > 0 OR status::text = 'FAIL'",
            &[],
        )
        .await
        .expect("query")
        .get(0)
}

/// A round asks the broker again about its missing topics all at once, within the round's send
/// timeout, so it stays within two send timeouts. Three topics went missing, then the broker
/// froze: the round that holds their events releases them about one send timeout (1 s) after
/// they came due, not one per topic (3 s) plus the deliveries' own timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_topics_are_asked_about_at_once_within_the_round() {
    let db = TestDb::create();
    let broker = Broker::start();
    let client = db.connect().await;
    let relay = Relay::spawn(
        &db.url(),
        &broker.addr(),
        &["--poll-interval", "100ms", "--send-timeout", "1s"],
    );
    for topic in ["gone.a", "gone.b", "gone.c"] {
        client
            .execute(
                "SELECT outbox_enqueue(topic => $1::text, payload => '{}'::jsonb)",
                &[&topic],
            )
            .await
            .expect("enqueue");
    }
    let failed_once =
        "SELECT count(*) FROM outbox_scheduled WHERE status = 'WAIT' AND retry_count = 1";
    poll_until(&client, failed_once, &[], &relay, |r| {
        r.get::<_, i64>(0) == 3
    })
    .await;
    broker.freeze();
    // All three due at once: one round takes them.
    let due: std::time::SystemTime = client
        .query_one(
            "WITH u AS (UPDATE outbox_scheduled SET next_retry_time = clock_timestamp() \
             WHERE status = 'WAIT' RETURNING next_retry_time) SELECT max(next_retry_time) FROM u",
            &[],
        )
        .await
        .expect("due now")
        .get(0);
    let released = "SELECT count(*), max(updated_at) FROM outbox_scheduled \
                    WHERE status = 'WAIT' AND retry_count = 1 AND updated_at > $1";
    let last: std::time::SystemTime = poll_until(&client, released, &[&due], &relay, |r| {
        r.get::<_, i64>(0) == 3
    })
    .await
    .get(1);
    broker.thaw();
    let took = last.duration_since(due).unwrap_or_default();
    println!("the round of three missing topics ended {took:?} after they came due");
    assert!(
        took < Duration::from_millis(2500),
        "{took:?}: the looks at the missing topics took a send timeout each\n{}",
        relay.log_tail(40)
    );
}

/// The row of `sql` once `done` holds for it, polled every 50 ms for at most 30 s.
async fn poll_until(
    client: &tokio_postgres::Client,
    sql: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    relay: &Relay,
    done: impl Fn(&tokio_postgres::Row) -> bool,
) -> tokio_postgres::Row {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let row = client.query_one(sql, params).await.expect(sql);
        if done(&row) {
            return row;
        }
        assert!(Instant::now() < deadline, "{sql}\n{}", relay.log_tail(40));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
