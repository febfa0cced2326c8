//! `outbox-worker run`: start-up checks, the claim loops, the reclaimer, the stats poller and the
//! wake-up session as tasks, and shutdown.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::breaker::{probe_loop, Breaker};
use crate::claim::{claim_loop, Relay};
use crate::cli::RunArgs;
use crate::cli::SinkKind;
use crate::error::DbError;
use crate::health::Health;
use crate::kafka_metrics::{librdkafka_build, KafkaMetrics};
use crate::maintenance::{
    broker_watch, heartbeat_loop, owner_taken, reclaim_loop, stats_loop, taken_over,
};
use crate::metrics::{self, Metrics};
use crate::nats::NatsSink;
use crate::publisher::Publisher;
use crate::rocketmq::RocketMqSink;
use crate::sink::{self, Sink};
use crate::store::{Settings, Store};
use crate::tasks::Tasks;
use crate::unknown::UnknownErrors;
use crate::{broker_tls, db, defaults};
use crate::{shutdown, wakeup, Fatal};

/// hostname-pid-random
pub fn default_owner() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname NUL-terminates on success.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    let host = if rc == 0 {
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        String::from_utf8_lossy(&buf[..end]).into_owned()
    } else {
        "unknown".to_string()
    };
    let host: String = host.chars().filter(|c| !c.is_control()).take(150).collect();
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    format!("{host}-{}-{:08x}", std::process::id(), h.finish() as u32)
}

/// `outbox-worker run`: one database (`--database-url`), or every database of `--config`
/// (`fleet.rs`).
pub async fn run(args: RunArgs) -> Result<(), Fatal> {
    if args.db.config.is_some() {
        return crate::fleet::run(args).await;
    }
    args.validate()?;
    // Signals from here on stop the relay cleanly (exit 0), even during start-up.
    let metrics = Metrics::new(Health::new(
        args.concurrency,
        args.live_timeout(),
        args.sink.broker_name(),
    ));
    let cancel = CancellationToken::new();
    let m = metrics.clone();
    shutdown::spawn_signal_handler(cancel.clone(), move || m.health.set_stopping());
    shutdown::spawn_deadline(cancel.clone(), args.shutdown_timeout);
    shutdown::ignore_hangup();
    let props = args.producer_properties()?;
    let db = Database::open(&args).await?;
    broker_tls::check(&args.kafka.brokers, &props, args.send_timeout).await?;
    // Created after the database checks: librdkafka starts connecting at once.
    let publisher = shared_publisher(&args, &props, &metrics.registry).await?;
    let server = Server::start(args.metrics_addr, metrics.clone()).await?;
    let result = db.serve(&args, metrics, publisher.clone(), cancel).await;
    publisher.flush().await;
    let result = server.stop(result).await;
    if result.is_ok() {
        tracing::info!("relay stopped: in-flight events settled");
    }
    result
}

/// The sink all databases' claim loops share (`--sink`), its client's statistics in `registry`.
pub async fn shared_publisher(
    args: &RunArgs,
    props: &[(String, String)],
    registry: &prometheus::Registry,
) -> Result<Arc<dyn Sink>, Fatal> {
    match args.sink {
        SinkKind::Nats => {
            return Ok(Arc::new(
                NatsSink::connect(&args.nats, args.send_timeout).await?,
            ))
        }
        SinkKind::Rocketmq => {
            return Ok(Arc::new(RocketMqSink::new(
                &args.rocketmq,
                args.send_timeout,
            )?))
        }
        SinkKind::Kafka => {}
    }
    let kafka_metrics = Arc::new(KafkaMetrics::register(registry));
    let publisher = Publisher::new(
        &args.kafka.brokers,
        args.send_timeout,
        props,
        usize::from(args.kafka_connections),
        kafka_metrics,
    )?;
    let (rdkafka_version, rdkafka_features) = librdkafka_build();
    tracing::info!(
        version = env!("CARGO_PKG_VERSION"),
        librdkafka = %rdkafka_version,
        features = %rdkafka_features,
        "librdkafka build"
    );
    Ok(Arc::new(publisher))
}

/// The metrics and health endpoints, when `--metrics-addr` is set.
pub struct Server {
    task: Option<tokio::task::JoinHandle<()>>,
    cancel: CancellationToken,
}

