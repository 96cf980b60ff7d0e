//! [`TcpLink`]: the [`Link`] over a rank's connections (see the module above for the protocol): the
//! sending side, writing each part with one vectored send, and the executor's side of the receiving one.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::io::ErrorKind;
use std::net::TcpStream;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use braid_core::Error;

use super::conn::TcpOptions;
use super::frame::{self, PartHeader};
use super::reader::{Inbound, Shared};
use crate::link::{check_token, misuse, AbortHandle, Event, Link, LinkId, RecvSlot, SendSlot};
use crate::memory::Span;
use crate::wait::{futex_wake, wait_until};
use crate::WaitCtx;

/// The sending side of one (peer, channel): staging buffers, one per reserved and unposted slot.
#[derive(Default)]
pub(super) struct SendRing {
    /// Messages reserved, and posted (sent), wrapping.
    reserved: Cell<u32>,
    posted: Cell<u32>,
    /// Buffers of reserved slots, oldest first (the next to post is at the front).
    outstanding: RefCell<VecDeque<Box<[u8]>>>,
    /// Buffers to reuse.
    free: RefCell<Vec<Box<[u8]>>>,
}

/// The sending side of one peer.
pub(super) struct Outbound {
    /// `sockets_per_peer` connections per channel, channel by channel.
    pub(super) socks: Vec<TcpStream>,
    pub(super) rings: Vec<SendRing>,
}

/// The receiving side of one (peer, channel), as the executor sees it.
#[derive(Default)]
pub(super) struct RecvRing {
    recvd: Cell<u32>,
    released: Cell<u32>,
}

/// The TCP link of one rank. Used by one thread at a time, like every link.
pub struct TcpLink {
    pub(super) id: LinkId,
    pub(super) opts: TcpOptions,
    pub(super) shared: Arc<Shared>,
    pub(super) outbound: Vec<Option<Outbound>>,
    pub(super) recv_rings: Vec<RecvRing>,
    pub(super) readers: Vec<JoinHandle<()>>,
}

/// The handle other threads use to abort a TCP link.
struct TcpAbort {
    shared: Arc<Shared>,
}

impl AbortHandle for TcpAbort {
    /// Closes every connection, so peers see this rank fail at once, and wakes every wait.
    fn fail_and_wake(&self) {
        self.shared.close_all();
    }
}

impl TcpLink {
    fn out(&self, peer: usize, ch: usize) -> Result<(&Outbound, &SendRing), Error> {
        match self.outbound.get(peer).and_then(Option::as_ref) {
            Some(o) if ch < self.opts.channels => Ok((o, &o.rings[ch])),
            _ => Err(misuse(
                "tcp",
                format!("no ring to rank {peer} on channel {ch}"),
            )),
        }
    }

    fn inbound(&self, peer: usize, ch: usize) -> Result<(&Inbound, &RecvRing), Error> {
        match self.shared.inbound.get(peer).and_then(Option::as_ref) {
            Some(v) if ch < self.opts.channels => {
                Ok((&v[ch], &self.recv_rings[peer * self.opts.channels + ch]))
            }
            _ => Err(misuse(
                "tcp",
                format!("no ring from rank {peer} on channel {ch}"),
            )),
        }
    }

    fn peer_error(&self, peer: usize, ctx: &WaitCtx<'_>) -> Result<(), Error> {
        if let Some(v) = self.shared.inbound.get(peer).and_then(Option::as_ref) {
            for ib in v {
                if ib.failed.load(Ordering::Acquire) {
                    let why = ib.reason.lock().clone();
                    return Err(ctx.peer_failed(peer, why));
                }
            }
        }
        Ok(())
    }
}

impl Link for TcpLink {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn slot_bytes(&self) -> usize {
        self.opts.slot_bytes
    }

    fn channels(&self) -> usize {
        self.opts.channels
    }

    fn try_reserve(
        &self,
        peer: usize,
        ch: usize,
        _ctx: &WaitCtx<'_>,
    ) -> Result<Option<SendSlot>, Error> {
        let (_, ring) = self.out(peer, ch)?;
        let mut outstanding = ring.outstanding.borrow_mut();
        if outstanding.len() >= self.opts.slots {
            return Ok(None);
        }
        let mut buf = ring
            .free
            .borrow_mut()
            .pop()
            .unwrap_or_else(|| vec![0u8; self.opts.slot_bytes].into_boxed_slice());
        let msg = ring.reserved.get();
        ring.reserved.set(msg.wrapping_add(1));
        // SAFETY: the buffer is a heap allocation owned by this ring until the slot is posted (moving the
        // box into the queue does not move its heap bytes); nobody else writes it meanwhile.
        let slot = unsafe {
            let span = Span::host(buf.as_mut_ptr(), buf.len());
            SendSlot::new(self.id, peer, ch, msg, span)
        };
        outstanding.push_back(buf);
        Ok(Some(slot))
    }

