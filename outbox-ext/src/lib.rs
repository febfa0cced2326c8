//! `outbox`: the transactional outbox as a PostgreSQL extension.
//!
//! The data path (enqueue, claim, ack, nack, renew, reclaim, requeue, purge, stats) is plain SQL in
//! the repository's top-level `sql/`, one file per concern (docs/design.md). Rust owns what SQL
//! cannot do well: registering and validating the `outbox.*` settings (`guc.rs`) and handing them
//! to the SQL layer in one typed call (`outbox_config()`), and the producer's per-event guards and
//! identity (`producer.rs`: topic names and allow-list, UUID version 7).

use pgrx::prelude::*;

mod client;
mod guc;
mod producer;
mod wake;

::pgrx::pg_module_magic!(name, version);

#[pg_guard]
pub extern "C-unwind" fn _PG_init() {
    guc::register();
    wake::init();
}

// Order matters: the table and types first, then functions that read the settings.
extension_sql_file!(
    "../../sql/schema.sql",
    name = "schema",
    requires = [producer::outbox_uuidv7]
);
extension_sql_file!(
    "../../sql/checks.sql",
    name = "checks",
    requires = [
        "schema",
        client::outbox_client_connected,
        guc::outbox_config,
        guc::outbox_max_payload_bytes,
        guc::outbox_notify_enabled,
        producer::outbox_check_topic,
        producer::outbox_topic_ordered,
        wake::outbox_enqueue_begin,
        wake::outbox_wait_for,
        wake::outbox_wake_mode
    ],
);
extension_sql_file!(
    "../../sql/enqueue.sql",
    name = "enqueue",
    requires = ["checks"]
);
extension_sql_file!("../../sql/keys.sql", name = "keys", requires = ["enqueue"]);
extension_sql_file!("../../sql/stream.sql", name = "stream", requires = ["keys"]);
extension_sql_file!("../../sql/claim.sql", name = "claim", requires = ["stream"]);
extension_sql_file!(
    "../../sql/settle.sql",
    name = "settle",
    requires = ["claim"]
);
extension_sql_file!(
    "../../sql/reclaim.sql",
    name = "reclaim",
    requires = ["settle"]
);
extension_sql_file!(
    "../../sql/admin.sql",
    name = "admin",
    requires = ["reclaim"]
);
extension_sql_file!("../../sql/inbox.sql", name = "inbox", requires = ["admin"]);
extension_sql_file!("../../sql/privileges.sql", name = "privileges", finalize);

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use pgrx::prelude::*;

    #[pg_test]
    fn settings_have_contract_defaults() {
        let row =
            Spi::get_two::<i32, i64>("SELECT max_retry, backoff_base_ms FROM outbox_config()")
                .unwrap();
        assert_eq!(row, (Some(3), Some(5_000)));
        assert_eq!(
            Spi::get_one::<i64>("SELECT lease_ms FROM outbox_config()").unwrap(),
            Some(600_000)
        );
    }

    #[pg_test]
    fn settings_follow_set_with_units() {
        Spi::run("SET outbox.backoff_base = '2s'; SET outbox.lease = '90s'").unwrap();
        assert_eq!(
            Spi::get_two::<i64, i64>("SELECT backoff_base_ms, lease_ms FROM outbox_config()")
                .unwrap(),
            (Some(2_000), Some(90_000))
        );
    }

    #[pg_test(error = "invalid value for parameter \"outbox.max_retry\": \"many\"")]
    fn nonsense_setting_is_an_error() {
        Spi::run("SET outbox.max_retry = 'many'").unwrap();
    }

    #[pg_test(
        error = "0 ms is outside the valid range for parameter \"outbox.lease\" (1 .. 2147483647)"
    )]
    fn zero_lease_is_an_error() {
        Spi::run("SET outbox.lease = 0").unwrap();
    }

    #[pg_test]
    fn enqueue_returns_the_events_id() {
        let id = Spi::get_one::<i64>("SELECT outbox_enqueue('orders', '{\"id\":1}', key => 'A-1')")
            .unwrap()
            .unwrap();
        let topic =
            Spi::get_one::<String>(&format!("SELECT topic FROM outbox_event WHERE id = {id}"))
                .unwrap();
        assert_eq!(topic.as_deref(), Some("orders"));
    }

    // A pg_test runs in one transaction, which the enqueue wrote in: the claim refuses to hand
    // out that transaction's own events (the SQL-level tests claim committed ones).
    #[pg_test(
        error = "outbox_claim: the transaction has already written; a claim must come first in its own transaction"
    )]
    fn claim_after_a_write_in_its_transaction_is_refused() {
        Spi::run("SELECT outbox_enqueue('orders', '{}')").unwrap();
        Spi::run("SELECT * FROM outbox_claim('relay-a', 5)").unwrap();
    }
}

/// Required by `cargo pgrx test`.
#[cfg(test)]
pub mod pg_test {
    pub fn setup(_options: Vec<&str>) {}

    pub fn postgresql_conf_options() -> Vec<&'static str> {
        vec![]
    }
}
