//! Fairness between the databases of one relay (issue 32): one `run --config` relay serves two
//! databases; the steady one is offered a fixed rate, alone and while the other works off a large
//! backlog. Its commit-to-ack p99 beside the backlog should stay within 2× of alone. One run is
//! noise on a shared machine: the set-ups alternate over several rounds and the goal is judged
//! on the median of the rounds' ratios. Written to its own report: `scripts/bench --only fairness`.

use anyhow::{anyhow, Result};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::{Duration, Instant};
use tokio_postgres::Client;

use outbox_tests::db::TestDb;
use outbox_tests::relay::{write_config, ConfigDb};

use crate::db::{self, BenchDb};
use crate::latency::{latency, unix_us, LatencyRun, Offer, MAIN_SERVER};
use crate::relay_env::RelayEnv;
use crate::report::{median, ms, num, Table};
use crate::results::Results;
use crate::Profile;

const BACKLOG_TOPIC: &str = "bench.fair.backlog";
/// The goal: p99 beside the backlog at most this many times p99 alone.
pub const GOAL_RATIO: f64 = 2.0;

/// How the relays serve the two databases while the steady one is measured.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Setup {
    /// One relay over both databases, the other one empty.
    Alone,
    /// One relay, one producer shared by both databases (`producer = "shared"`).
    Shared,
    /// One relay, a producer per database (the default, `producer = "own"`).
    Own,
    /// A relay per database (the control: no sharing, same machine).
    Separate,
}

const SETUPS: [Setup; 4] = [Setup::Alone, Setup::Shared, Setup::Own, Setup::Separate];

impl Setup {
    fn tag(self) -> &'static str {
        match self {
            Setup::Alone => "alone",
            Setup::Shared => "shared",
            Setup::Own => "own",
            Setup::Separate => "separate",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Setup::Alone => "alone (one relay, the other database empty)",
            Setup::Shared => "beside the backlog, one relay, `producer = \"shared\"`",
            Setup::Own => "beside the backlog, one relay, a producer per database (default)",
            Setup::Separate => "beside the backlog, a relay each (control)",
        }
    }
}

/// One measured run of the steady database.
struct Side {
    run: LatencyRun,
    /// Commit→ack (µs) of the judged events: all of them alone, else those committed before the
    /// other database had nothing due (the overlap).
    judged: Vec<f64>,
    /// From the relay's start until the other database had nothing due or in flight.
    drained_in: Duration,
    /// Peak resident memory of the relay process(es), MiB, summed.
    peak_rss_mib: f64,
}

impl Side {
    fn p99(&self) -> f64 {
        quantile(&self.judged, 0.99)
    }
}

/// Every round's runs, per set-up (index of [`SETUPS`]).
struct Rounds(Vec<[Side; 4]>);

impl Rounds {
    fn of(&self, s: Setup) -> impl Iterator<Item = &Side> {
        let i = SETUPS.iter().position(|x| *x == s).expect("setup");
        self.0.iter().map(move |r| &r[i])
    }

    /// Per round: p99 of `s` / p99 alone in the same round.
    fn ratios(&self, s: Setup) -> Vec<f64> {
        self.of(s)
            .zip(self.of(Setup::Alone))
            .map(|(x, alone)| x.p99() / alone.p99())
            .collect()
    }

    /// Every round's judged events of `s` together.
    fn pooled(&self, s: Setup) -> Vec<f64> {
        self.of(s).flat_map(|x| x.judged.iter().copied()).collect()
    }
}

pub async fn run(p: &Profile, env: &RelayEnv<'_>, r: &mut Results) -> Result<()> {
    let steady = TestDb::create_on(&env.db.server, "outbox_bench");
    let monitor = steady.client().await?;
    let steady_env = RelayEnv {
        db: &steady,
        monitor: &monitor,
        ..*env
    };
    let configs = [
        fleet_config(env, &steady, "fairness.toml", &[]),
        fleet_config(
            env,
            &steady,
            "fairness-shared.toml",
            &["producer = \"shared\""],
        ),
    ];
    env.broker
        .try_create_topic(BACKLOG_TOPIC)
        .map_err(|e| anyhow!(e))?;
    let mut rounds = Rounds(Vec::new());
    for round in 0..p.fair_rounds {
        // Every other round runs the set-ups backwards, so a drift of the machine over the
        // run does not always favour the same one.
        let mut order = SETUPS;
        if round % 2 == 1 {
            order.reverse();
        }
        let mut sides: [Option<Side>; 4] = Default::default();
        for s in order {
            progress!("  round {}/{}: {}", round + 1, p.fair_rounds, s.tag());
            let side = side(p, (&steady_env, env), s, round, &configs).await?;
            let i = SETUPS.iter().position(|x| *x == s).expect("setup");
            sides[i] = Some(side);
        }
        rounds.0.push(sides.map(|s| s.expect("every setup ran")));
    }
    let judged = median(&rounds.ratios(Setup::Own));
    if judged > GOAL_RATIO {
        r.failures.push(format!(
            "fairness: median over {} rounds of commit-to-ack p99 beside the backlog is \
             {judged:.2}× alone (goal ≤ {GOAL_RATIO}×)",
            p.fair_rounds
        ));
    }
    r.fairness_md = Some(render(p, &rounds));
    r.fairness = Some(to_json(p, &rounds));
    Ok(())
}

