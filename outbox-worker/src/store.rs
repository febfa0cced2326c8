//! The relay's typed database boundary: one method per extension function it calls (claim, ack,
//! nack, release, reclaim, stats), each owning its SQL and mapping its rows by column name. Every
//! statement is schema-qualified with the extension's schema, so the relay works whatever its
//! role's search_path is. Failures are [`DbError`]s that keep the SQLSTATE; retrying is the
//! caller's decision. Statements are unnamed, sent with their parameters' types: each call is
//! one Parse/Bind/Execute/Sync, so a transaction-mode pooler (PgBouncer) may run every call on
//! another server session.

use std::time::{Duration, SystemTime};

use deadpool_postgres::{Manager, ManagerConfig, Object, Pool, RecyclingMethod, Runtime};
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::Row;

use crate::db::{connect_failure, extension, Target};
use crate::error::DbError;
use crate::Fatal;

/// `outbox.max_retry` when the setting is not readable (the extension's default).
pub const EXTENSION_DEFAULT_MAX_RETRY: i32 = 3;

/// A statement's parameters, each with its PostgreSQL type.
type Params<'a> = &'a [(&'a (dyn ToSql + Sync), Type)];

/// One claimed outbox row.
#[derive(Debug, Clone)]
pub struct Event {
    /// The row's bigint key in this database (sent as `outbox_id`, for operators).
    pub id: i64,
    /// The event's global UUID (sent as `event_id`): what consumers deduplicate on.
    pub event_id: String,
    pub topic: String,
    pub key: Option<String>,
    pub event_type: Option<String>,
    /// The payload's JSON text.
    pub payload: String,
    /// The row's headers as JSON text (an object of strings).
    pub headers: String,
    /// The fencing token of the claim that returned this row (the same for the whole batch).
    pub claim_token: i64,
    pub retry_count: i32,
    /// Seconds between the row's created_at and the claim, by the database clock.
    pub age_at_claim: f64,
    /// The row's created_at in milliseconds since the Unix epoch: the message's timestamp
    /// (CreateTime), so a consumer sees when the event happened rather than when it was relayed.
    pub created_at_ms: i64,
    /// The event keeps its key's order: nothing after it in its key may be acked before it.
    pub ordered: bool,
}

impl Event {
    fn from_row(r: &Row) -> Result<Event, tokio_postgres::Error> {
        Ok(Event {
            id: r.try_get("id")?,
            event_id: r.try_get("event_id")?,
            topic: r.try_get("topic")?,
            key: r.try_get("event_key")?,
            event_type: r.try_get("event_type")?,
            payload: r.try_get("payload")?,
            headers: r.try_get("headers")?,
            claim_token: r.try_get("claim_token")?,
            retry_count: r.try_get("retry_count")?,
            age_at_claim: r.try_get::<_, Option<f64>>("age_at_claim")?.unwrap_or(0.0),
            created_at_ms: r.try_get("created_at_ms")?,
            ordered: r.try_get("ordered")?,
        })
    }
}

/// A row `outbox_nack_returning` settled, in its new state.
#[derive(Debug, Clone, PartialEq)]
pub struct Nacked {
    pub id: i64,
    /// FAIL: retries exhausted, a dead letter.
    pub dead_letter: bool,
    /// Failed attempts so far.
    pub retry_count: i32,
}

impl Nacked {
    fn from_row(r: &Row) -> Result<Nacked, tokio_postgres::Error> {
        Ok(Nacked {
            id: r.try_get("id")?,
            dead_letter: r.try_get::<_, String>("status")? == "FAIL",
            retry_count: r.try_get("retry_count")?,
        })
    }
}

/// A row `outbox_reclaim_returning` took back from an expired lease, in its new state.
#[derive(Debug, Clone, PartialEq)]
pub struct Reclaimed {
    pub id: i64,
    pub topic: String,
    /// FAIL: retries exhausted, a dead letter.
    pub dead_letter: bool,
    pub retry_count: i32,
    /// The relay that held it (its lease expired or its heartbeat ran out).
    pub expired_owner: Option<String>,
}

impl Reclaimed {
    fn from_row(r: &Row) -> Result<Reclaimed, tokio_postgres::Error> {
        Ok(Reclaimed {
            id: r.try_get("id")?,
            topic: r.try_get("topic")?,
            dead_letter: r.try_get::<_, String>("status")? == "FAIL",
            retry_count: r.try_get("retry_count")?,
            expired_owner: r.try_get("expired_owner")?,
        })
    }
}

/// `outbox_stats()`, plus `outbox.max_retry` as this session sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct Stats {
    pub due_wait: i64,
    pub delayed_wait: i64,
    pub sending: i64,
    pub failed: i64,
    pub succeeded: i64,
    /// Seconds; None when nothing is due.
    pub oldest_due_age: Option<f64>,
    /// Seconds; None when nothing is claimed.
    pub oldest_lease_age: Option<f64>,
    /// Keys held back by a dead head (outbox.head_of_line = block).
    pub blocked_keys: i64,
    /// Seconds since the oldest blocking head died; None when no key is blocked.
    pub oldest_blocked_age: Option<f64>,
    /// None when the setting cannot be read.
    pub max_retry: Option<i32>,
}

impl Stats {
    /// The statement, for a store or any other session (the `stats` admin command).
    pub fn sql(schema: &str) -> String {
        format!(
            "SELECT due_wait, delayed_wait, sending, failed, succeeded, \
             extract(epoch from oldest_due_age)::float8 AS oldest_due_age, \
             extract(epoch from oldest_lease_age)::float8 AS oldest_lease_age, blocked_keys, \
             extract(epoch from oldest_blocked_age)::float8 AS oldest_blocked_age, \
             current_setting('outbox.max_retry', true) AS max_retry \
             FROM {schema}.outbox_stats()"
        )
    }

    pub fn from_row(r: &Row) -> Result<Stats, tokio_postgres::Error> {
        Ok(Stats {
            due_wait: r.try_get("due_wait")?,
            delayed_wait: r.try_get("delayed_wait")?,
            sending: r.try_get("sending")?,
            failed: r.try_get("failed")?,
            succeeded: r.try_get("succeeded")?,
            oldest_due_age: r.try_get("oldest_due_age")?,
            oldest_lease_age: r.try_get("oldest_lease_age")?,
            blocked_keys: r.try_get("blocked_keys")?,
            oldest_blocked_age: r.try_get("oldest_blocked_age")?,
            max_retry: parse_setting(r.try_get("max_retry")?),
        })
    }
}

/// The extension's settings that bound what the relay may do.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Settings {
    /// `outbox.max_retry` ([`EXTENSION_DEFAULT_MAX_RETRY`] when unreadable).
    pub max_retry: i32,
    /// `outbox.max_claim`; None when unset (the extension's default applies).
    pub max_claim: Option<i32>,
    /// The session's statement_timeout (zero: none).
    pub statement_timeout: Duration,
}

