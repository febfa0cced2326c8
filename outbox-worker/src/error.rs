//! The relay's errors: a failed database call keeps its SQLSTATE and a failed publish keeps its
//! sink's error (librdkafka's error code, NATS's error kind), so the relay decides by code (retry,
//! stop, replace the producer), not by message text.

use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use std::time::Duration;

use tokio_postgres::error::SqlState;

use crate::db::db_error;

/// A failed call of an extension function.
#[derive(Debug, thiserror::Error)]
pub enum DbError {
    /// No connection from the pool (server down or restarting, network, authentication).
    #[error("no database connection: {0}")]
    Connect(#[source] deadpool_postgres::PoolError),
    /// The server raised an error (it has a SQLSTATE), or the connection broke during the call.
    #[error("{}", db_error(.0))]
    Query(#[source] tokio_postgres::Error),
    /// A returned row lacks a column or has another type: the installed extension is not the one
    /// this relay was written for.
    #[error("unexpected result from {call}: {} (is the installed extension the version this relay expects?)", db_error(.source))]
    Row {
        call: &'static str,
        #[source]
        source: tokio_postgres::Error,
    },
    /// No pooled connection within `--pool-timeout`, waiting for a free one and opening one
    /// together (deadpool bounds each alone).
    #[error("no database connection within {0:?} (--pool-timeout)")]
    PoolTimeout(Duration),
    /// No answer within the call's client-side bound: the connection is dropped.
    #[error("the database did not answer within {0:?}: connection dropped")]
    Timeout(Duration),
}

impl DbError {
    /// The server's error code, when the server raised the error.
    pub fn sqlstate(&self) -> Option<&SqlState> {
        match self {
            DbError::Connect(deadpool_postgres::PoolError::Backend(e)) | DbError::Query(e) => {
                e.code()
            }
            DbError::Connect(_)
            | DbError::PoolTimeout(_)
            | DbError::Row { .. }
            | DbError::Timeout(_) => None,
        }
    }

    /// Whether the call may have committed although it failed: no answer, or the connection
    /// broke before the server said anything (a server-raised error rolled it back).
    pub fn may_have_committed(&self) -> bool {
        match self {
            DbError::Timeout(_) => true,
            DbError::Query(e) => e.as_db_error().is_none(),
            DbError::Connect(_) | DbError::PoolTimeout(_) | DbError::Row { .. } => false,
        }
    }

    /// Whether calling again can succeed: true for lost connections, timeouts, restarts,
    /// deadlocks and other transient states; false for a configuration error (the role's grants
    /// or settings, a bad argument, a mismatched extension), which every retry would meet again.
    pub fn is_retriable(&self) -> bool {
        match self {
            DbError::Row { .. } => false,
            _ => !self.sqlstate().is_some_and(is_configuration),
        }
    }
}

/// SQLSTATEs no retry fixes: classes 22 (22023: a batch above `outbox.max_claim`), 28, 3D, 3F, 42
/// (42501: no EXECUTE) and 25000 (a locking call outside READ COMMITTED). Not all of class 25: a
/// failover shows 25006 (read-only) for a moment.
pub fn is_configuration(s: &SqlState) -> bool {
    let code = s.code();
    *s == SqlState::INVALID_TRANSACTION_STATE
        || ["22", "28", "3D", "3F", "42"]
            .iter()
            .any(|class| code.starts_with(class))
}

/// One event's failed publish: the sink's error and the event's topic.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{}", describe(.topic, .source))]
pub struct PublishError {
    pub topic: String,
    #[source]
    pub source: SinkError,
}

/// A sink's own error, classified by the sink that raised it.
#[derive(Debug, Clone, thiserror::Error)]
pub enum SinkError {
    #[error(transparent)]
    Kafka(#[from] KafkaError),
    /// NATS's or RocketMQ's, classified by the sink.
    #[error(transparent)]
    Broker(#[from] crate::sink::BrokerError),
}

impl PublishError {
    /// librdkafka's error code, when a Kafka error has one.
    pub fn code(&self) -> Option<RDKafkaErrorCode> {
        match &self.source {
            SinkError::Kafka(e) => e.rdkafka_error_code(),
            SinkError::Broker(_) => None,
        }
    }

    /// Whose fault it is. Permanent (the event's, or a setting no retry changes): an attempt, in
    /// the end a dead letter. Transient (broker, network, authentication, an unusable producer):
    /// released without an attempt, however long. Unknown: any other code (see `claim.rs`).
    pub fn class(&self) -> FailureClass {
        if let SinkError::Broker(e) = &self.source {
            return e.class();
        }
        let Some(code) = self.code() else {
            // No code: the delivery was cancelled (the producer was replaced under it).
            return FailureClass::Transient;
        };
        if PERMANENT.contains(&code) {
            FailureClass::Permanent
        } else if TRANSIENT.contains(&code) {
            FailureClass::Transient
        } else {
            FailureClass::Unknown
        }
    }

    /// librdkafka's name of the code (`InvalidTimestamp`), `none` without one, or the
    /// other sinks' failure kind: the `code` label.
    pub fn code_label(&self) -> String {
        if let SinkError::Broker(e) = &self.source {
            return e.kind.label().to_string();
        }
        self.code()
            .map_or_else(|| "none".to_string(), |c| format!("{c:?}"))
    }

    /// No delivery report within the send timeout.
    pub fn timed_out(&self) -> bool {
        match &self.source {
            SinkError::Kafka(_) => self.code() == Some(RDKafkaErrorCode::MessageTimedOut),
            SinkError::Broker(e) => e.kind == crate::sink::FailureKind::TimedOut,
        }
    }

    /// The idempotent producer cannot go on (its producer id/epoch is rejected): every later send
    /// would fail the same way, so the producer must be replaced.
    pub fn producer_unusable(&self) -> bool {
        matches!(
            self.code(),
            Some(
                RDKafkaErrorCode::ProducerFenced
                    | RDKafkaErrorCode::InvalidProducerEpoch
                    | RDKafkaErrorCode::OutOfOrderSequenceNumber
                    | RDKafkaErrorCode::UnknownProducerId
                    | RDKafkaErrorCode::InvalidProducerIdMapping
                    | RDKafkaErrorCode::Fatal
            )
        )
    }
}

/// Codes no retry fixes: the event's own (size, timestamp, record, topic, partition) or a setting
/// of the topic or cluster that refuses it (authorization, compression, policy, acks, version).
const PERMANENT: [RDKafkaErrorCode; 20] = [
    RDKafkaErrorCode::MessageSizeTooLarge,
    RDKafkaErrorCode::InvalidMessageSize,
    RDKafkaErrorCode::MessageBatchTooLarge,
    RDKafkaErrorCode::InvalidMessage,
    RDKafkaErrorCode::InvalidRecord,
    RDKafkaErrorCode::BadMessage,
    RDKafkaErrorCode::BadCompression,
    RDKafkaErrorCode::InvalidTimestamp,
    RDKafkaErrorCode::UnknownTopicOrPartition,
    RDKafkaErrorCode::UnknownTopic,
    RDKafkaErrorCode::UnknownPartition,
    RDKafkaErrorCode::InvalidTopic,
    RDKafkaErrorCode::TopicAuthorizationFailed,
    RDKafkaErrorCode::ClusterAuthorizationFailed,
    RDKafkaErrorCode::PolicyViolation,
    RDKafkaErrorCode::UnsupportedForMessageFormat,
    RDKafkaErrorCode::UnsupportedCompressionType,
    RDKafkaErrorCode::UnsupportedVersion,
    RDKafkaErrorCode::InvalidRequiredAcks,
    RDKafkaErrorCode::InvalidArgument,
];

/// Codes of a broker, network or producer state that passes: an outage, a leader election, a
/// replica catching up, a full queue, a producer being replaced.
const TRANSIENT: [RDKafkaErrorCode; 37] = [
    RDKafkaErrorCode::MessageTimedOut,
    RDKafkaErrorCode::RequestTimedOut,
    RDKafkaErrorCode::OperationTimedOut,
    RDKafkaErrorCode::TimedOutQueue,
    RDKafkaErrorCode::BrokerTransportFailure,
    RDKafkaErrorCode::BrokerDestroy,
    RDKafkaErrorCode::DestroyBroker,
    RDKafkaErrorCode::AllBrokersDown,
    RDKafkaErrorCode::Resolve,
    RDKafkaErrorCode::NetworkException,
    RDKafkaErrorCode::SSL,
    RDKafkaErrorCode::Authentication,
    RDKafkaErrorCode::SaslAuthenticationFailed,
    RDKafkaErrorCode::BrokerNotAvailable,
    RDKafkaErrorCode::LeaderNotAvailable,
    RDKafkaErrorCode::NotLeaderForPartition,
    RDKafkaErrorCode::ReplicaNotAvailable,
    RDKafkaErrorCode::NotEnoughReplicas,
    RDKafkaErrorCode::NotEnoughReplicasAfterAppend,
    RDKafkaErrorCode::ISRInsufficient,
    RDKafkaErrorCode::KafkaStorageError,
    RDKafkaErrorCode::FencedLeaderEpoch,
    RDKafkaErrorCode::UnknownLeaderEpoch,
    RDKafkaErrorCode::NotController,
    RDKafkaErrorCode::ThrottlingQuotaExceeded,
    RDKafkaErrorCode::QueueFull,
    RDKafkaErrorCode::Retry,
    RDKafkaErrorCode::PurgeQueue,
    RDKafkaErrorCode::PurgeInflight,
    RDKafkaErrorCode::ProducerFenced,
    RDKafkaErrorCode::InvalidProducerEpoch,
    RDKafkaErrorCode::OutOfOrderSequenceNumber,
    RDKafkaErrorCode::DuplicateSequenceNumber,
    RDKafkaErrorCode::UnknownProducerId,
    RDKafkaErrorCode::InvalidProducerIdMapping,
    RDKafkaErrorCode::Fenced,
    RDKafkaErrorCode::Fatal,
];

/// What a failed publish says about the event, which decides how it is settled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum FailureClass {
    /// The event itself is at fault (too large, unknown topic, not authorized, invalid record):
    /// `outbox_nack`, one attempt counted, a dead letter after `outbox.max_retry`.
    Permanent,
    /// The broker or the network is: `outbox_release`, no attempt counted.
    Transient,
    /// A code neither list names: released without an attempt for the first
    /// `defaults::UNKNOWN_ERROR_GRACE` failures of an event, counted as an attempt after that.
    Unknown,
}

impl FailureClass {
    /// The `class` label of the failure metrics.
    pub fn label(self) -> &'static str {
        match self {
            FailureClass::Permanent => "permanent",
            FailureClass::Transient => "transient",
            FailureClass::Unknown => "unknown",
        }
    }
}

/// The text `outbox_nack` records: it always names the topic.
fn describe(topic: &str, e: &SinkError) -> String {
    let e = match e {
        SinkError::Kafka(e) => e,
        SinkError::Broker(e) => return format!("publish to topic {topic} failed: {e}"),
    };
    match e.rdkafka_error_code() {
        Some(RDKafkaErrorCode::UnknownTopicOrPartition) | Some(RDKafkaErrorCode::UnknownTopic) => {
            format!("topic {topic} does not exist on the broker: {e}")
        }
        Some(RDKafkaErrorCode::MessageTimedOut) => format!(
            "publish to topic {topic} timed out (broker unreachable, or topic {topic} missing?): {e}"
        ),
        _ => format!("publish to topic {topic} failed: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn publish_error(code: RDKafkaErrorCode) -> PublishError {
        PublishError {
            topic: "orders".into(),
            source: KafkaError::MessageProduction(code).into(),
        }
    }

    #[test]
    fn publish_failures_name_the_topic_and_keep_the_code() {
        let e = publish_error(RDKafkaErrorCode::UnknownTopicOrPartition);
        assert!(e.to_string().contains("topic orders does not exist"));
        assert!(!e.timed_out() && !e.producer_unusable());
        let e = publish_error(RDKafkaErrorCode::MessageTimedOut);
        assert!(e.to_string().contains("topic orders"));
        assert!(e.timed_out());
        assert!(publish_error(RDKafkaErrorCode::ProducerFenced).producer_unusable());
    }

    #[test]
    fn only_the_events_own_faults_count_as_attempts() {
        for code in [
            RDKafkaErrorCode::MessageSizeTooLarge,
            RDKafkaErrorCode::UnknownTopicOrPartition,
            RDKafkaErrorCode::UnknownTopic,
            RDKafkaErrorCode::TopicAuthorizationFailed,
            RDKafkaErrorCode::InvalidRecord,
            RDKafkaErrorCode::InvalidTimestamp,
            RDKafkaErrorCode::UnsupportedCompressionType,
            RDKafkaErrorCode::ClusterAuthorizationFailed,
        ] {
            assert_eq!(
                publish_error(code).class(),
                FailureClass::Permanent,
                "{code:?}"
            );
        }
        for code in [
            RDKafkaErrorCode::MessageTimedOut,
            RDKafkaErrorCode::BrokerTransportFailure,
            RDKafkaErrorCode::AllBrokersDown,
            RDKafkaErrorCode::NotEnoughReplicas,
            RDKafkaErrorCode::NotLeaderForPartition,
            RDKafkaErrorCode::Authentication,
            RDKafkaErrorCode::SaslAuthenticationFailed,
            RDKafkaErrorCode::ProducerFenced,
        ] {
            assert_eq!(
                publish_error(code).class(),
                FailureClass::Transient,
                "{code:?}"
            );
        }
        let cancelled = PublishError {
            topic: "orders".into(),
            source: KafkaError::Canceled.into(),
        };
        assert_eq!(cancelled.class(), FailureClass::Transient);
        assert_eq!(cancelled.code_label(), "none");
    }

    #[test]
    fn codes_on_neither_list_are_unknown_and_labelled_by_name() {
        for code in [
            RDKafkaErrorCode::Unknown,
            RDKafkaErrorCode::Fail,
            RDKafkaErrorCode::InvalidRequest,
            RDKafkaErrorCode::State,
        ] {
            assert_eq!(
                publish_error(code).class(),
                FailureClass::Unknown,
                "{code:?}"
            );
        }
        assert_eq!(
            publish_error(RDKafkaErrorCode::InvalidTimestamp).code_label(),
            "InvalidTimestamp"
        );
    }

    #[test]
    fn no_code_is_on_both_lists() {
        for code in PERMANENT {
            assert!(!TRANSIENT.contains(&code), "{code:?}");
        }
    }

    #[test]
    fn configuration_errors_are_not_retriable() {
        for s in [
            SqlState::INSUFFICIENT_PRIVILEGE,
            SqlState::INVALID_PARAMETER_VALUE,
            SqlState::UNDEFINED_FUNCTION,
            SqlState::INVALID_PASSWORD,
            SqlState::INVALID_TRANSACTION_STATE,
        ] {
            assert!(is_configuration(&s), "{}", s.code());
        }
        for s in [
            SqlState::ADMIN_SHUTDOWN,
            SqlState::CANNOT_CONNECT_NOW,
            SqlState::T_R_DEADLOCK_DETECTED,
            SqlState::QUERY_CANCELED,
            SqlState::CONNECTION_FAILURE,
            SqlState::TOO_MANY_CONNECTIONS,
            SqlState::READ_ONLY_SQL_TRANSACTION,
        ] {
            assert!(!is_configuration(&s), "{}", s.code());
        }
    }
}
