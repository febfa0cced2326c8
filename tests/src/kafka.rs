//! A local single-node Apache Kafka (KRaft: broker and controller in one JVM) run as a child
//! process: what `scripts/broker start` does, from the same templates (`scripts/kafka/`) and the
//! Kafka that `scripts/broker install` put into `$OUTBOX_TOOLS/kafka-<version>`.
//!
//! Used through `Broker` (`tests/src/broker.rs`) by the tests and by outbox-bench.

use std::fs::{File, OpenOptions};
use std::future::Future;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::task::{Context, Poll, Wake};
use std::time::{Duration, Instant};

use rdkafka::admin::{
    AdminClient, AdminOptions, AlterConfig, NewTopic, ResourceSpecifier, TopicReplication,
};
use rdkafka::client::DefaultClientContext;
use rdkafka::ClientConfig;

const ENV_SH: &str = include_str!("../../scripts/env.sh");
const SERVER_PROPERTIES: &str = include_str!("../../scripts/kafka/server.properties");
const LOG4J2_XML: &str = include_str!("../../scripts/kafka/log4j2.xml");
const JVM_OPTIONS: &str = include_str!("../../scripts/kafka/jvm.options");

/// How long a start or a restart may take until the broker answers a metadata request.
pub const START_TIMEOUT: Duration = Duration::from_secs(90);
/// How long a clean shutdown (SIGTERM) may take before the JVM is killed.
pub const STOP_TIMEOUT: Duration = Duration::from_secs(30);

/// `KAFKA_VERSION` of `scripts/env.sh`.
pub fn version() -> &'static str {
    ENV_SH
        .lines()
        .find_map(|l| l.strip_prefix("KAFKA_VERSION="))
        .map(str::trim)
        .expect("KAFKA_VERSION=... in scripts/env.sh")
}

/// `$KAFKA_HOME`, else `$OUTBOX_TOOLS/kafka-<version>` (`OUTBOX_TOOLS` defaults to
/// `/opt/outbox-tools`), as in `scripts/env.sh`.
pub fn home() -> PathBuf {
    if let Some(h) = std::env::var_os("KAFKA_HOME") {
        return h.into();
    }
    let tools = std::env::var_os("OUTBOX_TOOLS")
        .map(PathBuf::from)
        .unwrap_or_else(|| "/opt/outbox-tools".into());
    tools.join(format!("kafka-{}", version()))
}