/// The config file of a relay over both databases, `steady` (the steady one's extra lines).
fn fleet_config(env: &RelayEnv<'_>, steady_db: &TestDb, file: &str, steady: &[&str]) -> PathBuf {
    let path = env.workdir.join(file);
    let db = |name, url, extra| ConfigDb { name, url, extra };
    let dbs = [
        db("backlog", env.db.url(), &[][..]),
        db("steady", steady_db.url(), steady),
    ];
    write_config(&path, &dbs);
    path
}

async fn seed_backlog(p: &Profile, c: &Client) -> Result<()> {
    c.execute(
        "SELECT outbox_enqueue($1::text, jsonb_build_object('n', g)) \
         FROM generate_series(1, $2::bigint) g",
        &[&BACKLOG_TOPIC, &p.fair_backlog],
    )
    .await?;
    Ok(())
}

/// Empties the outbox, so that every run starts from the same table sizes. (Not outbox_purge:
/// after a drain of 200,000 events of one transaction it ran for minutes on CPU.)
async fn empty(c: &Client) -> Result<()> {
    c.batch_execute(db::TRUNCATE_OUTBOX).await?;
    Ok(())
}

/// The steady database offered `p.fair_rate` under set-up `s` (`configs`: the default, shared).
async fn side(
    p: &Profile,
    (steady, backlog_env): (&RelayEnv<'_>, &RelayEnv<'_>),
    s: Setup,
    round: usize,
    configs: &[PathBuf; 2],
) -> Result<Side> {
    let backlog = backlog_env.monitor;
    if s != Setup::Alone {
        seed_backlog(p, backlog).await?;
    }
    let log = format!("fairness-{}-{round}", s.tag());
    let relays = match s {
        Setup::Alone | Setup::Own => vec![steady.start_fleet(&configs[0], &log)?],
        Setup::Shared => vec![steady.start_fleet(&configs[1], &log)?],
        Setup::Separate => vec![
            steady.start_relay(&[], &log)?,
            backlog_env.start_relay(&[], &format!("{log}-backlog"))?,
        ],
    };
    let started = Instant::now();
    let topic = format!("bench.fair.{}.{round}", s.tag());
    let (run, drained) = tokio::join!(
        latency(
            steady,
            &relays[0],
            &topic,
            outbox_tests::broker::PARTITIONS,
            Offer::plain(p.fair_rate),
            p.fair_time.as_secs_f64(),
            Duration::from_secs(15),
            "fleet of two databases",
            MAIN_SERVER,
        ),
        drained(backlog, started)
    );
    let (run, (drained_in, drained_at)) = (run?, drained?);
    let judged = run
        .acks
        .iter()
        .filter(|(at, _)| s == Setup::Alone || *at < drained_at)
        .map(|(_, lat)| *lat)
        .collect();
    let peak_rss_mib = relays.iter().filter_map(|r| r.peak_rss_kib()).sum::<u64>() as f64 / 1024.0;
    for relay in relays {
        relay.stop()?;
    }
    empty(backlog).await?;
    empty(steady.monitor).await?;
    Ok(Side {
        run,
        judged,
        drained_in,
        peak_rss_mib,
    })
}

/// When the database had nothing due or claimed any more: counted from `since`, and as Unix µs.
async fn drained(c: &Client, since: Instant) -> Result<(Duration, f64)> {
    if !db::wait_drained(c, Duration::from_secs(600)).await? {
        return Err(anyhow!("the backlog did not drain within 10 minutes"));
    }
    Ok((since.elapsed(), unix_us()))
}

/// The `q` quantile of `xs` (nearest rank); NaN when empty.
fn quantile(xs: &[f64], q: f64) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

fn min_max(xs: &[f64]) -> (f64, f64) {
    let min = xs.iter().copied().fold(f64::INFINITY, f64::min);
    let max = xs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    (min, max)
}

