//! `outbox-worker run --config FILE`: one relay process for every database of the config file.
//! The metrics server is shared, and the Kafka producer for databases with `producer = "shared"`;
//! each database has its own producer by default, pool, claim loops, heartbeat owner, circuit breaker, wake-up session and metrics (label `database`), and
//! runs in a span naming it. A database that fails (unreachable at start, a revoked grant) is
//! started again with a backoff while the others go on. SIGHUP re-reads the file: removed
//! databases stop after settling their rounds, added ones start, changed ones restart.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prometheus::Registry;
use tokio::signal::unix::{signal, SignalKind};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::cli::RunArgs;
use crate::config::{self, DatabaseConfig, Producer};
use crate::health::Health;
use crate::metrics::{render_all, Metrics, Status};
use crate::relay::{shared_publisher, Database, Server};
use crate::sink::Sink;
use crate::{shutdown, Fatal};

/// First wait before a failed database is started again; it doubles up to [`RESTART_MAX`].
const RESTART_MIN: Duration = Duration::from_secs(1);
const RESTART_MAX: Duration = Duration::from_secs(60);

/// The databases' metrics and health, as the endpoints read them.
#[derive(Default)]
pub struct Fleet {
    /// Shared series (the producer's librdkafka statistics).
    registry: Registry,
    databases: Mutex<BTreeMap<String, Arc<Metrics>>>,
    stopping: AtomicBool,
}

impl Fleet {
    fn add(&self, name: &str, args: &RunArgs) -> Arc<Metrics> {
        let label = HashMap::from([("database".to_string(), name.to_string())]);
        let registry = Registry::new_custom(None, Some(label)).expect("valid label");
        let health = Health::new(
            args.concurrency,
            args.live_timeout(),
            args.sink.broker_name(),
        );
        let m = Metrics::in_registry(health, registry);
        let mut dbs = self.databases.lock().expect("databases");
        dbs.insert(name.to_string(), m.clone());
        m
    }

    fn remove(&self, name: &str) {
        self.databases.lock().expect("databases").remove(name);
    }

    /// `check` of every database: the failures, each naming its database.
    fn failures(&self, check: impl Fn(&Metrics) -> Result<(), String>) -> (usize, Vec<String>) {
        let dbs = self.databases.lock().expect("databases");
        let bad = dbs
            .iter()
            .filter_map(|(name, m)| check(m).err().map(|why| format!("database {name}: {why}")))
            .collect();
        (dbs.len(), bad)
    }

    /// Ready while at least one database is: a relay with one bad database keeps serving the
    /// others, so it stays in service; the body names the bad ones.
    fn some_ok(&self, check: impl Fn(&Metrics) -> Result<(), String>) -> Result<String, String> {
        if self.stopping.load(Ordering::Relaxed) {
            return Err("stopping".into());
        }
        match self.failures(check) {
            (_, bad) if bad.is_empty() => Ok("ok\n".into()),
            (all, bad) if bad.len() < all => Ok(format!("ok, degraded: {}\n", bad.join("; "))),
            (_, bad) => Err(bad.join("; ")),
        }
    }
}

impl Status for Fleet {
    fn render(&self) -> String {
        let dbs = self.databases.lock().expect("databases");
        let mut registries = vec![&self.registry];
        registries.extend(dbs.values().map(|m| &m.registry));
        render_all(&registries)
    }
    /// Not live once any database's claim loop is stuck: only a restart helps that.
    fn live(&self) -> Result<(), String> {
        match self.failures(|m| m.health.live()).1 {
            bad if bad.is_empty() => Ok(()),
            bad => Err(bad.join("; ")),
        }
    }
    fn ready(&self) -> Result<String, String> {
        self.some_ok(|m| m.health.ready())
    }
    fn health(&self) -> Result<(), String> {
        self.some_ok(Status::health).map(|_| ())
    }
}

/// Each database's table and the flags it runs with.
type Plan = BTreeMap<String, (DatabaseConfig, RunArgs)>;

