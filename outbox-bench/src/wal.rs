//! WAL written between two points: the server-wide distance between insert positions, and, with
//! contrib's `pg_walinspect`, the records that belong to one database (by record type, with their
//! full-page images), so that other work on the same server does not count.

use anyhow::Result;
use std::collections::BTreeMap;
use std::time::Duration;
use tokio_postgres::Client;

/// WAL records of one kind (`resource manager/record type`) in a span.
#[derive(Clone, Default)]
pub struct Kind {
    pub count: i64,
    /// Whole records, full-page images included (`record_length`).
    pub bytes: i64,
    pub fpi: i64,
}

/// The WAL between two insert positions.
#[derive(Clone, Default)]
pub struct Span {
    /// Server-wide: `pg_wal_lsn_diff(end, start)` (every database, page headers and alignment).
    pub lsn_bytes: i64,
    /// The records of the measured database by kind; None when `pg_walinspect` is unavailable or
    /// could no longer read the span.
    pub kinds: Option<BTreeMap<String, Kind>>,
}

impl Span {
    /// The database's record bytes when known, else the server-wide distance.
    pub fn bytes(&self) -> i64 {
        match &self.kinds {
            Some(k) => k.values().map(|x| x.bytes).sum(),
            None => self.lsn_bytes,
        }
    }
    pub fn fpi(&self) -> Option<i64> {
        self.kinds.as_ref().map(|k| k.values().map(|x| x.fpi).sum())
    }
    pub fn add(&mut self, other: &Span) {
        self.lsn_bytes += other.lsn_bytes;
        self.kinds = match (self.kinds.take(), &other.kinds) {
            (Some(mut a), Some(b)) => {
                for (k, v) in b {
                    let e = a.entry(k.clone()).or_default();
                    e.count += v.count;
                    e.bytes += v.bytes;
                    e.fpi += v.fpi;
                }
                Some(a)
            }
            _ => None,
        };
    }
}

/// Reads WAL positions and, when it can, attributes records to a database. Runs its queries on its
/// own session, in a database where `CREATE EXTENSION pg_walinspect` succeeded (any database of
/// the server: WAL is server-wide).
pub struct WalMeter {
    c: Client,
    /// Why records cannot be attributed, if they cannot.
    pub unavailable: Option<String>,
}

impl WalMeter {
    pub async fn new(c: Client) -> Result<WalMeter> {
        let unavailable = match c
            .batch_execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
            .await
        {
            Ok(()) => {
                // A span's records are held in a tuplestore; keep it in memory.
                c.batch_execute("SET work_mem = '256MB'").await?;
                None
            }
            Err(e) => Some(format!("CREATE EXTENSION pg_walinspect failed: {e}")),
        };
        Ok(WalMeter { c, unavailable })
    }

    pub async fn lsn(&self) -> Result<String> {
        Ok(self
            .c
            .query_one("SELECT pg_current_wal_insert_lsn()::text", &[])
            .await?
            .get(0))
    }

    /// The WAL from `start` to `end` (positions from [`WalMeter::lsn`]); records are those with a
    /// block in database `dboid`, plus every record (commits) of a transaction that wrote one.
    /// WAL that the server no longer has (a checkpoint recycled it) leaves `kinds` empty and
    /// `note` says so.
    pub async fn span(
        &self,
        start: &str,
        end: &str,
        dboid: u32,
        notes: &mut Vec<String>,
    ) -> Result<Span> {
        let lsn_bytes: i64 = self
            .c
            .query_one(
                "SELECT pg_wal_lsn_diff($2::text::pg_lsn, $1::text::pg_lsn)::bigint",
                &[&start, &end],
            )
            .await?
            .get(0);
        let mut span = Span {
            lsn_bytes,
            kinds: None,
        };
        if self.unavailable.is_some() {
            return Ok(span);
        }
        // pg_walinspect reads only flushed WAL, and the walwriter leaves a partial page unflushed
        // until some commit asks for it: commit a transaction with an xid here (synchronously),
        // whose flush covers `end`; its record comes after `end` and in another database.
        self.c.batch_execute("SELECT txid_current()").await?;
        for _ in 0..100 {
            let flushed: bool = self
                .c
                .query_one(
                    "SELECT pg_current_wal_flush_lsn() >= $1::text::pg_lsn",
                    &[&end],
                )
                .await?
                .get(0);
            if flushed {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let pattern = format!("%/{dboid}/%");
        let rows = self
            .c
            .query(
                "WITH r AS MATERIALIZED (
                     SELECT xid::text AS xid, resource_manager || '/' || record_type AS kind,
                            record_length::bigint AS len, fpi_length::bigint AS fpi,
                            coalesce(block_ref, '') LIKE $3 AS here
                       FROM pg_get_wal_records_info($1::text::pg_lsn, $2::text::pg_lsn)),
                 mine AS (SELECT DISTINCT xid FROM r WHERE here AND xid <> '0')
                 SELECT kind, count(*), sum(len)::bigint, sum(fpi)::bigint
                   FROM r WHERE here OR xid IN (SELECT xid FROM mine)
                  GROUP BY kind",
                &[&start, &end, &pattern],
            )
            .await;
        match rows {
            Ok(rows) => {
                span.kinds = Some(
                    rows.iter()
                        .map(|r| {
                            (
                                r.get::<_, String>(0),
                                Kind {
                                    count: r.get(1),
                                    bytes: r.get(2),
                                    fpi: r.get(3),
                                },
                            )
                        })
                        .collect(),
                );
            }
            Err(e) => {
                let why = e
                    .as_db_error()
                    .map(|d| d.message().to_string())
                    .unwrap_or_else(|| e.to_string());
                notes.push(format!(
                    "pg_walinspect could not read the WAL from {start} to {end} ({why}); the \
                     server-wide distance is used for that phase"
                ));
            }
        }
        Ok(span)
    }

    /// Keeps the server from removing WAL from now on (a checkpoint elsewhere on the server would
    /// otherwise recycle the segments of a span before it is read): a temporary physical
    /// replication slot of this session, reserved at once, until [`WalMeter::release_wal`].
    /// Returns why not, if it cannot.
    pub async fn hold_wal(&self) -> Result<Option<String>> {
        if self.unavailable.is_some() {
            return Ok(None);
        }
        let r = self
            .c
            .query_one(
                "SELECT pg_create_physical_replication_slot($1, true, true)::text",
                &[&self.slot_name()],
            )
            .await;
        Ok(r.err().map(|e| {
            let why = e
                .as_db_error()
                .map(|d| d.message().to_string())
                .unwrap_or_else(|| e.to_string());
            format!("WAL could not be held with a temporary replication slot ({why})")
        }))
    }

    pub async fn release_wal(&self) -> Result<()> {
        self.c
            .execute(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots
                  WHERE slot_name = $1",
                &[&self.slot_name()],
            )
            .await?;
        Ok(())
    }

    fn slot_name(&self) -> String {
        format!("outbox_bench_wal_{}", std::process::id())
    }

    /// `CHECKPOINT`: the next change of each page writes a full-page image again.
    pub async fn checkpoint(&self) -> Result<()> {
        self.c.batch_execute("CHECKPOINT").await?;
        Ok(())
    }
}

/// The OID of the database a session is connected to.
pub async fn dboid(c: &Client) -> Result<u32> {
    Ok(c.query_one(
        "SELECT oid FROM pg_database WHERE datname = current_database()",
        &[],
    )
    .await?
    .get(0))
}
