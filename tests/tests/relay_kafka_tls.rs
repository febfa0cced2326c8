//! Kafka over TLS against a real broker with an SSL and a SASL_SSL listener and a CA the test
//! makes (`openssl`, tests/src/certs.rs): the relay verifies the broker's certificate and name
//! (librdkafka's default `ssl.endpoint.identification.algorithm=https`) and delivers over SSL and
//! over SASL_SSL (SCRAM-SHA-256); a CA that did not sign the broker's certificate, or a broker
//! reached by a name its certificate does not hold, stops the relay at start-up with exit 2 and
//! one line, before it claims anything.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use outbox_tests::broker::{free_port, Broker};
use outbox_tests::certs::Certs;
use outbox_tests::db::TestDb;
use outbox_tests::events::{enqueue, status_counts, wait_counts};
use outbox_tests::kafka;
use outbox_tests::relay::{relay_bin, Relay};
use serde_json::json;

/// The broker's name in its certificate (the only one).
const HOST: &str = "localhost";

struct TlsBroker {
    broker: Broker,
    tls: kafka::Tls,
    certs: Certs,
}

fn tls_broker() -> TlsBroker {
    let dir = std::env::temp_dir().join(format!("outbox-test-kafka-tls-{}", std::process::id()));
    let certs = Certs::create(&dir, HOST);
    let tls = kafka::Tls {
        host: HOST.into(),
        ssl_port: free_port(),
        sasl_ssl_port: free_port(),
        user: "outbox-relay".into(),
        password: "s3cret-tls".into(),
        key: certs.server_key.clone(),
        cert: certs.server_cert.clone(),
    };
    let broker = Broker::start_tls(&tls);
    broker.create_topic("orders");
    TlsBroker { broker, tls, certs }
}

/// A properties file in the certificates' directory (secrets go into a file, as docs/relay.md
/// says).
fn props_file(certs: &Certs, name: &str, lines: &str) -> PathBuf {
    let path = certs.dir.join(format!("{name}.properties"));
    std::fs::write(&path, lines).expect("properties file");
    path
}

fn ssl_props(ca: &Path) -> String {
    format!("security.protocol=ssl\nssl.ca.location={}\n", ca.display())
}

fn run(db: &TestDb, brokers: &str, props: &Path) -> Relay {
    Relay::spawn(
        &db.url(),
        brokers,
        &[
            "--poll-interval",
            "200ms",
            "--kafka-properties-file",
            props.to_str().expect("utf-8 path"),
        ],
    )
}

/// Enqueues one event, waits until `n` events are SUCCESS, stops the relay with SIGTERM.
async fn delivers(db: &TestDb, mut relay: Relay, n: i64) {
    let client = db.connect().await;
    enqueue(
        &client,
        "orders",
        "k",
        "T",
        &json!({"n": n}),
        &BTreeMap::new(),
    )
    .await;
    let counts = wait_counts(&client, Duration::from_secs(60), |c| c["SUCCESS"] == n).await;
    assert_eq!(counts["SUCCESS"], n, "{counts:?}\n{}", relay.logs());
    let status = relay.terminate(Duration::from_secs(30));
    assert!(
        status.as_ref().is_ok_and(|s| s.success()),
        "{status:?}\n{}",
        relay.logs()
    );
}

/// `outbox-worker run` (default log level) exits 2 within 30 s of its start with one line on
/// stderr naming the TLS failure, and claimed nothing.
async fn refused(db: &TestDb, brokers: &str, props: &Path, why: &str) -> String {
    let mut cmd = Command::new(relay_bin());
    cmd.args(["run", "--database-url", &db.url(), "--brokers", brokers])
        .arg("--kafka-properties-file")
        .arg(props);
    let mut relay = Relay::start(cmd).expect("spawn outbox-worker");
    let status = relay.wait_exit(Duration::from_secs(30));
    let line = relay.logs();
    if status.is_none() {
        let _ = relay.terminate(Duration::from_secs(30));
    }
    assert_eq!(status.and_then(|s| s.code()), Some(2), "{why}: {line}");
    assert_eq!(line.lines().count(), 1, "{why}: one line: {line}");
    assert!(
        line.contains("TLS to the Kafka brokers failed")
            && line.contains("certificate verify failed"),
        "{why}: {line}"
    );
    let counts = status_counts(&db.connect().await).await;
    assert_eq!(counts["SENDING"], 0, "{why}: nothing claimed: {counts:?}");
    eprintln!("{why}: {line}");
    line
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_verifies_the_brokers_certificate_and_name() {
    let TlsBroker { broker, tls, certs } = tls_broker();
    let db = TestDb::create();
    let by_name = format!("{HOST}:{}", tls.ssl_port);

    let good = props_file(&certs, "ssl", &ssl_props(&certs.ca));
    delivers(&db, run(&db, &by_name, &good), 1).await;

    let sasl_ssl = props_file(
        &certs,
        "sasl-ssl",
        &format!(
            "security.protocol=sasl_ssl\nssl.ca.location={}\nsasl.mechanisms=SCRAM-SHA-256\n\
             sasl.username={}\nsasl.password={}\n",
            certs.ca.display(),
            tls.user,
            tls.password
        ),
    );
    delivers(
        &db,
        run(&db, &format!("{HOST}:{}", tls.sasl_ssl_port), &sasl_ssl),
        2,
    )
    .await;

    // An event waits while the refused relays start.
    let client = db.connect().await;
    enqueue(
        &client,
        "orders",
        "k",
        "T",
        &json!({"n": 3}),
        &BTreeMap::new(),
    )
    .await;
    let wrong_ca = props_file(&certs, "other-ca", &ssl_props(&certs.other_ca));
    let line = refused(&db, &by_name, &wrong_ca, "untrusted CA").await;
    assert!(line.contains("ssl.ca.location"), "{line}");
    // The right CA, but the broker reached by an address its certificate does not name.
    let by_address = format!("127.0.0.1:{}", tls.ssl_port);
    refused(&db, &by_address, &good, "name not in the certificate").await;
    assert_eq!(status_counts(&client).await["WAIT"], 1);
    // The same address with the name check switched off: delivered, with a warning.
    let unchecked = props_file(
        &certs,
        "unchecked",
        &format!(
            "{}ssl.endpoint.identification.algorithm=none\n",
            ssl_props(&certs.ca)
        ),
    );
    let relay = run(&db, &by_address, &unchecked);
    assert!(
        relay
            .wait_log(
                &["identification.algorithm=none", "not checked"],
                Duration::from_secs(10)
            )
            .is_some(),
        "{}",
        relay.logs()
    );
    delivers(&db, relay, 4).await;

    let msgs = broker.consume_all("orders", Duration::from_secs(3));
    let mut ns: Vec<i64> = msgs
        .iter()
        .map(|m| {
            serde_json::from_str::<serde_json::Value>(&m.value).expect("JSON")["n"]
                .as_i64()
                .expect("n")
        })
        .collect();
    ns.sort();
    assert_eq!(
        ns,
        [1, 2, 3, 4],
        "each event once, none while the relays were refused"
    );
    let _ = std::fs::remove_dir_all(&certs.dir);
}
