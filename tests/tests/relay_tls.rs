//! TLS to PostgreSQL against a throwaway PostgreSQL 15 cluster with `ssl = on` and a certificate
//! the test makes (the shared server's configuration is never changed): `verify-full` with the
//! right CA delivers events end to end over TLS sessions; a wrong CA, a wrong host name or a
//! server without TLS under `require` stop the relay at start-up with exit 2 and one line; a
//! client certificate is presented when `sslcert`/`sslkey` are given.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Output;
use std::time::Duration;

use outbox_tests::broker::{free_port, Broker};
use outbox_tests::certs::Certs;
use outbox_tests::db::connect;
use outbox_tests::events::enqueue;
use outbox_tests::pg_cluster::PgCluster;
use outbox_tests::relay::{run_cmd, Relay};
use serde_json::json;

/// A cluster with `ssl = on`, a database `app` with the extension, and the certificates (server
/// certificate for `localhost` only). With `client_cert`, TCP sessions must present a client
/// certificate signed by the CA (`cert` authentication: its CN is the user).
fn tls_cluster(name: &str, client_cert: bool) -> (PgCluster, Certs) {
    let dir = std::env::temp_dir().join(format!("outbox-test-certs-{name}-{}", std::process::id()));
    let certs = Certs::create(&dir, "localhost");
    let mut conf =
        "ssl = on\nssl_cert_file = 'server.crt'\nssl_key_file = 'server.key'\n".to_string();
    if client_cert {
        let hba = dir.join("hba.conf");
        std::fs::write(&hba, "local all all trust\nhostssl all all all cert\n").expect("hba.conf");
        conf.push_str(&format!(
            "ssl_ca_file = 'ca.crt'\nhba_file = '{}'\n",
            hba.display()
        ));
    }
    let pg = PgCluster::start(&conf, &[&certs.server_cert, &certs.server_key, &certs.ca]);
    pg.psql("postgres", "CREATE DATABASE app");
    pg.psql("app", "CREATE EXTENSION outbox");
    (pg, certs)
}

fn url(pg: &PgCluster, host: &str, tls: &str, ca: &Path) -> String {
    format!(
        "{} sslmode={tls} sslrootcert={}",
        pg.params(host, "app"),
        ca.display()
    )
}

fn stderr_line(out: &Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(stderr.lines().count(), 1, "one line expected: {stderr}");
    stderr
}

/// `outbox-worker stats` (one direct session) succeeds.
fn stats_ok(db_url: &str) {
    let out = run_cmd(&["stats", "--database-url", db_url]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_full_with_the_right_ca_delivers_over_tls() {
    let (pg, certs) = tls_cluster("ok", false);
    let broker = Broker::start();
    broker.create_topic("orders");
    let follower = broker.follow("orders");
    let client = connect(&pg.params("localhost", "app")).await;

    let w = Relay::spawn(
        &url(&pg, "localhost", "verify-full", &certs.ca),
        &broker.addr(),
        &["--poll-interval", "200ms"],
    );
    let ev = enqueue(
        &client,
        "orders",
        "k",
        "Created",
        &json!({"n": 1}),
        &BTreeMap::new(),
    )
    .await;
    assert!(
        follower.wait_for(ev.id, Duration::from_secs(20)).is_some(),
        "{}",
        w.logs()
    );
    // Every session of the relay (pool and LISTEN) is encrypted.
    let rows = client
        .query(
            "SELECT s.ssl FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) \
             WHERE a.application_name = 'outbox-worker'",
            &[],
        )
        .await
        .expect("pg_stat_ssl");
    assert!(rows.len() >= 2, "{} sessions", rows.len());
    assert!(
        rows.iter().all(|r| r.get::<_, bool>(0)),
        "a session without TLS"
    );

    // require: encrypted without verification, so even an unrelated CA file is not consulted...
    stats_ok(&format!(
        "{} sslmode=require",
        pg.params("127.0.0.1", "app")
    ));
    // ...unless given with sslrootcert, which makes it verify-ca (libpq's rule); verify-ca does
    // not check the host name.
    stats_ok(&url(&pg, "127.0.0.1", "verify-ca", &certs.ca));
    let out = run_cmd(&[
        "stats",
        "--database-url",
        &url(&pg, "localhost", "require", &certs.other_ca),
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr_line(&out));
}

#[test]
fn certificate_failures_stop_the_relay_with_exit_2() {
    let (pg, certs) = tls_cluster("bad", false);
    let brokers = format!("127.0.0.1:{}", free_port());
    for (db_url, why) in [
        (
            url(&pg, "localhost", "verify-full", &certs.other_ca),
            "untrusted CA",
        ),
        (
            url(&pg, "127.0.0.1", "verify-full", &certs.ca),
            "host name not in the certificate",
        ),
    ] {
        let out = run_cmd(&["run", "--database-url", &db_url, "--brokers", &brokers]);
        let line = stderr_line(&out);
        assert_eq!(out.status.code(), Some(2), "{why}: {line}");
        assert!(
            line.contains("TLS to the database failed")
                && line.contains("sslmode=verify-full")
                && line.contains("certificate verify failed"),
            "{why}: {line}"
        );
        eprintln!("{why}: {line}");
    }
    let missing = Path::new("/nonexistent/ca.pem");
    let out = run_cmd(&[
        "run",
        "--database-url",
        &url(&pg, "localhost", "verify-full", missing),
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr_line(&out).contains("/nonexistent/ca.pem"));
    let out = run_cmd(&[
        "run",
        "--database-url",
        &format!("{} sslmode=verify", pg.params("localhost", "app")),
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr_line(&out).contains("invalid sslmode"));
}

#[test]
fn a_client_certificate_is_presented_when_given() {
    let (pg, certs) = tls_cluster("client", true);
    let verified = url(&pg, "localhost", "verify-full", &certs.ca);
    stats_ok(&format!(
        "{verified} sslcert={} sslkey={}",
        certs.client_cert.display(),
        certs.client_key.display()
    ));
    let out = run_cmd(&["stats", "--database-url", &verified]);
    let line = stderr_line(&out);
    assert!(!out.status.success(), "no client certificate, yet: {line}");
    assert!(line.contains("certificate"), "{line}");
    eprintln!("{line}");
}

#[test]
fn require_against_a_server_without_tls_exits_2() {
    let pg = PgCluster::start("ssl = off", &[]);
    pg.psql("postgres", "CREATE EXTENSION outbox");
    let db_url = format!("{} sslmode=require", pg.params("localhost", "postgres"));
    let out = run_cmd(&["run", "--database-url", &db_url]);
    let line = stderr_line(&out);
    assert_eq!(out.status.code(), Some(2), "{line}");
    assert!(
        line.contains("TLS to the database failed") && line.contains("does not support TLS"),
        "{line}"
    );
    eprintln!("{line}");
    // prefer (the default) falls back to a plain session.
    stats_ok(&pg.params("localhost", "postgres"));
}
