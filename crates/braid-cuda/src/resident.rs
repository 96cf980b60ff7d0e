//! Device-resident collectives: one kernel launch per all-reduce, on the caller's stream, with no host
//! thread on the data path (kernels/braid_collective.cuh says how the kernel works).
//!
//! Every rank owns a *window* of device memory (flags, descriptors, per-block state, two staging
//! halves, and a heap for buffers allocated symmetrically) that every other rank maps; a
//! [`ResidentAllReduce`] is given every rank's window as mapped in its own process, so it does not care
//! how the windows were shared (CUDA IPC between processes, or one context for ranks that are threads of
//! one process). It compiles the kernel of a (dtype, op) when a collective first needs it (NVRTC, with
//! the kernel cache), picks the mode and the blocks from the size alone (so every rank picks the same),
//! and launches. The barrier epochs and the staging parity live in the windows and are advanced by the
//! kernel, so the launch's arguments do not change from one call to the next for the same buffers: a
//! collective captured in a CUDA graph replays correctly.
//!
//! Failures inside the kernel (a peer that never arrives before the deadline, the abort word, ranks that
//! called different collectives) land in status words in mapped host memory; [`ResidentAllReduce::status`]
//! turns them into an error naming the peer. After a failure the epochs of the ranks disagree: the
//! collectives of this object must not be used again.
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::ffi::c_void;
use std::time::Duration;

use braid_core::{DType, Error, ReduceOp};
use parking_lot::Mutex;

use crate::driver::{Gpu, Module, PinnedBuffer, Stream};
use crate::{dtype_tag, load_module, load_or_compile_program};

/// The most ranks a window serves.
pub const MAX_RANKS: usize = 8;
/// The most blocks (channels) a collective runs on.
pub const MAX_BLOCKS: usize = 64;
/// Threads per block.
pub const THREADS: u32 = 512;
/// Bytes of a window before its staging halves: flags, descriptors, per-block state
/// (`AR_STAGE_OFF` in kernels/braid_collective.cuh).
pub const HEADER_BYTES: usize =
    MAX_BLOCKS * MAX_RANKS * 128 + MAX_BLOCKS * 2 * 64 + MAX_BLOCKS * 128;
/// Bytes of one staging half unless told otherwise.
pub const DEFAULT_STAGE_BYTES: usize = 16 << 20;
/// Messages up to this size use the one-shot mode with more than two ranks.
pub const ONE_SHOT_MAX_BYTES: usize = 256 << 10;
/// Heap buffers of up to this many bytes still go through staging: its one barrier beats the symmetric
/// mode's three for small messages (measured on an H200: 6 µs against 9.5 µs at 8 bytes, 2 ranks).
pub const SYMMETRIC_MIN_BYTES: usize = 256 << 10;
/// Bytes a block covers before another block pays off.
const BYTES_PER_BLOCK: usize = 256 << 10;

/// How the kernel moves the data (`AR_*` modes of the kernel).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Copy in, barrier, every rank reduces the whole message from every staging half.
    StagedOneShot = 0,
    /// Copy in, barrier, reduce-scatter into staging, barrier, all-gather into the output.
    StagedTwoShot = 1,
    /// Buffers in the heap at the same offsets on every rank: reduce-scatter from the peers' inputs,
    /// all-gather from their outputs; no staging copy.
    Symmetric = 2,
}

/// The kernel's argument (`braid::ArArgs`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ArArgs {
    /// Every rank's window as mapped here.
    pub window: [u64; MAX_RANKS],
    /// Staged: the input's device address; symmetric: its heap offset.
    pub send: u64,
    /// Likewise for the output.
    pub recv: u64,
    /// Elements.
    pub count: u64,
    /// Bytes of one staging half.
    pub stage_bytes: u64,
    /// Where the heap starts in a window.
    pub heap_off: u64,
    /// How long one wait of the kernel may last.
    pub timeout_ns: u64,
    /// Device address of the abort word (0: none).
    pub abort_word: u64,
    /// Device address of the four status words.
    pub status: u64,
    /// This rank.
    pub rank: u32,
    /// Ranks.
    pub world: u32,
    /// [`Mode`].
    pub mode: u32,
    /// Dtype and op, compared across ranks by the kernel.
    pub tag: u32,
}

/// The layout of a window: staging halves of `stage_bytes`, then a heap of `heap_bytes`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WindowLayout {
    /// Bytes of one staging half (a multiple of 4096).
    pub stage_bytes: usize,
    /// Bytes of the heap.
    pub heap_bytes: usize,
}

