//! The producer's guards and identity: topic names (format and the operator's allow-list) and
//! the globally unique `event_id` (UUID version 7). In Rust because they run on every enqueue.

use std::ffi::CString;

use pgrx::guc::GucSetting;
use pgrx::prelude::*;

/// `outbox.allowed_topics`: comma-separated topic names or `prefix*` patterns; empty = any topic.
pub static ALLOWED_TOPICS: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);
/// `outbox.unordered_topics`: the same syntax; empty = every keyed event keeps its key's order.
pub static UNORDERED_TOPICS: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);

fn setting(s: &GucSetting<Option<CString>>) -> String {
    s.get()
        .as_deref()
        .and_then(|c| c.to_str().ok())
        .unwrap_or("")
        .to_string()
}

/// Kafka's own rule: 1 to 249 characters from `[A-Za-z0-9._-]`, not "." or "..".
fn is_topic_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 249
        && s != "."
        && s != ".."
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

fn invalid(message: String, detail: String) -> ! {
    ereport!(
        ERROR,
        PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE,
        message,
        detail
    );
}

/// Whether `topic` is allowed by the allow-list `list`; an error names a malformed entry.
fn allowed(list: &str, topic: &str) -> Result<bool, String> {
    matches(list, topic).map(|hit| hit.unwrap_or(true))
}

/// Whether `topic` matches an entry of `list` (`None` for an empty list); an error names a
/// malformed entry.
fn matches(list: &str, topic: &str) -> Result<Option<bool>, String> {
    let mut any_entry = false;
    let mut hit = false;
    for entry in list.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        any_entry = true;
        let (stem, prefix) = match entry.strip_suffix('*') {
            Some(stem) => (stem, true),
            None => (entry, false),
        };
        // `*` alone allows every topic; otherwise the stem must be spelt like a topic name.
        if !(prefix && stem.is_empty() || is_topic_name(stem)) {
            return Err(entry.to_string());
        }
        hit |= if prefix {
            topic.starts_with(stem)
        } else {
            topic == stem
        };
    }
    Ok(any_entry.then_some(hit))
}

/// Raises 22023 unless `topic` is a valid Kafka topic name allowed by `outbox.allowed_topics`.
#[pg_extern(stable, parallel_safe)]
pub fn outbox_check_topic(topic: Option<&str>) {
    let Some(topic) = topic.filter(|t| is_topic_name(t)) else {
        invalid(
            "outbox_enqueue: topic must be 1 to 249 characters from [A-Za-z0-9._-] (not \".\" or \"..\")"
                .into(),
            format!("topic = {:?}", topic.map(|t| t.chars().take(80).collect::<String>())),
        );
    };
    let list = setting(&ALLOWED_TOPICS);
    match allowed(&list, topic) {
        Ok(true) => {}
        Ok(false) => invalid(
            format!("outbox_enqueue: topic \"{topic}\" is not in outbox.allowed_topics"),
            format!("outbox.allowed_topics = '{list}'"),
        ),
        Err(entry) => invalid(
            format!(
                "outbox.allowed_topics: entry \"{entry}\" is neither a topic name nor a prefix* pattern"
            ),
            format!("outbox.allowed_topics = '{list}'"),
        ),
    }
}

/// Whether keyed events of `topic` keep their key's order: true unless `outbox.unordered_topics`
/// names the topic. Raises 22023 for a malformed list, like `outbox.allowed_topics`.
#[pg_extern(stable, parallel_safe)]
pub fn outbox_topic_ordered(topic: &str) -> bool {
    let list = setting(&UNORDERED_TOPICS);
    match matches(&list, topic) {
        Ok(hit) => !hit.unwrap_or(false),
        Err(entry) => invalid(
            format!(
                "outbox.unordered_topics: entry \"{entry}\" is neither a topic name nor a prefix* pattern"
            ),
            format!("outbox.unordered_topics = '{list}'"),
        ),
    }
}

/// A new UUID version 7 (RFC 9562: 48-bit Unix milliseconds, then random bits), the event's
/// global identity: unlike the bigint id it is never reissued by a restore, a sequence reset or
/// another database publishing to the same topic, and it sorts by creation time.
#[pg_extern(volatile, parallel_safe)]
pub fn outbox_uuidv7() -> pgrx::Uuid {
    pgrx::Uuid::from_bytes(*uuid::Uuid::now_v7().as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allow_list_matches_names_and_prefixes() {
        assert_eq!(allowed("", "anything"), Ok(true));
        assert_eq!(allowed(" , ", "anything"), Ok(true));
        assert_eq!(allowed("orders, payments", "orders"), Ok(true));
        assert_eq!(allowed("orders, payments", "orders.v2"), Ok(false));
        assert_eq!(allowed("orders.*", "orders.v2"), Ok(true));
        assert_eq!(allowed("orders.*", "orders"), Ok(false));
        assert_eq!(allowed("team-a*", "team-a.x"), Ok(true));
        assert_eq!(allowed("*", "__consumer_offsets"), Ok(true));
        assert_eq!(allowed("orders", "__consumer_offsets"), Ok(false));
        assert_eq!(allowed("or*ders", "orders"), Err("or*ders".into()));
        assert_eq!(allowed("bad topic", "x"), Err("bad topic".into()));
    }

    #[test]
    fn unordered_list_matches_only_its_entries() {
        assert_eq!(matches("", "orders"), Ok(None));
        assert_eq!(matches("metrics, logs.*", "logs.app"), Ok(Some(true)));
        assert_eq!(matches("metrics, logs.*", "orders"), Ok(Some(false)));
        assert_eq!(matches("*", "orders"), Ok(Some(true)));
    }
}
