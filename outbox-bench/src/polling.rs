//! The throwaway server without `shared_preload_libraries` (`PgCluster`): where `outbox_wait`
//! polls the queue (mode `polling`, as on managed PostgreSQL), for the latency and idle rows of
//! that mode.

use anyhow::{anyhow, Result};
use tokio_postgres::Client;

use outbox_tests::db::TestDb;
use outbox_tests::pg_cluster::PgCluster;

use crate::db::BenchDb;

/// Fields drop in order: the session, the database, then the server.
pub struct PollingServer {
    pub monitor: Client,
    pub db: TestDb,
    _pg: PgCluster,
}

impl PollingServer {
    /// initdb + start (as the `postgres` OS user; `fsync = on` like the main server, which the
    /// test clusters turn off) and a bench database with the installed extension.
    pub async fn start() -> Result<PollingServer> {
        let (pg, db) = tokio::task::spawn_blocking(|| {
            let pg = PgCluster::start("fsync = on", &[]);
            let db = TestDb::create_on(
                &format!("host=127.0.0.1 port={} user=postgres", pg.port),
                "outbox_bench_poll",
            );
            (pg, db)
        })
        .await
        .map_err(|e| anyhow!("starting a server without shared_preload_libraries: {e}"))?;
        let monitor = db.client().await?;
        Ok(PollingServer {
            monitor,
            db,
            _pg: pg,
        })
    }
}
