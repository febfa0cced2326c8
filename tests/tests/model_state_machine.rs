//! Property test of the outbox state machine against an in-memory model.
//!
//! Random sequences of enqueue (committed or rolled back, due now or later) / claim / ack / nack /
//! renew / reclaim / requeue / purge / clock-advance operations from four owners (with their own
//! sessions, stale tokens, other owners' tokens and ids, part of a claim's ids, unknown ids) run
//! against the real extension. After every step every row's status, retry count, claim owner,
//! exact claim token, lease and error presence, (for SENDING rows) the lease's age and (for WAIT
//! rows) its backoff delay are compared with the model, as are each call's returned count or rows
//! and `outbox_stats()`.
//!
//! The model knows where each event lives: a fresh event due now is a stream event (one row in
//! `outbox_stream`, its claim's lease on the claim's `outbox_stream_batch` row), an event due
//! later is a scheduled row, and a stream event's first failed attempt (nack, lease expired) makes
//! a scheduled copy with the same id that stands for it from then on (the stream row stays until
//! purge takes both). A claim takes the stream in id order first, then fills the batch with due
//! scheduled rows (oldest due first), and returns all its rows in id order. An acked stream event
//! shows no owner, token or lease; renewing one of a claim's stream events moves the lease of all
//! of them (it is the claim's). Purge takes scheduled SUCCESS rows by age, then stream SUCCESS rows
//! by age among the oldest (max_rows minus what it deleted) stream rows by id.
//!
//! Time is made exact with a virtual clock in units of one hour: every delay the test configures
//! (backoff base and cap, lease, deliver_at, purge age) is a whole number of units, and "advance
//! the clock by k units" shifts every timestamp of every row k hours into the past. A case runs
//! in seconds, so the real time that passes between steps never crosses a unit boundary: a row is
//! due exactly when its virtual due time is at most the virtual now (ties resolved by the real
//! clock, which only moves forward, in the direction the model assumes).
//!
//! `OUTBOX_MODEL_CASES` (default 48) and `OUTBOX_MODEL_STEPS` (default 80) size the run.

use std::collections::{BTreeMap, BTreeSet};

use outbox_tests::db::{connect, TestDb};
use outbox_tests::model::env_usize;
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use tokio_postgres::Client;

/// Settings of the test database, in virtual units (hours).
const MAX_RETRY: i32 = 2;
const BACKOFF_MAX_U: i64 = 5; // backoff_base is 1 unit: delays 1, 4, 5 (capped)
const DEFAULT_LEASE_U: i64 = 2;
const OWNERS: usize = 4;

#[derive(Debug, Clone)]
enum ClaimPart {
    None,
    All,
    /// Its first ids, not all of them when it has more than one: the rest stays held (a stream
    /// claim's batch keeps them pending, and their lease is the claim's).
    Some(Index),
}

#[derive(Debug, Clone)]
struct IdSel {
    /// Include ids of the chosen claim.
    from_claim: ClaimPart,
    /// Ids picked among every id ever returned by enqueue (also rolled-back and purged ones).
    extra: Vec<Index>,
    /// Add an id that never existed.
    bogus: bool,
}

#[derive(Debug, Clone)]
enum Who {
    /// The owner that made the chosen claim.
    ClaimOwner,
    /// Some owner, perhaps another one.
    Owner(usize),
}

#[derive(Debug, Clone)]
enum Op {
    Enqueue { n: u8, delay_u: u8, rollback: bool },
    Claim { owner: usize, max: i32 },
    Ack { who: Who, claim: Index, ids: IdSel },
    Nack { who: Who, claim: Index, ids: IdSel },
    Renew { who: Who, claim: Index, ids: IdSel },
    Reclaim { lease_u: Option<u8> },
    Requeue { all_failed: bool, ids: IdSel },
    Purge { older_u: u8, max_rows: i32 },
    Advance { units: u8 },
}

