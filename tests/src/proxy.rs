//! A TCP proxy on a free loopback port to an upstream address, whose connections can be made to
//! stop forwarding while they stay open: a black hole, as a dead NAT entry or a partition leaves
//! established connections. Connections opened after [`Proxy::black_hole`] forward as usual.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;

pub struct Proxy {
    pub port: u16,
    /// Connections numbered below this forward nothing any more.
    cutoff: Arc<AtomicU64>,
    accepted: Arc<AtomicU64>,
}

impl Proxy {
    /// Starts accepting on 127.0.0.1 (threads; they end when the process does).
    pub fn start(upstream: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("proxy listener");
        let port = listener.local_addr().expect("proxy address").port();
        let cutoff = Arc::new(AtomicU64::new(0));
        let accepted = Arc::new(AtomicU64::new(0));
        let (cut, count) = (cutoff.clone(), accepted.clone());
        thread::spawn(move || {
            for client in listener.incoming().flatten() {
                let Ok(server) = TcpStream::connect(upstream) else {
                    continue;
                };
                let n = count.fetch_add(1, Ordering::SeqCst);
                pump(&client, &server, n, cut.clone());
                pump(&server, &client, n, cut.clone());
            }
        });
        Proxy {
            port,
            cutoff,
            accepted,
        }
    }

    /// Every connection open now stops forwarding, in both directions, and stays open.
    pub fn black_hole(&self) {
        self.cutoff
            .store(self.accepted.load(Ordering::SeqCst), Ordering::SeqCst);
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::SeqCst)
    }
}

/// Copies `from` to `to` until `from` ends, dropping what connection `n` reads once it is
/// black-holed; then ends the other side too.
fn pump(from: &TcpStream, to: &TcpStream, n: u64, cutoff: Arc<AtomicU64>) {
    let (mut from, mut to) = (
        from.try_clone().expect("clone"),
        to.try_clone().expect("clone"),
    );
    thread::spawn(move || {
        let mut buf = [0u8; 16 * 1024];
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(_) if n < cutoff.load(Ordering::SeqCst) => {}
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
