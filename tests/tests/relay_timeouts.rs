//! Every wait of the relay is bounded: a Kafka delivery timeout above the lease is refused at
//! start-up, a statement stuck on a lock is cancelled by the statement timeout and the relay
//! carries on, a database connection that stops answering is dropped and replaced, and SIGTERM
//! ends the process within the shutdown timeout even with a round stuck.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use outbox_tests::broker::{free_port, Broker};
use outbox_tests::db::TestDb;
use outbox_tests::events::{enqueue, enqueue_burst, wait_counts};
use outbox_tests::proxy::{self, Proxy};
use outbox_tests::relay::{run_cmd, Relay};
use serde_json::json;
use tokio_postgres::Client;

#[test]
fn a_delivery_timeout_property_above_the_lease_is_refused() {
    let url = format!("host=127.0.0.1 port={} connect_timeout=1", free_port());
    for prop in ["message.timeout.ms=700000", "delivery.timeout.ms=0"] {
        let out = run_cmd(&["run", "--database-url", &url, "--kafka-property", prop]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
        assert!(
            stderr.contains(prop) && stderr.contains("--lease"),
            "{stderr}"
        );
    }
}

/// Locks the outbox's scheduled table in a transaction of the test's own session (every claim reads
/// it first, so every round waits); released when the returned transaction is dropped or rolled
/// back. One table, not the outbox_event view: locking the view takes both of its tables in turn,
/// and a claim taking them in the other order is a deadlock.
async fn lock_outbox(client: &mut Client) -> tokio_postgres::Transaction<'_> {
    let tx = client.transaction().await.expect("begin");
    tx.batch_execute("LOCK TABLE outbox_scheduled IN ACCESS EXCLUSIVE MODE")
        .await
        .expect("lock");
    tx
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_stuck_on_a_lock_is_cancelled_and_the_relay_carries_on() {
    let db = TestDb::create();
    let broker = Broker::start();
    broker.create_topic("orders");
    let follower = broker.follow("orders");
    let mut w = Relay::spawn(
        &db.url(),
        &broker.addr(),
        &["--poll-interval", "200ms", "--statement-timeout", "1s"],
    );
    assert!(w
        .wait_log(&["claim returned no due events"], Duration::from_secs(15))
        .is_some());

    let mut locker = db.connect().await;
    let tx = lock_outbox(&mut locker).await;
    let line = w.wait_log(
        &["claim failed", "statement timeout", "57014"],
        Duration::from_secs(10),
    );
    assert!(line.is_some(), "{}", w.logs());
    // Enqueued by the lock holder itself, delivered once it commits.
    let ev = enqueue(&tx, "orders", "k", "Created", &json!({}), &BTreeMap::new()).await;
    tx.commit().await.expect("commit");
    assert!(
        follower.wait_for(ev.id, Duration::from_secs(20)).is_some(),
        "{}",
        w.logs()
    );
    assert!(w.wait_exit(Duration::ZERO).is_none(), "the relay exited");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_ends_the_relay_within_the_shutdown_timeout() {
    let db = TestDb::create();
    let brokers = format!("127.0.0.1:{}", free_port());
    let mut w = Relay::spawn(
        &db.url(),
        &brokers,
        &[
            "--poll-interval",
            "200ms",
            "--statement-timeout",
            "0s",
            "--shutdown-timeout",
            "1s",
        ],
    );
    assert!(w
        .wait_log(&["claim returned no due events"], Duration::from_secs(15))
        .is_some());
    let mut locker = db.connect().await;
    let _tx = lock_outbox(&mut locker).await;
    // Wait until the claim loop's statement is queued behind the lock: the wake-up session's
    // outbox_wait queues there too, but a relay whose claim loop sleeps stops cleanly.
    let watcher = db.connect().await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let waiting: i64 = watcher
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
                 AND application_name = 'outbox-worker' AND wait_event_type = 'Lock' \
                 AND query LIKE '%outbox_claim%'",
                &[],
            )
            .await
            .expect("pg_stat_activity")
            .get(0);
        if waiting > 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no claim of the relay waits on the lock"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let start = Instant::now();
    w.signal(libc::SIGTERM);
    let st = w
        .wait_exit(Duration::from_secs(10))
        .unwrap_or_else(|| panic!("still running 10 s after SIGTERM: {}", w.logs()));
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
    assert_eq!(st.code(), Some(1), "{}", w.logs());
    assert!(
        w.logs().contains("shutdown timeout (1s) passed"),
        "{}",
        w.logs()
    );
}

/// A relay on `db` that reaches the database through a [`Proxy`], once it has delivered a first
/// few events; returns the relay, the proxy and a direct session.
async fn relay_through_a_proxy(db: &TestDb, broker: &Broker) -> (Relay, Proxy, Client) {
    let client = db.connect().await;
    let (proxy, url) = proxy::to_database(&client, &db.url()).await;
    let relay = Relay::spawn(
        &url,
        &broker.addr(),
        &["--poll-interval", "500ms", "--statement-timeout", "2s"],
    );
    enqueue_burst(&client, "orders", 5).await;
    let c = wait_counts(&client, Duration::from_secs(20), |c| c["SUCCESS"] == 5).await;
    assert_eq!(
        c["SUCCESS"],
        5,
        "through the proxy: {c:?}\n{}",
        relay.logs()
    );
    (relay, proxy, client)
}

/// Enqueues 20 more events and waits until all 25 are delivered; returns how long that took.
async fn twenty_more_are_delivered(client: &Client, relay: &Relay) -> Duration {
    let start = Instant::now();
    enqueue_burst(client, "orders", 20).await;
    let c = wait_counts(client, Duration::from_secs(60), |c| c["SUCCESS"] == 25).await;
    assert_eq!(c["SUCCESS"], 25, "{c:?}\n{}", relay.log_tail(40));
    start.elapsed()
}

/// The relay's open database connections stop forwarding (no reset, no answer: a partition, a
/// dead NAT entry). Its calls give up after the statement timeout plus a margin (here 2 s + 5 s),
/// their connections leave the pool, new ones go through, and events enqueued meanwhile are
/// delivered. Without a client-side bound every call would wait for them forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_connection_that_stops_answering_is_dropped_and_replaced() {
    let db = TestDb::create();
    let broker = Broker::start();
    broker.create_topic("orders");
    let (mut relay, proxy, client) = relay_through_a_proxy(&db, &broker).await;
    proxy.black_hole();
    let opened = proxy.accepted();
    let took = twenty_more_are_delivered(&client, &relay).await;
    println!("delivered {took:?} after the relay's database connections went silent");
    assert!(
        relay
            .wait_log(&["did not answer within 7s"], Duration::from_secs(1))
            .is_some(),
        "{}",
        relay.log_tail(40)
    );
    assert!(
        proxy.accepted() > opened,
        "new connections replaced the silent ones"
    );
    let st = relay.terminate(Duration::from_secs(30)).expect("stops");
    assert!(st.success(), "{}", relay.log_tail(40));
}

