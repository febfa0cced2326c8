//! The relay's config file (`--config FILE`, TOML): the databases one relay serves, by name, each
//! with its connection string (or a file holding it) and overrides of the per-database flags of
//! `run`. Everything else (Kafka, the metrics address, the shutdown timeout) comes from the flags
//! and is shared. Every field is documented in docs/relay.md ("Many databases").

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Deserializer};

use crate::cli::{DbArgs, RunArgs};
use crate::Fatal;

/// The whole file: `[databases.NAME]` tables.
#[derive(Deserialize, Debug, Clone, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ConfigFile {
    pub databases: BTreeMap<String, DatabaseConfig>,
}

/// One `[databases.NAME]` table; unset fields take the value of the flag of the same name.
#[derive(Deserialize, Debug, Clone, PartialEq, Default)]
#[serde(deny_unknown_fields)]
pub struct DatabaseConfig {
    pub url: Option<String>,
    pub url_file: Option<PathBuf>,
    pub owner: Option<String>,
    /// `"own"` (default): a producer of its own, so this database's events never wait behind
    /// another's backlog on the broker connections; `"shared"`: the relay's one producer.
    #[serde(default)]
    pub producer: Producer,
    pub concurrency: Option<usize>,
    pub batch_size: Option<i32>,
    #[serde(default, deserialize_with = "duration")]
    pub poll_interval: Option<Duration>,
    #[serde(default, deserialize_with = "duration")]
    pub claim_cooldown: Option<Duration>,
    #[serde(default, deserialize_with = "duration")]
    pub lease: Option<Duration>,
    #[serde(default, deserialize_with = "duration")]
    pub reclaim_interval: Option<Duration>,
    #[serde(default, deserialize_with = "duration")]
    pub heartbeat_timeout: Option<Duration>,
    #[serde(default, deserialize_with = "duration")]
    pub stats_interval: Option<Duration>,
    #[serde(default, deserialize_with = "duration")]
    pub live_timeout: Option<Duration>,
    #[serde(default, deserialize_with = "duration")]
    pub statement_timeout: Option<Duration>,
    #[serde(default, deserialize_with = "duration")]
    pub pool_timeout: Option<Duration>,
}

#[derive(Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum Producer {
    Shared,
    #[default]
    Own,
}

/// A duration written as text, as on the command line (`500ms`, `3s`, `10m`).
fn duration<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    let text = String::deserialize(d)?;
    crate::cli::parse_duration(&text)
        .map(Some)
        .map_err(serde::de::Error::custom)
}

/// Reads and checks the file; every error is one line naming the file (and the line).
pub fn load(path: &Path) -> Result<ConfigFile, Fatal> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| Fatal::usage(format!("cannot read --config {}: {e}", path.display())))?;
    let file: ConfigFile = toml::from_str(&text).map_err(|e| {
        let line = e
            .span()
            .map(|s| format!(", line {}", text[..s.start].matches('\n').count() + 1))
            .unwrap_or_default();
        Fatal::usage(format!(
            "invalid config file {}{line}: {}",
            path.display(),
            e.message().replace('\n', " ")
        ))
    })?;
    if file.databases.is_empty() {
        return Err(Fatal::usage(format!(
            "config file {} lists no database: add a [databases.NAME] table",
            path.display()
        )));
    }
    for (name, db) in &file.databases {
        check_name(name)?;
        if db.url.is_some() == db.url_file.is_some() {
            return Err(Fatal::usage(format!(
                "database {name} in {}: give exactly one of url and url_file",
                path.display()
            )));
        }
    }
    Ok(file)
}

/// Names are metric label values and log fields: short and plain.
fn check_name(name: &str) -> Result<(), Fatal> {
    let plain = name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || "_-.".contains(c));
    if name.is_empty() || name.len() > 63 || !plain {
        return Err(Fatal::usage(format!(
            "database name {name:?}: use 1 to 63 letters, digits, '_', '-' or '.'"
        )));
    }
    Ok(())
}

impl DatabaseConfig {
    /// The connection of this database, as `--database-url` or `--database-url-file` gives it.
    pub fn db_args(&self) -> DbArgs {
        DbArgs {
            database_url: self.url.clone(),
            database_url_file: self.url_file.clone(),
            config: None,
            database: None,
        }
    }

    /// The flags of `run` for this database: `base` with this table's values on top, checked as
    /// the flags are (errors name the database).
    pub fn run_args(&self, name: &str, base: &RunArgs) -> Result<RunArgs, Fatal> {
        let mut a = base.clone();
        a.db = self.db_args();
        a.owner = self.owner.clone().or(a.owner);
        a.concurrency = self.concurrency.unwrap_or(a.concurrency);
        a.batch_size = self.batch_size.unwrap_or(a.batch_size);
        a.poll_interval = self.poll_interval.unwrap_or(a.poll_interval);
        a.claim_cooldown = self.claim_cooldown.unwrap_or(a.claim_cooldown);
        a.lease = self.lease.unwrap_or(a.lease);
        a.reclaim_interval = self.reclaim_interval.unwrap_or(a.reclaim_interval);
        a.stats_interval = self.stats_interval.unwrap_or(a.stats_interval);
        a.heartbeat_timeout = self.heartbeat_timeout.or(a.heartbeat_timeout);
        a.live_timeout = self.live_timeout.or(a.live_timeout);
        a.statement_timeout = self.statement_timeout.or(a.statement_timeout);
        a.pool_timeout = self.pool_timeout.or(a.pool_timeout);
        a.validate()
            .map_err(|e| Fatal::usage(format!("database {name}: {}", e.message)))?;
        Ok(a)
    }
}

