//! A role that may CREATE in the extension's schema must not get its code run by the extension's
//! SECURITY DEFINER functions, which run as the superuser who installed the extension.
//!
//! Generic on purpose, so new SQL is covered without editing this file: the test reads which
//! pg_catalog functions and operators the installed SQL calls, plants better-matching overloads of
//! each in the extension's schema as an unprivileged attacker, drives every API function, and fails
//! if a planted body ever ran as anyone but the attacker.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use std::time::Duration;

use outbox_tests::build;
use outbox_tests::db::{connect_with_notices, scalar, TestDb};
use outbox_tests::roles::Roles;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, Row};

/// Argument types of the planted overloads and operators ([`planted_types`] adds the extension's
/// own). real and smallint because a weaker match is all it takes: outbox_stats compares a
/// real variable with an integer literal.
const TYPES: &[&str] = &[
    "integer",
    "smallint",
    "bigint",
    "numeric",
    "real",
    "double precision",
    "text",
    "timestamp with time zone",
    "interval",
    "jsonb",
];

/// [`TYPES`] and the types the extension itself declares or handles: its own types, its tables'
/// columns, its functions' arguments and results (arrays, rows and pseudo-types aside).
async fn planted_types(c: &Client) -> Vec<String> {
    let (types, classes, functions) = (
        build::objects("pg_type"),
        build::objects("pg_class"),
        build::objects("pg_proc"),
    );
    let sql = format!(
        "WITH used AS (
                  SELECT t.oid AS t FROM pg_type t WHERE t.oid IN ({types})
                  UNION
                  SELECT a.atttypid FROM pg_attribute a
                   WHERE a.attrelid IN ({classes}) AND a.attnum > 0
                  UNION
                  SELECT unnest(p.prorettype || coalesce(p.proallargtypes, p.proargtypes::oid[]))
                    FROM pg_proc p WHERE p.oid IN ({functions}))
         SELECT format_type(t.oid, NULL) FROM used JOIN pg_type t ON t.oid = used.t
          WHERE t.typtype IN ('b', 'd', 'e', 'r') AND t.typcategory <> 'A'"
    );
    let mut types: Vec<String> = TYPES.iter().map(|t| t.to_string()).collect();
    for row in c.query(&sql, &[]).await.unwrap() {
        let t: String = row.get(0);
        if !types.contains(&t) {
            types.push(t);
        }
    }
    types
}

/// What the extension's SQL source calls: every identifier before "(" (lower-cased, qualified or
/// not), and the pg_catalog functions and operators among those names and operator tokens.
struct Calls {
    identifiers: BTreeSet<String>,
    functions: Vec<String>,
    operators: Vec<String>,
}

async fn enumerate_calls(c: &Client) -> Calls {
    let functions = build::objects("pg_proc");
    let sql = format!(
        r"WITH src AS (
              SELECT p.prosrc FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang
               WHERE p.oid IN ({functions}) AND l.lanname IN ('sql', 'plpgsql')),
          idents AS (SELECT DISTINCT lower(m[1]) AS name FROM src,
                       regexp_matches(src.prosrc, '([A-Za-z_][A-Za-z0-9_$]*)\s*\(', 'g') m),
          ops AS (SELECT DISTINCT m[1] AS name FROM src,
                    regexp_matches(src.prosrc, '([-+*/<>=~!@#%^&|`?]+)', 'g') m)
          SELECT ARRAY(SELECT name FROM idents ORDER BY 1),
                 ARRAY(SELECT name FROM idents WHERE name IN (SELECT proname FROM pg_proc
                        WHERE pronamespace = 'pg_catalog'::regnamespace) ORDER BY 1),
                 ARRAY(SELECT name FROM ops WHERE name IN (SELECT oprname FROM pg_operator
                        WHERE oprnamespace = 'pg_catalog'::regnamespace) ORDER BY 1)"
    );
    let row = c.query_one(&sql, &[]).await.unwrap();
    Calls {
        identifiers: row.get::<_, Vec<String>>(0).into_iter().collect(),
        functions: row.get(1),
        operators: row.get(2),
    }
}

/// One object to create as the attacker: `label` names it in its WARNING, `sql` creates it.
struct Plant {
    label: String,
    sql: String,
}

/// Everything a planted body needs to know: where it lives and whom it must not report.
struct Planter {
    schema: String,
    attacker: String,
    hits: String,
}

impl Planter {
    /// A plpgsql function that, unless run by the attacker, bumps the hits sequence (which a
    /// rollback does not undo) and warns, then returns NULL (a bare RETURN if `bare`: void, set or
    /// OUT parameters). Nothing else: only evidence, no damage.
    fn function(&self, label: &str, name: &str, args: &str, returns: &str, bare: bool) -> String {
        let ret = if bare { "RETURN" } else { "RETURN NULL" };
        format!(
            "CREATE FUNCTION {schema}.\"{name}\"({args}) RETURNS {returns} LANGUAGE plpgsql AS $planted$
             BEGIN
                 IF current_user OPERATOR(pg_catalog.<>) '{attacker}'::pg_catalog.name THEN
                     PERFORM pg_catalog.nextval('{hits}'::pg_catalog.regclass);
                     RAISE WARNING 'planted % ran as %', '{label}', current_user;
                 END IF;
                 {ret};
             END
             $planted$",
            schema = self.schema,
            attacker = self.attacker,
            hits = self.hits,
            label = label.replace('\'', "''"),
        )
    }
}

