//! The `ipc` transport over emulated device memory: the real setup stages (offers passed over real Unix
//! sockets, segments in /dev/shm), with memory shared by descriptor and by (emulated legacy) handle,
//! device spans for every slot, messages in order across counter wraps, strangers refused at setup, and
//! hostile offers refused with an error naming the peer.

use super::ipc::{decode_offer, encode_offer, Ipc, KIND_FD, KIND_HANDLE, NAME, OFFER_BYTES};
use super::layout::{CACHE_LINE, CTRL, HEADER};
use super::tests::rand_tag;
use super::*;
use crate::device::{recv_msg, send_msg, DeviceMemory, EmulatedDevice, Shareable};
use crate::link::{Event, Link, RecvSlot};
use crate::memory::{MemKind, Span};
use crate::plugin::{Endpoint, Geometry, Peer, SetupCtx, Transport};
use crate::wait::{WaitCtx, WaitPolicy};
use braid_core::Error;
use braid_testkit::process::{hex, read_marked, unhex, ChildTest};
use std::io::{Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How a test's emulated device shares its memory.
#[derive(Clone, Copy, Debug)]
enum Mode {
    Fd,
    Handle,
}

fn device(mode: Mode) -> EmulatedDevice {
    match mode {
        Mode::Fd => EmulatedDevice::new(0),
        Mode::Handle => EmulatedDevice::with_handles(0),
    }
}

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

/// Ranks (threads of this process), one on each of `modes`, through prepare, connect and activate.
fn world(modes: &[Mode], slots: usize, slot_bytes: usize) -> Vec<Box<dyn Link>> {
    let n = modes.len();
    let nonce = rand_tag();
    let prepared: Vec<_> = (0..n)
        .map(|r| {
            let ctx = setup_ctx(r, n, slots, slot_bytes, nonce);
            let t = Box::new(Ipc::new("/dev/shm", Arc::new(device(modes[r]))));
            assert_eq!((t.name(), t.scope()), (NAME, crate::plugin::Scope::Host));
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
fn messages_cross_device_rings_in_order_on_every_channel_by_descriptor() {
    messages_in_order(&[Mode::Fd; 3]);
}

#[test]
fn messages_cross_device_rings_in_order_on_every_channel_by_handle() {
    messages_in_order(&[Mode::Handle; 3]);
}

#[test]
fn ranks_sharing_by_descriptor_and_by_handle_mix() {
    messages_in_order(&[Mode::Handle, Mode::Fd, Mode::Handle]);
}

fn messages_in_order(modes: &[Mode]) {
    let mut links = world(modes, 3, 1000);
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
    strangers_are_refused(Mode::Fd);
}

#[test]
fn strangers_without_the_secret_get_no_handle_and_hold_nothing_back() {
    strangers_are_refused(Mode::Handle);
}

fn strangers_are_refused(mode: Mode) {
    let nonce = rand_tag();
    let ctx0 = setup_ctx(0, 2, 2, 256, nonce);
    let ctx1 = setup_ctx(1, 2, 2, 256, nonce);
    let mem = || Arc::new(device(mode));
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
            let addr = SocketAddr::from_abstract_name(socket.as_bytes()).unwrap();
            let mut sock = UnixStream::connect_addr(&addr).unwrap();
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
            let addr = SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
            let sock = UnixStream::connect_addr(&addr).unwrap();
            let _ = wait_done.recv_timeout(Duration::from_secs(40));
            drop(sock);
        });
        std::thread::sleep(Duration::from_millis(50));
        // Each rank keeps what it connected until both are done: with handles, a peer opens the
        // exporter's memory by name, which must still be there.
        let h1 = s.spawn(|| p1.connect(&ctx1, &[Some(&t0), None]));
        let c0 = p0.connect(&ctx0, &[None, Some(&t1)]);
        let c1 = h1.join().unwrap();
        assert!(c0.is_ok(), "{:?}", c0.err().map(|e| e.to_string()));
        assert!(c1.is_ok(), "{:?}", c1.err().map(|e| e.to_string()));
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

/// The error rank 1 (real, on `mode`) gets from connecting to a fake rank 0 that serves the offer `make`
/// builds from rank 0's ring bytes, with the descriptor `make` gives. The fake rank fetches rank 1's offer
/// as a real peer would (so rank 1's serving side finishes) and checks it.
fn against_a_hostile_peer(
    mode: Mode,
    make: impl FnOnce(usize) -> ([u8; OFFER_BYTES], Option<OwnedFd>) + Send,
) -> Error {
    let nonce = rand_tag();
    let (ctx0, ctx1) = (
        setup_ctx(0, 2, 2, 256, nonce),
        setup_ctx(1, 2, 2, 256, nonce),
    );
    // A real rank 0 for its segment and ring size; its socket is replaced by the fake one.
    let p0 = Box::new(Ipc::new("/dev/shm", Arc::new(device(mode))))
        .prepare(&ctx0)
        .unwrap();
    let p1 = Box::new(Ipc::new("/dev/shm", Arc::new(device(mode))))
        .prepare(&ctx1)
        .unwrap();
    let blob0 = String::from_utf8(p0.endpoint()).unwrap();
    let fields: Vec<&str> = blob0.split('\n').collect();
    let bytes0: usize = fields[2].parse().unwrap();
    let fake = format!("braid-{nonce:016x}-hostile");
    let listener =
        UnixListener::bind_addr(&SocketAddr::from_abstract_name(fake.as_bytes()).unwrap()).unwrap();
    let blob1 = String::from_utf8(p1.endpoint()).unwrap();
    let socket1 = blob1.split('\n').nth(1).unwrap().to_string();
    let bytes1 = blob1.split('\n').nth(2).unwrap().to_string();
    let peer0 = Peer {
        pid: std::process::id(),
        host: "here".into(),
        endpoints: vec![Endpoint {
            transport: NAME.into(),
            blob: format!("{}\n{fake}\n{bytes0}", fields[0]).into_bytes(),
        }],
    };
    std::thread::scope(|s| {
        let server = s.spawn(move || {
            let (sock, _) = listener.accept().unwrap();
            sock.set_read_timeout(Some(Duration::from_secs(10)))
                .unwrap();
            let mut hello = [0u8; 20];
            (&sock).read_exact(&mut hello).unwrap();
            assert_eq!(hello[..16], SECRET);
            assert_eq!(hello[16..], 1u32.to_le_bytes());
            let (offer, fd) = make(bytes0);
            send_msg(&sock, &offer, fd.as_ref().map(|f| f.as_fd())).unwrap();
            // `fd` closes here: rank 1 holds the only other copy, if it kept one.
        });
        let fetcher = s.spawn(|| {
            let addr = SocketAddr::from_abstract_name(socket1.as_bytes()).unwrap();
            let sock = loop {
                match UnixStream::connect_addr(&addr) {
                    Ok(s) => break s,
                    Err(_) => std::thread::sleep(Duration::from_millis(2)),
                }
            };
            sock.set_read_timeout(Some(Duration::from_secs(10)))
                .unwrap();
            let mut hello = [0u8; 20];
            hello[..16].copy_from_slice(&SECRET);
            (&sock).write_all(&hello).unwrap();
            let mut offer = [0u8; OFFER_BYTES];
            let fd = recv_msg(&sock, &mut offer).unwrap();
            let (bytes, shared) = decode_offer(&offer, fd).unwrap();
            assert_eq!(bytes.to_string(), bytes1);
            let kind = u32::from_le_bytes(offer[8..12].try_into().unwrap());
            match (mode, shared) {
                (Mode::Fd, Shareable::Fd(_)) => assert_eq!(kind, KIND_FD),
                (Mode::Handle, Shareable::Handle(h)) => {
                    assert_eq!(kind, KIND_HANDLE);
                    assert_eq!(h.len(), 8, "an emulated handle: pid and descriptor number");
                }
                (mode, shared) => panic!("a {mode:?} rank offered a {}", shared.kind()),
            }
        });
        let err = p1.connect(&ctx1, &[Some(&peer0), None]).err();
        server.join().unwrap();
        fetcher.join().unwrap();
        drop(p0);
        err.expect("rank 1 accepted a hostile offer")
    })
}

/// Asserts that `err` is a bootstrap error about rank 0 that says `why`.
fn refused(err: Error, why: &str) {
    let text = err.to_string();
    assert!(matches!(err, Error::Bootstrap(_)), "{text}");
    assert!(text.contains("rank 0's device rings"), "{text}");
    assert!(text.contains(why), "{text}");
}

fn handle_offer(bytes: usize) -> [u8; OFFER_BYTES] {
    encode_offer(bytes, &Shareable::handle(vec![7; 8]).unwrap()).unwrap()
}

#[test]
fn an_offer_of_an_unknown_kind_is_refused() {
    for (mode, kind) in [(Mode::Fd, 0u32), (Mode::Handle, 3), (Mode::Fd, u32::MAX)] {
        let err = against_a_hostile_peer(mode, |bytes| {
            let mut offer = handle_offer(bytes);
            offer[8..12].copy_from_slice(&kind.to_le_bytes());
            (offer, None)
        });
        refused(err, &format!("unknown kind {kind}"));
    }
}

#[test]
fn a_handle_longer_than_an_offer_holds_is_refused() {
    for (mode, len) in [
        (Mode::Handle, 129u32),
        (Mode::Fd, u32::MAX),
        (Mode::Handle, 0),
    ] {
        let err = against_a_hostile_peer(mode, |bytes| {
            let mut offer = handle_offer(bytes);
            offer[12..16].copy_from_slice(&len.to_le_bytes());
            (offer, None)
        });
        refused(err, &format!("a handle of {len} bytes (1 to 128 allowed)"));
    }
}

#[test]
fn a_descriptor_offer_without_its_descriptor_is_refused() {
    let err = against_a_hostile_peer(Mode::Fd, |bytes| {
        let (_, fd) = EmulatedDevice::new(0).allocate(bytes).unwrap();
        (encode_offer(bytes, &fd).unwrap(), None)
    });
    refused(err, "its descriptor did not come");
    // A descriptor offer that also claims handle bytes.
    let err = against_a_hostile_peer(Mode::Handle, |bytes| {
        let (_, fd) = EmulatedDevice::new(0).allocate(bytes).unwrap();
        let mut offer = encode_offer(bytes, &fd).unwrap();
        offer[12..16].copy_from_slice(&8u32.to_le_bytes());
        let Shareable::Fd(fd) = fd else {
            unreachable!()
        };
        (offer, Some(fd))
    });
    refused(err, "descriptor offer holds 8 handle bytes");
}

#[test]
fn a_stray_descriptor_with_a_handle_offer_is_refused_and_closed() {
    for mode in [Mode::Handle, Mode::Fd] {
        let (stray, watch) = UnixStream::pair().unwrap();
        let stray = OwnedFd::from(stray);
        let err = against_a_hostile_peer(mode, move |bytes| (handle_offer(bytes), Some(stray)));
        refused(err, "its handle offer came with a descriptor");
        // Every copy of the stray end is closed (the sender's, and the one rank 1 received): the other
        // end sees the end of the stream, not a stream that may still bring bytes.
        watch.set_nonblocking(true).unwrap();
        let mut buf = [0u8; 1];
        assert_eq!(
            (&watch).read(&mut buf).unwrap(),
            0,
            "rank 1 kept the stray descriptor"
        );
    }
}

#[test]
fn an_offer_of_another_size_than_the_endpoint_said_is_refused() {
    let err = against_a_hostile_peer(Mode::Handle, |bytes| (handle_offer(bytes + 4096), None));
    refused(err, "bytes of rings, its endpoint said");
}

#[test]
fn offers_round_trip_and_oversized_handles_are_not_sent() {
    let handle = Shareable::handle((1..=128).collect()).unwrap();
    let offer = encode_offer(1 << 21, &handle).unwrap();
    let (bytes, back) = decode_offer(&offer, None).unwrap();
    let Shareable::Handle(h) = back else {
        panic!("a handle came back as a {}", back.kind())
    };
    assert_eq!((bytes, h), (1 << 21, (1..=128).collect::<Vec<u8>>()));
    // `Shareable::Handle` can be built unchecked; the offer checks it.
    for bad in [Vec::new(), vec![0; 129]] {
        let e = encode_offer(4096, &Shareable::Handle(bad)).unwrap_err();
        assert!(e.to_string().contains("1 to 128 fit an offer"), "{e}");
    }
}

/// The variable that makes `rank_1_of_a_child_process` a rank (its value: the mode and the nonce), set
/// only by the test that starts it.
const CHILD: &str = "BRAID_TEST_IPC_CHILD";

/// Rank 0 here and rank 1 in a child process (this test binary again), sharing by descriptor and by
/// handle (the child opens this process's memfd through `/proc/<pid>/fd`, and this process the child's):
/// the endpoints cross through the child's stdin and stdout, messages go both ways through each other's
/// rings.
#[test]
fn ranks_in_two_processes_share_rings_by_descriptor_and_by_handle() {
    for mode in [Mode::Fd, Mode::Handle] {
        let nonce = rand_tag();
        let ctx = setup_ctx(0, 2, 2, 4096, nonce);
        let prepared = Box::new(Ipc::new("/dev/shm", Arc::new(device(mode))))
            .prepare(&ctx)
            .unwrap();
        let mut child = ChildTest::start(
            "shm::ipc_tests::rank_1_of_a_child_process",
            CHILD,
            &format!("{mode:?} {nonce}"),
        );
        child.send_marked("BRAID-ENDPOINT ", &prepared.endpoint());
        let theirs = child.read_marked("BRAID-ENDPOINT ");
        let link = prepared
            .connect(&ctx, &[None, Some(&child_peer(unhex(&theirs)))])
            .unwrap()
            .activate()
            .unwrap();
        let abort = AtomicBool::new(false);
        send(&*link, 1, 0, b"from rank 0", 1, &abort);
        assert_eq!(
            recv(&*link, 1, 0, &abort),
            (b"from rank 1".to_vec(), 2),
            "{mode:?}"
        );
        let (ok, rest) = child.finish();
        assert!(ok, "{mode:?}: {rest}");
    }
}

/// Rank 1 of `ranks_in_two_processes_share_rings_by_descriptor_and_by_handle`, in the child process it
/// starts; elsewhere it does nothing.
#[test]
fn rank_1_of_a_child_process() {
    let Ok(setting) = std::env::var(CHILD) else {
        return;
    };
    let (mode, nonce) = setting.split_once(' ').unwrap();
    let mode = if mode == "Handle" {
        Mode::Handle
    } else {
        Mode::Fd
    };
    let ctx = setup_ctx(1, 2, 2, 4096, nonce.parse().unwrap());
    let prepared = Box::new(Ipc::new("/dev/shm", Arc::new(device(mode))))
        .prepare(&ctx)
        .unwrap();
    println!("\nBRAID-ENDPOINT {}", hex(&prepared.endpoint()));
    let theirs = read_marked(&mut std::io::stdin().lock(), "BRAID-ENDPOINT ");
    let link = prepared
        .connect(&ctx, &[Some(&child_peer(unhex(&theirs))), None])
        .unwrap()
        .activate()
        .unwrap();
    let abort = AtomicBool::new(false);
    assert_eq!(recv(&*link, 0, 0, &abort), (b"from rank 0".to_vec(), 1));
    // Into the parent's ring: the message stays there after this process ends.
    send(&*link, 0, 0, b"from rank 1", 2, &abort);
}

fn child_peer(blob: Vec<u8>) -> Peer {
    Peer {
        pid: std::process::id(),
        host: "here".into(),
        endpoints: vec![Endpoint {
            transport: NAME.into(),
            blob,
        }],
    }
}
