//! The NATS sink over TLS with a user and password: a real nats-server with a TLS listener whose
//! certificate a CA made by the test signed. With that CA (`--nats-tls-ca`) and the user the relay
//! delivers; with a CA that signed nothing here it stops at start-up with exit 2 and one line,
//! before it claims anything.

use std::collections::BTreeMap;
use std::process::Command;
use std::time::Duration;

use outbox_tests::certs::Certs;
use outbox_tests::db::TestDb;
use outbox_tests::events::{enqueue, status_counts, wait_counts};
use outbox_tests::nats::{Nats, Secure};
use outbox_tests::relay::{relay_bin, Relay};
use serde_json::json;

/// The name in the server's certificate, and the one the relay connects by.
const HOST: &str = "localhost";
const USER: &str = "outbox";
const PASSWORD: &str = "s3cret-nats";

/// `outbox-worker run` to `tls://HOST:PORT` trusting `ca`, the password in the environment.
fn relay(db: &TestDb, nats: &Nats, ca: &std::path::Path) -> Relay {
    let mut cmd = Command::new(relay_bin());
    cmd.args(["run", "--database-url", &db.url(), "--sink", "nats"])
        .args(["--nats-url", &format!("tls://{HOST}:{}", nats.port)])
        .arg("--nats-tls-ca")
        .arg(ca)
        .args(["--nats-user", USER, "--poll-interval", "200ms"])
        .env("OUTBOX_NATS_PASSWORD", PASSWORD);
    Relay::start(cmd).expect("spawn outbox-worker")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_verifies_the_nats_servers_certificate() {
    let dir = std::env::temp_dir().join(format!("outbox-test-nats-tls-{}", std::process::id()));
    let certs = Certs::create(&dir, HOST);
    let nats = Nats::start_secure(Secure {
        cert: certs.server_cert.clone(),
        key: certs.server_key.clone(),
        ca: certs.ca.clone(),
        user: USER.into(),
        password: PASSWORD.into(),
    });
    nats.create_stream("orders");
    let db = TestDb::create();
    let client = db.connect().await;

    // A CA that did not sign the server's certificate: exit 2, one line, nothing claimed.
    enqueue(
        &client,
        "orders",
        "k",
        "Created",
        &json!({"n": 1}),
        &BTreeMap::new(),
    )
    .await;
    let mut refused = relay(&db, &nats, &certs.other_ca);
    let status = refused.wait_exit(Duration::from_secs(30));
    let line = refused.logs();
    if status.is_none() {
        let _ = refused.terminate(Duration::from_secs(30));
    }
    assert_eq!(status.and_then(|s| s.code()), Some(2), "{line}");
    assert_eq!(line.lines().count(), 1, "one line: {line}");
    assert!(
        line.contains("TLS to the NATS server") && line.contains("certificate"),
        "{line}"
    );
    let counts = status_counts(&client).await;
    assert_eq!(counts["SENDING"], 0, "nothing claimed: {counts:?}");
    eprintln!("wrong CA: {line}");

    // The CA that signed it: delivered.
    let mut good = relay(&db, &nats, &certs.ca);
    let counts = wait_counts(&client, Duration::from_secs(30), |c| c["SUCCESS"] == 1).await;
    assert_eq!(counts["SUCCESS"], 1, "{counts:?}\n{}", good.logs());
    let msgs = nats.consume_all("orders");
    assert_eq!(msgs.len(), 1, "{msgs:?}");
    assert_eq!(msgs[0].key.as_deref(), Some("k"));
    let status = good.terminate(Duration::from_secs(30));
    assert!(
        status.as_ref().is_ok_and(|s| s.success()),
        "{status:?}\n{}",
        good.logs()
    );
    let _ = std::fs::remove_dir_all(&dir);
}
