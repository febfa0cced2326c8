//! The relay's Kafka conventions and build, against the real broker: keys land on the partition
//! the Java client would choose, each partition is written by one of the relay's producers, the
//! message timestamp is the event's created_at (an event older
//! than its topic accepts is a dead letter), every message says `content-type`, zstd and lz4
//! compressed batches arrive intact, and librdkafka's statistics and the build reach `/metrics`.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpListener;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use outbox_tests::broker::{Broker, Msg};
use outbox_tests::db::TestDb;
use outbox_tests::events::{enqueue, status_counts, wait_counts};
use outbox_tests::kafka;
use outbox_tests::relay::Relay;
use outbox_worker::lanes::partition_of_key;
use serde_json::json;

/// Enqueues one event per key on `topic` (payload `{"n": i}`), commits, and has a relay started
/// with `extra` publish them; returns the relay (still running) and the messages of `topic` read
/// back.
async fn relay_keys(
    db: &TestDb,
    broker: &Broker,
    topic: &str,
    keys: &[String],
    extra: &[&str],
    payload: fn(usize) -> serde_json::Value,
) -> (Relay, Vec<Msg>) {
    let client = db.connect().await;
    let before = status_counts(&client).await["SUCCESS"];
    for (i, k) in keys.iter().enumerate() {
        enqueue(&client, topic, k, "T", &payload(i), &BTreeMap::new()).await;
    }
    let mut args = vec!["--poll-interval", "200ms"];
    args.extend_from_slice(extra);
    let worker = Relay::spawn(&db.url(), &broker.addr(), &args);
    let n = before + keys.len() as i64;
    let counts = wait_counts(&client, Duration::from_secs(60), |c| c["SUCCESS"] == n).await;
    assert_eq!(counts["SUCCESS"], n, "{counts:?}\n{}", worker.logs());
    let msgs = broker.consume_all(topic, Duration::from_secs(3));
    assert_eq!(msgs.len(), keys.len(), "one message per event");
    (worker, msgs)
}

/// `{"n": i}`: the payload of relay_keys' events.
fn numbered(i: usize) -> serde_json::Value {
    json!({ "n": i })
}

/// `{"n": i}` with 2 KB of repeated text: librdkafka sends a batch uncompressed when compressing
/// does not make it smaller, which a batch of one small event never is; a compressible payload
/// makes every batch compress, however the rounds happen to split the events.
fn padded(i: usize) -> serde_json::Value {
    json!({ "n": i, "pad": "order created ".repeat(150) })
}

/// The payload of the tests' single events.
fn a_payload() -> serde_json::Value {
    json!({"a": 1})
}

/// `n` random keys of 1 to 12 characters, ASCII and not (Latin-1, CJK, an emoji: 2, 3 and 4
/// UTF-8 bytes), none with a line break.
fn random_keys(n: usize) -> Vec<String> {
    const CHARS: &[char] = &[
        'a', 'b', 'k', 'z', 'A', 'Q', '0', '7', '9', '-', '_', ':', ' ', 'ü', 'é', 'ß', 'Ω', 'ж',
        '日', '本', '語', '€', '🙂', '🚀',
    ];
    let mut bytes = vec![0u8; n * 13];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .expect("/dev/urandom");
    bytes
        .chunks(13)
        .map(|c| {
            let len = 1 + usize::from(c[0]) % 12;
            c[1..=len]
                .iter()
                .map(|b| CHARS[usize::from(*b) % CHARS.len()])
                .collect()
        })
        .collect()
}

