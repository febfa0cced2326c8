//! PgBouncer (Debian's `pgbouncer` package, 1.18: no protocol-level prepared statements) in
//! transaction mode on a free loopback port, in front of the tests' server: one process per test,
//! run as the `postgres` OS user (PgBouncer refuses root) with a config file in its own temp
//! directory; killed on drop (the directory, with its log, is kept when the test failed).

use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::broker::free_port;
use crate::db::server_params;
use crate::kafka::log_tail;

const BIN: &str = "/usr/sbin/pgbouncer";

pub struct PgBouncer {
    pub port: u16,
    dir: PathBuf,
    child: Child,
}

impl PgBouncer {
    /// Every database of the tests' server, `pool_size` server connections per database and user,
    /// no authentication of clients; `extra` is appended to the `[pgbouncer]` section (e.g.
    /// `ignore_startup_parameters = options`). Returns once it accepts connections.
    pub fn start(pool_size: usize, extra: &str) -> PgBouncer {
        let port = free_port();
        let dir = std::env::temp_dir().join(format!(
            "outbox-test-pgbouncer-{port}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("pgbouncer dir");
        let ini = dir.join("pgbouncer.ini");
        std::fs::write(&ini, config(port, pool_size, &dir, extra)).expect("pgbouncer.ini");
        let mut cmd = Command::new(BIN);
        cmd.arg(&ini)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if let Some((uid, gid)) = postgres_ids_when_root() {
            chown_postgres(&dir);
            cmd.uid(uid).gid(gid);
        }
        let child = cmd.spawn().unwrap_or_else(|e| {
            panic!("{BIN}: {e} (install Debian's pgbouncer package, as scripts/setup does)")
        });
        let mut bouncer = PgBouncer { port, dir, child };
        bouncer.wait_ready(Duration::from_secs(10));
        bouncer
    }

    /// libpq parameters for database `dbname` through this PgBouncer.
    pub fn params(&self, dbname: &str) -> String {
        format!("host=127.0.0.1 port={} dbname={dbname}", self.port)
    }

    /// The last `n` lines of PgBouncer's log.
    pub fn log_tail(&self, n: usize) -> String {
        log_tail(&self.dir.join("pgbouncer.log"), n)
    }

    fn wait_ready(&mut self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            let exited = self.child.try_wait().expect("try_wait");
            assert!(
                exited.is_none() && Instant::now() < deadline,
                "pgbouncer did not start (exit: {exited:?}):\n{}",
                self.log_tail(30)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// pgbouncer.ini: transaction mode, 127.0.0.1 only (no Unix socket), the server's user for every
/// server connection (`auth_type = any` logs clients in as that user).
fn config(port: u16, pool_size: usize, dir: &Path, extra: &str) -> String {
    format!(
        "[databases]\n* = {}\n\n[pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {port}\n\
         unix_socket_dir =\nauth_type = any\npool_mode = transaction\n\
         default_pool_size = {pool_size}\nmax_client_conn = 200\nlogfile = {}\n{extra}\n",
        server_params(),
        dir.join("pgbouncer.log").display()
    )
}

/// The `postgres` user's uid and gid when this process runs as root, else None.
fn postgres_ids_when_root() -> Option<(u32, u32)> {
    // SAFETY: geteuid(2) has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return None;
    }
    let id = |flag: &str| -> u32 {
        let out = Command::new("id")
            .args([flag, "postgres"])
            .output()
            .expect("id");
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("no postgres OS user to run pgbouncer as"))
    };
    Some((id("-u"), id("-g")))
}

fn chown_postgres(dir: &Path) {
    let out = Command::new("chown")
        .args(["-R", "postgres:postgres"])
        .arg(dir)
        .output()
        .expect("chown");
    assert!(
        out.status.success(),
        "chown: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}