fn parse_setting(text: Option<String>) -> Option<i32> {
    text.and_then(|s| s.parse().ok())
}

/// The statements, built once with the extension's schema.
struct Sql {
    claim: String,
    ack: String,
    nack: String,
    release: String,
    reclaim: String,
    heartbeat: String,
    release_orphans: String,
    stats: String,
    settings: String,
}

impl Sql {
    fn new(schema: &str) -> Sql {
        let f = |name: &str| format!("{schema}.outbox_{name}");
        Sql {
            claim: format!(
                "SELECT id, event_id::text AS event_id, topic, event_key, event_type, \
                 payload::text AS payload, headers::text AS headers, claim_token, retry_count, \
                 extract(epoch from (clock_timestamp() - created_at))::float8 AS age_at_claim, \
                 floor(extract(epoch from created_at) * 1000)::int8 AS created_at_ms, ordered \
                 FROM {}($1, $2)",
                f("claim")
            ),
            ack: format!("SELECT id FROM {}($1, $2, $3) AS id", f("ack_returning")),
            nack: format!(
                "SELECT id, status::text AS status, retry_count FROM {}($1, $2, $3, $4)",
                f("nack_returning")
            ),
            release: format!(
                "SELECT {}($1, $2, $3, $4::text::interval, $5) AS released",
                f("release")
            ),
            reclaim: format!(
                "SELECT id, topic, status::text AS status, retry_count, expired_owner \
                 FROM {}($1::text::interval)",
                f("reclaim_returning")
            ),
            heartbeat: format!(
                "SELECT {}($1, $2::text::interval, $3) AS expires_at",
                f("heartbeat")
            ),
            release_orphans: format!("SELECT {}($1, $2) AS released", f("release_orphans")),
            stats: Stats::sql(schema),
            // Calling outbox_stats() first loads the extension library, which defines the settings.
            settings: format!(
                "SELECT current_setting('outbox.max_retry', true) AS max_retry, \
                 current_setting('outbox.max_claim', true) AS max_claim, \
                 (SELECT setting::int8 FROM pg_catalog.pg_settings \
                  WHERE name = 'statement_timeout') AS statement_timeout_ms FROM {}() s",
                f("stats")
            ),
        }
    }
}

/// The pool of the relay's sessions and the statements they run.
pub struct Store {
    pool: Pool,
    schema: String,
    desc: String,
    sql: Sql,
    /// The longest wait for a pooled connection, opening it included (see [`Store::call`]).
    pool_timeout: Duration,
    /// The client-side bound of one call (see [`Store::call`]).
    call_timeout: Duration,
}

