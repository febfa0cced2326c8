//! The commit-time wake-up behind `outbox_wait` (docs/reference.md, "Wake-up"), without NOTIFY:
//! NOTIFY takes a cluster-wide lock from pre-commit through the commit's WAL flush, so every
//! notifying transaction commits alone and loses group commit.
//!
//! With `shared_preload_libraries = 'outbox'` a small shared-memory block holds, per backend slot,
//! the database that backend waits for and a "woken" flag. A transaction that enqueued, once it
//! has committed (its rows are visible by then), wakes the waiters of its own database: atomics
//! and `SetLatch`, nothing that can fail at commit. Without the preload (managed
//! PostgreSQL) `outbox_wait` looks at the queue every `outbox.wait_poll_interval` instead. Either
//! way it also looks at the queue on a timer, which catches what no commit of this server
//! announces: `COMMIT PREPARED`, `deliver_at` and backoffs coming due.

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use pgrx::prelude::*;
use pgrx::{pg_shmem_init, PGRXSharedMemory, PgAtomic, PgMemoryContexts};

use crate::guc;

/// Backends whose slot (`PGPROC.pgprocno`) is below this can be woken by a commit; the others fall
/// back to polling. 1,024 covers max_connections up to about 1,000.
const SLOTS: usize = 1024;

/// With the preload, how often a waiter also looks at the queue (the safety net above).
const PRELOADED_POLL: Duration = Duration::from_millis(250);

pub struct Shared {
    /// `waiting[pgprocno]`: the database whose commits that backend waits for inside
    /// `outbox_wait`, 0 when it does not wait (a relay of another database has nothing to claim).
    waiting: [AtomicU32; SLOTS],
    /// `woken[pgprocno]`: a transaction of that database enqueued and committed since it registered.
    woken: [AtomicBool; SLOTS],
}

// Plain atomics, no pointers: valid in every process that maps the segment.
unsafe impl PGRXSharedMemory for Shared {}

impl Shared {
    fn new() -> Shared {
        Shared {
            waiting: [const { AtomicU32::new(0) }; SLOTS],
            woken: [const { AtomicBool::new(false) }; SLOTS],
        }
    }
}

static SHARED: PgAtomic<Shared> = unsafe { PgAtomic::new(c"outbox_wake") };

/// Set in the postmaster when it preloads the library; backends inherit it by fork.
static PRELOADED: AtomicBool = AtomicBool::new(false);

/// This backend's transaction enqueued at these nesting levels (bit n = level n, levels past 63
/// share bit 63): a subtransaction that rolls back drops its bit, one that commits hands it to its
/// parent, and the top level commits with a bit set → wake. Backend-local, single-threaded.
static ENQUEUED_LEVELS: AtomicU64 = AtomicU64::new(0);

/// Called from `_PG_init`, in the postmaster when preloaded, else in the backend that loads us.
// pg_shmem_init! tests the features of other PostgreSQL versions, which this crate does not declare.
#[allow(unexpected_cfgs)]
pub fn init() {
    if unsafe { pg_sys::process_shared_preload_libraries_in_progress } {
        pg_shmem_init!(SHARED = Shared::new());
        PRELOADED.store(true, Ordering::Relaxed);
    }
    unsafe {
        pg_sys::RegisterXactCallback(Some(on_xact_event), std::ptr::null_mut());
        pg_sys::RegisterSubXactCallback(Some(on_subxact_event), std::ptr::null_mut());
    }
}

fn preloaded() -> bool {
    PRELOADED.load(Ordering::Relaxed)
}

fn level_bit(level: i32) -> u64 {
    1u64 << level.clamp(0, 63)
}

/// Remember that the current (sub)transaction enqueued.
pub fn note_enqueue() {
    let level = unsafe { pg_sys::GetCurrentTransactionNestLevel() };
    ENQUEUED_LEVELS.fetch_or(level_bit(level), Ordering::Relaxed);
}

