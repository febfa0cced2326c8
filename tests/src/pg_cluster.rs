//! A throwaway PostgreSQL 15 cluster (initdb + pg_ctl, run as the `postgres` OS user since initdb
//! refuses root) on a free port, for tests that need a server configuration of their own (e.g.
//! `ssl = on` with the test's certificate) without touching the shared server. Stopped and
//! removed on drop. The installed `outbox` extension is available to it (same installation).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use crate::broker::free_port;

/// The system's binaries, unless `OUTBOX_TEST_PG_BINDIR` names those of a private installation
/// (the one the tests' server runs from, so the same extension build is installed).
fn default_bin() -> PathBuf {
    std::env::var_os("OUTBOX_TEST_PG_BINDIR")
        .map_or_else(|| "/usr/lib/postgresql/15/bin".into(), PathBuf::from)
}

pub struct PgCluster {
    pub dir: PathBuf,
    pub port: u16,
    /// The PostgreSQL binaries it runs (the system's, or a private installation's).
    bin: PathBuf,
}

fn as_postgres(args: &[&str]) -> Output {
    Command::new("runuser")
        .args(["-u", "postgres", "--"])
        .args(args)
        .output()
        .expect("runuser")
}

fn check(what: &str, out: Output) {
    assert!(
        out.status.success(),
        "{what}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn chown_postgres(path: &Path) {
    check(
        "chown",
        Command::new("chown")
            .args(["postgres:postgres"])
            .arg(path)
            .output()
            .expect("chown"),
    );
}

impl PgCluster {
    /// initdb, then start on 127.0.0.1 and localhost's other addresses with `conf` appended to
    /// postgresql.conf; `files` are copied into the data directory first (owned by postgres,
    /// mode 0600, as the server wants its key).
    pub fn start(conf: &str, files: &[&Path]) -> PgCluster {
        PgCluster::start_with(&default_bin(), conf, files)
    }

    /// The same with the binaries of another installation (`bin` = its `pg_config --bindir`), e.g.
    /// a private copy into which a release package installed the extension.
    pub fn start_with(bin: &Path, conf: &str, files: &[&Path]) -> PgCluster {
        let bin_s = bin.to_str().expect("utf-8 path").to_string();
        let mut cluster = PgCluster::new_dir(bin);
        let data = cluster.dir.join("data");
        let data_s = data.to_str().expect("utf-8 path");
        check(
            "initdb",
            as_postgres(&[
                &format!("{bin_s}/initdb"),
                "-D",
                data_s,
                "-U",
                "postgres",
                "-A",
                "trust",
                "--no-sync",
                "--no-instructions",
            ]),
        );
        for f in files {
            let to = data.join(f.file_name().expect("file name"));
            std::fs::copy(f, &to).expect("copy into the data dir");
            chown_postgres(&to);
            check(
                "chmod",
                Command::new("chmod")
                    .arg("600")
                    .arg(&to)
                    .output()
                    .expect("chmod"),
            );
        }
        cluster.configure(&format!(
            "listen_addresses = 'localhost'\nfsync = off\n{conf}"
        ));
        cluster.start_first();
        cluster
    }

    /// An empty directory owned by postgres for a cluster on a free port.
    fn new_dir(bin: &Path) -> PgCluster {
        let port = free_port();
        let dir =
            std::env::temp_dir().join(format!("outbox-test-pg-{port}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("cluster dir");
        chown_postgres(&dir);
        PgCluster {
            dir,
            port,
            bin: bin.to_path_buf(),
        }
    }

    /// Appends this cluster's port and socket directory, then `conf`, to its postgresql.conf
    /// (a later line wins).
    fn configure(&self, conf: &str) {
        use std::io::Write;
        let mut pgconf = std::fs::OpenOptions::new()
            .append(true)
            .open(self.dir.join("data/postgresql.conf"))
            .expect("postgresql.conf");
        writeln!(
            pgconf,
            "port = {}\nunix_socket_directories = '{}'\n{conf}",
            self.port,
            self.dir.display()
        )
        .expect("write postgresql.conf");
    }

    /// A streaming standby of this running cluster, started on a port of its own: a copy made
    /// with `pg_basebackup -R` (initdb's pg_hba.conf lets local replication in), which follows the
    /// primary until [`PgCluster::promote`].
    pub fn standby(&self) -> PgCluster {
        let mut standby = PgCluster::new_dir(&self.bin);
        let data = standby.dir.join("data");
        check(
            "pg_basebackup",
            as_postgres(&[
                &format!("{}/pg_basebackup", self.bin.display()),
                "-h",
                self.dir.to_str().expect("utf-8 path"),
                "-p",
                &self.port.to_string(),
                "-U",
                "postgres",
                "-D",
                data.to_str().expect("utf-8 path"),
                "-R",
                "-X",
                "stream",
                "-c",
                "fast",
                "--no-sync",
            ]),
        );
        standby.configure("");
        standby.start_first();
        standby
    }

    /// Starts a new cluster. Its port was free when chosen, but another process may have bound
    /// it since on one of localhost's addresses (the server then starts on the others, or not at
    /// all): then it moves to another free port, at most three times.
    fn start_first(&mut self) {
        let log_path = self.dir.join("server.log");
        for attempt in 1..=3 {
            let _ = std::fs::remove_file(&log_path);
            let out = self.pg_ctl_start();
            let taken = std::fs::read_to_string(&log_path)
                .unwrap_or_default()
                .contains("Address already in use");
            if !taken || attempt == 3 {
                check("pg_ctl start", out);
                assert!(!taken, "port {} taken three times", self.port);
                return;
            }
            if out.status.success() {
                self.stop("immediate");
            }
            self.port = free_port();
            self.configure("");
        }
    }

    /// Ends recovery: the standby becomes a primary (`pg_ctl promote -w`).
    pub fn promote(&self) {
        check(
            "pg_ctl promote",
            self.pg_ctl(&["-w", "-t", "30", "promote"]),
        );
    }

    /// `pg_ctl ARGS` on this cluster's data directory, as postgres.
    fn pg_ctl(&self, args: &[&str]) -> Output {
        let data = self.dir.join("data");
        let pg_ctl = format!("{}/pg_ctl", self.bin.display());
        let mut argv = vec![pg_ctl.as_str(), "-D", data.to_str().unwrap_or("")];
        argv.extend_from_slice(args);
        as_postgres(&argv)
    }

    /// Starts the (stopped) server and waits until it accepts connections.
    pub fn start_again(&self) {
        check("pg_ctl start", self.pg_ctl_start());
    }

    /// `pg_ctl start`, logging to server.log, waiting up to 30 s for connections.
    fn pg_ctl_start(&self) -> Output {
        let log = self.dir.join("server.log");
        self.pg_ctl(&[
            "-l",
            log.to_str().expect("utf-8"),
            "-w",
            "-t",
            "30",
            "start",
        ])
    }

    /// Stops the server with `pg_ctl stop -m MODE` (`fast`, `immediate`: a crash, as for the
    /// clients).
    pub fn stop(&self, mode: &str) {
        check("pg_ctl stop", self.pg_ctl(&["-m", mode, "-w", "stop"]));
    }

    /// libpq parameters for `dbname` over TCP on localhost, without TLS settings.
    pub fn params(&self, host: &str, dbname: &str) -> String {
        format!(
            "host={host} port={} user=postgres dbname={dbname}",
            self.port
        )
    }

    /// Runs SQL with psql over the Unix socket (no TLS involved).
    pub fn psql(&self, dbname: &str, sql: &str) {
        check(sql, self.psql_output(dbname, sql, "-q"));
    }

    /// One value (unaligned, no header) of a query run with psql over the Unix socket.
    pub fn psql_value(&self, dbname: &str, sql: &str) -> String {
        let out = self.psql_output(dbname, sql, "-t");
        check(sql, out.clone());
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// psql with `-X -A -v ON_ERROR_STOP=1`, `flag` and `-c sql`.
    fn psql_output(&self, dbname: &str, sql: &str, flag: &str) -> Output {
        Command::new("psql")
            .arg(format!(
                "host={} port={} user=postgres dbname={dbname}",
                self.dir.display(),
                self.port
            ))
            .args(["-X", flag, "-A", "-v", "ON_ERROR_STOP=1", "-c", sql])
            .output()
            .expect("psql")
    }
}

impl Drop for PgCluster {
    fn drop(&mut self) {
        let _ = self.pg_ctl(&["-m", "immediate", "-w", "stop"]);
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}
