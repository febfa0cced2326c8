//! The fault runner (issue 4): the whole input set against the whole output set, under hard kills.
//!
//! Producers commit E events in transactions of random size (a share rolled back, a few with a
//! poison topic that does not exist on the broker) while K `outbox-worker` processes relay them to
//! a local Apache Kafka broker. Meanwhile the runner injects faults:
//! - SIGKILL of a random worker every `kill_every`, restarted at once under a new owner name;
//! - a zombie: SIGSTOP of a worker holding claims; once its heartbeat ran out (or its lease
//!   expired) the runner reclaims its rows and keeps them open until it was SIGCONTed and its
//!   late acks met the fence;
//! - a broker outage: SIGSTOP of the broker for `outage` (longer than the send timeout), SIGCONT;
//! - a broker restart: SIGTERM of the broker while the workers keep running, then the same
//!   broker started again on the same ports and data (what it acknowledged must still be there);
//! - `pg_terminate_backend` of every worker connection (application_name = its owner name);
//! - ordered events the broker rejects: a key's head above its topic's `max.message.bytes`, then
//!   the limit raised (`reject.rs`).
//!
//! At the end it waits for quiescence (no WAIT or SENDING rows), stops the workers with SIGTERM,
//! reads every topic back and checks: lost = 0, phantoms = 0, no WAIT/SENDING rows, dead letters
//! = the poison events exactly, every turn to SUCCESS made by the claim's holder (the ack audit),
//! no relay exit the runner did not cause, exit 0 on SIGTERM, every message's topic and payload
//! match its event, per key first arrivals in commit order. Duplicates are counted, attributed to a
//! cause where the final row tells it (a reclaim after a kill or of the zombie, a publish that
//! failed after the broker had stored it), and held to a budget the faults explain
//! (`analysis::duplicate_budget`).
//!
//! Modules: `profile` (sizes, schedule, seed), `producer`, `runner` and `zombie` (the faults),
//! `audit` (who acked what), `scrape` (what each relay counted, from its /metrics), `analysis`
//! (read back and compare), `report` (printing, verdict).

mod analysis;
mod audit;
pub mod doc;
mod producer;
mod profile;
mod reject;
mod report;
mod runner;
mod scrape;
mod zombie;

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::broker::Broker;
use crate::db::{connect, TestDb};

pub use profile::{clock_seed, seed_from_env, Profile, Rng};
pub use report::{Report, ZombieResult};

use analysis::{analyse, read_topic};
use producer::{produce, Produced};
use runner::Runner;

/// Topics the events go to; the poison topic is never created on the broker.
pub const TOPICS: [&str; 2] = ["orders", "payments"];
pub const POISON_TOPIC: &str = "poison-missing";