    fn post(&self, slot: SendSlot, len: usize, tag: u32, ctx: &WaitCtx<'_>) -> Result<(), Error> {
        let (out, ring) = self.out(slot.peer, slot.ch)?;
        check_token(
            "tcp",
            self.id,
            slot.link,
            slot.msg,
            ring.posted.get(),
            "post",
        )?;
        if len > self.opts.slot_bytes {
            return Err(misuse(
                "tcp",
                format!(
                    "posting {len} bytes into a slot of {}",
                    self.opts.slot_bytes
                ),
            ));
        }
        let Some(buf) = ring.outstanding.borrow_mut().pop_front() else {
            return Err(misuse("tcp", "post without a reserved slot".into()));
        };
        let msg = slot.msg;
        ring.posted.set(msg.wrapping_add(1));
        let k = self.opts.sockets_per_peer;
        let data = &buf[..len];
        let mut result = Ok(());
        for (j, s) in out.socks[slot.ch * k..(slot.ch + 1) * k].iter().enumerate() {
            let r = frame::part_range(data.len(), msg, j, k);
            let h = PartHeader {
                tag,
                msg,
                len: data.len() as u32,
                offset: r.start as u32,
                part_len: r.len() as u32,
            }
            .encode();
            result = send_all(s, &h, &data[r], ctx, slot.peer, self);
            if result.is_err() {
                break;
            }
        }
        ring.free.borrow_mut().push(buf);
        result
    }

    fn try_recv(
        &self,
        peer: usize,
        ch: usize,
        _ctx: &WaitCtx<'_>,
    ) -> Result<Option<RecvSlot>, Error> {
        let (ib, ring) = self.inbound(peer, ch)?;
        let r = ring.recvd.get();
        let index = (r % self.opts.slots as u32) as usize;
        if ib.seq[index].load(Ordering::Acquire) != r.wrapping_add(1) {
            return Ok(None);
        }
        let len = ib.len[index].load(Ordering::Relaxed) as usize;
        let tag = ib.tag[index].load(Ordering::Relaxed);
        ring.recvd.set(r.wrapping_add(1));
        let mem = &ib.mem[index];
        // SAFETY: `len <= slot_bytes` (validated by the reader before it wrote the slot); the Acquire load
        // of `seq` above observed the reader's publication, and the reader will not write this slot again
        // until `release` returns it; the memory lives as long as the link.
        let slot = unsafe {
            let span = Span::host(mem.ptr, len);
            RecvSlot::new(self.id, peer, ch, r, tag, span)
        };
        Ok(Some(slot))
    }

    fn release(&self, slot: RecvSlot) -> Result<(), Error> {
        let (ib, ring) = self.inbound(slot.peer, slot.ch)?;
        check_token(
            "tcp",
            self.id,
            slot.link,
            slot.msg,
            ring.released.get(),
            "release",
        )?;
        let r = slot.msg.wrapping_add(1);
        ring.released.set(r);
        ib.consumed.store(r, Ordering::SeqCst);
        if ib.reader_waiting.load(Ordering::SeqCst) != 0 {
            futex_wake(&ib.consumed);
        }
        Ok(())
    }

    fn wait(
        &self,
        peer: usize,
        ch: usize,
        event: Event,
        ctx: &WaitCtx<'_>,
        until: Instant,
    ) -> Result<(), Error> {
        match event {
            // A slot is free again as soon as the post that used it returns, and the post has
            // stopped reading the caller's memory by then.
            Event::Credit | Event::Sent => {
                self.out(peer, ch)?;
                self.peer_error(peer, ctx)
            }
            Event::Data => {
                let (ib, ring) = self.inbound(peer, ch)?;
                let r = ring.recvd.get();
                let index = (r % self.opts.slots as u32) as usize;
                let want = r.wrapping_add(1);
                let seq = &ib.seq[index];
                wait_until(
                    &self.opts.policy,
                    ctx,
                    until,
                    peer,
                    event.describe(),
                    seq,
                    &ib.recv_waiting,
                    || seq.load(Ordering::Acquire) == want,
                    || self.peer_error(peer, ctx),
                )
            }
        }
    }

    fn abort_handle(&self) -> Arc<dyn AbortHandle> {
        Arc::new(TcpAbort {
            shared: self.shared.clone(),
        })
    }
}

/// Writes header and payload as one vectored send, in slices, until done or a wait fails.
fn send_all(
    s: &TcpStream,
    hdr: &[u8],
    data: &[u8],
    ctx: &WaitCtx<'_>,
    to: usize,
    link: &TcpLink,
) -> Result<(), Error> {
    let total = hdr.len() + data.len();
    let mut done = 0;
    while done < total {
        let (a, b) = if done < hdr.len() {
            (&hdr[done..], data)
        } else {
            (&data[done - hdr.len()..], &[][..])
        };
        match send_vectored(s, a, b) {
            Ok(n) => done += n,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                if ctx.abort.load(Ordering::Relaxed) {
                    return Err(ctx.aborted());
                }
                if Instant::now() >= ctx.deadline {
                    return Err(ctx.timeout(to, "the network to accept data"));
                }
                link.peer_error(to, ctx)?;
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => {
                return Err(
                    ctx.peer_failed(to, format!("is unreachable: sending to it failed ({e})"))
                )
            }
        }
    }
    Ok(())
}

/// One `sendmsg` of two buffers, without raising SIGPIPE on a closed connection.
fn send_vectored(s: &TcpStream, a: &[u8], b: &[u8]) -> std::io::Result<usize> {
    let both = [std::io::IoSlice::new(a), std::io::IoSlice::new(b)];
    let iov = if b.is_empty() { &both[..1] } else { &both[..] };
    rustix::net::sendmsg(
        s,
        iov,
        &mut rustix::net::SendAncillaryBuffer::default(),
        rustix::net::SendFlags::NOSIGNAL,
    )
    .map_err(std::io::Error::from)
}

impl Drop for TcpLink {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        self.shared.close_all();
        for h in self.readers.drain(..) {
            let _ = h.join();
        }
    }
}
