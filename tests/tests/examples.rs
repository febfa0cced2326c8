//! The client examples of `examples/` (Python, Node, Java, Go) run as real programs: each against
//! its own scratch database with the extension, the real relay and a real Kafka broker (one
//! broker shared by the tests of this file while any of them runs). What counts is what arrived
//! at the broker: the committed events with their keys and `event_id` headers, not the
//! rolled-back ones; the invalid call reported with SQLSTATE 22023; and for the inbox consumers
//! (all four languages) each event's effect applied exactly once through a relay killed with an
//! unacked batch, a duplicate copy on the topic and their own SIGKILL before an offset commit.
//!
//! The toolchains and packages come from `scripts/examples-setup`; a missing one fails the test
//! with a message naming it, never skips it.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use outbox_tests::broker::{Broker, Msg};
use outbox_tests::db::TestDb;
use outbox_tests::events::wait_counts;
use outbox_tests::proxy::Proxy;
use outbox_tests::relay::Relay;
use outbox_tests::roles::Roles;
use outbox_worker::{HEADER_EVENT_KEY, HEADER_EVENT_TYPE};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
use rdkafka::ClientConfig;

/// How long an example program (or a build) may run.
const RUN_TIMEOUT: Duration = Duration::from_secs(180);

/// One broker for the tests of this file, started by the first that needs it and stopped when
/// the last one running drops it.
fn shared_broker() -> Arc<Broker> {
    static SHARED: Mutex<Weak<Broker>> = Mutex::new(Weak::new());
    let mut shared = SHARED.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(b) = shared.upgrade() {
        return b;
    }
    let b = Arc::new(Broker::start());
    *shared = Arc::downgrade(&b);
    b
}

fn examples_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples")
}

/// `OUTBOX_TOOLS` as `scripts/env.sh` sets it.
fn tools_dir() -> PathBuf {
    std::env::var_os("OUTBOX_TOOLS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/opt/outbox-tools"))
}

/// A program from the PATH (or one of `extra` places); fails the test naming what to run when
/// it is missing.
fn tool(name: &str, extra: &[&str], lang: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .chain(extra.iter().map(PathBuf::from))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "the {lang} example needs `{name}`, which is not on the PATH: \
                 run scripts/examples-setup {lang}"
            )
        })
}

/// The scratch database as a `postgresql://` URL (what the examples take), from the libpq
/// key=value parameters of [`TestDb::url`].
fn pg_url(db: &TestDb) -> String {
    pg_url_as(db, None)
}

/// [`pg_url`] for another user than the tests' (no password: the server trusts loopback).
fn pg_url_as(db: &TestDb, user: Option<&str>) -> String {
    let mut params = BTreeMap::new();
    for part in db.url().split_whitespace() {
        let (k, v) = part
            .split_once('=')
            .unwrap_or_else(|| panic!("libpq parameter {part:?} in {:?}", db.url()));
        assert!(
            !v.starts_with('\''),
            "quoted libpq values are not supported here: {:?}",
            db.url()
        );
        params.insert(k.to_string(), v.to_string());
    }
    if let Some(u) = user {
        params.insert("user".into(), u.into());
        params.remove("password");
    }
    let get = |k: &str, d: &str| params.get(k).cloned().unwrap_or_else(|| d.to_string());
    let auth = match params.get("password") {
        Some(pw) => format!("{}:{pw}", get("user", "postgres")),
        None => get("user", "postgres"),
    };
    format!(
        "postgresql://{auth}@{}:{}/{}",
        get("host", "127.0.0.1"),
        get("port", "5432"),
        get("dbname", "postgres")
    )
}

/// The port in the libpq parameters of `db`.
fn db_port(db: &TestDb) -> u16 {
    db.url()
        .split_whitespace()
        .find_map(|kv| kv.strip_prefix("port=")?.parse().ok())
        .unwrap_or(5432)
}

/// What a program printed and how it ended.
struct Ran {
    what: String,
    ok: bool,
    stdout: String,
    stderr: String,
}

impl Ran {
    fn context(&self) -> String {
        format!(
            "{}:\n--- stdout\n{}--- stderr\n{}",
            self.what, self.stdout, self.stderr
        )
    }

