//! What the two property tests against the real extension share (`model_state_machine.rs`,
//! `model_ordering.rs`).

/// `OUTBOX_MODEL_CASES`, `OUTBOX_MODEL_STEPS`: a number from the environment, or the default.
pub fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}
