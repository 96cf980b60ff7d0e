//! The TCP transport between threads of one process, over loopback.

use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use braid_core::Error;

use super::*;
use crate::link::{recv_with, send_bytes};
use crate::{WaitCtx, WaitPolicy};

const SECRET: [u8; 16] = [9; 16];

fn opts(rank: usize, world: usize, sockets: usize, slot_bytes: usize) -> TcpOptions {
    TcpOptions {
        rank,
        world,
        channels: 2,
        slots: 4,
        slot_bytes,
        sockets_per_peer: sockets,
        secret: SECRET,
        policy: WaitPolicy {
            spin: Duration::from_micros(5),
            yield_for: Duration::from_micros(50),
        },
    }
}

fn ctx<'a>(rank: usize, abort: &'a AtomicBool, timeout: Duration) -> WaitCtx<'a> {
    let now = Instant::now();
    WaitCtx {
        rank,
        collective: "test",
        seq: 0,
        deadline: now + timeout,
        started: now,
        abort,
    }
}

/// Builds a fully connected world of `n` TCP transports on loopback, one per thread.
fn world(n: usize, sockets: usize, slot_bytes: usize) -> Vec<TcpLink> {
    let eps: Vec<TcpEndpoint> = (0..n)
        .map(|_| TcpEndpoint::bind(IpAddr::V4(Ipv4Addr::LOCALHOST)).unwrap())
        .collect();
    let addrs: Vec<SocketAddr> = eps.iter().map(|e| e.addr()).collect();
    let deadline = Instant::now() + Duration::from_secs(20);
    let handles: Vec<_> = eps
        .into_iter()
        .enumerate()
        .map(|(r, ep)| {
            let peers: Vec<Option<SocketAddr>> =
                (0..n).map(|p| (p != r).then_some(addrs[p])).collect();
            std::thread::spawn(move || {
                ep.connect(opts(r, n, sockets, slot_bytes), &peers, deadline)
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().unwrap().unwrap())
        .collect()
}

fn pattern(from: usize, msg: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i * 31 + msg * 7 + from * 101) as u8)
        .collect()
}

#[test]
fn messages_arrive_whole_and_in_order_over_several_sockets() {
    for sockets in [1, 3] {
        let slot = 96 * 1024;
        let ts = world(3, sockets, slot);
        let lens = [
            0usize,
            1,
            100,
            frame::SPLIT_MIN - 1,
            frame::SPLIT_MIN,
            50_000,
            slot,
        ];
        std::thread::scope(|s| {
            for (r, t) in ts.into_iter().enumerate() {
                s.spawn(move || {
                    let abort = AtomicBool::new(false);
                    let c = ctx(r, &abort, Duration::from_secs(20));
                    // Every rank sends 3 rounds of every length to both peers, then receives; the slot
                    // depth (4) is smaller than the number of messages, so flow control is exercised.
                    let t = &t;
                    let sender = |to: usize| {
                        for round in 0..3 {
                            for (m, &len) in lens.iter().enumerate() {
                                let ch = m % 2;
                                send_bytes(t, to, ch, &pattern(r, round * 10 + m, len), 7, &c)
                                    .unwrap();
                            }
                        }
                    };
                    let peers: Vec<usize> = (0..3).filter(|&p| p != r).collect();
                    for &p in &peers {
                        // Sends cannot block forever: the peers' readers drain into their slots and TCP
                        // buffers, and the total sent here fits in the socket buffers plus 4 slots.
                        sender(p);
                    }
                    for &p in &peers {
                        for round in 0..3 {
                            for (m, &len) in lens.iter().enumerate() {
                                let (got, tag) =
                                    recv_with(t, p, m % 2, &c, |d, tag| (d.to_vec(), tag)).unwrap();
                                assert_eq!(
                                    (got, tag),
                                    (pattern(p, round * 10 + m, len), 7),
                                    "from {p} msg {m} sockets {sockets}"
                                );
                            }
                        }
                    }
                });
            }
        });
    }
}

#[test]
fn a_closed_peer_is_a_failure_that_names_it() {
    let mut ts = world(2, 2, 4096);
    let t1 = ts.pop().unwrap();
    let t0 = ts.pop().unwrap();
    drop(t1);
    let abort = AtomicBool::new(false);
    let c = ctx(0, &abort, Duration::from_secs(10));
    let start = Instant::now();
    let e = recv_with(&t0, 1, 0, &c, |_, _| ()).unwrap_err();
    assert!(matches!(e, Error::PeerFailed { peer: 1, .. }), "{e}");
    assert!(e.to_string().contains("closed"), "{e}");
    assert!(start.elapsed() < Duration::from_secs(5));
    // Sending to it fails too, soon (the kernel reports the reset).
    let mut failed = None;
    for _ in 0..1000 {
        if let Err(e) = send_bytes(&t0, 1, 0, &[1; 10], 0, &c) {
            failed = Some(e);
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let e = failed.expect("sending to a closed peer kept succeeding");
    assert!(matches!(e, Error::PeerFailed { peer: 1, .. }), "{e}");
}

#[test]
fn a_silent_peer_times_out_and_abort_ends_the_wait() {
    let ts = world(2, 1, 4096);
    let abort = AtomicBool::new(false);
    let c = ctx(0, &abort, Duration::from_millis(100));
    let e = recv_with(&ts[0], 1, 0, &c, |_, _| ()).unwrap_err();
    assert!(matches!(e, Error::Timeout { peer: 1, .. }), "{e}");
    let c = ctx(0, &abort, Duration::from_secs(30));
    let start = Instant::now();
    std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(50));
            abort.store(true, Ordering::Relaxed);
        });
        let e = recv_with(&ts[0], 1, 1, &c, |_, _| ()).unwrap_err();
        assert!(matches!(e, Error::Aborted { .. }), "{e}");
    });
    assert!(start.elapsed() < Duration::from_secs(5));
}

