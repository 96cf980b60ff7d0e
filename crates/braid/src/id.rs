//! The unique id that names a communicator: the root's address and a random 128-bit secret.

use std::collections::HashMap;
use std::fmt;
use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::str::FromStr;
use std::sync::OnceLock;

use braid_core::Error;
use parking_lot::Mutex;

/// Names a communicator. Rank 0 listens at [`UniqueId::addr`]; every other rank connects there and must
/// present the secret. Create one per communicator (on one process) and hand it to every rank, like
/// `ncclGetUniqueId`; its text form (`host:port/secret-hex`) travels through any channel.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct UniqueId {
    addr: SocketAddr,
    secret: [u8; 16],
}

/// Listeners opened by [`UniqueId::new`], handed to rank 0's `init` in this process.
fn listeners() -> &'static Mutex<HashMap<[u8; 16], TcpListener>> {
    static L: OnceLock<Mutex<HashMap<[u8; 16], TcpListener>>> = OnceLock::new();
    L.get_or_init(Default::default)
}

/// 16 random bytes from the OS.
pub(crate) fn random_secret() -> Result<[u8; 16], Error> {
    let mut s = [0u8; 16];
    getrandom::fill(&mut s)
        .map_err(|e| Error::Bootstrap(format!("no randomness from the OS: {e}")))?;
    Ok(s)
}

impl UniqueId {
    /// A fresh id whose root listens on an ephemeral port of the loopback interface, already bound in
    /// this process (so the port cannot be taken in between). Rank 0 must run in this process.
    pub fn new() -> Result<UniqueId, Error> {
        UniqueId::listen("127.0.0.1:0")
    }

    /// A fresh id whose root listens on `addr` (for example `0.0.0.0:29500`), bound now in this process.
    /// The advertised address is `addr` itself, or the loopback address when `addr` is unspecified.
    pub fn listen(addr: impl ToSocketAddrs) -> Result<UniqueId, Error> {
        let l =
            TcpListener::bind(addr).map_err(|e| Error::io("binding the bootstrap listener", e))?;
        let mut addr = l
            .local_addr()
            .map_err(|e| Error::io("bootstrap listener address", e))?;
        if addr.ip().is_unspecified() {
            addr.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
        }
        let secret = random_secret()?;
        listeners().lock().insert(secret, l);
        Ok(UniqueId { addr, secret })
    }

    /// An id for a root at `addr` with a fresh random secret, without binding anything (for launchers:
    /// rank 0, in another process, binds `addr`).
    pub fn unbound(addr: SocketAddr) -> Result<UniqueId, Error> {
        Ok(UniqueId {
            addr,
            secret: random_secret()?,
        })
    }

    /// The secret as 32 hex digits (what `BRAID_SECRET` takes).
    pub fn secret_hex(&self) -> String {
        format_secret(&self.secret)
    }

    /// An id for a root at `addr` with a known secret (for launchers that pass both in the environment).
    /// Rank 0 binds `addr` itself when it initialises.
    pub fn from_parts(addr: SocketAddr, secret: [u8; 16]) -> UniqueId {
        UniqueId { addr, secret }
    }

    /// The root's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub(crate) fn secret(&self) -> &[u8; 16] {
        &self.secret
    }

    /// The listening socket a launcher bound for this id's port and left open across `exec`
    /// (`BRAID_ROOT_FD`, set by `braid run` for rank 0), so the port is never free for another socket
    /// to take between the launcher choosing it and rank 0 listening. Taken at most once per process;
    /// `None` when the variable is unset, already taken, or names a socket on another port (that one
    /// belongs to another id and is left open). A value that is not a listening socket is an error.
    pub(crate) fn inherited_listener(&self) -> Result<Option<TcpListener>, Error> {
        static TAKEN: Mutex<bool> = Mutex::new(false);
        let mut taken = TAKEN.lock();
        if *taken {
            return Ok(None);
        }
        let Some(v) = std::env::var_os("BRAID_ROOT_FD") else {
            return Ok(None);
        };
        let fd = v
            .to_str()
            .and_then(|v| v.trim().parse::<i32>().ok())
            .filter(|v| *v >= 0)
            .ok_or_else(|| {
                Error::invalid(format!(
                    "BRAID_ROOT_FD={v:?} is not a file descriptor number"
                ))
            })?;
        let l = self.adopt_listener_fd(fd)?;
        *taken = l.is_some();
        Ok(l)
    }

    /// Takes `fd` if it is a listening socket on this id's port (see [`UniqueId::inherited_listener`]);
    /// leaves it untouched otherwise.
    fn adopt_listener_fd(&self, fd: i32) -> Result<Option<TcpListener>, Error> {
        use std::os::fd::FromRawFd;
        let bad = |why: String| Error::invalid(format!("BRAID_ROOT_FD={fd}: {why}"));
        let mut kind: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: getsockopt writes at most `len` bytes into `kind`; a bad fd is reported, not used.
        let rc = unsafe {
            libc::getsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_ACCEPTCONN,
                (&mut kind as *mut libc::c_int).cast(),
                &mut len,
            )
        };
        if rc != 0 {
            return Err(bad(format!(
                "not an open socket ({})",
                std::io::Error::last_os_error()
            )));
        }
        if kind == 0 {
            return Err(bad("the socket is not listening".into()));
        }
        // SAFETY: getsockopt just showed `fd` an open socket; the listener is never dropped (so the
        // fd is not closed) and only asked for its address.
        let peek = std::mem::ManuallyDrop::new(unsafe { TcpListener::from_raw_fd(fd) });
        let port = peek
            .local_addr()
            .map_err(|e| bad(format!("no local address ({e})")))?
            .port();
        if port != self.addr.port() {
            tracing::debug!(
                "BRAID_ROOT_FD={fd} listens on port {port}, not on {}: left alone",
                self.addr
            );
            return Ok(None);
        }
        // SAFETY: `fd` is an open listening socket on this id's port that the launcher handed to this
        // process; from here it is owned by the listener (and closed when that drops).
        let l = unsafe { TcpListener::from_raw_fd(fd) };
        // SAFETY: fcntl on the fd just adopted; FD_CLOEXEC keeps it out of this rank's own children.
        unsafe {
            libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC);
        }
        Ok(Some(l))
    }

    /// The listener bound by `new`/`listen` in this process, if any.
    pub(crate) fn take_listener(&self) -> Option<TcpListener> {
        listeners().lock().remove(&self.secret)
    }
}