fn id_sel() -> impl Strategy<Value = IdSel> {
    (
        prop_oneof![
            3 => Just(ClaimPart::None),
            13 => Just(ClaimPart::All),
            4 => any::<Index>().prop_map(ClaimPart::Some),
        ],
        prop::collection::vec(any::<Index>(), 0..3),
        prop::bool::weighted(0.15),
    )
        .prop_map(|(from_claim, extra, bogus)| IdSel {
            from_claim,
            extra,
            bogus,
        })
}

fn who() -> impl Strategy<Value = Who> {
    prop_oneof![
        3 => Just(Who::ClaimOwner),
        1 => (0..OWNERS).prop_map(Who::Owner),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (1u8..=3, prop_oneof![3 => Just(0u8), 1 => 1u8..=3], prop::bool::weighted(0.2))
            .prop_map(|(n, delay_u, rollback)| Op::Enqueue { n, delay_u, rollback }),
        4 => (0..OWNERS, 1i32..=5).prop_map(|(owner, max)| Op::Claim { owner, max }),
        3 => (who(), any::<Index>(), id_sel()).prop_map(|(who, claim, ids)| Op::Ack { who, claim, ids }),
        2 => (who(), any::<Index>(), id_sel()).prop_map(|(who, claim, ids)| Op::Nack { who, claim, ids }),
        2 => (who(), any::<Index>(), id_sel()).prop_map(|(who, claim, ids)| Op::Renew { who, claim, ids }),
        3 => prop::option::of(1u8..=3).prop_map(|lease_u| Op::Reclaim { lease_u }),
        2 => (any::<bool>(), id_sel()).prop_map(|(all_failed, ids)| Op::Requeue { all_failed, ids }),
        1 => (0u8..=3, 1i32..=6).prop_map(|(older_u, max_rows)| Op::Purge { older_u, max_rows }),
        3 => (1u8..=6).prop_map(|units| Op::Advance { units }),
    ]
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum St {
    Wait,
    Sending,
    Success,
    Fail,
}

impl St {
    fn sql(self) -> &'static str {
        match self {
            St::Wait => "WAIT",
            St::Sending => "SENDING",
            St::Success => "SUCCESS",
            St::Fail => "FAIL",
        }
    }
}

#[derive(Debug, Clone)]
struct Row {
    /// The event's state is a row of outbox_scheduled (due later, or a stream event after a failed
    /// attempt); otherwise the view derives it from the stream row, the cursor and its batch.
    scheduled: bool,
    /// The event has a row in outbox_stream (fresh unordered; kept under a scheduled copy).
    in_stream: bool,
    status: St,
    retry: i32,
    owner: Option<String>,
    token: Option<i64>,
    has_lease: bool,
    has_error: bool,
    /// Virtual next_retry_time (units) and the step that wrote it (orders equal times).
    due_u: i64,
    due_seq: usize,
    /// next_retry_time - updated_at, in units (checked for WAIT rows).
    delay_u: i64,
    claimed_u: i64,
    updated_u: i64,
    created_u: i64,
}

/// One claim call that returned rows.
#[derive(Debug, Clone)]
struct ClaimRec {
    owner: usize,
    token: i64,
    ids: Vec<i64>,
}

#[derive(Default, Debug)]
struct Model {
    now_u: i64,
    rows: BTreeMap<i64, Row>,
    all_ids: Vec<i64>,
    claims: Vec<ClaimRec>,
    last_token: i64,
    last_id: i64,
}

fn owner_name(i: usize) -> String {
    format!("relay-{i}")
}

impl Model {
    fn resolve_ids(&self, sel: &IdSel, claim: Option<&ClaimRec>) -> Vec<i64> {
        let mut ids = Vec::new();
        if let Some(c) = claim {
            match &sel.from_claim {
                ClaimPart::None => {}
                ClaimPart::All => ids.extend(&c.ids),
                ClaimPart::Some(i) => {
                    let n = c.ids.len();
                    let k = if n > 1 { 1 + i.index(n - 1) } else { n };
                    ids.extend(&c.ids[..k]);
                }
            }
        }
        if !self.all_ids.is_empty() {
            ids.extend(
                sel.extra
                    .iter()
                    .map(|i| self.all_ids[i.index(self.all_ids.len())]),
            );
        }
        if sel.bogus {
            ids.push(-1);
            ids.push(i64::MAX);
        }
        ids
    }