fn to_json(p: &Profile, rounds: &Rounds) -> Value {
    let side = |x: &Side| {
        json!({
            "sent": x.run.sent, "achieved_rate": x.run.achieved_rate, "missing": x.run.missing,
            "commit_to_ack_us": x.run.commit_to_ack, "ack_source": x.run.ack_source,
            "judged_events": x.judged.len(), "judged_p99_us": x.p99(),
            "backlog_drained_secs": x.drained_in.as_secs_f64(),
            "relay_peak_rss_mib": x.peak_rss_mib,
        })
    };
    let setups: serde_json::Map<String, Value> = SETUPS
        .iter()
        .map(|&s| {
            let ratios = rounds.ratios(s);
            let pooled = rounds.pooled(s);
            let v = json!({
                "rounds": rounds.of(s).map(side).collect::<Vec<_>>(),
                "ratio_p99_per_round": ratios,
                "ratio_p99_median": median(&ratios),
                "pooled_p99_us": quantile(&pooled, 0.99),
                "pooled_ratio_p99": quantile(&pooled, 0.99)
                    / quantile(&rounds.pooled(Setup::Alone), 0.99),
            });
            (s.tag().to_string(), v)
        })
        .collect();
    json!({
        "rate": p.fair_rate, "backlog": p.fair_backlog, "rounds": p.fair_rounds,
        "window_secs": p.fair_time.as_secs_f64(), "goal_ratio": GOAL_RATIO,
        "ratio_p99_median": median(&rounds.ratios(Setup::Own)),
        "setups": setups,
    })
}

fn render(p: &Profile, rounds: &Rounds) -> String {
    let alone_pooled = quantile(&rounds.pooled(Setup::Alone), 0.99);
    let mut t = Table::new(&[
        "steady database",
        "events judged (all rounds)",
        "commit→ack p50 ms",
        "p99 ms (all rounds)",
        "p99 / alone, median of rounds",
        "min – max of rounds",
        "p99 / alone, all rounds pooled",
        "other database drained in s (median)",
        "relay peak RSS MiB (max)",
    ]);
    for s in SETUPS {
        let pooled = rounds.pooled(s);
        let ratios = rounds.ratios(s);
        let (lo, hi) = min_max(&ratios);
        let drained: Vec<f64> = rounds.of(s).map(|x| x.drained_in.as_secs_f64()).collect();
        let rss = rounds.of(s).map(|x| x.peak_rss_mib).fold(0.0, f64::max);
        t.row(vec![
            s.label().into(),
            num(pooled.len() as f64),
            ms(quantile(&pooled, 0.5)),
            ms(quantile(&pooled, 0.99)),
            format!("{:.2}×", median(&ratios)),
            format!("{lo:.2}× – {hi:.2}×"),
            format!("{:.2}×", quantile(&pooled, 0.99) / alone_pooled),
            match s {
                Setup::Alone => "no backlog".into(),
                _ => format!("{:.1}", median(&drained)),
            },
            format!("{rss:.1}"),
        ]);
    }
    let mut per_round = Table::new(&[
        "round",
        "order",
        "alone p99 ms",
        "shared p99 ms (events)",
        "own p99 ms (events)",
        "separate p99 ms (events)",
    ]);
    for (i, r) in rounds.0.iter().enumerate() {
        let mut cells = vec![
            (i + 1).to_string(),
            if i % 2 == 0 { "forward" } else { "backward" }.into(),
        ];
        cells.extend(
            r.iter()
                .map(|x| format!("{} ({})", ms(x.p99()), num(x.judged.len() as f64))),
        );
        per_round.row(cells);
    }
    let judged = median(&rounds.ratios(Setup::Own));
    format!(
        "One relay (`run --config`) serves two databases on the same server. The steady database \
         is offered {} single-event transactions per second for {:?}; beside, the other database \
         starts with a backlog of {} events. Each of {} rounds runs the four set-ups below \
         (forward, or backward every other round, so a drift of the machine does not favour one), \
         seeding the backlog before and emptying both databases after each run. A run's p99 \
         counts the steady events committed while the other database still had events due \
         (alone: all of them); its ratio is to the same round's p99 alone. The control runs a \
         relay per database: what is left of the slowdown there is the machine (database, broker \
         and relays on 2 cores), not the sharing. Commit→ack: {}.\n\n{}\n\
         **Default (a producer per database), median over {} rounds of p99 beside the backlog / \
         p99 alone: {judged:.2}×** (goal ≤ {GOAL_RATIO}×: {}).\n\nPer round (p99 ms of the judged events, \
         and how many):\n\n{}",
        num(p.fair_rate),
        p.fair_time,
        num(p.fair_backlog as f64),
        p.fair_rounds,
        rounds
            .of(Setup::Alone)
            .next()
            .map_or("", |x| x.run.ack_source),
        t.render(),
        p.fair_rounds,
        if judged <= GOAL_RATIO {
            "met"
        } else {
            "NOT met"
        },
        per_round.render(),
    )
}