/// Parses 32 hex digits into a secret.
pub fn parse_secret(s: &str) -> Result<[u8; 16], Error> {
    let s = s.trim();
    if s.len() != 32 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(Error::invalid("a secret is 32 hexadecimal digits"));
    }
    let mut out = [0u8; 16];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).expect("checked hex");
    }
    Ok(out)
}

/// Formats a secret as 32 hex digits.
pub fn format_secret(s: &[u8; 16]) -> String {
    s.iter().map(|b| format!("{b:02x}")).collect()
}

impl fmt::Display for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, format_secret(&self.secret))
    }
}

impl fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The secret stays out of logs.
        write!(f, "UniqueId({}/…)", self.addr)
    }
}

impl FromStr for UniqueId {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        let (addr, secret) = s
            .rsplit_once('/')
            .ok_or_else(|| Error::invalid(format!("unique id {s:?} is not host:port/secret")))?;
        let addr = resolve(addr)?;
        Ok(UniqueId {
            addr,
            secret: parse_secret(secret)?,
        })
    }
}

/// Resolves `host:port` to its first address.
pub(crate) fn resolve(hostport: &str) -> Result<SocketAddr, Error> {
    hostport
        .to_socket_addrs()
        .map_err(|e| Error::invalid(format!("cannot resolve {hostport:?}: {e}")))?
        .next()
        .ok_or_else(|| Error::invalid(format!("{hostport:?} resolves to no address")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_form_round_trips_and_hides_the_secret_in_debug() {
        let id = UniqueId::new().unwrap();
        let back: UniqueId = id.to_string().parse().unwrap();
        assert_eq!(back, id);
        assert!(!format!("{id:?}").contains(&format_secret(id.secret())));
        assert!(id.take_listener().is_some());
        assert!("127.0.0.1:5".parse::<UniqueId>().is_err());
        assert!("127.0.0.1:5/abc".parse::<UniqueId>().is_err());
    }

    #[test]
    fn adopts_only_a_listening_socket_on_its_port() {
        use std::os::fd::{AsRawFd, IntoRawFd};
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let id = UniqueId::unbound(SocketAddr::from(([127, 0, 0, 1], port))).unwrap();

        let file = std::fs::File::open("/dev/null").unwrap();
        let e = id
            .adopt_listener_fd(file.as_raw_fd())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("BRAID_ROOT_FD") && e.contains("not an open socket"),
            "{e}"
        );
        let e = id.adopt_listener_fd(1 << 20).unwrap_err().to_string();
        assert!(e.contains("not an open socket"), "{e}");
        let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let e = id
            .adopt_listener_fd(udp.as_raw_fd())
            .unwrap_err()
            .to_string();
        assert!(e.contains("not listening"), "{e}");

        // Another id's socket is left open and alone.
        let other = TcpListener::bind("127.0.0.1:0").unwrap();
        assert!(id.adopt_listener_fd(other.as_raw_fd()).unwrap().is_none());
        assert!(other.local_addr().is_ok(), "the other socket was closed");

        let adopted = id
            .adopt_listener_fd(l.into_raw_fd())
            .unwrap()
            .expect("the listener on the id's port");
        assert_eq!(adopted.local_addr().unwrap().port(), port);
    }
}