impl Store {
    /// Connects, checks the extension (installed, version at least
    /// [`crate::db::MIN_EXTENSION_VERSION`]) and returns the store. Waiting for a connection (opening
    /// it included) takes at most `wait`, a call at most `call_timeout`. Errors are one clear line.
    pub async fn open(
        target: Target,
        pool_size: usize,
        wait: Duration,
        call_timeout: Duration,
    ) -> Result<Store, Fatal> {
        let (cfg, desc) = (target.cfg.clone(), target.desc.clone());
        let mgr = Manager::from_connect(
            cfg,
            crate::hosts::PoolConnect(target),
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(mgr)
            .max_size(pool_size)
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(wait))
            .create_timeout(Some(wait))
            .recycle_timeout(Some(wait))
            .build()
            .map_err(|e| Fatal::runtime(format!("cannot build the connection pool: {e}")))?;
        let client = pool.get().await.map_err(|e| match &e {
            deadpool_postgres::PoolError::Backend(b) => connect_failure(&desc, b),
            other => connect_failure(&desc, other),
        })?;
        // Refused here rather than at the first nack (42883) of a relay that looked started.
        let ext = extension(&client, &desc).await?;
        ext.check_version(&desc)?;
        drop(client);
        let schema = ext.schema;
        let sql = Sql::new(&schema);
        Ok(Store {
            pool,
            schema,
            desc,
            sql,
            pool_timeout: wait,
            call_timeout,
        })
    }

    /// `host=… port=… dbname=… user=…`, for messages.
    pub fn desc(&self) -> &str {
        &self.desc
    }

    /// The extension's schema, quoted for SQL.
    pub fn schema(&self) -> &str {
        &self.schema
    }

    /// `schema.outbox_<name>`, for messages.
    pub fn func(&self, name: &str) -> String {
        format!("{}.outbox_{name}", self.schema)
    }

    /// `f` on a pooled connection (had within `--pool-timeout`), within the call's bound. A
    /// connection that outlives it stopped answering (the server would have cancelled the
    /// statement by then): it leaves the pool instead of being handed out again.
    async fn call<T>(
        &self,
        f: impl AsyncFnOnce(&Object) -> Result<T, tokio_postgres::Error>,
    ) -> Result<T, DbError> {
        let client = tokio::time::timeout(self.pool_timeout, self.pool.get())
            .await
            .map_err(|_| DbError::PoolTimeout(self.pool_timeout))?
            .map_err(DbError::Connect)?;
        let answer = tokio::time::timeout(self.call_timeout, f(&client)).await;
        match answer {
            Ok(result) => result.map_err(DbError::Query),
            Err(_) => {
                drop(Object::take(client));
                Err(DbError::Timeout(self.call_timeout))
            }
        }
    }

    /// A statement's rows, within the call's bound.
    async fn rows(&self, sql: &str, params: Params<'_>) -> Result<Vec<Row>, DbError> {
        self.call(async |c| c.query_typed(sql, params).await).await
    }

    /// A statement's one row, within the call's bound.
    async fn row(&self, sql: &str, params: Params<'_>) -> Result<Row, DbError> {
        self.call(async |c| c.query_typed_one(sql, params).await)
            .await
    }

    /// `outbox.max_retry`, `outbox.max_claim` and the session's statement_timeout.
    pub async fn settings(&self) -> Result<Settings, DbError> {
        let row = self.row(&self.sql.settings, &[]).await?;
        let get = |name| row.try_get::<_, Option<String>>(name).map(parse_setting);
        let row_err = |source| DbError::Row {
            call: "outbox_stats",
            source,
        };
        Ok(Settings {
            max_retry: get("max_retry")
                .map_err(row_err)?
                .unwrap_or(EXTENSION_DEFAULT_MAX_RETRY),
            max_claim: get("max_claim").map_err(row_err)?,
            statement_timeout: Duration::from_millis(
                row.try_get::<_, i64>("statement_timeout_ms")
                    .map_err(row_err)?
                    .max(0) as u64,
            ),
        })
    }

    /// `outbox_claim(owner, batch)`: the oldest due events, now held by `owner` under one token.
    pub async fn claim(&self, owner: &str, batch: i32) -> Result<Vec<Event>, DbError> {
        let rows = self
            .rows(
                &self.sql.claim,
                &[(&owner, Type::TEXT), (&batch, Type::INT4)],
            )
            .await?;
        rows.iter()
            .map(Event::from_row)
            .collect::<Result<_, _>>()
            .map_err(|source| DbError::Row {
                call: "outbox_claim",
                source,
            })
    }

