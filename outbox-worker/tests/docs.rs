//! The lists in docs/relay.md, docs/reference.md and README.md that mirror the code and need no
//! running server: the flags of `run` with their variables and defaults, the config file's fields,
//! the operator commands, the SQL functions' arguments and defaults and the view's columns. Each
//! test fails when the code and the page differ, naming what is missing on which side. (The
//! metrics, the settings and the privileges are checked against a running relay and server:
//! relay_kafka, sql_errors, sql_security.)

use std::collections::BTreeSet;
use std::path::Path;

use clap::CommandFactory;
use outbox_worker::cli::Cli;
use outbox_worker::config::ConfigFile;
use outbox_worker::defaults;

fn read(path: &str) -> String {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(path);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// The lines of `page` from the heading that starts with `heading` to the next heading of the
/// same or a higher level.
fn section<'a>(page: &'a str, heading: &str) -> Vec<&'a str> {
    let level = heading.chars().take_while(|c| *c == '#').count();
    let mut lines = page.lines().skip_while(|l| !l.starts_with(heading));
    let first = lines
        .next()
        .unwrap_or_else(|| panic!("no section {heading}"));
    let mut out = vec![first];
    out.extend(lines.take_while(|l| {
        let hashes = l.chars().take_while(|c| *c == '#').count();
        hashes == 0 || hashes > level || !l[hashes..].starts_with(' ')
    }));
    out
}

/// The cells of the table rows in `lines` (header and separator rows skipped).
fn rows<'a>(lines: &[&'a str]) -> Vec<Vec<&'a str>> {
    lines
        .iter()
        .filter(|l| l.starts_with('|') && !l.starts_with("|---"))
        .map(|l| l.trim_matches('|').split(" | ").map(str::trim).collect())
        .skip(1)
        .collect()
}

/// The lines of the table of `lines` whose header row starts with `header`.
fn table<'a>(lines: &[&'a str], header: &str) -> Vec<&'a str> {
    let start = lines
        .iter()
        .position(|l| l.starts_with(header))
        .unwrap_or_else(|| panic!("no table {header}"));
    lines[start..]
        .iter()
        .take_while(|l| l.starts_with('|'))
        .copied()
        .collect()
}

/// The text of the first `code` span of `cell`.
fn first_code(cell: &str) -> Option<&str> {
    cell.split('`').nth(1)
}

#[test]
fn the_flag_table_lists_every_flag_of_run_with_its_variable_and_default() {
    let mut cli = Cli::command();
    cli.build();
    let run = cli.find_subcommand("run").expect("run").clone();
    let page = read("docs/relay.md");
    let documented = rows(&section(&page, "## Flags (`outbox-worker run`)"));
    // Defaults that `run` derives at start (they depend on other flags), from the constants.
    let secs = |d: std::time::Duration| humantime::format_duration(d).to_string();
    let derived = [
        ("heartbeat-timeout", secs(defaults::HEARTBEAT_TIMEOUT)),
        ("live-timeout", secs(defaults::LIVE_TIMEOUT)),
        ("statement-timeout", secs(defaults::STATEMENT_TIMEOUT)),
        ("pool-timeout", secs(defaults::POOL_TIMEOUT)),
    ];
    let mut in_code = BTreeSet::new();
    for arg in run.get_arguments() {
        let Some(long) = arg.get_long() else { continue };
        if ["help", "version"].contains(&long) {
            continue;
        }
        in_code.insert(long.to_string());
        let flag = format!("--{long}");
        let row = documented
            .iter()
            .find(|r| first_code(r[0]).is_some_and(|c| c.split(' ').next() == Some(&flag)))
            .unwrap_or_else(|| panic!("docs/relay.md, Flags: no row for {flag}"));
        let env = arg.get_env().map(|e| e.to_string_lossy().to_string());
        assert_eq!(
            first_code(row[1]).map(str::to_string),
            env,
            "docs/relay.md, Flags: the variable of {flag}"
        );
        let default = row[2].replace('`', "");
        let from_code = match arg.get_default_values() {
            [v] => Some(v.to_string_lossy().to_string()),
            _ => derived
                .iter()
                .find(|(name, _)| *name == long)
                .map(|(_, d)| d.clone()),
        };
        if let Some(d) = from_code {
            assert!(
                default.starts_with(&d),
                "docs/relay.md, Flags: {flag} defaults to {d}, the table says {default:?}"
            );
        }
    }
    let in_docs: BTreeSet<String> = documented
        .iter()
        .filter_map(|r| first_code(r[0]))
        .map(|c| {
            c.split(' ')
                .next()
                .unwrap_or(c)
                .trim_start_matches("--")
                .to_string()
        })
        .collect();
    assert_eq!(
        in_docs, in_code,
        "docs/relay.md, Flags: rows vs `run`'s flags"
    );
}

