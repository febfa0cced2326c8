//! Operator commands: stats, dead-letters, blocked, relays, requeue, skip, purge (through the
//! extension's functions), and
//! tail (reads a topic back from Kafka).

use std::io::Write;
use std::time::{Duration, Instant};

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{Offset, TopicPartitionList};
use serde_json::json;

use crate::cli::{
    BlockedArgs, DeadLettersArgs, PurgeArgs, RelaysArgs, RequeueArgs, SkipArgs, StatsArgs, TailArgs,
};
use crate::db::{admin_session, db_error};
use crate::store::Stats;
use crate::Fatal;

fn failed(what: &str, e: &tokio_postgres::Error) -> Fatal {
    Fatal::runtime(format!("{what} failed: {}", db_error(e)))
}

pub async fn stats(args: StatsArgs) -> Result<(), Fatal> {
    let (client, schema) = admin_session(&args.db).await?;
    let row = client
        .query_one(&Stats::sql(&schema), &[])
        .await
        .map_err(|e| failed("outbox_stats()", &e))?;
    let s = Stats::from_row(&row).map_err(|e| failed("outbox_stats()", &e))?;
    let counts = [
        ("due_wait", s.due_wait),
        ("delayed_wait", s.delayed_wait),
        ("sending", s.sending),
        ("failed", s.failed),
        ("succeeded", s.succeeded),
        ("blocked_keys", s.blocked_keys),
    ];
    if args.json {
        let mut obj = serde_json::Map::new();
        for (n, c) in counts {
            obj.insert(n.to_string(), json!(c));
        }
        obj.insert("oldest_due_age_seconds".into(), json!(s.oldest_due_age));
        obj.insert("oldest_lease_age_seconds".into(), json!(s.oldest_lease_age));
        obj.insert(
            "oldest_blocked_age_seconds".into(),
            json!(s.oldest_blocked_age),
        );
        println!("{}", serde_json::Value::Object(obj));
    } else {
        for (n, c) in counts {
            println!("{n:<22} {c}");
        }
        let fmt = |a: Option<f64>| a.map_or("-".to_string(), |s| format!("{s:.3}s"));
        println!("{:<22} {}", "oldest_due_age", fmt(s.oldest_due_age));
        println!("{:<22} {}", "oldest_lease_age", fmt(s.oldest_lease_age));
        println!("{:<22} {}", "oldest_blocked_age", fmt(s.oldest_blocked_age));
    }
    Ok(())
}

pub async fn inbox_stats(args: StatsArgs) -> Result<(), Fatal> {
    let (client, schema) = admin_session(&args.db).await?;
    let rows = client
        .query(
            &format!(
                "SELECT consumer, events, \
                 to_char(oldest_accepted_at, 'YYYY-MM-DD\"T\"HH24:MI:SS.MSOF') AS oldest, \
                 to_char(newest_accepted_at, 'YYYY-MM-DD\"T\"HH24:MI:SS.MSOF') AS newest \
                 FROM {schema}.outbox_inbox_stats()"
            ),
            &[],
        )
        .await
        .map_err(|e| failed("outbox_inbox_stats()", &e))?;
    let mut out = std::io::stdout().lock();
    if !args.json {
        let _ = writeln!(
            out,
            "{:<32} {:>12}  {:<29} newest_accepted_at",
            "consumer", "events", "oldest_accepted_at"
        );
    }
    for r in &rows {
        let (consumer, events): (String, i64) = (r.get("consumer"), r.get("events"));
        let (oldest, newest): (String, String) = (r.get("oldest"), r.get("newest"));
        if args.json {
            let v = json!({"consumer": consumer, "events": events,
                           "oldest_accepted_at": oldest, "newest_accepted_at": newest});
            let _ = writeln!(out, "{v}");
        } else {
            let _ = writeln!(out, "{consumer:<32} {events:>12}  {oldest:<29} {newest}");
        }
    }
    Ok(())
}

