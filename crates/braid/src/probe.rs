//! Probing at start-up (`BRAID_TOPO_PROBE`): latency and bandwidth between every pair of ranks, measured
//! over the communicator's own transport, so that hosts can be told apart where identities do not.
//!
//! Pairs meet in the rounds of a round-robin tournament, so each rank measures against one partner at a
//! time and every link is measured unloaded. Each rank then sends its row of measurements to every other
//! rank, and every rank infers the same grouping from the same matrix.

use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use braid_core::Error;
use braid_transport::{recv_with, send_bytes, Link, Router, WaitCtx};

/// Round trips per pair for latency.
const PINGS: usize = 30;
/// Bytes streamed each way per pair and trial for bandwidth: enough to fill socket buffers and a
/// shaper's burst many times over, so what is timed is the link.
const BULK_BYTES: usize = 4 << 20;
/// Bandwidth trials per direction; the best counts (contention only ever makes a link look slower).
const TRIALS: usize = 3;
/// Tag of probe messages (collectives use their sequence number).
const TAG: u32 = u32::MAX - 7;

/// The partner of `rank` in round `round` of a round-robin tournament over `n` ranks (the circle
/// method; with `n` odd, one rank sits out each round and gets `None`).
pub(crate) fn partner(n: usize, rank: usize, round: usize) -> Option<usize> {
    let m = n + n % 2;
    let pos = |r: usize| {
        if r == m - 1 {
            m - 1
        } else {
            (r + round) % (m - 1)
        }
    };
    let mine = pos(rank);
    let other_pos = if mine == m - 1 {
        0
    } else if mine == 0 {
        m - 1
    } else {
        m - 1 - mine
    };
    // Invert `pos` for the partner.
    let other = if other_pos == m - 1 {
        m - 1
    } else {
        (other_pos + (m - 1) - round % (m - 1)) % (m - 1)
    };
    (other < n && other != rank).then_some(other)
}

/// Measurements between ranks, `[from][to]`.
pub(crate) type Matrix = Vec<Vec<f64>>;

/// Rounds of the tournament.
pub(crate) fn rounds(n: usize) -> usize {
    (n + n % 2).saturating_sub(1)
}

/// Measures one-way latency (seconds) and bandwidth (bytes per second) from this rank to every other
/// rank; returns the full `n × n` matrices, as every rank sees them.
pub(crate) fn measure(
    t: &Router,
    rank: usize,
    world: usize,
    deadline: Instant,
) -> Result<(Matrix, Matrix), Error> {
    let abort = AtomicBool::new(false);
    let now = Instant::now();
    let ctx = WaitCtx {
        rank,
        collective: "topology probe",
        seq: 0,
        deadline,
        started: now,
        abort: &abort,
    };
    let mut lat = vec![f64::NAN; world];
    let mut bw = vec![f64::NAN; world];
    let bulk = t.slot_bytes().min(1 << 20);
    let messages = BULK_BYTES.div_ceil(bulk);
    for round in 0..rounds(world) {
        let Some(p) = partner(world, rank, round) else {
            continue;
        };
        let lead = rank < p;
        let payload = vec![0x5au8; bulk];
        let send = |len: usize| send_bytes(t, p, 0, &payload[..len], TAG, &ctx);
        let recv = || -> Result<(), Error> { recv_with(t, p, 0, &ctx, |_, _| ()) };
        // Latency: ping-pong, the leader times it; one warm-up exchange first.
        let mut best = Duration::MAX;
        for i in 0..=PINGS {
            let start = Instant::now();
            if lead {
                send(8)?;
                recv()?;
            } else {
                recv()?;
                send(8)?;
            }
            if i > 0 {
                best = best.min(start.elapsed());
            }
        }
        // Bandwidth: the leader streams, the other acknowledges the last message; then the other way.
        let mut rate = [0.0f64; 2];
        for (dir, r) in rate.iter_mut().enumerate() {
            let sender = lead == (dir == 0);
            for _ in 0..TRIALS {
                let start = Instant::now();
                if sender {
                    for _ in 0..messages {
                        send(bulk)?;
                    }
                    recv()?;
                    *r = r.max((messages * bulk) as f64 / start.elapsed().as_secs_f64());
                } else {
                    for _ in 0..messages {
                        recv()?;
                    }
                    send(8)?;
                }
            }
        }
        // Each side keeps what it measured as the sender: the rate towards its partner.
        lat[p] = best.as_secs_f64() / 2.0;
        bw[p] = if lead { rate[0] } else { rate[1] };
    }
    // Everyone sends its row to everyone.
    let row: Vec<u8> = lat
        .iter()
        .chain(&bw)
        .flat_map(|x| x.to_le_bytes())
        .collect();
    if row.len() > t.slot_bytes() {
        return Err(Error::invalid(format!(
            "BRAID_TOPO_PROBE: {world} ranks need slots of at least {} bytes (BRAID_CHUNK_BYTES)",
            row.len()
        )));
    }
    for k in 1..world {
        let p = (rank + k) % world;
        send_bytes(t, p, 0, &row, TAG, &ctx)?;
    }
    let mut lat_m = vec![vec![f64::NAN; world]; world];
    let mut bw_m = vec![vec![f64::NAN; world]; world];
    lat_m[rank].clone_from(&lat);
    bw_m[rank].clone_from(&bw);
    for k in 1..world {
        let p = (rank + world - k) % world;
        let d = recv_with(t, p, 0, &ctx, |d, _| d.to_vec())?;
        if d.len() != row.len() {
            return Err(Error::Bootstrap(format!(
                "rank {p} sent a probe row of {} bytes, expected {}",
                d.len(),
                row.len()
            )));
        }
        let vals: Vec<f64> = d
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect();
        lat_m[p].copy_from_slice(&vals[..world]);
        bw_m[p].copy_from_slice(&vals[world..]);
    }
    Ok((lat_m, bw_m))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_pair_meets_exactly_once() {
        for n in 1..=17 {
            let mut met = vec![vec![0; n]; n];
            for round in 0..rounds(n) {
                for (r, row) in met.iter_mut().enumerate() {
                    if let Some(p) = partner(n, r, round) {
                        assert_eq!(partner(n, p, round), Some(r), "n {n} round {round}");
                        row[p] += 1;
                    }
                }
            }
            for (r, row) in met.iter().enumerate() {
                for (p, &m) in row.iter().enumerate() {
                    assert_eq!(m, usize::from(r != p), "n {n}: {r} met {p} {m} times");
                }
            }
        }
    }
}