    /// Lines starting with `tag `, as `key=value` maps (a `message=` value runs to the line's
    /// end).
    fn records(&self, tag: &str) -> Vec<BTreeMap<String, String>> {
        self.stdout
            .lines()
            .filter_map(|l| l.strip_prefix(tag)?.strip_prefix(' '))
            .map(|rest| {
                let (fields, message) = match rest.split_once("message=") {
                    Some((f, m)) => (f, Some(m)),
                    None => (rest, None),
                };
                let mut m: BTreeMap<String, String> = fields
                    .split_whitespace()
                    .filter_map(|kv| kv.split_once('='))
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect();
                if let Some(msg) = message {
                    m.insert("message".into(), msg.to_string());
                }
                m
            })
            .collect()
    }

    /// The single `done` line's fields.
    fn done(&self) -> BTreeMap<String, String> {
        let mut d = self.records("done");
        assert_eq!(d.len(), 1, "one `done` line from {}", self.context());
        d.remove(0)
    }
}

/// Runs `cmd` to completion (killed after `RUN_TIMEOUT`), capturing its output.
fn run(what: &str, mut cmd: Command) -> Ran {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("starting {what} ({cmd:?}): {e}"));
    let pipe = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = r.read_to_string(&mut s);
            s
        })
    };
    let out = pipe(Box::new(child.stdout.take().expect("stdout")));
    let err = pipe(Box::new(child.stderr.take().expect("stderr")));
    let deadline = Instant::now() + RUN_TIMEOUT;
    let status = loop {
        if let Some(st) = child.try_wait().expect("try_wait") {
            break Some(st);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut ran = Ran {
        what: what.to_string(),
        ok: status.is_some_and(|s| s.success()),
        stdout: out.join().unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
    };
    match status {
        None => ran.stderr += &format!("\n(killed after {} s)\n", RUN_TIMEOUT.as_secs()),
        Some(st) if !st.success() => ran.stderr += &format!("\n(exit: {st})\n"),
        _ => {}
    }
    ran
}

/// A build step that must succeed; `hint` says what to run when it does not.
fn build(what: &str, cmd: Command, hint: &str) {
    let r = run(what, cmd);
    assert!(r.ok, "{}\n{hint}", r.context());
}

/// A run id unique to this test run, so reruns against one database would not collide.
fn run_id(lang: &str) -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("t{}{lang}{}", std::process::id(), nanos % 1_000_000_000)
}

/// One example's world: database, topic, relay and the shared broker (dropped in this order:
/// the relay first).
struct World {
    relay: Relay,
    /// Between the relay and the database, when asked for ([`World::with_relay`]).
    proxy: Option<Proxy>,
    broker: Arc<Broker>,
    db: TestDb,
    topic: String,
    run: String,
}

impl World {
    fn new(lang: &str) -> World {
        World::with_relay(lang, &[], false)
    }

    /// A world whose relay gets `extra` flags besides the short poll interval, and reaches the
    /// database through a [`Proxy`] if `proxied`.
    fn with_relay(lang: &str, extra: &[&str], proxied: bool) -> World {
        let db = TestDb::create();
        let broker = shared_broker();
        let topic = format!("examples.{lang}");
        broker.create_topic(&topic);
        let mut args = vec!["--poll-interval", "200ms"];
        args.extend_from_slice(extra);
        let port = db_port(&db);
        let proxy = proxied.then(|| Proxy::start(([127, 0, 0, 1], port).into()));
        let url = match &proxy {
            Some(p) => db
                .url()
                .replace(&format!("port={port}"), &format!("port={}", p.port)),
            None => db.url(),
        };
        let relay = Relay::spawn(&url, &broker.addr(), &args);
        World {
            db,
            broker,
            relay,
            proxy,
            topic,
            run: run_id(lang),
        }
    }

    /// The environment every producer gets: topic and run id (the database URL is an argument).
    fn env(&self, cmd: &mut Command) {
        cmd.env("OUTBOX_TOPIC", &self.topic)
            .env("RUN_ID", &self.run);
    }