    /// `outbox_ack_returning`: SENDING → SUCCESS for the ids still held; returns those it settled.
    pub async fn ack(&self, owner: &str, token: i64, ids: &[i64]) -> Result<Vec<i64>, DbError> {
        let rows = self
            .rows(
                &self.sql.ack,
                &[
                    (&owner, Type::TEXT),
                    (&token, Type::INT8),
                    (&ids, Type::INT8_ARRAY),
                ],
            )
            .await?;
        rows.iter()
            .map(|r| r.try_get("id"))
            .collect::<Result<_, _>>()
            .map_err(|source| DbError::Row {
                call: "outbox_ack_returning",
                source,
            })
    }

    /// `outbox_nack_returning`: one failed attempt (with `error` as last_error) for the ids still
    /// held; returns each settled row with its new state.
    pub async fn nack(
        &self,
        owner: &str,
        token: i64,
        ids: &[i64],
        error: &str,
    ) -> Result<Vec<Nacked>, DbError> {
        let rows = self
            .rows(
                &self.sql.nack,
                &[
                    (&owner, Type::TEXT),
                    (&token, Type::INT8),
                    (&ids, Type::INT8_ARRAY),
                    (&error, Type::TEXT),
                ],
            )
            .await?;
        rows.iter()
            .map(Nacked::from_row)
            .collect::<Result<_, _>>()
            .map_err(|source| DbError::Row {
                call: "outbox_nack_returning",
                source,
            })
    }

    /// `outbox_release`: the ids still held go back to WAIT, due after `delay`, with `error` as
    /// last_error and **no attempt counted** (the broker failed, not the event); returns how many.
    pub async fn release(
        &self,
        owner: &str,
        token: i64,
        ids: &[i64],
        delay: Duration,
        error: &str,
    ) -> Result<u64, DbError> {
        let delay = format!("{} milliseconds", delay.as_millis());
        self.count(
            &self.sql.release,
            "released",
            "outbox_release",
            &[
                (&owner, Type::TEXT),
                (&token, Type::INT8),
                (&ids, Type::INT8_ARRAY),
                (&delay, Type::TEXT),
                (&error, Type::TEXT),
            ],
        )
        .await
    }

    /// `outbox_release_orphans`: what `owner` holds under tokens other than `keep` goes back to
    /// WAIT without an attempt counted; returns how many.
    pub async fn release_orphans(&self, owner: &str, keep: &[i64]) -> Result<u64, DbError> {
        self.count(
            &self.sql.release_orphans,
            "released",
            "outbox_release_orphans",
            &[(&owner, Type::TEXT), (&keep, Type::INT8_ARRAY)],
        )
        .await
    }

    /// `outbox_reclaim_returning(lease)`: expired claims back to WAIT (or FAIL); returns each.
    pub async fn reclaim(&self, lease: Duration) -> Result<Vec<Reclaimed>, DbError> {
        let lease = format!("{} milliseconds", lease.as_millis());
        let rows = self
            .rows(&self.sql.reclaim, &[(&lease, Type::TEXT)])
            .await?;
        rows.iter()
            .map(Reclaimed::from_row)
            .collect::<Result<_, _>>()
            .map_err(|source| DbError::Row {
                call: "outbox_reclaim_returning",
                source,
            })
    }

    /// `outbox_heartbeat(owner, timeout, previous)`: this owner is alive until the returned time,
    /// now + `timeout` (zero: it stops, and what it still holds may be reclaimed now). With the
    /// expiry of this process's last beat as `previous`, another process's beat since is 55006.
    pub async fn heartbeat(
        &self,
        owner: &str,
        timeout: Duration,
        previous: Option<SystemTime>,
    ) -> Result<SystemTime, DbError> {
        let timeout = format!("{} milliseconds", timeout.as_millis());
        let row = self
            .row(
                &self.sql.heartbeat,
                &[
                    (&owner, Type::TEXT),
                    (&timeout, Type::TEXT),
                    (&previous, Type::TIMESTAMPTZ),
                ],
            )
            .await?;
        row.try_get("expires_at").map_err(|source| DbError::Row {
            call: "outbox_heartbeat",
            source,
        })
    }

    /// `outbox_stats()`.
    pub async fn stats(&self) -> Result<Stats, DbError> {
        let row = self.row(&self.sql.stats, &[]).await?;
        Stats::from_row(&row).map_err(|source| DbError::Row {
            call: "outbox_stats",
            source,
        })
    }

    /// Runs a settle-style call and reads its int result.
    async fn count(
        &self,
        sql: &str,
        column: &str,
        call: &'static str,
        params: Params<'_>,
    ) -> Result<u64, DbError> {
        let row = self.row(sql, params).await?;
        row_count(&row, column, call)
    }
}

/// An extension function's int result (a row count, never negative).
fn row_count(row: &Row, column: &str, call: &'static str) -> Result<u64, DbError> {
    let n: i32 = row
        .try_get(column)
        .map_err(|source| DbError::Row { call, source })?;
    Ok(u64::try_from(n).unwrap_or(0))
}