/// One pg_catalog overload of a function the extension calls.
struct Overload {
    name: String,
    arg_types: Vec<String>,
    in_names: Vec<String>,
    defaults: usize,
    variadic: bool,
    retset: bool,
    /// Its return type, or text where that is a pseudo-type such as record or anyelement.
    ret: String,
    /// `pg_get_function_arguments` and `pg_get_function_result`: its exact declaration.
    exact_args: String,
    exact_result: String,
    has_out: bool,
}

async fn overloads(c: &Client, names: &[String]) -> Vec<Overload> {
    let rows = c
        .query(
            "SELECT p.proname::text,
                    ARRAY(SELECT format_type(t, NULL) FROM unnest(p.proargtypes::oid[])
                          WITH ORDINALITY a(t, i) ORDER BY i),
                    ARRAY(SELECT coalesce(a.n, '') FROM unnest(p.proargnames, p.proargmodes)
                          WITH ORDINALITY a(n, m, i) WHERE coalesce(a.m, 'i') IN ('i', 'b', 'v')
                          ORDER BY i),
                    p.pronargdefaults::int, p.provariadic <> 0, p.proretset,
                    CASE WHEN r.typtype = 'p' AND r.oid <> 'void'::regtype THEN 'text'
                         ELSE format_type(p.prorettype, NULL) END,
                    pg_get_function_arguments(p.oid), pg_get_function_result(p.oid),
                    coalesce(p.proargmodes && '{o,b,t}'::\"char\"[], false)
               FROM pg_proc p JOIN pg_type r ON r.oid = p.prorettype
              WHERE p.pronamespace = 'pg_catalog'::regnamespace AND p.proname = ANY ($1::text[])
              ORDER BY p.oid",
            &[&names],
        )
        .await
        .unwrap();
    rows.iter()
        .map(|r| Overload {
            name: r.get(0),
            arg_types: r.get(1),
            in_names: r.get(2),
            defaults: r.get::<_, i32>(3) as usize,
            variadic: r.get(4),
            retset: r.get(5),
            ret: r.get(6),
            exact_args: r.get(7),
            exact_result: r.get(8),
            has_out: r.get(9),
        })
        .collect()
}

/// The overload's parameters (names, defaults, VARIADIC) with every argument of type `ty`: its
/// signature and its parameter list. The names and defaults matter: a call in named notation
/// (`make_interval(secs => ...)`) only considers functions with a parameter of that name.
fn uniform(o: &Overload, ty: &str) -> (String, String) {
    let n = o.arg_types.len();
    let mut types = Vec::new();
    let mut params = Vec::new();
    for i in 0..n {
        let variadic = o.variadic && i + 1 == n;
        let ty = if variadic {
            format!("{ty}[]")
        } else {
            ty.to_string()
        };
        let mode = if variadic { "VARIADIC " } else { "" };
        let name = match o.in_names.get(i) {
            Some(name) if !name.is_empty() => format!("\"{name}\" "),
            _ => String::new(),
        };
        let default = if i >= n - o.defaults {
            " DEFAULT NULL"
        } else {
            ""
        };
        params.push(format!("{mode}{name}{ty}{default}"));
        types.push(ty);
    }
    (
        format!("{}({})", o.name, types.join(", ")),
        params.join(", "),
    )
}

/// For every overload: its exact declaration, and its [`uniform`] variant for each type. Keyed by
/// signature, so each is planted once.
fn function_plants(p: &Planter, overloads: &[Overload], types: &[String]) -> Vec<Plant> {
    let mut plants = BTreeMap::new();
    for o in overloads {
        let sig = format!("{}({})", o.name, o.arg_types.join(", "));
        let bare = o.has_out || o.retset || o.exact_result == "void";
        let label = format!("{}.{sig}", p.schema);
        let sql = p.function(&label, &o.name, &o.exact_args, &o.exact_result, bare);
        plants.entry(sig).or_insert(sql);

        let setof = if o.retset { "SETOF " } else { "" };
        let bare = o.retset || o.ret == "void";
        for ty in types {
            let (sig, params) = uniform(o, ty);
            let label = format!("{}.{sig}", p.schema);
            let returns = format!("{setof}{}", o.ret);
            let sql = p.function(&label, &o.name, &params, &returns, bare);
            plants.entry(sig).or_insert(sql);
        }
    }
    plants
        .into_iter()
        .map(|(sig, sql)| Plant { label: sig, sql })
        .collect()
}

/// The type pg_catalog's `op` gives for these operand types (prefix if `left` is None), or, where
/// pg_catalog has no such operator, its most common result type: the planted operator returns the
/// same type, so the statement that picks it still plans and then runs it.
async fn operator_result(c: &Client, op: &str, left: Option<&str>, right: &str) -> String {
    let left = left.map(|l| format!("NULL::{l}")).unwrap_or_default();
    let resolved = format!(
        "SELECT format_type(pg_typeof({left} OPERATOR(pg_catalog.{op}) NULL::{right})::oid, NULL)"
    );
    if let Ok(row) = c.query_one(&resolved, &[]).await {
        return row.get(0);
    }
    scalar(
        c,
        "SELECT coalesce((SELECT format_type(o.oprresult, NULL) FROM pg_operator o
                            JOIN pg_type t ON t.oid = o.oprresult
                           WHERE o.oprname = $1 AND o.oprnamespace = 'pg_catalog'::regnamespace
                             AND t.typtype <> 'p'
                           GROUP BY 1 ORDER BY count(*) DESC, 1 LIMIT 1), 'text')",
        &[&op],
    )
    .await
}