    /// Checks a producer's output and what reached the broker; returns the messages read back.
    async fn check_producer(
        &self,
        ran: &Ran,
        committed_n: usize,
        rolled_back_n: usize,
        invalid_n: usize,
    ) -> Vec<Msg> {
        let ctx = ran.context();
        assert!(ran.ok, "{ctx}");

        // The program's own account.
        let committed: BTreeMap<i64, String> = ran
            .records("committed")
            .iter()
            .map(|r| {
                let id = r["outbox_id"]
                    .parse()
                    .unwrap_or_else(|e| panic!("outbox_id {:?}: {e}\n{ctx}", r["outbox_id"]));
                (id, r["key"].clone())
            })
            .collect();
        let rolled_back: Vec<String> = ran
            .records("rolled_back")
            .iter()
            .map(|r| r["key"].clone())
            .collect();
        let invalid = ran.records("invalid");
        assert_eq!(committed.len(), committed_n, "committed events\n{ctx}");
        assert_eq!(rolled_back.len(), rolled_back_n, "rolled back\n{ctx}");
        assert_eq!(invalid.len(), invalid_n, "invalid calls reported\n{ctx}");
        for i in &invalid {
            assert_eq!(i["sqlstate"], "22023", "the bad topic's SQLSTATE\n{ctx}");
            assert!(
                i.get("message").is_some_and(|m| m.contains("topic")),
                "the 22023 message names the topic argument: {i:?}\n{ctx}"
            );
        }
        let done = ran.done();
        assert_eq!(done["committed"], committed_n.to_string(), "{ctx}");
        assert!(
            done["invalid_sqlstate"] == "22023",
            "done line: {done:?}\n{ctx}"
        );
        for key in committed.values().chain(&rolled_back) {
            assert!(
                key.contains(&self.run),
                "key {key} carries the run id {}\n{ctx}",
                self.run
            );
        }

        // The database: the committed events only, each with its event_id.
        let client = self.db.connect().await;
        let n = committed_n as i64;
        let counts = wait_counts(&client, Duration::from_secs(60), |c| c["SUCCESS"] >= n).await;
        assert_eq!(
            counts["SUCCESS"],
            n,
            "the relay delivered the committed events: {counts:?}\n{ctx}\nrelay log:\n{}",
            self.relay.log_tail(30)
        );
        let mut event_ids = BTreeMap::new();
        for row in client
            .query(
                "SELECT id, event_key, event_id::text FROM outbox_event",
                &[],
            )
            .await
            .expect("outbox rows")
        {
            let (id, key, event_id): (i64, String, String) = (row.get(0), row.get(1), row.get(2));
            assert_eq!(
                committed.get(&id),
                Some(&key),
                "outbox row {id} ({key}) is one the program reported committed\n{ctx}"
            );
            event_ids.insert(id, event_id);
        }
        assert_eq!(event_ids.len(), committed_n, "{ctx}");
        for key in &rolled_back {
            let orders: i64 = client
                .query_one("SELECT count(*) FROM orders WHERE order_no = $1", &[key])
                .await
                .expect("orders")
                .get(0);
            assert_eq!(orders, 0, "the rolled-back order {key} is not in orders");
        }

        // The broker: exactly the committed events, with their keys and event_id headers.
        let msgs = self
            .broker
            .consume_all(&self.topic, Duration::from_secs(10));
        let mut seen = BTreeSet::new();
        for m in &msgs {
            let key = m.key.clone().unwrap_or_default();
            assert!(
                !rolled_back.contains(&key),
                "the rolled-back event {key} was published: {m:?}"
            );
            let id = m.outbox_id();
            assert_eq!(committed.get(&id), Some(&key), "key of event {id}: {m:?}");
            assert_eq!(
                m.event_id(),
                event_ids[&id],
                "event_id header of {key}: {m:?}"
            );
            assert_eq!(m.headers.get(HEADER_EVENT_KEY), Some(&key), "{m:?}");
            assert_eq!(
                m.headers.get(HEADER_EVENT_TYPE).map(String::as_str),
                Some("OrderCreated"),
                "{m:?}"
            );
            let value: serde_json::Value = serde_json::from_str(&m.value)
                .unwrap_or_else(|e| panic!("value of {key} is JSON: {e}: {m:?}"));
            assert_eq!(
                value["order_no"].as_str(),
                Some(key.as_str()),
                "payload of {key}"
            );
            seen.insert(id);
        }
        let want: BTreeSet<i64> = committed.keys().copied().collect();
        assert_eq!(
            seen, want,
            "the broker holds exactly the committed events\n{ctx}"
        );
        assert_eq!(
            msgs.len(),
            committed_n,
            "one message per event in a clean run"
        );
        msgs
    }