impl Server {
    pub async fn start(
        addr: Option<std::net::SocketAddr>,
        status: Arc<dyn metrics::Status>,
    ) -> Result<Server, Fatal> {
        let cancel = CancellationToken::new();
        let task = match addr {
            Some(addr) => Some(metrics::serve(addr, status, cancel.clone()).await?),
            None => None,
        };
        Ok(Server { task, cancel })
    }

    /// Stops serving; a server failure becomes the result unless the relay failed already.
    pub async fn stop(self, result: Result<(), Fatal>) -> Result<(), Fatal> {
        self.cancel.cancel();
        let Some(Err(e)) = (match self.task {
            Some(t) => Some(t.await),
            None => None,
        }) else {
            return result;
        };
        let f = Fatal::runtime(format!("metrics server: {e}"));
        match result {
            Ok(()) => Err(f),
            Err(first) => {
                tracing::error!("{}", f.message);
                Err(first)
            }
        }
    }
}

/// A database the relay checked at start-up: its pool, its address for the wake-up session and
/// `outbox.max_retry`.
pub struct Database {
    store: Store,
    target: db::Target,
    max_retry: i32,
}

impl Database {
    /// Connects, checks the extension and the settings against the flags.
    pub async fn open(args: &RunArgs) -> Result<Database, Fatal> {
        let mut target = db::config(&args.db)?;
        target.share_between_hosts(args.pool_timeout());
        let asked_timeout = db::set_statement_timeout(&mut target.cfg, args.statement_timeout());
        // One connection per claim loop, one for the reclaimer, one for the stats poller, and
        // one for the heartbeat: a beat never waits behind a round.
        let store = Store::open(
            target.clone(),
            args.concurrency + 3,
            args.pool_timeout(),
            args.call_timeout(),
        )
        .await?;
        let Settings {
            max_retry,
            max_claim,
            statement_timeout,
        } = read_settings(&store).await?;
        check_statement_timeout(asked_timeout, statement_timeout);
        if let Some(max_claim) = max_claim.filter(|m| args.batch_size > *m) {
            return Err(Fatal::usage(format!(
                "--batch-size {} is above the database's outbox.max_claim ({max_claim})",
                args.batch_size
            )));
        }
        Ok(Database {
            store,
            target,
            max_retry,
        })
    }

    /// Runs the claim loops, the reclaimer, the stats poller and the wake-up session until
    /// `cancel` (or a task's failure, which fires it); then settles and stops.
    pub async fn serve(
        self,
        args: &RunArgs,
        metrics: Arc<Metrics>,
        publisher: Arc<dyn Sink>,
        cancel: CancellationToken,
    ) -> Result<(), Fatal> {
        let owner = args.owner.clone().unwrap_or_else(default_owner);
        log_start(args, &owner, &self);
        let probe = sink::probe(publisher.clone());
        let m = metrics.clone();
        tokio::spawn(async move { m.health.set_broker_reachable(probe.await) }.in_current_span());
        let (rounds_tx, rounds_rx) = watch::channel(0usize);
        let relay = Arc::new(Relay {
            store: self.store,
            publisher: publisher.clone(),
            breaker: Arc::new(Breaker::new()),
            metrics: metrics.clone(),
            owner,
            batch_size: args.batch_size,
            poll_interval: args.poll_interval,
            claim_cooldown: args.claim_cooldown,
            lease: args.lease,
            rounds: rounds_tx,
            wake: Default::default(),
            unknown: UnknownErrors::new(defaults::UNKNOWN_ERROR_GRACE),
            held: Default::default(),
            claiming: Default::default(),
        });

        let beats = Beats::start(&relay, args, &cancel).await?;
        let mut tasks = Tasks::new(cancel.clone());
        let waiter = wakeup::run(
            self.target,
            relay.store.schema().to_string(),
            relay.wake.clone(),
            wakeup::Rounds {
                done: rounds_rx,
                full: args.batch_size as usize,
                loops: args.concurrency,
            },
            cancel.clone(),
        );
        tasks.spawn("wake-up session", async move {
            waiter.await;
            Ok(())
        });
        spawn_loops(&mut tasks, &relay, args, &cancel);

        // Until a signal, or a task's failure, cancels them all; either way every claim loop
        // settles its round before it stops.
        let result = tasks.join().await;
        // Taken over: what the owner holds is the other relay's now, left as it is.
        let beating = beats.stop().await?;
        settle_leftovers(&relay, beating).await?;
        result
    }
}