#[pg_guard]
unsafe extern "C-unwind" fn on_xact_event(event: pg_sys::XactEvent::Type, _arg: *mut c_void) {
    match event {
        // After the commit record is flushed and the transaction is visible to new snapshots.
        pg_sys::XactEvent::XACT_EVENT_COMMIT => {
            let enqueued = ENQUEUED_LEVELS.swap(0, Ordering::Relaxed) != 0;
            if enqueued {
                wake_waiters();
            }
        }
        // A prepared transaction commits later, maybe in another session: the timer finds it.
        pg_sys::XactEvent::XACT_EVENT_ABORT | pg_sys::XactEvent::XACT_EVENT_PREPARE => {
            ENQUEUED_LEVELS.store(0, Ordering::Relaxed);
        }
        _ => {}
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn on_subxact_event(
    event: pg_sys::SubXactEvent::Type,
    _my_subid: pg_sys::SubTransactionId,
    _parent_subid: pg_sys::SubTransactionId,
    _arg: *mut c_void,
) {
    // The subtransaction ending is still the current one here.
    let level = unsafe { pg_sys::GetCurrentTransactionNestLevel() };
    let levels = ENQUEUED_LEVELS.load(Ordering::Relaxed);
    let bit = level_bit(level);
    if levels & bit == 0 {
        return;
    }
    match event {
        pg_sys::SubXactEvent::SUBXACT_EVENT_COMMIT_SUB if level <= 63 => {
            ENQUEUED_LEVELS.store((levels & !bit) | level_bit(level - 1), Ordering::Relaxed);
        }
        // Past level 63 the bit is shared with deeper levels: keep it (a spurious wake-up costs
        // one empty claim; a lost one costs latency).
        pg_sys::SubXactEvent::SUBXACT_EVENT_ABORT_SUB if level < 63 => {
            ENQUEUED_LEVELS.store(levels & !bit, Ordering::Relaxed);
        }
        _ => {}
    }
}

/// Runs at commit: only atomics and SetLatch, which cannot fail.
fn wake_waiters() {
    if !preloaded() {
        return;
    }
    let shared = SHARED.get();
    unsafe {
        let database = pg_sys::MyDatabaseId.to_u32();
        let procs = (*pg_sys::ProcGlobal).allProcs;
        let count = ((*pg_sys::ProcGlobal).allProcCount as usize).min(SLOTS);
        for (slot, waiting) in shared.waiting[..count].iter().enumerate() {
            if waiting.load(Ordering::SeqCst) == database {
                shared.woken[slot].store(true, Ordering::SeqCst);
                pg_sys::SetLatch(&raw mut (*procs.add(slot)).procLatch);
            }
        }
    }
}

/// This backend's slot in `Shared::waiting`, when the preload gave us one.
fn my_slot() -> Option<usize> {
    if !preloaded() {
        return None;
    }
    let slot = unsafe { (*pg_sys::MyProc).pgprocno } as usize;
    (slot < SLOTS).then_some(slot)
}

/// Clears this backend's waiting flag however `outbox_wait` ends (error, cancel, or the backend
/// exiting: then `on_exit_clear` does it).
struct Registration(usize);

impl Registration {
    fn new(slot: usize) -> Registration {
        static EXIT_HOOK: AtomicBool = AtomicBool::new(false);
        if !EXIT_HOOK.swap(true, Ordering::Relaxed) {
            unsafe { pg_sys::before_shmem_exit(Some(on_exit_clear), pg_sys::Datum::from(0)) };
        }
        let shared = SHARED.get();
        shared.woken[slot].store(false, Ordering::SeqCst);
        let database = unsafe { pg_sys::MyDatabaseId }.to_u32();
        shared.waiting[slot].store(database, Ordering::SeqCst);
        Registration(slot)
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        SHARED.get().waiting[self.0].store(0, Ordering::SeqCst);
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn on_exit_clear(_code: i32, _arg: pg_sys::Datum) {
    if let Some(slot) = my_slot() {
        SHARED.get().waiting[slot].store(0, Ordering::SeqCst);
    }
}

/// Which wake-up this backend has: `commit` (shared memory, woken by commits) or `polling`.
#[pg_extern(stable, parallel_safe)]
pub fn outbox_wake_mode() -> &'static str {
    if my_slot().is_some() {
        "commit"
    } else {
        "polling"
    }
}

/// The engine of `outbox_wait` (the SQL wrapper validates the arguments and checks isolation):
/// true as soon as `work_due` (the oid of a function returning whether something is claimable)
/// says so or a transaction that enqueued commits, false after `timeout_ms`.
#[pg_extern(volatile, parallel_unsafe)]
pub fn outbox_wait_for(timeout_ms: i64, work_due: pg_sys::Oid) -> bool {
    let deadline = Instant::now() + Duration::from_millis(timeout_ms.max(0) as u64);
    let slot = my_slot();
    let poll = match slot {
        Some(_) => PRELOADED_POLL,
        None => Duration::from_millis(guc::WAIT_POLL_INTERVAL_MS.get().max(1) as u64),
    };
    // Registered before the first look at the queue: a commit of this database after that
    // registration finds it and sets our woken flag; one before it is seen by the first look.
    let _registration = slot.map(Registration::new);
    let woken = || slot.is_some_and(|s| SHARED.get().woken[s].load(Ordering::SeqCst));

    let flinfo = unsafe { PgBox::<pg_sys::FmgrInfo>::alloc0() };
    unsafe { pg_sys::fmgr_info(work_due, flinfo.as_ptr()) };
    // Each look allocates a little in the current context: reset it between looks, so a long
    // wait costs no memory.
    let mut scratch = PgMemoryContexts::new("outbox_wait");
    loop {
        let due = unsafe {
            scratch.switch_to(|_| {
                let datum = pg_sys::FunctionCall0Coll(flinfo.as_ptr(), pg_sys::InvalidOid);
                bool::from_datum(datum, false).unwrap_or(false)
            })
        };
        unsafe { scratch.reset() };
        if due {
            return true;
        }
        let next_look = (Instant::now() + poll).min(deadline);
        loop {
            if woken() {
                return true;
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            if now >= next_look {
                break;
            }
            let wait_ms = (next_look - now).as_millis().max(1) as std::ffi::c_long;
            unsafe {
                pg_sys::WaitLatch(
                    pg_sys::MyLatch,
                    (pg_sys::WL_LATCH_SET | pg_sys::WL_TIMEOUT | pg_sys::WL_EXIT_ON_PM_DEATH)
                        as i32,
                    wait_ms,
                    pg_sys::PG_WAIT_EXTENSION,
                );
                pg_sys::ResetLatch(pg_sys::MyLatch);
            }
            // statement_timeout, pg_cancel_backend and pg_terminate_backend end the wait here.
            pg_sys::check_for_interrupts!();
        }
    }
}

/// The Rust half of `outbox_enqueue`: checks the topic (format and `outbox.allowed_topics`),
/// remembers that this transaction enqueued (for the wake-up at commit) and returns whether the
/// event keeps its key's order. One call instead of three.
#[pg_extern(volatile, parallel_unsafe)]
pub fn outbox_enqueue_begin(topic: Option<&str>, key: Option<&str>) -> bool {
    crate::producer::outbox_check_topic(topic);
    note_enqueue();
    match (topic, key) {
        (Some(topic), Some(_)) => crate::producer::outbox_topic_ordered(topic),
        _ => false,
    }
}
