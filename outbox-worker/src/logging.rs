//! Logging set-up: tracing to stderr as text or one JSON object a line, filtered with
//! `RUST_LOG`-style directives (`info`, `warn,librdkafka=debug`, `outbox_worker::claim=trace`).

use std::io::IsTerminal;

use rdkafka::config::RDKafkaLogLevel;
use tracing_subscriber::EnvFilter;

use crate::cli::LogFormat;
use crate::defaults;

/// Installs the global subscriber. `directives`: `--log-level`, else `RUST_LOG`, else
/// [`defaults::LOG_LEVEL`]. The error is one line naming the bad filter.
pub fn init(directives: Option<&str>, format: LogFormat) -> Result<(), String> {
    let text = match directives {
        Some(d) => d.to_string(),
        None => std::env::var("RUST_LOG").unwrap_or_else(|_| defaults::LOG_LEVEL.to_string()),
    };
    let filter = parse_filter(&text)?;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // A failed write (stderr closed: EPIPE) is not reported with eprintln!, which panics on
        // the same closed stderr, in whichever task or librdkafka thread was logging.
        .log_internal_errors(false);
    match format {
        LogFormat::Text => builder.with_ansi(std::io::stderr().is_terminal()).init(),
        // Fields (message included) at the top level: what log shippers index without
        // configuration; a fleet's database name under "span" (absent with one database).
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_span_list(false)
            .init(),
    }
    Ok(())
}

/// Parses the directives; `warning` is accepted for `warn`, as `--log-level` always did.
fn parse_filter(text: &str) -> Result<EnvFilter, String> {
    let normalized: Vec<String> = text
        .split(',')
        .map(|d| {
            let d = d.trim();
            match d.rsplit_once('=') {
                Some((target, level)) if level.eq_ignore_ascii_case("warning") => {
                    format!("{target}=warn")
                }
                None if d.eq_ignore_ascii_case("warning") => "warn".to_string(),
                _ => d.to_string(),
            }
        })
        .collect();
    EnvFilter::builder()
        .parse(normalized.join(","))
        .map_err(|e| {
            format!(
                "invalid log filter {text:?}: {e} (e.g. info, debug, warn,librdkafka=debug, outbox_worker::claim=trace)"
            )
        })
}

/// librdkafka's log level: the most verbose the filter lets through for target `librdkafka`, so it
/// formats no line that would be dropped. Its debug lines also need the `debug` property (e.g.
/// `--kafka-property debug=broker,msg`).
pub fn librdkafka_log_level() -> RDKafkaLogLevel {
    use tracing::{enabled, Level};
    if enabled!(target: "librdkafka", Level::DEBUG) {
        RDKafkaLogLevel::Debug
    } else if enabled!(target: "librdkafka", Level::INFO) {
        RDKafkaLogLevel::Info
    } else if enabled!(target: "librdkafka", Level::WARN) {
        RDKafkaLogLevel::Warning
    } else if enabled!(target: "librdkafka", Level::ERROR) {
        RDKafkaLogLevel::Critical
    } else {
        RDKafkaLogLevel::Emerg
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_and_directives_parse_and_nonsense_does_not() {
        for ok in [
            "info",
            "warning",
            "WARN",
            "off",
            "warn,librdkafka=debug",
            "x::y=warning",
        ] {
            assert!(parse_filter(ok).is_ok(), "{ok}");
        }
        let e = parse_filter("info,librdkafka=loud").expect_err("bad level");
        assert!(e.contains("librdkafka=loud"), "{e}");
    }

    #[test]
    fn librdkafka_follows_the_filter_of_its_target() {
        for (filter, want) in [
            ("info", RDKafkaLogLevel::Info),
            ("warn", RDKafkaLogLevel::Warning),
            ("warn,librdkafka=debug", RDKafkaLogLevel::Debug),
            ("debug,librdkafka=error", RDKafkaLogLevel::Critical),
            ("off", RDKafkaLogLevel::Emerg),
        ] {
            let subscriber = tracing_subscriber::fmt()
                .with_env_filter(parse_filter(filter).expect("filter"))
                .finish();
            let got = tracing::subscriber::with_default(subscriber, librdkafka_log_level);
            assert_eq!(got as i32, want as i32, "{filter}");
        }
    }
}
