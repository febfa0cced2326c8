//! The message of an outbox row: payload and key as stored, and headers that identify the event
//! (the names consumers and tests rely on) followed by the row's own headers.

use rdkafka::message::{Header, OwnedHeaders};

use crate::defaults;
use crate::store::Event;

/// Header with the event's global UUID: what consumers deduplicate on.
pub const HEADER_EVENT_ID: &str = "event_id";
/// Header with the row's bigint id in its database, for operators.
pub const HEADER_OUTBOX_ID: &str = "outbox_id";
/// Header with the row's event_type (absent when NULL).
pub const HEADER_EVENT_TYPE: &str = "event_type";
/// Header with the row's event_key (absent when NULL).
pub const HEADER_EVENT_KEY: &str = "event_key";

/// Header with the payload's media type, [`defaults::CONTENT_TYPE`] unless the row's headers
/// carry their own (any letter case): not reserved, so a producer can name a more precise type
/// (`application/cloudevents+json`) without a new extension version.
pub const HEADER_CONTENT_TYPE: &str = "content-type";

/// Headers the relay sets itself; a row header with one of these names is not sent.
pub const RESERVED_HEADERS: [&str; 4] = [
    HEADER_EVENT_ID,
    HEADER_OUTBOX_ID,
    HEADER_EVENT_TYPE,
    HEADER_EVENT_KEY,
];

/// `event_id` (the UUID consumers dedupe on), `outbox_id` (the row's id), `event_type`,
/// `event_key`, `content-type` (unless the row has one), then the row's own headers (reserved
/// names skipped; non-string values sent as their JSON text): every sink's headers, in order.
pub fn headers(ev: &Event) -> Vec<(String, String)> {
    let mut h = vec![
        (HEADER_EVENT_ID.to_string(), ev.event_id.clone()),
        (HEADER_OUTBOX_ID.to_string(), ev.id.to_string()),
    ];
    if let Some(t) = &ev.event_type {
        h.push((HEADER_EVENT_TYPE.to_string(), t.clone()));
    }
    if let Some(k) = &ev.key {
        h.push((HEADER_EVENT_KEY.to_string(), k.clone()));
    }
    let row_headers = match serde_json::from_str(&ev.headers) {
        Ok(serde_json::Value::Object(map)) => map,
        _ => serde_json::Map::new(),
    };
    if !row_headers
        .iter()
        .any(|(k, v)| !v.is_null() && k.eq_ignore_ascii_case(HEADER_CONTENT_TYPE))
    {
        h.push((
            HEADER_CONTENT_TYPE.to_string(),
            defaults::CONTENT_TYPE.to_string(),
        ));
    }
    for (k, v) in row_headers {
        if RESERVED_HEADERS.contains(&k.as_str()) {
            continue;
        }
        let text = match v {
            serde_json::Value::String(s) => s,
            serde_json::Value::Null => continue,
            other => other.to_string(),
        };
        h.push((k, text));
    }
    h
}

/// [`headers`] as a Kafka message's headers.
pub fn build_headers(ev: &Event) -> OwnedHeaders {
    headers(ev)
        .iter()
        .fold(OwnedHeaders::new(), |h, (key, value)| {
            h.insert(Header {
                key,
                value: Some(value.as_str()),
            })
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdkafka::message::Headers;

    const UUID: &str = "0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b";

    fn ev(headers: &str) -> Event {
        Event {
            id: 42,
            event_id: UUID.into(),
            topic: "orders".into(),
            key: Some("A-1".into()),
            event_type: Some("OrderCreated".into()),
            payload: "{}".into(),
            headers: headers.into(),
            claim_token: 1,
            retry_count: 0,
            age_at_claim: 0.0,
            created_at_ms: 1_700_000_000_123,
            ordered: true,
        }
    }

    fn pairs(h: &OwnedHeaders) -> Vec<(String, String)> {
        h.iter()
            .map(|x| {
                (
                    x.key.to_string(),
                    String::from_utf8_lossy(x.value.unwrap_or_default()).into_owned(),
                )
            })
            .collect()
    }

    #[test]
    fn headers_carry_ids_and_row_headers_but_not_spoofed_reserved_ones() {
        let h = build_headers(&ev(
            r#"{"trace":"t1","event_id":"999","outbox_id":"7","n":5}"#,
        ));
        let p = pairs(&h);
        assert_eq!(
            p,
            vec![
                ("event_id".into(), UUID.into()),
                ("outbox_id".into(), "42".into()),
                ("event_type".into(), "OrderCreated".into()),
                ("event_key".into(), "A-1".into()),
                ("content-type".into(), "application/json".into()),
                ("n".into(), "5".into()),
                ("trace".into(), "t1".into()),
            ]
        );
    }

    #[test]
    fn null_key_and_type_are_omitted() {
        let mut e = ev("{}");
        e.key = None;
        e.event_type = None;
        assert_eq!(
            pairs(&build_headers(&e)),
            vec![
                ("event_id".into(), UUID.into()),
                ("outbox_id".into(), "42".into()),
                ("content-type".into(), "application/json".into()),
            ]
        );
    }

    #[test]
    fn a_row_content_type_replaces_the_default_one() {
        let h = pairs(&build_headers(&ev(
            r#"{"Content-Type":"application/cloudevents+json"}"#,
        )));
        let ct: Vec<_> = h
            .iter()
            .filter(|(k, _)| k.eq_ignore_ascii_case(HEADER_CONTENT_TYPE))
            .collect();
        assert_eq!(
            ct,
            [&(
                "Content-Type".to_string(),
                "application/cloudevents+json".to_string()
            )]
        );
        // A null value is no header: the default is sent.
        let h = pairs(&build_headers(&ev(r#"{"content-type":null}"#)));
        assert!(h.contains(&("content-type".into(), "application/json".into())));
    }
}