/// Reads the file and checks every database's flags (a bad one fails the whole file).
fn plan(base: &RunArgs) -> Result<Plan, Fatal> {
    let path = base.db.config.as_deref().expect("--config");
    let file = config::load(path)?;
    let mut plan = Plan::new();
    for (name, db) in file.databases {
        let args = db.run_args(&name, base)?;
        args.producer_properties()
            .map_err(|e| Fatal::usage(format!("database {name}: {}", e.message)))?;
        plan.insert(name, (db, args));
    }
    Ok(plan)
}

/// A running database: its table (to see a change at reload) and how to stop it.
struct Member {
    config: DatabaseConfig,
    cancel: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

/// What every database shares.
#[derive(Clone)]
struct Shared {
    publisher: Arc<dyn Sink>,
    fleet: Arc<Fleet>,
    cancel: CancellationToken,
}

pub async fn run(base: RunArgs) -> Result<(), Fatal> {
    if base.db.database.is_some() {
        return Err(Fatal::usage(
            "--database picks the database of an operator command; run serves every database of --config",
        ));
    }
    if base.db.database_url.is_some() || base.db.database_url_file.is_some() {
        return Err(Fatal::usage(
            "give either --config or --database-url (--database-url-file), not both",
        ));
    }
    base.validate()?;
    let props = base.producer_properties()?;
    let first = plan(&base)?;
    crate::broker_tls::check(&base.kafka.brokers, &props, base.send_timeout).await?;
    let fleet = Arc::new(Fleet::default());
    let cancel = CancellationToken::new();
    let f = fleet.clone();
    shutdown::spawn_signal_handler(cancel.clone(), move || {
        f.stopping.store(true, Ordering::Relaxed)
    });
    shutdown::spawn_deadline(cancel.clone(), base.shutdown_timeout);
    let mut hup = signal(SignalKind::hangup()).expect("SIGHUP handler");
    let shared = Shared {
        publisher: shared_publisher(&base, &props, &fleet.registry).await?,
        fleet: fleet.clone(),
        cancel: cancel.clone(),
    };
    let server = Server::start(base.metrics_addr, fleet).await?;
    let mut members = BTreeMap::new();
    apply(&mut members, first, &shared).await;
    loop {
        tokio::select! {
            _ = cancel.cancelled() => break,
            _ = hup.recv() => match plan(&base) {
                Ok(p) => apply(&mut members, p, &shared).await,
                Err(e) => tracing::error!("config reload refused, the databases run on unchanged: {}", e.message),
            },
        }
    }
    for (_, m) in members {
        let _ = m.task.await;
    }
    shared.publisher.flush().await;
    let result = server.stop(Ok(())).await;
    if result.is_ok() {
        tracing::info!("relay stopped: in-flight events settled");
    }
    result
}

/// Stops the databases that left the plan or changed (their rounds settle first), then starts
/// the new and changed ones.
async fn apply(members: &mut BTreeMap<String, Member>, plan: Plan, shared: &Shared) {
    let gone: Vec<String> = members
        .iter()
        .filter(|(name, m)| plan.get(*name).is_none_or(|(c, _)| *c != m.config))
        .map(|(name, _)| name.clone())
        .collect();
    for name in gone {
        let m = members.remove(&name).expect("member");
        m.cancel.cancel();
        let _ = m.task.await;
        tracing::info!(database = %name, "database stopped: its claims settled or released");
    }
    for (name, (config, args)) in plan {
        if members.contains_key(&name) {
            continue;
        }
        let cancel = shared.cancel.child_token();
        let span = tracing::info_span!("db", database = %name);
        let own = config.producer == Producer::Own;
        let task = tokio::spawn(
            supervise(name.clone(), args, own, shared.clone(), cancel.clone()).instrument(span),
        );
        members.insert(
            name,
            Member {
                config,
                cancel,
                task,
            },
        );
    }
}

/// Runs one database until `cancel`, starting it again (after a growing pause) whenever it
/// fails; the other databases never wait for it.
async fn supervise(
    name: String,
    args: RunArgs,
    own_producer: bool,
    shared: Shared,
    cancel: CancellationToken,
) {
    let metrics = shared.fleet.add(&name, &args);
    let own = match own_producer {
        false => Ok(shared.publisher.clone()),
        true => match args.producer_properties() {
            Ok(props) => shared_publisher(&args, &props, &metrics.registry).await,
            Err(e) => Err(e),
        },
    };
    let publisher = match own {
        Ok(p) => p,
        Err(e) => return not_started(&name, &e, &metrics, &shared.fleet, &cancel).await,
    };
    let mut backoff = RESTART_MIN;
    while !cancel.is_cancelled() {
        let started = Instant::now();
        let result = match Database::open(&args).await {
            Ok(db) => {
                metrics.health.db_result(true);
                let run = cancel.child_token();
                db.serve(&args, metrics.clone(), publisher.clone(), run)
                    .await
            }
            Err(e) => Err(e),
        };
        if cancel.is_cancelled() {
            break;
        }
        if started.elapsed() > RESTART_MAX {
            backoff = RESTART_MIN;
        }
        let why = result.err().map_or("stopped".to_string(), |f| f.message);
        metrics.health.db_result(false);
        tracing::error!(
            "database {name} failed: {why}; starting it again in {}",
            humantime::format_duration(backoff)
        );
        pause(&metrics, backoff, &cancel).await;
        backoff = (backoff * 2).min(RESTART_MAX);
    }
    if own_producer {
        publisher.flush().await;
    }
    shared.fleet.remove(&name);
}

/// A database whose own producer could not be built: shown unready until removed or stopped.
async fn not_started(
    name: &str,
    e: &Fatal,
    metrics: &Metrics,
    fleet: &Fleet,
    cancel: &CancellationToken,
) {
    tracing::error!("database {name} not started: {}", e.message);
    metrics.health.db_result(false);
    while !cancel.is_cancelled() {
        pause(metrics, RESTART_MAX, cancel).await;
    }
    fleet.remove(name);
}

/// Waits `d` (or until `cancel`), counting as rounds for /live: the wait is on purpose.
async fn pause(metrics: &Metrics, d: Duration, cancel: &CancellationToken) {
    let end = tokio::time::Instant::now() + d;
    while tokio::time::Instant::now() < end {
        metrics.health.all_rounds_completed();
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep_until(end.min(tokio::time::Instant::now() + RESTART_MIN)) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn args() -> RunArgs {
        match crate::cli::Cli::try_parse_from(["outbox-worker", "run"])
            .expect("parse")
            .command
        {
            crate::cli::Command::Run(a) => a,
            _ => unreachable!(),
        }
    }

    #[test]
    fn ready_while_one_database_is_and_names_the_others() {
        let fleet = Fleet::default();
        let (a, b) = (fleet.add("a", &args()), fleet.add("b", &args()));
        for m in [&a, &b] {
            m.health.set_broker_reachable(true);
        }
        assert_eq!(fleet.ready(), Ok("ok\n".to_string()));
        b.health.db_result(false);
        assert_eq!(
            fleet.ready(),
            Ok("ok, degraded: database b: database unreachable\n".to_string())
        );
        a.health.db_result(false);
        assert_eq!(
            fleet.ready(),
            Err("database a: database unreachable; database b: database unreachable".into())
        );
        a.health.db_result(true);
        fleet.stopping.store(true, Ordering::Relaxed);
        assert_eq!(fleet.ready(), Err("stopping".into()));
    }

    #[test]
    fn every_series_carries_its_database_under_one_family() {
        let fleet = Fleet::default();
        for name in ["a", "b"] {
            fleet.add(name, &args()).backlog.set(7);
        }
        let text = fleet.render();
        assert_eq!(
            text.matches("# TYPE outbox_backlog_events gauge").count(),
            1
        );
        assert!(
            text.contains("outbox_backlog_events{database=\"a\"} 7"),
            "{text}"
        );
        assert!(
            text.contains("outbox_backlog_events{database=\"b\"} 7"),
            "{text}"
        );
        fleet.remove("a");
        assert!(!fleet.render().contains("database=\"a\""));
    }
}