/// The relay's open connections still carry its requests but no longer the replies: its next
/// claim commits and its answer is lost, so the relay never learns the token. Once the call gives
/// up it releases what it holds under unknown tokens (no attempt counted), and the events go out
/// on new connections, each published once, instead of waiting for the 10-minute lease. The relay
/// polls idle for 3 s first, so that each of its pooled connections (handed out in turn) has
/// prepared the claim, then is stopped (SIGSTOP) while the events are enqueued and the replies
/// cut: its next claim, on a connection from before the cut, is the one that takes them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_whose_reply_is_lost_releases_its_events() {
    let db = TestDb::create();
    let broker = Broker::start();
    broker.create_topic("orders");
    let (mut relay, proxy, client) = relay_through_a_proxy(&db, &broker).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    relay.signal(libc::SIGSTOP);
    // Replies already on their way reach the stopped relay's sockets before the cut.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let start = Instant::now();
    enqueue_burst(&client, "orders", 20).await;
    proxy.drop_replies();
    relay.signal(libc::SIGCONT);
    let c = wait_counts(&client, Duration::from_secs(60), |c| c["SUCCESS"] == 25).await;
    assert_eq!(c["SUCCESS"], 25, "{c:?}\n{}", relay.log_tail(40));
    let took = start.elapsed();
    println!("delivered {took:?} after the replies to the relay's claims were lost");
    assert!(
        relay
            .wait_log(&["the reply to a claim was lost"], Duration::from_secs(1))
            .is_some(),
        "the orphaned claim was not released:\n{}",
        relay.log_tail(40)
    );
    let retried: i64 = client
        .query_one(
            "SELECT count(*) FROM outbox_event WHERE retry_count > 0",
            &[],
        )
        .await
        .expect("retries")
        .get(0);
    assert_eq!(retried, 0, "an orphaned claim counts no attempt");
    let got = broker.consume_all("orders", Duration::from_secs(3));
    let ids: BTreeSet<i64> = got.iter().map(|m| m.outbox_id()).collect();
    assert_eq!(ids.len(), 25);
    assert_eq!(got.len(), 25, "each event published once");
    let st = relay.terminate(Duration::from_secs(30)).expect("stops");
    assert!(st.success(), "{}", relay.log_tail(40));
}

