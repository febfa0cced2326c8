//! TLS to PostgreSQL with libpq's meaning of the connection string's `sslmode`, `sslrootcert`,
//! `sslcert` and `sslkey`, over the system OpenSSL (the one librdkafka uses). tokio-postgres only
//! knows `disable`, `prefer` and `require` (encryption without verification), so these parameters
//! are taken out of the string here and turned into an OpenSSL connector.

use std::error::Error as StdError;
use std::path::PathBuf;

use openssl::ssl::{SslConnector, SslMethod, SslVerifyMode};
use postgres_openssl::MakeTlsConnector;
use tokio_postgres::config::SslMode as PgSslMode;

use crate::Fatal;

/// libpq's `sslmode` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SslMode {
    Disable,
    /// libpq's `allow` (plain first, TLS if refused) has no counterpart: it behaves like `prefer`.
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

/// The TLS parameters of a connection string.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsParams {
    pub mode: SslMode,
    /// CA file; `system` (or none) means the system's trust store.
    pub root_cert: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
}

const KEYS: [&str; 4] = ["sslmode", "sslrootcert", "sslcert", "sslkey"];

impl SslMode {
    pub fn name(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }
}

impl TlsParams {
    /// `require` with a CA file verifies the chain, as in libpq.
    pub fn effective_mode(&self) -> SslMode {
        match (self.mode, &self.root_cert) {
            (SslMode::Require, Some(_)) => SslMode::VerifyCa,
            (m, _) => m,
        }
    }

    /// What tokio-postgres does about TLS itself: try it, insist on it, or not use it.
    pub fn pg_mode(&self) -> PgSslMode {
        match self.mode {
            SslMode::Disable => PgSslMode::Disable,
            SslMode::Prefer => PgSslMode::Prefer,
            _ => PgSslMode::Require,
        }
    }

    /// The OpenSSL connector for these parameters; a missing or unreadable file is one line.
    pub fn connector(&self) -> Result<MakeTlsConnector, Fatal> {
        let bad = |what: &str, path: &Option<PathBuf>, e: openssl::error::ErrorStack| {
            let path = path.as_ref().map(|p| p.display().to_string());
            Fatal::usage(format!(
                "cannot use {what} {}: {e}",
                path.unwrap_or_default()
            ))
        };
        let mut b = SslConnector::builder(SslMethod::tls_client())
            .map_err(|e| Fatal::usage(format!("cannot set up TLS: {e}")))?;
        let mode = self.effective_mode();
        if matches!(mode, SslMode::VerifyCa | SslMode::VerifyFull) {
            b.set_verify(SslVerifyMode::PEER);
            match &self.root_cert {
                Some(p) if p.as_os_str() != "system" => {
                    if !p.is_file() {
                        return Err(Fatal::usage(format!(
                            "sslrootcert {} is not a readable file",
                            p.display()
                        )));
                    }
                    b.set_ca_file(p)
                        .map_err(|e| bad("sslrootcert", &self.root_cert, e))?;
                }
                _ => b
                    .set_default_verify_paths()
                    .map_err(|e| Fatal::usage(format!("cannot load the system CAs: {e}")))?,
            }
        } else {
            // prefer/require: encrypted, but any certificate is accepted (libpq's meaning).
            b.set_verify(SslVerifyMode::NONE);
        }
        match (&self.cert, &self.key) {
            (Some(_), Some(_)) => {
                b.set_certificate_chain_file(self.cert.as_ref().expect("cert"))
                    .map_err(|e| bad("sslcert", &self.cert, e))?;
                b.set_private_key_file(
                    self.key.as_ref().expect("key"),
                    openssl::ssl::SslFiletype::PEM,
                )
                .map_err(|e| bad("sslkey", &self.key, e))?;
            }
            (None, None) => {}
            _ => {
                return Err(Fatal::usage(
                    "give both sslcert and sslkey for a client certificate, or neither",
                ))
            }
        }
        let mut connector = MakeTlsConnector::new(b.build());
        if mode != SslMode::VerifyFull {
            connector.set_callback(|cfg, _host| {
                cfg.set_verify_hostname(false);
                Ok(())
            });
        }
        Ok(connector)
    }
}

fn parse_mode(v: &str) -> Result<SslMode, Fatal> {
    Ok(match v {
        "disable" => SslMode::Disable,
        "allow" | "prefer" => SslMode::Prefer,
        "require" => SslMode::Require,
        "verify-ca" => SslMode::VerifyCa,
        "verify-full" => SslMode::VerifyFull,
        other => {
            return Err(Fatal::usage(format!(
                "invalid sslmode {other:?} in the database URL (disable, allow, prefer, require, verify-ca, verify-full)"
            )))
        }
    })
}

/// Takes the TLS parameters out of a connection string (URL or `key=value` form); returns the
/// rest, for tokio-postgres, and the parameters (libpq's default: `prefer`).
pub fn split(text: &str) -> Result<(String, TlsParams), Fatal> {
    let (rest, pairs) = if text.starts_with("postgres://") || text.starts_with("postgresql://") {
        split_url(text)
    } else {
        split_key_values(text)
    };
    let mut p = TlsParams {
        mode: SslMode::Prefer,
        root_cert: None,
        cert: None,
        key: None,
    };
    for (k, v) in pairs {
        match k.as_str() {
            "sslmode" => p.mode = parse_mode(&v)?,
            "sslrootcert" => p.root_cert = Some(v.into()),
            "sslcert" => p.cert = Some(v.into()),
            _ => p.key = Some(v.into()),
        }
    }
    Ok((rest, p))
}

