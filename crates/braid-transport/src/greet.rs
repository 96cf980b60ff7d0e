//! Serving a listener's first messages from one loop: accept without blocking, read what each new
//! connection has sent so far, hand over each one whose first message is complete. No thread per
//! connection (so none can fail to start), a bound on the connections waiting (the oldest goes: a
//! real peer speaks at once), and a time limit for each to speak. The bootstrap root and the TCP
//! data port both greet their peers this way.

use std::collections::VecDeque;
use std::io::{ErrorKind, Read};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use tracing::warn;

/// A connection that has said its first message, or failed to.
pub struct Greeted {
    /// The connection, blocking again when `first` is `Ok`.
    pub stream: TcpStream,
    /// Where it came from.
    pub from: SocketAddr,
    /// The first message's bytes (exactly those: nothing after it is read); else why there are none.
    pub first: Result<Vec<u8>, String>,
}

struct Waiting {
    stream: TcpStream,
    from: SocketAddr,
    buf: Vec<u8>,
    until: Instant,
}

/// The connections of one listener that have not said their first message yet.
pub struct Greeter {
    waiting: VecDeque<Waiting>,
    max_waiting: usize,
    within: Duration,
    what: &'static str,
    chunk: Vec<u8>,
}

impl Greeter {
    /// At most `max_waiting` connections wait, each at most `within`. `what` names the listener in
    /// warnings.
    pub fn new(what: &'static str, max_waiting: usize, within: Duration) -> Greeter {
        Greeter {
            waiting: VecDeque::new(),
            max_waiting: max_waiting.max(1),
            within,
            what,
            chunk: vec![0u8; 16 * 1024],
        }
    }

    /// How many connections wait.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Accepts what `listener` (non-blocking) has, reads what the waiting connections have sent, and
    /// returns those that are done. `remaining(bytes)` says how many more bytes the first message
    /// needs after `bytes` (0: it is whole; a message that can be seen to be bad is whole too, for the
    /// caller to refuse). `deadline` caps every connection's time to speak. The second value says
    /// whether anything happened (when nothing did, the caller may sleep a little).
    pub fn poll(
        &mut self,
        listener: &TcpListener,
        now: Instant,
        deadline: Instant,
        remaining: impl Fn(&[u8]) -> usize,
    ) -> (Vec<Greeted>, bool) {
        let mut busy = false;
        loop {
            match listener.accept() {
                Ok((stream, from)) => {
                    busy = true;
                    if stream.set_nonblocking(true).is_err() {
                        continue;
                    }
                    let _ = stream.set_nodelay(true);
                    if self.waiting.len() == self.max_waiting {
                        if let Some(old) = self.waiting.pop_front() {
                            warn!(
                                "{}: {} connections have not spoken; dropping the oldest, from {}",
                                self.what, self.max_waiting, old.from
                            );
                        }
                    }
                    self.waiting.push_back(Waiting {
                        stream,
                        from,
                        buf: Vec::new(),
                        until: deadline.min(now + self.within),
                    });
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) => {
                    // Out of descriptors, say: the connections already here can still be served.
                    warn!("{}: accepting a connection failed: {e}", self.what);
                    break;
                }
            }
        }
        let mut done = Vec::new();
        let mut i = 0;
        while i < self.waiting.len() {
            let w = &mut self.waiting[i];
            let mut failed = None;
            loop {
                let want = remaining(&w.buf).min(self.chunk.len());
                if want == 0 {
                    break;
                }
                match w.stream.read(&mut self.chunk[..want]) {
                    Ok(0) => {
                        failed = Some("closed before its first message".to_string());
                        break;
                    }
                    Ok(n) => {
                        busy = true;
                        w.buf.extend_from_slice(&self.chunk[..n]);
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) => {
                        failed = Some(e.to_string());
                        break;
                    }
                }
            }
            let first = if remaining(&w.buf) == 0 {
                Ok(())
            } else if let Some(why) = failed {
                Err(why)
            } else if now >= w.until {
                Err(format!("no first message within {:?}", self.within))
            } else {
                i += 1;
                continue;
            };
            let Some(w) = self.waiting.remove(i) else {
                break;
            };
            let first = first.and_then(|()| {
                w.stream
                    .set_nonblocking(false)
                    .map(|()| w.buf)
                    .map_err(|e| e.to_string())
            });
            done.push(Greeted {
                stream: w.stream,
                from: w.from,
                first,
            });
        }
        (done, busy)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn takes_exactly_the_first_message_and_times_out_the_silent() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.set_nonblocking(true).unwrap();
        let addr = l.local_addr().unwrap();
        let mut talker = TcpStream::connect(addr).unwrap();
        talker.write_all(b"hello!and more").unwrap();
        let _silent = TcpStream::connect(addr).unwrap();
        let mut g = Greeter::new("test", 8, Duration::from_millis(200));
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut got = Vec::new();
        while got.len() < 2 && Instant::now() < deadline {
            let (done, _) = g.poll(&l, Instant::now(), deadline, |b| {
                6usize.saturating_sub(b.len())
            });
            got.extend(done);
            std::thread::sleep(Duration::from_millis(5));
        }
        let mut firsts: Vec<_> = got.iter().map(|x| x.first.clone()).collect();
        firsts.sort();
        assert_eq!(firsts[0], Ok(b"hello!".to_vec()));
        assert!(
            matches!(&firsts[1], Err(e) if e.contains("within")),
            "{firsts:?}"
        );
        // What came after the first message is still in the stream, for the protocol that follows.
        let talked = got.into_iter().find(|x| x.first.is_ok()).unwrap();
        let mut rest = [0u8; 8];
        std::io::Read::read_exact(&mut &talked.stream, &mut rest).unwrap();
        assert_eq!(&rest, b"and more");
        assert_eq!(g.waiting(), 0);
    }
}