    /// (owner, token, ids) of a settle call: a real claim, or a token nobody holds.
    fn resolve_settle(&self, who: &Who, claim: &Index, sel: &IdSel) -> (String, i64, Vec<i64>) {
        // Mostly one of the latest claims (live tokens), sometimes any earlier (stale) one.
        let n = self.claims.len();
        let pick = claim.index(4 * n.max(1));
        let rec = (n > 0).then(|| {
            if pick < n {
                &self.claims[pick]
            } else {
                &self.claims[n - 1 - (pick % 2).min(n - 1)]
            }
        });
        let owner = match (who, rec) {
            (Who::ClaimOwner, Some(c)) => c.owner,
            (Who::ClaimOwner, None) => 0,
            (Who::Owner(o), _) => *o,
        };
        let token = rec.map(|c| c.token).unwrap_or(-42);
        (owner_name(owner), token, self.resolve_ids(sel, rec))
    }

    fn held(&self, owner: &str, token: i64, ids: &[i64]) -> BTreeSet<i64> {
        ids.iter()
            .copied()
            .filter(|id| {
                self.rows.get(id).is_some_and(|r| {
                    r.status == St::Sending
                        && r.owner.as_deref() == Some(owner)
                        && r.token == Some(token)
                })
            })
            .collect()
    }
}

struct Sessions {
    admin: Client,
    owners: Vec<Client>,
    /// Rows changed per operation kind over the whole run (shows the run exercised each path).
    coverage: std::cell::RefCell<BTreeMap<&'static str, usize>>,
}

