//! One run: the selected sections in order, then the report.

use anyhow::{Context, Result};
use std::path::Path;
use std::time::Instant;

use outbox_tests::broker::{free_port, Broker};
use outbox_tests::db::TestDb;

use crate::db::BenchDb;
use crate::relay_env::{RelayEnv, SinkTarget};
use crate::results::{self, Results};
use crate::{
    broker_drain, contention, enqueue, fairness, goals, health, held_snapshot, hot_key, idle,
    inbox, indexes, latency, lifecycle, null_sink, ordering, polling, report, seed, sinks, sys,
};
use crate::{Args, Profile, Section};

pub async fn run(args: &Args, p: &Profile, db: &TestDb, workdir: &Path) -> Result<Vec<String>> {
    let t_start = Instant::now();
    let want = |s: Section| args.wants(s);
    let monitor = db.client().await?;
    let load_start = outbox_tests::provenance::loadavg();
    let mut r = Results::default();

    if want(Section::Enqueue) {
        progress!("==> 1. enqueue cost: producer throughput, CPU per row, bulk");
        r.enqueue = Some(enqueue::run(db, p).await?);
    }
    if want(Section::Drain) {
        progress!("==> 2. null-sink drain matrix");
        null_sink::run(p, db, &monitor, &mut r).await?;
    }
    if want(Section::Health) || want(Section::Drain) {
        let drained = null_sink::headline(p, db, &monitor, &mut r).await?;
        health::run(&monitor, drained, &mut r).await?;
    }
    if want(Section::Contention) {
        progress!("==> 4. claim contention");
        contention::run(p, db, &monitor, &mut r).await?;
    }
    if want(Section::Seed) {
        progress!("==> 5. seed design baseline");
        seed::run(p, db, &monitor, &mut r).await?;
    }
    // Before the broker starts: these two measure the database alone.
    if want(Section::Lifecycle) {
        lifecycle::run(p, db, &mut r).await?;
    }
    if want(Section::HeldSnapshot) {
        held_snapshot::run(p, db, &mut r).await?;
    }
    if want(Section::Inbox) {
        inbox::run(p, db, &mut r).await?;
    }

    let mut broker_version = "not used".to_string();
    let mut relay_version = "not used".to_string();
    let broker_wanted = want(Section::Broker)
        || want(Section::Latency)
        || want(Section::Idle)
        || want(Section::Ordering)
        || want(Section::Fairness)
        || want(Section::Sinks);
    if !args.no_broker && broker_wanted {
        let relay_bin = outbox_tests::relay::find_relay_bin();
        if let Ok(bin) = &relay_bin {
            relay_version = sys::command_line(bin, &["--version"])
                .unwrap_or_else(|| format!("{} (no --version)", bin.display()));
        }
        broker_version = sys::kafka_version();
        let sections = match relay_bin {
            Ok(bin) => broker_sections(args, p, db, &monitor, workdir, &bin, &mut r).await,
            Err(e) => Err(anyhow::anyhow!(e)),
        };
        match sections {
            Ok(()) => {}
            Err(e) => {
                let msg = format!("broker/relay benchmarks: {e:#}");
                eprintln!("outbox-bench: {msg}");
                r.broker_note = Some(msg.clone());
                r.failures.push(msg);
            }
        }
    } else if args.no_broker {
        r.broker_note = Some("skipped (`--no-broker`)".into());
    }

    if want(Section::Ordering) {
        hot_key::run(p, db, &mut r).await?;
    }
    if want(Section::Indexes) {
        indexes::run(p, &db.server, &mut r).await?;
    }

    let env = sys::environment(p, db, &load_start, &broker_version, &relay_version)
        .await
        .unwrap_or_else(|e| format!("(could not query the environment: {e:#})\n"));
    let goals = goals::goals(&r);
    let took = t_start.elapsed();
    let own = match args.own_report() {
        Some(Section::Indexes) => Some((
            "Index comparison: partial vs composite",
            "indexes",
            r.indexes_md.as_deref(),
            "INDEXES.json",
        )),
        Some(Section::Sinks) => Some((
            "Drain rate per sink",
            "sinks",
            r.sinks_md.as_deref(),
            "drain.json",
        )),
        Some(_) => Some((
            "Fairness between the databases of one relay",
            "fairness",
            r.fairness_md.as_deref(),
            "FAIRNESS.json",
        )),
        None => None,
    };
    let md = match own {
        Some(o) => report::render_own(p, &r, o, &env, took),
        None => {
            let readme = report::readme_link(args.output.as_deref());
            report::render(p, &r, &goals, &env, took, &args.flags(), &readme)
        }
    };
    println!("{md}");
    if let Some(out) = &args.output {
        std::fs::write(out, &md).with_context(|| format!("writing {}", out.display()))?;
        progress!("==> report written to {}", out.display());
    }
    let secs = took.as_secs_f64();
    let json = match args.own_report() {
        Some(Section::Indexes) => results::section_json(p, "indexes", &r.indexes, &r, secs),
        Some(Section::Sinks) => results::section_json(p, "sinks", &r.sinks, &r, secs),
        Some(_) => results::section_json(p, "fairness", &r.fairness, &r, secs),
        None => results::to_json(p, &r, &goals, secs),
    };
    if let Some(out) = args.json_path() {
        let text = serde_json::to_string_pretty(&json)?;
        std::fs::write(&out, text + "\n").with_context(|| format!("writing {}", out.display()))?;
        progress!("==> figures written to {}", out.display());
    }
    Ok(r.failures)
}