/// `postgres://…?a=b&sslmode=x`: the query without the TLS parameters (values percent-decoded).
fn split_url(text: &str) -> (String, Vec<(String, String)>) {
    let Some((base, query)) = text.split_once('?') else {
        return (text.to_string(), Vec::new());
    };
    let mut kept = Vec::new();
    let mut ours = Vec::new();
    for part in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = part.split_once('=').unwrap_or((part, ""));
        if KEYS.contains(&k) {
            ours.push((k.to_string(), percent_decode(v)));
        } else {
            kept.push(part);
        }
    }
    let rest = if kept.is_empty() {
        base.to_string()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    (rest, ours)
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = (b[i] == b'%' && i + 2 < b.len())
            .then(|| std::str::from_utf8(&b[i + 1..i + 3]).ok())
            .flatten()
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match hex {
            Some(c) => {
                out.push(c);
                i += 3;
            }
            None => {
                out.push(b[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `host=h sslmode=x sslrootcert='/a b'`: the string without the TLS pairs, and their values
/// (single quotes and backslash escapes as libpq reads them). Anything unparsable is left in the
/// rest, for tokio-postgres to report.
fn split_key_values(text: &str) -> (String, Vec<(String, String)>) {
    let chars: Vec<char> = text.chars().collect();
    let mut rest = String::new();
    let mut ours = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let start = i;
        while i < chars.len() && chars[i].is_whitespace() {
            i += 1;
        }
        let key_start = i;
        while i < chars.len() && !chars[i].is_whitespace() && chars[i] != '=' {
            i += 1;
        }
        let key: String = chars[key_start..i].iter().collect();
        while i < chars.len() && chars[i].is_whitespace() {
            i += 1;
        }
        if i >= chars.len() || chars[i] != '=' {
            rest.extend(&chars[start..]);
            break;
        }
        i += 1;
        while i < chars.len() && chars[i].is_whitespace() {
            i += 1;
        }
        let mut value = String::new();
        if i < chars.len() && chars[i] == '\'' {
            i += 1;
            while i < chars.len() && chars[i] != '\'' {
                if chars[i] == '\\' && i + 1 < chars.len() {
                    i += 1;
                }
                value.push(chars[i]);
                i += 1;
            }
            i += 1;
        } else {
            while i < chars.len() && !chars[i].is_whitespace() {
                if chars[i] == '\\' && i + 1 < chars.len() {
                    i += 1;
                }
                value.push(chars[i]);
                i += 1;
            }
        }
        if KEYS.contains(&key.as_str()) {
            ours.push((key, value));
        } else {
            rest.extend(&chars[start..i.min(chars.len())]);
        }
    }
    (rest.trim().to_string(), ours)
}

/// Whether a connection error is a failed TLS negotiation (certificate not trusted, wrong host
/// name, server without TLS under `require`): a configuration error, not an outage.
pub fn is_tls_failure(e: &(dyn StdError + 'static)) -> bool {
    let mut cur: Option<&(dyn StdError + 'static)> = Some(e);
    while let Some(err) = cur {
        if err.is::<openssl::ssl::Error>() || err.is::<openssl::error::ErrorStack>() {
            return true;
        }
        // tokio-postgres does not expose its error kind; its TLS errors all say this.
        if err
            .to_string()
            .starts_with("error performing TLS handshake")
        {
            return true;
        }
        cur = err.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_parameters_are_taken_out() {
        let (rest, p) = split(
            "postgres://u:pw@db:5432/app?application_name=x&sslmode=verify-full&sslrootcert=%2Fetc%2Fca.pem",
        )
        .expect("valid");
        assert_eq!(rest, "postgres://u:pw@db:5432/app?application_name=x");
        assert_eq!(p.mode, SslMode::VerifyFull);
        assert_eq!(p.root_cert, Some(PathBuf::from("/etc/ca.pem")));
        let (rest, p) = split("postgresql://db/app?sslmode=require").expect("valid");
        assert_eq!(rest, "postgresql://db/app");
        assert_eq!(p.effective_mode(), SslMode::Require);
    }

    #[test]
    fn key_value_parameters_are_taken_out() {
        let (rest, p) = split(
            "host=db sslmode = verify-ca sslrootcert='/a b/c\\'s.pem' password='x y' dbname=app",
        )
        .expect("valid");
        assert_eq!(rest, "host=db password='x y' dbname=app");
        assert_eq!(p.mode, SslMode::VerifyCa);
        assert_eq!(p.root_cert, Some(PathBuf::from("/a b/c's.pem")));
        let (rest, p) = split("host=db dbname=app").expect("valid");
        assert_eq!(rest, "host=db dbname=app");
        assert_eq!(p.mode, SslMode::Prefer);
        // require with a CA file verifies the chain, as libpq does.
        let (_, p) = split("host=db sslmode=require sslrootcert=/ca.pem").expect("valid");
        assert_eq!(p.effective_mode(), SslMode::VerifyCa);
    }

    #[test]
    fn bad_values_are_one_line() {
        let e = split("host=db sslmode=verify").expect_err("bad mode");
        assert_eq!(e.code, 2);
        assert!(e.message.contains("\"verify\""), "{}", e.message);
        let (_, p) =
            split("host=db sslmode=verify-full sslrootcert=/nonexistent.pem").expect("parses");
        let e = p.connector().err().expect("missing CA file");
        assert!(e.message.contains("/nonexistent.pem"), "{}", e.message);
    }
}
