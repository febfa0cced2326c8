//! Throwaway databases on the real PostgreSQL server (the tests' and outbox-bench's).

use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use futures_util::{stream, StreamExt};
use tokio_postgres::types::{FromSqlOwned, ToSql};
use tokio_postgres::{AsyncMessage, Client, NoTls};

/// libpq-style parameters of the server the tests use, without a database name: `OUTBOX_TEST_PG`,
/// else `PGHOST`, `PGPORT`, `PGUSER` (and `PGPASSWORD`) with `scripts/env.sh`'s defaults.
pub fn server_params() -> String {
    if let Ok(p) = std::env::var("OUTBOX_TEST_PG") {
        return p;
    }
    let var = |k: &str, default: &str| std::env::var(k).unwrap_or_else(|_| default.to_string());
    let mut p = format!(
        "host={} port={} user={}",
        conninfo_value(&var("PGHOST", "127.0.0.1")),
        conninfo_value(&var("PGPORT", "5432")),
        conninfo_value(&var("PGUSER", "postgres"))
    );
    if let Ok(pw) = std::env::var("PGPASSWORD") {
        p += &format!(" password={}", conninfo_value(&pw));
    }
    p
}

/// A value for a libpq `key=value` connection string, quoted when it needs to be.
pub fn conninfo_value(v: &str) -> String {
    if !v.is_empty() && !v.contains([' ', '\'', '\\']) {
        return v.to_string();
    }
    format!("'{}'", v.replace('\\', "\\\\").replace('\'', "\\'"))
}

