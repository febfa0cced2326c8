//! The integration, relay and fault tests, one module per file, built as one test binary:
//! `cargo nextest run --cargo-profile integration --workspace --exclude outbox relay_e2e::` runs
//! one file's tests.

mod examples;
mod fault_ci;
mod model_ordering;
mod model_state_machine;
mod package;
mod relay_admin;
mod relay_broker_shutdown;
mod relay_claim_cooldown;
mod relay_e2e;
mod relay_failover;
mod relay_faults;
mod relay_health;
mod relay_kafka;
mod relay_kafka_tls;
mod relay_logs;
mod relay_multidb;
mod relay_nats_tls;
mod relay_ordering;
mod relay_outage;
mod relay_pgbouncer;
mod relay_reconnect;
mod relay_settle;
mod relay_startup;
mod relay_timeouts;
mod relay_tls;
mod relay_wakeup;
mod sql_claim_plan;
mod sql_concurrency;
mod sql_deadlock;
mod sql_dump;
mod sql_enqueue_many;
mod sql_errors;
mod sql_hardening;
mod sql_hijack;
mod sql_inbox;
mod sql_lifecycle;
mod sql_only;
mod sql_ordering;
mod sql_security;
mod sql_upgrade;
mod sql_wakeup;