pub async fn dead_letters(args: DeadLettersArgs) -> Result<(), Fatal> {
    let (client, schema) = admin_session(&args.db).await?;
    let rows = client
        .query(
            &format!(
                "SELECT id, topic, event_key, event_type, retry_count, last_error, \
                 to_char(updated_at, 'YYYY-MM-DD\"T\"HH24:MI:SS.MSOF') AS failed_at, \
                 payload::text AS payload, headers::text AS headers \
                 FROM {schema}.outbox_dead_letters($1, $2)"
            ),
            &[&args.limit, &args.after_id],
        )
        .await
        .map_err(|e| failed("outbox_dead_letters()", &e))?;
    let mut out = std::io::stdout().lock();
    if !args.json {
        let _ = writeln!(
            out,
            "{:>10}  {:<20} {:<16} {:<16} {:>8}  {:<29} last_error",
            "id", "topic", "key", "type", "attempts", "failed_at"
        );
    }
    for r in &rows {
        let id: i64 = r.get("id");
        let topic: String = r.get("topic");
        let key: Option<String> = r.get("event_key");
        let et: Option<String> = r.get("event_type");
        let attempts: i32 = r.get("retry_count");
        let err: Option<String> = r.get("last_error");
        let at: String = r.get("failed_at");
        if args.json {
            let payload: String = r.get("payload");
            let headers: String = r.get("headers");
            let v = json!({
                "id": id, "topic": topic, "key": key, "event_type": et, "attempts": attempts,
                "last_error": err, "failed_at": at,
                "payload": serde_json::from_str::<serde_json::Value>(&payload).unwrap_or(json!(payload)),
                "headers": serde_json::from_str::<serde_json::Value>(&headers).unwrap_or(json!(headers)),
            });
            let _ = writeln!(out, "{v}");
        } else {
            let _ = writeln!(
                out,
                "{id:>10}  {topic:<20} {:<16} {:<16} {attempts:>8}  {at:<29} {}",
                key.unwrap_or_default(),
                et.unwrap_or_default(),
                err.unwrap_or_default().replace('\n', " ")
            );
        }
    }
    if !args.json {
        let _ = writeln!(out, "({} dead letters)", rows.len());
    }
    Ok(())
}

/// Keys held back by a dead head: what `requeue` (resume in order) or `skip` would release.
pub async fn blocked(args: BlockedArgs) -> Result<(), Fatal> {
    let (client, schema) = admin_session(&args.db).await?;
    let rows = client
        .query(
            &format!(
                "SELECT topic, event_key, head_id, waiting, last_error, \
                 to_char(blocked_since, 'YYYY-MM-DD\"T\"HH24:MI:SS.MSOF') AS blocked_since \
                 FROM {schema}.outbox_blocked_keys($1)"
            ),
            &[&args.limit],
        )
        .await
        .map_err(|e| failed("outbox_blocked_keys()", &e))?;
    let mut out = std::io::stdout().lock();
    if !args.json {
        let _ = writeln!(
            out,
            "{:<20} {:<24} {:>10} {:>8}  {:<29} last_error",
            "topic", "key", "head_id", "waiting", "blocked_since"
        );
    }
    for r in &rows {
        let (topic, key): (String, String) = (r.get("topic"), r.get("event_key"));
        let (head, waiting): (i64, i64) = (r.get("head_id"), r.get("waiting"));
        let err: Option<String> = r.get("last_error");
        let since: String = r.get("blocked_since");
        if args.json {
            let v = json!({"topic": topic, "key": key, "head_id": head, "waiting": waiting,
                           "blocked_since": since, "last_error": err});
            let _ = writeln!(out, "{v}");
        } else {
            let _ = writeln!(
                out,
                "{topic:<20} {key:<24} {head:>10} {waiting:>8}  {since:<29} {}",
                err.unwrap_or_default().replace('\n', " ")
            );
        }
    }
    if !args.json {
        let _ = writeln!(
            out,
            "({} blocked keys; `requeue HEAD_ID` resumes a key in order, `skip HEAD_ID` lets it go on without its head)",
            rows.len()
        );
    }
    Ok(())
}