/// A loopback port nothing listens on right now.
pub fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// The last `n` lines of a file.
pub fn log_tail(path: &Path, n: usize) -> String {
    let s = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// URL-safe base64 without padding (Kafka's cluster ids, JWT parts).
pub fn base64url(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut bits: u32 = 0;
    let mut n = 0;
    let mut out = String::with_capacity(bytes.len() * 4 / 3 + 1);
    for &byte in bytes {
        bits = (bits << 8) | u32::from(byte);
        n += 8;
        while n >= 6 {
            n -= 6;
            out.push(ALPHABET[((bits >> n) & 63) as usize] as char);
        }
    }
    if n > 0 {
        out.push(ALPHABET[((bits << (6 - n)) & 63) as usize] as char);
    }
    out
}

/// A random Kafka cluster id: 16 random bytes in URL-safe base64 without padding, not starting
/// with `-` (the format tool would take it for an option; Kafka's own `Uuid.randomUuid` redraws
/// those too). Before that check, 1 broker start in 64 failed.
/// A broker's storage formatted once per machine and Kafka version, which a broker without SASL
/// users starts from a copy of: formatting is a JVM run (about 2 s), and the storage holds
/// nothing of the broker's ports (the controller voters are static, in server.properties).
/// Every copy has the same cluster id, which no test compares across brokers.
fn storage_template() -> Result<PathBuf, String> {
    let dir = std::env::temp_dir().join(format!("outbox-kafka-storage-{}", version()));
    if dir.join("data/meta.properties").exists() {
        return Ok(dir.join("data"));
    }
    // Formatted beside it and renamed into place, so a concurrent test never sees half of it.
    let tmp = dir.with_extension(format!("{}.tmp", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(|e| format!("creating {}: {e}", tmp.display()))?;
    // The storage records no path: formatted under tmp, it works wherever it is copied.
    let props = SERVER_PROPERTIES
        .replace("@PORT@", "0")
        .replace("@CONTROLLER_PORT@", "1")
        .replace("@DATA_DIR@", &tmp.join("data").to_string_lossy());
    for (name, text) in [
        ("server.properties", props.as_str()),
        ("log4j2.xml", LOG4J2_XML),
        ("jvm.options", JVM_OPTIONS),
    ] {
        std::fs::write(tmp.join(name), text).map_err(|e| format!("{name}: {e}"))?;
    }
    let k = Kafka {
        port: 0,
        controller_port: 1,
        dir: tmp.clone(),
        child: None,
    };
    k.format(None)?;
    if std::fs::rename(&tmp, &dir).is_err() {
        // Another test formatted it first.
        let _ = std::fs::remove_dir_all(&tmp);
    }
    Ok(dir.join("data"))
}

/// Copies the directory tree `from` into `to` (created).
fn copy_dir(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let dest = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_dir(&entry.path(), &dest)?;
        } else {
            std::fs::copy(entry.path(), dest)?;
        }
    }
    Ok(())
}

fn random_cluster_id() -> std::io::Result<String> {
    let mut b = [0u8; 16];
    loop {
        File::open("/dev/urandom")?.read_exact(&mut b)?;
        let id = base64url(&b);
        if !id.starts_with('-') {
            return Ok(id);
        }
    }
}

/// True when a Kafka broker on 127.0.0.1:`port` answers a Metadata request (v4) listing at least
/// one broker. A KRaft broker accepts TCP connections before it serves requests, so an open port
/// is not enough.
pub fn metadata_ok(port: u16) -> bool {
    fn probe(port: u16) -> std::io::Result<bool> {
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(1))?;
        s.set_read_timeout(Some(Duration::from_secs(2)))?;
        s.set_write_timeout(Some(Duration::from_secs(2)))?;
        // size 20 | api_key 3 (Metadata) | version 4 | correlation id 1 | client id "probe" |
        // topics null (all) | allow_auto_topic_creation false
        let mut req = vec![0, 0, 0, 20, 0, 3, 0, 4, 0, 0, 0, 1, 0, 5];
        req.extend_from_slice(b"probe");
        req.extend_from_slice(&[0xff, 0xff, 0xff, 0xff, 0]);
        s.write_all(&req)?;
        // size | correlation id | throttle_time_ms | brokers count
        let mut head = [0u8; 16];
        s.read_exact(&mut head)?;
        let int = |i: usize| i32::from_be_bytes([head[i], head[i + 1], head[i + 2], head[i + 3]]);
        Ok(int(4) == 1 && int(12) >= 1)
    }
    probe(port).unwrap_or(false)
}

/// A second listener, SASL_PLAINTEXT with SCRAM-SHA-256 and OAUTHBEARER, and its one SCRAM user
/// (created at format time with `kafka-storage format --add-scram`, as KRaft allows before the
/// first start). OAUTHBEARER is validated by Kafka's default, unsecured handler (unsigned tokens,
/// any principal): it shows the mechanism works, not a token provider.
#[derive(Debug, Clone)]
pub struct Sasl {
    pub port: u16,
    pub user: String,
    pub password: String,
}

impl Sasl {
    /// Properties appended to `server.properties` (a later key overrides the template's).
    fn properties(&self, port: u16, controller_port: u16) -> String {
        let sasl = self.port;
        format!(
            "\n# SASL listener (tests/src/kafka.rs Sasl)\n\
             listeners=PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port},SASL_PLAINTEXT://127.0.0.1:{sasl}\n\
             advertised.listeners=PLAINTEXT://127.0.0.1:{port},SASL_PLAINTEXT://127.0.0.1:{sasl}\n\
             listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT,SASL_PLAINTEXT:SASL_PLAINTEXT\n\
             sasl.enabled.mechanisms=SCRAM-SHA-256,OAUTHBEARER\n\
             listener.name.sasl_plaintext.scram-sha-256.sasl.jaas.config=\
             org.apache.kafka.common.security.scram.ScramLoginModule required;\n\
             listener.name.sasl_plaintext.oauthbearer.sasl.jaas.config=\
             org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginModule required;\n"
        )
    }
}