impl WindowLayout {
    /// A layout with staging halves of `stage_bytes` (rounded up to 4096, at least 64 KiB) and a heap of
    /// `heap_bytes` (rounded up to 4096).
    pub fn new(stage_bytes: usize, heap_bytes: usize) -> WindowLayout {
        WindowLayout {
            stage_bytes: stage_bytes.max(64 << 10).next_multiple_of(4096),
            heap_bytes: heap_bytes.next_multiple_of(4096),
        }
    }

    /// Where the heap starts.
    pub fn heap_offset(&self) -> usize {
        HEADER_BYTES + 2 * self.stage_bytes
    }

    /// Bytes of the whole window.
    pub fn bytes(&self) -> usize {
        self.heap_offset() + self.heap_bytes
    }
}

/// The mode and blocks a collective of `bytes` among `world` ranks takes, `symmetric` when both
/// buffers are in the heap: a function of these alone, so every rank picks the same.
pub fn plan(bytes: usize, world: usize, symmetric: bool, max_blocks: usize) -> (Mode, u32) {
    let mode = if symmetric {
        Mode::Symmetric
    } else if world <= 2 || bytes <= ONE_SHOT_MAX_BYTES {
        Mode::StagedOneShot
    } else {
        Mode::StagedTwoShot
    };
    let blocks = bytes
        .div_ceil(BYTES_PER_BLOCK)
        .clamp(1, max_blocks.clamp(1, MAX_BLOCKS));
    (mode, blocks as u32)
}

/// The all-reduce kernel's entry point for `dtype`, `op` and `world` ranks.
pub fn kernel_name(dtype: DType, op: ReduceOp, world: usize) -> String {
    format!("braid_ar_{}_{}_w{world}", dtype_tag(dtype), op.name())
}

/// The C type the kernels store `dtype` in.
fn c_type(dtype: DType) -> &'static str {
    match dtype {
        DType::I8 => "signed char",
        DType::U8 => "unsigned char",
        DType::I32 => "int",
        DType::U32 => "unsigned int",
        DType::I64 => "long long",
        DType::U64 => "unsigned long long",
        DType::F16 => "braid::half_t",
        DType::F32 => "float",
        DType::F64 => "double",
        DType::BF16 => "braid::bfloat16_t",
    }
}

/// The source of the one kernel for `dtype`, `op` and `world` ranks (compiled alone, in a few
/// seconds).
pub fn kernel_source(dtype: DType, op: ReduceOp, world: usize) -> String {
    format!(
        "#include \"braid_collective.cuh\"\nBRAID_AR_KERNEL({}, {}, {}, {}, {world})\n",
        dtype_tag(dtype),
        c_type(dtype),
        op.name(),
        op as u32
    )
}

/// The headers the kernel source includes.
pub fn kernel_headers() -> Vec<(&'static str, &'static str)> {
    let mut h = crate::SOURCES[..2].to_vec();
    h.push((
        "braid_collective.cuh",
        include_str!("../../../kernels/braid_collective.cuh"),
    ));
    h
}

/// Compiles (or reads from the kernel cache) the kernel for `dtype`, `op` and `world` ranks for
/// `sm_<arch>`.
pub fn compile_kernel(
    dtype: DType,
    op: ReduceOp,
    world: usize,
    arch: u32,
) -> Result<Vec<u8>, Error> {
    let name = format!("{}.cu", kernel_name(dtype, op, world));
    load_or_compile_program(
        &name,
        &kernel_source(dtype, op, world),
        &kernel_headers(),
        arch,
    )
    .map(|(image, _)| image)
}

/// Whether the CUDA MPS control daemon runs for this process's pipe directory
/// (`CUDA_MPS_PIPE_DIRECTORY`, else `/tmp/nvidia-mps`): only then do the kernels of several processes
/// on one GPU run at the same time (without it the GPU time-slices between processes, and a kernel
/// that waits for another process's kernel waits a time slice per barrier).
pub fn mps_active() -> bool {
    let dir = std::env::var_os("CUDA_MPS_PIPE_DIRECTORY")
        .filter(|d| !d.is_empty())
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| "/tmp/nvidia-mps".into());
    dir.join("control").exists()
}

/// The all-reduce of one rank over windows every rank maps.
pub struct ResidentAllReduce {
    gpu: Gpu,
    rank: usize,
    world: usize,
    windows: Vec<u64>,
    layout: WindowLayout,
    max_blocks: usize,
    timeout: Duration,
    /// Status words (16 bytes) and, at 128, the abort word: host memory the device maps.
    control: PinnedBuffer,
    control_dev: u64,
    kernels: Mutex<HashMap<(DType, ReduceOp), (Module, usize)>>,
}

