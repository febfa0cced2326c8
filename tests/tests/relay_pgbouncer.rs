//! Through PgBouncer in transaction mode (Debian 12's 1.18, without protocol-level prepared
//! statements): the relay's sessions share fewer server connections than they are, and every
//! event is delivered once. A PgBouncer that refuses the relay's startup options stops it with
//! one line naming the fix.

use std::collections::BTreeMap;
use std::time::Duration;

use outbox_tests::broker::{free_port, Broker};
use outbox_tests::db::{connect, server_params, TestDb};
use outbox_tests::events::{enqueue_burst, wait_counts};
use outbox_tests::pgbouncer::PgBouncer;
use outbox_tests::relay::Relay;

/// Server connections per database: fewer than the relay's sessions (two claim loops, the pool's
/// other users and the wake-up session).
const POOL: usize = 2;

/// Connections PgBouncer holds for `db`: (its clients, its server connections).
async fn bouncer_connections(bouncer: &PgBouncer, db: &str) -> (usize, usize) {
    let console = connect(&format!("{} user=postgres", bouncer.params("pgbouncer"))).await;
    let mut counts = [0, 0];
    for (i, show) in ["SHOW CLIENTS", "SHOW SERVERS"].iter().enumerate() {
        for m in console.simple_query(show).await.expect(show) {
            if let tokio_postgres::SimpleQueryMessage::Row(r) = m {
                counts[i] += usize::from(r.get("database") == Some(db));
            }
        }
    }
    (counts[0], counts[1])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_through_pgbouncer_in_transaction_mode_delivers_every_event_once() {
    let db = TestDb::create();
    let bouncer = PgBouncer::start(POOL, "ignore_startup_parameters = options");
    let broker = Broker::start();
    broker.create_topic("orders");
    let client = db.connect().await;
    let n = 3000i64;
    enqueue_burst(&client, "orders", n / 2).await;

    // Small batches: many claims and acks, interleaved over the shared server connections.
    let url = format!("{} {}", bouncer.params(&db.name), user_param());
    let relay = Relay::spawn(
        &url,
        &broker.addr(),
        &[
            "--concurrency",
            "2",
            "--batch-size",
            "20",
            "--poll-interval",
            "200ms",
        ],
    );
    relay.wait_ready(Duration::from_secs(15));
    // Enqueued while the relay waits: the wake-up session goes through PgBouncer too.
    enqueue_burst(&client, "orders", n / 2).await;
    let counts = wait_counts(&client, Duration::from_secs(90), |c| c["SUCCESS"] == n).await;
    assert_eq!(
        counts["SUCCESS"],
        n,
        "{counts:?}\n{}\n{}",
        relay.log_tail(40),
        bouncer.log_tail(20)
    );

    let (clients, servers) = bouncer_connections(&bouncer, &db.name).await;
    assert!(
        clients > servers && servers <= POOL,
        "{clients} relay sessions should share {servers} server connections (at most {POOL})"
    );
    let mut seen: BTreeMap<i64, usize> = BTreeMap::new();
    for m in broker.consume_all("orders", Duration::from_secs(3)) {
        *seen.entry(m.outbox_id()).or_default() += 1;
    }
    assert_eq!(seen.len() as i64, n, "every event arrives");
    let dups: Vec<_> = seen.iter().filter(|(_, c)| **c > 1).collect();
    assert!(dups.is_empty(), "published more than once: {dups:?}");

    let logs = relay.logs();
    for bad in ["prepared statement", "wake-up connection", "wake-up: "] {
        assert!(!logs.contains(bad), "{bad:?} in the relay's logs:\n{logs}");
    }
    // PgBouncer drops the options that carry the statement timeout, and the relay says so.
    assert!(
        logs.contains("do not have the statement_timeout the relay asked for"),
        "{logs}"
    );
}

#[test]
fn a_pgbouncer_that_refuses_the_startup_options_stops_the_relay_with_the_fix() {
    let bouncer = PgBouncer::start(POOL, "");
    let url = format!("{} {}", bouncer.params("postgres"), user_param());
    let brokers = format!("127.0.0.1:{}", free_port());
    let mut relay = Relay::spawn(&url, &brokers, &[]);
    let status = relay.wait_exit(Duration::from_secs(30));
    assert_eq!(status.and_then(|s| s.code()), Some(2), "{}", relay.logs());
    let logs = relay.logs();
    assert!(
        logs.contains("unsupported startup parameter")
            && logs.contains("ignore_startup_parameters"),
        "{logs}"
    );
}

/// `user=…` of the tests' server (PgBouncer logs every client in as that user).
fn user_param() -> String {
    server_params()
        .split_whitespace()
        .find(|p| p.starts_with("user="))
        .unwrap_or("user=postgres")
        .to_string()
}
