//! A TCP proxy on a free loopback port to an upstream address, whose connections can be made to
//! stop forwarding while they stay open: a black hole, as a dead NAT entry or a partition leaves
//! established connections, in both directions or for the upstream's replies only (a request
//! arrives and runs, its answer never does). Connections opened after that forward as usual,
//! unless the proxy is partitioned: then no connection forwards until it heals. A stalled proxy
//! holds what its connections carry instead, and delivers it late: a pause that TCP outlasts.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

pub struct Proxy {
    pub port: u16,
    /// Connections numbered below this forward nothing any more.
    cutoff: Arc<AtomicU64>,
    /// Connections numbered below this forward no reply any more.
    replies_cutoff: Arc<AtomicU64>,
    accepted: Arc<AtomicU64>,
    /// Every connection holds what it reads until this is false again.
    stalled: Arc<AtomicBool>,
}

impl Proxy {
    /// Starts accepting on 127.0.0.1 (threads; they end when the process does).
    pub fn start(upstream: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("proxy listener");
        let port = listener.local_addr().expect("proxy address").port();
        let cutoff = Arc::new(AtomicU64::new(0));
        let replies_cutoff = Arc::new(AtomicU64::new(0));
        let accepted = Arc::new(AtomicU64::new(0));
        let stalled = Arc::new(AtomicBool::new(false));
        let (cut, replies_cut, count) = (cutoff.clone(), replies_cutoff.clone(), accepted.clone());
        let stall = stalled.clone();
        thread::spawn(move || {
            for client in listener.incoming().flatten() {
                let Ok(server) = TcpStream::connect(upstream) else {
                    continue;
                };
                let n = count.fetch_add(1, Ordering::SeqCst);
                let (up, down) = (cut.clone(), [cut.clone(), replies_cut.clone()]);
                pump(&client, &server, stall.clone(), move || {
                    n < up.load(Ordering::SeqCst)
                });
                pump(&server, &client, stall.clone(), move || {
                    down.iter().any(|c| n < c.load(Ordering::SeqCst))
                });
            }
        });
        Proxy {
            port,
            cutoff,
            replies_cutoff,
            accepted,
            stalled,
        }
    }

    /// Every connection open now stops forwarding, in both directions, and stays open.
    pub fn black_hole(&self) {
        self.cutoff
            .store(self.accepted.load(Ordering::SeqCst), Ordering::SeqCst);
    }

    /// Every connection, open now or opened until [`Proxy::heal`], forwards nothing: a
    /// partition (connecting still succeeds, as through a NAT that drops what follows).
    pub fn partition(&self) {
        self.cutoff.store(u64::MAX, Ordering::SeqCst);
    }

    /// Ends a partition: connections opened from now on forward; those opened before stay silent.
    pub fn heal(&self) {
        self.cutoff
            .store(self.accepted.load(Ordering::SeqCst), Ordering::SeqCst);
    }

    /// Every connection open now stops forwarding the upstream's replies, and stays open.
    pub fn drop_replies(&self) {
        self.replies_cutoff
            .store(self.accepted.load(Ordering::SeqCst), Ordering::SeqCst);
    }

    /// Every connection, open now or opened until [`Proxy::resume`], holds what it reads instead
    /// of forwarding it (nothing is lost): requests and replies arrive late, as after a pause of
    /// the network that TCP's retransmissions outlast.
    pub fn stall(&self) {
        self.stalled.store(true, Ordering::SeqCst);
    }

    /// Ends a stall: what the connections held is forwarded, and all they carry from now on.
    pub fn resume(&self) {
        self.stalled.store(false, Ordering::SeqCst);
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::SeqCst)
    }
}

/// A proxy to the PostgreSQL server (on 127.0.0.1) that `client` is connected to, and `url` (libpq
/// key=value parameters) with its port replaced by the proxy's.
pub async fn to_database(client: &tokio_postgres::Client, url: &str) -> (Proxy, String) {
    let port: i32 = client
        .query_one("SELECT current_setting('port')::int", &[])
        .await
        .expect("port")
        .get(0);
    let proxy = Proxy::start(([127, 0, 0, 1], port as u16).into());
    let url = url
        .split(' ')
        .map(|kv| match kv.strip_prefix("port=") {
            Some(_) => format!("port={}", proxy.port),
            None => kv.to_string(),
        })
        .collect::<Vec<_>>()
        .join(" ");
    (proxy, url)
}

/// Copies `from` to `to` until `from` ends, holding what it read while `stalled` and dropping it
/// while `dropping()`; then ends the other side too.
fn pump(
    from: &TcpStream,
    to: &TcpStream,
    stalled: Arc<AtomicBool>,
    dropping: impl Fn() -> bool + Send + 'static,
) {
    let (mut from, mut to) = (
        from.try_clone().expect("clone"),
        to.try_clone().expect("clone"),
    );
    thread::spawn(move || {
        let mut buf = [0u8; 16 * 1024];
        loop {
            let read = from.read(&mut buf);
            while stalled.load(Ordering::SeqCst) {
                thread::sleep(Duration::from_millis(10));
            }
            match read {
                Ok(0) | Err(_) => break,
                Ok(_) if dropping() => {}
                Ok(len) => {
                    if to.write_all(&buf[..len]).is_err() {
                        break;
                    }
                }
            }
        }
        let _ = to.shutdown(Shutdown::Both);
    });
}
