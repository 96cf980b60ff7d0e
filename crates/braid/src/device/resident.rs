//! The device-resident all-reduce of a CUDA device communicator: one kernel launch per all-reduce, on
//! the caller's stream (or the communicator's own, for blocking calls), over windows every rank of the
//! host maps (braid-cuda's `resident` module has the kernel's side).
//!
//! Set up by [`Communicator::cuda_device`] when every rank can take it: at most
//! [`MAX_RANKS`](braid_cuda::resident::MAX_RANKS) ranks, `BRAID_CUDA_RESIDENT` not `off`, and, where
//! ranks of several processes share one GPU, the CUDA MPS daemon running for each of them (without
//! MPS the GPU time-slices between processes and every barrier would wait a time slice: those ranks
//! keep the host-driven path, and rank 0 says once that MPS would be faster). Ranks that are threads
//! of one process share a context and need no MPS.
//!
//! Every rank agrees on the decision and on the blocks (the fewest multiprocessors per rank of any
//! GPU), allocates its window in shareable device memory, and maps every peer's (the `ipc` transport's
//! [`DeviceShare`]). Kernels are compiled (or read from the kernel cache) per (dtype, op) for the
//! world size; the usual float ones at setup, the others on first use. Ranks that share one context
//! load all of theirs at setup: loading a module while a peer's kernel waits for this rank would wait
//! for that kernel to end.

use std::time::{Duration, Instant};

use braid_core::{DType, Error, ReduceOp};
use braid_cuda::resident::{mps_active, ResidentAllReduce, WindowLayout, MAX_BLOCKS, MAX_RANKS};
use braid_cuda::{Gpu, Priority, Stream};
use braid_exec::Op;
use braid_sched::Collective;
use braid_transport::shm::ipc::{DeviceShare, SharedAllocations};
use braid_transport::{DeviceMemory, Geometry, SetupCtx, WaitPolicy};

use crate::comm::Communicator;

/// The environment variable that turns the device-resident path off (`off`) or leaves it to braid
/// (`auto`, the default).
pub const RESIDENT_VARIABLE: &str = "BRAID_CUDA_RESIDENT";

/// Bytes of one staging half of a window.
const STAGE_BYTES: usize = 16 << 20;

/// The (dtype, op) kernels every rank loads at setup.
const USUAL: [(DType, ReduceOp); 6] = [
    (DType::F32, ReduceOp::Sum),
    (DType::F32, ReduceOp::Avg),
    (DType::BF16, ReduceOp::Sum),
    (DType::BF16, ReduceOp::Avg),
    (DType::F16, ReduceOp::Sum),
    (DType::F16, ReduceOp::Avg),
];

/// A communicator's device-resident all-reduce.
pub(super) struct Resident {
    ar: ResidentAllReduce,
    /// The stream blocking calls run on.
    stream: Stream,
    _windows: SharedAllocations,
}

/// What each rank tells the others before they decide.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Facts {
    willing: bool,
    gpu: u64,
    pid: u64,
    sms: u64,
    mps: bool,
}

impl Facts {
    fn words(&self) -> [u64; 5] {
        [
            u64::from(self.willing),
            self.gpu,
            self.pid,
            self.sms,
            u64::from(self.mps),
        ]
    }

    fn from_words(w: &[u64]) -> Facts {
        Facts {
            willing: w[0] != 0,
            gpu: w[1],
            pid: w[2],
            sms: w[3],
            mps: w[4] != 0,
        }
    }
}

/// Whether every rank can run the device-resident path, with the blocks they agree on, or why not.
/// A pure function of every rank's facts, so every rank decides the same.
fn decide(facts: &[Facts]) -> Result<u32, String> {
    if facts.len() > MAX_RANKS {
        return Err(format!(
            "{} ranks (the device-resident all-reduce takes at most {MAX_RANKS})",
            facts.len()
        ));
    }
    if let Some(r) = facts.iter().position(|f| !f.willing) {
        return Err(format!("rank {r} has {RESIDENT_VARIABLE}=off"));
    }
    let mut blocks = MAX_BLOCKS as u64;
    for (r, f) in facts.iter().enumerate() {
        let sharing: Vec<&Facts> = facts.iter().filter(|g| g.gpu == f.gpu).collect();
        let processes = {
            let mut pids: Vec<u64> = sharing.iter().map(|g| g.pid).collect();
            pids.sort_unstable();
            pids.dedup();
            pids.len()
        };
        if processes > 1 && sharing.iter().any(|g| !g.mps) {
            return Err(format!(
                "rank {r} shares its GPU with {} other processes and the CUDA MPS daemon does not run \
                 for all of them (start it with `nvidia-cuda-mps-control -d` for GPU kernels that run at \
                 once)",
                processes - 1
            ));
        }
        blocks = blocks.min((f.sms / sharing.len() as u64).max(1));
    }
    Ok(blocks as u32)
}