/// Runs `tests/java/JavaProducer.java` (Java's single-file source launcher, `java` from the PATH,
/// the jars of the installed Kafka: `$KAFKA_HOME/libs`): a real Java KafkaProducer sends each key
/// to `topic`; returns the partition of each.
fn java_partitions(bootstrap: &str, topic: &str, keys: &[String]) -> Vec<i32> {
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("java/JavaProducer.java");
    let mut child = Command::new("java")
        .arg("-cp")
        .arg(format!("{}/libs/*", kafka::home().display()))
        .arg(&source)
        .args([bootstrap, topic])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run java (Java 17 on the PATH)");
    let mut stdin = child.stdin.take().expect("stdin");
    for k in keys {
        writeln!(stdin, "{k}").expect("write a key to java");
    }
    drop(stdin);
    let out = child.wait_with_output().expect("java");
    assert!(
        out.status.success(),
        "JavaProducer failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .expect("utf-8")
        .lines()
        .map(|l| l.trim().parse().expect("a partition number"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_lands_on_the_partition_the_java_client_chooses() {
    let db = TestDb::create();
    let broker = Broker::start();
    // 7 partitions: not a power of two, so a hash that only agrees on low bits would show.
    kafka::create_topics(&broker.addr(), &["relay", "java"], 7).expect("topics");
    let keys = random_keys(200);

    let (_worker, msgs) = relay_keys(&db, &broker, "relay", &keys, &[], numbered).await;
    let relay: BTreeMap<String, i64> = msgs
        .iter()
        .map(|m| (m.key.clone().expect("keyed message"), m.partition))
        .collect();
    let java = java_partitions(&broker.addr(), "java", &keys);
    assert_eq!(java.len(), keys.len(), "one partition per key from java");

    let differ: Vec<_> = keys
        .iter()
        .zip(&java)
        .filter(|(k, j)| relay.get(*k) != Some(&i64::from(**j)))
        .map(|(k, j)| format!("{k:?}: relay {:?}, java {j}", relay.get(k)))
        .collect();
    assert!(
        differ.is_empty(),
        "{} of {} keys on another partition than the Java client's:\n{}",
        differ.len(),
        keys.len(),
        differ.join("\n")
    );
    let used: std::collections::BTreeSet<_> = relay.values().collect();
    assert_eq!(used.len(), 7, "200 keys spread over every partition");
}

/// librdkafka writes one partition per request, one request at a time per connection: the relay's
/// producers (`--kafka-connections`) each write whole partitions, side by side. 6 partitions over
/// 4 producers: a key's hash modulo 4 (the rule before librdkafka's statistics name the partition
/// count) would split partitions between producers, so this checks the count is used.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_partition_is_written_by_one_of_the_relays_producers() {
    let db = TestDb::create();
    let broker = Broker::start();
    kafka::create_topics(&broker.addr(), &["lanes"], 6).expect("topic");
    // A first event whose producer is the same by either rule, so librdkafka learns the topic.
    let first = (0..)
        .map(|i| format!("first-{i}"))
        .find(|k| partition_of_key(k, 6) % 4 == partition_of_key(k, 4))
        .expect("a key");
    let args = [
        "--kafka-connections",
        "4",
        "--kafka-property",
        "statistics.interval.ms=100",
    ];
    let (worker, _) = relay_keys(&db, &broker, "lanes", &[first], &args, numbered).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let client = db.connect().await;
    for i in 0..200 {
        let key = format!("order-{i}");
        enqueue(&client, "lanes", &key, "T", &numbered(i), &BTreeMap::new()).await;
    }
    let counts = wait_counts(&client, Duration::from_secs(60), |c| c["SUCCESS"] == 201).await;
    assert_eq!(counts["SUCCESS"], 201, "{counts:?}\n{}", worker.logs());
    let mut writers = BTreeMap::new();
    for p in 0..6 {
        let ids = kafka::producer_ids(&broker.addr(), "lanes", p).expect("describe-producers");
        let logs = worker.logs();
        assert_eq!(ids.len(), 1, "partition {p} written by {ids:?}\n{logs}");
        writers.insert(p, ids[0]);
    }
    let producers: std::collections::BTreeSet<_> = writers.values().collect();
    assert_eq!(producers.len(), 4, "producers by partition: {writers:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_carry_the_creation_time_and_a_content_type() {
    let db = TestDb::create();
    let broker = Broker::start();
    broker.create_topic("orders");
    let client = db.connect().await;
    let plain = enqueue(&client, "orders", "A", "T", &a_payload(), &BTreeMap::new()).await;
    let own = BTreeMap::from([(
        "content-type".to_string(),
        "application/cloudevents+json".to_string(),
    )]);
    let typed = enqueue(&client, "orders", "B", "T", &json!({"b": 2}), &own).await;
    // Relayed well after they were created: a timestamp taken at send time would differ.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let created: BTreeMap<i64, i64> = client
        .query(
            "SELECT id, (extract(epoch from date_trunc('milliseconds', created_at)) * 1000)::int8 \
             FROM outbox_event",
            &[],
        )
        .await
        .expect("created_at")
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();

    let worker = Relay::spawn(&db.url(), &broker.addr(), &["--poll-interval", "200ms"]);
    let counts = wait_counts(&client, Duration::from_secs(30), |c| c["SUCCESS"] == 2).await;
    assert_eq!(counts["SUCCESS"], 2, "{counts:?}\n{}", worker.logs());
    let msgs = broker.consume_all("orders", Duration::from_secs(3));
    assert_eq!(msgs.len(), 2);
    for m in &msgs {
        let id = m.outbox_id();
        assert_eq!(
            m.timestamp_ms,
            Some(created[&id]),
            "timestamp of {id} is its created_at in ms"
        );
        let want = if id == typed.id {
            "application/cloudevents+json"
        } else {
            assert_eq!(id, plain.id);
            "application/json"
        };
        assert_eq!(
            m.headers.get("content-type").map(String::as_str),
            Some(want),
            "content-type of {id}: {m:?}"
        );
    }
}

/// A topic that refuses old timestamps (`message.timestamp.before.max.ms`, Kafka 3.6+) rejects
/// events created before that with InvalidTimestamp: the event's fault, which no retry fixes. Each
/// failure counts an attempt and the events end as dead letters naming the error (they used to
/// be released every second for good, never counted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_older_than_the_topic_accepts_become_dead_letters() {
    let db = TestDb::create();
    db.set(&[
        ("outbox.max_retry", "1"),
        ("outbox.backoff_base", "100ms"),
        ("outbox.backoff_max", "1s"),
    ]);
    let broker = Broker::start();
    broker.create_topic_with("recent", &[("message.timestamp.before.max.ms", "60000")]);
    let client = db.connect().await;
    let mut ids = Vec::new();
    for k in ["a", "b", "c"] {
        ids.push(
            enqueue(&client, "recent", k, "T", &a_payload(), &BTreeMap::new())
                .await
                .id,
        );
    }
    // The message timestamp is created_at: an hour old is beyond the topic's minute.
    client
        .batch_execute(
            "UPDATE outbox_stream SET created_at = created_at - interval '1 hour'; \
             UPDATE outbox_scheduled SET created_at = created_at - interval '1 hour'",
        )
        .await
        .expect("backdate");

    // One event a round: librdkafka fails the other records of a batch the broker rejected one
    // record of with InvalidRecord, which would make the codes depend on the batching.
    let worker = Relay::spawn(
        &db.url(),
        &broker.addr(),
        &["--poll-interval", "200ms", "--batch-size", "1"],
    );
    let counts = wait_counts(&client, Duration::from_secs(60), |c| c["FAIL"] == 3).await;
    assert_eq!(counts["FAIL"], 3, "{counts:?}\n{}", worker.logs());
    for r in client
        .query(
            "SELECT id, retry_count, last_error FROM outbox_event WHERE status = 'FAIL'",
            &[],
        )
        .await
        .expect("dead letters")
    {
        let (id, attempts, error): (i64, i32, String) = (r.get(0), r.get(1), r.get(2));
        assert!(ids.contains(&id));
        assert_eq!(attempts, 2, "max_retry 1: dead at the second attempt");
        assert!(
            error.contains("topic recent") && error.contains("InvalidTimestamp"),
            "{error}"
        );
    }
    // Two attempts of each of the 3 events, all InvalidTimestamp, classed permanent.
    for (name, labels) in [
        ("outbox_publish_errors_total", r#"code="InvalidTimestamp""#),
        ("outbox_publish_errors_total", r#"class="permanent""#),
        ("outbox_failed_total", r#"class="permanent""#),
    ] {
        assert_eq!(
            worker.metric_where(name, labels),
            Some(6.0),
            "{name}{{{labels}}}: {:?}",
            samples(&worker, name)
        );
    }
    assert_eq!(worker.metric("outbox_dead_lettered_total"), Some(3.0));
    assert_eq!(
        worker.metric_where("outbox_publish_errors_total", r#"class="unknown""#),
        None
    );
    assert!(broker
        .consume_all("recent", Duration::from_secs(2))
        .is_empty());
}

/// The compression codecs of the batches in a topic's partition 0, as Kafka's own
/// `DumpLogSegments` (kafka-dump-log.sh) reads them from the broker's segment files.
fn codecs_on_disk(broker: &Broker, topic: &str) -> Vec<String> {
    let dir = broker.data_dir().join(format!("{topic}-0"));
    let segments: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "log"))
        .collect();
    let out = Command::new("java")
        .arg("-cp")
        .arg(format!("{}/libs/*", kafka::home().display()))
        .args(["org.apache.kafka.tools.DumpLogSegments", "--files"])
        .arg(
            segments
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(","),
        )
        .output()
        .expect("java DumpLogSegments");
    assert!(
        out.status.success(),
        "DumpLogSegments failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let words: Vec<&str> = text.split_whitespace().collect();
    words
        .windows(2)
        .filter(|w| w[0] == "compresscodec:")
        .map(|w| w[1].to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zstd_and_lz4_batches_arrive_intact() {
    let db = TestDb::create();
    let broker = Broker::start();
    for codec in ["zstd", "lz4"] {
        kafka::create_topics(&broker.addr(), &[codec], 1).expect("topic");
        let keys: Vec<String> = (0..50).map(|i| format!("{codec}-{i}")).collect();
        let prop = format!("compression.type={codec}");
        let (mut worker, msgs) = relay_keys(
            &db,
            &broker,
            codec,
            &keys,
            &["--kafka-property", &prop],
            padded,
        )
        .await;
        let mut got: Vec<(String, serde_json::Value)> = msgs
            .iter()
            .map(|m| {
                (
                    m.key.clone().expect("key"),
                    serde_json::from_str(&m.value).expect("JSON value"),
                )
            })
            .collect();
        got.sort_by_key(|(k, _)| keys.iter().position(|x| x == k));
        let want: Vec<_> = keys
            .iter()
            .enumerate()
            .map(|(i, k)| (k.clone(), padded(i)))
            .collect();
        assert_eq!(got, want, "{codec}: every event, key and value intact");
        let codecs = codecs_on_disk(&broker, codec);
        assert!(
            !codecs.is_empty() && codecs.iter().all(|c| c == codec),
            "{codec}: batches on disk compressed with {codecs:?}"
        );
        worker.signal(libc::SIGTERM);
        assert!(worker.wait_exit(Duration::from_secs(30)).is_some());
    }
}

/// The samples of a metric family: (labels as written, value).
fn samples(worker: &Relay, name: &str) -> Vec<(String, f64)> {
    let (_, body) = worker.http_get("/metrics").expect("/metrics");
    body.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let labels = series.strip_prefix(name)?;
            if !labels.is_empty() && !labels.starts_with('{') {
                return None; // another metric whose name starts with this one
            }
            Some((labels.to_string(), value.parse().ok()?))
        })
        .collect()
}

/// Polls `samples` until `pred` holds; returns the last samples.
fn wait_samples(
    worker: &Relay,
    name: &str,
    pred: impl Fn(&[(String, f64)]) -> bool,
) -> Vec<(String, f64)> {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let s = samples(worker, name);
        if pred(&s) || std::time::Instant::now() > deadline {
            return s;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn librdkafka_statistics_and_build_reach_the_metrics() {
    let db = TestDb::create();
    // A failed publish is a dead letter at once (the alert-rule check below needs one).
    db.set(&[("outbox.max_retry", "0")]);
    let broker = Broker::start();
    broker.create_topic("orders");
    let keys: Vec<String> = (0..20).map(|i| format!("k{i}")).collect();
    let (worker, _) = relay_keys(
        &db,
        &broker,
        "orders",
        &keys,
        &["--kafka-property", "statistics.interval.ms=500"],
        numbered,
    )
    .await;

    // The features a platform needs, in the start-up log.
    let line = worker
        .wait_log(&["librdkafka build"], Duration::from_secs(5))
        .expect("librdkafka build line");
    let features = line
        .split("features=")
        .nth(1)
        .expect("features=")
        .split_whitespace()
        .next()
        .unwrap_or_default();
    for f in [
        "ssl",
        "sasl_scram",
        "sasl_oauthbearer",
        "oidc",
        "zstd",
        "lz4",
    ] {
        assert!(
            features.split(',').any(|x| x == f),
            "librdkafka built without {f}: {line}"
        );
    }

    let build = samples(&worker, "outbox_relay_build_info");
    let want = format!("version=\"{}\"", env!("CARGO_PKG_VERSION"));
    assert!(
        build.len() == 1
            && build[0].0.contains(&want)
            && build[0].0.contains("rdkafka_version=\"2."),
        "build_info: {build:?}"
    );
    assert_eq!(build[0].1, 1.0);

    // The broker the cluster metadata named (node 1) is up, and has a round-trip time.
    let node = format!("{{broker=\"{}/1\"}}", broker.addr());
    let up = wait_samples(&worker, "outbox_kafka_broker_up", |s| {
        s.iter().any(|(l, v)| *l == node && *v == 1.0)
    });
    assert!(
        up.iter().any(|(l, v)| *l == node && *v == 1.0),
        "broker up: {up:?}"
    );
    let rtt = wait_samples(&worker, "outbox_kafka_broker_rtt_p99_seconds", |s| {
        s.iter().any(|(l, v)| *l == node && *v > 0.0)
    });
    assert!(
        rtt.iter().any(|(l, v)| *l == node && *v > 0.0 && *v < 5.0),
        "rtt p99: {rtt:?}"
    );
    let queued = wait_samples(&worker, "outbox_kafka_queue_messages", |s| {
        s == [(String::new(), 0.0)]
    });
    assert_eq!(
        queued,
        vec![(String::new(), 0.0)],
        "nothing left in the producer's queue"
    );

    // Every metric the example alert rules name is one the relay exports (the labelled failure
    // counters appear with their first sample: one event of a missing topic, dead-lettered at
    // its first attempt).
    enqueue(
        &db.connect().await,
        "no-such-topic",
        "k",
        "T",
        &a_payload(),
        &BTreeMap::new(),
    )
    .await;
    let dead = worker.wait_metric("outbox_dead_lettered_total", Duration::from_secs(30), |v| {
        v >= 1.0
    });
    assert_eq!(dead, Some(1.0), "{}", worker.logs());
    let (_, body) = worker.http_get("/metrics").expect("/metrics");
    let rules =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/alerts.yml"))
            .expect("docs/alerts.yml");
    let named = metric_names(&rules);
    assert!(named.len() >= 5, "alert rules name metrics: {named:?}");
    for m in &named {
        assert!(
            body.lines().any(|l| l
                .strip_prefix("# TYPE ")
                .and_then(|t| t.split_whitespace().next())
                .is_some_and(|t| t == m
                    || [("_bucket"), ("_sum"), ("_count")]
                        .iter()
                        .any(|s| m.strip_suffix(s) == Some(t)))),
            "docs/alerts.yml names {m}, which the relay does not export"
        );
    }

    // docs/relay.md's metric tables list exactly the families the relay exports.
    let exported: std::collections::BTreeSet<String> = body
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|t| t.split_whitespace().next())
        .map(str::to_string)
        .collect();
    let guide =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/relay.md"))
            .expect("docs/relay.md");
    let mut documented = std::collections::BTreeSet::new();
    for row in guide
        .lines()
        .skip_while(|l| !l.starts_with("## Metrics"))
        .skip(1)
        .take_while(|l| !l.starts_with("## "))
        .filter(|l| l.starts_with("| `outbox_"))
    {
        let first = row.split(" | ").next().unwrap_or("");
        for code in first.split('`').skip(1).step_by(2) {
            documented.insert(code.split('{').next().unwrap_or(code).to_string());
        }
    }
    assert_eq!(
        documented, exported,
        "docs/relay.md, Metrics: documented vs exported families"
    );

    // The broker gone: its gauge says down.
    drop(broker);
    let down = wait_samples(&worker, "outbox_kafka_broker_up", |s| {
        s.iter().any(|(l, v)| *l == node && *v == 0.0)
    });
    assert!(
        down.iter().any(|(l, v)| *l == node && *v == 0.0),
        "broker down: {down:?}"
    );
}

/// The `outbox_*` metric names in the `expr:` of the rules (comments skipped).
fn metric_names(yaml: &str) -> std::collections::BTreeSet<String> {
    let mut names = std::collections::BTreeSet::new();
    let mut in_expr = false;
    for line in yaml.lines() {
        let t = line.trim_start();
        if t.starts_with('#') {
            continue;
        }
        if let Some(rest) = t.strip_prefix("expr:") {
            in_expr = true;
            scan(rest, &mut names);
        } else if in_expr && !t.contains(": ") && !t.ends_with(':') && !t.starts_with("- ") {
            // A continuation line of a multi-line expression.
            scan(t, &mut names);
        } else {
            in_expr = false;
        }
    }
    names
}

fn scan(text: &str, out: &mut std::collections::BTreeSet<String>) {
    let mut rest = text;
    while let Some(i) = rest.find("outbox_") {
        let word: String = rest[i..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        rest = &rest[i + word.len()..];
        out.insert(word);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_authenticates_with_sasl_scram_and_oauthbearer_oidc() {
    let listener = kafka::Sasl {
        port: outbox_tests::broker::free_port(),
        user: "outbox-relay".into(),
        password: "s3cret-äö".into(),
    };
    let broker = Broker::start_sasl(&listener);
    broker.create_topic("orders");
    let db = TestDb::create();
    let dir = std::env::temp_dir().join(format!("outbox-test-sasl-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    // Secrets go into a properties file, as docs/relay.md recommends.
    let props = |name: &str, lines: String| {
        let path = dir.join(format!("{name}.properties"));
        std::fs::write(&path, format!("security.protocol=sasl_plaintext\n{lines}"))
            .expect("properties file");
        path.display().to_string()
    };
    let scram = |password: &str| {
        format!(
            "sasl.mechanisms=SCRAM-SHA-256\nsasl.username={}\nsasl.password={password}\n",
            listener.user
        )
    };
    let addr = format!("127.0.0.1:{}", listener.port);
    let run = |file: String| {
        Relay::spawn(
            &db.url(),
            &addr,
            &["--poll-interval", "200ms", "--kafka-properties-file", &file],
        )
    };
    let client = db.connect().await;
    // Each relay is stopped the graceful way (SIGTERM) before the next event is enqueued: a
    // SIGKILLed relay's last claim still runs in PostgreSQL after the process is gone, and could
    // take an event committed meanwhile for a dead owner until the lease (10 min) ends (the native
    // build rolls such a claim back since 0.12.0; the SQL-only build cannot). A CI failure of this
    // test showed its event held by the previous, already killed relay.
    let stop = |mut relay: Relay| {
        let status = relay.terminate(Duration::from_secs(30));
        assert!(
            status.as_ref().is_ok_and(|s| s.success()),
            "the relay stops cleanly on SIGTERM: {status:?}\n{}",
            relay.logs()
        );
    };
    let delivered = |relay: Relay, n: i64| {
        let client = &client;
        async move {
            enqueue(client, "orders", "A", "T", &a_payload(), &BTreeMap::new()).await;
            let counts = wait_counts(client, Duration::from_secs(60), |c| c["SUCCESS"] == n).await;
            // Who holds what, should it fail.
            let rows: Vec<String> = client
                .query(
                    "SELECT format('%s %s owner=%s claimed_at=%s token=%s retries=%s error=%s',
                                   id, status, claim_owner, claimed_at, claim_token, retry_count,
                                   last_error)
                       FROM outbox_event ORDER BY id",
                    &[],
                )
                .await
                .expect("events")
                .iter()
                .map(|r| r.get(0))
                .collect();
            assert_eq!(
                counts["SUCCESS"],
                n,
                "{counts:?}\n{}\nrelay pid {}:\n{}",
                rows.join("\n"),
                relay.pid(),
                relay.logs()
            );
            stop(relay);
        }
    };

    // A wrong password: the broker's refusal is in the relay's log.
    let wrong = run(props("wrong", scram("wrong")));
    assert!(
        wrong
            .wait_log(&["librdkafka", "uthentication"], Duration::from_secs(30))
            .is_some(),
        "a failed SCRAM login is logged:\n{}",
        wrong.logs()
    );
    stop(wrong);

    delivered(run(props("scram", scram(&listener.password))), 1).await;
    // OAUTHBEARER the way platforms run it: OIDC client credentials, the token fetched by
    // librdkafka (its curl feature) from the identity provider's endpoint.
    let (url, requests) = token_endpoint("outbox-relay");
    let oidc = props(
        "oidc",
        format!(
            "sasl.mechanisms=OAUTHBEARER\nsasl.oauthbearer.method=oidc\n\
             sasl.oauthbearer.token.endpoint.url={url}\n\
             sasl.oauthbearer.client.id=relay\nsasl.oauthbearer.client.secret=relay-secret\n"
        ),
    );
    delivered(run(oidc), 2).await;
    let requests = requests.lock().expect("requests").clone();
    let basic = format!("Basic {}", standard_base64(b"relay:relay-secret"));
    assert!(
        requests
            .iter()
            .any(|r| r.contains("grant_type=client_credentials") && r.contains(&basic)),
        "the token was fetched with the client credentials: {requests:?}"
    );

    let msgs = broker.consume_all("orders", Duration::from_secs(3));
    assert_eq!(msgs.len(), 2);
    for m in &msgs {
        let value: serde_json::Value = serde_json::from_str(&m.value).expect("JSON");
        assert_eq!(value, a_payload());
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A stand-in for an identity provider's token endpoint (OAuth 2 client credentials): answers
/// every request with an unsigned JWT for `sub` (`alg: none`, which the test broker's unsecured
/// validator accepts, valid for an hour). Returns its URL and the requests it received.
fn token_endpoint(sub: &'static str) -> (String, Arc<Mutex<Vec<String>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let url = format!("http://{}/token", listener.local_addr().expect("addr"));
    let requests = Arc::new(Mutex::new(Vec::new()));
    let seen = requests.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut s) = stream else { continue };
            let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
            seen.lock().expect("requests").push(read_request(&mut s));
            let now = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .expect("clock")
                .as_secs();
            let claims = json!({"sub": sub, "iat": now, "exp": now + 3600}).to_string();
            let jwt = format!(
                "{}.{}.",
                kafka::base64url(br#"{"alg":"none"}"#),
                kafka::base64url(claims.as_bytes())
            );
            let body = json!({"access_token": jwt, "token_type": "bearer", "expires_in": 3600})
                .to_string();
            let _ = write!(
                s,
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
                 Connection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    (url, requests)
}

/// One HTTP request: the head, then as many body bytes as its Content-Length says.
fn read_request(s: &mut std::net::TcpStream) -> String {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let text = String::from_utf8_lossy(&buf).into_owned();
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let len = head
                .lines()
                .find_map(|l| {
                    let (k, v) = l.split_once(':')?;
                    k.eq_ignore_ascii_case("content-length")
                        .then(|| v.trim().parse::<usize>().ok())?
                })
                .unwrap_or(0);
            if body.len() >= len {
                return text;
            }
        }
        match s.read(&mut chunk) {
            Ok(0) | Err(_) => return text,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

/// Standard base64 with padding (an HTTP Basic credential), from the URL-safe one.
fn standard_base64(bytes: &[u8]) -> String {
    let mut b = kafka::base64url(bytes).replace('-', "+").replace('_', "/");
    while !b.len().is_multiple_of(4) {
        b.push('=');
    }
    b
}

/// The harness's own check: a broker started on a port another broker already serves fails to
/// start, instead of taking the other broker's answers for its own (a test would then freeze,
/// stop or read a broker it does not own).
#[test]
fn a_broker_on_a_port_another_broker_serves_does_not_start() {
    let first = Broker::start();
    let dir = std::env::temp_dir().join(format!(
        "outbox-test-kafka-taken-{}-{}",
        first.port,
        std::process::id()
    ));
    let second = Broker::try_start_in(&dir, first.port, None);
    let _ = std::fs::remove_dir_all(&dir);
    match second {
        Ok(_) => panic!("a second broker started on port {}", first.port),
        Err(e) => assert!(e.contains("Address already in use"), "{e}"),
    }
}
