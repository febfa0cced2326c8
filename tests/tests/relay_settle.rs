//! The relay's settle calls outlive a database outage: a batch delivered while the database is
//! away is acked once it is back, not left SENDING for the lease (issue 29, item 1); and what it
//! counts as published is what its ack settled, whichever try of the ack landed.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use outbox_tests::broker::Broker;
use outbox_tests::db::{psql_admin, TestDb};
use outbox_tests::events::{enqueue_burst, ids_in, wait_counts};
use outbox_tests::proxy;
use outbox_tests::relay::Relay;
use outbox_worker::defaults::CLIENT_ID;

const EVENTS: i64 = 20;
const OUTAGE: Duration = Duration::from_secs(5);

/// The relay claims a batch while the broker is frozen; the database then refuses connections and
/// the relay's sessions are ended; the broker is thawed, so the deliveries land during the outage
/// and the ack fails. After 5 s the database is back: every event must be acked within seconds
/// (the relay backs off at most 5 s between tries), under a 10-minute lease, each published once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ack_that_meets_a_database_outage_lands_once_the_database_is_back() {
    let db = TestDb::create();
    let broker = Broker::start();
    broker.create_topic("orders");
    let client = db.connect().await;
    enqueue_burst(&client, "orders", EVENTS).await;

    broker.freeze();
    let mut relay = Relay::spawn(
        &db.url(),
        &broker.addr(),
        &[
            "--owner",
            "relay-a",
            "--send-timeout",
            "30s",
            "--lease",
            "10m",
        ],
    );
    let c = wait_counts(&client, Duration::from_secs(20), |c| c["SENDING"] == EVENTS).await;
    assert_eq!(c["SENDING"], EVENTS, "{c:?}\n{}", relay.logs());

    // The outage: no new sessions for the database, the relay's ended (this test's stays).
    psql_admin(&format!(
        "ALTER DATABASE {0} ALLOW_CONNECTIONS false; \
         SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
          WHERE datname = '{0}' AND application_name = '{CLIENT_ID}'",
        db.name
    ));
    broker.thaw();
    assert!(
        relay
            .wait_log(&["could not ack delivered events"], Duration::from_secs(20))
            .is_some(),
        "the ack never met the outage:\n{}",
        relay.logs()
    );
    tokio::time::sleep(OUTAGE).await;
    psql_admin(&format!(
        "ALTER DATABASE {} ALLOW_CONNECTIONS true",
        db.name
    ));
    let back = Instant::now();

    let c = wait_counts(&client, Duration::from_secs(30), |c| c["SUCCESS"] == EVENTS).await;
    let recovered = back.elapsed();
    assert_eq!(
        c["SUCCESS"],
        EVENTS,
        "delivered events left unacked after the database came back: {c:?}\n{}",
        relay.log_tail(40)
    );
    println!("all {EVENTS} events acked {recovered:?} after a {OUTAGE:?} outage ended");
    assert!(
        recovered < Duration::from_secs(15),
        "took {recovered:?} after the outage"
    );

    let got: Vec<i64> = broker
        .consume_all("orders", Duration::from_secs(3))
        .iter()
        .map(|m| m.outbox_id())
        .collect();
    let distinct: BTreeSet<i64> = got.iter().copied().collect();
    let all: BTreeSet<i64> = ids_in(&client, "SUCCESS").await.into_iter().collect();
    assert_eq!(distinct, all, "every event arrives");
    assert_eq!(
        got.len(),
        distinct.len(),
        "none is published twice: {got:?}"
    );
    let st = relay.terminate(Duration::from_secs(10)).expect("stops");
    assert!(st.success(), "{}", relay.logs());
}

/// A relay's `outbox_published_total{…}`, every topic summed (0 when not yet exported).
fn published(relay: &Relay) -> f64 {
    relay.metric("outbox_published_total").unwrap_or(0.0)
}

/// Scheduled rows acked under `owner` (a reclaimed event is a scheduled row, which keeps its claim).
async fn acked_by(client: &tokio_postgres::Client, owner: &str) -> i64 {
    client
        .query_one(
            "SELECT count(*) FROM outbox_scheduled WHERE status = 'SUCCESS' AND claim_owner = $1",
            &[&owner],
        )
        .await
        .expect("acked by")
        .get(0)
}

/// Relay A's database connections are cut (a partition) while its batch is being delivered, for
/// longer than its heartbeat timeout: relay B reclaims the events, publishes and acks them. Once
/// the partition heals, A's retried ack lands and settles nothing. Each relay's
/// `outbox_published_total` must be what the outbox says it acked, so together exactly the
/// events: counting the delivered events once the ack call returned, A counted them all again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_ack_counts_only_the_events_the_outbox_settled_as_published() {
    let db = TestDb::create();
    let broker = Broker::start();
    broker.create_topic("orders");
    let client = db.connect().await;
    let (proxy, through_proxy) = proxy::to_database(&client, &db.url()).await;
    enqueue_burst(&client, "orders", EVENTS).await;

    broker.freeze();
    let a = Relay::spawn(
        &through_proxy,
        &broker.addr(),
        &[
            "--owner",
            "relay-a",
            "--lease",
            "2m",
            "--heartbeat-timeout",
            "2s",
            "--statement-timeout",
            "2s",
            "--pool-timeout",
            "2s",
            "--send-timeout",
            "30s",
        ],
    );
    let c = wait_counts(&client, Duration::from_secs(20), |c| c["SENDING"] == EVENTS).await;
    assert_eq!(c["SENDING"], EVENTS, "{c:?}\n{}", a.logs());

    proxy.partition();
    broker.thaw();
    assert!(
        a.wait_log(&["could not ack delivered events"], Duration::from_secs(30))
            .is_some(),
        "relay-a's ack never met the partition:\n{}",
        a.log_tail(40)
    );
    // A's heartbeat runs out; B takes the events back and delivers them.
    let mut b = Relay::spawn(
        &db.url(),
        &broker.addr(),
        &["--owner", "relay-b", "--reclaim-interval", "500ms"],
    );
    let c = wait_counts(&client, Duration::from_secs(30), |c| c["SUCCESS"] == EVENTS).await;
    assert_eq!(c["SUCCESS"], EVENTS, "{c:?}\n{}", b.log_tail(40));

    proxy.heal();
    assert!(
        a.wait_log(
            &["some delivered events were no longer held"],
            Duration::from_secs(30)
        )
        .is_some(),
        "relay-a's retried ack did not land after the partition:\n{}",
        a.log_tail(40)
    );
    let b_published = b
        .wait_metric("outbox_published_total", Duration::from_secs(10), |v| {
            v >= EVENTS as f64
        })
        .unwrap_or(0.0);
    for (relay, owner, counted) in [(&a, "relay-a", published(&a)), (&b, "relay-b", b_published)] {
        let acked = acked_by(&client, owner).await;
        assert_eq!(
            counted,
            acked as f64,
            "{owner}'s outbox_published_total against the events the outbox says it acked:\n{}",
            relay.log_tail(20)
        );
    }
    assert_eq!(
        published(&a) + b_published,
        EVENTS as f64,
        "the relays' counts add up to the events"
    );
    assert_eq!(a.metric("outbox_stale_acks_total"), Some(EVENTS as f64));
    assert_eq!(b.metric("outbox_stale_acks_total"), Some(0.0));
    // (relay-a is killed on drop: its connections from before the partition stay silent, and
    // stopping cleanly would wait for each of them.)
    let st = b.terminate(Duration::from_secs(20)).expect("stops");
    assert!(st.success(), "{}", b.log_tail(20));
}
