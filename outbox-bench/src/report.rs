//! The markdown report: its frame (machine, goals, recommendations, reproduce) around each
//! section's own markdown, and the table and number helpers.

use std::path::Path;
use std::time::Duration;

use crate::goals::recommendations;
use crate::results::Results;
use crate::{
    broker_drain, contention, held_snapshot, idle, inbox, latency, lifecycle, null_sink, ordering,
    seed, Profile,
};

pub struct Table {
    head: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(head: &[&str]) -> Self {
        Table {
            head: head.iter().map(|s| s.to_string()).collect(),
            rows: Vec::new(),
        }
    }

    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    pub fn render(&self) -> String {
        let mut s = format!("| {} |\n", self.head.join(" | "));
        s += &format!(
            "|{}\n",
            self.head
                .iter()
                .enumerate()
                .map(|(i, _)| if i == 0 { "---|" } else { "---:|" })
                .collect::<String>()
        );
        for r in &self.rows {
            s += &format!("| {} |\n", r.join(" | "));
        }
        s
    }
}

/// The text of a broker section that did not run: why (the failure, `--no-broker`) or that it was
/// not selected.
pub fn not_run(r: &Results) -> String {
    format!(
        "Not run: {}.\n",
        r.broker_note.as_deref().unwrap_or("section not selected")
    )
}

/// Median of the values (NaN for none): the figure of interleaved rounds on a shared machine.
pub fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// 12345.6 -> "12,346"
pub fn num(x: f64) -> String {
    if !x.is_finite() {
        return "n/a".into();
    }
    let n = x.round() as i64;
    let digits = n.unsigned_abs().to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    if n < 0 {
        format!("-{out}")
    } else {
        out
    }
}

/// Microseconds as milliseconds with sensible precision.
pub fn ms(us: f64) -> String {
    let m = us / 1000.0;
    if m >= 100.0 {
        format!("{m:.0}")
    } else if m >= 10.0 {
        format!("{m:.1}")
    } else {
        format!("{m:.2}")
    }
}

pub fn pct(x: f64) -> String {
    format!("{x:.1} %")
}

pub fn bytes(b: i64) -> String {
    let b = b as f64;
    if b >= 1024.0 * 1024.0 * 1024.0 {
        format!("{:.2} GiB", b / 1024.0 / 1024.0 / 1024.0)
    } else if b >= 1024.0 * 1024.0 {
        format!("{:.1} MiB", b / 1024.0 / 1024.0)
    } else if b >= 1024.0 {
        format!("{:.0} KiB", b / 1024.0)
    } else {
        format!("{b:.0} B")
    }
}

/// One goal of issue 5 or 10, compared with what this run measured.
pub struct Goal {
    pub name: String,
    pub target: String,
    pub measured: String,
    /// None: not measured in this run.
    pub met: Option<bool>,
    pub note: String,
}

impl Goal {
    /// A goal whose section did not run in this profile.
    pub fn not_measured(name: impl Into<String>, target: String) -> Goal {
        Goal {
            name: name.into(),
            target,
            measured: "—".into(),
            met: None,
            note: "not run in this profile".into(),
        }
    }
}

/// What stops each of issue 10's goals that can miss, and what would lift it (printed under the
/// goals table when one of them missed; the figures are the table's).
const ISSUE10_LIMITS: &str = "
### What stops the missed `[10]` goals, and what would lift them