impl Sessions {
    fn covered(&self, what: &'static str, n: usize) {
        *self.coverage.borrow_mut().entry(what).or_default() += n;
    }
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

async fn run_case(s: &Sessions, ops: &[Op]) -> R<()> {
    pg(
        "truncate",
        // The stream's cursor stays: its newest version must, and a fresh stream behind an old
        // position is handed out as any new events are.
        s.admin
            .batch_execute(
                "TRUNCATE outbox_scheduled, outbox_stream, outbox_stream_batch, outbox_key",
            )
            .await,
    )?;
    let mut m = Model::default();
    for (step, op) in ops.iter().enumerate() {
        let ctx = format!("step {step} {op:?}");
        let mut purge_check: Option<(BTreeSet<i64>, usize)> = None;
        match op {
            Op::Enqueue {
                n,
                delay_u,
                rollback,
            } => {
                pg(&ctx, s.admin.batch_execute("BEGIN").await)?;
                let mut ids = Vec::new();
                for _ in 0..*n {
                    let row = pg(
                        &ctx,
                        s.admin
                            .query_one(
                                "SELECT outbox_enqueue('orders', '{\"x\":1}', \
                                 deliver_at => CASE WHEN $1::int > 0 THEN now() + $1::int * interval '1 hour' END)",
                                &[&(*delay_u as i32)],
                            )
                            .await,
                    )?;
                    ids.push(row.get::<_, i64>(0));
                }
                let end = if *rollback { "ROLLBACK" } else { "COMMIT" };
                pg(&ctx, s.admin.batch_execute(end).await)?;
                for id in ids {
                    check!(id > m.last_id, "{ctx}: id {id} not above {}", m.last_id);
                    m.last_id = id;
                    m.all_ids.push(id);
                    if !rollback {
                        // Due now: the stream; due later: a scheduled row.
                        let stream = *delay_u == 0;
                        m.rows.insert(
                            id,
                            Row {
                                scheduled: !stream,
                                in_stream: stream,
                                status: St::Wait,
                                retry: 0,
                                owner: None,
                                token: None,
                                has_lease: false,
                                has_error: false,
                                due_u: m.now_u + *delay_u as i64,
                                due_seq: step,
                                delay_u: *delay_u as i64,
                                claimed_u: 0,
                                updated_u: m.now_u,
                                created_u: m.now_u,
                            },
                        );
                    }
                }
            }
            Op::Claim { owner, max } => {
                let name = owner_name(*owner);
                // The stream in commit (= id) order, leaving up to half of the batch to due
                // scheduled rows, which fill the rest oldest due first.
                let mut due: Vec<(i64, usize, i64)> = m
                    .rows
                    .iter()
                    .filter(|(_, r)| r.scheduled && r.status == St::Wait && r.due_u <= m.now_u)
                    .map(|(id, r)| (r.due_u, r.due_seq, *id))
                    .collect();
                due.sort();
                let limit = *max as usize;
                let reserved = due.len().min(limit.div_ceil(2));
                let mut expect: Vec<i64> = m
                    .rows
                    .iter()
                    .filter(|(_, r)| !r.scheduled && r.status == St::Wait)
                    .map(|(id, _)| *id)
                    .take(limit - reserved)
                    .collect();
                expect.extend(due.iter().take(limit - expect.len()).map(|d| d.2));
                expect.sort();
                let rows = pg(
                    &ctx,
                    s.owners[*owner]
                        .query(
                            "SELECT id, status::text, claim_owner, claim_token FROM outbox_claim($1, $2)",
                            &[&name, max],
                        )
                        .await,
                )?;
                let got: Vec<i64> = rows.iter().map(|r| r.get(0)).collect();
                check!(
                    got == expect,
                    "{ctx}: claimed {got:?}, model expects {expect:?} (the stream by id, then \
                     scheduled oldest due first; returned in id order)"
                );
                if let Some(first) = rows.first() {
                    let token: i64 = first.get(3);
                    check!(
                        token > m.last_token,
                        "{ctx}: token {token} is not new (last {})",
                        m.last_token
                    );
                    m.last_token = token;
                    for r in &rows {
                        check!(
                            r.get::<_, String>(1) == "SENDING"
                                && r.get::<_, Option<String>>(2).as_deref() == Some(name.as_str())
                                && r.get::<_, i64>(3) == token,
                            "{ctx}: returned row not SENDING/owner/one token: {r:?}"
                        );
                    }
                    for id in &got {
                        let r = m.rows.get_mut(id).expect("claimed known row");
                        r.status = St::Sending;
                        r.owner = Some(name.clone());
                        r.token = Some(token);
                        r.has_lease = true;
                        r.claimed_u = m.now_u;
                        r.updated_u = m.now_u;
                    }
                    s.covered("claimed", got.len());
                    s.covered(
                        "claimed from the stream",
                        got.iter().filter(|id| !m.rows[id].scheduled).count(),
                    );
                    m.claims.push(ClaimRec {
                        owner: *owner,
                        token,
                        ids: got,
                    });
                }
            }
            Op::Ack { who, claim, ids } => {
                let (owner, token, ids) = m.resolve_settle(who, claim, ids);
                let held = m.held(&owner, token, &ids);
                let n: i32 = pg(
                    &ctx,
                    s.owners[owner_index(&owner)]
                        .query_one("SELECT outbox_ack($1, $2, $3)", &[&owner, &token, &ids])
                        .await,
                )?
                .get(0);
                check!(
                    n as usize == held.len(),
                    "{ctx}: ack({owner}, {token}, {ids:?}) counted {n}, model {}",
                    held.len()
                );
                s.covered("acked", held.len());
                s.covered("ack calls counting 0", usize::from(held.is_empty()));
                for id in held {
                    let r = m.rows.get_mut(&id).unwrap();
                    r.status = St::Success;
                    if r.scheduled {
                        // Keeps its owner, token and lease.
                        r.updated_u = m.now_u;
                    } else {
                        // Out of its claim's batch: the stream row alone, never rewritten.
                        r.owner = None;
                        r.token = None;
                        r.has_lease = false;
                        r.updated_u = r.created_u;
                        s.covered("acked from the stream", 1);
                    }
                }
            }
            Op::Nack { who, claim, ids } => {
                let (owner, token, ids) = m.resolve_settle(who, claim, ids);
                let held = m.held(&owner, token, &ids);
                let n: i32 = pg(
                    &ctx,
                    s.owners[owner_index(&owner)]
                        .query_one(
                            "SELECT outbox_nack($1, $2, $3, 'broker said no')",
                            &[&owner, &token, &ids],
                        )
                        .await,
                )?
                .get(0);
                check!(
                    n as usize == held.len(),
                    "{ctx}: nack({owner}, {token}, {ids:?}) counted {n}, model {}",
                    held.len()
                );
                for id in held {
                    let now = m.now_u;
                    let r = m.rows.get_mut(&id).unwrap();
                    // A stream event's first failed attempt: a scheduled copy (retry_count 0 + 1).
                    if !r.scheduled {
                        s.covered("nacked from the stream", 1);
                    }
                    r.scheduled = true;
                    r.retry += 1;
                    r.status = if r.retry > MAX_RETRY {
                        St::Fail
                    } else {
                        St::Wait
                    };
                    s.covered(
                        if r.status == St::Fail {
                            "nacked to FAIL"
                        } else {
                            "nacked to WAIT"
                        },
                        1,
                    );
                    let delay = ((r.retry as i64) * (r.retry as i64)).min(BACKOFF_MAX_U);
                    r.due_u = now + delay;
                    r.due_seq = step;
                    r.delay_u = delay;
                    r.owner = None;
                    r.token = None;
                    r.has_lease = false;
                    r.has_error = true;
                    r.updated_u = now;
                }
            }
            Op::Renew { who, claim, ids } => {
                let (owner, token, ids) = m.resolve_settle(who, claim, ids);
                let held = m.held(&owner, token, &ids);
                let n: i32 = pg(
                    &ctx,
                    s.owners[owner_index(&owner)]
                        .query_one("SELECT outbox_renew($1, $2, $3)", &[&owner, &token, &ids])
                        .await,
                )?
                .get(0);
                check!(
                    n as usize == held.len(),
                    "{ctx}: renew({owner}, {token}, {ids:?}) counted {n}, model {}",
                    held.len()
                );
                s.covered("renewed", held.len());
                // A stream event's lease is its claim's: renewing one renews every event the
                // claim still holds.
                let batches: BTreeSet<i64> = held
                    .iter()
                    .filter(|id| !m.rows[id].scheduled)
                    .filter_map(|id| m.rows[id].token)
                    .collect();
                s.covered(
                    "renewed from the stream",
                    held.iter().filter(|id| !m.rows[id].scheduled).count(),
                );
                let now = m.now_u;
                for (id, r) in m.rows.iter_mut() {
                    let in_batch = !r.scheduled
                        && r.status == St::Sending
                        && r.token.is_some_and(|t| batches.contains(&t));
                    if held.contains(id) || in_batch {
                        if !held.contains(id) && r.claimed_u != now {
                            s.covered("renewed with its claim", 1);
                        }
                        r.claimed_u = now;
                        r.updated_u = now;
                    }
                }
            }
            Op::Reclaim { lease_u } => {
                let lease = lease_u.map(i64::from).unwrap_or(DEFAULT_LEASE_U);
                let expired: Vec<i64> = m
                    .rows
                    .iter()
                    .filter(|(_, r)| r.status == St::Sending && r.claimed_u + lease <= m.now_u)
                    .map(|(id, _)| *id)
                    .collect();
                let arg: Option<String> = lease_u.map(|u| format!("{u} hours"));
                let n: i32 = pg(
                    &ctx,
                    s.admin
                        .query_one("SELECT outbox_reclaim($1::text::interval)", &[&arg])
                        .await,
                )?
                .get(0);
                check!(
                    n as usize == expired.len(),
                    "{ctx}: reclaim counted {n}, model expects {expired:?}"
                );
                for id in expired {
                    let now = m.now_u;
                    let r = m.rows.get_mut(&id).unwrap();
                    // A stream event's first failed attempt: a scheduled copy (retry_count 0 + 1).
                    if !r.scheduled {
                        s.covered("reclaimed from the stream", 1);
                    }
                    r.scheduled = true;
                    r.retry += 1;
                    r.status = if r.retry > MAX_RETRY {
                        St::Fail
                    } else {
                        St::Wait
                    };
                    s.covered(
                        if r.status == St::Fail {
                            "reclaimed to FAIL"
                        } else {
                            "reclaimed to WAIT"
                        },
                        1,
                    );
                    r.due_u = now;
                    r.due_seq = step;
                    r.delay_u = 0;
                    r.owner = None;
                    r.token = None;
                    r.has_lease = false;
                    r.has_error = true;
                    r.updated_u = now;
                }
            }
            Op::Requeue { all_failed, ids } => {
                let mut ids = m.resolve_ids(ids, None);
                if *all_failed {
                    ids.extend(
                        m.rows
                            .iter()
                            .filter(|(_, r)| r.status == St::Fail)
                            .map(|(id, _)| *id),
                    );
                }
                let failed: BTreeSet<i64> = ids
                    .iter()
                    .copied()
                    .filter(|id| m.rows.get(id).is_some_and(|r| r.status == St::Fail))
                    .collect();
                let n: i32 = pg(
                    &ctx,
                    s.admin
                        .query_one("SELECT outbox_requeue($1)", &[&ids])
                        .await,
                )?
                .get(0);
                check!(
                    n as usize == failed.len(),
                    "{ctx}: requeue({ids:?}) counted {n}, model {}",
                    failed.len()
                );
                s.covered("requeued", failed.len());
                for id in failed {
                    let now = m.now_u;
                    let r = m.rows.get_mut(&id).unwrap();
                    r.status = St::Wait;
                    r.retry = 0;
                    r.due_u = now;
                    r.due_seq = step;
                    r.delay_u = 0;
                    r.updated_u = now;
                }
            }
            Op::Purge { older_u, max_rows } => {
                let max = *max_rows as usize;
                // Scheduled SUCCESS rows by updated_at (a retried stream event's row goes with its
                // scheduled copy, counted once).
                let mut eligible: BTreeSet<i64> = m
                    .rows
                    .iter()
                    .filter(|(_, r)| {
                        r.scheduled
                            && r.status == St::Success
                            && r.updated_u + *older_u as i64 <= m.now_u
                    })
                    .map(|(id, _)| *id)
                    .collect();
                let mut expect = eligible.len().min(max);
                if expect < max {
                    // Every scheduled one went (no choice left to the database): then stream
                    // SUCCESS rows by created_at, among the oldest (max - expect) stream rows by
                    // id that remain (whatever their state, retried ones included).
                    let stream: BTreeSet<i64> = m
                        .rows
                        .iter()
                        .filter(|(id, r)| r.in_stream && !eligible.contains(id))
                        .map(|(id, _)| *id)
                        .take(max - expect)
                        .filter(|id| {
                            let r = &m.rows[id];
                            !r.scheduled
                                && r.status == St::Success
                                && r.created_u + *older_u as i64 <= m.now_u
                        })
                        .collect();
                    s.covered("purged from the stream", stream.len());
                    expect += stream.len();
                    eligible.extend(stream);
                }
                let n: i64 = pg(
                    &ctx,
                    s.admin
                        .query_one(
                            "SELECT outbox_purge($1::text::interval, $2)",
                            &[&format!("{older_u} hours"), max_rows],
                        )
                        .await,
                )?
                .get(0);
                check!(
                    n as usize == expect,
                    "{ctx}: purge counted {n}, model {expect} of {eligible:?}"
                );
                s.covered("purged", expect);
                purge_check = Some((eligible, expect));
            }
            Op::Advance { units } => {
                // Every timestamp an event has: a scheduled row's own, a stream event's creation
                // time and its claim's lease (on the claim's batch row). One implicit transaction.
                pg(
                    &ctx,
                    s.admin
                        .batch_execute(&format!(
                            "UPDATE outbox_scheduled SET \
                             next_retry_time = next_retry_time - {units} * interval '1 hour', \
                             claimed_at = claimed_at - {units} * interval '1 hour', \
                             created_at = created_at - {units} * interval '1 hour', \
                             updated_at = updated_at - {units} * interval '1 hour'; \
                             UPDATE outbox_stream SET created_at = created_at - {units} * interval '1 hour'; \
                             UPDATE outbox_stream_batch SET claimed_at = claimed_at - {units} * interval '1 hour'"
                        ))
                        .await,
                )?;
                m.now_u += *units as i64;
            }
        }
        compare(s, &mut m, &ctx, purge_check).await?;
    }
    Ok(())
}

fn owner_index(name: &str) -> usize {
    name.trim_start_matches("relay-")
        .parse()
        .expect("owner index")
}

/// Compares every row and `outbox_stats()` with the model. After a purge, the rows the database
/// deleted must be `expect` of the eligible ones (which ones is the database's choice).
async fn compare(
    s: &Sessions,
    m: &mut Model,
    ctx: &str,
    purge: Option<(BTreeSet<i64>, usize)>,
) -> R<()> {
    let rows = pg(
        ctx,
        s.admin
            .query(
                "SELECT id, status::text, retry_count, claim_owner, claim_token, claimed_at IS NOT NULL, \
                 last_error IS NOT NULL, \
                 (extract(epoch from next_retry_time - updated_at) * 1000)::bigint, \
                 claimed_at = updated_at, \
                 floor(extract(epoch from now() - claimed_at) / 3600)::bigint \
                 FROM outbox_event ORDER BY id",
                &[],
            )
            .await,
    )?;
    let in_db: BTreeSet<i64> = rows.iter().map(|r| r.get(0)).collect();
    if let Some((eligible, expect)) = purge {
        let gone: BTreeSet<i64> = m
            .rows
            .keys()
            .copied()
            .filter(|id| !in_db.contains(id))
            .collect();
        check!(
            gone.len() == expect && gone.is_subset(&eligible),
            "{ctx}: purge deleted {gone:?}, expected {expect} of {eligible:?}"
        );
        for id in gone {
            m.rows.remove(&id);
        }
    }
    let model_ids: BTreeSet<i64> = m.rows.keys().copied().collect();
    check!(
        in_db == model_ids,
        "{ctx}: database rows {in_db:?} != model rows {model_ids:?}"
    );
    for r in &rows {
        let id: i64 = r.get(0);
        let want = &m.rows[&id];
        let status: String = r.get(1);
        let retry: i32 = r.get(2);
        let owner: Option<String> = r.get(3);
        let token: Option<i64> = r.get(4);
        let lease: bool = r.get(5);
        let error: bool = r.get(6);
        let delay_ms: i64 = r.get(7);
        let lease_stamp_eq: Option<bool> = r.get(8);
        let lease_age_u: Option<i64> = r.get(9);
        let got = (
            status.as_str(),
            retry,
            owner.as_deref(),
            token,
            lease,
            error,
        );
        let exp = (
            want.status.sql(),
            want.retry,
            want.owner.as_deref(),
            want.token,
            want.has_lease,
            want.has_error,
        );
        check!(
            got == exp,
            "{ctx}: row {id} is (status, retry, owner, token, lease, error) = {got:?}, model {exp:?}"
        );
        if want.status == St::Wait {
            check!(
                delay_ms == want.delay_u * 3_600_000,
                "{ctx}: row {id} WAIT with next_retry_time - updated_at = {delay_ms} ms, model {} h",
                want.delay_u
            );
        }
        if want.status == St::Sending {
            check!(
                lease_stamp_eq == Some(true),
                "{ctx}: row {id} SENDING with claimed_at != updated_at"
            );
            // The lease's age in whole units: a renew (of a stream event: of its whole claim)
            // moved it to now.
            check!(
                lease_age_u == Some(m.now_u - want.claimed_u),
                "{ctx}: row {id} SENDING with a lease {lease_age_u:?} h old, model {} h",
                m.now_u - want.claimed_u
            );
        }
    }
    let st = pg(
        ctx,
        s.admin
            .query_one(
                "SELECT due_wait, delayed_wait, sending, failed, succeeded FROM outbox_stats()",
                &[],
            )
            .await,
    )?;
    let count = |f: &dyn Fn(&Row) -> bool| m.rows.values().filter(|r| f(r)).count() as i64;
    let now = m.now_u;
    let exp = (
        count(&|r| r.status == St::Wait && r.due_u <= now),
        count(&|r| r.status == St::Wait && r.due_u > now),
        count(&|r| r.status == St::Sending),
        count(&|r| r.status == St::Fail),
        count(&|r| r.status == St::Success),
    );
    let got: (i64, i64, i64, i64, i64) = (st.get(0), st.get(1), st.get(2), st.get(3), st.get(4));
    check!(
        got == exp,
        "{ctx}: outbox_stats (due, delayed, sending, failed, succeeded) = {got:?}, model {exp:?}"
    );
    Ok(())
}

#[test]
fn state_machine_matches_the_model() {
    let cases = env_usize("OUTBOX_MODEL_CASES", 48) as u32;
    let steps = env_usize("OUTBOX_MODEL_STEPS", 80);
    let db = TestDb::create();
    db.set(&[
        ("outbox.max_retry", &MAX_RETRY.to_string()),
        ("outbox.backoff_base", "1h"),
        ("outbox.backoff_max", &format!("{BACKOFF_MAX_U}h")),
        ("outbox.backoff_jitter", "0"),
        ("outbox.lease", &format!("{DEFAULT_LEASE_U}h")),
    ]);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let sessions = rt.block_on(async {
        let admin = connect(&db.url()).await;
        let mut owners = Vec::new();
        for _ in 0..OWNERS {
            owners.push(connect(&db.url()).await);
        }
        Sessions {
            admin,
            owners,
            coverage: Default::default(),
        }
    });
    // A green run must have run cases, and every transition in them: a generator that never
    // reaches FAIL (or reclaim, or requeue) would otherwise pass without testing it. Rows reach
    // FAIL, and then requeue, in only a few of 48 cases: when a batch of cases missed a kind,
    // more batches run (at most MAX_BATCHES) before that counts as a failure.
    let ran = std::cell::Cell::new(0u32);
    let unreached = || -> Vec<&str> {
        let coverage = sessions.coverage.borrow();
        COVERED_KINDS
            .iter()
            .copied()
            .filter(|k| coverage.get(k).copied().unwrap_or(0) == 0)
            .collect()
    };
    for _ in 0..MAX_BATCHES {
        let mut runner = TestRunner::new(Config {
            cases,
            max_shrink_iters: 300,
            failure_persistence: None,
            ..Config::default()
        });
        let result = runner.run(&prop::collection::vec(op(), 1..=steps), |ops| {
            ran.set(ran.get() + 1);
            rt.block_on(run_case(&sessions, &ops))
        });
        if let Err(e) = result {
            panic!("{e}");
        }
        if unreached().is_empty() {
            break;
        }
    }
    let coverage = sessions.coverage.borrow().clone();
    eprintln!(
        "{} cases of up to {steps} steps; rows changed per kind: {coverage:?}",
        ran.get()
    );
    assert!(
        cases > 0 && ran.get() >= cases,
        "{} cases ran, {cases} asked for",
        ran.get()
    );
    let unreached = unreached();
    assert!(
        unreached.is_empty(),
        "no row ever changed by {unreached:?} in {} cases: {coverage:?}",
        ran.get()
    );
}

/// Batches of `OUTBOX_MODEL_CASES` cases run at most to reach every kind of `COVERED_KINDS`.
const MAX_BATCHES: usize = 8;

/// Every kind of row change `Sessions::covered` records; each must happen in a run.
const COVERED_KINDS: [&str; 17] = [
    "claimed",
    "claimed from the stream",
    "acked",
    "acked from the stream",
    "ack calls counting 0",
    "nacked to WAIT",
    "nacked to FAIL",
    "nacked from the stream",
    "renewed",
    "renewed from the stream",
    "renewed with its claim",
    "reclaimed to WAIT",
    "reclaimed to FAIL",
    "reclaimed from the stream",
    "requeued",
    "purged",
    "purged from the stream",
];
