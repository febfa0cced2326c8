//! Shared harness for the integration tests and outbox-bench: every test gets its own database on
//! the real server, with the installed extension, dropped again when the test ends (so a broken
//! run cannot poison the next one). The relay tests also get their own broker and run the real
//! relay binary.

pub mod broker;
pub mod build;
pub mod certs;
pub mod db;
pub mod events;
pub mod fault;
pub mod in_flight;
pub mod kafka;
pub mod model;
pub mod nats;
pub mod pg_cluster;
pub mod pgbouncer;
pub mod provenance;
pub mod proxy;
pub mod relay;
pub mod rocketmq;
pub mod roles;
pub mod sinks;
