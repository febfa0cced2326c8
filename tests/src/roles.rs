//! The roles of the README's GRANT recipe (sql/examples/grant-roles.sql), created per test database.

use std::process::Command;

use crate::db::{psql_admin, server_params, TestDb};

/// producer, relay, admin and consumer with the recipe's grants, plus extra roles with none. Roles belong to
/// the whole server: declare this before the `TestDb` so it is dropped after the database.
pub struct Roles {
    suffix: String,
    kinds: Vec<&'static str>,
}

impl Roles {
    /// Creates the recipe's four roles (NOLOGIN) and runs the recipe, then creates `extra` roles
    /// (NOLOGIN, no grants).
    pub fn create(db: &TestDb, extra: &[&'static str]) -> Roles {
        let mut kinds = vec!["producer", "relay", "admin", "consumer"];
        kinds.extend_from_slice(extra);
        let roles = Roles {
            suffix: db
                .name
                .trim_start_matches(&format!("{}_", crate::db::test_prefix()))
                .to_string(),
            kinds,
        };
        for r in roles.all() {
            psql_admin(&format!("CREATE ROLE {r} NOLOGIN"));
        }
        grant_recipe(
            &db.url(),
            &roles.name("producer"),
            &roles.name("relay"),
            &roles.name("admin"),
            Some(&roles.name("consumer")),
        );
        roles
    }

    /// The server-wide name of the role of this kind ("producer", "relay", "admin" or an extra).
    pub fn name(&self, kind: &str) -> String {
        format!("{}_{kind}_{}", crate::build::name_prefix(), self.suffix)
    }

    fn all(&self) -> Vec<String> {
        self.kinds.iter().map(|k| self.name(k)).collect()
    }
}

/// Runs the GRANT recipe (sql/examples/grant-roles.sql) in the database at `url` for existing
/// roles (the consumer is optional there); panics (failing the test) when psql fails.
pub fn grant_recipe(url: &str, producer: &str, relay: &str, admin: &str, consumer: Option<&str>) {
    let mut psql = Command::new("psql");
    if let Some(consumer) = consumer {
        psql.arg("-v").arg(format!("consumer={consumer}"));
    }
    let out = psql
        .arg(url)
        .args(["-X", "-q", "-v", "ON_ERROR_STOP=1"])
        .arg("-v")
        .arg(format!("producer={producer}"))
        .arg("-v")
        .arg(format!("relay={relay}"))
        .arg("-v")
        .arg(format!("admin={admin}"))
        .args([
            "-f",
            concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../sql/examples/grant-roles.sql"
            ),
        ])
        .output()
        .expect("psql must be installed");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Drop for Roles {
    fn drop(&mut self) {
        for r in self.all() {
            let _ = Command::new("psql")
                .arg(format!("{} dbname=postgres", server_params()))
                .args(["-X", "-q", "-c", &format!("DROP ROLE IF EXISTS {r}")])
                .output();
        }
    }
}