/// The claim owners (outbox_owners): alive, gone (their claims are reclaimed at the next reclaim)
/// or without a heartbeat (their claims wait for the lease), and what each holds.
pub async fn relays(args: RelaysArgs) -> Result<(), Fatal> {
    let (client, schema) = admin_session(&args.db).await?;
    let rows = client
        .query(
            &format!(
                "SELECT owner, \
                 CASE WHEN alive THEN 'alive' WHEN NOT alive THEN 'gone' ELSE 'no heartbeat' END AS state, \
                 held, extract(epoch FROM clock_timestamp() - beat_at)::float8 AS beat_age, \
                 extract(epoch FROM clock_timestamp() - oldest_claim)::float8 AS claim_age, \
                 to_char(started_at, 'YYYY-MM-DD\"T\"HH24:MI:SS.MSOF') AS started_at \
                 FROM {schema}.outbox_owners($1)"
            ),
            &[&args.limit],
        )
        .await
        .map_err(|e| failed("outbox_owners()", &e))?;
    let secs = |v: Option<f64>| v.map_or("-".to_string(), |s| format!("{s:.1}s"));
    let mut out = std::io::stdout().lock();
    if !args.json {
        let _ = writeln!(
            out,
            "{:<40} {:<12} {:>8} {:>10} {:>12}  started_at",
            "owner", "state", "held", "last_beat", "oldest_claim"
        );
    }
    for r in &rows {
        let (owner, state, held): (String, String, i64) =
            (r.get("owner"), r.get("state"), r.get("held"));
        let (beat_age, claim_age): (Option<f64>, Option<f64>) =
            (r.get("beat_age"), r.get("claim_age"));
        let started: Option<String> = r.get("started_at");
        if args.json {
            let v = json!({"owner": owner, "state": state, "held": held,
                           "last_beat_age_seconds": beat_age,
                           "oldest_claim_age_seconds": claim_age, "started_at": started});
            let _ = writeln!(out, "{v}");
        } else {
            let _ = writeln!(
                out,
                "{owner:<40} {state:<12} {held:>8} {:>10} {:>12}  {}",
                secs(beat_age),
                secs(claim_age),
                started.unwrap_or_else(|| "-".into())
            );
        }
    }
    if !args.json {
        let _ = writeln!(
            out,
            "({} relays; a gone relay's claims go back at the next reclaim, one without heartbeat waits for the lease)",
            rows.len()
        );
    }
    Ok(())
}

/// Lets the keys of these dead letters go on without them (outbox_skip).
pub async fn skip(args: SkipArgs) -> Result<(), Fatal> {
    let (client, schema) = admin_session(&args.db).await?;
    let row = client
        .query_one(&format!("SELECT {schema}.outbox_skip($1)"), &[&args.ids])
        .await
        .map_err(|e| failed("outbox_skip()", &e))?;
    let n: i32 = row.get(0);
    println!("skipped {n} of {} dead letters", args.ids.len());
    Ok(())
}

pub async fn requeue(args: RequeueArgs) -> Result<(), Fatal> {
    let (client, schema) = admin_session(&args.db).await?;
    let mut ids = args.ids.clone();
    if args.all {
        let mut after = 0i64;
        loop {
            let rows = client
                .query(
                    &format!("SELECT id FROM {schema}.outbox_dead_letters(1000, $1)"),
                    &[&after],
                )
                .await
                .map_err(|e| failed("outbox_dead_letters()", &e))?;
            if rows.is_empty() {
                break;
            }
            for r in &rows {
                ids.push(r.get(0));
            }
            after = *ids.last().expect("non-empty");
        }
    }
    let mut total = 0i64;
    for chunk in ids.chunks(1000) {
        let row = client
            .query_one(&format!("SELECT {schema}.outbox_requeue($1)"), &[&chunk])
            .await
            .map_err(|e| failed("outbox_requeue()", &e))?;
        total += row.get::<_, i32>(0) as i64;
    }
    println!("requeued {total} of {} events", ids.len());
    Ok(())
}

pub async fn purge(args: PurgeArgs) -> Result<(), Fatal> {
    let (client, schema) = admin_session(&args.db).await?;
    if args.max_rows < 1 {
        return Err(Fatal::usage("--max-rows must be at least 1"));
    }
    let older = format!("{} milliseconds", args.older_than.as_millis());
    let mut total = 0i64;
    loop {
        let row = client
            .query_one(
                &format!("SELECT {schema}.outbox_purge($1::text::interval, $2)"),
                &[&older, &args.max_rows],
            )
            .await
            .map_err(|e| failed("outbox_purge()", &e))?;
        let n: i64 = row.get(0);
        total += n;
        if n < args.max_rows as i64 {
            break;
        }
    }
    println!(
        "purged {total} delivered events older than {}",
        humantime::format_duration(args.older_than)
    );
    Ok(())
}

