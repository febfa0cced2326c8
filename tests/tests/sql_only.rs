//! The SQL-only build itself (scripts/sql-only, docs/sql-only.md), in both test passes: installed
//! by a database owner that is not a superuser, refused where it cannot go, and its upgrade steps
//! made from the native build's steps. The SQL-level suites run against it in the second pass of
//! scripts/test (OUTBOX_TEST_BUILD=sql-only), where every scratch database is installed this way:
//! sql_security (the privilege split) and sql_hijack (planted lookalikes) hold there too.

use std::path::{Path, PathBuf};
use std::process::Command;

use outbox_tests::build::{self, repo_root, FIRST_RELEASE, VERSION};
use outbox_tests::db::{db_error, scalar, TestDb};
use outbox_tests::in_flight;
use outbox_tests::roles::Roles;

#[tokio::test]
async fn a_database_owner_without_superuser_installs_it() {
    let db = TestDb::create_sql_only();
    let c = db.connect().await;
    let r = c
        .query_one(
            "SELECT r.rolname::text, r.rolsuper, outbox_sql_only_version(), \
                    (SELECT count(*) FROM pg_proc p WHERE p.proname LIKE 'outbox\\_%' AND p.proowner = r.oid), \
                    (SELECT count(*) FROM pg_proc p WHERE p.proname LIKE 'outbox\\_%' AND p.proowner <> r.oid), \
                    (SELECT count(*) FROM pg_extension WHERE extname = 'outbox') \
               FROM pg_class c JOIN pg_roles r ON r.oid = c.relowner WHERE c.oid = 'outbox_event'::regclass",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(r.get::<_, String>(0), db.owner());
    assert!(
        !r.get::<_, bool>(1),
        "the installing role is not a superuser"
    );
    assert_eq!(r.get::<_, String>(2), VERSION);
    assert!(r.get::<_, i64>(3) > 30, "the owner owns every function");
    assert_eq!(r.get::<_, i64>(4), 0);
    assert_eq!(r.get::<_, i64>(5), 0, "no extension: no superuser needed");

    // The functions run as that owner, and a producer of the recipe does its part only.
    let roles = Roles::create(&db, &[]);
    c.batch_execute(&format!("SET ROLE {}", roles.name("producer")))
        .await
        .unwrap();
    c.execute("SELECT outbox_enqueue('orders', '{}', key => 'k')", &[])
        .await
        .unwrap();
    let (code, _) = db_error(c.query("SELECT * FROM outbox_event", &[]).await);
    assert_eq!(code, "42501");
    c.batch_execute(&format!("RESET ROLE; SET ROLE {}", roles.name("relay")))
        .await
        .unwrap();
    let claimed: i64 = scalar(&c, "SELECT count(*) FROM outbox_claim('r', 5)", &[]).await;
    assert_eq!(claimed, 1);
    let (code, _) = db_error(c.query("SELECT outbox_enqueue('orders', '{}')", &[]).await);
    assert_eq!(code, "42501");
    c.batch_execute("RESET ROLE").await.unwrap();

    // A second application changes nothing and says why.
    let out = db.try_psql_file_as(&db.owner(), &build::sql_only_script());
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!(
            "outbox {VERSION} (SQL-only build) is already installed"
        )),
        "{err}"
    );
    let rows: i64 = scalar(&c, "SELECT count(*) FROM outbox_event", &[]).await;
    assert_eq!(rows, 1);
    drop(c);
    drop(db);
    drop(roles);
}

#[tokio::test]
async fn it_refuses_a_database_with_the_extension() {
    if build::sql_only() {
        // This pass may run where the native build is not installed; the native pass covers it.
        println!("skipped in the SQL-only pass: needs CREATE EXTENSION outbox");
        return;
    }
    let db = TestDb::create();
    let out = db.try_psql_file_as("postgres", &build::sql_only_script());
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("the outbox extension is installed in this database"),
        "{err}"
    );
}

