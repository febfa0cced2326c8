//! Claim contention (report section 4): N concurrent claim loops on one table; every claimed id is
//! checked for double claims.

use anyhow::Result;
use std::time::Duration;
use tokio_postgres::Client;

use outbox_tests::db::TestDb;

use crate::null_sink::{self, check_drain};
use crate::report::num;
use crate::results::Results;
use crate::Profile;

pub async fn run(p: &Profile, db: &TestDb, monitor: &Client, r: &mut Results) -> Result<()> {
    progress!("==> 4. claim contention");
    for &n in &p.claimers {
        progress!("  {n} claimer(s), batch {}", p.contention_batch);
        let run = null_sink::drain(
            db,
            monitor,
            n,
            p.contention_batch,
            p.contention_backlog,
            Duration::from_secs(600),
            p.sessions(false),
        )
        .await?;
        check_drain(
            &run,
            &format!("contention with {n} claimers"),
            true,
            &mut r.failures,
        );
        r.contention.push(run);
    }
    Ok(())
}

pub fn markdown(p: &Profile, r: &Results) -> String {
    let mut s = String::new();
    if r.contention.is_empty() {
        s += "Not run.\n";
    } else {
        let base = r.contention[0].rate();
        s += &format!(
            "N concurrent claim loops (null sink, batch {}) on one table with {} due events; every \
             claimed id is collected and checked for duplicates.\n\n",
            p.contention_batch,
            num(p.contention_backlog as f64)
        );
        s += &null_sink::drain_table(&r.contention);
        s += &format!(
            "\nThroughput relative to 1 claimer: {}. Double claims in total: **{}**.\n",
            r.contention
                .iter()
                .map(|c| format!("{} → {:.2}×", c.loops, c.rate() / base))
                .collect::<Vec<_>>()
                .join(", "),
            r.contention.iter().map(|c| c.duplicates).sum::<usize>()
        );
    }
    s
}