async fn broker_sections(
    args: &Args,
    p: &Profile,
    db: &TestDb,
    monitor: &tokio_postgres::Client,
    workdir: &Path,
    relay_bin: &Path,
    r: &mut Results,
) -> Result<()> {
    let want = |s: Section| args.wants(s);
    let broker = Broker::try_start_in(&workdir.join("kafka"), free_port(), None)
        .map_err(anyhow::Error::msg)?;
    broker
        .try_create_topic(broker_drain::DRAIN_TOPIC)
        .map_err(anyhow::Error::msg)?;
    if want(Section::Ordering) {
        broker
            .try_create_topic(ordering::TOPIC)
            .map_err(anyhow::Error::msg)?;
    }
    let mut kafka = SinkTarget::kafka(&broker);
    if let Some(n) = args.kafka_connections {
        kafka
            .args
            .extend(["--kafka-connections".into(), n.to_string()]);
    }
    let env = RelayEnv {
        db,
        monitor,
        broker: &broker,
        sink: &kafka,
        relay_bin,
        workdir,
    };
    if want(Section::Broker) {
        progress!("==> 2. drain to the broker through the relay");
        broker_drain::run(p, &env, r).await?;
    }
    // Throwaway servers without and with shared_preload_libraries: the polling-mode rows and
    // their control.
    let mut throwaway = Vec::new();
    if want(Section::Latency) || want(Section::Idle) {
        for (server, preload) in [
            (latency::POLLING_SERVER, false),
            (latency::PRELOADED_SERVER, true),
        ] {
            progress!("==> starting a {server}");
            match polling::PollingServer::start(preload).await {
                Ok(s) => throwaway.push((server, s)),
                Err(e) => {
                    let msg = format!("rows of the {server} skipped: {e:#}");
                    eprintln!("outbox-bench: {msg}");
                    r.failures.push(msg);
                }
            }
        }
    }
    {
        let throwaway_envs: Vec<(&'static str, RelayEnv)> = throwaway
            .iter()
            .map(|(server, s)| {
                (
                    *server,
                    RelayEnv {
                        db: &s.db,
                        monitor: &s.monitor,
                        broker: &broker,
                        sink: &kafka,
                        relay_bin,
                        workdir,
                    },
                )
            })
            .collect();
        if want(Section::Latency) {
            progress!("==> 3. commit-to-broker latency");
            latency::run(p, &env, r).await?;
            for (server, te) in &throwaway_envs {
                progress!("==> 3. commit-to-broker latency, {server}");
                latency::run_throwaway(p, te, r, server).await?;
            }
        }
        if want(Section::Idle) {
            progress!("==> 8. idle relay cost");
            let mut envs = vec![(latency::MAIN_SERVER, &env)];
            envs.extend(throwaway_envs.iter().map(|(s, e)| (*s, e)));
            idle::run(p, &envs, r).await?;
        }
    }
    // The throwaway servers stop here, before the ordering section's drains.
    drop(throwaway);
    if want(Section::Ordering) {
        progress!("==> 7. per-key order: ordered vs unordered drain to the broker");
        ordering::run_drains(p, &env, r).await?;
    }
    if want(Section::Fairness) {
        progress!("==> fairness: two databases on one relay, one with a backlog");
        fairness::run(p, &env, r).await?;
    }
    if want(Section::Sinks) {
        progress!("==> drain rate per sink");
        sinks::run(p, &env, r).await?;
    }
    Ok(())
}