#[test]
fn the_config_file_table_lists_every_field() {
    let err = toml::from_str::<ConfigFile>("[databases.a]\nnot_a_field = 1\n")
        .expect_err("an unknown field is refused")
        .to_string();
    let expected = err
        .split("expected one of ")
        .nth(1)
        .unwrap_or_else(|| panic!("serde names the fields: {err}"));
    let in_code: BTreeSet<String> = expected
        .split(", ")
        .map(|f| f.trim().trim_matches('`').to_string())
        .filter(|f| !f.is_empty())
        .collect();
    let page = read("docs/relay.md");
    let lines = section(&page, "## Many databases");
    let in_docs: BTreeSet<String> = rows(&table(&lines, "| field |"))
        .iter()
        .filter_map(|r| first_code(r[0]).map(str::to_string))
        .collect();
    assert_eq!(in_docs, in_code, "docs/relay.md, Many databases: fields");
}

/// `outbox-worker NAME` (and `inbox stats`) for every command but `run`.
fn operator_commands() -> BTreeSet<String> {
    let cli = Cli::command();
    let mut out = BTreeSet::new();
    for c in cli.get_subcommands().filter(|c| c.get_name() != "run") {
        let subs: Vec<_> = c.get_subcommands().map(|s| s.get_name()).collect();
        if subs.is_empty() {
            out.insert(c.get_name().to_string());
        }
        for s in subs {
            out.insert(format!("{} {s}", c.get_name()));
        }
    }
    out
}

/// The commands `outbox-worker X [Y]` that the code blocks of `lines` show, but `run`.
fn commands_shown(lines: &[&str], known: &BTreeSet<String>) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut in_code = false;
    for l in lines {
        if l.starts_with("```") {
            in_code = !in_code;
            continue;
        }
        let Some(rest) = l.trim().strip_prefix("outbox-worker ").filter(|_| in_code) else {
            continue;
        };
        let words: Vec<&str> = rest.split_whitespace().take(2).collect();
        let two = words.join(" ");
        match words.first() {
            Some(&"run") | None => {}
            _ if known.contains(&two) => {
                out.insert(two);
            }
            Some(w) => {
                out.insert(w.to_string());
            }
        }
    }
    out
}

#[test]
fn every_operator_command_is_documented_and_every_documented_one_exists() {
    let known = operator_commands();
    let relay = read("docs/relay.md");
    let readme = read("README.md");
    let pages = [
        (
            "docs/relay.md, Operator commands",
            section(&relay, "## Operator commands"),
        ),
        (
            "README.md, The relay",
            section(&readme, "## The relay: `outbox-worker`"),
        ),
    ];
    for (name, lines) in pages {
        assert_eq!(commands_shown(&lines, &known), known, "{name}");
    }
}

#[test]
fn the_operator_commands_variables_are_listed() {
    let cli = Cli::command();
    let mut in_code = BTreeSet::new();
    for c in cli.get_subcommands().filter(|c| c.get_name() != "run") {
        let subs: Vec<_> = c.get_subcommands().cloned().collect();
        for c in std::iter::once(c.clone()).chain(subs) {
            for a in c.get_arguments() {
                if let Some(e) = a.get_env() {
                    in_code.insert(e.to_string_lossy().to_string());
                }
            }
        }
    }
    let relay = read("docs/relay.md");
    let text = section(&relay, "## Operator commands").join("\n");
    // The connection's and the log's variables are documented with `run`'s flags.
    let common = [
        "OUTBOX_DATABASE_URL",
        "OUTBOX_DATABASE_URL_FILE",
        "OUTBOX_CONFIG",
        "OUTBOX_DATABASE",
        "OUTBOX_LOG",
        "OUTBOX_LOG_FORMAT",
    ];
    let missing: Vec<&String> = in_code
        .iter()
        .filter(|e| !common.contains(&e.as_str()) && !text.contains(&format!("`{e}`")))
        .collect();
    assert!(
        missing.is_empty(),
        "docs/relay.md, Operator commands: {missing:?} not listed"
    );
}

/// The Markdown files of the repository (not build output nor the clients' vendored packages).
fn markdown_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for e in std::fs::read_dir(dir)
        .expect("readable directory")
        .flatten()
    {
        let p = e.path();
        let name = e.file_name().to_string_lossy().to_string();
        if p.is_dir() {
            if !name.starts_with('.')
                && !["target", "node_modules", "vendor"].contains(&name.as_str())
            {
                markdown_files(&p, out);
            }
        } else if name.ends_with(".md") {
            out.push(p);
        }
    }
}

/// GitHub's anchors of the headings of a Markdown page.
fn anchors(page: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    let mut in_code = false;
    for l in page.lines() {
        if l.starts_with("```") {
            in_code = !in_code;
        }
        let Some(title) = l.strip_prefix('#').filter(|_| !in_code) else {
            continue;
        };
        let slug: String = title
            .trim_start_matches('#')
            .trim()
            .to_lowercase()
            .chars()
            .filter(|c| c.is_alphanumeric() || [' ', '-', '_'].contains(c))
            .map(|c| if c == ' ' { '-' } else { c })
            .collect();
        let mut unique = slug.clone();
        for n in 1.. {
            if !seen.contains(&unique) {
                break;
            }
            unique = format!("{slug}-{n}");
        }
        seen.insert(unique);
    }
    seen
}