/// An FNV-1a hash of the GPU's PCI address: equal on every rank of that GPU.
fn gpu_id(gpu: &Gpu) -> Result<u64, Error> {
    let pci = gpu.pci_address()?;
    Ok(pci.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    }))
}

impl Resident {
    /// Sets up the device-resident all-reduce on every rank, or on none (with the reason logged):
    /// every rank calls it, after the device rings are up.
    pub(super) fn setup(
        comm: &Communicator,
        gpu: &Gpu,
        memory: &dyn DeviceMemory,
    ) -> Result<Option<Resident>, Error> {
        let (rank, world) = (comm.rank(), comm.world_size());
        let setting = std::env::var(RESIDENT_VARIABLE).unwrap_or_default();
        if !matches!(setting.as_str(), "" | "auto" | "off") {
            // Every rank reads its own environment; a typo is reported the same way on each.
            return Err(Error::invalid(format!(
                "{RESIDENT_VARIABLE}={setting:?}: expected auto or off"
            )));
        }
        let mine = Facts {
            willing: setting != "off",
            gpu: gpu_id(gpu)?,
            pid: u64::from(std::process::id()),
            sms: u64::from(gpu.multiprocessors()?),
            mps: mps_active(),
        };
        let mut all = vec![0u64; 5 * world];
        comm.all_gather(&mine.words(), &mut all)?;
        let facts: Vec<Facts> = all.chunks_exact(5).map(Facts::from_words).collect();
        let blocks = match decide(&facts) {
            Ok(b) => b,
            Err(why) => {
                if rank == 0 {
                    tracing::warn!(
                        "device all-reduce: the host-driven path, not the device-resident one: {why}"
                    );
                }
                return Ok(None);
            }
        };
        let shared_context = facts
            .iter()
            .filter(|f| f.gpu == mine.gpu && f.pid == mine.pid)
            .count()
            > 1;
        let made = Self::make(comm, gpu, memory, blocks, shared_context);
        match comm.all_agree("setting up the device-resident all-reduce", made) {
            Ok(r) => Ok(Some(r)),
            Err(e) => {
                tracing::warn!("device all-reduce: the host-driven path, since setup failed: {e}");
                Ok(None)
            }
        }
    }

    fn make(
        comm: &Communicator,
        gpu: &Gpu,
        memory: &dyn DeviceMemory,
        blocks: u32,
        shared_context: bool,
    ) -> Result<Resident, Error> {
        let (rank, world) = (comm.rank(), comm.world_size());
        let config = comm.config();
        let layout = WindowLayout::new(STAGE_BYTES, 0);
        let bytes = layout.bytes().next_multiple_of(memory.granularity());
        let nonce = crate::id::random_secret()?;
        let nonce = u64::from_le_bytes([
            nonce[0], nonce[1], nonce[2], nonce[3], nonce[4], nonce[5], nonce[6], nonce[7],
        ]);
        let share = DeviceShare::new(memory, &format!("braid-{nonce:016x}-r{rank}-win"), bytes);
        let share = comm.all_agree("allocating device windows", share)?;
        let blobs = comm.exchange_blobs("exchanging device windows", &share.endpoint())?;
        let endpoints: Vec<Option<&[u8]>> = blobs
            .iter()
            .enumerate()
            .map(|(p, b)| (p != rank).then_some(b.as_slice()))
            .collect();
        let ctx = SetupCtx {
            geometry: Geometry {
                rank,
                world,
                channels: 1,
                slots: 1,
                slot_bytes: 0,
            },
            secret: comm.inner.secret,
            nonce,
            policy: WaitPolicy::for_host(world, config.spin_us),
            deadline: Instant::now() + config.timeout,
        };
        let windows = comm.all_agree(
            "mapping the peers' device windows",
            share.exchange(&ctx, memory, &endpoints),
        )?;
        let addrs: Vec<u64> = (0..world)
            .map(|p| match &windows.peers[p] {
                Some(w) if p != rank => w.addr(),
                _ => windows.own.addr(),
            })
            .collect();
        let ar = ResidentAllReduce::new(gpu, rank, addrs, layout, blocks as usize, config.timeout)?;
        let kernels: Vec<(DType, ReduceOp)> = if shared_context {
            DType::ALL
                .iter()
                .flat_map(|&d| ReduceOp::ARITHMETIC.iter().map(move |&o| (d, o)))
                .collect()
        } else {
            USUAL.to_vec()
        };
        prepare_all(&ar, &kernels)?;
        Ok(Resident {
            ar,
            stream: Stream::new(gpu, Priority::High)?,
            _windows: windows,
        })
    }