/// The heartbeat loop of a database's owner, when heartbeats are on.
struct Beats {
    task: Option<JoinHandle<Result<Option<SystemTime>, Fatal>>>,
    cancel: CancellationToken,
}

/// Whether the relay beat, and the expiry of its last beat when known.
enum Beating {
    Off,
    On(Option<SystemTime>),
}

impl Beats {
    /// The first beat before the first claim, so that every claim is covered; a relay that may
    /// not beat or release (no EXECUTE) stops here with one line rather than at that moment. A
    /// beat of the loop finding the owner taken over fires `stop`.
    async fn start(
        relay: &Arc<Relay>,
        args: &RunArgs,
        stop: &CancellationToken,
    ) -> Result<Beats, Fatal> {
        let first = first_beat(relay, args.heartbeat_timeout()).await?;
        call_at_start(
            &relay.store,
            "release_orphans",
            "; grant it to the relay's role (sql/examples/grant-roles.sql)",
            || relay.store.release_orphans(&relay.owner, &[]),
        )
        .await?;
        let cancel = CancellationToken::new();
        let task = first.map(|(timeout, last)| {
            let beats = heartbeat_loop(
                relay.clone(),
                timeout,
                Some(last),
                cancel.clone(),
                stop.clone(),
            );
            tokio::spawn(beats.in_current_span())
        });
        Ok(Beats { task, cancel })
    }

    /// Stops beating (after the rounds have ended); Err when another relay took the owner over.
    async fn stop(self) -> Result<Beating, Fatal> {
        self.cancel.cancel();
        let Some(task) = self.task else {
            return Ok(Beating::Off);
        };
        match task.await {
            Ok(last) => last.map(Beating::On),
            Err(_) => Ok(Beating::On(None)),
        }
    }
}

/// The reclaimer, the broker prober and watch, the stats poller and the claim loops.
fn spawn_loops(tasks: &mut Tasks, relay: &Arc<Relay>, args: &RunArgs, cancel: &CancellationToken) {
    let every = args.reclaim_interval;
    tasks.spawn(
        "reclaimer",
        reclaim_loop(relay.clone(), args.lease, every, cancel.clone()),
    );
    tasks.spawn(
        "broker prober",
        probe_loop(
            relay.breaker.clone(),
            relay.publisher.clone(),
            args.send_timeout,
            relay.metrics.clone(),
            cancel.clone(),
        ),
    );
    tasks.spawn(
        "stats poller",
        stats_loop(relay.clone(), args.stats_interval, cancel.clone()),
    );
    tasks.spawn(
        "broker watch",
        broker_watch(
            relay.publisher.clone(),
            relay.breaker.clone(),
            relay.metrics.clone(),
            args.stats_interval,
            args.send_timeout,
            cancel.clone(),
        ),
    );
    for n in 0..args.concurrency {
        tasks.spawn(
            format!("claim loop {n}"),
            claim_loop(n, relay.clone(), cancel.clone()),
        );
    }
}

/// After the rounds: the last beat says this relay stops, then what no round settled is released
/// (outbox_release_orphans) rather than left to the lease; nothing when the owner was taken over.
/// (Past the shutdown deadline the process exits without this; its beats then run out.)
async fn settle_leftovers(relay: &Relay, beating: Beating) -> Result<(), Fatal> {
    if let Beating::On(last) = beating {
        match relay
            .store
            .heartbeat(&relay.owner, Duration::ZERO, last)
            .await
        {
            Ok(_) => {}
            Err(e) if owner_taken(&e) => return Err(taken_over(&relay.owner, &e)),
            Err(e) => tracing::warn!("could not say this relay stops (outbox_heartbeat): {e}"),
        }
    }
    match relay.store.release_orphans(&relay.owner, &[]).await {
        Ok(0) => {}
        Ok(n) => tracing::info!(released = n, "released the claims no round settled"),
        Err(e) => tracing::warn!("could not release the claims no round settled: {e}"),
    }
    Ok(())
}