/// Every operator over every pair of types (and every type, where pg_catalog has a prefix form),
/// each with its own backing function.
async fn operator_plants(c: &Client, p: &Planter, ops: &[String], types: &[String]) -> Vec<Plant> {
    let prefix: BTreeSet<String> = c
        .query(
            "SELECT DISTINCT oprname::text FROM pg_operator \
             WHERE oprkind = 'l' AND oprnamespace = 'pg_catalog'::regnamespace",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let mut plants = Vec::new();
    for op in ops {
        let lefts = types
            .iter()
            .map(|t| Some(t.as_str()))
            .chain(prefix.contains(op).then_some(None));
        for left in lefts {
            for right in types {
                let label = format!(
                    "operator {}.{op}({}, {right})",
                    p.schema,
                    left.unwrap_or("NONE")
                );
                let backer = format!("hijack_op_{}", plants.len());
                let returns = operator_result(c, op, left, right).await;
                let args = left
                    .map(|l| format!("{l}, {right}"))
                    .unwrap_or(right.clone());
                let leftarg = left.map(|l| format!("LEFTARG = {l}, ")).unwrap_or_default();
                let sql = format!(
                    "{}; CREATE OPERATOR {schema}.{op} ({leftarg}RIGHTARG = {right}, \
                     FUNCTION = {schema}.{backer})",
                    p.function(&label, &backer, &args, &returns, false),
                    schema = p.schema,
                );
                plants.push(Plant { label, sql });
            }
        }
    }
    plants
}

/// Creates each plant (function and operator together) and returns how many were created; one
/// that cannot be created (say, plpgsql cannot take "any") is skipped.
async fn plant(c: &Client, plants: &[Plant]) -> usize {
    let mut created = 0;
    let mut skipped = Vec::new();
    for p in plants {
        match c.batch_execute(&p.sql).await {
            Ok(()) => created += 1,
            Err(e) => {
                let why = e
                    .as_db_error()
                    .map_or(e.to_string(), |d| d.message().to_string());
                skipped.push(format!("{}: {why}", p.label));
            }
        }
    }
    println!(
        "planted {created} of {}; skipped {}, e.g. {:?}",
        plants.len(),
        skipped.len(),
        &skipped[..skipped.len().min(5)]
    );
    created
}

/// The hits sequence: (last_value, is_called).
async fn hits(c: &Client, seq: &str) -> (i64, bool) {
    let r = c
        .query_one(&format!("SELECT last_value, is_called FROM {seq}"), &[])
        .await
        .unwrap();
    (r.get(0), r.get(1))
}

/// The distinct WARNINGs of planted bodies received so far.
fn planted_warnings(notices: &Mutex<Vec<String>>) -> BTreeSet<String> {
    notices
        .lock()
        .unwrap()
        .iter()
        .filter(|n| n.starts_with("WARNING: planted"))
        .cloned()
        .collect()
}

/// Proves the plants work: a SECURITY DEFINER function with the vulnerable search_path, calling
/// nextval with an untyped literal and power with integers, runs them. Then the count starts over.
async fn control(c: &Client, schema: &str, seq: &str, notices: &Mutex<Vec<String>>) {
    c.batch_execute(&format!(
        "CREATE SEQUENCE {schema}.hijack_control_seq;
         CREATE FUNCTION {schema}.hijack_control() RETURNS void LANGUAGE plpgsql SECURITY DEFINER
         SET search_path = pg_catalog, {schema}, pg_temp AS $$
         BEGIN
             PERFORM nextval('{schema}.hijack_control_seq');
             PERFORM power(2, 3);
         END $$;
         SELECT {schema}.hijack_control();"
    ))
    .await
    .unwrap();
    let (count, called) = hits(c, seq).await;
    let warnings = planted_warnings(notices);
    assert!(
        called && count >= 2,
        "control: the vulnerable function ran no planted code ({count}, {called}): {warnings:#?}"
    );
    for name in ["nextval(text)", "power(integer, integer)"] {
        assert!(
            warnings.iter().any(|w| w.contains(name)),
            "control: {name} did not run: {warnings:#?}"
        );
    }
    c.batch_execute(&format!(
        "DROP FUNCTION {schema}.hijack_control(); DROP SEQUENCE {schema}.hijack_control_seq;
         ALTER SEQUENCE {seq} RESTART"
    ))
    .await
    .unwrap();
    notices.lock().unwrap().clear();
}

/// Calls the extension's functions as one role at a time, recording which functions were called
/// and which happy-path calls failed (a planted object that ran usually breaks the call too).
struct Api<'a> {
    c: &'a Client,
    schema: String,
    role: String,
    called: BTreeSet<String>,
    failures: Vec<String>,
}

