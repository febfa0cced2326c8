//! Database connections: connection settings (never logged with a password) with their TLS
//! connector (`tls.rs`), direct sessions for the admin commands and the LISTEN connection, the
//! extension check, and error formatting. The relay's own calls are in `store.rs`.

use std::error::Error as StdError;
use std::str::FromStr;
use std::time::Duration;

use postgres_openssl::MakeTlsConnector;
use tokio_postgres::config::Host;
use tokio_postgres::Config;

use crate::cli::DbArgs;
use crate::tls::{self, SslMode};
use crate::Fatal;

/// Joins an error and its sources into one line.
pub fn one_line(e: &(dyn StdError + 'static)) -> String {
    let mut out = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        let t = s.to_string();
        if !out.contains(&t) {
            out.push_str(": ");
            out.push_str(&t);
        }
        src = s.source();
    }
    out.replace(['\n', '\r'], " ")
}

/// A parsed connection string: what to connect to, how (TLS), and a password-free description.
#[derive(Clone)]
pub struct Target {
    pub cfg: Config,
    pub tls: MakeTlsConnector,
    /// `host=… port=… dbname=… user=…` (and `sslmode=…` unless the default), for messages.
    pub desc: String,
    /// The whole handshake's bound for each host of several but the last (`hosts.rs`).
    pub host_timeout: Duration,
}

impl Target {
    /// One session, host by host (`hosts::connect`).
    pub async fn connect(
        &self,
    ) -> Result<(tokio_postgres::Client, crate::hosts::Session), tokio_postgres::Error> {
        crate::hosts::connect(&self.cfg, &self.tls, self.host_timeout).await
    }

    /// Gives each host its share of `total`, so that a connection attempt reaches the last host
    /// within it whatever the others do.
    pub fn share_between_hosts(&mut self, total: Duration) {
        let n = crate::hosts::count(&self.cfg).max(1) as u32;
        self.host_timeout = self.host_timeout.min(total / n);
    }
}

/// Reads the connection string from the flag/env or the file, parses it (TLS parameters with
/// libpq's meaning) and returns it with a password-free description for logs.
pub fn config(args: &DbArgs) -> Result<Target, Fatal> {
    if let Some(chosen) = crate::config::selected(args)? {
        return config(&chosen);
    }
    let text = match (&args.database_url, &args.database_url_file) {
        (Some(_), Some(_)) => {
            return Err(Fatal::usage(
                "give either --database-url or --database-url-file, not both",
            ))
        }
        (Some(u), None) => u.clone(),
        (None, Some(path)) => std::fs::read_to_string(path)
            .map_err(|e| {
                Fatal::usage(format!(
                    "cannot read --database-url-file {}: {e}",
                    path.display()
                ))
            })?
            .trim()
            .to_string(),
        (None, None) => return Err(Fatal::usage(
            "no database given: set --database-url or OUTBOX_DATABASE_URL (or --database-url-file)",
        )),
    };
    let (text, tls_params) = tls::split(&text)?;
    // The parser's messages don't echo the input, so a password cannot leak from here.
    let mut cfg = Config::from_str(&text)
        .map_err(|e| Fatal::usage(format!("invalid database URL: {}", one_line(&e))))?;
    // Unless the string sets it, the hosts share the default connect timeout.
    let hosts = crate::hosts::count(&cfg).max(1) as u32;
    let host_timeout = match cfg.get_connect_timeout() {
        Some(t) => *t,
        None => crate::defaults::CONNECT_TIMEOUT / hosts,
    };
    cfg.connect_timeout(host_timeout);
    if cfg.get_application_name().is_none() {
        cfg.application_name(crate::defaults::CLIENT_ID);
    }
    cfg.keepalives(true);
    cfg.keepalives_idle(crate::defaults::KEEPALIVE_IDLE);
    cfg.keepalives_interval(crate::defaults::KEEPALIVE_INTERVAL);
    cfg.keepalives_retries(crate::defaults::KEEPALIVE_RETRIES);
    cfg.tcp_user_timeout(crate::defaults::TCP_USER_TIMEOUT);
    cfg.ssl_mode(tls_params.pg_mode());
    let tls = tls_params.connector()?;
    let mut desc = describe(&cfg);
    if tls_params.mode != SslMode::Prefer {
        desc.push_str(&format!(" sslmode={}", tls_params.effective_mode().name()));
    }
    Ok(Target {
        cfg,
        tls,
        desc,
        host_timeout,
    })
}

