//! The start-up check of TLS to the brokers. With `security.protocol` ssl or sasl_ssl, a
//! short-lived client asks the brokers for their metadata before the relay starts: a handshake
//! the client refuses (a certificate the CA did not sign, a broker name not in the certificate,
//! TLS against a plaintext port) ends the start with exit 2 and librdkafka's reason on one line,
//! as a failed TLS to PostgreSQL does. An unreachable broker does not: the relay waits for it as
//! for any outage, and a TLS failure after start-up is retried like one (docs/relay.md).

use std::sync::Mutex;
use std::time::{Duration, Instant};

use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{BaseProducer, DeliveryResult, Producer, ProducerContext};
use rdkafka::ClientContext;

use crate::guarantees::canonical;
use crate::Fatal;

/// How long one metadata request of the check may wait before the next look at the errors.
const STEP: Duration = Duration::from_millis(200);

/// Whether the properties ask for TLS to the brokers (librdkafka reads the value in any case).
pub fn uses_tls(props: &[(String, String)]) -> bool {
    props
        .iter()
        .rev()
        .find(|(k, _)| canonical(k) == "security.protocol")
        .is_some_and(|(_, v)| matches!(v.to_ascii_lowercase().as_str(), "ssl" | "sasl_ssl"))
}

/// Checks the TLS handshake with `brokers` for up to `wait` when the properties ask for TLS.
/// Err: the first TLS failure librdkafka reported. Ok: the brokers answered, or they did not
/// answer within `wait` without a TLS failure (an outage, a refused login: left to the relay).
pub async fn check(brokers: &str, props: &[(String, String)], wait: Duration) -> Result<(), Fatal> {
    if !uses_tls(props) {
        return Ok(());
    }
    warn_if_names_are_not_verified(props);
    let (brokers, props) = (brokers.to_string(), props.to_vec());
    tokio::task::spawn_blocking(move || handshake(&brokers, &props, wait))
        .await
        .map_err(|e| Fatal::runtime(format!("checking TLS to the brokers: {e}")))?
}

/// librdkafka verifies the broker's name by default; `ssl.endpoint.identification.algorithm=none`
/// turns that off, which a log line says at each start.
fn warn_if_names_are_not_verified(props: &[(String, String)]) {
    let off = props
        .iter()
        .rev()
        .find(|(k, _)| k == "ssl.endpoint.identification.algorithm");
    if off.is_some_and(|(_, v)| v.eq_ignore_ascii_case("none")) {
        tracing::warn!(
            "ssl.endpoint.identification.algorithm=none: the brokers' certificates are not checked against their names"
        );
    }
}

/// The first TLS failure librdkafka reports through the client's error callback.
#[derive(Default)]
struct TlsFailure(Mutex<Option<String>>);

impl ClientContext for TlsFailure {
    // The relay's producer logs the same connection failures: this client stays quiet.
    fn log(&self, _: rdkafka::config::RDKafkaLogLevel, _: &str, _: &str) {}

    fn error(&self, error: KafkaError, reason: &str) {
        if error.rdkafka_error_code() == Some(RDKafkaErrorCode::SSL) {
            let mut first = self.0.lock().expect("TLS failure lock");
            first.get_or_insert_with(|| reason.to_string());
        }
    }
}

// Nothing is produced: no delivery reports.
impl ProducerContext for TlsFailure {
    type DeliveryOpaque = ();
    fn delivery(&self, _: &DeliveryResult<'_>, _: ()) {}
}

fn handshake(brokers: &str, props: &[(String, String)], wait: Duration) -> Result<(), Fatal> {
    let mut cfg = ClientConfig::new();
    cfg.set("bootstrap.servers", brokers);
    for (k, v) in props {
        cfg.set(k, v);
    }
    // An invalid property is reported by the relay's own producer, with its value hidden.
    let Ok(client) = cfg.create_with_context::<_, BaseProducer<TlsFailure>>(TlsFailure::default())
    else {
        return Ok(());
    };
    let start = Instant::now();
    loop {
        let answered = client.client().fetch_metadata(None, STEP).is_ok();
        // Serves the error callbacks.
        client.poll(Duration::ZERO);
        if let Some(reason) = client.context().0.lock().expect("TLS failure lock").take() {
            return Err(Fatal::usage(failure(brokers, &reason)));
        }
        if answered {
            return Ok(());
        }
        if start.elapsed() >= wait {
            tracing::warn!(
                brokers,
                "no broker answered the TLS check within {}: starting anyway",
                humantime::format_duration(wait)
            );
            return Ok(());
        }
    }
}

/// The line the relay exits with. librdkafka says "certificate verify failed" for an unknown CA
/// and for a name missing from the certificate alike, and only names the CA: both causes are said.
fn failure(brokers: &str, reason: &str) -> String {
    let reason = reason.split_whitespace().collect::<Vec<_>>().join(" ");
    let hint = if reason.contains("certificate verify failed") {
        " (the CA of ssl.ca.location must have signed the broker's certificate, and the \
         certificate must name the host of --brokers and the brokers' advertised host names)"
    } else {
        ""
    };
    format!("TLS to the Kafka brokers failed ({brokers}): {reason}{hint}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::guarantees::props;

    #[test]
    fn a_verification_failure_names_both_causes_on_one_line() {
        let m = failure(
            "b:9093",
            "ssl://b:9093/bootstrap: SSL handshake failed:\n certificate verify failed",
        );
        assert!(!m.contains('\n'), "{m}");
        assert!(m.starts_with("TLS to the Kafka brokers failed (b:9093): ssl://b:9093"));
        assert!(m.contains("ssl.ca.location") && m.contains("advertised host names"));
        assert!(!failure("b:9093", "wrong version number").contains("ssl.ca.location"));
    }

    #[test]
    fn only_ssl_and_sasl_ssl_are_checked_and_the_last_setting_wins() {
        assert!(uses_tls(&props(&[("security.protocol", "SSL")])));
        assert!(uses_tls(&props(&[("security.protocol", "sasl_ssl")])));
        assert!(!uses_tls(&props(&[(
            "security.protocol",
            "sasl_plaintext"
        )])));
        assert!(!uses_tls(&props(&[])));
        assert!(!uses_tls(&props(&[
            ("security.protocol", "ssl"),
            ("security.protocol", "plaintext"),
        ])));
    }
}
