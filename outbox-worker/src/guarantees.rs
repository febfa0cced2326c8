//! The producer settings that at-least-once delivery and per-key order rest on. The relay sets
//! them itself; a `--kafka-property` (or properties file line) that would undo one is refused at
//! start with one line naming the property and what it would break.

use crate::Fatal;

/// A property's name as librdkafka resolves it: a topic-level property may be given with the
/// `topic.` prefix (`topic.acks`), and some have an alias.
pub fn canonical(key: &str) -> &str {
    let key = match key.strip_prefix("topic.") {
        Some(rest) if TOPIC_LEVEL.contains(&rest) => rest,
        _ => key,
    };
    match key {
        "request.required.acks" => "acks",
        "max.in.flight" => "max.in.flight.requests.per.connection",
        "delivery.timeout.ms" => "message.timeout.ms",
        other => other,
    }
}

/// The topic-level properties among those checked here.
const TOPIC_LEVEL: [&str; 6] = [
    "acks",
    "request.required.acks",
    "queuing.strategy",
    "partitioner",
    "message.timeout.ms",
    "delivery.timeout.ms",
];

/// Refuses the first property that would break at-least-once delivery or per-partition order.
pub fn check(props: &[(String, String)]) -> Result<(), Fatal> {
    for (key, value) in props {
        if let Some(why) = breaks_guarantee(canonical(key), &value.trim().to_ascii_lowercase()) {
            return Err(Fatal::usage(format!(
                "Kafka property {key}={value} is refused: {why}"
            )));
        }
    }
    Ok(())
}

/// Why `key=value` (canonical key, lower-case value) breaks a guarantee, or None.
fn breaks_guarantee(key: &str, value: &str) -> Option<&'static str> {
    let ok = match key {
        "acks" => matches!(value, "all" | "-1"),
        "enable.idempotence" => matches!(value, "true" | "t" | "1"),
        "max.in.flight.requests.per.connection" => value == "1",
        "queuing.strategy" => value == "fifo",
        "partitioner" => value != "random",
        "delivery.report.only.error" => !matches!(value, "true" | "t" | "1"),
        "enable.gapless.guarantee" => matches!(value, "true" | "t" | "1"),
        "transactional.id" => false,
        _ => true,
    };
    (!ok).then(|| reason(key))
}

fn reason(key: &str) -> &'static str {
    match key {
        "acks" => {
            "the relay acks an event once Kafka confirmed it with acks=all (-1); with fewer \
             acknowledgements a confirmed event can still be lost"
        }
        "enable.idempotence" => {
            "the relay needs the idempotent producer (enable.idempotence=true): without it \
             librdkafka's retries can reorder or duplicate a partition's events"
        }
        "max.in.flight.requests.per.connection" => {
            "with more than one request in flight, a later event of a key can be written while \
             the broker rejects an earlier one"
        }
        "queuing.strategy" => "only fifo keeps the events of a key in commit order",
        "partitioner" => {
            "random spreads the events of one key over several partitions, losing their order"
        }
        "delivery.report.only.error" => {
            "the relay acks an event on its delivery report; without reports for successes no \
             event would ever be acked"
        }
        "enable.gapless.guarantee" => {
            "without it a batch the broker rejects lets later events of the same keys through \
             (the producer bumps its epoch and sends them on), out of commit order"
        }
        "transactional.id" => {
            "the relay's producer is idempotent, not transactional: it never begins a \
             transaction, so every publish would fail"
        }
        _ => "it breaks the relay's delivery guarantee",
    }
}

/// `--kafka-property` pairs as the relay holds them, from literals: the tests' input.
#[cfg(test)]
pub(crate) fn props(list: &[(&str, &str)]) -> Vec<(String, String)> {
    list.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_that_keep_the_guarantees_pass() {
        let ok = props(&[
            ("acks", "all"),
            ("acks", "-1"),
            ("request.required.acks", "ALL"),
            ("enable.idempotence", "true"),
            ("max.in.flight", "1"),
            ("queuing.strategy", "fifo"),
            ("partitioner", "murmur2"),
            ("delivery.report.only.error", "false"),
            ("enable.gapless.guarantee", "true"),
            ("linger.ms", "5"),
            ("topic.metadata.refresh.interval.ms", "1000"),
        ]);
        assert!(check(&ok).is_ok());
    }

    #[test]
    fn settings_that_break_them_are_refused_by_name() {
        for (k, v, says) in [
            ("acks", "1", "acks=all"),
            ("acks", "0", "acks=all"),
            ("request.required.acks", "1", "acks=all"),
            ("topic.acks", "1", "acks=all"),
            ("topic.request.required.acks", "0", "acks=all"),
            ("enable.idempotence", "false", "idempotent"),
            ("max.in.flight.requests.per.connection", "2", "in flight"),
            ("max.in.flight", "1000000", "in flight"),
            ("queuing.strategy", "lifo", "fifo"),
            ("topic.partitioner", "random", "one key"),
            ("delivery.report.only.error", "true", "delivery report"),
            ("transactional.id", "relay-1", "transactional"),
            ("enable.gapless.guarantee", "false", "out of commit order"),
        ] {
            let e = check(&props(&[("linger.ms", "1"), (k, v)])).expect_err(k);
            assert_eq!(e.code, 2, "{k}");
            assert!(
                e.message
                    .starts_with(&format!("Kafka property {k}={v} is refused: ")),
                "{}",
                e.message
            );
            assert!(e.message.contains(says), "{}", e.message);
            assert!(!e.message.contains('\n'), "one line: {}", e.message);
        }
    }

    #[test]
    fn topic_prefix_and_aliases_resolve_to_the_checked_names() {
        assert_eq!(canonical("topic.acks"), "acks");
        assert_eq!(canonical("topic.delivery.timeout.ms"), "message.timeout.ms");
        assert_eq!(
            canonical("max.in.flight"),
            "max.in.flight.requests.per.connection"
        );
        assert_eq!(
            canonical("topic.metadata.refresh.interval.ms"),
            "topic.metadata.refresh.interval.ms"
        );
    }
}