/// The targets of the inline links `[text](target)` of a page, outside code blocks.
fn links(page: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut in_code = false;
    for l in page.lines() {
        if l.trim_start().starts_with("```") {
            in_code = !in_code;
            continue;
        }
        if in_code {
            continue;
        }
        for part in l.split("](").skip(1) {
            if let Some(end) = part.find(')') {
                out.push(part[..end].to_string());
            }
        }
    }
    out
}

#[test]
fn every_relative_link_of_the_docs_resolves() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut files = Vec::new();
    markdown_files(&root, &mut files);
    assert!(files.len() > 10, "found the pages: {files:?}");
    let mut broken = Vec::new();
    for f in &files {
        let page = std::fs::read_to_string(f).expect("a page");
        let rel = f.strip_prefix(&root).unwrap_or(f).display().to_string();
        for target in links(&page) {
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            let (path, anchor) = target.split_once('#').unwrap_or((&target, ""));
            let dest = match path {
                "" => f.clone(),
                p => f.parent().expect("a directory").join(p),
            };
            if !dest.exists() {
                broken.push(format!("{rel}: {target} (no such file)"));
            } else if !anchor.is_empty() && dest.extension().is_some_and(|e| e == "md") {
                let text = std::fs::read_to_string(&dest).expect("the linked page");
                if !anchors(&text).contains(anchor) {
                    broken.push(format!("{rel}: {target} (no such heading)"));
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

/// `outbox_X` → its arguments as the install SQL declares them (`name type [DEFAULT value]`),
/// output arguments left out; the functions written in Rust as the SQL-only build declares them.
fn sql_signatures() -> std::collections::BTreeMap<String, Vec<String>> {
    let mut out = std::collections::BTreeMap::new();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../sql");
    let files = std::fs::read_dir(&root)
        .expect("sql/")
        .chain(std::fs::read_dir(root.join("sql-only")).expect("sql/sql-only/"));
    for e in files.flatten() {
        let p = e.path();
        if p.extension().is_none_or(|x| x != "sql") {
            continue;
        }
        let text = std::fs::read_to_string(&p).expect("an SQL file");
        for part in text.split("CREATE FUNCTION @extschema@.").skip(1) {
            let (name, rest) = part.split_once('(').expect("a signature");
            let args = &rest[..rest.find(')').expect("the end of the signature")];
            let args = args
                .split(',')
                .map(|a| a.split_whitespace().collect::<Vec<_>>().join(" "))
                .filter(|a| !a.is_empty() && !a.starts_with("OUT "))
                .collect();
            out.insert(name.to_string(), args);
        }
    }
    out
}

#[test]
fn the_sql_api_table_gives_each_function_its_arguments_and_defaults() {
    let sql = sql_signatures();
    let page = read("docs/reference.md");
    let lines = section(&page, "## SQL API");
    for row in rows(&table(&lines, "| function |")) {
        let call = first_code(row[0]).expect("a function in code");
        let (name, args) = call.split_once('(').expect("name(args)");
        let declared = sql
            .get(name)
            .unwrap_or_else(|| panic!("docs/reference.md, SQL API: {name} is not in sql/"));
        let args = args.trim_end_matches(')');
        let shown: Vec<&str> = args.split(", ").filter(|a| !a.is_empty()).collect();
        assert_eq!(
            shown.len(),
            declared.len(),
            "docs/reference.md, SQL API: the arguments of {name}: {shown:?} vs {declared:?}"
        );
        for (doc, decl) in shown.iter().zip(declared) {
            let arg = decl.split(' ').next().expect("a name");
            let default = decl.split_once(" DEFAULT ").map(|(_, d)| d);
            match doc.split_once(" => ") {
                Some((n, d)) => assert_eq!(
                    (n, Some(d)),
                    (arg, default),
                    "docs/reference.md, SQL API: {name}'s argument {doc:?} vs `{decl}`"
                ),
                None => assert_eq!(
                    (doc.split(' ').next(), None),
                    (Some(arg), default),
                    "docs/reference.md, SQL API: {name}'s argument {doc:?} vs `{decl}`"
                ),
            }
        }
    }
}

#[test]
fn the_data_model_table_lists_the_columns_of_outbox_event() {
    let schema = read("sql/schema.sql");
    let view = schema
        .split("CREATE VIEW @extschema@.outbox_event AS")
        .nth(1)
        .expect("the view in sql/schema.sql");
    // The first branch reads outbox_scheduled as `t`, column by column.
    let select = view.split("FROM").next().expect("SELECT ... FROM");
    let in_code: BTreeSet<String> = select
        .split(',')
        .map(|c| c.trim().trim_start_matches("SELECT").trim())
        .map(|c| c.trim_start_matches("t.").to_string())
        .collect();
    let page = read("docs/reference.md");
    let lines = section(&page, "## Data model");
    let in_docs: BTreeSet<String> = rows(&table(&lines, "| column |"))
        .iter()
        .flat_map(|r| r[0].split('`').skip(1).step_by(2).map(str::to_string))
        .collect();
    assert_eq!(
        in_docs, in_code,
        "docs/reference.md, Data model: columns vs the view"
    );
}
