//! A real Kafka-protocol broker (tansu, memory storage) per test, on a free loopback port, killed
//! on drop; and reading a topic back with `outbox-worker tail` (assigned partitions, from offset 0,
//! until idle: this broker's high watermarks can't be trusted).

use std::collections::BTreeMap;
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use outbox_worker::{HEADER_EVENT_ID, HEADER_OUTBOX_ID};

use crate::worker::worker_bin;

/// A loopback port nothing listens on right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .expect("bind 127.0.0.1:0")
        .local_addr()
        .expect("local addr")
        .port()
}

pub fn tansu_bin() -> PathBuf {
    if let Ok(p) = std::env::var("TANSU_BIN") {
        return p.into();
    }
    let tools = std::env::var("OUTBOX_TOOLS").unwrap_or_else(|_| "/opt/outbox-tools".into());
    PathBuf::from(tools).join("bin/tansu")
}

pub struct Broker {
    pub port: u16,
    child: Option<Child>,
    pub log: PathBuf,
}

/// One message read back from a topic.
#[derive(Debug, Clone)]
pub struct Msg {
    pub partition: i64,
    pub offset: i64,
    pub key: Option<String>,
    pub headers: BTreeMap<String, String>,
    pub value: String,
}

impl Msg {
    /// The row id of the event in its database (the `outbox_id` header).
    pub fn outbox_id(&self) -> i64 {
        self.headers
            .get(HEADER_OUTBOX_ID)
            .unwrap_or_else(|| panic!("message without {HEADER_OUTBOX_ID} header: {self:?}"))
            .parse()
            .expect("numeric outbox_id")
    }

    /// The event's global UUID (the `event_id` header), what consumers deduplicate on.
    pub fn event_id(&self) -> &str {
        self.headers
            .get(HEADER_EVENT_ID)
            .unwrap_or_else(|| panic!("message without {HEADER_EVENT_ID} header: {self:?}"))
    }

    /// Parses one line of `outbox-worker tail --json`.
    pub fn from_json_line(line: &str) -> Msg {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("tail line {line:?}: {e}"));
        let headers = v["headers"]
            .as_object()
            .map(|m| {
                m.iter()
                    .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_string()))
                    .collect()
            })
            .unwrap_or_default();
        Msg {
            partition: v["partition"].as_i64().unwrap_or(-1),
            offset: v["offset"].as_i64().unwrap_or(-1),
            key: v["key"].as_str().map(str::to_string),
            headers,
            value: v["value"].as_str().unwrap_or_default().to_string(),
        }
    }
}

impl Broker {
    /// Starts a broker on a free port and waits until it accepts connections.
    pub fn start() -> Broker {
        Broker::start_on(free_port())
    }

    pub fn start_on(port: u16) -> Broker {
        let bin = tansu_bin();
        assert!(
            bin.exists(),
            "tansu not found at {} (run scripts/broker install)",
            bin.display()
        );
        let log = std::env::temp_dir().join(format!("outbox-test-tansu-{port}.log"));
        let logf = std::fs::File::create(&log).expect("broker log file");
        let url = format!("tcp://127.0.0.1:{port}");
        let child = Command::new(&bin)
            .args([
                "broker",
                "--listener-url",
                &url,
                "--advertised-listener-url",
                &url,
            ])
            .args(["--storage-engine", "memory://tansu/"])
            .stdin(Stdio::null())
            .stdout(logf.try_clone().expect("log fd"))
            .stderr(logf)
            .spawn()
            .expect("spawn tansu");
        let mut b = Broker {
            port,
            child: Some(child),
            log,
        };
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            if TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return b;
            }
            if let Some(st) = b.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                panic!(
                    "tansu exited with {st}: {}",
                    std::fs::read_to_string(&b.log).unwrap_or_default()
                );
            }
            assert!(
                Instant::now() < deadline,
                "tansu did not listen on {port} within 15 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `host:port` for `--brokers`.
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Creates a topic with 4 partitions (this broker does not create topics on first produce).
    pub fn create_topic(&self, name: &str) {
        let out = Command::new(tansu_bin())
            .args(["topic", "create", name, "--broker"])
            .arg(format!("tcp://127.0.0.1:{}", self.port))
            .args(["--partitions", "4"])
            .output()
            .expect("run tansu topic create");
        assert!(
            out.status.success(),
            "tansu topic create {name}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn signal(&self, sig: i32) {
        if let Some(c) = &self.child {
            // SAFETY: plain kill(2) on our own child's pid.
            unsafe {
                libc::kill(c.id() as i32, sig);
            }
        }
    }

    /// Freezes the broker (connections stay open, nothing is answered).
    pub fn freeze(&self) {
        self.signal(libc::SIGSTOP);
    }

    pub fn thaw(&self) {
        self.signal(libc::SIGCONT);
    }

    /// Every message of the topic, read from offset 0 of every partition until nothing new came
    /// for `idle`.
    pub fn consume_all(&self, topic: &str, idle: Duration) -> Vec<Msg> {
        let out = Command::new(worker_bin())
            .args([
                "tail",
                "--json",
                "--brokers",
                &self.addr(),
                "--topic",
                topic,
            ])
            .arg("--idle")
            .arg(format!("{}ms", idle.as_millis()))
            .output()
            .expect("run outbox-worker tail");
        assert!(
            out.status.success(),
            "outbox-worker tail failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| l.starts_with('{'))
            .map(Msg::from_json_line)
            .collect()
    }

    /// A `tail --follow` consumer whose messages arrive on the returned channel as they come.
    pub fn follow(&self, topic: &str) -> Follower {
        let mut child = Command::new(worker_bin())
            .args([
                "tail",
                "--json",
                "--follow",
                "--brokers",
                &self.addr(),
                "--topic",
                topic,
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn outbox-worker tail");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                if line.starts_with('{')
                    && tx
                        .send((Instant::now(), Msg::from_json_line(&line)))
                        .is_err()
                {
                    return;
                }
            }
        });
        Follower { child, rx }
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            self.thaw_pid(c.id());
            let _ = c.kill();
            let _ = c.wait();
        }
        // Keep the broker's log when the test failed.
        if !std::thread::panicking() {
            let _ = std::fs::remove_file(&self.log);
        }
    }
}

impl Broker {
    fn thaw_pid(&self, pid: u32) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe {
            libc::kill(pid as i32, libc::SIGCONT);
        }
    }
}

/// A running `tail --follow`.
pub struct Follower {
    child: Child,
    pub rx: std::sync::mpsc::Receiver<(Instant, Msg)>,
}

impl Follower {
    /// Waits for the message with this event id; returns when it arrived.
    pub fn wait_for(&self, outbox_id: i64, timeout: Duration) -> Option<(Instant, Msg)> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.checked_duration_since(Instant::now())?;
            match self.rx.recv_timeout(left) {
                Ok((t, m)) if m.outbox_id() == outbox_id => return Some((t, m)),
                Ok(_) => continue,
                Err(_) => return None,
            }
        }
    }
}

impl Drop for Follower {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