/// Two listeners over TLS: SSL on `ssl_port` and SASL_SSL (SCRAM-SHA-256, the one user made at
/// format time) on `sasl_ssl_port`, bound to 127.0.0.1 and advertised under `host`, the name in
/// the server certificate, so a client that verifies names must reach them by that name. The key
/// (unencrypted PKCS#8) and the certificate are PEM files, given to Kafka inline (`ssl.keystore.type
/// = PEM`): Java reads an unencrypted key only that way.
#[derive(Debug, Clone)]
pub struct Tls {
    pub host: String,
    pub ssl_port: u16,
    pub sasl_ssl_port: u16,
    pub user: String,
    pub password: String,
    pub key: PathBuf,
    pub cert: PathBuf,
}

impl Tls {
    fn properties(&self, port: u16, controller_port: u16) -> Result<String, String> {
        // Kafka's PEM parser wants whitespace between the lines, not line breaks: one line.
        let pem = |p: &Path| {
            std::fs::read_to_string(p)
                .map(|s| s.split_whitespace().collect::<Vec<_>>().join(" "))
                .map_err(|e| format!("reading {}: {e}", p.display()))
        };
        let (key, cert) = (pem(&self.key)?, pem(&self.cert)?);
        let (host, ssl, sasl) = (&self.host, self.ssl_port, self.sasl_ssl_port);
        Ok(format!(
            "\n# TLS listeners (tests/src/kafka.rs Tls)\n\
             listeners=PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port},SSL://127.0.0.1:{ssl},SASL_SSL://127.0.0.1:{sasl}\n\
             advertised.listeners=PLAINTEXT://127.0.0.1:{port},SSL://{host}:{ssl},SASL_SSL://{host}:{sasl}\n\
             listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT,SSL:SSL,SASL_SSL:SASL_SSL\n\
             sasl.enabled.mechanisms=SCRAM-SHA-256\n\
             listener.name.sasl_ssl.scram-sha-256.sasl.jaas.config=\
             org.apache.kafka.common.security.scram.ScramLoginModule required;\n\
             ssl.keystore.type=PEM\n\
             ssl.keystore.key={key}\n\
             ssl.keystore.certificate.chain={cert}\n"
        ))
    }
}