/// The connection of the database that `--config` and `--database` name (operator commands).
pub fn selected(args: &DbArgs) -> Result<Option<DbArgs>, Fatal> {
    let Some(path) = &args.config else {
        if args.database.is_some() {
            return Err(Fatal::usage("--database needs --config FILE"));
        }
        return Ok(None);
    };
    if args.database_url.is_some() || args.database_url_file.is_some() {
        return Err(Fatal::usage(
            "give either --config or --database-url (--database-url-file), not both",
        ));
    }
    let file = load(path)?;
    let names = || {
        file.databases
            .keys()
            .cloned()
            .collect::<Vec<_>>()
            .join(", ")
    };
    let db = match (&args.database, file.databases.len()) {
        (Some(n), _) => file.databases.get(n).ok_or_else(|| {
            Fatal::usage(format!(
                "no database {n} in {} (it has: {})",
                path.display(),
                names()
            ))
        })?,
        (None, 1) => file.databases.values().next().expect("one database"),
        (None, _) => {
            return Err(Fatal::usage(format!(
                "{} lists several databases: choose one with --database NAME ({})",
                path.display(),
                names()
            )))
        }
    };
    Ok(Some(db.db_args()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn write(text: &str) -> PathBuf {
        use std::sync::atomic::{AtomicU32, Ordering};
        static N: AtomicU32 = AtomicU32::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let p = std::env::temp_dir().join(format!("outbox-config-{}-{n}.toml", std::process::id()));
        std::fs::write(&p, text).expect("write");
        p
    }

    fn base() -> RunArgs {
        match crate::cli::Cli::try_parse_from(["outbox-worker", "run", "--batch-size", "7"])
            .expect("parse")
            .command
        {
            crate::cli::Command::Run(a) => a,
            _ => unreachable!(),
        }
    }

    #[test]
    fn overrides_apply_per_database_and_flags_fill_the_rest() {
        let f = load(&write(
            "[databases.orders]\nurl = \"host=a dbname=orders\"\nconcurrency = 2\nlease = \"40s\"\nclaim_cooldown = \"20ms\"\nproducer = \"shared\"\n\
             [databases.billing]\nurl_file = \"/run/secrets/billing\"\n",
        ))
        .expect("valid");
        let orders = f.databases["orders"]
            .run_args("orders", &base())
            .expect("ok");
        assert_eq!((orders.concurrency, orders.batch_size), (2, 7), "flag kept");
        assert_eq!(orders.lease, Duration::from_secs(40));
        assert_eq!(orders.claim_cooldown, Duration::from_millis(20));
        assert_eq!(f.databases["orders"].producer, Producer::Shared);
        assert_eq!(f.databases["billing"].producer, Producer::Own);
        assert_eq!(
            orders.db.database_url.as_deref(),
            Some("host=a dbname=orders")
        );
        let billing = f.databases["billing"]
            .run_args("billing", &base())
            .expect("ok");
        assert_eq!(billing.concurrency, base().concurrency);
        assert_eq!(billing.claim_cooldown, Duration::ZERO);
        assert!(billing.db.database_url_file.is_some());
    }

    #[test]
    fn bad_files_fail_with_one_line_naming_the_problem() {
        for (text, want) in [
            (
                "[databases.a]\nurl = \"x\"\nbatch = 3\n",
                "line 3: unknown field `batch`",
            ),
            ("[databases.a]\nurl = \"x\"\nlease = \"soon\"\n", "line 3"),
            (
                "[databases.a]\nconcurrency = 2\n",
                "exactly one of url and url_file",
            ),
            ("[databases]\n", "lists no database"),
            (
                "[databases.\"a b\"]\nurl = \"x\"\n",
                "database name \"a b\"",
            ),
        ] {
            let e = load(&write(text)).expect_err(text);
            assert_eq!(e.code, 2);
            assert!(e.message.contains(want), "{text}: {}", e.message);
            assert!(!e.message.contains('\n'), "{}", e.message);
        }
        let f = load(&write("[databases.a]\nurl = \"x\"\nlease = \"4s\"\n")).expect("valid");
        let e = f.databases["a"]
            .run_args("a", &base())
            .expect_err("send timeout");
        assert!(
            e.message.starts_with("database a: --send-timeout"),
            "{}",
            e.message
        );
    }

    #[test]
    fn operator_commands_pick_a_database_by_name() {
        let path = write("[databases.a]\nurl = \"dbname=a\"\n[databases.b]\nurl = \"dbname=b\"\n");
        let args = |database: Option<&str>| DbArgs {
            database_url: None,
            database_url_file: None,
            config: Some(path.clone()),
            database: database.map(str::to_string),
        };
        let b = selected(&args(Some("b"))).expect("ok").expect("some");
        assert_eq!(b.database_url.as_deref(), Some("dbname=b"));
        let e = selected(&args(None)).expect_err("ambiguous");
        assert!(
            e.message.contains("--database NAME (a, b)"),
            "{}",
            e.message
        );
        let e = selected(&args(Some("c"))).expect_err("unknown");
        assert!(e.message.contains("no database c"), "{}", e.message);
    }
}