/// Runs one SQL command with psql on the database named by `conninfo`; panics with psql's output.
fn run_psql(conninfo: &str, sql: &str) {
    let out = Command::new("psql")
        .arg(conninfo)
        .args(["-X", "-q", "-v", "ON_ERROR_STOP=1", "-c", sql])
        .output()
        .expect("psql must be installed");
    assert!(
        out.status.success(),
        "psql failed on {sql}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The prefix of the tests' scratch databases: `outbox_test`, or `sqlonly_test` for the SQL-only
/// build.
pub fn test_prefix() -> String {
    format!("{}_test", crate::build::name_prefix())
}

/// Runs one SQL command on the server's `postgres` database.
pub fn psql_admin(sql: &str) {
    run_psql(&format!("{} dbname=postgres", server_params()), sql);
}

/// A database created for one test (with `CREATE EXTENSION outbox` unless `empty`), dropped on drop.
pub struct TestDb {
    pub name: String,
    /// The server's connection parameters, without a database name.
    pub server: String,
}

impl TestDb {
    /// `OUTBOX_TEST_EXT_VERSION` installs that version instead of the default one (to show a
    /// test failing on an earlier release). `OUTBOX_TEST_BUILD=sql-only` applies the SQL-only
    /// build's script instead of `CREATE EXTENSION` (see [`crate::build`]).
    pub fn create() -> TestDb {
        TestDb::create_on(&server_params(), &test_prefix())
    }

    /// A database named `<prefix>_<pid>_<n>_<nanos>` with the outbox on the server `server`
    /// (libpq parameters without a database name); outbox-bench uses its own prefix.
    pub fn create_on(server: &str, prefix: &str) -> TestDb {
        if crate::build::sql_only() {
            return TestDb::sql_only_on(server, prefix);
        }
        let db = TestDb::empty_on(server, prefix);
        match std::env::var("OUTBOX_TEST_EXT_VERSION") {
            Ok(v) => db.psql(&format!("CREATE EXTENSION outbox VERSION '{v}'")),
            Err(_) => db.psql("CREATE EXTENSION outbox"),
        }
        db
    }

    /// A database without the extension (for installing a given version).
    pub fn empty() -> TestDb {
        TestDb::empty_on(&server_params(), &test_prefix())
    }

    /// A database with the SQL-only build whatever `OUTBOX_TEST_BUILD` says (tests of the build
    /// itself): see [`TestDb::sql_only_on`].
    pub fn create_sql_only() -> TestDb {
        TestDb::sql_only_on(&server_params(), "sqlonly_test")
    }

    /// [`TestDb::create_sql_only`] with another install script (an earlier release's, for
    /// upgrade tests).
    pub fn create_sql_only_from(script: &std::path::Path) -> TestDb {
        let db = TestDb::sql_only_owned_empty(&server_params(), "sqlonly_test");
        db.psql_file_as(&db.owner(), script);
        db
    }

    /// The SQL-only build as a managed service has it: a database owned by a role that is not a
    /// superuser ([`TestDb::owner`]), which applies the script. The tests still connect as the
    /// server's user; the outbox's functions run as that owner.
    fn sql_only_on(server: &str, prefix: &str) -> TestDb {
        let db = TestDb::sql_only_owned_empty(server, prefix);
        db.psql_file_as(&db.owner(), &crate::build::sql_only_script());
        db
    }

    /// An empty database owned by its [`TestDb::owner`], a new role without superuser rights.
    fn sql_only_owned_empty(server: &str, prefix: &str) -> TestDb {
        let db = TestDb::empty_on(server, &prefix.replacen("outbox_", "sqlonly_", 1));
        let owner = db.owner();
        run_psql(
            &db.admin_url(),
            &format!(
                "CREATE ROLE {owner} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE; \
                 ALTER DATABASE {} OWNER TO {owner}",
                db.name
            ),
        );
        db
    }

    /// The SQL-only build's owner of this database and of the outbox in it: `<name>_owner`, a
    /// login role without superuser rights (dropped with the database).
    pub fn owner(&self) -> String {
        format!("{}_owner", self.name)
    }

    /// Runs a script file through `psql -v ON_ERROR_STOP=1 -f` as `user`; panics with psql's
    /// output.
    pub fn psql_file_as(&self, user: &str, file: &std::path::Path) {
        let out = self.try_psql_file_as(user, file);
        assert!(
            out.status.success(),
            "psql -f {} failed: {}",
            file.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// [`TestDb::psql_file_as`], returning psql's output instead of panicking.
    pub fn try_psql_file_as(&self, user: &str, file: &std::path::Path) -> std::process::Output {
        Command::new("psql")
            .arg(format!("{} user={}", self.url(), conninfo_value(user)))
            .args(["-X", "-q", "-v", "ON_ERROR_STOP=1", "-f"])
            .arg(file)
            .output()
            .expect("psql must be installed")
    }

    /// Runs a script file through `psql -v ON_ERROR_STOP=1 -f`; panics with psql's output.
    pub fn psql_file(&self, file: &std::path::Path) {
        let out = Command::new("psql")
            .arg(self.url())
            .args(["-X", "-q", "-v", "ON_ERROR_STOP=1", "-f"])
            .arg(file)
            .output()
            .expect("psql must be installed");
        assert!(
            out.status.success(),
            "psql -f {} failed: {}",
            file.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn empty_on(server: &str, prefix: &str) -> TestDb {
        static SEQ: AtomicU32 = AtomicU32::new(0);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .subsec_nanos();
        let name = format!(
            "{prefix}_{}_{}_{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed),
            nanos
        );
        let db = TestDb {
            name,
            server: server.to_string(),
        };
        run_psql(&db.admin_url(), &format!("CREATE DATABASE {}", db.name));
        db
    }

    /// Connection string for this database (libpq key=value form, accepted by tokio-postgres and
    /// by the relay).
    pub fn url(&self) -> String {
        format!("{} dbname={}", self.server, self.name)
    }

    /// The server's `postgres` database, to create and drop this one.
    fn admin_url(&self) -> String {
        format!("{} dbname=postgres", self.server)
    }

    /// Runs SQL in this database through psql (for set-up that needs psql features).
    /// `ALTER DATABASE … SET name = 'value'` for each pair: what every later session of the
    /// database starts with, a relay's included.
    pub fn set(&self, settings: &[(&str, &str)]) {
        let sql: Vec<String> = settings
            .iter()
            .map(|(name, value)| format!("ALTER DATABASE {} SET {name} = '{value}'", self.name))
            .collect();
        self.psql(&sql.join("; "));
    }

    pub fn psql(&self, sql: &str) {
        run_psql(&self.url(), sql);
    }

    /// A new session (its own backend) on this database.
    pub async fn connect(&self) -> Client {
        connect(&self.url()).await
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let _ = Command::new("psql")
            .arg(self.admin_url())
            .args(["-X", "-q", "-c"])
            .arg(format!(
                "DROP DATABASE IF EXISTS {} WITH (FORCE)",
                self.name
            ))
            .output();
        if self.name.starts_with("sqlonly_") {
            let _ = Command::new("psql")
                .arg(self.admin_url())
                .args(["-X", "-q", "-c"])
                .arg(format!("DROP ROLE IF EXISTS {}", self.owner()))
                .output();
        }
    }
}

/// Connects and drives the connection on the current runtime.
pub async fn connect(url: &str) -> Client {
    try_connect(url)
        .await
        .unwrap_or_else(|e| panic!("connect to {url}: {e}"))
}

/// [`connect`], returning the error (outbox-bench reports it instead of panicking).
pub async fn try_connect(url: &str) -> Result<Client, tokio_postgres::Error> {
    let (client, conn) = tokio_postgres::connect(url, NoTls).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(client)
}

/// Connects like [`connect`] and collects the session's notices and warnings (RAISE NOTICE,
/// RAISE WARNING) as "SEVERITY: message" lines, in arrival order.
pub async fn connect_with_notices(url: &str) -> (Client, Arc<Mutex<Vec<String>>>) {
    let (client, mut conn) = tokio_postgres::connect(url, NoTls)
        .await
        .unwrap_or_else(|e| panic!("connect to {url}: {e}"));
    let notices = Arc::new(Mutex::new(Vec::new()));
    let sink = notices.clone();
    let mut messages = stream::poll_fn(move |cx| conn.poll_message(cx));
    tokio::spawn(async move {
        while let Some(Ok(msg)) = messages.next().await {
            if let AsyncMessage::Notice(n) = msg {
                let line = format!("{}: {}", n.severity(), n.message());
                sink.lock().unwrap().push(line);
            }
        }
    });
    (client, notices)
}

/// The SQLSTATE (e.g. "22023") and message of a failed statement; panics if the call succeeded
/// or failed without a server error.
pub fn db_error<T: std::fmt::Debug>(result: Result<T, tokio_postgres::Error>) -> (String, String) {
    match result {
        Ok(v) => panic!("expected an error, got {v:?}"),
        Err(e) => {
            let db = e
                .as_db_error()
                .unwrap_or_else(|| panic!("expected a server error, got {e}"));
            (db.code().code().to_string(), db.message().to_string())
        }
    }
}

/// The SQLSTATE of a failed statement.
pub fn sqlstate<T: std::fmt::Debug>(result: Result<T, tokio_postgres::Error>) -> String {
    db_error(result).0
}

/// The first column of the single row `sql` returns; panics (failing the test) on any error.
pub async fn scalar<T: FromSqlOwned>(
    c: &impl tokio_postgres::GenericClient,
    sql: &str,
    params: &[&(dyn ToSql + Sync)],
) -> T {
    c.query_one(sql, params)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
        .get(0)
}

/// The stream's batch floor (0.9.0): the newest cursor version's `batch_floor`.
pub async fn batch_floor(c: &Client) -> i64 {
    scalar(
        c,
        "SELECT batch_floor FROM outbox_stream_cursor ORDER BY version DESC LIMIT 1",
        &[],
    )
    .await
}

/// Whether backend `pid` waits for a lock: `None` once the backend is gone (its client closed,
/// e.g. a task that dropped it after its call returned), so callers never race its exit.
pub async fn lock_wait(c: &Client, pid: i32) -> Option<bool> {
    scalar(
        c,
        "SELECT (SELECT wait_event_type IS NOT DISTINCT FROM 'Lock' FROM pg_stat_activity WHERE pid = $1)",
        &[&pid],
    )
    .await
}

/// Rows in the outbox table.
pub async fn row_count(c: &Client) -> i64 {
    scalar(c, "SELECT count(*) FROM outbox_event", &[]).await
}

/// A fingerprint of every outbox row (count and hash), to prove a failed call changed nothing.
async fn table_fingerprint(c: &Client) -> (i64, i64) {
    let row = c
        .query_one(
            "SELECT count(*), coalesce(sum(hashtext(e::text)), 0) FROM outbox_event e",
            &[],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1))
}

/// Runs `sql` expecting SQLSTATE `code`, a message containing `needle`, and no change to the table.
pub async fn rejects(
    c: &Client,
    sql: &str,
    params: &[&(dyn ToSql + Sync)],
    code: &str,
    needle: &str,
) {
    let before = table_fingerprint(c).await;
    let (state, message) = db_error(c.query(sql, params).await);
    assert_eq!(state, code, "{sql}: {message}");
    assert!(
        message.contains(needle),
        "{sql}: message {message:?} should name {needle:?}"
    );
    assert_eq!(
        before,
        table_fingerprint(c).await,
        "{sql} changed the table"
    );
}