/// A copy of what scripts/sql-only reads (the script, Cargo.toml, the crate's sources, sql/), to
/// run it on a repository with a made-up next release.
fn scratch_repo() -> PathBuf {
    let root = repo_root();
    let dir = std::env::temp_dir().join(format!("outbox-sql-only-repo-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    for sub in ["scripts", "outbox-ext/src", "sql/sql-only"] {
        std::fs::create_dir_all(dir.join(sub)).unwrap();
    }
    let copy = |from: &Path, to: &Path| {
        std::fs::copy(from, to).unwrap_or_else(|e| panic!("copy {}: {e}", from.display()));
    };
    copy(
        &root.join("scripts/sql-only"),
        &dir.join("scripts/sql-only"),
    );
    copy(&root.join("Cargo.toml"), &dir.join("Cargo.toml"));
    for sub in ["outbox-ext/src", "sql", "sql/sql-only"] {
        for entry in std::fs::read_dir(root.join(sub)).unwrap() {
            let p = entry.unwrap().path();
            if p.is_file() {
                copy(&p, &dir.join(sub).join(p.file_name().unwrap()));
            }
        }
    }
    dir
}

fn generate(repo: &Path, out: &Path) -> std::process::Output {
    Command::new(repo.join("scripts/sql-only"))
        .arg(out)
        .output()
        .unwrap()
}

/// The next release's step is the native step, reused: its native-only part (a C function) left
/// out and the SQL-only side (sql/sql-only/outbox--A--B.sql) put in, guarded by the installed
/// version.
#[tokio::test]
async fn an_upgrade_step_is_the_native_step_reused() {
    let (stem, patch) = VERSION.rsplit_once('.').unwrap();
    let next = format!("{stem}.{}", patch.parse::<u32>().unwrap() + 1);
    let step = format!("outbox--{VERSION}--{next}.sql");
    let repo = scratch_repo();
    std::fs::write(
        repo.join("sql").join(&step),
        format!(
            "-- outbox {VERSION} -> {next}: a made-up release.\n\
             \\echo Use \"ALTER EXTENSION outbox UPDATE TO '{next}'\" to load this file. \\quit\n\
             -- native-only begin\n\
             CREATE FUNCTION @extschema@.\"outbox_fake\"() RETURNS int STRICT LANGUAGE c AS 'MODULE_PATHNAME', 'outbox_fake_wrapper';\n\
             -- native-only end\n\
             COMMENT ON TABLE @extschema@.outbox_scheduled IS 'after {next}';\n"
        ),
    )
    .unwrap();
    std::fs::write(
        repo.join("sql/sql-only").join(&step),
        "CREATE FUNCTION @extschema@.outbox_fake() RETURNS int LANGUAGE sql \
         SET search_path = pg_catalog, pg_temp AS $$ SELECT 41 $$;\n",
    )
    .unwrap();
    let out_dir = repo.join("out");
    let out = generate(&repo, &out_dir);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut written: Vec<String> = std::fs::read_dir(&out_dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    written.sort();
    // The install script, every real step (one per release after 1.0.0), and the made-up one.
    let mut expected = vec![format!("outbox--{VERSION}.sql"), step.clone()];
    for entry in std::fs::read_dir(repo.join("sql")).unwrap() {
        let name = entry.unwrap().file_name().to_string_lossy().into_owned();
        let is_step = name
            .strip_prefix("outbox--")
            .is_some_and(|rest| rest.contains("--"));
        if is_step && name != step {
            expected.push(name);
        }
    }
    expected.sort();
    assert_eq!(written, expected);
    let text = std::fs::read_to_string(out_dir.join(&step)).unwrap();
    assert!(
        !text.contains("MODULE_PATHNAME")
            && !text.contains("@extschema@")
            && !text.contains("\\quit"),
        "{text}"
    );

    let db = TestDb::create_sql_only();
    db.psql_file_as(&db.owner(), &out_dir.join(&step));
    let c = db.connect().await;
    let r = c
        .query_one(
            "SELECT outbox_sql_only_version(), outbox_fake(), obj_description('outbox_scheduled'::regclass, 'pg_class')",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(
        (
            r.get::<_, String>(0),
            r.get::<_, i32>(1),
            r.get::<_, String>(2)
        ),
        (next.clone(), 41, format!("after {next}"))
    );
    // Applied again (the database is at 0.4.1 now): refused, nothing changed.
    let again = db.try_psql_file_as(&db.owner(), &out_dir.join(&step));
    assert!(!again.status.success());
    let err = String::from_utf8_lossy(&again.stderr);
    assert!(
        err.contains(&format!(
            "this step updates outbox {VERSION} (SQL-only build), this database has outbox {next}"
        )),
        "{err}"
    );

    // What would break outside an extension is refused at generation.
    std::fs::write(
        repo.join("sql").join(&step),
        "SELECT pg_catalog.pg_extension_config_dump('@extschema@.outbox_scheduled', '');\n",
    )
    .unwrap();
    let out = generate(&repo, &repo.join("out2"));
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("guard it"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::remove_file(repo.join("sql").join(&step)).unwrap();
    let rust = repo.join("outbox-ext/src/producer.rs");
    let mut src = std::fs::read_to_string(&rust).unwrap();
    src.push_str("\n#[pg_extern]\npub fn outbox_only_native() -> i32 {\n    1\n}\n");
    std::fs::write(&rust, src).unwrap();
    let out = generate(&repo, &repo.join("out3"));
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains(
            "outbox_only_native is a Rust function of the native build without its SQL version"
        ),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(&repo);
}

/// `git` in the repository; panics with its error output.
fn git(root: &Path, args: &[&str]) -> String {
    let out = Command::new("git")
        .arg("-C")
        .arg(root)
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "git {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// The outbox's functions (with bodies and settings) and table options in a SQL-only database.
async fn sql_only_catalog(c: &tokio_postgres::Client) -> Vec<(String, String)> {
    let rows = c
        .query(
            "SELECT 'function ' || p.oid::regprocedure::text, pg_get_functiondef(p.oid) \
               FROM pg_proc p WHERE p.pronamespace = 'public'::regnamespace AND p.proname LIKE 'outbox\\_%' \
             UNION ALL \
             SELECT 'table ' || c.relname, coalesce(array_to_string(c.reloptions, ','), '') \
               FROM pg_class c WHERE c.relnamespace = 'public'::regnamespace AND c.relname LIKE 'outbox\\_%' \
             ORDER BY 1",
            &[],
        )
        .await
        .unwrap();
    rows.iter().map(|r| (r.get(0), r.get(1))).collect()
}

/// The real step to this release: a database on the previous SQL-only release, installed from the
/// script that release's tree generates (taken out of git history), with a claim in flight, is
/// updated by this tree's generated step as its owner. The claim still settles, the keys drain in
/// order, and the functions and table options are those of a fresh SQL-only install. Every
/// release after the first ships that step (docs/reference.md, "Upgrades").
#[tokio::test]
async fn the_previous_release_updates_with_events_in_flight() {
    let root = repo_root();
    let step_to_this = std::fs::read_dir(root.join("sql"))
        .unwrap()
        .filter_map(|e| {
            let name = e.unwrap().file_name().to_string_lossy().into_owned();
            let steps = name
                .strip_prefix("outbox--")?
                .strip_suffix(".sql")?
                .to_string();
            let (from, to) = steps.split_once("--")?;
            (to == VERSION).then(|| from.to_string())
        })
        .next();
    let Some(previous) = step_to_this else {
        assert_eq!(
            VERSION, FIRST_RELEASE,
            "release {VERSION} needs its step sql/outbox--A--{VERSION}.sql from the release before it"
        );
        println!("{VERSION} is the first release: no step to it");
        return;
    };
    // The previous release's tree: the parent of the commit that moved Cargo.toml off it.
    let bump = git(
        &root,
        &[
            "log",
            "-n1",
            "--format=%H",
            &format!("-Sversion = \"{previous}\""),
            "--",
            "Cargo.toml",
        ],
    );
    let old_tree =
        std::env::temp_dir().join(format!("outbox-sql-only-{previous}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&old_tree);
    std::fs::create_dir_all(&old_tree).unwrap();
    let archive = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "git -C '{}' archive '{bump}^' Cargo.toml scripts/sql-only outbox-ext/src sql | tar -x -C '{}'",
            root.display(),
            old_tree.display()
        ))
        .output()
        .unwrap();
    assert!(
        archive.status.success(),
        "{}",
        String::from_utf8_lossy(&archive.stderr)
    );
    let old_out = generate(&old_tree, &old_tree.join("out"));
    assert!(
        old_out.status.success(),
        "{}",
        String::from_utf8_lossy(&old_out.stderr)
    );
    let new_out = root
        .join("target")
        .join(format!("sql-only-step-{}", std::process::id()));
    let out = generate(&root, &new_out);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let db = TestDb::create_sql_only_from(&old_tree.join(format!("out/outbox--{previous}.sql")));
    let c = db.connect().await;
    let version: String = scalar(&c, "SELECT outbox_sql_only_version()", &[]).await;
    assert_eq!(version, previous);
    let token = in_flight::enqueue_and_claim(&c, 6).await;

    db.psql_file_as(
        &db.owner(),
        &new_out.join(format!("outbox--{previous}--{VERSION}.sql")),
    );
    let version: String = scalar(&c, "SELECT outbox_sql_only_version()", &[]).await;
    assert_eq!(version, VERSION);

    // The claim taken before the update settles; the rest drains in key order.
    in_flight::settle_and_drain(&c, token).await;

    let fresh = TestDb::create_sql_only();
    let installed = sql_only_catalog(&fresh.connect().await).await;
    assert!(installed.len() > 40, "too little to compare: {installed:?}");
    let updated = sql_only_catalog(&c).await;
    // Only the entries that differ, so a failure names the object.
    let differ: Vec<_> = updated
        .iter()
        .filter(|u| !installed.contains(u))
        .chain(installed.iter().filter(|i| !updated.contains(i)))
        .collect();
    assert!(
        differ.is_empty(),
        "updated vs fresh SQL-only install differ in: {differ:#?}"
    );
    let _ = std::fs::remove_dir_all(&old_tree);
    let _ = std::fs::remove_dir_all(&new_out);
}
