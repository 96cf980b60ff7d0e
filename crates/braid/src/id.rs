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
}
