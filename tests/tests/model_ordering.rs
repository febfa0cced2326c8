//! Property test of per-key order against the real extension: random sequences of keyed enqueues
//! (several events per transaction, some rolled back; pairs whose later commit drew the lower
//! txid, as a producer waiting for the key's aggregate row does), claims by several owners, settles the way
//! the relay settles (ack the delivered, nack or release a failed event, release everything after
//! it in its key), late settles of claims that were reclaimed meanwhile (zombies), reclaims with an
//! expired lease, requeues and skips of dead letters, under both `outbox.head_of_line` policies.
//!
//! Checked at every claim: each event it returns has no earlier unfinished event of its key
//! (earlier = lower id: commit order for producers that take turns) except the ones before it in the
//! same claim; no two claims hold events of one key at once. At the end of a case everything
//! drains: every committed event is SUCCESS, the rolled-back ones never existed, and no key row is
//! left. Backoff and lease are a few milliseconds of real time, so a case needs no virtual clock.
//!
//! `OUTBOX_MODEL_CASES` (default 32) and `OUTBOX_MODEL_STEPS` (default 60) size the run.

use std::collections::{BTreeMap, BTreeSet};

use outbox_tests::db::{connect, TestDb};
use outbox_tests::model::env_usize;
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use tokio_postgres::Client;

const OWNERS: usize = 3;
const KEYS: u8 = 3;

#[derive(Debug, Clone)]
enum Op {
    Enqueue {
        key: u8,
        n: u8,
        rollback: bool,
    },
    /// A second producer draws its txid, then an event of the key commits, then the second
    /// producer enqueues for the key and commits: its event is later in commit order and in id
    /// order, earlier in txid order.
    EnqueueInverted {
        key: u8,
    },
    Claim {
        owner: usize,
        max: i32,
    },
    /// Settle an open claim as the relay would; `fail` picks the event whose publish failed.
    Settle {
        claim: Index,
        fail: Option<Index>,
        transient: bool,
    },
    Reclaim,
    Requeue,
    Skip,
    Pause,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..KEYS, 1..4u8, prop::bool::weighted(0.2))
            .prop_map(|(key, n, rollback)| Op::Enqueue { key, n, rollback }),
        2 => (0..KEYS).prop_map(|key| Op::EnqueueInverted { key }),
        4 => (0..OWNERS, 1..6i32).prop_map(|(owner, max)| Op::Claim { owner, max }),
        4 => (any::<Index>(), prop::option::weighted(0.4, any::<Index>()), any::<bool>())
            .prop_map(|(claim, fail, transient)| Op::Settle { claim, fail, transient }),
        1 => Just(Op::Reclaim),
        1 => Just(Op::Requeue),
        2 => Just(Op::Skip),
        1 => Just(Op::Pause),
    ]
}

/// An open claim: its owner, token and (id, key) rows in the order returned.
struct Claim {
    owner: usize,
    token: i64,
    rows: Vec<(i64, String)>,
}

type R<T> = Result<T, TestCaseError>;

fn pg<T>(what: &str, r: Result<T, tokio_postgres::Error>) -> R<T> {
    r.map_err(|e| TestCaseError::fail(format!("{what}: {e}")))
}

macro_rules! check {
    ($cond:expr, $($arg:tt)*) => {
        if !$cond {
            return Err(TestCaseError::fail(format!($($arg)*)));
        }
    };
}

