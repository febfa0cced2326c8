//! A real Apache RocketMQ 5 per test: a name server and a broker with its gRPC proxy in one JVM
//! (the proxy's local mode), as `scripts/rocketmq start` runs them, from the same templates
//! (`scripts/rocketmq-conf/`) and the jars `scripts/rocketmq install` put into
//! `$OUTBOX_TOOLS/rocketmq-<version>`. Topics are created and read back over the broker's own
//! remoting protocol (a JSON header per request), queue by queue in offset order.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::broker::{free_port, Msg};
use crate::kafka::log_tail;

const ENV_SH: &str = include_str!("../../scripts/env.sh");
const BROKER_CONF: &str = include_str!("../../scripts/rocketmq-conf/broker.conf");
const PROXY_JSON: &str = include_str!("../../scripts/rocketmq-conf/proxy.json");
const NAMESRV_CONF: &str = include_str!("../../scripts/rocketmq-conf/namesrv.conf");
const JVM_OPTIONS: &str = include_str!("../../scripts/rocketmq-conf/jvm.options");

/// How long a start may take until the broker answers and the proxy listens.
const START_TIMEOUT: Duration = Duration::from_secs(120);
/// Queues of a topic the tests create.
pub const QUEUES: i32 = 8;

/// Remoting request codes (RocketMQ's `RequestCode`).
const UPDATE_AND_CREATE_TOPIC: i32 = 17;
const PULL_MESSAGE: i32 = 11;
const GET_BROKER_RUNTIME_INFO: i32 = 28;
const GET_ROUTEINFO_BY_TOPIC: i32 = 105;
const GET_BROKER_CLUSTER_INFO: i32 = 106;
/// Response codes of a pull that found nothing (more).
const PULL_NOT_FOUND: i32 = 19;
const PULL_OFFSET_MOVED: i32 = 21;

/// `ROCKETMQ_VERSION` of `scripts/env.sh`.
pub fn version() -> &'static str {
    ENV_SH
        .lines()
        .find_map(|l| l.strip_prefix("ROCKETMQ_VERSION="))
        .map(str::trim)
        .expect("ROCKETMQ_VERSION=... in scripts/env.sh")
}

/// `$ROCKETMQ_HOME`, else `$OUTBOX_TOOLS/rocketmq-<version>`, as in `scripts/env.sh`.
pub fn home() -> PathBuf {
    if let Some(h) = std::env::var_os("ROCKETMQ_HOME") {
        return h.into();
    }
    std::env::var_os("OUTBOX_TOOLS")
        .map(PathBuf::from)
        .unwrap_or_else(|| "/opt/outbox-tools".into())
        .join(format!("rocketmq-{}", version()))
}

pub struct RocketMq {
    /// The proxy's gRPC port: the relay's `--rocketmq-proxy`.
    pub port: u16,
    pub broker_port: u16,
    namesrv_port: u16,
    dir: PathBuf,
    namesrv: Option<Child>,
    proxy: Option<Child>,
    /// `ROCKETMQ_DIR` of a RocketMQ that `scripts/rocketmq` started (and stops when dropped).
    script_dir: Option<PathBuf>,
}

/// A broker port P whose neighbours P-2 (its fast remoting port) and P+1 (its replication port)
/// are free too.
fn broker_port() -> u16 {
    loop {
        let p = free_port();
        let free = |q: u16| std::net::TcpListener::bind(("127.0.0.1", q)).is_ok();
        if p > 2 && free(p - 2) && free(p + 1) {
            return p;
        }
    }
}

/// Whether process `pid` holds a socket listening on loopback or any address at `port`, read from
/// /proc/net/tcp and tcp6 and the process's descriptors.
fn listens(pid: u32, port: u16) -> bool {
    let sockets: Vec<String> = ["/proc/net/tcp", "/proc/net/tcp6"]
        .into_iter()
        .filter_map(|p| std::fs::read_to_string(p).ok())
        .flat_map(|table| {
            table
                .lines()
                .skip(1)
                .filter_map(|line| {
                    let f: Vec<&str> = line.split_whitespace().collect();
                    let local = u16::from_str_radix(f.get(1)?.rsplit(':').next()?, 16).ok()?;
                    let (state, inode) = (f.get(3)?, f.get(9)?);
                    (local == port && *state == "0A").then(|| format!("socket:[{inode}]"))
                })
                .collect::<Vec<_>>()
        })
        .collect();
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    fds.flatten()
        .filter_map(|fd| std::fs::read_link(fd.path()).ok())
        .any(|target| sockets.iter().any(|s| target.as_os_str() == s.as_str()))
}

