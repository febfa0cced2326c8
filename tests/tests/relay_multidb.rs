//! One relay process serving several databases (`run --config`): three databases on two
//! clusters, one cluster stopped mid-run; a database added and removed with SIGHUP; an operator
//! command picking its database from the same file.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use outbox_tests::broker::{Broker, Follower};
use outbox_tests::db::{test_prefix, TestDb};
use outbox_tests::events::{enqueue, enqueue_burst, wait_counts};
use outbox_tests::pg_cluster::PgCluster;
use outbox_tests::relay::{run_cmd, write_config, ConfigDb, Relay};
use serde_json::json;
use tokio_postgres::Client;

const PRELOAD: &str = "shared_preload_libraries = 'outbox'";

fn server(c: &PgCluster) -> String {
    format!("host=127.0.0.1 port={} user=postgres", c.port)
}

fn topic(db: &str) -> String {
    format!("multi_{db}")
}

fn config_path(test: &str) -> PathBuf {
    std::env::temp_dir().join(format!("outbox-{test}-{}.toml", std::process::id()))
}

/// `run --config PATH` against `broker`, claiming every 500 ms without a wake-up.
fn spawn_relay(config: &std::path::Path, broker: &Broker) -> Relay {
    let path = config.to_str().expect("utf-8");
    let addr = broker.addr();
    Relay::spawn_args(&[
        "run",
        "--config",
        path,
        "--brokers",
        &addr,
        "--poll-interval",
        "500ms",
    ])
}