/// `url` (libpq key=value) with a first host before its own: 127.0.0.1 on `port`.
fn behind_another_host(url: &str, port: u16) -> String {
    url.split(' ')
        .map(|kv| match kv.split_once('=') {
            Some(("host", h)) => format!("host=127.0.0.1,{h}"),
            Some(("port", p)) => format!("port={port},{p}"),
            _ => kv.to_string(),
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// A connection string's first host accepts connections and never answers (a frozen server:
/// tokio-postgres bounds only the TCP connect). Each session gives it its share of
/// `--pool-timeout` (5 s of 10) and goes on to the second host, so the relay starts and delivers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_host_that_never_answers_is_passed_over_for_the_next() {
    let db = TestDb::create();
    let broker = Broker::start();
    broker.create_topic("orders");
    let client = db.connect().await;
    let (frozen, _) = proxy::to_database(&client, &db.url()).await;
    frozen.partition();
    let url = behind_another_host(&db.url(), frozen.port);
    assert!(url.contains("host=127.0.0.1,"), "two hosts: {url}");
    let started = Instant::now();
    let relay = Relay::spawn(&url, &broker.addr(), &["--poll-interval", "500ms"]);
    enqueue_burst(&client, "orders", 5).await;
    let c = wait_counts(&client, Duration::from_secs(60), |c| c["SUCCESS"] == 5).await;
    assert_eq!(c["SUCCESS"], 5, "{c:?}\n{}", relay.log_tail(40));
    println!(
        "5 events delivered {:?} after the relay started, past a silent first host",
        started.elapsed()
    );
    assert!(
        frozen.accepted() > 0,
        "the relay never tried the first host"
    );
    assert!(
        relay
            .logs()
            .contains("database host did not answer within 5s, trying the next"),
        "{}",
        relay.log_tail(40)
    );
}

/// `--pool-timeout` bounds the whole wait for a pooled session: waiting for a free one and then
/// opening one share it (deadpool bounds each alone, so it could take twice as long). Here the
/// only session stops answering, and a new one never finishes its handshake.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pooled_session_is_had_within_the_pool_timeout_in_all() {
    use outbox_worker::error::DbError;
    let db = TestDb::create();
    let client = db.connect().await;
    let (proxy, url) = proxy::to_database(&client, &db.url()).await;
    let target = outbox_worker::db::config(&outbox_worker::cli::DbArgs {
        database_url: Some(url),
        database_url_file: None,
        config: None,
        database: None,
    })
    .expect("target");
    let pool_timeout = Duration::from_secs(2);
    let store = std::sync::Arc::new(
        outbox_worker::store::Store::open(target, 1, pool_timeout, Duration::from_millis(1500))
            .await
            .expect("store"),
    );
    proxy.partition();
    // The session's call hangs until its bound (1.5 s) drops it; the next call waits for it.
    let stuck = tokio::spawn({
        let store = store.clone();
        async move { store.stats().await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let started = Instant::now();
    let err = store.stats().await.expect_err("no session to be had");
    let took = started.elapsed();
    eprintln!(
        "the second call gave up after {:.2} s: {err}",
        took.as_secs_f64()
    );
    assert!(matches!(err, DbError::PoolTimeout(_)), "{err}");
    assert!(
        took < pool_timeout + Duration::from_millis(500),
        "took {took:?}, --pool-timeout is {pool_timeout:?}"
    );
    assert!(matches!(stuck.await, Ok(Err(DbError::Timeout(_)))));
}
