//! Markdown helpers.

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

/// One goal from issue 5, compared with what this run measured.
pub struct Goal {
    pub name: String,
    pub target: String,
    pub measured: String,
    /// None: not measured in this run.
    pub met: Option<bool>,
    pub note: String,
}

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
