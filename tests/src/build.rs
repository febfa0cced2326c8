//! Which build of the outbox the tests install: the native extension (`CREATE EXTENSION outbox`,
//! the default) or the SQL-only build (`OUTBOX_TEST_BUILD=sql-only`: the script `scripts/sql-only`
//! generates, applied with psql; docs/sql-only.md). Tests about the extension mechanism itself
//! (upgrade chain, pg_dump of configuration tables, setting registration) ask [`sql_only`] and
//! assert what the SQL-only build does instead.

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

/// Whether this run tests the SQL-only build (`OUTBOX_TEST_BUILD=sql-only`); panics on an
/// unknown value so a typo cannot silently test the native build.
pub fn sql_only() -> bool {
    match std::env::var("OUTBOX_TEST_BUILD").as_deref() {
        Err(_) | Ok("") | Ok("native") => false,
        Ok("sql-only") => true,
        Ok(other) => panic!("OUTBOX_TEST_BUILD={other}: expected native or sql-only"),
    }
}

/// The prefix of scratch database names (and of the recipe's role names) in this build.
pub fn name_prefix() -> &'static str {
    if sql_only() {
        "sqlonly"
    } else {
        "outbox"
    }
}

/// The repository's root.
pub fn repo_root() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

/// The workspace's version (the SQL-only install script is `outbox--VERSION.sql`).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The first release: the only one with no upgrade step to it (docs/reference.md, "Upgrades").
pub const FIRST_RELEASE: &str = "1.0.0";

/// The directory `scripts/sql-only` wrote the SQL-only build into: `OUTBOX_TEST_SQL_ONLY_DIR`
/// when set (scripts/test generates it once), else generated once per test process.
pub fn sql_only_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        if let Ok(d) = std::env::var("OUTBOX_TEST_SQL_ONLY_DIR") {
            return PathBuf::from(d);
        }
        let dir = std::env::temp_dir().join(format!("outbox-sql-only-{}", std::process::id()));
        generate(&dir);
        dir
    })
    .clone()
}

/// Runs `scripts/sql-only DIR`; panics with its output on failure.
pub fn generate(dir: &std::path::Path) {
    let out = Command::new(repo_root().join("scripts/sql-only"))
        .arg(dir)
        .output()
        .expect("scripts/sql-only must run");
    assert!(
        out.status.success(),
        "scripts/sql-only failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The SQL-only install script of the current version.
pub fn sql_only_script() -> PathBuf {
    sql_only_dir().join(format!("outbox--{VERSION}.sql"))
}

/// The outbox's schema-owning role in SQL, for [`objects`] in the SQL-only build.
const SQL_ONLY_OWNER: &str =
    "(SELECT c.relowner FROM pg_catalog.pg_class c WHERE c.oid = 'public.outbox_event'::pg_catalog.regclass)";

/// A query of the oids of the outbox's objects in system catalog `catalog` (`pg_proc`,
/// `pg_type`, `pg_class`). Native build: the extension's members. SQL-only build: objects of the
/// schema public named `outbox_…` and owned by the outbox's owner (so not an attacker's planted
/// ones), which includes what only this build has (its setting helpers).
pub fn objects(catalog: &str) -> String {
    if !sql_only() {
        return format!(
            "SELECT d.objid FROM pg_catalog.pg_depend d \
             WHERE d.classid = '{catalog}'::pg_catalog.regclass \
             AND d.refclassid = 'pg_catalog.pg_extension'::pg_catalog.regclass AND d.deptype = 'e' \
             AND d.refobjid = (SELECT oid FROM pg_catalog.pg_extension WHERE extname = 'outbox')"
        );
    }
    let (oid, ns, name, owner) = match catalog {
        "pg_proc" => ("oid", "pronamespace", "proname", "proowner"),
        "pg_type" => ("oid", "typnamespace", "typname", "typowner"),
        "pg_class" => ("oid", "relnamespace", "relname", "relowner"),
        other => panic!("objects: no SQL-only query for catalog {other}"),
    };
    format!(
        "SELECT o.{oid} FROM pg_catalog.{catalog} o \
         WHERE o.{ns} = 'public'::pg_catalog.regnamespace AND o.{name} LIKE 'outbox\\_%' \
         AND o.{owner} = {SQL_ONLY_OWNER}"
    )
}