/// The unfinished events before `id` in its key that are not part of `run` (what must not exist
/// when `id` is handed to the broker).
async fn earlier_unfinished(c: &Client, id: i64, run: &[i64]) -> R<Vec<i64>> {
    let rows = pg(
        "earlier events",
        c.query(
            "SELECT p.id FROM outbox_event e JOIN outbox_event p \
               ON p.topic = e.topic AND p.event_key = e.event_key AND p.id < e.id \
             WHERE e.id = $1 AND p.status <> 'SUCCESS' AND NOT p.id = ANY($2) \
               AND NOT (p.status = 'FAIL' AND (p.skipped_at IS NOT NULL \
                        OR current_setting('outbox.head_of_line') = 'skip'))",
            &[&id, &run],
        )
        .await,
    )?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

async fn claim(c: &Client, owner: usize, max: i32) -> R<Claim> {
    let rows = pg(
        "claim",
        c.query(
            "SELECT id, event_key, claim_token FROM outbox_claim($1, $2)",
            &[&format!("owner-{owner}"), &max],
        )
        .await,
    )?;
    Ok(Claim {
        owner,
        token: rows.first().map(|r| r.get(2)).unwrap_or(0),
        rows: rows.iter().map(|r| (r.get(0), r.get(1))).collect(),
    })
}

async fn call(c: &Client, f: &str, claim: &Claim, ids: &[i64]) -> R<()> {
    if ids.is_empty() {
        return Ok(());
    }
    pg(
        f,
        c.query(
            &format!("SELECT {f}($1, $2, $3)"),
            &[&format!("owner-{}", claim.owner), &claim.token, &ids],
        )
        .await,
    )?;
    Ok(())
}

type Coverage = std::cell::RefCell<BTreeMap<&'static str, usize>>;

async fn run_case(
    admin: &Client,
    second_producer: &Client,
    owners: &[Client],
    cov: &Coverage,
    skip_policy: bool,
    ops: &[Op],
) -> R<()> {
    let note = |what: &'static str, n: usize| *cov.borrow_mut().entry(what).or_default() += n;
    pg(
        "reset",
        admin
            .batch_execute(
                "TRUNCATE outbox_scheduled, outbox_stream, outbox_stream_batch, outbox_key",
            )
            .await,
    )?;
    let policy = if skip_policy { "skip" } else { "block" };
    for c in owners.iter().chain([admin]) {
        pg(
            "policy",
            c.batch_execute(&format!("SET outbox.head_of_line = '{policy}'"))
                .await,
        )?;
    }
    let mut committed = BTreeSet::new();
    let mut open: Vec<Claim> = Vec::new();
    for op in ops {
        match op {
            Op::Enqueue { key, n, rollback } => {
                pg("begin", admin.batch_execute("BEGIN").await)?;
                let mut ids = Vec::new();
                for _ in 0..*n {
                    let r = pg(
                        "enqueue",
                        admin
                            .query_one(
                                "SELECT outbox_enqueue('orders', '{}', key => $1)",
                                &[&format!("k{key}")],
                            )
                            .await,
                    )?;
                    ids.push(r.get::<_, i64>(0));
                }
                let end = if *rollback { "ROLLBACK" } else { "COMMIT" };
                pg(end, admin.batch_execute(end).await)?;
                if !rollback {
                    committed.extend(ids);
                }
            }
            Op::EnqueueInverted { key } => {
                let key = format!("k{key}");
                let enqueue = "SELECT outbox_enqueue('orders', '{}', key => $1)";
                pg(
                    "begin",
                    second_producer
                        .batch_execute("BEGIN; SELECT pg_current_xact_id()")
                        .await,
                )?;
                let first: i64 = pg("enqueue", admin.query_one(enqueue, &[&key]).await)?.get(0);
                let second: i64 =
                    pg("enqueue", second_producer.query_one(enqueue, &[&key]).await)?.get(0);
                pg("commit", second_producer.batch_execute("COMMIT").await)?;
                committed.extend([first, second]);
                let inverted: bool = pg(
                    "txids",
                    admin
                        .query_one(
                            "SELECT (SELECT txid FROM outbox_stream WHERE id = $2) \
                                  < (SELECT txid FROM outbox_stream WHERE id = $1)",
                            &[&first, &second],
                        )
                        .await,
                )?
                .get(0);
                note(
                    "inverted pairs: the later commit has the lower txid",
                    usize::from(inverted),
                );
            }
            Op::Claim { owner, max } => {
                let c = claim(&owners[*owner], *owner, *max).await?;
                let ids: Vec<i64> = c.rows.iter().map(|r| r.0).collect();
                for (i, &(id, _)) in c.rows.iter().enumerate() {
                    let before = earlier_unfinished(admin, id, &ids[..i]).await?;
                    check!(
                        before.is_empty(),
                        "event {id} claimed while earlier events of its key are unfinished: {before:?} (claim {ids:?})"
                    );
                }
                let keys: BTreeSet<&String> = c.rows.iter().map(|r| &r.1).collect();
                note(
                    "claims with a run of several events",
                    usize::from(keys.len() < c.rows.len()),
                );
                if !c.rows.is_empty() {
                    open.push(c);
                }
            }
            Op::Settle {
                claim,
                fail,
                transient,
            } => {
                if open.is_empty() {
                    continue;
                }
                let c = open.remove(claim.index(open.len()));
                let failed = fail.map(|f| f.index(c.rows.len()));
                let s = &owners[c.owner];
                // As the relay: ack the delivered, settle the failed one, release what follows
                // it in its key.
                let (mut ack, mut held) = (Vec::new(), Vec::new());
                let mut failed_key = None;
                for (i, (id, key)) in c.rows.iter().enumerate() {
                    if Some(i) == failed {
                        failed_key = Some(key.clone());
                    } else if failed_key.as_ref() == Some(key) {
                        held.push(*id);
                    } else {
                        ack.push(*id);
                    }
                }
                note("events held back behind a failure", held.len());
                call(s, "outbox_ack", &c, &ack).await?;
                call(s, "outbox_release", &c, &held).await?;
                if let Some(i) = failed {
                    let f = if *transient {
                        "outbox_release"
                    } else {
                        "outbox_nack"
                    };
                    call(s, f, &c, &[c.rows[i].0]).await?;
                }
            }
            Op::Reclaim => {
                tokio::time::sleep(std::time::Duration::from_millis(3)).await;
                let n: i32 = pg(
                    "reclaim",
                    admin
                        .query_one("SELECT outbox_reclaim('1 millisecond')", &[])
                        .await,
                )?
                .get(0);
                note("events reclaimed", n as usize);
            }
            Op::Requeue | Op::Skip => {
                let f = if matches!(op, Op::Requeue) {
                    "outbox_requeue"
                } else {
                    "outbox_skip"
                };
                let n: i32 = pg(
                    f,
                    admin
                        .query_one(
                            &format!(
                                "SELECT {f}(ARRAY(SELECT id FROM outbox_event WHERE status = 'FAIL'))"
                            ),
                            &[],
                        )
                        .await,
                )?
                .get(0);
                note(
                    if matches!(op, Op::Requeue) {
                        "dead letters requeued"
                    } else {
                        "dead letters skipped"
                    },
                    n as usize,
                );
            }
            Op::Pause => tokio::time::sleep(std::time::Duration::from_millis(5)).await,
        }
    }

    // Drain: settle nothing more from the open claims (zombies), take their rows back, revive
    // dead letters, and claim and ack until the table is done.
    let drainer = &owners[0];
    for _ in 0..200 {
        tokio::time::sleep(std::time::Duration::from_millis(3)).await;
        pg(
            "drain",
            admin
                .batch_execute(
                    "SELECT outbox_reclaim('1 millisecond'); \
                     SELECT outbox_requeue(ARRAY(SELECT id FROM outbox_event WHERE status = 'FAIL'))",
                )
                .await,
        )?;
        let c = claim(drainer, 0, 50).await?;
        let ids: Vec<i64> = c.rows.iter().map(|r| r.0).collect();
        for (i, &id) in ids.iter().enumerate() {
            let before = earlier_unfinished(admin, id, &ids[..i]).await?;
            check!(
                before.is_empty(),
                "drain: event {id} claimed before {before:?}"
            );
        }
        call(drainer, "outbox_ack", &c, &ids).await?;
        let left: i64 = pg(
            "left",
            admin
                .query_one(
                    "SELECT count(*) FROM outbox_event WHERE status <> 'SUCCESS'",
                    &[],
                )
                .await,
        )?
        .get(0);
        if left == 0 {
            break;
        }
    }
    claim(drainer, 0, 50).await?;
    let rows = pg(
        "final",
        admin
            .query("SELECT id, status::text FROM outbox_event ORDER BY id", &[])
            .await,
    )?;
    let state: BTreeMap<i64, String> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    let ids: BTreeSet<i64> = state.keys().copied().collect();
    check!(
        ids == committed,
        "committed events {committed:?}, table holds {ids:?}"
    );
    let stuck: Vec<_> = state.iter().filter(|(_, s)| *s != "SUCCESS").collect();
    check!(stuck.is_empty(), "not drained: {stuck:?}");
    let keys: i64 = pg(
        "keys",
        admin
            .query_one("SELECT count(*) FROM outbox_key", &[])
            .await,
    )?
    .get(0);
    check!(keys == 0, "{keys} key rows left after the drain");
    Ok(())
}

#[test]
fn per_key_order_holds_under_random_operations() {
    let cases = env_usize("OUTBOX_MODEL_CASES", 32) as u32;
    let steps = env_usize("OUTBOX_MODEL_STEPS", 60);
    let db = TestDb::create();
    db.set(&[
        ("outbox.max_retry", "0"),
        ("outbox.backoff_base", "1ms"),
        ("outbox.backoff_max", "2ms"),
    ]);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let (admin, second_producer, owners) = rt.block_on(async {
        let admin = connect(&db.url()).await;
        let second_producer = connect(&db.url()).await;
        let mut owners = Vec::new();
        for _ in 0..OWNERS {
            owners.push(connect(&db.url()).await);
        }
        (admin, second_producer, owners)
    });
    let ran = std::cell::Cell::new(0u32);
    let cov = Coverage::default();
    const KINDS: [&str; 6] = [
        "claims with a run of several events",
        "inverted pairs: the later commit has the lower txid",
        "events held back behind a failure",
        "dead letters requeued",
        "dead letters skipped",
        "events reclaimed",
    ];
    let unreached = || -> Vec<&str> {
        let c = cov.borrow();
        KINDS
            .into_iter()
            .filter(|k| c.get(k).copied().unwrap_or(0) == 0)
            .collect()
    };
    // More batches of cases run (at most 4) while a kind was never reached.
    for _ in 0..4 {
        let mut runner = TestRunner::new(Config {
            cases,
            max_shrink_iters: 200,
            failure_persistence: None,
            ..Config::default()
        });
        let result = runner.run(
            &(any::<bool>(), prop::collection::vec(op(), 1..=steps)),
            |(skip_policy, ops)| {
                ran.set(ran.get() + 1);
                rt.block_on(run_case(
                    &admin,
                    &second_producer,
                    &owners,
                    &cov,
                    skip_policy,
                    &ops,
                ))
            },
        );
        if let Err(e) = result {
            panic!("{e}");
        }
        if unreached().is_empty() {
            break;
        }
    }
    let unreached = unreached();
    let cov = cov.into_inner();
    eprintln!("{} cases of up to {steps} steps: {cov:?}", ran.get());
    assert!(ran.get() >= cases && cases > 0, "{} cases ran", ran.get());
    // A generator that never reaches a dead head, a skip, a reclaim or a held-back run would pass
    // without testing the order around them.
    assert!(
        unreached.is_empty(),
        "never reached: {unreached:?} ({cov:?})"
    );
}
