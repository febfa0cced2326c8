//! What a run measured, section by section: what the report and the goals are made from.

use crate::{broker_drain, enqueue, latency, null_sink, seed};

/// Everything the report needs, filled in section by section.
#[derive(Default)]
pub struct Results {
    pub enqueue: Option<enqueue::EnqueueSummary>,
    pub matrix: Vec<null_sink::DrainRun>,
    pub sync_off: Option<null_sink::DrainRun>,
    pub headline: Option<null_sink::DrainRun>,
    pub health_md: Option<String>,
    pub contention: Vec<null_sink::DrainRun>,
    pub seed: Vec<seed::SeedRun>,
    pub seed_compare: Option<null_sink::DrainRun>,
    pub broker: Vec<broker_drain::BrokerDrain>,
    pub latency: Vec<latency::LatencyRun>,
    pub broker_note: Option<String>,
    pub failures: Vec<String>,
}