    /// Publishes a second copy of `m` (same key, value and headers: what an at-least-once
    /// redelivery looks like) and checks that the topic now holds it.
    fn publish_copy(&self, m: &Msg, before: usize) {
        let producer: BaseProducer = ClientConfig::new()
            .set("bootstrap.servers", self.broker.addr())
            .create()
            .expect("producer");
        let mut headers = OwnedHeaders::new();
        for (k, v) in &m.headers {
            headers = headers.insert(Header {
                key: k,
                value: Some(v.as_str()),
            });
        }
        let key = m.key.clone().unwrap_or_default();
        producer
            .send(
                BaseRecord::to(&self.topic)
                    .key(&key)
                    .payload(&m.value)
                    .headers(headers)
                    .partition(m.partition as i32),
            )
            .unwrap_or_else(|(e, _)| panic!("publishing a copy of {key}: {e}"));
        producer
            .flush(Duration::from_secs(30))
            .expect("flush the copy");
        let now = self
            .broker
            .consume_all(&self.topic, Duration::from_secs(10));
        assert_eq!(now.len(), before + 1, "the copy of {key} is on the topic");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_psycopg_producer() {
    let python = python();
    let dir = examples_dir().join("python");
    let w = World::new("python");

    let mut cmd = Command::new(&python);
    cmd.arg(dir.join("producer.py")).arg(pg_url(&w.db));
    w.env(&mut cmd);
    let ran = run("python producer.py", cmd);
    w.check_producer(&ran, 4, 1, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_pg_producer() {
    let (node, dir) = node_example();
    let w = World::new("node");

    let mut cmd = Command::new(node);
    cmd.arg(dir.join("producer.js")).arg(pg_url(&w.db));
    w.env(&mut cmd);
    let ran = run("node producer.js", cmd);
    w.check_producer(&ran, 4, 1, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn java_jdbc_and_spring_producer() {
    let (java, classpath) = java_build();
    let w = World::new("java");

    let mut cmd = Command::new(&java);
    cmd.args(["-cp", &classpath, "example.Producer"])
        .arg(pg_url(&w.db));
    w.env(&mut cmd);
    let ran = run("java example.Producer", cmd);
    // JDBC: 4 committed, 1 rolled back, 1 invalid; Spring: 3 committed, 1 rolled back, 1 invalid.
    let msgs = w.check_producer(&ran, 7, 2, 2).await;
    let via: BTreeSet<String> = ran
        .records("invalid")
        .iter()
        .map(|r| r["via"].clone())
        .collect();
    assert_eq!(
        via,
        BTreeSet::from(["jdbc".to_string(), "spring".to_string()]),
        "{}",
        ran.context()
    );
    let keys: Vec<&str> = msgs.iter().filter_map(|m| m.key.as_deref()).collect();
    assert_eq!(
        keys.iter().filter(|k| k.contains("-spring-")).count(),
        3,
        "the Spring service's events arrived: {keys:?}"
    );
}

/// Builds examples/java offline; returns `java` and the classpath of the build.
fn java_build() -> (PathBuf, String) {
    let mvn = tool("mvn", &[], "java");
    let java = tool("java", &[], "java");
    let dir = examples_dir().join("java");
    // Offline: the dependencies and plugins are the ones scripts/examples-setup put into ~/.m2.
    let mut cmd = Command::new(mvn);
    cmd.current_dir(&dir).args(["-B", "-q", "-o", "package"]);
    build(
        "mvn -o package (examples/java)",
        cmd,
        "the Java example's dependencies must be in ~/.m2: run scripts/examples-setup java",
    );
    let classpath = format!(
        "{}:{}/*",
        dir.join("target/classes").display(),
        dir.join("target/lib").display()
    );
    (java, classpath)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn go_pgx_producer() {
    let bin = go_build(".");
    let w = World::new("go");

    let mut cmd = Command::new(&bin);
    cmd.arg(pg_url(&w.db));
    w.env(&mut cmd);
    let ran = run("go example (pgx)", cmd);
    let _ = std::fs::remove_file(&bin);
    w.check_producer(&ran, 4, 1, 1).await;
}

/// Events of the inbox test: loyalty points for a few customers (each event's points differ, so
/// an event applied twice changes a total).
const INBOX_EVENTS: i64 = 400;
const INBOX_CUSTOMERS: i64 = 7;
/// The consumer's first run kills itself after this many database commits, before that
/// message's offset commit.
const CRASH_AFTER: usize = 5;

/// The consumer side of issue 31 with its faults, for the consumer program `consumer` (given the
/// database URL and the broker address as arguments): the relay SIGKILLed mid-batch (another one
/// reclaims and republishes its unacked events), the consumer SIGKILLed between its database
/// commit and its offset commit, and a copy of a message published by hand. Every event's points
/// are applied exactly once.
async fn exactly_once_through_faults(lang: &str, consumer: &dyn Fn() -> Command) {
    let roles;
    // relay-a holds each batch a second before sending it (linger.ms), time enough to cut its
    // database connections after its claim: it publishes, cannot ack and is then killed.
    let mut w = World::with_relay(
        &format!("{lang}.inbox"),
        &[
            "--owner",
            "relay-a",
            "--heartbeat-timeout",
            "2s",
            "--batch-size",
            "50",
            "--kafka-property",
            "linger.ms=1000",
        ],
        true,
    );
    roles = Roles::create(&w.db, &["service"]);
    let [consumer_role, service] = ["consumer", "service"].map(|k| roles.name(k));
    let c = w.db.connect().await;
    // The consumer program logs in as the service's role, a member of the consumer's role.
    c.batch_execute(&format!(
        "ALTER ROLE {service} LOGIN; GRANT {consumer_role} TO {service};
         CREATE TABLE loyalty_points (customer text PRIMARY KEY, points bigint NOT NULL);
         GRANT SELECT, INSERT, UPDATE ON loyalty_points TO {service}"
    ))
    .await
    .unwrap();
    c.execute(
        "SELECT count(outbox_enqueue($1, jsonb_build_object('customer', 'c-' || g % $3::bigint, 'points', g), \
         key => 'c-' || g % $3::bigint, event_type => 'PointsEarned')) FROM generate_series(1, $2::bigint) g",
        &[&w.topic, &INBOX_EVENTS, &INBOX_CUSTOMERS],
    )
    .await
    .unwrap();
    let mut want: BTreeMap<String, i64> = BTreeMap::new();
    for g in 1..=INBOX_EVENTS {
        *want
            .entry(format!("c-{}", g % INBOX_CUSTOMERS))
            .or_default() += g;
    }

    // The relay dies mid-batch; relay-b republishes what relay-a published but had not acked.
    // Its database is cut once it holds a batch, not once a claim committed: a claim whose reply
    // is cut off is never published, and then nothing is republished.
    let held = w.relay.wait_metric(
        "outbox_claim_batch_size_sum",
        Duration::from_secs(30),
        |v| v > 0.0,
    );
    assert!(
        held.is_some_and(|v| v > 0.0),
        "relay-a never received a batch: {}",
        w.relay.log_tail(30)
    );
    w.proxy.as_ref().expect("proxied").black_hole();
    tokio::time::sleep(Duration::from_secs(3)).await;
    w.relay.signal(libc::SIGKILL);
    w.relay
        .wait_exit(Duration::from_secs(5))
        .expect("relay-a killed");
    let relay_b = Relay::spawn(
        &w.db.url(),
        &w.broker.addr(),
        &["--poll-interval", "200ms", "--owner", "relay-b"],
    );
    let counts = wait_counts(&c, Duration::from_secs(60), |m| {
        m["SUCCESS"] == INBOX_EVENTS
    })
    .await;
    assert_eq!(counts["SUCCESS"], INBOX_EVENTS, "{}", relay_b.log_tail(30));
    let msgs = w.broker.consume_all(&w.topic, Duration::from_secs(10));
    assert!(
        msgs.len() > INBOX_EVENTS as usize,
        "relay-b republished relay-a's unacked batch: {} messages for {INBOX_EVENTS} events",
        msgs.len()
    );
    println!("{} messages for {INBOX_EVENTS} events", msgs.len());
    w.publish_copy(&msgs[0], msgs.len());
    let on_topic = msgs.len() + 1;

    let group = format!("inbox-{}", w.run);
    let url = pg_url_as(&w.db, Some(&service));
    let run_consumer = |crash: Option<usize>| {
        let mut cmd = consumer();
        cmd.arg(&url)
            .arg(w.broker.addr())
            .env("OUTBOX_TOPIC", &w.topic)
            .env("CONSUMER_NAME", &consumer_role)
            .env("CONSUMER_GROUP", &group)
            .env("CONSUMER_INSTANCE", "inbox-consumer-1")
            .env("IDLE_SECONDS", "3");
        if let Some(n) = crash {
            cmd.env("EXIT_AFTER_COMMITS", n.to_string());
        }
        run(&format!("{lang} inbox consumer"), cmd)
    };
    let first = run_consumer(Some(CRASH_AFTER));
    let handled = first.records("applied").len() + first.records("duplicate").len();
    assert!(
        !first.ok && handled == CRASH_AFTER,
        "the first run dies after {CRASH_AFTER} commits\n{}",
        first.context()
    );
    let second = run_consumer(None);
    assert!(second.ok, "{}", second.context());
    let done = second.done();

    // The message whose offset the crash lost comes again, and only it.
    assert_eq!(
        done["messages"],
        (on_topic - (CRASH_AFTER - 1)).to_string(),
        "{}",
        second.context()
    );
    let mut applied = BTreeSet::new();
    for r in first
        .records("applied")
        .iter()
        .chain(&second.records("applied"))
    {
        assert!(
            applied.insert(r["event_id"].clone()),
            "event {} applied twice\n{}\n{}",
            r["event_id"],
            first.context(),
            second.context()
        );
    }
    let event_ids: BTreeSet<String> = c
        .query("SELECT event_id::text FROM outbox_event", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(applied, event_ids, "every event applied once");

    // What a user checks: each customer's points, and the inbox holding each event once.
    let got: BTreeMap<String, i64> = c
        .query("SELECT customer, points FROM loyalty_points", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        got, want,
        "loyalty points: every event applied exactly once"
    );
    let inbox: i64 = c
        .query_one(
            "SELECT count(*) FROM outbox_inbox WHERE consumer = $1",
            &[&consumer_role],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(inbox, INBOX_EVENTS);
    drop(relay_b);
    drop(w);
    drop(roles);
}

/// The venv of the Python example, or a failure naming what to run.
fn python() -> PathBuf {
    let venv = std::env::var_os("EXAMPLES_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| tools_dir().join("python-examples"));
    let python = venv.join("bin/python");
    assert!(
        python.is_file(),
        "the Python example needs the venv {} (psycopg, confluent-kafka): \
         run scripts/examples-setup python",
        venv.display()
    );
    python
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_inbox_consumer_applies_each_event_once_through_faults() {
    let python = python();
    let script = examples_dir().join("python/consumer.py");
    exactly_once_through_faults("python", &|| {
        let mut cmd = Command::new(&python);
        cmd.arg(&script);
        cmd
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn java_spring_inbox_consumer_applies_each_event_once_through_faults() {
    let (java, classpath) = java_build();
    exactly_once_through_faults("java", &|| {
        let mut cmd = Command::new(&java);
        cmd.args(["-cp", &classpath, "example.Consumer"]);
        cmd
    })
    .await;
}

/// Builds package `pkg` of examples/go offline into a temporary binary; returns its path.
fn go_build(pkg: &str) -> PathBuf {
    let go = tool("go", &["/usr/local/go/bin/go"], "go");
    let dir = examples_dir().join("go");
    let name = pkg.trim_start_matches("./").replace(['.', '/'], "");
    let bin = std::env::temp_dir().join(format!("outbox-example-go{name}-{}", std::process::id()));
    // Offline: the modules are the ones scripts/examples-setup put into Go's module cache.
    let mut cmd = Command::new(go);
    cmd.current_dir(&dir)
        .env("GOPROXY", "off")
        .args(["build", "-mod=readonly", "-o"])
        .arg(&bin)
        .arg(pkg);
    build(
        &format!("go build {pkg} (examples/go)"),
        cmd,
        "the Go example's modules must be in Go's module cache: run scripts/examples-setup go",
    );
    bin
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn go_franz_inbox_consumer_applies_each_event_once_through_faults() {
    let bin = go_build("./consumer");
    exactly_once_through_faults("go", &|| Command::new(&bin)).await;
    let _ = std::fs::remove_file(&bin);
}

/// `node` and examples/node with its packages installed, or a failure naming what to run.
fn node_example() -> (PathBuf, PathBuf) {
    let node = tool("node", &[], "node");
    let dir = examples_dir().join("node");
    for package in ["pg", "kafkajs"] {
        assert!(
            dir.join("node_modules")
                .join(package)
                .join("package.json")
                .is_file(),
            "the Node example needs its packages in {}: run scripts/examples-setup node",
            dir.join("node_modules").display()
        );
    }
    (node, dir)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_kafkajs_inbox_consumer_applies_each_event_once_through_faults() {
    let (node, dir) = node_example();
    exactly_once_through_faults("node", &|| {
        let mut cmd = Command::new(&node);
        cmd.arg(dir.join("consumer.js"));
        cmd
    })
    .await;
}
