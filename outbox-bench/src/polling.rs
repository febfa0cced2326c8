//! Throwaway servers (`PgCluster`): one without `shared_preload_libraries`, where `outbox_wait`
//! polls the queue (mode `polling`, as on managed PostgreSQL), and one with it (mode `commit`) as a
//! control: the same fresh server in both modes, apart from the main server, which other work
//! shares.

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
    /// test clusters turn off; with `preload`, `shared_preload_libraries = 'outbox'`) and a bench
    /// database with the installed extension.
    pub async fn start(preload: bool) -> Result<PollingServer> {
        let conf = if preload {
            "fsync = on\nshared_preload_libraries = 'outbox'"
        } else {
            "fsync = on"
        };
        let (pg, db) = tokio::task::spawn_blocking(move || {
            let pg = PgCluster::start(conf, &[]);
            let db = TestDb::create_on(
                &format!("host=127.0.0.1 port={} user=postgres", pg.port),
                "outbox_bench_poll",
            );
            (pg, db)
        })
        .await
        .map_err(|e| anyhow!("starting a throwaway server (preload {preload}): {e}"))?;
        let monitor = db.client().await?;
        Ok(PollingServer {
            monitor,
            db,
            _pg: pg,
        })
    }
}
