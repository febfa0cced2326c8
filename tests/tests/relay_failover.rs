//! A primary failover while the relay runs: a throwaway primary with a synchronous streaming
//! standby (pg_basebackup, tests/src/pg_cluster.rs), a relay and a producer on a multi-host URL
//! (`target_session_attrs=read-write`), the primary crashed (`pg_ctl stop -m immediate`) with a
//! batch in flight and the standby promoted a second later. Every event whose commit the producer
//! saw arrives on the topic, nothing is left SENDING, the stream's cursor survives (duplicates at
//! most the one batch in flight, not a replay), first arrivals keep per-key order, and the relay
//! reconnects on its own. Prints the time from the promotion to delivery resuming.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox_tests::broker::{Broker, Msg};
use outbox_tests::events::wait_counts;
use outbox_tests::pg_cluster::PgCluster;
use outbox_tests::relay::Relay;
use tokio_postgres::{Client, NoTls};

const TOPIC: &str = "orders";
const KEYS: i64 = 8;
/// Small batches: a replayed stream would duplicate many times this many events.
const BATCH: &str = "20";

/// Events whose commit the producer saw: (id, key, commit time).
type Committed = Arc<Mutex<Vec<(i64, String, Instant)>>>;

/// Enqueues one keyed event every 10 ms through `url` until `stop`, reconnecting (every 50 ms)
/// whenever a call fails: a commit that fails is not recorded, one that returns is.
async fn produce(url: String, stop: Arc<AtomicBool>, committed: Committed) {
    let mut client: Option<Client> = None;
    let mut n: i64 = 0;
    while !stop.load(Ordering::Relaxed) {
        let Some(c) = client.as_ref().filter(|c| !c.is_closed()) else {
            client = match tokio_postgres::connect(&url, NoTls).await {
                Ok((c, conn)) => {
                    tokio::spawn(conn);
                    Some(c)
                }
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    None
                }
            };
            continue;
        };
        let key = format!("k{}", n % KEYS);
        let r = c
            .query_one(
                "SELECT outbox_enqueue(topic => $1::text, payload => jsonb_build_object('n', $2::bigint), \
                 key => $3::text)",
                &[&TOPIC, &n, &key],
            )
            .await;
        match r {
            Ok(row) => {
                let id: i64 = row.get(0);
                committed
                    .lock()
                    .expect("committed")
                    .push((id, key, Instant::now()));
                n += 1;
            }
            Err(_) => client = None,
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn events_committed(c: &Committed) -> Vec<(i64, String, Instant)> {
    c.lock().expect("committed").clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promoted_standby_takes_over_without_loss_or_replay() {
    let primary = PgCluster::start("shared_preload_libraries = 'outbox'", &[]);
    primary.psql("postgres", "CREATE DATABASE app");
    primary.psql("app", "CREATE EXTENSION outbox");
    let standby = primary.standby();
    // Synchronous: a commit the producer saw is on the standby too.
    primary.psql(
        "postgres",
        "ALTER SYSTEM SET synchronous_standby_names = '*'",
    );
    primary.psql("postgres", "SELECT pg_reload_conf()");
    let deadline = Instant::now() + Duration::from_secs(30);
    while primary.psql_value(
        "postgres",
        "SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'",
    ) != "1"
    {
        assert!(
            Instant::now() < deadline,
            "the standby never became synchronous"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let broker = Broker::start();
    broker.create_topic(TOPIC);
    let follower = broker.follow(TOPIC);
    let url = format!(
        "host=localhost,localhost port={},{} user=postgres dbname=app \
         target_session_attrs=read-write connect_timeout=2",
        primary.port, standby.port
    );

    let stop = Arc::new(AtomicBool::new(false));
    let committed: Committed = Arc::default();
    let producer = tokio::spawn(produce(url.clone(), stop.clone(), committed.clone()));
    let mut relay = Relay::spawn(
        &url,
        &broker.addr(),
        &["--poll-interval", "200ms", "--batch-size", BATCH],
    );
    // Two seconds of traffic, then the crash.
    let published = relay.wait_metric("outbox_published_total", Duration::from_secs(30), |v| {
        v >= 100.0
    });
    assert!(published.is_some_and(|v| v >= 100.0), "{}", relay.logs());
    primary.stop("immediate");
    let crashed_at = Instant::now();
    let before_crash = events_committed(&committed).len();
    std::thread::sleep(Duration::from_secs(1));
    standby.promote();
    let promoted_at = Instant::now();
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, Ordering::Relaxed);
    producer.await.expect("producer");
    let committed = events_committed(&committed);
    assert!(
        committed.len() > before_crash + 20,
        "the producer went on on the new primary: {} then {}",
        before_crash,
        committed.len()
    );

    let client = connect(&standby).await;
    let counts = wait_counts(&client, Duration::from_secs(60), |c| {
        c["SUCCESS"] as usize >= committed.len() && c["WAIT"] + c["SENDING"] + c["FAIL"] == 0
    })
    .await;
    assert!(
        relay.is_running(),
        "the relay reconnected on its own\n{}",
        relay.logs()
    );
    assert_eq!(
        counts["WAIT"] + counts["SENDING"] + counts["FAIL"],
        0,
        "{counts:?}\n{}",
        relay.log_tail(60)
    );
    let in_db: BTreeSet<i64> = client
        .query("SELECT id FROM outbox_event", &[])
        .await
        .expect("ids")
        .iter()
        .map(|r| r.get(0))
        .collect();
    let lost: Vec<i64> = committed
        .iter()
        .map(|(id, _, _)| *id)
        .filter(|id| !in_db.contains(id))
        .collect();
    assert!(
        lost.is_empty(),
        "committed, not on the new primary: {lost:?}"
    );

    // Everything on the topic: every event at least once, per-key order of first arrivals.
    let msgs = broker.consume_all(TOPIC, Duration::from_secs(10));
    let mut first: BTreeMap<i64, &Msg> = BTreeMap::new();
    for m in &msgs {
        first.entry(m.outbox_id()).or_insert(m);
    }
    let missing: Vec<&i64> = in_db.iter().filter(|id| !first.contains_key(id)).collect();
    assert!(missing.is_empty(), "never published: {missing:?}");
    let duplicates = msgs.len() - first.len();
    let batch: usize = BATCH.parse().expect("batch");
    assert!(
        duplicates <= batch,
        "{duplicates} duplicates: more than the one batch in flight ({batch}), the stream was \
         replayed"
    );
    let mut order: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    let mut seen = BTreeSet::new();
    let mut by_partition: Vec<&Msg> = msgs.iter().collect();
    by_partition.sort_by_key(|m| (m.partition, m.offset));
    for m in by_partition {
        if seen.insert(m.outbox_id()) {
            order
                .entry(m.key.clone().unwrap_or_default())
                .or_default()
                .push(m.outbox_id());
        }
    }
    for (key, ids) in &order {
        assert!(
            ids.windows(2).all(|w| w[0] < w[1]),
            "key {key}: first arrivals out of order: {ids:?}"
        );
    }

    // When delivery resumed: the first message after the promotion, and the first of an event
    // committed on the new primary.
    let arrivals: Vec<(Instant, Msg)> = follower.rx.try_iter().collect();
    let new_ids: BTreeSet<i64> = committed
        .iter()
        .filter(|(_, _, t)| *t > promoted_at)
        .map(|(id, _, _)| *id)
        .collect();
    let first_new_commit = committed
        .iter()
        .find(|(_, _, t)| *t > promoted_at)
        .map(|(_, _, t)| t.duration_since(promoted_at));
    let after = |pred: &dyn Fn(&Msg) -> bool| {
        arrivals
            .iter()
            .filter(|(t, m)| *t > promoted_at && pred(m))
            .map(|(t, _)| t.duration_since(promoted_at))
            .min()
    };
    let any = after(&|_| true);
    let new = after(&|m| new_ids.contains(&m.outbox_id()));
    eprintln!(
        "failover: {} events committed before the crash, {} after the promotion; primary crashed, \
         standby promoted {:.1} s later; promotion -> first message {:?}, -> first commit on the \
         new primary {:?}, -> first of those delivered {:?}; {duplicates} duplicates",
        before_crash,
        new_ids.len(),
        promoted_at.duration_since(crashed_at).as_secs_f64(),
        any,
        first_new_commit,
        new,
    );
    assert!(new.is_some(), "no event of the new primary was delivered");
    let status = relay.terminate(Duration::from_secs(30));
    assert!(status.is_ok_and(|s| s.success()), "{}", relay.log_tail(40));
}

async fn connect(pg: &PgCluster) -> Client {
    outbox_tests::db::connect(&pg.params("localhost", "app")).await
}