impl Api<'_> {
    /// Acts as `role` from now on; None is the superuser.
    async fn set_role(&mut self, role: Option<&str>) {
        let sql = role.map_or("RESET ROLE".to_string(), |r| format!("SET ROLE {r}"));
        self.c.batch_execute(&sql).await.unwrap();
        self.role = role.unwrap_or("superuser").to_string();
    }

    async fn run(
        &mut self,
        func: &str,
        args: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, String> {
        self.called.insert(func.to_string());
        let sql = format!("SELECT * FROM {}.{func}({args})", self.schema);
        self.c
            .query(&sql, params)
            .await
            .map_err(|e| match e.as_db_error() {
                Some(d) => format!("{} {sql}: {} ({:?})", self.role, d.message(), d.where_()),
                None => format!("{} {sql}: {e}", self.role),
            })
    }

    /// A call that must succeed; its rows (none if it failed).
    async fn call(&mut self, func: &str, args: &str, params: &[&(dyn ToSql + Sync)]) -> Vec<Row> {
        self.run(func, args, params).await.unwrap_or_else(|e| {
            self.failures.push(e);
            Vec::new()
        })
    }

    /// A call with bad input: any outcome is fine, what counts is the error path it runs.
    async fn reject(&mut self, func: &str, args: &str) {
        let _ = self.run(func, args, &[]).await;
    }

    /// The single number a call returns (bigint or int), or None if it failed.
    async fn count(
        &mut self,
        func: &str,
        args: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Option<i64> {
        let rows = self.call(func, args, params).await;
        let row = rows.first()?;
        row.try_get::<_, Option<i64>>(0)
            .or_else(|_| row.try_get::<_, Option<i32>>(0).map(|n| n.map(i64::from)))
            .ok()
            .flatten()
    }

    /// Records a failed expectation about a happy path.
    fn expect(&mut self, ok: bool, what: &str) {
        if !ok {
            self.failures.push(format!("{}: {what}", self.role));
        }
    }

    /// Claims every due event as `owner`: (claim token, ids).
    async fn claim(&mut self, owner: &str) -> (Option<i64>, Vec<i64>) {
        let rows = self.call("outbox_claim", "$1, 100", &[&owner]).await;
        let token = rows.first().and_then(|r| r.get("claim_token"));
        (token, rows.iter().filter_map(|r| r.get("id")).collect())
    }

    async fn failed_events(&mut self) -> Option<i64> {
        let rows = self.call("outbox_stats", "", &[]).await;
        rows.first().and_then(|r| r.get("failed"))
    }
}

/// Every happy path once, each step as the role the recipe gives it (None: the superuser): three
/// due events; one acked, one nacked and one reclaimed, both retried until they are dead letters,
/// requeued, drained and purged. Expects outbox.max_retry = 1 and a 1 ms backoff.
async fn lifecycle(
    api: &mut Api<'_>,
    producer: Option<&str>,
    relay: Option<&str>,
    admin: Option<&str>,
) {
    api.set_role(producer).await;
    for args in [
        "'orders', '{\"n\": 1}'",
        "'orders', '{\"n\": 2}', key => 'k-2', event_type => 'created', \
         headers => '{\"trace\": \"t\"}', deliver_at => '2000-01-01'",
        "'orders', '{\"n\": 3}', 'k-3', 'created', '{}', NULL",
        // Not due: stays WAIT, so outbox_stats has a delayed event to count.
        "'orders', '{\"n\": 4}', deliver_at => '2999-01-01'",
    ] {
        let id = api.count("outbox_enqueue", args, &[]).await;
        api.expect(id.is_some(), "outbox_enqueue returned no id");
    }

    api.set_role(relay).await;
    let owner = "relay-1";
    api.call("outbox_heartbeat", "$1, '30 seconds'", &[&owner])
        .await;
    // An owner that said it stops: the reclaims below read and then delete its row.
    api.call("outbox_heartbeat", "'relay-gone', '0 seconds'", &[])
        .await;
    let (token, ids) = api.claim(owner).await;
    api.expect(ids.len() == 3, &format!("claimed {ids:?}, want 3 events"));
    let renewed = api
        .count("outbox_renew", "$1, $2, $3", &[&owner, &token, &ids])
        .await;
    api.expect(renewed == Some(3), &format!("renewed {renewed:?}"));
    let first = &ids[..ids.len().min(1)];
    let acked = api
        .count("outbox_ack", "$1, $2, $3", &[&owner, &token, &first])
        .await;
    api.expect(acked == Some(1), &format!("acked {acked:?}"));
    let second = ids.get(1..2).unwrap_or_default();
    let nacked = api
        .count(
            "outbox_nack",
            "$1, $2, $3, 'boom'",
            &[&owner, &token, &second],
        )
        .await;
    api.expect(nacked == Some(1), &format!("nacked {nacked:?}"));
    // The third event's lease is older than 1 ms once we have slept.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let reclaimed = api.count("outbox_reclaim", "'1 millisecond'", &[]).await;
    api.expect(reclaimed == Some(1), &format!("reclaimed {reclaimed:?}"));
    let reclaimed = api.call("outbox_reclaim_returning", "", &[]).await.len();
    api.expect(
        reclaimed == 0,
        "outbox_reclaim_returning() with the default lease",
    );
    let reclaimed = api.count("outbox_reclaim", "", &[]).await;
    api.expect(
        reclaimed == Some(0),
        "outbox_reclaim() with the default lease",
    );
    // Retry both until they are past outbox.max_retry.
    for _ in 0..50 {
        if api.failed_events().await >= Some(2) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        let (token, ids) = api.claim(owner).await;
        if !ids.is_empty() {
            // The relay's form: the settled rows with their new state.
            let settled = api
                .call(
                    "outbox_nack_returning",
                    "$1, $2, $3",
                    &[&owner, &token, &ids],
                )
                .await;
            api.expect(
                settled.len() == ids.len(),
                &format!("outbox_nack_returning settled {} of {ids:?}", settled.len()),
            );
        }
    }
    let failed = api.failed_events().await;
    api.expect(
        failed == Some(2),
        &format!("{failed:?} dead letters, want 2"),
    );

    api.set_role(admin).await;
    api.call("outbox_dead_letters", "", &[]).await;
    let dead: Vec<i64> = api
        .call("outbox_dead_letters", "100, 0", &[])
        .await
        .iter()
        .map(|r| r.get("id"))
        .collect();
    // A claim finds both keys' heads dead and marks the keys blocked; skipping lets them go on.
    api.claim(owner).await;
    let blocked = api.call("outbox_blocked_keys", "", &[]).await.len();
    api.expect(blocked == 2, &format!("{blocked} blocked keys, want 2"));
    // relay-1 beats (above) and has claimed: outbox_owners lists it.
    let owners: Vec<String> = api
        .call("outbox_owners", "10", &[])
        .await
        .iter()
        .map(|r| r.get("owner"))
        .collect();
    api.expect(
        owners.iter().any(|o| o == owner),
        &format!("outbox_owners lists {owners:?}, want {owner} among them"),
    );
    let skipped = api.count("outbox_skip", "$1", &[&dead]).await;
    api.expect(
        skipped == Some(2),
        &format!("skipped {skipped:?} of {dead:?}"),
    );
    let requeued = api.count("outbox_requeue", "$1", &[&dead]).await;
    api.expect(
        requeued == Some(2),
        &format!("requeued {requeued:?} of {dead:?}"),
    );
    api.set_role(relay).await;
    let (token, ids) = api.claim(owner).await;
    let released = api
        .count(
            "outbox_release",
            "$1, $2, $3, '0 seconds', 'broker down'",
            &[&owner, &token, &ids],
        )
        .await;
    api.expect(
        released == Some(2),
        &format!("released {released:?} requeued events"),
    );
    let orphans = api
        .count("outbox_release_orphans", "$1, '{}'", &[&owner])
        .await;
    api.expect(
        orphans == Some(0),
        &format!("released {orphans:?} orphans of an owner holding nothing"),
    );
    let (token, ids) = api.claim(owner).await;
    // The relay's form: the ids it settled.
    let acked: Vec<i64> = api
        .call(
            "outbox_ack_returning",
            "$1, $2, $3",
            &[&owner, &token, &ids],
        )
        .await
        .iter()
        .map(|r| r.get(0))
        .collect();
    api.expect(
        acked == ids,
        &format!("acked {acked:?} of the requeued events {ids:?}"),
    );
    api.set_role(admin).await;
    let purged = api.count("outbox_purge", "'0 seconds'", &[]).await;
    api.expect(purged == Some(3), &format!("purged {purged:?}, want 3"));
    api.call("outbox_purge", "", &[]).await;
    api.call("outbox_stats", "", &[]).await;
}

/// The inbox's happy paths: `consumer` accepts an event id twice (new, then a duplicate), `admin`
/// reads the stats and purges it; `name` is the consumer (a role).
async fn inbox(api: &mut Api<'_>, name: &str, consumer: Option<&str>, admin: Option<&str>) {
    api.set_role(consumer).await;
    let id = "'0190a1b2-0000-7000-8000-00000000c0de'";
    for want in [true, false] {
        let rows = api
            .call("outbox_inbox_accept", &format!("$1, {id}"), &[&name])
            .await;
        let got: Option<bool> = rows.first().map(|r| r.get(0));
        api.expect(
            got == Some(want),
            &format!("accept returned {got:?}, want {want}"),
        );
    }
    api.set_role(admin).await;
    let consumers = api.call("outbox_inbox_stats", "", &[]).await.len();
    api.expect(
        consumers == 1,
        &format!("{consumers} consumers in the stats, want 1"),
    );
    let purged = api.count("outbox_inbox_purge", "'0 seconds'", &[]).await;
    api.expect(
        purged == Some(1),
        &format!("purged {purged:?} inbox rows, want 1"),
    );
    api.call("outbox_inbox_purge", "", &[]).await;
}

/// The error paths (their messages are built with format, so they run pg_catalog code too), and
/// the extension's helper functions that only its owner may call directly; as the superuser.
async fn bad_input_and_helpers(api: &mut Api<'_>) {
    api.set_role(None).await;
    for (func, args) in [
        ("outbox_enqueue", "'', '{}'"),
        ("outbox_enqueue", "'orders', NULL"),
        ("outbox_enqueue", "'orders', '{}', headers => '[]'"),
        ("outbox_enqueue", "'orders', '{}', headers => '{\"a\": 1}'"),
        (
            "outbox_enqueue",
            "'orders', '{}', headers => '{\"event_id\": \"1\"}'",
        ),
        ("outbox_claim", "'', 1"),
        ("outbox_claim", "'relay-1', 0"),
        ("outbox_ack", "'relay-1', NULL, '{1}'"),
        ("outbox_nack", "'relay-1', 1, NULL"),
        ("outbox_renew", "'', 1, '{1}'"),
        ("outbox_release", "'relay-1', 1, '{1}', '-1 second'"),
        ("outbox_release_orphans", "'', '{}'"),
        ("outbox_release_orphans", "'relay-1', NULL"),
        ("outbox_reclaim", "'-1 second'"),
        ("outbox_heartbeat", "'relay-1', '-1 second'"),
        ("outbox_heartbeat", "'', '1 second'"),
        ("outbox_requeue", "NULL"),
        ("outbox_purge", "'-1 second'"),
        ("outbox_purge", "'1 second', 0"),
        ("outbox_dead_letters", "0"),
        ("outbox_blocked_keys", "0"),
        ("outbox_owners", "0"),
        ("outbox_skip", "NULL"),
        ("outbox_enqueue", "'orders', '{}', deliver_at => 'infinity'"),
        ("outbox_inbox_accept", "'', NULL"),
        ("outbox_inbox_accept", "'postgres', NULL"),
        ("outbox_inbox_accept", "'no such role', gen_random_uuid()"),
        ("outbox_inbox_purge", "'-1 second'"),
        ("outbox_inbox_purge", "'1 second', 0"),
    ] {
        api.reject(func, args).await;
    }
    // Calls that lock rows refuse REPEATABLE READ.
    api.c
        .batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        .await
        .unwrap();
    api.reject("outbox_claim", "'relay-1', 1").await;
    api.c.batch_execute("ROLLBACK").await.unwrap();
    api.c
        .batch_execute("SET outbox.max_payload_bytes = 16")
        .await
        .unwrap();
    api.reject(
        "outbox_enqueue",
        "'orders', '{\"too\": \"large for 16 bytes\"}'",
    )
    .await;
    api.c
        .batch_execute("RESET outbox.max_payload_bytes")
        .await
        .unwrap();

    for (func, args) in [
        ("outbox_config", ""),
        ("outbox_max_payload_bytes", ""),
        ("outbox_notify_enabled", ""),
        ("outbox_check_owner", "'f', 'owner'"),
        ("outbox_check_ids", "'f', '{1}'"),
        ("outbox_check_claim_args", "'f', 'owner', 1, '{1}'"),
        ("outbox_check_claim", "'owner', 10"),
        ("outbox_check_isolation", "'f'"),
        ("outbox_check_topic", "'orders'"),
        ("outbox_topic_ordered", "'orders'"),
        ("outbox_key_hash", "'orders', 'k-1'"),
        ("outbox_uuidv7", ""),
        ("outbox_status_after_failure", "4, 3"),
        ("outbox_backoff", "2, 5000::bigint, 60000::bigint, 0.1"),
        ("outbox_check_count", "'f', 'max_rows', 10, 100"),
        (
            "outbox_check_elements",
            "'f', ARRAY['{}'::jsonb], ARRAY['k-1'], ARRAY['{\"h\": \"v\"}'::jsonb]",
        ),
        ("outbox_succeeded", "0"),
        ("outbox_check_headers", "'f', 'headers', '{\"h\": \"v\"}'"),
        (
            "outbox_reclaim_reason",
            "'relay-1', now() - interval '1 hour', now(), interval '10 minutes', '{}', '{}'",
        ),
        ("outbox_enqueue_begin", "'orders', 'k-1'"),
        ("outbox_client_connected", ""),
        (
            "outbox_enqueue_many",
            "'orders', ARRAY['{}'::jsonb], ARRAY['k-1']",
        ),
        ("outbox_wait", "'0 s'"),
        ("outbox_wake_mode", ""),
        ("outbox_work_due", ""),
    ] {
        api.call(func, args, &[]).await;
    }
    let work_due = format!(
        "0, '{}.outbox_work_due()'::pg_catalog.regprocedure",
        api.schema
    );
    api.call("outbox_wait_for", &work_due, &[]).await;
    // The stream's internals, which the claim and the settle calls use: directly, once each.
    api.call(
        "outbox_enqueue",
        "'orders', '{\"for\": \"the stream\"}'",
        &[],
    )
    .await;
    for (func, args) in [
        ("outbox_stream_lock_id", ""),
        ("outbox_cursor", ""),
        ("outbox_snapshot_of_others", ""),
        (
            "outbox_stream_passed",
            "'5'::xid8, 1::bigint, pg_current_snapshot(), pg_current_snapshot(), 1::bigint",
        ),
        ("outbox_stream_take", "'relay-h', 424242, now(), 10"),
        ("outbox_claim_scheduled", "'relay-h', 424243, now(), 10"),
        (
            "outbox_key_next",
            "false, true, 'WAIT', now(), NULL, now(), now(), '1 minute'",
        ),
        ("outbox_stream_settle", "'relay-h', 424242, '{1}'"),
        ("outbox_keys_wait", "'{1}', now()"),
        ("outbox_keys_wake", "'{orders}', '{k-1}', now()"),
        ("outbox_keys_drop_idle", "'{orders}', '{k-1}', false"),
        ("outbox_key_run", "'orders', 'k-1', false, false, now(), 10"),
        (
            "outbox_stream_schedule",
            "'{}', 'WAIT', 0, now(), NULL, now()",
        ),
        ("outbox_stream_rebase", "'(1,1:1:,1:1:,0,,0,0,0)'"),
        ("outbox_stream_lock", ""),
        (
            "outbox_stream_window",
            "pg_current_snapshot(), pg_current_snapshot()",
        ),
        (
            "outbox_stream_walk",
            "pg_current_snapshot(), pg_current_snapshot(), 0::bigint, 1::bigint, 10::bigint, 10",
        ),
        ("outbox_stream_divert", "'{1}', '{5}', now(), 0::bigint"),
        ("outbox_stream_waiting", ""),
        (
            "outbox_reclaim_batches",
            "now(), interval '10 minutes', '{}', '{}', 3",
        ),
    ] {
        api.call(func, args, &[]).await;
    }
    // The restamp trigger fires for a stream row inserted with another transaction's id (as
    // pg_restore inserts them).
    let restamp = format!(
        "INSERT INTO {}.outbox_stream (txid, topic, payload) VALUES ('3', 'orders', '{{}}')",
        api.schema
    );
    match api.c.batch_execute(&restamp).await {
        Ok(()) => {
            api.called.insert("outbox_stream_restamp".into());
        }
        Err(e) => api.failures.push(format!("restamp: {e}")),
    }
    if build::sql_only() {
        sql_only_functions(api).await;
    }
}

/// What only the SQL-only build has: the version, outbox_wait, and the helpers that read and
/// check the settings, each through its paths (a value, the default, a bad value).
async fn sql_only_functions(api: &mut Api<'_>) {
    for (func, args) in [
        ("outbox_sql_only_version", ""),
        ("outbox_setting_raw", "'outbox.lease'"),
        ("outbox_setting_database", "'outbox.lease'"),
        ("outbox_setting_trusted", ""),
        (
            "outbox_setting_int",
            "'outbox.lease', '1.5min', 1, 'ms', 1, 2147483647",
        ),
        (
            "outbox_setting_int",
            "'outbox.x', '3 kB', 1, 'B', 1, 2147483647",
        ),
        ("outbox_setting_int", "'outbox.x', NULL, 1, NULL, 0, 10"),
        ("outbox_setting_bool", "'outbox.notify', true"),
        ("outbox_topic_list_match", "'outbox.x', 'a, b.*, *', 'b.c'"),
    ] {
        api.call(func, args, &[]).await;
    }
    for (func, args) in [
        ("outbox_wait", "'-1 s'"),
        ("outbox_setting_int", "'outbox.x', 'many', 1, 'ms', 1, 2"),
        ("outbox_setting_int", "'outbox.x', '5', 1, NULL, 1, 2"),
        ("outbox_setting_error", "'m', NULL"),
        ("outbox_setting_error", "'m', 'h'"),
        ("outbox_setting_denied", "'outbox.x', 'a', NULL"),
        ("outbox_topic_list_match", "'outbox.x', 'or*ders', 'orders'"),
    ] {
        api.reject(func, args).await;
    }
    // The settings through their checks: bad values, guards wider than the database's (a
    // superuser may set them: the check runs, the call succeeds).
    let reset = "RESET outbox.notify; RESET outbox.backoff_jitter; RESET outbox.head_of_line; \
                 RESET outbox.max_payload_bytes; RESET outbox.unordered_topics; RESET outbox.allowed_topics";
    for set in [
        "SET outbox.notify = 'sometimes'",
        "SET outbox.backoff_jitter = 'x'",
        "SET outbox.backoff_jitter = 2",
        "SET outbox.head_of_line = 'x'",
    ] {
        api.c.batch_execute(set).await.unwrap();
        api.reject("outbox_config", "").await;
        api.c.batch_execute(reset).await.unwrap();
    }
    api.c
        .batch_execute(
            "SET outbox.max_payload_bytes = '1GB'; SET outbox.unordered_topics = '*'; \
             SET outbox.allowed_topics = 'x'",
        )
        .await
        .unwrap();
    api.reject("outbox_max_payload_bytes", "").await;
    api.reject("outbox_topic_ordered", "'orders'").await;
    api.reject("outbox_check_topic", "'orders'").await;
    api.c.batch_execute(reset).await.unwrap();
}

#[tokio::test]
async fn planted_catalog_lookalikes_never_run_as_the_definer() {
    let roles;
    let db = TestDb::create();
    roles = Roles::create(&db, &["attacker"]);
    let attacker = roles.name("attacker");
    let (c, notices) = connect_with_notices(&db.url()).await;
    // Nothing this session runs itself may resolve to a planted object: any hit comes from inside
    // the extension.
    c.batch_execute("SET search_path = pg_catalog, pg_temp")
        .await
        .unwrap();
    // The SQL-only build's schema is fixed (scripts/sql-only): public, like the extension's here.
    let schema: String = if build::sql_only() {
        "public".into()
    } else {
        scalar(
            &c,
            "SELECT extnamespace::regnamespace::text FROM pg_extension WHERE extname = 'outbox'",
            &[],
        )
        .await
    };
    let functions: Vec<String> = c
        .query(
            &format!(
                "SELECT oid::regprocedure::text FROM pg_proc WHERE oid IN ({})",
                build::objects("pg_proc")
            ),
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    c.batch_execute(&format!(
        "GRANT CREATE ON SCHEMA {schema} TO {attacker};
         GRANT EXECUTE ON FUNCTION {} TO {attacker}",
        functions.join(", ")
    ))
    .await
    .unwrap();

    let calls = enumerate_calls(&c).await;
    println!(
        "pg_catalog functions the extension calls: {:?}",
        calls.functions
    );
    println!(
        "pg_catalog operators the extension uses: {:?}",
        calls.operators
    );
    for f in ["nextval", "power", "format", "make_interval"] {
        assert!(calls.functions.iter().any(|n| n == f), "{f} not enumerated");
    }
    for op in ["*", "+", "-", "/", "<", "="] {
        assert!(
            calls.operators.iter().any(|o| o == op),
            "{op} not enumerated"
        );
    }
    // least() is grammar (like greatest and coalesce), not a pg_proc function: no search_path
    // lookup, nothing to plant. Its presence checks the identifier extraction itself.
    assert!(
        calls.identifiers.contains("least"),
        "{:?}",
        calls.identifiers
    );

    let types = planted_types(&c).await;
    let planter = Planter {
        hits: format!("{schema}.hijack_hits"),
        schema: schema.clone(),
        attacker: attacker.clone(),
    };
    let mut plants = function_plants(&planter, &overloads(&c, &calls.functions).await, &types);
    plants.extend(operator_plants(&c, &planter, &calls.operators, &types).await);

    c.batch_execute(&format!(
        "SET ROLE {attacker};
         CREATE SEQUENCE {hits};
         GRANT USAGE ON SEQUENCE {hits} TO PUBLIC",
        hits = planter.hits
    ))
    .await
    .unwrap();
    let planted = plant(&c, &plants).await;
    c.batch_execute("RESET ROLE").await.unwrap();
    assert!(planted >= 200, "only {planted} objects planted");

    control(&c, &schema, &planter.hits, &notices).await;

    // Session settings survive SET ROLE: every role's nacks reach FAIL after two attempts.
    c.batch_execute("SET outbox.max_retry = 1; SET outbox.backoff_base = '1ms'")
        .await
        .unwrap();
    let mut api = Api {
        c: &c,
        schema: schema.clone(),
        role: String::new(),
        called: BTreeSet::new(),
        failures: Vec::new(),
    };
    lifecycle(&mut api, None, None, None).await;
    let [producer, relay, admin, consumer] =
        ["producer", "relay", "admin", "consumer"].map(|k| roles.name(k));
    inbox(&mut api, &consumer, None, None).await;
    lifecycle(&mut api, Some(&producer), Some(&relay), Some(&admin)).await;
    inbox(&mut api, &consumer, Some(&consumer), Some(&admin)).await;
    bad_input_and_helpers(&mut api).await;
    api.set_role(None).await;

    let (count, called) = hits(&c, &planter.hits).await;
    assert!(
        !called,
        "planted code ran as the definer ({count} times): {:#?}",
        planted_warnings(&notices)
    );
    assert!(
        api.failures.is_empty(),
        "happy paths failed: {:#?}",
        api.failures
    );
    let uncalled: Vec<String> = c
        .query(
            &format!(
                "SELECT DISTINCT proname::text FROM pg_proc WHERE oid IN ({})",
                build::objects("pg_proc")
            ),
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get::<_, String>(0))
        .filter(|f| !api.called.contains(f))
        .collect();
    assert!(
        uncalled.is_empty(),
        "extension functions this test does not call (add them to lifecycle or bad_input_and_helpers): {uncalled:?}"
    );
    drop(c);
    drop(db);
    drop(roles);
}
