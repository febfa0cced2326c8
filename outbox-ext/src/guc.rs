//! The `outbox.*` settings. Registering them makes PostgreSQL validate every `SET` (type, unit and
//! range), so a nonsense value is an error at `SET` time instead of a surprise inside a relay call.

use pgrx::guc::{GucContext, GucFlags, GucRegistry, GucSetting, PostgresGucEnum};
use pgrx::prelude::*;

pub static MAX_RETRY: GucSetting<i32> = GucSetting::<i32>::new(3);
pub static BACKOFF_BASE_MS: GucSetting<i32> = GucSetting::<i32>::new(5_000);
pub static BACKOFF_MAX_MS: GucSetting<i32> = GucSetting::<i32>::new(3_600_000);
pub static BACKOFF_JITTER: GucSetting<f64> = GucSetting::<f64>::new(0.0);
pub static LEASE_MS: GucSetting<i32> = GucSetting::<i32>::new(600_000);
pub static MAX_CLAIM: GucSetting<i32> = GucSetting::<i32>::new(10_000);
pub static MAX_PAYLOAD_BYTES: GucSetting<i32> = GucSetting::<i32>::new(1_000_000);
// Off: NOTIFY serializes the commits of every notifying transaction (wake.rs); relays wait with
// outbox_wait instead. On only for a listener of the application's own.
pub static NOTIFY: GucSetting<bool> = GucSetting::<bool>::new(false);
pub static WAIT_POLL_INTERVAL_MS: GucSetting<i32> = GucSetting::<i32>::new(10);
pub static HEAD_OF_LINE: GucSetting<HeadOfLine> = GucSetting::<HeadOfLine>::new(HeadOfLine::Block);

/// `outbox.head_of_line`: what a key does when its head event becomes a dead letter. The SQL
/// reads it with `current_setting`, so only the names matter here.
#[derive(PostgresGucEnum, Clone, Copy, PartialEq, Debug)]
pub enum HeadOfLine {
    /// Later events of the key wait until an operator requeues or skips the dead head.
    #[name = c"block"]
    Block,
    /// Later events of the key go on without it.
    #[name = c"skip"]
    Skip,
}

pub fn register() {
    GucRegistry::define_int_guc(
        c"outbox.max_retry",
        c"Failed attempts after which an event becomes a dead letter (FAIL).",
        c"An event whose retry_count exceeds this value is moved to FAIL instead of WAIT.",
        &MAX_RETRY,
        0,
        1_000,
        GucContext::Userset,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"outbox.backoff_base",
        c"Backoff unit: the n-th failure waits n^2 times this.",
        c"",
        &BACKOFF_BASE_MS,
        1,
        i32::MAX,
        GucContext::Userset,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_int_guc(
        c"outbox.backoff_max",
        c"Upper bound of one backoff delay.",
        c"",
        &BACKOFF_MAX_MS,
        1,
        i32::MAX,
        GucContext::Userset,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_float_guc(
        c"outbox.backoff_jitter",
        c"Random spread of backoff delays: a factor drawn from [1 - j, 1 + j].",
        c"",
        &BACKOFF_JITTER,
        0.0,
        1.0,
        GucContext::Userset,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"outbox.lease",
        c"How long a claim may stay SENDING before outbox_reclaim takes it back.",
        c"",
        &LEASE_MS,
        1,
        i32::MAX,
        GucContext::Userset,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_int_guc(
        c"outbox.max_claim",
        c"Upper bound of max_events in one outbox_claim call.",
        c"",
        &MAX_CLAIM,
        1,
        1_000_000,
        GucContext::Userset,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"outbox.max_payload_bytes",
        c"Largest message outbox_enqueue accepts: payload (as JSON text) + key + headers, in bytes.",
        c"Keep it below the broker's message.max.bytes: oversize messages fail late and obscurely.",
        &MAX_PAYLOAD_BYTES,
        1,
        i32::MAX,
        // A producer guard: only superusers and roles granted SET on it may change it.
        GucContext::Suset,
        GucFlags::UNIT_BYTE,
    );
    GucRegistry::define_bool_guc(
        c"outbox.notify",
        c"Send NOTIFY outbox at commit of a transaction that enqueued (off: relays use outbox_wait).",
        c"NOTIFY makes notifying transactions commit one at a time; turn it on only for a LISTEN client of your own.",
        &NOTIFY,
        GucContext::Userset,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"outbox.wait_poll_interval",
        c"How often outbox_wait looks at the queue when commits cannot wake it (no shared_preload_libraries).",
        c"The wake-up latency without the preload; each look is one index probe.",
        &WAIT_POLL_INTERVAL_MS,
        1,
        60_000,
        GucContext::Userset,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_enum_guc(
        c"outbox.head_of_line",
        c"When the head event of a key is a dead letter: block the key (default) or skip the dead event.",
        c"block: later events of that key wait until an operator requeues or skips it; skip: they go on, out of order with the dead one.",
        &HEAD_OF_LINE,
        GucContext::Userset,
        GucFlags::default(),
    );
    GucRegistry::define_string_guc(
        c"outbox.unordered_topics",
        c"Topics whose keyed events are published without per-key order: comma-separated names or prefix* patterns; * = all.",
        c"Ordered keys publish one run at a time; unordered events are claimed in parallel like events without a key.",
        &crate::producer::UNORDERED_TOPICS,
        // Decided at enqueue: one producer opting out would let its events overtake other producers' events of the same key.
        GucContext::Suset,
        GucFlags::default(),
    );
    GucRegistry::define_string_guc(
        c"outbox.allowed_topics",
        c"Topics outbox_enqueue accepts: comma-separated names or prefix* patterns; empty = any.",
        c"The relay publishes with its own broker credentials: this keeps producers off other teams' and internal topics.",
        &crate::producer::ALLOWED_TOPICS,
        // A producer guard, like outbox.max_payload_bytes.
        GucContext::Suset,
        GucFlags::default(),
    );
    // After loading, a misspelt `outbox.*` name is an error instead of a silent placeholder.
    unsafe { pg_sys::MarkGUCPrefixReserved(c"outbox".as_ptr()) };
}

/// The current settings in one typed row. The SQL functions call this once per call: it also
/// guarantees the library (and so the settings) is loaded before any `outbox.*` value is read.
#[pg_extern(stable, parallel_safe)]
#[allow(clippy::type_complexity)]
pub fn outbox_config() -> TableIterator<
    'static,
    (
        name!(max_retry, i32),
        name!(backoff_base_ms, i64),
        name!(backoff_max_ms, i64),
        name!(backoff_jitter, f64),
        name!(lease_ms, i64),
        name!(max_claim, i32),
        name!(max_payload_bytes, i32),
        name!(notify, bool),
    ),
> {
    TableIterator::once((
        MAX_RETRY.get(),
        i64::from(BACKOFF_BASE_MS.get()),
        i64::from(BACKOFF_MAX_MS.get()),
        BACKOFF_JITTER.get(),
        i64::from(LEASE_MS.get()),
        MAX_CLAIM.get(),
        MAX_PAYLOAD_BYTES.get(),
        NOTIFY.get(),
    ))
}

/// `outbox.max_payload_bytes`, for `outbox_enqueue`: a scalar call is several times cheaper than
/// the `outbox_config()` row on the producer's hot path.
#[pg_extern(stable, parallel_safe)]
pub fn outbox_max_payload_bytes() -> i32 {
    MAX_PAYLOAD_BYTES.get()
}

/// `outbox.notify`, for `outbox_enqueue`.
#[pg_extern(stable, parallel_safe)]
pub fn outbox_notify_enabled() -> bool {
    NOTIFY.get()
}
