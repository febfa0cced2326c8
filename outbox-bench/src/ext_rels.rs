//! The extension's own tables in a database, found from the catalog rather than named (a release
//! may add or split tables): their partitions, indexes, sizes and dead tuples.

use anyhow::Result;
use serde_json::{json, Value};
use tokio_postgres::Client;

/// The tables that belong to extension `outbox` (`pg_depend`, deptype `e`) and, recursively, their
/// partitions or inheritance children, as `oid` rows of a CTE named `t`.
const EXT_TABLES: &str = "WITH RECURSIVE t AS (
        SELECT c.oid FROM pg_depend d JOIN pg_class c ON c.oid = d.objid
         WHERE d.classid = 'pg_class'::regclass AND d.refclassid = 'pg_extension'::regclass
           AND d.refobjid = (SELECT oid FROM pg_extension WHERE extname = 'outbox')
           AND d.deptype = 'e' AND c.relkind IN ('r', 'p')
        UNION
        SELECT i.inhrelid FROM pg_inherits i JOIN t ON i.inhparent = t.oid)";

/// One table of the extension at one moment.
#[derive(Clone)]
pub struct TableStat {
    pub name: String,
    /// `pg_table_size`: heap, TOAST, free space and visibility maps.
    pub heap: i64,
    /// `pg_indexes_size`.
    pub indexes: i64,
    pub live: i64,
    pub dead: i64,
    pub autovacuums: i64,
    pub autoanalyzes: i64,
}

/// The extension's tables and each of their indexes (`pg_relation_size`), by name.
#[derive(Clone)]
pub struct ExtRels {
    pub tables: Vec<TableStat>,
    pub indexes: Vec<(String, i64)>,
}

impl ExtRels {
    pub fn total(&self) -> i64 {
        self.tables.iter().map(|t| t.heap + t.indexes).sum()
    }
    pub fn heap(&self) -> i64 {
        self.tables.iter().map(|t| t.heap).sum()
    }
    pub fn index(&self) -> i64 {
        self.tables.iter().map(|t| t.indexes).sum()
    }
    pub fn autovacuum_runs(&self) -> i64 {
        self.tables
            .iter()
            .map(|t| t.autovacuums + t.autoanalyzes)
            .sum()
    }
    pub fn index_size(&self, name: &str) -> Option<i64> {
        self.indexes.iter().find(|(n, _)| n == name).map(|x| x.1)
    }

    pub fn json(&self) -> Value {
        json!({
            "tables": self.tables.iter().map(|t| json!({
                "name": t.name,
                "heap_bytes": t.heap,
                "index_bytes": t.indexes,
                "live_tuples": t.live,
                "dead_tuples": t.dead,
                "autovacuum_count": t.autovacuums,
                "autoanalyze_count": t.autoanalyzes,
            })).collect::<Vec<_>>(),
            "index_bytes": self.indexes.iter().map(|(n, b)| (n.clone(), json!(b))).collect::<serde_json::Map<_, _>>(),
        })
    }
}

/// Sizes now, and the cumulative statistics as this session's snapshot sees them: other sessions
/// report theirs at most about once a second while busy, so `n_dead_tup` may lag by that much.
pub async fn snapshot(c: &Client) -> Result<ExtRels> {
    c.batch_execute("SELECT pg_stat_clear_snapshot()").await?;
    let tables = c
        .query(
            &format!(
                "{EXT_TABLES}
                 SELECT t.oid::regclass::text, pg_table_size(t.oid), pg_indexes_size(t.oid),
                        coalesce(s.n_live_tup, 0), coalesce(s.n_dead_tup, 0),
                        coalesce(s.autovacuum_count, 0), coalesce(s.autoanalyze_count, 0)
                   FROM t LEFT JOIN pg_stat_user_tables s ON s.relid = t.oid
                  ORDER BY 1"
            ),
            &[],
        )
        .await?
        .iter()
        .map(|r| TableStat {
            name: r.get(0),
            heap: r.get(1),
            indexes: r.get(2),
            live: r.get(3),
            dead: r.get(4),
            autovacuums: r.get(5),
            autoanalyzes: r.get(6),
        })
        .collect();
    let indexes = c
        .query(
            &format!(
                "{EXT_TABLES}
                 SELECT i.indexrelid::regclass::text, pg_relation_size(i.indexrelid)
                   FROM pg_index i JOIN t ON t.oid = i.indrelid
                  ORDER BY 1"
            ),
            &[],
        )
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    Ok(ExtRels { tables, indexes })
}

/// The extension's tables as a comma-separated list for VACUUM or ANALYZE.
pub async fn table_list(c: &Client) -> Result<String> {
    let names: Vec<String> = c
        .query(
            &format!("{EXT_TABLES} SELECT t.oid::regclass::text FROM t ORDER BY 1"),
            &[],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    Ok(names.join(", "))
}