/// The address of the broker `--sink` names.
fn broker_address(args: &RunArgs) -> &str {
    match args.sink {
        SinkKind::Kafka => &args.kafka.brokers,
        SinkKind::Nats => &args.nats.nats_url,
        SinkKind::Rocketmq => &args.rocketmq.rocketmq_proxy,
    }
}

fn log_start(args: &RunArgs, owner: &str, db: &Database) {
    tracing::info!(
        owner = %owner,
        database_address = %db.store.desc(),
        sink = ?args.sink,
        brokers = %broker_address(args),
        batch_size = args.batch_size,
        concurrency = args.concurrency,
        poll_interval = %humantime::format_duration(args.poll_interval),
        claim_cooldown = %humantime::format_duration(args.claim_cooldown),
        lease = %humantime::format_duration(args.lease),
        heartbeat_timeout = %humantime::format_duration(args.heartbeat_timeout()),
        send_timeout = %humantime::format_duration(args.send_timeout),
        statement_timeout = %humantime::format_duration(args.statement_timeout()),
        max_retry = db.max_retry,
        "relay started"
    );
}

/// The first heartbeat, which takes the owner over from any earlier process: the timeout to keep
/// beating with and the beat's expiry; None when heartbeats are off.
async fn first_beat(
    relay: &Relay,
    timeout: Duration,
) -> Result<Option<(Duration, SystemTime)>, Fatal> {
    if timeout.is_zero() {
        return Ok(None);
    }
    let expires_at = call_at_start(
        &relay.store,
        "heartbeat",
        "; grant it to the relay's role (sql/examples/grant-roles.sql) or run with --heartbeat-timeout 0",
        || relay.store.heartbeat(&relay.owner, timeout, None),
    )
    .await?;
    Ok(Some((timeout, expires_at)))
}

/// Warns when the sessions do not have the statement_timeout their startup options asked for: a
/// pooler dropped the options (PgBouncer's ignore_startup_parameters). Only the client-side bound
/// of each call is left then.
fn check_statement_timeout(asked: Option<Duration>, got: Duration) {
    let Some(asked) = asked.filter(|a| a.as_millis() != got.as_millis()) else {
        return;
    };
    tracing::warn!(
        asked = %humantime::format_duration(asked),
        got = %humantime::format_duration(got),
        "the database sessions do not have the statement_timeout the relay asked for (a pooler \
         ignored the startup options?): set it on the relay's role instead (ALTER ROLE … SET \
         statement_timeout)"
    );
}

/// `outbox.max_retry`, `outbox.max_claim` and the session's statement_timeout.
async fn read_settings(store: &Store) -> Result<Settings, Fatal> {
    call_at_start(store, "stats", "", || store.settings()).await
}

/// A call to `outbox_<func>` that the start depends on. Retried: a connection terminated right at
/// start-up (failover, pg_terminate_backend) is no reason to exit; a configuration error (e.g. no
/// EXECUTE) is not retried, and ends the start with one line (`hint` appended).
async fn call_at_start<T, F, Fut>(
    store: &Store,
    func: &str,
    hint: &str,
    call: F,
) -> Result<T, Fatal>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<T, DbError>>,
{
    let mut attempt = 0;
    loop {
        attempt += 1;
        let e = match call().await {
            Ok(v) => return Ok(v),
            Err(e) => e,
        };
        let message = match &e {
            DbError::Connect(c) => {
                format!("cannot connect to the database ({}): {c}", store.desc())
            }
            _ => format!("cannot call {}() ({}): {e}", store.func(func), store.desc()),
        };
        if !e.is_retriable() {
            return Err(Fatal::usage(format!("{message}{hint}")));
        }
        if attempt >= 3 {
            return Err(Fatal::runtime(message));
        }
        tracing::warn!("{message}; retrying");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_owner_is_host_pid_random() {
        let o = default_owner();
        assert!(o.contains(&format!("-{}-", std::process::id())), "{o}");
        assert!(o.len() <= 200 && !o.chars().any(char::is_control));
        assert_ne!(o, default_owner());
    }
}