    /// Whether `op` runs here: an all-reduce.
    pub(super) fn takes(&self, op: &Op) -> bool {
        op.collective == Collective::AllReduce
    }

    /// Queues `op` (an all-reduce on this device's memory) on `stream`.
    ///
    /// # Safety
    /// The op's spans must stay valid device memory, untouched by anything not ordered on `stream`,
    /// until the kernel completes on `stream`.
    pub(super) unsafe fn launch(&self, op: &Op, stream: &Stream) -> Result<(), Error> {
        if !self.takes(op) {
            return Err(Error::Internal(
                "the device-resident path was handed an op it does not take".into(),
            ));
        }
        // SAFETY: the caller's contract.
        unsafe {
            self.ar.all_reduce(
                stream,
                op.send.addr() as u64,
                op.recv.addr() as u64,
                op.count,
                op.dtype,
                op.redop,
            )
        }
    }

    /// Runs `op` on the communicator's stream and returns once it has finished on the device.
    ///
    /// # Safety
    /// The op's spans must be valid device memory until this returns, untouched meanwhile.
    pub(super) unsafe fn run(&self, op: &Op, timeout: Duration) -> Result<(), Error> {
        // SAFETY: the caller's contract, for as long as this waits below.
        unsafe { self.launch(op, &self.stream)? };
        // The kernel ends by its own deadline at the latest; the host waits a little longer.
        self.stream
            .synchronize(Instant::now() + timeout * 2 + Duration::from_secs(5))?;
        self.ar.status()
    }

    /// The failure a kernel recorded, if any.
    pub(super) fn status(&self) -> Result<(), Error> {
        self.ar.status()
    }

    /// Ends every wait of this rank's kernels (running or later) with an error.
    pub(super) fn abort(&self) {
        self.ar.abort();
    }
}

/// Loads `kernels` on `ar`, compiling the missing ones in parallel.
fn prepare_all(ar: &ResidentAllReduce, kernels: &[(DType, ReduceOp)]) -> Result<(), Error> {
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(kernels.len().max(1));
    let chunks: Vec<&[(DType, ReduceOp)]> =
        kernels.chunks(kernels.len().div_ceil(threads)).collect();
    std::thread::scope(|s| {
        let handles: Vec<_> = chunks
            .iter()
            .map(|chunk| {
                s.spawn(move || {
                    chunk
                        .iter()
                        .try_for_each(|&(dtype, op)| ar.prepare(dtype, op))
                })
            })
            .collect();
        handles.into_iter().try_for_each(|h| {
            h.join()
                .unwrap_or_else(|_| Err(Error::Internal("compiling a kernel panicked".into())))
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rank(gpu: u64, pid: u64, mps: bool) -> Facts {
        Facts {
            willing: true,
            gpu,
            pid,
            sms: 132,
            mps,
        }
    }

    #[test]
    fn ranks_share_the_multiprocessors_of_their_gpu() {
        assert_eq!(decide(&[rank(1, 10, false), rank(2, 11, false)]), Ok(64));
        assert_eq!(decide(&[rank(1, 10, false), rank(1, 10, false)]), Ok(64));
        let four: Vec<Facts> = (0..4).map(|p| rank(1, p, true)).collect();
        assert_eq!(decide(&four), Ok(33));
    }

    #[test]
    fn processes_sharing_a_gpu_need_mps_and_everyone_must_be_willing() {
        let e = decide(&[rank(1, 10, true), rank(1, 11, false)]).unwrap_err();
        assert!(e.contains("MPS"), "{e}");
        let mut off = rank(2, 12, false);
        off.willing = false;
        let e = decide(&[rank(1, 10, false), off]).unwrap_err();
        assert!(e.contains("rank 1") && e.contains("off"), "{e}");
        let nine: Vec<Facts> = (0..9).map(|p| rank(p, p, false)).collect();
        assert!(decide(&nine).unwrap_err().contains("at most 8"));
    }

    #[test]
    fn facts_travel_as_words() {
        let f = rank(7, 99, true);
        assert_eq!(Facts::from_words(&f.words()), f);
    }
}
