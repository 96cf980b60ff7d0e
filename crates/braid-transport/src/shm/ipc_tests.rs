//! The `ipc` transport over emulated device memory: the real setup stages (descriptors passed over
//! real Unix sockets, segments in /dev/shm), device spans for every slot, messages in order across
//! counter wraps, strangers refused at setup.

use super::ipc::{Ipc, NAME};
use super::tests::rand_tag;
use super::*;
use crate::device::EmulatedDevice;
use crate::link::{Link, RecvSlot};
use crate::memory::MemKind;
use crate::setup::{Endpoint, Geometry, Peer, SetupCtx, Transport};
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

const SECRET: [u8; 16] = *b"ipc-test-secret!";

fn setup_ctx(rank: usize, world: usize, slots: usize, slot_bytes: usize, nonce: u64) -> SetupCtx {
    SetupCtx {
        geometry: Geometry {
            rank,
            world,
            channels: 2,
            slots,
            slot_bytes,
        },
        secret: SECRET,
        nonce,
        policy: WaitPolicy {
            spin: Duration::from_micros(5),
            yield_for: Duration::from_micros(20),
        },
        deadline: Instant::now() + Duration::from_secs(20),
    }
}

/// `n` ranks (threads of this process) through prepare, connect and activate.
fn world(n: usize, slots: usize, slot_bytes: usize) -> Vec<Box<dyn Link>> {
    let nonce = rand_tag();
    let prepared: Vec<_> = (0..n)
        .map(|r| {
            let ctx = setup_ctx(r, n, slots, slot_bytes, nonce);
            let t = Box::new(Ipc::new("/dev/shm", Arc::new(EmulatedDevice::new(0))));
            assert_eq!((t.name(), t.scope()), (NAME, crate::setup::Scope::Host));
            (ctx, t.prepare(&ctx).unwrap())
        })
        .collect();
    let table: Vec<Peer> = prepared
        .iter()
        .map(|(_, p)| Peer {
            pid: std::process::id(),
            host: "here".into(),
            endpoints: vec![Endpoint {
                transport: NAME.into(),
                blob: p.endpoint(),
            }],
        })
        .collect();
    let connected: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = prepared
            .into_iter()
            .enumerate()
            .map(|(r, (ctx, p))| {
                let table = &table;
                s.spawn(move || {
                    let peers: Vec<Option<&Peer>> =
                        (0..n).map(|q| (q != r).then(|| &table[q])).collect();
                    p.connect(&ctx, &peers).unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    connected
        .into_iter()
        .map(|c| c.activate().unwrap())
        .collect()
}

fn wctx(abort: &AtomicBool) -> WaitCtx<'_> {
    let now = Instant::now();
    WaitCtx {
        rank: 0,
        collective: "ipc test",
        seq: 0,
        deadline: now + Duration::from_secs(10),
        started: now,
        abort,
    }
}

/// Writes `bytes` into a device slot of the emulated device (host memory under a device span).
fn fill(span: Span, bytes: &[u8]) {
    assert_eq!(span.kind(), MemKind::Device { ordinal: 0 });
    assert!(bytes.len() <= span.len());
    // SAFETY: emulated device memory is host memory, mapped in this process for the link's life; the
    // slot is ours until posted.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), span.addr() as *mut u8, bytes.len()) };
}

fn contents(slot: &RecvSlot) -> Vec<u8> {
    let span = slot.span();
    assert_eq!(span.kind(), MemKind::Device { ordinal: 0 });
    // SAFETY: as in `fill`; the slot is ours until released.
    unsafe { std::slice::from_raw_parts(span.addr() as *const u8, span.len()).to_vec() }
}

fn send(link: &dyn Link, peer: usize, ch: usize, msg: &[u8], tag: u32, abort: &AtomicBool) {
    let c = wctx(abort);
    let slot = loop {
        if let Some(s) = link.try_reserve(peer, ch, &c).unwrap() {
            break s;
        }
        link.wait(peer, ch, Event::Credit, &c, c.deadline).unwrap();
    };
    assert_eq!(slot.span().len(), link.slot_bytes());
    assert_eq!(
        slot.span().addr() % 256,
        0,
        "device slots are 256-byte aligned"
    );
    fill(slot.span(), msg);
    link.post(slot, msg.len(), tag, &c).unwrap();
}

fn recv(link: &dyn Link, peer: usize, ch: usize, abort: &AtomicBool) -> (Vec<u8>, u32) {
    let c = wctx(abort);
    let slot = loop {
        if let Some(s) = link.try_recv(peer, ch, &c).unwrap() {
            break s;
        }
        link.wait(peer, ch, Event::Data, &c, c.deadline).unwrap();
    };
    let got = (contents(&slot), slot.tag());
    link.release(slot).unwrap();
    got
}

#[test]
fn messages_cross_device_rings_in_order_on_every_channel() {
    let mut links = world(3, 3, 1000);
    assert!(links.iter().all(|l| l.name() == "ipc" && l.channels() == 2));
    let c = links.pop().unwrap();
    let b = links.pop().unwrap();
    let a = links.pop().unwrap();
    let n = 2000u32;
    let sender = std::thread::spawn(move || {
        let abort = AtomicBool::new(false);
        for i in 0..n {
            let len = (i as usize * 7) % 1000 + 1;
            let msg: Vec<u8> = (0..len).map(|k| (i as usize + k) as u8).collect();
            send(&*a, 1, (i % 2) as usize, &msg, i, &abort);
            send(&*a, 2, 0, &msg, i, &abort);
        }
        a
    });
    let other = std::thread::spawn(move || {
        let abort = AtomicBool::new(false);
        for i in 0..n {
            let (got, tag) = recv(&*c, 0, 0, &abort);
            assert_eq!(tag, i);
            assert_eq!(got.len(), (i as usize * 7) % 1000 + 1);
        }
        c
    });
    let abort = AtomicBool::new(false);
    for i in 0..n {
        let (got, tag) = recv(&*b, 0, (i % 2) as usize, &abort);
        let len = (i as usize * 7) % 1000 + 1;
        let want: Vec<u8> = (0..len).map(|k| (i as usize + k) as u8).collect();
        assert_eq!((got, tag), (want, i), "message {i}");
    }
    let _a = sender.join().unwrap();
    let _c = other.join().unwrap();
}

#[test]
fn strangers_without_the_secret_get_no_descriptor_and_hold_nothing_back() {
    let nonce = rand_tag();
    let ctx0 = setup_ctx(0, 2, 2, 256, nonce);
    let ctx1 = setup_ctx(1, 2, 2, 256, nonce);
    let mem = || Arc::new(EmulatedDevice::new(0));
    let p0 = Box::new(Ipc::new("/dev/shm", mem()))
        .prepare(&ctx0)
        .unwrap();
    let p1 = Box::new(Ipc::new("/dev/shm", mem()))
        .prepare(&ctx1)
        .unwrap();
    let blob0 = p0.endpoint();
    let socket = String::from_utf8(blob0.clone())
        .unwrap()
        .split('\n')
        .nth(1)
        .unwrap()
        .to_string();
    let peer = |blob: Vec<u8>| Peer {
        pid: std::process::id(),
        host: "here".into(),
        endpoints: vec![Endpoint {
            transport: NAME.into(),
            blob,
        }],
    };
    let (t0, t1) = (peer(blob0), peer(p1.endpoint()));
    std::thread::scope(|s| {
        // A stranger knocks first with a wrong secret: it is dropped, and the real peer still connects.
        let stranger = s.spawn(|| {
            use std::io::{Read, Write};
            use std::os::linux::net::SocketAddrExt;
            let addr =
                std::os::unix::net::SocketAddr::from_abstract_name(socket.as_bytes()).unwrap();
            let mut sock = std::os::unix::net::UnixStream::connect_addr(&addr).unwrap();
            let mut hello = [0u8; 20];
            hello[..16].copy_from_slice(b"not-the-secret!!");
            hello[16..].copy_from_slice(&1u32.to_le_bytes());
            sock.write_all(&hello).unwrap();
            sock.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let mut buf = [0u8; 8];
            sock.read(&mut buf).unwrap_or(0)
        });
        // Another connects and says nothing until setup is over (past the setup deadline, if setup
        // waited for it): it is dropped after a short wait, and setup goes on.
        let (done, wait_done) = std::sync::mpsc::channel::<()>();
        let name = socket.clone();
        let silent = s.spawn(move || {
            use std::os::linux::net::SocketAddrExt;
            let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
            let sock = std::os::unix::net::UnixStream::connect_addr(&addr).unwrap();
            let _ = wait_done.recv_timeout(Duration::from_secs(40));
            drop(sock);
        });
        std::thread::sleep(Duration::from_millis(50));
        let h1 = s.spawn(|| p1.connect(&ctx1, &[Some(&t0), None]).map(|_| ()));
        let c0 = p0.connect(&ctx0, &[None, Some(&t1)]).map(|_| ());
        assert!(c0.is_ok(), "{:?}", c0.err());
        assert!(h1.join().unwrap().is_ok());
        done.send(()).unwrap();
        assert_eq!(stranger.join().unwrap(), 0, "the stranger read bytes");
        silent.join().unwrap();
    });
}

#[test]
fn a_device_segment_and_a_host_segment_do_not_mix() {
    let layout = Layout {
        world: 2,
        channels: 1,
        slots: 2,
        slot_bytes: 64,
        device: true,
    };
    let p = PathBuf::from(format!("/dev/shm/braid-test-ipc-{:x}", rand_tag()));
    let _seg = Segment::create(&p, layout, 0).unwrap();
    assert_eq!(layout.size(), HEADER + 2 * (CTRL + 2 * CACHE_LINE));
    let host = Layout {
        device: false,
        ..layout
    };
    let e = Segment::open(&p, host, 0).err().unwrap();
    assert!(e.to_string().contains("size"), "{e}");
    assert_eq!(layout.device_bytes(4096), 4096);
    assert_eq!(
        Layout {
            world: 4,
            slots: 8,
            slot_bytes: 1 << 20,
            ..layout
        }
        .device_bytes(2 << 20),
        32 << 20
    );
}