impl RocketMq {
    /// Starts a name server and a broker with its proxy on free ports, their store in a fresh
    /// directory; returns once the broker answers and the proxy listens. A free port can be taken
    /// by a test running beside this one before the JVM binds it: such a start is tried again on
    /// fresh ports, up to three times.
    pub fn start() -> RocketMq {
        let mut attempt = 0;
        loop {
            attempt += 1;
            match RocketMq::try_start() {
                Ok(r) => return r,
                Err(e) if attempt < 3 && e.contains("Address already in use") => {
                    eprintln!("RocketMQ start {attempt}: a port was taken, trying fresh ones");
                }
                Err(e) => panic!("{e}"),
            }
        }
    }

    fn try_start() -> Result<RocketMq, String> {
        let libs = home().join("libs");
        assert!(
            libs.is_dir(),
            "{} not found: scripts/rocketmq install fetches it",
            libs.display()
        );
        let port = free_port();
        let dir = std::env::temp_dir().join(format!(
            "outbox-test-rocketmq-{port}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("data")).expect("rocketmq dir");
        let mut r = RocketMq {
            port,
            broker_port: broker_port(),
            namesrv_port: free_port(),
            dir,
            namesrv: None,
            proxy: None,
            script_dir: None,
        };
        let proxy_remoting = free_port();
        for (name, template) in [
            ("broker.conf", BROKER_CONF),
            ("proxy.json", PROXY_JSON),
            ("namesrv.conf", NAMESRV_CONF),
        ] {
            let text = template
                .replace("@NAMESRV_PORT@", &r.namesrv_port.to_string())
                .replace("@BROKER_PORT@", &r.broker_port.to_string())
                .replace("@GRPC_PORT@", &port.to_string())
                .replace("@PROXY_REMOTING_PORT@", &proxy_remoting.to_string())
                .replace("@DATA_DIR@", &r.dir.join("data").display().to_string());
            std::fs::write(r.dir.join(name), text).expect("rocketmq config");
        }
        let conf = r.dir.join("namesrv.conf");
        r.namesrv = Some(r.java(
            "namesrv",
            &[
                "org.apache.rocketmq.namesrv.NamesrvStartup",
                "-c",
                &conf.display().to_string(),
            ],
        ));
        // The broker registers with the name server as it starts, and again only every 30 s: a
        // name server not answering yet would leave its topics without a route for that long.
        let deadline = Instant::now() + START_TIMEOUT;
        while request(r.namesrv_port, GET_BROKER_CLUSTER_INFO, json!({})).is_err() {
            if Instant::now() >= deadline {
                return Err(format!(
                    "the name server did not answer within {START_TIMEOUT:?}: {}",
                    log_tail(&r.dir.join("namesrv.log"), 30)
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        r.spawn_proxy();
        r.wait_started()?;
        Ok(r)
    }

    /// Started as a user starts it, by `scripts/rocketmq start PORT` (its `ROCKETMQ_DIR` a fresh
    /// directory): topics can then be created with [`RocketMq::topic_script`]. Only the script
    /// stops it (`wipe`, when dropped): `stop` and `start_again` are for [`RocketMq::start`]'s.
    pub fn start_with_script() -> RocketMq {
        let port = free_port();
        let script_dir = std::env::temp_dir().join(format!(
            "outbox-test-rocketmq-script-{port}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&script_dir);
        std::fs::create_dir_all(&script_dir).expect("rocketmq dir");
        let dir = script_dir.join(format!("rocketmq-{port}"));
        let out = script(&script_dir, &["start", &port.to_string()])
            .output()
            .expect("run scripts/rocketmq");
        assert!(
            out.status.success(),
            "scripts/rocketmq start {port}: {}{}",
            String::from_utf8_lossy(&out.stderr),
            log_tail(&dir.join("proxy.log"), 30)
        );
        let ports = std::fs::read_to_string(dir.join("ports")).expect("the script's ports file");
        let port_of = |name: &str| -> u16 {
            ports
                .lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix('='))
                .and_then(|p| p.trim().parse().ok())
                .unwrap_or_else(|| panic!("no {name} in {ports}"))
        };
        let r = RocketMq {
            port,
            broker_port: port_of("BROKER_PORT"),
            namesrv_port: port_of("NAMESRV_PORT"),
            dir,
            namesrv: None,
            proxy: None,
            script_dir: Some(script_dir),
        };
        // Until the name server lists the broker: a topic created before fails (the script
        // retries it), which would take the test's timing from the start-up, not the topic.
        let deadline = Instant::now() + START_TIMEOUT;
        while !r.registered() {
            assert!(
                Instant::now() < deadline,
                "the broker did not register within {START_TIMEOUT:?}: {}",
                log_tail(&r.dir.join("proxy.log"), 30)
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        r
    }

    /// `scripts/rocketmq topic NAME --port PORT` started (a FIFO topic, created through the
    /// admin tool): the caller waits for it.
    pub fn topic_script(&self, topic: &str) -> Child {
        let dir = self
            .script_dir
            .as_ref()
            .expect("a RocketMQ of RocketMq::start_with_script");
        script(dir, &["topic", topic, "--port", &self.port.to_string()])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run scripts/rocketmq topic")
    }

    fn java(&self, name: &str, args: &[&str]) -> Child {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join(format!("{name}.log")))
            .expect("rocketmq log");
        Command::new("java")
            .args(JVM_OPTIONS.split_whitespace())
            .arg(format!("-Duser.home={}", self.dir.display()))
            .arg("-cp")
            .arg(format!("{}/*", home().join("libs").display()))
            .args(args)
            .env("ROCKETMQ_HOME", home())
            .current_dir(&self.dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("spawn java")
    }

    /// `127.0.0.1:PORT` of the proxy, for `--rocketmq-proxy`.
    pub fn proxy_addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// The broker's (and proxy's) JVM while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.proxy.as_ref().map(Child::id)
    }

    /// Starts the stopped broker and proxy again with the same store; returns once the broker
    /// answers and the proxy listens.
    pub fn start_again(&mut self) {
        self.spawn_proxy();
        self.wait_started().unwrap_or_else(|e| panic!("{e}"));
    }

    fn spawn_proxy(&mut self) {
        let (bc, pc) = (self.dir.join("broker.conf"), self.dir.join("proxy.json"));
        let ns = format!("127.0.0.1:{}", self.namesrv_port);
        self.proxy = Some(self.java(
            "proxy",
            &[
                "org.apache.rocketmq.proxy.ProxyStartup",
                "-pm",
                "local",
                "-bc",
                &bc.display().to_string(),
                "-pc",
                &pc.display().to_string(),
                "-n",
                &ns,
            ],
        ));
    }

    /// Until the broker answers and is registered with the name server, and the proxy's own JVM
    /// listens on the gRPC port (one that only accepts may be another process's); an error with
    /// the log if the JVM exits or is too slow.
    fn wait_started(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + START_TIMEOUT;
        let pid = self.proxy.as_ref().expect("the proxy was spawned").id();
        loop {
            let exited = self
                .proxy
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten());
            let log = self.dir.join("proxy.log");
            let taken =
                std::fs::read_to_string(&log).is_ok_and(|l| l.contains("Address already in use"));
            if exited.is_some() || taken || Instant::now() >= deadline {
                return Err(format!(
                    "RocketMQ did not start within {START_TIMEOUT:?} ({exited:?}{}): {}",
                    if taken {
                        ", Address already in use"
                    } else {
                        ""
                    },
                    log_tail(&log, 30)
                ));
            }
            if listens(pid, self.port)
                && listens(pid, self.broker_port)
                && request(self.broker_port, GET_BROKER_RUNTIME_INFO, json!({})).is_ok()
                && self.registered()
            {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Whether the name server lists the broker (topics get a route only then).
    fn registered(&self) -> bool {
        request(self.namesrv_port, GET_BROKER_CLUSTER_INFO, json!({}))
            .is_ok_and(|c| String::from_utf8_lossy(&c.body).contains("outbox-broker"))
    }

    /// Stops the broker and its proxy (SIGTERM), keeping the store and the name server.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.proxy.take() {
            // SAFETY: kill(2) on our own child's pid.
            unsafe {
                libc::kill(c.id() as i32, libc::SIGTERM);
            }
            let _ = c.wait();
        }
    }

    /// A FIFO topic of [`QUEUES`] queues.
    pub fn create_topic(&self, topic: &str) {
        let r = self
            .request(
                UPDATE_AND_CREATE_TOPIC,
                json!({
                    "topic": topic,
                    "defaultTopic": "TBW102",
                    "readQueueNums": QUEUES.to_string(),
                    "writeQueueNums": QUEUES.to_string(),
                    "perm": "6",
                    "topicFilterType": "SINGLE_TAG",
                    "topicSysFlag": "0",
                    "order": "false",
                    "attributes": "+message.type=FIFO",
                }),
            )
            .expect("create topic");
        assert_eq!(r.code, 0, "create topic {topic}: {:?}", r.remark);
        // The broker answers before the name server has the new topic's route (it can take until
        // the broker's next registration): a test starts once the topic can be published to.
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            let route = json!({ "topic": topic });
            let r = request(self.namesrv_port, GET_ROUTEINFO_BY_TOPIC, route).expect("route");
            if r.code == 0 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the name server has no route of {topic} after {START_TIMEOUT:?}: {:?}",
                r.remark
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Every message stored for `topic`: `partition` the queue, `offset` the queue offset, `key`
    /// the `event_key` property, `headers` every property (the relay's headers, `KEYS`, `TAGS`,
    /// `__SHARDINGKEY`, ...).
    pub fn consume_all(&self, topic: &str) -> Vec<Msg> {
        let mut out = Vec::new();
        for queue in 0..QUEUES {
            let mut offset = 0i64;
            loop {
                let r = self
                    .request(
                        PULL_MESSAGE,
                        json!({
                            "consumerGroup": "outbox-tests",
                            "topic": topic,
                            "queueId": queue.to_string(),
                            "queueOffset": offset.to_string(),
                            "maxMsgNums": "32",
                            "sysFlag": "4",
                            "commitOffset": "0",
                            "suspendTimeoutMillis": "0",
                            "subscription": "*",
                            "subVersion": "0",
                            "expressionType": "TAG",
                        }),
                    )
                    .expect("pull");
                if r.code == PULL_NOT_FOUND || r.code == PULL_OFFSET_MOVED {
                    break;
                }
                assert_eq!(r.code, 0, "pull {topic} queue {queue}: {:?}", r.remark);
                let msgs = decode_messages(&r.body);
                if msgs.is_empty() {
                    break;
                }
                offset = msgs.last().expect("a message").offset + 1;
                out.extend(msgs);
            }
        }
        out
    }

    /// One remoting request to the broker and its response.
    fn request(&self, code: i32, ext: Value) -> std::io::Result<Response> {
        request(self.broker_port, code, ext)
    }
}

/// One remoting request to the broker or name server on `port` and its response.
fn request(port: u16, code: i32, ext: Value) -> std::io::Result<Response> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    let header = json!({
        "code": code,
        "language": "JAVA",
        "version": 0,
        "opaque": 1,
        "flag": 0,
        "extFields": ext,
        "serializeTypeCurrentRPC": "JSON",
    })
    .to_string();
    let mut frame = Vec::new();
    frame.extend(((4 + header.len()) as u32).to_be_bytes());
    frame.extend((header.len() as u32).to_be_bytes()); // serialize type 0: JSON
    frame.extend(header.as_bytes());
    s.write_all(&frame)?;
    let mut len = [0u8; 4];
    s.read_exact(&mut len)?;
    let mut buf = vec![0u8; u32::from_be_bytes(len) as usize];
    s.read_exact(&mut buf)?;
    let header_len =
        (u32::from_be_bytes(buf[..4].try_into().expect("4 bytes")) & 0xFF_FFFF) as usize;
    let header: Value = serde_json::from_slice(&buf[4..4 + header_len])
        .map_err(|e| std::io::Error::other(format!("response header: {e}")))?;
    Ok(Response {
        code: header["code"].as_i64().unwrap_or(-1) as i32,
        remark: header["remark"].as_str().map(str::to_string),
        body: buf[4 + header_len..].to_vec(),
    })
}

struct Response {
    code: i32,
    remark: Option<String>,
    body: Vec<u8>,
}

/// Reads big-endian fields off a byte slice.
struct Fields<'a>(&'a [u8]);

impl Fields<'_> {
    fn take(&mut self, n: usize) -> &[u8] {
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        a
    }
    fn i16(&mut self) -> i16 {
        i16::from_be_bytes(self.take(2).try_into().expect("2 bytes"))
    }
    fn i32(&mut self) -> i32 {
        i32::from_be_bytes(self.take(4).try_into().expect("4 bytes"))
    }
    fn i64(&mut self) -> i64 {
        i64::from_be_bytes(self.take(8).try_into().expect("8 bytes"))
    }
}

/// The body of a pull: stored messages one after the other, in the broker's message format
/// (version 1 or 2, IPv4 or IPv6 hosts); bodies the tests write are never compressed.
fn decode_messages(mut body: &[u8]) -> Vec<Msg> {
    const MAGIC_V2: i32 = -626843477;
    const BORNHOST_V6: i32 = 1 << 4;
    const STOREHOST_V6: i32 = 1 << 5;
    let mut out = Vec::new();
    while body.len() >= 4 {
        let total = i32::from_be_bytes(body[..4].try_into().expect("4 bytes")) as usize;
        let mut f = Fields(&body[..total]);
        body = &body[total..];
        f.i32(); // total size
        let magic = f.i32();
        f.i32(); // body CRC
        let queue = f.i32();
        f.i32(); // flag
        let offset = f.i64();
        f.i64(); // physical offset
        let sys_flag = f.i32();
        let born_ms = f.i64();
        f.take(if sys_flag & BORNHOST_V6 != 0 { 20 } else { 8 });
        f.i64(); // store timestamp
        f.take(if sys_flag & STOREHOST_V6 != 0 { 20 } else { 8 });
        f.i32(); // reconsume times
        f.i64(); // prepared transaction offset
        let body_len = f.i32() as usize;
        let value = String::from_utf8_lossy(f.take(body_len)).into_owned();
        let topic_len = if magic == MAGIC_V2 {
            f.i16() as usize
        } else {
            f.take(1)[0] as usize
        };
        f.take(topic_len);
        let props_len = f.i16() as usize;
        let props = String::from_utf8_lossy(f.take(props_len)).into_owned();
        let headers: BTreeMap<String, String> = props
            .split('\u{2}')
            .filter_map(|kv| kv.split_once('\u{1}'))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        out.push(Msg {
            partition: queue as i64,
            offset,
            key: headers.get(outbox_worker::HEADER_EVENT_KEY).cloned(),
            headers,
            value,
            timestamp_ms: Some(born_ms),
        });
    }
    out
}

impl Drop for RocketMq {
    fn drop(&mut self) {
        for c in [self.proxy.take(), self.namesrv.take()]
            .into_iter()
            .flatten()
        {
            let mut c = c;
            let _ = c.kill();
            let _ = c.wait();
        }
        if let Some(dir) = &self.script_dir {
            let _ = script(dir, &["stop", &self.port.to_string()]).output();
        }
        if std::thread::panicking() {
            eprintln!("RocketMQ of the failed test kept in {}", self.dir.display());
        } else {
            let _ = std::fs::remove_dir_all(self.script_dir.as_ref().unwrap_or(&self.dir));
        }
    }
}

/// `scripts/rocketmq ARGS` with `ROCKETMQ_DIR` set to `dir`.
fn script(dir: &std::path::Path, args: &[&str]) -> Command {
    let mut cmd = Command::new(crate::build::repo_root().join("scripts/rocketmq"));
    cmd.args(args)
        .env("ROCKETMQ_DIR", dir)
        .env("ROCKETMQ_HOME", home())
        .stdin(Stdio::null());
    cmd
}
