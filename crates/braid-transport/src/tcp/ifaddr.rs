//! Which local address TCP listens on: the interfaces `BRAID_SOCKET_IFNAME` selects, or the one that
//! routes to the bootstrap root.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};

use braid_core::Error;

/// The addresses of this host's interfaces that are up, as (interface name, address), IPv4 first.
pub fn interfaces() -> Vec<(String, IpAddr)> {
    let mut out = Vec::new();
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list it allocates, released by freeifaddrs below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return out;
    }
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs returned, alive until freeifaddrs.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_flags & libc::IFF_UP as u32 == 0 {
            continue;
        }
        // SAFETY: ifa_name is a NUL-terminated string owned by the list.
        let name = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) }
            .to_string_lossy()
            .into_owned();
        // SAFETY: ifa_addr is non-null and points at a sockaddr whose family says which struct it is.
        let family = unsafe { (*ifa.ifa_addr).sa_family } as i32;
        let ip = match family {
            libc::AF_INET => {
                // SAFETY: family AF_INET means the address is a sockaddr_in.
                let sa = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
                IpAddr::V4(Ipv4Addr::from(u32::from_be(sa.sin_addr.s_addr)))
            }
            libc::AF_INET6 => {
                // SAFETY: family AF_INET6 means the address is a sockaddr_in6.
                let sa = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in6) };
                IpAddr::V6(Ipv6Addr::from(sa.sin6_addr.s6_addr))
            }
            _ => continue,
        };
        out.push((name, ip));
    }
    // SAFETY: `head` came from getifaddrs and is freed once; no reference into it survives.
    unsafe { libc::freeifaddrs(head) };
    out.sort_by_key(|(_, ip)| ip.is_ipv6());
    out
}

/// Whether interface `name` is selected by `spec`: comma-separated name prefixes; a prefix starting
/// with `^` excludes. Without any including prefix, everything not excluded is selected.
pub fn selects(spec: &str, name: &str) -> bool {
    let items: Vec<&str> = spec
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    if items
        .iter()
        .filter_map(|i| i.strip_prefix('^'))
        .any(|p| name.starts_with(p))
    {
        return false;
    }
    let mut includes = items.iter().filter(|i| !i.starts_with('^')).peekable();
    includes.peek().is_none() || includes.any(|p| name.starts_with(p))
}

/// The address to listen on: the first address of an interface `spec` selects (IPv4 preferred), or
/// without a spec, the local address of the route toward `root`.
pub fn choose_ip(spec: Option<&str>, root: SocketAddr) -> Result<IpAddr, Error> {
    if let Some(spec) = spec {
        let all = interfaces();
        return all
            .iter()
            .find(|(n, _)| selects(spec, n))
            .map(|(_, ip)| *ip)
            .ok_or_else(|| {
                let have: Vec<String> = all.iter().map(|(n, ip)| format!("{n} ({ip})")).collect();
                Error::invalid(format!(
                    "BRAID_SOCKET_IFNAME={spec:?} selects no interface that is up; this host has {}",
                    if have.is_empty() {
                        "none".to_string()
                    } else {
                        have.join(", ")
                    }
                ))
            });
    }
    if root.ip().is_unspecified() {
        return Ok(IpAddr::V4(Ipv4Addr::LOCALHOST));
    }
    // Connecting a UDP socket sends nothing; it only asks the kernel for the route.
    let bind: SocketAddr = if root.is_ipv4() {
        (Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let probe = UdpSocket::bind(bind).and_then(|s| s.connect(root).map(|_| s));
    match probe.and_then(|s| s.local_addr()) {
        Ok(a) => Ok(a.ip()),
        Err(e) => Err(Error::io(
            format!("finding the interface that routes to {root}"),
            e,
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selection_by_prefix_and_exclusion() {
        assert!(selects("eth", "eth0"));
        assert!(!selects("eth", "lo"));
        assert!(selects("^docker,^lo", "eth1"));
        assert!(!selects("^docker,^lo", "docker0"));
        assert!(!selects("eth,^eth1", "eth1"));
        assert!(selects("eth,ib", "ib0"));
        assert!(selects("", "anything"));
    }

    #[test]
    fn loopback_is_found_and_routes_to_itself() {
        let all = interfaces();
        assert!(
            all.iter().any(|(n, ip)| n == "lo" && ip.is_loopback()),
            "{all:?}"
        );
        assert_eq!(
            choose_ip(Some("lo"), "127.0.0.1:1".parse().unwrap()).unwrap(),
            IpAddr::V4(Ipv4Addr::LOCALHOST)
        );
        assert!(choose_ip(None, "127.0.0.1:9".parse().unwrap())
            .unwrap()
            .is_loopback());
        let e = choose_ip(Some("nosuchif"), "127.0.0.1:1".parse().unwrap()).unwrap_err();
        assert!(
            e.to_string().contains("BRAID_SOCKET_IFNAME") && e.to_string().contains("lo ("),
            "{e}"
        );
    }
}
