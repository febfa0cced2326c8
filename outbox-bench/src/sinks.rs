//! Drain rate per sink (issue 33): the broker section's drain (same backlog, the relay's default
//! flags, first claim to last ack) against every sink the relay publishes to. One run is noise on
//! a shared machine: the sinks alternate over rounds and each is judged by its median round.
//! Written to its own report: `scripts/bench --only sinks` (reports/sinks/drain.md).

use anyhow::{bail, Result};
use serde_json::{json, Value};

use outbox_tests::nats::{self, Nats};
use outbox_tests::rocketmq::{self, RocketMq};
use outbox_tests::sinks::TestSink;
use outbox_worker::defaults::CONCURRENCY;

use crate::broker_drain::{self, BrokerDrain, DRAIN_TOPIC};
use crate::relay_env::{RelayEnv, SinkTarget};
use crate::report::{median, num, Table};
use crate::results::{broker_run, Results};
use crate::Profile;

/// One sink's rounds.
struct SinkRuns {
    name: &'static str,
    runs: Vec<BrokerDrain>,
}

impl SinkRuns {
    fn rates(&self) -> Vec<f64> {
        self.runs.iter().map(BrokerDrain::rate).collect()
    }

    /// The round with the median rate (the lower middle one of an even count).
    fn median_run(&self) -> &BrokerDrain {
        let mut by_rate: Vec<&BrokerDrain> = self.runs.iter().collect();
        by_rate.sort_by(|a, b| a.rate().total_cmp(&b.rate()));
        by_rate[(by_rate.len() - 1) / 2]
    }
}

/// The sinks besides Kafka (the environment's own), each started here on free loopback ports,
/// with the drain's topic (RocketMQ's JVMs only when the profile has it: they take seconds).
fn other_sinks(p: &Profile) -> Result<Vec<TestSink>> {
    let bin = nats::server_bin();
    if !bin.exists() {
        bail!(
            "{} not found: scripts/nats install builds it",
            bin.display()
        );
    }
    let mut sinks = vec![TestSink::Nats(Nats::start())];
    if p.sink_rocketmq {
        let libs = rocketmq::home().join("libs");
        if !libs.is_dir() {
            bail!(
                "{} not found: scripts/rocketmq install fetches it",
                libs.display()
            );
        }
        sinks.push(TestSink::RocketMq(RocketMq::start()));
    }
    for s in &sinks {
        s.create_topic(DRAIN_TOPIC);
    }
    Ok(sinks)
}

pub async fn run(p: &Profile, env: &RelayEnv<'_>, r: &mut Results) -> Result<()> {
    let others = other_sinks(p)?;
    // The environment's target is Kafka, with the run's relay flags.
    let mut targets = vec![env.sink.clone()];
    targets.extend(others.iter().map(SinkTarget::of));
    let mut sinks: Vec<SinkRuns> = targets
        .iter()
        .map(|t| SinkRuns {
            name: t.name,
            runs: Vec::new(),
        })
        .collect();
    for round in 0..p.sink_rounds {
        // Every other round runs the sinks backwards, so a drift of the machine over the run
        // does not always favour the same one.
        let mut order: Vec<usize> = (0..targets.len()).collect();
        if round % 2 == 1 {
            order.reverse();
        }
        for i in order {
            let t = &targets[i];
            progress!("  round {}/{}: {}", round + 1, p.sink_rounds, t.name);
            let sink_env = RelayEnv { sink: t, ..*env };
            let tag = format!("sinks-{}-{round}", t.name.replace(' ', "-"));
            let run = broker_drain::drain(
                &sink_env,
                p.broker_backlog,
                p.broker_cap,
                CONCURRENCY,
                &[],
                &tag,
            )
            .await?;
            if !run.complete {
                r.failures.push(format!(
                    "drain to {}: not complete within {:?}",
                    t.name, p.broker_cap
                ));
            }
            sinks[i].runs.push(run);
        }
    }
    env.monitor
        .batch_execute(crate::db::TRUNCATE_OUTBOX)
        .await?;
    r.sinks_md = Some(render(p, &sinks));
    r.sinks = Some(to_json(p, &sinks));
    Ok(())
}

fn render(p: &Profile, sinks: &[SinkRuns]) -> String {
    let mut s = format!(
        "`outbox-worker run` ({}, default flags: {CONCURRENCY} claim loop) against a fresh \
         backlog of {} unordered events per round, as the drain to the broker of \
         [BENCHMARKS.md](../BENCHMARKS.md) measures Kafka: events/s from the rows' own timestamps \
         (first claim to last ack), so relay start-up is excluded. Each broker runs on this \
         machine, on loopback: Kafka single-node (KRaft, {} partitions), NATS JetStream one \
         server (`scripts/nats`, file store, one stream), Apache RocketMQ {} a name server and a \
         broker with its gRPC proxy in one JVM (`scripts/rocketmq`, a FIFO topic of {} queues; \
         not in the smoke profile). The sinks alternate over {} round(s) (every other round \
         backwards); a sink's figure is its median round, whose CPU is shown.\n\n",
        outbox_tests::relay::relay_build(),
        num(p.broker_backlog as f64),
        outbox_tests::broker::PARTITIONS,
        rocketmq::version(),
        rocketmq::QUEUES,
        p.sink_rounds
    );
    let mut t = Table::new(&[
        "sink",
        "events/s (median)",
        "events/s per round",
        "CPU µs/event DB / relay / broker",
        "host CPU busy (other load)",
    ]);
    for sink in sinks {
        let m = sink.median_run();
        let per_event = |secs: f64| format!("{:.1}", secs * 1e6 / m.drained.max(1) as f64);
        t.row(vec![
            sink.name.to_string(),
            num(median(&sink.rates())),
            sink.rates()
                .iter()
                .map(|&x| num(x))
                .collect::<Vec<_>>()
                .join(", "),
            format!(
                "{} / {} / {}",
                m.db_cpu_secs.map_or("n/a".into(), per_event),
                per_event(m.relay_cpu_secs),
                per_event(m.broker_cpu_secs)
            ),
            format!("{:.0} % ({:.0} %)", m.host_busy_pct, m.other_pct),
        ]);
    }
    s += &t.render();
    s
}

fn to_json(p: &Profile, sinks: &[SinkRuns]) -> Value {
    json!({
        "backlog": p.broker_backlog,
        "claim_loops": CONCURRENCY,
        "rounds": p.sink_rounds,
        "sinks": sinks.iter().map(|s| json!({
            "sink": s.name,
            "median_events_per_sec": median(&s.rates()),
            "runs": s.runs.iter().map(broker_run).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
    })
}