/// Runs one profile end to end and returns its report (the caller prints it and checks `ok()`).
pub fn run(p: &Profile) -> Report {
    let wall = Instant::now();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let db = TestDb::create();
    // Every event has a key (`k-` || n % 97) and keeps its key's order, except the poison topic's:
    // its events die on purpose, and under the default head-of-line policy (block) the later
    // ones of a key would wait behind the first dead one instead of dying too.
    db.psql(&format!(
        "ALTER DATABASE {0} SET outbox.max_retry = {1}; \
         ALTER DATABASE {0} SET outbox.backoff_base = '{2}ms'; \
         ALTER DATABASE {0} SET outbox.backoff_max = '{3}ms'; \
         ALTER DATABASE {0} SET outbox.unordered_topics = '{POISON_TOPIC}'",
        db.name,
        p.max_retry,
        p.backoff_base.as_millis(),
        p.backoff_max.as_millis()
    ));
    db.psql(audit::INSTALL);
    let runner_url = format!("{} application_name=fault-runner", db.url());
    let admin = rt.block_on(async { connect(&runner_url).await });
    let broker = Broker::start();
    for t in TOPICS {
        broker.create_topic(t);
    }
    broker.create_topic_with(
        reject::LIMITED_TOPIC,
        &[("max.message.bytes", reject::REJECTING_LIMIT)],
    );
    let port = broker.port;
    let mut r = Runner {
        p,
        rt: &rt,
        db_url: db.url(),
        admin,
        broker: Some(broker),
        port,
        slots: Vec::new(),
        rng: Rng::new(p.seed),
        start: Instant::now(),
        report: Report {
            profile: p.name.clone(),
            seed: p.seed,
            workers: p.workers,
            ..Default::default()
        },
        killed_owners: HashSet::new(),
        zombie_owner: None,
        last_scrape: Instant::now(),
    };
    eprintln!(
        "[fault] profile {} seed {}: K={} E={} on {}",
        p.name, p.seed, p.workers, p.events, db.name
    );
    for i in 0..p.workers {
        let s = r.spawn(i, 0);
        r.slots.push(s);
    }

    // Producers.
    let shared = Arc::new(Mutex::new(Produced::default()));
    r.start = Instant::now();
    let mut handles = Vec::new();
    for me in 0..p.producers {
        let target = p.events / p.producers + usize::from(me < p.events % p.producers);
        let poison = p.poison_txs / p.producers + usize::from(me < p.poison_txs % p.producers);
        handles.push(rt.spawn(produce(
            runner_url.clone(),
            p.clone(),
            me,
            target,
            poison,
            shared.clone(),
        )));
    }

    // Faults.
    #[derive(Debug)]
    enum F {
        Zombie,
        Outage,
        Restart,
        Terminate,
        Reject,
    }
    let mut schedule: Vec<(Duration, F)> = Vec::new();
    if let Some(t) = p.zombie_at {
        schedule.push((t, F::Zombie));
    }
    if let Some(t) = p.outage_at {
        schedule.push((t, F::Outage));
    }
    if let Some(t) = p.restart_at {
        schedule.push((t, F::Restart));
    }
    for t in &p.terminate_at {
        schedule.push((*t, F::Terminate));
    }
    if let Some(t) = p.reject_at {
        schedule.push((t, F::Reject));
    }
    schedule.sort_by_key(|s| s.0);
    schedule.reverse();
    let mut next_kill = p.kill_every;
    let mut produce_time = None;
    loop {
        r.reap();
        r.scrape_all();
        let now = r.start.elapsed();
        let (done, err) = {
            let s = shared.lock().expect("produced");
            (s.done == p.producers, s.error.clone())
        };
        if let Some(e) = err {
            panic!("producer failed: {e}");
        }
        if done && produce_time.is_none() {
            produce_time = Some(now);
            r.log("producers done".to_string());
        }
        if schedule.last().is_some_and(|s| s.0 <= now) {
            let (_, f) = schedule.pop().expect("fault");
            match f {
                F::Zombie => r.zombie(),
                F::Outage => r.outage(),
                F::Restart => r.restart_broker(),
                F::Terminate => r.terminate_connections(),
                F::Reject => r.reject(&shared),
            }
            continue;
        }
        if now >= next_kill {
            r.kill_one();
            next_kill = now + p.kill_every;
            continue;
        }
        if done && schedule.is_empty() && r.report.kills >= p.min_kills {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let produce_time = produce_time.unwrap_or_else(|| r.start.elapsed());
    for h in handles {
        let _ = rt.block_on(h);
    }

    // Quiescence: nothing WAIT or SENDING (poison rows end FAIL).
    let deadline = Instant::now() + p.quiesce_timeout;
    loop {
        r.reap();
        r.scrape_all();
        let open = r.query_i64(
            "SELECT count(*) FROM outbox_event WHERE status IN ('WAIT', 'SENDING')",
            &[],
        );
        if open == 0 {
            break;
        }
        if Instant::now() > deadline {
            r.report.notes.push(format!(
                "quiescence not reached within {} s: {open} rows open",
                p.quiesce_timeout.as_secs()
            ));
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let drain_time = r.start.elapsed();
    r.log("quiescent: no WAIT or SENDING rows".to_string());

    // Graceful stop, after a last look at what each relay counted.
    for i in 0..r.slots.len() {
        r.scrape(i);
    }
    for s in &r.slots {
        s.worker.signal(libc::SIGTERM);
    }
    for s in &mut r.slots {
        match s.worker.wait_exit(Duration::from_secs(20)) {
            Some(st) if st.success() => {}
            other => r
                .report
                .sigterm_exit_failures
                .push(format!("{} {other:?}", s.owner)),
        }
    }

    for i in 0..r.slots.len() {
        r.harvest(i);
    }

    // Read everything back.
    let addr = format!("127.0.0.1:{}", r.port);
    let mut seen = Vec::new();
    let topics = TOPICS
        .iter()
        .enumerate()
        .map(|(i, t)| (*t, i as u8))
        .chain([(reject::LIMITED_TOPIC, reject::TOPIC_INDEX)]);
    for (topic, index) in topics {
        read_topic(&addr, topic, index, &mut seen)
            .unwrap_or_else(|e| panic!("reading {topic} back: {e}"));
    }

    let produced = std::mem::take(&mut *shared.lock().expect("produced"));
    r.report.produce_time = produce_time;
    r.report.drain_time = drain_time;
    analyse(&mut r, &produced, seen);
    audit::check(&mut r);
    r.report.wall_time = wall.elapsed();
    drop(r.slots);
    let report = r.report;
    drop(r.broker);
    drop(db);
    report
}