/// A failed connection attempt as one line: exit 2 when only the configuration can fix it (TLS, a
/// login refused (class 28), no such database (3D000), a startup parameter a pooler refuses), exit
/// 1 for anything else (an outage).
pub fn connect_failure(desc: &str, e: &(dyn StdError + 'static)) -> Fatal {
    if tls::is_tls_failure(e) {
        return Fatal::usage(format!(
            "TLS to the database failed ({desc}): {}",
            one_line(e)
        ));
    }
    match server_error(e) {
        // PgBouncer's answer to the `options` that carry the statement timeout.
        Some(d) if d.message().starts_with("unsupported startup parameter") => Fatal::usage(format!(
            "cannot connect to the database ({desc}): {} ({}); a pooler refuses the relay's statement_timeout: \
             add options to PgBouncer's ignore_startup_parameters, or run with --statement-timeout 0 \
             (docs/relay.md, \"PgBouncer\")",
            d.message(),
            d.code().code()
        )),
        Some(d) if crate::error::is_configuration(d.code()) => Fatal::usage(format!(
            "cannot connect to the database ({desc}): {} ({}); a configuration error (role, password, pg_hba.conf or database name)",
            d.message(),
            d.code().code()
        )),
        _ => Fatal::runtime(format!(
            "cannot connect to the database ({desc}): {}",
            one_line(e)
        )),
    }
}

/// The server's error (with its SQLSTATE) behind a failed connection attempt, if the server
/// answered with one.
fn server_error<'a>(e: &'a (dyn StdError + 'static)) -> Option<&'a tokio_postgres::error::DbError> {
    let mut cur: Option<&(dyn StdError + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(d) = err.downcast_ref::<tokio_postgres::error::DbError>() {
            return Some(d);
        }
        if let Some(d) = err
            .downcast_ref::<tokio_postgres::Error>()
            .and_then(tokio_postgres::Error::as_db_error)
        {
            return Some(d);
        }
        cur = err.source();
    }
    None
}

/// Adds `-c statement_timeout=…` to the sessions' startup options, unless `timeout` is zero or
/// the connection string's `options` already set one (the operator's choice wins). Returns the
/// timeout when it added it.
pub fn set_statement_timeout(cfg: &mut Config, timeout: Duration) -> Option<Duration> {
    let existing = cfg.get_options().unwrap_or("").to_string();
    if timeout.is_zero() || existing.contains("statement_timeout") {
        return None;
    }
    let ours = format!("-c statement_timeout={}", timeout.as_millis());
    cfg.options(if existing.trim().is_empty() {
        ours
    } else {
        format!("{existing} {ours}")
    });
    Some(timeout)
}

/// `host=… port=… dbname=… user=…`, without the password.
pub fn describe(cfg: &Config) -> String {
    let hosts: Vec<String> = cfg
        .get_hosts()
        .iter()
        .map(|h| match h {
            Host::Tcp(s) => s.clone(),
            Host::Unix(p) => p.display().to_string(),
        })
        .collect();
    let ports: Vec<String> = cfg.get_ports().iter().map(|p| p.to_string()).collect();
    format!(
        "host={} port={} dbname={} user={}",
        if hosts.is_empty() {
            "localhost".to_string()
        } else {
            hosts.join(",")
        },
        if ports.is_empty() {
            "5432".to_string()
        } else {
            ports.join(",")
        },
        cfg.get_dbname().unwrap_or("(default)"),
        cfg.get_user().unwrap_or("(default)")
    )
}

/// One direct session (admin commands, the LISTEN connection).
pub async fn connect_once(target: &Target) -> Result<tokio_postgres::Client, Fatal> {
    let (client, conn) = target
        .connect()
        .await
        .map_err(|e| connect_failure(&target.desc, &e))?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(client)
}

/// The oldest extension version that has everything the relay calls and reads.
pub const MIN_EXTENSION_VERSION: &str = "1.0.0";

/// The installed `outbox`: the extension, or the SQL-only build (`scripts/sql-only`, no
/// `pg_extension` row: found by its `outbox_sql_only_version()`).
#[derive(Debug, Clone, PartialEq)]
pub struct Extension {
    /// Its schema, quoted for SQL.
    pub schema: String,
    /// `pg_extension.extversion` (or `outbox_sql_only_version()`), e.g. `0.3.0`.
    pub version: String,
    /// Installed from the SQL-only build's script instead of `CREATE EXTENSION`.
    pub sql_only: bool,
}

impl Extension {
    /// Refuses a version older than [`MIN_EXTENSION_VERSION`] (or one that is not a version
    /// number) with one line naming both versions and the fix; any later version is accepted.
    pub fn check_version(&self, desc: &str) -> Result<(), Fatal> {
        match version_at_least(&self.version, MIN_EXTENSION_VERSION) {
            Some(true) => Ok(()),
            _ => Err(Fatal::usage(format!(
                "the database has outbox {} version {} ({desc}) but this relay ({}) needs {MIN_EXTENSION_VERSION} or later: {}",
                if self.sql_only { "SQL-only build" } else { "extension" },
                self.version,
                env!("CARGO_PKG_VERSION"),
                if self.sql_only {
                    "apply the SQL-only upgrade steps (scripts/sql-only)"
                } else {
                    "run ALTER EXTENSION outbox UPDATE"
                }
            ))),
        }
    }
}

/// The numeric components of a version (`0.4.0`, `1.2`, `0.4.0-rc1` -> [0, 4, 0]); None when
/// it does not start with a number.
fn version_numbers(v: &str) -> Option<Vec<u64>> {
    let core = v.trim().split(['-', '+', ' ']).next()?;
    core.split('.')
        .map(|part| {
            let digits: String = part.chars().take_while(char::is_ascii_digit).collect();
            digits.parse().ok()
        })
        .collect()
}

/// Whether version `v` is `min` or later (numerically, component by component; missing
/// components count as 0). None when either is not a version number.
pub fn version_at_least(v: &str, min: &str) -> Option<bool> {
    let (mut a, mut b) = (version_numbers(v)?, version_numbers(min)?);
    let n = a.len().max(b.len());
    a.resize(n, 0);
    b.resize(n, 0);
    Some(a >= b)
}

/// The installed outbox (schema and version), or a one-line configuration error. Unnamed statements
/// (pooled connections too). Without the extension, the SQL-only build's marker function, which
/// must be unique: a role that may create a schema must not make the relay pick its copy.
pub async fn extension(client: &tokio_postgres::Client, desc: &str) -> Result<Extension, Fatal> {
    let cannot = |e: tokio_postgres::Error| {
        Fatal::runtime(format!(
            "cannot query the database ({desc}): {}",
            one_line(&e)
        ))
    };
    let row = client
        .query_typed_opt(
            "SELECT quote_ident(n.nspname), e.extversion FROM pg_catalog.pg_extension e \
             JOIN pg_catalog.pg_namespace n ON n.oid = e.extnamespace WHERE e.extname = 'outbox'",
            &[],
        )
        .await
        .map_err(cannot)?;
    if let Some(r) = row {
        return Ok(Extension {
            schema: r.get(0),
            version: r.get(1),
            sql_only: false,
        });
    }
    let schemas: Vec<String> = client
        .query_typed(
            "SELECT quote_ident(n.nspname) FROM pg_catalog.pg_proc p \
             JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace \
             WHERE p.proname = 'outbox_sql_only_version' AND p.pronargs = 0 ORDER BY 1",
            &[],
        )
        .await
        .map_err(cannot)?
        .iter()
        .map(|r| r.get(0))
        .collect();
    match schemas.as_slice() {
        [] => Err(Fatal::usage(format!(
            "the outbox extension is not installed in the database ({desc}): run CREATE EXTENSION outbox \
             (or, where no extension can be installed, apply the SQL-only build: scripts/sql-only)"
        ))),
        [schema] => {
            let version: String = client
                .query_typed_one(
                    &format!("SELECT {schema}.outbox_sql_only_version()"),
                    &[],
                )
                .await
                .map_err(cannot)?
                .get(0);
            Ok(Extension {
                schema: schema.clone(),
                version,
                sql_only: true,
            })
        }
        many => Err(Fatal::usage(format!(
            "the database ({desc}) has more than one SQL-only outbox (outbox_sql_only_version() in schemas {}): \
             drop the ones that are not the outbox",
            many.join(", ")
        ))),
    }
}

/// The quoted schema of the installed extension, or a one-line error saying it is missing.
pub async fn extension_schema(
    client: &tokio_postgres::Client,
    desc: &str,
) -> Result<String, Fatal> {
    Ok(extension(client, desc).await?.schema)
}

/// Opens a session for an admin command and returns it with the extension's schema.
pub async fn admin_session(args: &DbArgs) -> Result<(tokio_postgres::Client, String), Fatal> {
    let target = config(args)?;
    let client = connect_once(&target).await?;
    let schema = extension_schema(&client, &target.desc).await?;
    Ok((client, schema))
}

/// Formats a database error for a log line or an admin command's failure.
pub fn db_error(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(d) => format!("{} ({})", d.message(), d.code().code()),
        None => one_line(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(url: &str) -> DbArgs {
        DbArgs {
            database_url: Some(url.into()),
            database_url_file: None,
            config: None,
            database: None,
        }
    }

    #[test]
    fn a_silent_peer_is_noticed_by_tcp_within_bounds() {
        let t = config(&args("postgres://relay@db.example/app")).expect("url");
        assert!(t.cfg.get_keepalives());
        assert_eq!(t.cfg.get_keepalives_idle(), crate::defaults::KEEPALIVE_IDLE);
        assert_eq!(
            t.cfg.get_keepalives_interval(),
            Some(crate::defaults::KEEPALIVE_INTERVAL)
        );
        assert_eq!(
            t.cfg.get_keepalives_retries(),
            Some(crate::defaults::KEEPALIVE_RETRIES)
        );
        assert_eq!(
            t.cfg.get_tcp_user_timeout(),
            Some(&crate::defaults::TCP_USER_TIMEOUT)
        );
    }

    #[test]
    fn description_never_contains_the_password() {
        let t = config(&args("postgres://relay:s3cret@db.example:6543/app")).expect("url");
        assert_eq!(t.desc, "host=db.example port=6543 dbname=app user=relay");
        let t = config(&args(
            "host=h user=u password=s3cret dbname=x sslmode=require",
        ))
        .expect("kv");
        assert_eq!(t.desc, "host=h port=5432 dbname=x user=u sslmode=require");
    }

    #[test]
    fn any_version_from_the_minimum_on_is_accepted() {
        for v in ["1.0.0", "1.0.1", "1.2.0", "1.10.0", "2.0.0", "1"] {
            assert_eq!(
                version_at_least(v, MIN_EXTENSION_VERSION),
                Some(true),
                "{v}"
            );
        }
        for v in ["0.1.0", "0.5.0", "0.14.0", "0.99.9", "0.9"] {
            assert_eq!(
                version_at_least(v, MIN_EXTENSION_VERSION),
                Some(false),
                "{v}"
            );
        }
        assert_eq!(version_at_least("dev", MIN_EXTENSION_VERSION), None);
        let old = Extension {
            schema: "public".into(),
            version: "0.14.0".into(),
            sql_only: false,
        };
        let e = old.check_version("host=h").expect_err("refused");
        assert_eq!(e.code, 2);
        assert!(e.message.contains("version 0.14.0"), "{}", e.message);
        assert!(e.message.contains("1.0.0 or later"), "{}", e.message);
        assert!(
            e.message.contains("ALTER EXTENSION outbox UPDATE"),
            "{}",
            e.message
        );
    }

    #[test]
    fn parse_errors_do_not_echo_the_input() {
        let e = config(&args("postgres://u:s3cret@h:notaport/x"))
            .err()
            .expect("error");
        assert!(!e.message.contains("s3cret"), "{}", e.message);
    }
}
