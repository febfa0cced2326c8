//! The relay's settle calls outlive a database outage: a batch delivered while the database is
//! away is acked once it is back, not left SENDING for the lease (issue 29, item 1).

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use outbox_tests::broker::Broker;
use outbox_tests::db::TestDb;
use outbox_tests::events::{enqueue_burst, ids_in, wait_counts};
use outbox_tests::relay::Relay;

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

    // The outage: no new sessions for the database, the relay's ended (this one stays).
    client
        .batch_execute(&format!(
            "ALTER DATABASE {0} ALLOW_CONNECTIONS false; \
             SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
              WHERE datname = '{0}' AND pid <> pg_backend_pid()",
            db.name
        ))
        .await
        .expect("start the outage");
    broker.thaw();
    assert!(
        relay
            .wait_log(&["could not ack delivered events"], Duration::from_secs(20))
            .is_some(),
        "the ack never met the outage:\n{}",
        relay.logs()
    );
    tokio::time::sleep(OUTAGE).await;
    client
        .batch_execute(&format!(
            "ALTER DATABASE {} ALLOW_CONNECTIONS true",
            db.name
        ))
        .await
        .expect("end the outage");
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