/// The listeners a broker has besides PLAINTEXT and the controller's.
#[derive(Debug, Clone, Copy)]
pub enum Listeners<'a> {
    Sasl(&'a Sasl),
    Tls(&'a Tls),
}

impl<'a> Listeners<'a> {
    fn properties(self, port: u16, controller_port: u16) -> Result<String, String> {
        match self {
            Listeners::Sasl(s) => Ok(s.properties(port, controller_port)),
            Listeners::Tls(t) => t.properties(port, controller_port),
        }
    }

    /// The SCRAM-SHA-256 user created at format time.
    fn scram_user(self) -> (&'a str, &'a str) {
        match self {
            Listeners::Sasl(s) => (&s.user, &s.password),
            Listeners::Tls(t) => (&t.user, &t.password),
        }
    }
}

/// One broker: its ports, its directory (`server.properties`, the logging and JVM options,
/// `data/`, `kafka.log`) and, while it runs, its JVM.
pub struct Kafka {
    pub port: u16,
    pub controller_port: u16,
    pub dir: PathBuf,
    child: Option<Child>,
}

impl Kafka {
    /// Formats a new broker in `dir` (emptied first), listening on 127.0.0.1:`port` (controller:
    /// a free port), starts it and waits until it answers a metadata request.
    pub fn start(dir: &Path, port: u16) -> Result<Kafka, String> {
        Kafka::start_with(dir, port, None)
    }

    /// `start`, plus the `extra` listeners.
    pub fn start_with(
        dir: &Path,
        port: u16,
        extra: Option<Listeners<'_>>,
    ) -> Result<Kafka, String> {
        let home = home();
        if !home.join(".installed").exists() {
            return Err(format!(
                "Apache Kafka {} is not installed in {} (run scripts/broker install)",
                version(),
                home.display()
            ));
        }
        let err = |what: &str, e: std::io::Error| format!("{what}: {e}");
        if dir.exists() {
            std::fs::remove_dir_all(dir).map_err(|e| err("emptying the broker dir", e))?;
        }
        let data = dir.join("data");
        std::fs::create_dir_all(&data).map_err(|e| err("creating the broker dir", e))?;
        // Never the listener's own port, which free_port can hand out again once released.
        let controller_port = loop {
            let p = free_port().map_err(|e| err("controller port", e))?;
            if p != port {
                break p;
            }
        };
        let mut props = SERVER_PROPERTIES
            .replace("@PORT@", &port.to_string())
            .replace("@CONTROLLER_PORT@", &controller_port.to_string())
            .replace("@DATA_DIR@", &data.to_string_lossy());
        if let Some(l) = extra {
            props.push_str(&l.properties(port, controller_port)?);
        }
        for (name, text) in [
            ("server.properties", props.as_str()),
            ("log4j2.xml", LOG4J2_XML),
            ("jvm.options", JVM_OPTIONS),
        ] {
            std::fs::write(dir.join(name), text).map_err(|e| err(name, e))?;
        }
        let mut k = Kafka {
            port,
            controller_port,
            dir: dir.to_path_buf(),
            child: None,
        };
        match extra {
            Some(_) => k.format(extra)?,
            None => copy_dir(&storage_template()?, &data)
                .map_err(|e| err("copying the formatted storage", e))?,
        }
        k.launch()?;
        Ok(k)
    }

    /// Formats the storage named by this broker's server.properties (a JVM run of its own), with
    /// the SCRAM user of the `extra` listeners if any.
    fn format(&self, extra: Option<Listeners<'_>>) -> Result<(), String> {
        let cluster_id = random_cluster_id().map_err(|e| format!("cluster id: {e}"))?;
        let mut format_cmd = self.java()?;
        format_cmd
            .args(["kafka.tools.StorageTool", "format", "--config"])
            .arg(self.dir.join("server.properties"))
            .args(["--cluster-id", &cluster_id]);
        if let Some(l) = extra {
            let (user, password) = l.scram_user();
            format_cmd
                .arg("--add-scram")
                .arg(format!("SCRAM-SHA-256=[name={user},password={password}]"));
        }
        let st = format_cmd
            .status()
            .map_err(|e| format!("running java (kafka.tools.StorageTool): {e}"))?;
        if !st.success() {
            return Err(format!(
                "formatting the storage failed ({st}):\n{}",
                log_tail(&self.log(), 20)
            ));
        }
        Ok(())
    }

    /// How many runs of the JVM in this directory logged that the server started.
    fn starts_logged(&self) -> usize {
        std::fs::read_to_string(self.log())
            .map(|l| l.matches("Kafka Server started").count())
            .unwrap_or(0)
    }

    /// The broker's log (stdout and stderr of every JVM run in this directory).
    pub fn log(&self) -> PathBuf {
        self.dir.join("kafka.log")
    }

    /// `host:port` for `bootstrap.servers`.
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// The JVM's pid while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn signal(&self, sig: i32) {
        if let Some(pid) = self.pid() {
            // SAFETY: kill(2) on our own child's pid (not yet reaped: we hold its Child).
            unsafe {
                libc::kill(pid as i32, sig);
            }
        }
    }

    /// `java` with the JVM options, the class-data sharing archive if there is one, the logging
    /// configuration and Kafka's jars, output appended to the broker's log.
    fn java(&self) -> Result<Command, String> {
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log())
            .map_err(|e| format!("opening {}: {e}", self.log().display()))?;
        let log2 = log.try_clone().map_err(|e| format!("broker log fd: {e}"))?;
        let mut cmd = Command::new("java");
        cmd.arg(format!("@{}", self.dir.join("jvm.options").display()));
        // The class-data sharing archive `scripts/broker install` records: a faster start-up.
        let cds = home().join("kafka.jsa");
        if cds.exists() {
            cmd.arg(format!("-XX:SharedArchiveFile={}", cds.display()));
        }
        cmd.arg(format!(
            "-Dlog4j2.configurationFile={}",
            self.dir.join("log4j2.xml").display()
        ))
        .arg("-cp")
        .arg(format!("{}/libs/*", home().display()))
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log2);
        Ok(cmd)
    }

    /// Starts the JVM on the existing directory and waits until it answers and its own log says
    /// it started: another broker that took the port would answer too.
    fn launch(&mut self) -> Result<(), String> {
        let starts_before = self.starts_logged();
        let child = self
            .java()?
            .arg("kafka.Kafka")
            .arg(self.dir.join("server.properties"))
            .spawn()
            .map_err(|e| format!("starting java kafka.Kafka: {e}"))?;
        self.child = Some(child);
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if metadata_ok(self.port) && self.starts_logged() > starts_before {
                return Ok(());
            }
            if let Some(st) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                self.child = None;
                return Err(format!(
                    "Kafka exited at start-up ({st}), log {}:\n{}",
                    self.log().display(),
                    log_tail(&self.log(), 20)
                ));
            }
            if Instant::now() > deadline {
                self.kill();
                return Err(format!(
                    "Kafka did not answer a metadata request on {} within {} s, log {}:\n{}",
                    self.addr(),
                    START_TIMEOUT.as_secs(),
                    self.log().display(),
                    log_tail(&self.log(), 20)
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Clean shutdown: SIGTERM (after SIGCONT, in case it is frozen), SIGKILL if it is still
    /// running after `STOP_TIMEOUT`. Returns the JVM's exit status; the data is kept.
    pub fn stop(&mut self) -> Option<ExitStatus> {
        let mut c = self.child.take()?;
        self.signal_pid(c.id(), libc::SIGCONT);
        self.signal_pid(c.id(), libc::SIGTERM);
        let deadline = Instant::now() + STOP_TIMEOUT;
        while Instant::now() < deadline {
            if let Ok(Some(st)) = c.try_wait() {
                return Some(st);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = c.kill();
        c.wait().ok()
    }

    /// Stops the JVM cleanly and starts it again on the same ports and the same data.
    pub fn restart(&mut self) -> Result<(), String> {
        self.stop();
        self.launch()
    }

    /// SIGKILL (after SIGCONT) and reap.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            self.signal_pid(c.id(), libc::SIGCONT);
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn signal_pid(&self, pid: u32, sig: i32) {
        // SAFETY: kill(2) on our own child's pid (not yet reaped).
        unsafe {
            libc::kill(pid as i32, sig);
        }
    }
}

impl Drop for Kafka {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Runs a runtime-agnostic future (rdkafka's admin futures complete from librdkafka's own
/// thread) to completion on the calling thread; usable inside or outside a tokio runtime.
fn block_on<F: Future>(f: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Arc::new(Unpark(std::thread::current())).into();
    let mut cx = Context::from_waker(&waker);
    let mut f = std::pin::pin!(f);
    loop {
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::park_timeout(Duration::from_millis(100));
    }
}

/// Creates topics with `partitions` partitions (replication factor 1) through the Admin API, then
/// waits until the broker's metadata lists every partition of each with a leader, so a producer
/// started right after does not see an unknown topic.
pub fn create_topics(addr: &str, names: &[&str], partitions: i32) -> Result<(), String> {
    create_topics_with(addr, names, partitions, &[])
}

/// The producer ids that wrote to one partition, from the broker's own producer state (Kafka's
/// `TransactionsCommand describe-producers`, which also lists idempotent producers).
pub fn producer_ids(addr: &str, topic: &str, partition: i32) -> Result<Vec<i64>, String> {
    let out = Command::new("java")
        .arg("-cp")
        .arg(format!("{}/libs/*", home().display()))
        .arg("org.apache.kafka.tools.TransactionsCommand")
        .args([
            "--bootstrap-server",
            addr,
            "describe-producers",
            "--topic",
            topic,
        ])
        .args(["--partition", &partition.to_string()])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("running java (TransactionsCommand): {e}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        return Err(format!(
            "describe-producers {topic}-{partition}: {stdout}{err}"
        ));
    }
    // A header line, then one line per producer starting with its id.
    Ok(stdout
        .lines()
        .skip(1)
        .filter_map(|l| l.split_whitespace().next()?.parse().ok())
        .collect())
}

/// [`create_topics`] with topic-level settings (e.g. `max.message.bytes`).
pub fn create_topics_with(
    addr: &str,
    names: &[&str],
    partitions: i32,
    config: &[(&str, &str)],
) -> Result<(), String> {
    let timeout = Duration::from_secs(30);
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", addr)
        .create()
        .map_err(|e| format!("admin client for {addr}: {e}"))?;
    let topics: Vec<NewTopic> = names
        .iter()
        .map(|n| {
            config.iter().fold(
                NewTopic::new(n, partitions, TopicReplication::Fixed(1)),
                |t, (k, v)| t.set(k, v),
            )
        })
        .collect();
    let opts = AdminOptions::new()
        .operation_timeout(Some(timeout))
        .request_timeout(Some(timeout));
    let results = block_on(admin.create_topics(&topics, &opts))
        .map_err(|e| format!("creating topics {names:?} on {addr}: {e}"))?;
    for r in results {
        if let Err((name, code)) = r {
            return Err(format!("creating topic {name} on {addr}: {code}"));
        }
    }
    let deadline = Instant::now() + timeout;
    for name in names {
        loop {
            let md = admin
                .inner()
                .fetch_metadata(Some(name), Duration::from_secs(5))
                .map_err(|e| format!("metadata of {name} from {addr}: {e}"))?;
            let ready = md.topics().iter().any(|t| {
                t.name() == *name
                    && t.error().is_none()
                    && t.partitions().len() == partitions as usize
                    && t.partitions()
                        .iter()
                        .all(|p| p.error().is_none() && p.leader() >= 0)
            });
            if ready {
                break;
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "topic {name} created on {addr} but its {partitions} partitions have no leader after {} s",
                    timeout.as_secs()
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    Ok(())
}

/// Sets a topic's settings through the Admin API (AlterConfigs: the settings given replace the
/// topic's, others return to the broker's defaults), e.g. `[("max.message.bytes", "1048588")]`.
pub fn alter_topic_config(addr: &str, topic: &str, config: &[(&str, &str)]) -> Result<(), String> {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", addr)
        .create()
        .map_err(|e| format!("admin client for {addr}: {e}"))?;
    let change = config.iter().fold(
        AlterConfig::new(ResourceSpecifier::Topic(topic)),
        |c, (k, v)| c.set(k, v),
    );
    let opts = AdminOptions::new().request_timeout(Some(Duration::from_secs(30)));
    let results = block_on(admin.alter_configs([&change], &opts))
        .map_err(|e| format!("altering topic {topic} on {addr}: {e}"))?;
    for r in results {
        r.map_err(|(_, code)| format!("altering topic {topic} on {addr}: {code}"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_ids_are_22_url_safe_characters() {
        let a = random_cluster_id().expect("urandom");
        let b = random_cluster_id().expect("urandom");
        assert_eq!(a.len(), 22, "{a}");
        assert!(!a.starts_with('-'), "{a}");
        assert!(
            a.bytes()
                .all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_'),
            "{a}"
        );
        assert_ne!(a, b);
        for _ in 0..1000 {
            assert!(!random_cluster_id().expect("urandom").starts_with('-'));
        }
    }

    #[test]
    fn base64url_is_rfc4648_url_safe_without_padding() {
        assert_eq!(base64url(b""), "");
        assert_eq!(base64url(b"f"), "Zg");
        assert_eq!(base64url(b"foob"), "Zm9vYg");
        assert_eq!(base64url(b"foobar"), "Zm9vYmFy");
        assert_eq!(base64url(&[0xfb, 0xff]), "-_8");
    }

    #[test]
    fn version_comes_from_env_sh() {
        assert!(version().starts_with("4."), "{}", version());
    }

    #[test]
    fn nothing_listening_is_not_a_broker() {
        let port = free_port().expect("port");
        assert!(!metadata_ok(port));
    }
}