impl ResidentAllReduce {
    /// Rank `rank` of `windows.len()` ranks on `gpu`: `windows[r]` is rank r's window as mapped in this
    /// process (laid out by `layout`, zeroed before any rank's first collective), `max_blocks` the
    /// blocks every rank agreed on (at most [`MAX_BLOCKS`]; ranks sharing one GPU must leave room for each
    /// other, since every block of every rank must be resident at once), `timeout` how long one wait
    /// inside the kernel may last.
    pub fn new(
        gpu: &Gpu,
        rank: usize,
        windows: Vec<u64>,
        layout: WindowLayout,
        max_blocks: usize,
        timeout: Duration,
    ) -> Result<ResidentAllReduce, Error> {
        let world = windows.len();
        if world == 0 || world > MAX_RANKS || rank >= world {
            return Err(Error::invalid(format!(
                "a device-resident collective takes 1 to {MAX_RANKS} ranks (rank {rank} of {world})"
            )));
        }
        if !(1..=MAX_BLOCKS).contains(&max_blocks) {
            return Err(Error::invalid(format!(
                "{max_blocks} blocks: 1 to {MAX_BLOCKS} allowed"
            )));
        }
        let control = PinnedBuffer::alloc_mapped(gpu, 256)?;
        let control_dev = control.device_addr()?;
        Ok(ResidentAllReduce {
            gpu: gpu.clone(),
            rank,
            world,
            windows,
            layout,
            max_blocks,
            timeout,
            control,
            control_dev,
            kernels: Mutex::new(HashMap::new()),
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// The window layout.
    pub fn layout(&self) -> WindowLayout {
        self.layout
    }

    /// This rank's heap: its device address and bytes.
    pub fn heap(&self) -> (u64, usize) {
        (
            self.windows[self.rank] + self.layout.heap_offset() as u64,
            self.layout.heap_bytes,
        )
    }

    /// Compiles and loads the kernel for `dtype` and `op` now (a collective does it when first needed).
    pub fn prepare(&self, dtype: DType, op: ReduceOp) -> Result<(), Error> {
        self.function(dtype, op).map(|_| ())
    }

    fn function(&self, dtype: DType, op: ReduceOp) -> Result<usize, Error> {
        if op.is_bitwise() {
            return Err(Error::invalid(format!(
                "the device-resident all-reduce has no {op} kernel (bitwise reductions run on host memory)"
            )));
        }
        let mut kernels = self.kernels.lock();
        if let Some((_, f)) = kernels.get(&(dtype, op)) {
            return Ok(*f);
        }
        let name = kernel_name(dtype, op, self.world);
        let module = load_module(
            &self.gpu,
            &format!("{name}.cu"),
            &kernel_source(dtype, op, self.world),
            &kernel_headers(),
        )?;
        let f = module.function(&name)?.raw() as usize;
        kernels.insert((dtype, op), (module, f));
        Ok(f)
    }

    /// Sets the abort word: every wait of a running or later kernel of this rank ends with an error.
    pub fn abort(&self) {
        // SAFETY: the abort word is 4 aligned bytes of the mapped buffer this object owns; the device
        // reads it with relaxed loads, and a volatile store is what makes the write reach it.
        unsafe { std::ptr::write_volatile(self.control.as_ptr().add(128).cast::<u32>(), 1) };
    }

    /// The failure a kernel of this rank recorded, if any (read once its launch has finished).
    pub fn status(&self) -> Result<(), Error> {
        let word = |i: usize| {
            // SAFETY: four aligned words at the start of the mapped buffer, written by the device;
            // volatile because the device writes them behind the compiler's back.
            unsafe { std::ptr::read_volatile(self.control.as_ptr().cast::<u32>().add(i)) }
        };
        let code = word(0);
        if code == 0 {
            return Ok(());
        }
        let (peer, block, epoch) = (word(1) as usize, word(2), word(3));
        let (rank, collective) = (self.rank, "device all-reduce".to_string());
        let seq = u64::from(epoch);
        Err(match code {
            1 => Error::Timeout {
                rank,
                peer,
                collective,
                seq,
                waited_ms: u64::try_from(self.timeout.as_millis()).unwrap_or(u64::MAX),
                what: format!("barrier {epoch} of block {block}, inside the kernel"),
            },
            2 => Error::Aborted {
                rank,
                during: format!(" during {collective} (block {block} waiting for rank {peer})"),
            },
            3 => Error::Mismatch {
                rank,
                peer,
                collective,
                seq,
                detail: "its count, dtype, op, mode or buffers differ from this rank's".into(),
            },
            5 => Error::Internal(format!(
                "device all-reduce on rank {rank}: the kernel refused its launch (fewer threads than \
                 ranks, another world size or a staging half under 16 bytes; block {block})"
            )),
            _ => Error::PeerFailed {
                rank,
                peer,
                collective,
                seq,
                reason: format!("was awaited when another block failed (code {code})"),
            },
        })
    }

    /// Queues an all-reduce of `count` elements of `dtype` from `send` to `recv` (device addresses of
    /// this GPU; equal for in place) on `stream`. When both lie in this rank's heap (at the same offsets
    /// on every rank) it runs without staging. Every rank must call it with the same count, dtype and op
    /// (a difference is caught by the kernel and reported by [`status`](Self::status)).
    ///
    /// # Safety
    /// `send` and `recv` must be valid device memory of this GPU for `count` elements until the kernel
    /// completes on `stream`, written by nothing else meanwhile; the windows must stay mapped as long.
    pub unsafe fn all_reduce(
        &self,
        stream: &Stream,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<(), Error> {
        let bytes = count
            .checked_mul(dtype.size())
            .ok_or_else(|| Error::invalid(format!("{count} elements overflow")))?;
        let (heap, heap_bytes) = self.heap();
        let in_heap = |addr: u64| {
            addr >= heap && (addr - heap) as usize <= heap_bytes && {
                let off = (addr - heap) as usize;
                off.checked_add(bytes).is_some_and(|end| end <= heap_bytes)
            }
        };
        // A failure is sticky: the kernel would return at once, so say why instead.
        self.status()?;
        let symmetric = bytes > SYMMETRIC_MIN_BYTES && in_heap(send) && in_heap(recv);
        let (mode, blocks) = plan(bytes, self.world, symmetric, self.max_blocks);
        let function = self.function(dtype, op)?;
        let mut args = ArArgs {
            send: if symmetric { send - heap } else { send },
            recv: if symmetric { recv - heap } else { recv },
            count: count as u64,
            stage_bytes: self.layout.stage_bytes as u64,
            heap_off: self.layout.heap_offset() as u64,
            timeout_ns: u64::try_from(self.timeout.as_nanos()).unwrap_or(u64::MAX),
            abort_word: self.control_dev + 128,
            status: self.control_dev,
            rank: self.rank as u32,
            world: self.world as u32,
            mode: mode as u32,
            tag: (dtype as u32) << 8 | op as u32,
            ..ArArgs::default()
        };
        args.window[..self.world].copy_from_slice(&self.windows);
        let mut params = [(&mut args as *mut ArArgs).cast::<c_void>()];
        // SAFETY: `function` is a kernel of a module this object keeps loaded, taking one `ArArgs` by
        // value (copied by the driver at launch); the caller vouches for the buffers and windows.
        unsafe {
            crate::driver::launch_raw(
                &self.gpu,
                function as *mut c_void,
                stream,
                blocks,
                THREADS,
                &mut params,
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_header_matches_the_kernel() {
        let src = include_str!("../../../kernels/braid_collective.cuh");
        for (name, value) in [
            ("AR_MAX_RANKS = ", MAX_RANKS),
            ("AR_MAX_BLOCKS = ", MAX_BLOCKS),
        ] {
            assert!(src.contains(&format!("{name}{value},")), "{name}{value}");
        }
        assert!(src.contains(&format!("#define BRAID_AR_THREADS {THREADS}")));
        assert_eq!(HEADER_BYTES, 81920);
        assert_eq!(std::mem::size_of::<ArArgs>(), 8 * 16 + 16);
        assert_eq!(std::mem::offset_of!(ArArgs, rank), 128);
    }

    #[test]
    fn plans_depend_on_the_size_only() {
        assert_eq!(plan(8, 4, false, 64), (Mode::StagedOneShot, 1));
        assert_eq!(plan(1 << 20, 4, false, 64), (Mode::StagedTwoShot, 4));
        assert_eq!(plan(1 << 20, 2, false, 64), (Mode::StagedOneShot, 4));
        assert_eq!(plan(1 << 30, 4, true, 16), (Mode::Symmetric, 16));
        assert_eq!(plan(0, 3, false, 0), (Mode::StagedOneShot, 1));
    }

    #[test]
    fn layouts_round_and_place_the_heap_after_the_staging() {
        let l = WindowLayout::new(1000, 1);
        assert_eq!(l.stage_bytes, 64 << 10);
        assert_eq!(l.heap_bytes, 4096);
        assert_eq!(l.heap_offset(), HEADER_BYTES + 2 * (64 << 10));
        assert_eq!(l.bytes(), l.heap_offset() + 4096);
    }

    #[test]
    fn one_kernel_source_per_dtype_and_op() {
        let s = kernel_source(DType::BF16, ReduceOp::Avg, 3);
        assert!(s.contains("BRAID_AR_KERNEL(bf16, braid::bfloat16_t, avg, 4, 3)"));
        assert_eq!(
            kernel_name(DType::F32, ReduceOp::Sum, 2),
            "braid_ar_f32_sum_w2"
        );
    }
}