/// Waits until `/ready` answers with a body containing `want`; returns (status, body).
fn wait_ready(relay: &Relay, want: &str, timeout: Duration) -> (String, String) {
    let deadline = Instant::now() + timeout;
    loop {
        let got = relay.http_get("/ready").unwrap_or_default();
        if got.1.contains(want) || Instant::now() > deadline {
            return got;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Commits `n` probe events one after the other to each database and waits for each on the
/// broker: the commit-to-delivery latencies, all databases together, sorted.
async fn latencies(dbs: &[(&Client, &str, &Follower)], n: usize) -> Vec<Duration> {
    let mut out = Vec::new();
    for i in 0..n {
        for (client, name, follower) in dbs {
            let e = enqueue(
                *client,
                &topic(name),
                "probe",
                "Probe",
                &json!({ "probe": i }),
                &Default::default(),
            )
            .await;
            let committed = Instant::now();
            let (seen, _) = follower
                .wait_for(e.id, Duration::from_secs(30))
                .unwrap_or_else(|| panic!("probe {} of {name} not delivered in 30 s", e.id));
            out.push(seen.saturating_duration_since(committed));
        }
    }
    out.sort();
    out
}

/// Every event committed in `db` is on its topic, and every one is SUCCESS.
async fn assert_all_delivered(broker: &Broker, client: &Client, name: &str, relay: &Relay) {
    let total: i64 = client
        .query_one("SELECT count(*) FROM outbox_event", &[])
        .await
        .expect("count")
        .get(0);
    let counts = wait_counts(client, Duration::from_secs(120), |c| c["SUCCESS"] == total).await;
    assert_eq!(
        counts["SUCCESS"],
        total,
        "{name}: {counts:?}\n{}",
        relay.log_tail(40)
    );
    let rows = client
        .query("SELECT id FROM outbox_event", &[])
        .await
        .expect("ids");
    let on_topic: BTreeSet<i64> = broker
        .consume_all(&topic(name), Duration::from_secs(10))
        .iter()
        .map(|m| m.outbox_id())
        .collect();
    let missing: Vec<i64> = rows
        .iter()
        .map(|r| r.get::<_, i64>(0))
        .filter(|id| !on_topic.contains(id))
        .collect();
    assert!(
        missing.is_empty(),
        "{name}: {} committed events never reached Kafka, e.g. {:?}",
        missing.len(),
        &missing[..missing.len().min(10)]
    );
    eprintln!("{name}: all {total} committed events on {}", topic(name));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_cluster_does_not_hold_up_the_others_and_its_backlog_drains() {
    let (c1, c2) = (
        PgCluster::start(PRELOAD, &[]),
        PgCluster::start(PRELOAD, &[]),
    );
    let a = TestDb::create_on(&server(&c1), &test_prefix());
    let b = TestDb::create_on(&server(&c1), &test_prefix());
    let c = TestDb::create_on(&server(&c2), &test_prefix());
    let broker = Broker::start();
    for name in ["a", "b", "c"] {
        broker.create_topic(&topic(name));
    }
    let config = config_path("multidb-isolation");
    // c's rows claimed when its server dies come back after a short lease, not ten minutes.
    let c_extra = [
        "lease = \"20s\"",
        "reclaim_interval = \"1s\"",
        "producer = \"shared\"",
    ];
    // b publishes through a producer of its own (the default), a and c share the relay's.
    let a_extra = ["producer = \"shared\""];
    write_config(
        &config,
        &[
            ConfigDb {
                name: "a",
                url: a.url(),
                extra: &a_extra,
            },
            ConfigDb {
                name: "b",
                url: b.url(),
                extra: &[],
            },
            ConfigDb {
                name: "c",
                url: c.url(),
                extra: &c_extra,
            },
        ],
    );
    let mut relay = spawn_relay(&config, &broker);
    let (status, body) = wait_ready(&relay, "ok\n", Duration::from_secs(60));
    assert!(status.contains("200"), "{status} {body}\n{}", relay.logs());

    let (ca, cb, cc) = (a.connect().await, b.connect().await, c.connect().await);
    for (client, name) in [(&ca, "a"), (&cb, "b"), (&cc, "c")] {
        enqueue_burst(client, &topic(name), 300).await;
    }
    let (fa, fb) = (broker.follow(&topic("a")), broker.follow(&topic("b")));
    let probes = [(&ca, "a", &fa), (&cb, "b", &fb)];
    let before = latencies(&probes, 10).await;

    // c goes down with a backlog, part of it claimed.
    enqueue_burst(&cc, &topic("c"), 20_000).await;
    c2.stop("immediate");
    drop(cc);
    for (client, name) in [(&ca, "a"), (&cb, "b")] {
        enqueue_burst(client, &topic(name), 300).await;
    }
    let during = latencies(&probes, 20).await;
    let (status, body) = wait_ready(&relay, "database c", Duration::from_secs(30));
    assert!(
        status.contains("200") && body.contains("degraded: database c: database unreachable"),
        "one bad database keeps the relay in service and is named: {status} {body}"
    );
    let max = |l: &[Duration]| *l.last().expect("latencies");
    eprintln!(
        "commit-to-delivery of a and b: before the stop p50 {:?} max {:?}; c down p50 {:?} max {:?}",
        before[before.len() / 2],
        max(&before),
        during[during.len() / 2],
        max(&during)
    );
    assert!(
        max(&during) < Duration::from_secs(2),
        "a and b slowed down while c was down: {during:?}\n{}",
        relay.log_tail(40)
    );

    let on_kafka: BTreeSet<i64> = broker
        .consume_all(&topic("c"), Duration::from_secs(10))
        .iter()
        .map(|m| m.outbox_id())
        .collect();
    assert!(on_kafka.len() < 20_300, "c had no backlog when it stopped");
    c2.start_again();
    let cc = c.connect().await;
    for (client, name) in [(&ca, "a"), (&cb, "b"), (&cc, "c")] {
        assert_all_delivered(&broker, client, name, &relay).await;
    }
    assert!(wait_ready(&relay, "ok\n", Duration::from_secs(30))
        .0
        .contains("200"));
    for name in ["a", "b", "c"] {
        let published =
            relay.metric_where("outbox_published_total", &format!("database=\"{name}\""));
        assert!(published.is_some_and(|n| n > 0.0), "{name}: {published:?}");
    }
    let own = relay.metric_where("outbox_relay_build_info", "database=\"b\"");
    assert_eq!(own, Some(1.0), "b's own producer reports under its name");
    let st = relay.terminate(Duration::from_secs(30)).expect("stops");
    assert!(st.success(), "{st:?}\n{}", relay.log_tail(20));
    let _ = std::fs::remove_file(&config);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_adds_and_removes_databases_and_a_removed_one_keeps_no_claim() {
    let cluster = PgCluster::start(PRELOAD, &[]);
    let a = TestDb::create_on(&server(&cluster), &test_prefix());
    let b = TestDb::create_on(&server(&cluster), &test_prefix());
    let broker = Broker::start();
    broker.create_topic(&topic("a"));
    broker.create_topic(&topic("b"));
    let config = config_path("multidb-reload");
    let db_a = || ConfigDb {
        name: "a",
        url: a.url(),
        extra: &[],
    };
    write_config(&config, &[db_a()]);
    let mut relay = spawn_relay(&config, &broker);
    assert!(wait_ready(&relay, "ok\n", Duration::from_secs(60))
        .0
        .contains("200"));
    let (ca, cb) = (a.connect().await, b.connect().await);

    // Added: b's backlog is relayed without a restart; a database that does not exist is
    // retried on its own and named by /ready.
    enqueue_burst(&cb, &topic("b"), 30_000).await;
    let ghost_url = format!("{} dbname=no_such_database", server(&cluster));
    let ghost = || ConfigDb {
        name: "ghost",
        url: ghost_url.clone(),
        extra: &[],
    };
    write_config(
        &config,
        &[
            db_a(),
            ConfigDb {
                name: "b",
                url: b.url(),
                extra: &[],
            },
            ghost(),
        ],
    );
    relay.signal(libc::SIGHUP);
    let counts = wait_counts(&cb, Duration::from_secs(30), |c| c["SENDING"] > 0).await;
    assert!(
        counts["SENDING"] > 0,
        "b never claimed: {counts:?}\n{}",
        relay.log_tail(30)
    );

    // Removed mid-drain: its rounds settle, and nothing stays claimed for the lease (10 min).
    write_config(&config, &[db_a(), ghost()]);
    relay.signal(libc::SIGHUP);
    let stopped = relay.wait_log(&["database stopped", "database=b"], Duration::from_secs(30));
    assert!(stopped.is_some(), "{}", relay.log_tail(30));
    let counts = wait_counts(&cb, Duration::from_secs(1), |_| false).await;
    assert_eq!(counts["SENDING"], 0, "claims left to the lease: {counts:?}");
    assert!(
        counts["SUCCESS"] > 0 && counts["WAIT"] > 0,
        "b was removed mid-drain: {counts:?}"
    );
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(
        wait_counts(&cb, Duration::from_secs(1), |_| false).await,
        counts,
        "a removed database is not served any more"
    );
    assert_eq!(
        relay.metric_where("outbox_published_total", "database=\"b\""),
        None
    );
    let (status, body) = wait_ready(&relay, "database ghost", Duration::from_secs(30));
    assert!(status.contains("200"), "{status} {body}");
    let failed = relay.wait_log(&["database ghost failed", "3D000"], Duration::from_secs(10));
    assert!(failed.is_some(), "{}", relay.log_tail(20));

    // a was served throughout; a bad file is refused and changes nothing.
    std::fs::write(&config, "[databases.a]\nurl = 1\n").expect("write");
    relay.signal(libc::SIGHUP);
    assert!(relay
        .wait_log(
            &["config reload refused", "line 2"],
            Duration::from_secs(10)
        )
        .is_some());
    let fa = broker.follow(&topic("a"));
    let l = latencies(&[(&ca, "a", &fa)], 3).await;
    assert!(l[2] < Duration::from_secs(2), "{l:?}");
    let st = relay.terminate(Duration::from_secs(30)).expect("stops");
    assert!(st.success(), "{st:?}\n{}", relay.log_tail(20));
    let _ = std::fs::remove_file(&config);

    // A relay without --config (reloads sent to every relay on a host) is not stopped by it.
    let mut single = Relay::spawn(&a.url(), &broker.addr(), &[]);
    single.wait_ready(Duration::from_secs(30));
    single.signal(libc::SIGHUP);
    assert!(single
        .wait_log(&["SIGHUP ignored"], Duration::from_secs(10))
        .is_some());
    assert!(single.is_running(), "{}", single.log_tail(10));
}

#[test]
fn a_bad_config_file_stops_run_with_one_line() {
    let config = config_path("multidb-bad");
    for (text, extra, want) in [
        (
            "[databases.a]\nurl = \"x\"\nbatch = 1\n",
            &[][..],
            "line 3: unknown field `batch`",
        ),
        (
            "[databases.a]\nurl_file = \"/nonexistent\"\nlease = \"4s\"\n",
            &[],
            "database a: --send-timeout",
        ),
        (
            "[databases.a]\nurl = \"x\"\n",
            &["--database-url", "host=h"],
            "not both",
        ),
    ] {
        std::fs::write(&config, text).expect("write");
        let mut args = vec!["run", "--config", config.to_str().expect("utf-8")];
        args.extend_from_slice(extra);
        let out = run_cmd(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{text}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
        assert!(stderr.contains(want), "{want}: {stderr}");
    }
    let _ = std::fs::remove_file(&config);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_commands_pick_their_database_from_the_config_file() {
    let cluster = PgCluster::start(PRELOAD, &[]);
    let a = TestDb::create_on(&server(&cluster), &test_prefix());
    let b = TestDb::create_on(&server(&cluster), &test_prefix());
    enqueue_burst(&b.connect().await, "orders", 7).await;
    let config = config_path("multidb-cli");
    write_config(
        &config,
        &[
            ConfigDb {
                name: "a",
                url: a.url(),
                extra: &[],
            },
            ConfigDb {
                name: "b",
                url: b.url(),
                extra: &[],
            },
        ],
    );
    let path = config.to_str().expect("utf-8");
    let due = |db: &str| {
        let out = run_cmd(&["stats", "--config", path, "--database", db, "--json"]);
        assert!(out.status.success(), "{out:?}");
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
        v["due_wait"].as_i64().expect("due_wait")
    };
    assert_eq!((due("a"), due("b")), (0, 7));
    let out = run_cmd(&["dead-letters", "--config", path]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("choose one with --database NAME (a, b)"),
        "{stderr}"
    );
    let _ = std::fs::remove_file(&config);
}
