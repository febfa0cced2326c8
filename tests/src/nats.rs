//! A real NATS server with JetStream per test (built by `scripts/nats install`), on a free
//! loopback port, killed on drop; a stream per topic; reading a stream back message by message.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, stream};

use crate::broker::{free_port, Msg};

const ENV_SH: &str = include_str!("../../scripts/env.sh");

/// How long a start may take until JetStream answers.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// `NATS_SERVER_VERSION` of `scripts/env.sh`.
pub fn version() -> &'static str {
    ENV_SH
        .lines()
        .find_map(|l| l.strip_prefix("NATS_SERVER_VERSION="))
        .map(str::trim)
        .expect("NATS_SERVER_VERSION=... in scripts/env.sh")
}

/// The nats-server binary: `$NATS_SERVER_HOME/nats-server`, else under `$OUTBOX_TOOLS`, as in
/// `scripts/env.sh`.
pub fn server_bin() -> PathBuf {
    let home = std::env::var_os("NATS_SERVER_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            std::env::var_os("OUTBOX_TOOLS")
                .map(PathBuf::from)
                .unwrap_or_else(|| "/opt/outbox-tools".into())
                .join(format!("nats-server-{}", version()))
        });
    home.join("nats-server")
}

pub struct Nats {
    pub port: u16,
    dir: PathBuf,
    child: Option<Child>,
    /// TLS and a user, when the server requires them.
    secure: Option<Secure>,
}

/// A TLS listener with this certificate and key, and a user with a password.
#[derive(Clone)]
pub struct Secure {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// The CA that signed `cert`, which the helpers' own client trusts.
    pub ca: PathBuf,
    pub user: String,
    pub password: String,
}

/// Runs `f` on a runtime of its own (the helpers are called from sync and async tests alike).
fn block_on<T: Send>(f: impl std::future::Future<Output = T> + Send) -> T {
    std::thread::scope(|s| {
        s.spawn(|| {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime")
                .block_on(f)
        })
        .join()
        .expect("nats helper thread")
    })
}

impl Nats {
    /// Starts a server with JetStream on a free port, its store in a fresh directory.
    pub fn start() -> Nats {
        Nats::start_with(None)
    }

    /// As `start`, with TLS required and a user with a password.
    pub fn start_secure(secure: Secure) -> Nats {
        Nats::start_with(Some(secure))
    }

    /// A port free when chosen can be taken before the server binds it: then another.
    fn start_with(secure: Option<Secure>) -> Nats {
        let port = free_port();
        let dir =
            std::env::temp_dir().join(format!("outbox-test-nats-{port}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("nats store dir");
        let mut n = Nats {
            port,
            dir,
            child: None,
            secure,
        };
        for attempt in 1..=3 {
            match n.try_start() {
                Ok(()) => return n,
                Err(e) if attempt < 3 && e.contains("address already in use") => {
                    n.port = free_port();
                }
                Err(e) => panic!("{e}"),
            }
        }
        unreachable!("the last attempt returns or panics")
    }

    /// The server's process while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// `nats://127.0.0.1:PORT` for `--nats-url`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// A connection of the helpers' own, with the CA and user of a secure server.
    async fn client(&self) -> Result<async_nats::Client, async_nats::ConnectError> {
        let mut o = async_nats::ConnectOptions::new();
        let mut url = self.url();
        if let Some(s) = &self.secure {
            o = o
                .add_root_certificates(s.ca.clone())
                .require_tls(true)
                .user_and_password(s.user.clone(), s.password.clone());
            url = format!("tls://localhost:{}", self.port);
        }
        o.connect(url).await
    }

    /// Starts the stopped server again on the same port with the same store; returns once
    /// JetStream answers.
    pub fn start_again(&mut self) {
        self.try_start().unwrap_or_else(|e| panic!("{e}"));
    }

    /// Starts the server and waits until its own log says it is ready and it answers: another
    /// process's server on the port would answer too.
    fn try_start(&mut self) -> Result<(), String> {
        let bin = server_bin();
        assert!(
            bin.exists(),
            "{} not found: scripts/nats install builds it",
            bin.display()
        );
        let log = std::fs::File::create(self.dir.join("server.log")).expect("nats log");
        let child = Command::new(bin)
            .args([
                "-a",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-js",
                "-sd",
            ])
            .arg(self.dir.join("store"))
            .args(self.secure.iter().flat_map(|s| {
                [
                    "--tls".into(),
                    "--tlscert".into(),
                    s.cert.display().to_string(),
                    "--tlskey".into(),
                    s.key.display().to_string(),
                    "--user".into(),
                    s.user.clone(),
                    "--pass".into(),
                    s.password.clone(),
                ]
            }))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("spawn nats-server");
        self.child = Some(child);
        let deadline = Instant::now() + START_TIMEOUT;
        let log = || std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default();
        loop {
            if let Some(Ok(Some(st))) = self.child.as_mut().map(Child::try_wait) {
                self.child = None;
                return Err(format!("nats-server exited ({st}): {}", log()));
            }
            let answers = log().contains("Server is ready")
                && block_on(async {
                    let Ok(c) = self.client().await else {
                        return false;
                    };
                    jetstream::new(c).query_account().await.is_ok()
                });
            if answers {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "nats-server did not answer within {START_TIMEOUT:?}: {}",
                    log()
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Stops the server (SIGTERM), keeping its store.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // SAFETY: kill(2) on our own child's pid.
            unsafe {
                libc::kill(c.id() as i32, libc::SIGTERM);
            }
            let _ = c.wait();
        }
    }

    /// A stream named after `topic` that captures the subject `topic` and `topic.>`.
    pub fn create_stream(&self, topic: &str) {
        block_on(async move {
            let js = jetstream::new(self.client().await.expect("connect"));
            js.create_stream(stream::Config {
                name: topic.replace('.', "_"),
                subjects: vec![topic.to_string(), format!("{topic}.>")],
                ..Default::default()
            })
            .await
            .expect("create stream");
        });
    }

    /// Every message of the stream of `topic` in stream order: `partition` 0, `offset` the
    /// stream sequence, `key` the `event_key` header.
    pub fn consume_all(&self, topic: &str) -> Vec<Msg> {
        block_on(async move {
            let js = jetstream::new(self.client().await.expect("connect"));
            let mut s = js
                .get_stream(topic.replace('.', "_"))
                .await
                .expect("stream");
            let state = s.info().await.expect("stream info").state.clone();
            let mut out = Vec::new();
            if state.messages == 0 {
                return out;
            }
            for seq in state.first_sequence..=state.last_sequence {
                let m = s.get_raw_message(seq).await.expect("stream message");
                let headers: std::collections::BTreeMap<String, String> = m
                    .headers
                    .iter()
                    .filter_map(|(k, v)| Some((k.to_string(), v.first()?.to_string())))
                    .collect();
                out.push(Msg {
                    partition: 0,
                    offset: seq as i64,
                    key: headers.get(outbox_worker::HEADER_EVENT_KEY).cloned(),
                    headers,
                    value: String::from_utf8_lossy(&m.payload).into_owned(),
                    timestamp_ms: None,
                });
            }
            out
        })
    }
}

impl Drop for Nats {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        if std::thread::panicking() {
            eprintln!("NATS of the failed test kept in {}", self.dir.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}
