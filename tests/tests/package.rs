//! The release package (`scripts/package`, path in `OUTBOX_PACKAGE`; scripts/test builds it before
//! the tests): unpacked, its `install-extension` puts the extension into a private copy of the
//! PostgreSQL 15 installation that has no outbox files at all (not the build tree, not the
//! system's), a fresh cluster of that installation preloads and creates the extension, and the
//! package's relay binary, started with the example systemd unit's command line and environment
//! file, delivers an event to a real broker.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use outbox_tests::broker::Broker;
use outbox_tests::db::connect;
use outbox_tests::pg_cluster::PgCluster;
use outbox_tests::relay::Relay;

const SYSTEM_LIB: &str = "/usr/lib/postgresql/15";
const SYSTEM_SHARE: &str = "/usr/share/postgresql/15";

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A copy of the system's PostgreSQL 15 under `root` with the same relative layout (PostgreSQL
/// finds its share and library directories relative to its binaries), minus every outbox file.
fn private_installation(root: &Path) -> PathBuf {
    let lib = root.join(SYSTEM_LIB.trim_start_matches('/'));
    let share = root.join(SYSTEM_SHARE.trim_start_matches('/'));
    for (from, to) in [(SYSTEM_LIB, &lib), (SYSTEM_SHARE, &share)] {
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        run(Command::new("cp").args(["-a", from]).arg(to));
    }
    for dir in [lib.join("lib"), share.join("extension")] {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().to_string();
            if name.starts_with("outbox") {
                std::fs::remove_file(&path).unwrap();
            }
        }
    }
    lib.join("bin")
}

/// `KEY=VALUE` lines of an environment file (comments and blanks skipped).
fn env_file(path: &Path) -> BTreeMap<String, String> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| {
            let (k, v) = l.split_once('=').expect("KEY=VALUE");
            (k.to_string(), v.to_string())
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_package_installs_into_a_fresh_cluster_and_its_relay_delivers() {
    let tarball = std::env::var("OUTBOX_PACKAGE").expect(
        "OUTBOX_PACKAGE must name the tarball scripts/package wrote (scripts/test sets it)",
    );
    let work = std::env::temp_dir().join(format!("outbox-package-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).unwrap();
    run(Command::new("tar")
        .arg("-xzf")
        .arg(&tarball)
        .arg("-C")
        .arg(&work));
    let pkg = std::fs::read_dir(&work)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let version = env!("CARGO_PKG_VERSION");
    assert!(
        pkg.file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with(&format!("outbox-{version}-pg15-")),
        "{}",
        pkg.display()
    );

    let bin = private_installation(&work.join("pg"));
    let pg_config = bin.join("pg_config");
    let sharedir = run(Command::new(&pg_config).arg("--sharedir"));
    assert!(
        sharedir.trim().starts_with(work.to_str().unwrap()),
        "the private installation must use its own share directory: {sharedir}"
    );
    run(Command::new(pkg.join("install-extension")).arg(&pg_config));
    run(Command::new("chown")
        .args(["-R", "postgres:postgres"])
        .arg(&work));

    let pg = PgCluster::start_with(&bin, "shared_preload_libraries = 'outbox'", &[]);
    pg.psql("postgres", "CREATE DATABASE orders");
    pg.psql("orders", "CREATE EXTENSION outbox");
    let db_url = pg.params("127.0.0.1", "orders");
    let c = connect(&db_url).await;
    let row = c
        .query_one(
            "SELECT extversion, outbox_wake_mode() FROM pg_extension WHERE extname = 'outbox'",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(
        (row.get::<_, String>(0), row.get::<_, String>(1)),
        (version.to_string(), "commit".to_string()),
        "the package's library is preloaded"
    );

    // The example unit's command line, with the example environment file: only the database,
    // the broker and the metrics address are this machine's.
    let unit = std::fs::read_to_string(pkg.join("systemd/outbox-worker.service")).unwrap();
    let exec = unit
        .lines()
        .find_map(|l| l.strip_prefix("ExecStart="))
        .expect("ExecStart");
    let mut argv = exec.split_whitespace();
    let program = argv.next().unwrap();
    let program = pkg.join(
        program
            .strip_prefix("/opt/outbox/")
            .expect("the unit runs the package's binary from /opt/outbox"),
    );
    let broker = Broker::start();
    broker.create_topic("orders");
    let mut env = env_file(&pkg.join("systemd/outbox-worker.env"));
    assert!(env.contains_key("OUTBOX_DATABASE_URL") && env.contains_key("OUTBOX_BROKERS"));
    env.insert("OUTBOX_DATABASE_URL".into(), db_url.clone());
    env.insert("OUTBOX_BROKERS".into(), broker.addr());
    // Port 0: the relay binds a free port itself; one chosen here could be taken before.
    env.insert("OUTBOX_METRICS_ADDR".into(), "127.0.0.1:0".into());
    let mut cmd = Command::new(&program);
    cmd.args(argv)
        .env_clear()
        .envs(&env)
        .env("PATH", "/usr/bin:/bin");
    let mut relay = Relay::start(cmd).expect("start the package's relay");

    let follower = broker.follow("orders");
    let id: i64 = c
        .query_one(
            "SELECT outbox_enqueue('orders', '{\"order\": 1}', key => 'order-1', event_type => 'OrderCreated')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let (_, msg) = follower
        .wait_for(id, Duration::from_secs(30))
        .unwrap_or_else(|| panic!("event {id} never arrived: {}", relay.logs()));
    assert_eq!(msg.key.as_deref(), Some("order-1"));
    assert_eq!(msg.value, r#"{"order": 1}"#);
    assert_eq!(
        msg.headers.get("event_type").map(String::as_str),
        Some("OrderCreated")
    );
    let status = relay
        .terminate(Duration::from_secs(30))
        .expect("the relay stops on SIGTERM");
    assert!(status.success(), "{}", relay.logs());
    drop(pg);
    let _ = std::fs::remove_dir_all(&work);
}
