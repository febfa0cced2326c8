//! Shared harness for the integration tests: every test gets its own database on the real server,
//! with the installed extension, dropped again when the test ends (so a broken run cannot poison
//! the next one).

pub mod db;