- **Producer throughput and set-based enqueue CPU.** The limit is server CPU per event: \
  `outbox_enqueue` checks its arguments and runs its own INSERT through SPI (an executor start per \
  event) where a set-based INSERT starts one for all rows. With 16 clients on 2 cores shared with \
  the relay and the broker, transactions are CPU-bound, so the ratio follows that extra work. \
  Lifts: `outbox_enqueue_many` for many events in one statement; events that need no order on \
  topics listed in `outbox.unordered_topics` change little now (an ordered event only adds its \
  key's hash); on a server where commits \
  wait for the WAL flush rather than for CPU, the fixed cost of a transaction dominates and the \
  ratio moves towards 1.
- **Latency.** A round is a claim, the publish with `acks=all` until its delivery reports, and \
  an ack, one after the other; an event committed during a round waits for it to end (section 3, \
  \"Where the time goes\", commit → claim). On 2 cores that also run the broker, the producers and \
  the consumer, each stage slows with the load, so the tails and the higher rates follow the \
  machine's CPU. Lift: the broker and the database on cores of their own.
- **Without `shared_preload_libraries`** (polling): the wait probes the queue every \
  `outbox.wait_poll_interval` (10 ms), which costs the idle server more than 1 % of a core and \
  adds up to a poll interval of latency. Lift: preload the library (the `commit` rows), or a \
  longer poll interval where latency matters less than idle CPU.
";

pub fn goals_table(goals: &[Goal]) -> String {
    let mut t = Table::new(&[
        "goal",
        "target",
        "measured",
        "verdict",
        "by how much / limit",
    ]);
    for g in goals {
        t.row(vec![
            g.name.clone(),
            g.target.clone(),
            g.measured.clone(),
            match g.met {
                Some(true) => "**met**".into(),
                Some(false) => "**missed**".into(),
                None => "not measured".into(),
            },
            g.note.clone(),
        ]);
    }
    t.render()
}

/// A histogram of microseconds from 1 µs to 1 hour, 3 significant digits.
pub fn hist() -> hdrhistogram::Histogram<u64> {
    hdrhistogram::Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("histogram bounds")
}

pub fn render(
    p: &Profile,
    r: &Results,
    goals: &[Goal],
    env: &str,
    took: Duration,
    flags: &str,
    readme: &str,
) -> String {
    let mut s = String::new();
    s += "# Benchmarks\n\n";
    s += &format!(
        "Generated by `scripts/bench --{}{flags}` (the `outbox-bench` binary) in {:.0} s; every figure below \
         comes from that run. Database, broker, relay and the load generator share the machine, \
         so absolute numbers drift between runs; compare ratios within one report.\n\n",
        p.name,
        took.as_secs_f64()
    );
    s += "## Machine\n\n";
    s += env;
    s += "\n## Goals\n\n";
    s += "Each goal names its issue (`[10]`: issue 10). Issues 10, 28 and 29's goals are judged \
          with the settings the extension and relay ship with; issue 9's on the extension's \
          default version. Figures from rounds are medians (the machine is shared).\n\n";
    s += &goals_table(goals);
    if goals
        .iter()
        .any(|g| g.name.starts_with("[10]") && g.met == Some(false))
    {
        s += ISSUE10_LIMITS;
    }
    s += "\n## Recommended relay defaults\n\n";
    s += &recommendations(r);
    s += "\n\n## 1. Enqueue cost\n\n";
    match &r.enqueue {
        Some(e) => s += &e.markdown,
        None => s += "Not run.\n",
    }
    s += "\n## 2. Drain throughput\n\n### Null sink (claim → ack, no broker)\n\n";
    s += &null_sink::markdown(p, r);
    s += "\n### Through the relay to the local broker\n\n";
    s += &broker_drain::markdown(p, r);
    s += "\n## 3. Commit-to-broker latency (wake-up without NOTIFY)\n\n";
    s += &latency::markdown(p, r);
    s += "\n## 4. Claim contention\n\n";
    s += &contention::markdown(p, r);
    s += "\n## 5. Seed design baseline\n\n";
    s += &seed::markdown(p, r);
    s += "\n## 6. Table health after the drain\n\n";
    match &r.health_md {
        Some(h) => s += h,
        None => s += "Not run.\n",
    }
    s += "\n## 7. Per-key order\n\n";
    s += &ordering::markdown(p, r);
    s += "\n## 8. Idle relay cost\n\n";
    s += &idle::markdown(p, r);
    s += "\n## 9. The life cycle of an event\n\n";
    s += &lifecycle::markdown(r);
    s += "\n## 10. Long transactions\n\n";
    s += &held_snapshot::markdown(r);
    s += "\n## 11. The consumer's inbox\n\n";
    s += &inbox::markdown(r);
    if let Some(md) = &r.indexes_md {
        s += "\n## 12. Index comparison (the full-size report is INDEXES.md)\n\n";
        s += md;
    }
    s += &failures(r);
    s += &format!(
        "\n## Reproduce\n\nThe same figures, unrounded, are in `BENCHMARKS.json` next to this file \
         (`--json PATH` writes them elsewhere; keys in `outbox-bench/src/results.rs`). The commands \
         of every report: [reports/README.md]({readme}).\n"
    );
    s
}

/// The link to reports/README.md from the folder of a report written to `out` (printed only: as
/// if it were in reports/): the README of the checkout the report goes into, else of the one the
/// bench runs in, never of the one it was built in (a shared target dir builds elsewhere).
pub fn readme_link(out: Option<&Path>) -> String {
    let folder = |o: &Path| std::path::absolute(o).ok()?.parent()?.canonicalize().ok();
    let link = |dir: std::path::PathBuf| {
        let readme = dir
            .ancestors()
            .map(|a| a.join("reports/README.md"))
            .chain(
                std::env::current_dir()
                    .ok()
                    .map(|c| c.join("reports/README.md")),
            )
            .find(|r| r.is_file())?;
        pathdiff::diff_paths(readme.canonicalize().ok()?, &dir)
    };
    out.and_then(folder)
        .and_then(link)
        .map_or_else(|| "README.md".to_string(), |rel| rel.display().to_string())
}

fn failures(r: &Results) -> String {
    let mut s = String::new();
    if !r.failures.is_empty() {
        s += "\n## Failures in this run\n\n";
        for f in &r.failures {
            s += &format!("- {f}\n");
        }
    }
    s
}

/// The report of a section run alone (`--only indexes`: reports/INDEXES.md, `--only fairness`:
/// reports/FAIRNESS.md): (title, section name, its markdown, the JSON file's name).
pub fn render_own(
    p: &Profile,
    r: &Results,
    (title, section, md, json): (&str, &str, Option<&str>, &str),
    env: &str,
    took: Duration,
) -> String {
    let mut s = format!(
        "# {title}\n\nGenerated by `scripts/bench --{} --only {section}` \
         (the `outbox-bench` binary, `outbox-bench/src/{section}.rs`) in {:.0} s; every figure below, \
         and the conclusion, comes from that run. The same figures, unrounded, are in \
         `{json}` next to this file.\n\n## Machine\n\n{env}\n## Result\n\n",
        p.name,
        took.as_secs_f64()
    );
    s += md.unwrap_or("Not run.\n");
    s += &failures(r);
    s
}

#[cfg(test)]
mod tests {
    use super::readme_link;
    use std::path::Path;

    #[test]
    fn a_reports_readme_link_resolves_from_where_the_report_is_written() {
        let reports = Path::new(env!("CARGO_MANIFEST_DIR")).join("../reports");
        assert_eq!(readme_link(Some(&reports.join("X.md"))), "README.md");
        assert_eq!(
            readme_link(Some(&reports.join("core-1.0/x.md"))),
            "../README.md"
        );
        assert_eq!(readme_link(None), "README.md");
    }

    #[test]
    fn the_link_goes_to_the_checkout_the_report_is_written_into() {
        let other = std::env::temp_dir().join(format!("outbox-readme-link-{}", std::process::id()));
        std::fs::create_dir_all(other.join("reports/core-1.0")).expect("mkdir");
        std::fs::write(other.join("reports/README.md"), "").expect("write");
        let link = readme_link(Some(&other.join("reports/core-1.0/x.md")));
        std::fs::remove_dir_all(&other).expect("cleanup");
        assert_eq!(link, "../README.md");
    }
}