#[test]
fn strangers_and_wrong_secrets_are_refused_and_the_peers_still_connect() {
    let eps: Vec<TcpEndpoint> = (0..2)
        .map(|_| TcpEndpoint::bind(IpAddr::V4(Ipv4Addr::LOCALHOST)).unwrap())
        .collect();
    let addrs: Vec<SocketAddr> = eps.iter().map(|e| e.addr()).collect();
    // Hostile connections to rank 0 before its peer: silence, garbage, a wrong secret, a bad rank.
    let mut hostile = Vec::new();
    for i in 0..4 {
        let mut s = TcpStream::connect(addrs[0]).unwrap();
        let mut h = Hello {
            secret: SECRET,
            from: 1,
            to: 0,
            socket: 0,
            sockets: 1,
            channels: 2,
            slots: 4,
            slot_bytes: 4096,
        };
        match i {
            0 => {}
            1 => s.write_all(&[0xAB; 300]).unwrap(),
            2 => {
                h.secret = [1; 16];
                s.write_all(&h.encode()).unwrap();
            }
            _ => {
                h.from = 77;
                s.write_all(&h.encode()).unwrap();
            }
        }
        hostile.push(s);
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    let handles: Vec<_> = eps
        .into_iter()
        .enumerate()
        .map(|(r, ep)| {
            let peers: Vec<Option<SocketAddr>> =
                (0..2).map(|p| (p != r).then_some(addrs[p])).collect();
            std::thread::spawn(move || ep.connect(opts(r, 2, 1, 4096), &peers, deadline))
        })
        .collect();
    let ts: Vec<TcpLink> = handles
        .into_iter()
        .map(|h| h.join().unwrap().unwrap())
        .collect();
    let abort = AtomicBool::new(false);
    let c = ctx(0, &abort, Duration::from_secs(10));
    send_bytes(&ts[1], 0, 1, b"abc", 3, &c).unwrap();
    let got = recv_with(&ts[0], 1, 1, &c, |d, t| (d.to_vec(), t)).unwrap();
    assert_eq!(got, (b"abc".to_vec(), 3));
}

#[test]
fn a_missing_peer_is_named_at_setup() {
    let ep = TcpEndpoint::bind(IpAddr::V4(Ipv4Addr::LOCALHOST)).unwrap();
    // Rank 1's address accepts connections (the listener exists) but rank 1 never connects back.
    let other = TcpEndpoint::bind(IpAddr::V4(Ipv4Addr::LOCALHOST)).unwrap();
    let peers = vec![None, Some(other.addr())];
    let e = ep
        .connect(
            opts(0, 2, 1, 4096),
            &peers,
            Instant::now() + Duration::from_millis(300),
        )
        .map(|_| ())
        .unwrap_err();
    assert!(e.to_string().contains("rank(s) 1"), "{e}");
}

#[test]
fn a_hundred_silent_connections_cost_no_threads_and_keep_no_peer_out() {
    let threads = || std::fs::read_dir("/proc/self/task").unwrap().count();
    let eps: Vec<TcpEndpoint> = (0..2)
        .map(|_| TcpEndpoint::bind(IpAddr::V4(Ipv4Addr::LOCALHOST)).unwrap())
        .collect();
    let addrs: Vec<SocketAddr> = eps.iter().map(|e| e.addr()).collect();
    // More than the accept loop keeps pending, so the oldest are dropped as the peer arrives.
    let silent: Vec<TcpStream> = (0..100)
        .map(|_| TcpStream::connect(addrs[0]).unwrap())
        .collect();
    let base = threads();
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut eps = eps.into_iter();
    let ep0 = eps.next().unwrap();
    let ep1 = eps.next().unwrap();
    let (p0, p1) = (vec![None, Some(addrs[1])], vec![Some(addrs[0]), None]);
    let t0 = std::thread::spawn(move || ep0.connect(opts(0, 2, 1, 4096), &p0, deadline));
    std::thread::sleep(Duration::from_millis(200));
    // Other tests of this binary run threads too: a thread per connection would be 100 more.
    let during = threads();
    assert!(
        during < base + 40,
        "{base} threads before, {during} while accepting"
    );
    let t1 = std::thread::spawn(move || ep1.connect(opts(1, 2, 1, 4096), &p1, deadline));
    let (l0, l1) = (t0.join().unwrap().unwrap(), t1.join().unwrap().unwrap());
    let abort = AtomicBool::new(false);
    let c = ctx(0, &abort, Duration::from_secs(10));
    send_bytes(&l1, 0, 1, b"xyz", 5, &c).unwrap();
    let got = recv_with(&l0, 1, 1, &c, |d, t| (d.to_vec(), t)).unwrap();
    assert_eq!(got, (b"xyz".to_vec(), 5));
    drop(silent);
}
