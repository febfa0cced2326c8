//! Whether the session's client is still there. PostgreSQL runs a statement to its end after its
//! client died (it finds out when it answers), so a relay killed with a claim in flight would
//! leave that claim's events `SENDING` for a dead owner until the lease ends (10 minutes by
//! default). `outbox_claim` asks this before it returns rows, and rolls back instead.

use pgrx::prelude::*;

/// False when the client's end of the connection is closed (its FIN or a reset has arrived);
/// true otherwise, and true where there is no client socket to look at (a background worker) or
/// no way to look (a platform without `POLLRDHUP`).
#[pg_extern(volatile, parallel_unsafe)]
fn outbox_client_connected() -> bool {
    // SAFETY: MyProcPort is the backend's own connection, NULL outside a client session. pgrx
    // declares `Port` opaque; its first field is the socket (`pgsocket sock`, an int, first in
    // every release since 8.x), which is all that is read. is_socket() checks what was read.
    let sock = unsafe {
        let port = pg_sys::MyProcPort;
        if port.is_null() {
            return true;
        }
        *(port as *const libc::c_int)
    };
    !is_socket(sock) || peer_open(sock)
}

fn is_socket(fd: libc::c_int) -> bool {
    // SAFETY: fstat(2) fills the zeroed struct or fails; nothing else is touched.
    unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        fd >= 0 && libc::fstat(fd, &mut st) == 0 && st.st_mode & libc::S_IFMT == libc::S_IFSOCK
    }
}

#[cfg(target_os = "linux")]
fn peer_open(sock: libc::c_int) -> bool {
    let mut fd = libc::pollfd {
        fd: sock,
        events: libc::POLLRDHUP,
        revents: 0,
    };
    // A zero timeout: a look, never a wait. A failed poll (EINTR) says nothing about the peer.
    // SAFETY: one pollfd on the stack; poll(2) only writes its revents.
    let ready = unsafe { libc::poll(&mut fd, 1, 0) };
    !(ready == 1 && fd.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0)
}

#[cfg(not(target_os = "linux"))]
fn peer_open(_sock: libc::c_int) -> bool {
    true
}
