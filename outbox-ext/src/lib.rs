//! `outbox`: the transactional outbox as a PostgreSQL extension.
//!
//! The data path (enqueue, claim, ack, nack, renew, reclaim, requeue, purge, stats) is plain SQL in
//! the repository's top-level `sql/`, each call a single guarded statement. Rust owns what SQL
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
    "../../sql/functions.sql",
    name = "functions",
    requires = [
        "schema",
        client::outbox_client_connected,
        guc::outbox_config,
        guc::outbox_max_payload_bytes,
        guc::outbox_notify_enabled,
        producer::outbox_check_topic,
        producer::outbox_topic_ordered,
        producer::outbox_xact_late_bound,
        wake::outbox_enqueue_begin,
        wake::outbox_wait_for,
        wake::outbox_wake_mode
    ],
);
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
    fn enqueue_claim_ack_round_trip() {
        // A pg_test runs in one transaction, and a claim hands out only committed stream events:
        // an event due a moment later is a tracked row, which a claim in the same transaction sees.
        let id = Spi::get_one::<i64>(
            "SELECT outbox_enqueue('orders', '{\"id\":1}', key => 'A-1', \
             deliver_at => clock_timestamp() + interval '1 millisecond')",
        )
        .unwrap()
        .unwrap();
        Spi::run("SELECT pg_sleep(0.01)").unwrap();
        let (claimed, token) =
            Spi::get_two::<i64, i64>("SELECT id, claim_token FROM outbox_claim('relay-a', 5)")
                .unwrap();
        assert_eq!(claimed, Some(id));
        let acked = Spi::get_one::<i32>(&format!(
            "SELECT outbox_ack('relay-a', {}, ARRAY[{id}]::bigint[])",
            token.unwrap()
        ))
        .unwrap();
        assert_eq!(acked, Some(1));
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