/// Reads every partition of a topic from offset 0 (no consumer group) and prints each message.
pub fn tail(args: TailArgs) -> Result<(), Fatal> {
    let mut cfg = ClientConfig::new();
    // A group id is required by librdkafka even for assigned partitions; no group is joined and
    // no offset is committed.
    let group = format!("outbox-worker-tail-{}", std::process::id());
    cfg.set("bootstrap.servers", &args.kafka.brokers)
        .set("group.id", &group)
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("enable.partition.eof", "false")
        .set("fetch.wait.max.ms", "10")
        .set("client.id", "outbox-worker-tail");
    for (k, v) in args.kafka.properties()? {
        cfg.set(k, v);
    }
    let consumer: BaseConsumer = cfg
        .create()
        .map_err(|e| Fatal::usage(format!("cannot create the Kafka consumer: {e}")))?;
    let deadline = Instant::now() + Duration::from_secs(10);
    let partitions = loop {
        let md = consumer
            .fetch_metadata(Some(&args.topic), Duration::from_secs(5))
            .map_err(|e| {
                Fatal::runtime(format!(
                    "cannot read metadata from {}: {e}",
                    args.kafka.brokers
                ))
            })?;
        let t = md.topics().iter().find(|t| t.name() == args.topic);
        match t {
            Some(t) if t.error().is_none() && !t.partitions().is_empty() => {
                break t.partitions().iter().map(|p| p.id()).collect::<Vec<_>>();
            }
            _ if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(200)),
            _ => {
                return Err(Fatal::runtime(format!(
                    "topic {} does not exist on {}",
                    args.topic, args.kafka.brokers
                )))
            }
        }
    };
    let mut tpl = TopicPartitionList::new();
    for p in &partitions {
        tpl.add_partition_offset(&args.topic, *p, Offset::Beginning)
            .map_err(|e| Fatal::runtime(e.to_string()))?;
    }
    consumer
        .assign(&tpl)
        .map_err(|e| Fatal::runtime(format!("cannot assign partitions: {e}")))?;
    let mut last = Instant::now();
    let mut count = 0u64;
    let mut out = std::io::stdout().lock();
    loop {
        match consumer.poll(Duration::from_millis(100)) {
            Some(Ok(m)) => {
                last = Instant::now();
                count += 1;
                let key = m.key().map(|k| String::from_utf8_lossy(k).into_owned());
                let value = m.payload().map(|v| String::from_utf8_lossy(v).into_owned());
                let mut headers = Vec::new();
                if let Some(h) = m.headers() {
                    for hd in h.iter() {
                        headers.push((
                            hd.key.to_string(),
                            hd.value.map(|v| String::from_utf8_lossy(v).into_owned()),
                        ));
                    }
                }
                if args.json {
                    let hs: serde_json::Map<String, serde_json::Value> =
                        headers.into_iter().map(|(k, v)| (k, json!(v))).collect();
                    let v = json!({
                        "topic": m.topic(), "partition": m.partition(), "offset": m.offset(),
                        "timestamp_ms": m.timestamp().to_millis(),
                        "key": key, "headers": hs, "value": value,
                    });
                    let _ = writeln!(out, "{v}");
                } else {
                    let hs: Vec<String> = headers
                        .iter()
                        .map(|(k, v)| format!("{k}={}", v.as_deref().unwrap_or("")))
                        .collect();
                    let _ = writeln!(
                        out,
                        "{}[{}]@{} key={} headers={{{}}} value={}",
                        m.topic(),
                        m.partition(),
                        m.offset(),
                        key.as_deref().unwrap_or("-"),
                        hs.join(", "),
                        value.as_deref().unwrap_or("-")
                    );
                }
                let _ = out.flush();
            }
            Some(Err(e)) => tracing::warn!("consumer: {e}"),
            None => {
                if !args.follow && last.elapsed() >= args.idle {
                    break;
                }
            }
        }
    }
    if !args.json {
        let _ = writeln!(out, "({count} messages)");
    }
    Ok(())
}
