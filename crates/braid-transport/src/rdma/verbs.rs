//! A thin safe layer over libibverbs (through `ibverbs-sys`): devices, protection domains, completion
//! queues and their channel, memory regions, and reliable-connected queue pairs whose states are types
//! (`Qp<Init>` → `Qp<Rtr>` → `Qp<Rts>`), so that a queue pair cannot be used before it is ready.
//!
//! Every object holds what it was made from (`Arc`), so destruction runs in the order verbs requires
//! (queue pairs and memory regions, then completion queues, then the protection domain and the
//! channel, then the device context), whatever order their owners drop them in. libibverbs objects
//! may be used from any thread, which is what makes these wrappers `Send` and `Sync`.
//!
//! `ibv_post_send`, `ibv_post_recv`, `ibv_poll_cq` and `ibv_req_notify_cq` are inline functions in
//! `verbs.h`; they are reached here, as there, through the context's table of provider operations.

use std::ffi::CStr;
use std::marker::PhantomData;
use std::sync::Arc;

use braid_core::Error;
use ibverbs_sys as ffi;

/// An error of verbs call `what`, with the `errno` it left.
fn os_error(what: String) -> Error {
    Error::io(what, std::io::Error::last_os_error())
}

/// A verbs call that returns an errno (0 on success).
fn check(rc: i32, what: impl FnOnce() -> String) -> Result<(), Error> {
    if rc == 0 {
        Ok(())
    } else {
        let e = if rc > 0 {
            std::io::Error::from_raw_os_error(rc)
        } else {
            std::io::Error::last_os_error()
        };
        Err(Error::io(what(), e))
    }
}

/// The RDMA devices this host has, by name (empty when none, or when the verbs library finds no
/// provider).
pub fn device_names() -> Vec<String> {
    let mut n = 0i32;
    // SAFETY: `ibv_get_device_list` returns a null-terminated array (or null) that we free below.
    let list = unsafe { ffi::ibv_get_device_list(&mut n) };
    if list.is_null() {
        return Vec::new();
    }
    let mut names = Vec::new();
    for i in 0..n.max(0) as usize {
        // SAFETY: `i < n` entries are valid device pointers while the list lives.
        let dev = unsafe { *list.add(i) };
        if dev.is_null() {
            break;
        }
        // SAFETY: a device's name is a NUL-terminated string owned by the list.
        let name = unsafe { CStr::from_ptr(ffi::ibv_get_device_name(dev)) };
        names.push(name.to_string_lossy().into_owned());
    }
    // SAFETY: the list came from `ibv_get_device_list` and is freed once.
    unsafe { ffi::ibv_free_device_list(list) };
    names
}

/// An open device.
pub struct Context {
    raw: *mut ffi::ibv_context,
    name: String,
}

// SAFETY: libibverbs contexts are thread-safe; the pointer is owned and freed once, in `Drop`.
unsafe impl Send for Context {}
// SAFETY: as above: every call made through `&Context` is thread-safe in libibverbs.
unsafe impl Sync for Context {}

/// What a port is and can do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortInfo {
    /// The port's number (from 1).
    pub port: u8,
    /// Whether it is `ACTIVE`.
    pub active: bool,
    /// `IBV_MTU_*` the port runs at.
    pub active_mtu: u32,
    /// Its local identifier (InfiniBand).
    pub lid: u16,
    /// Whether the link layer is Ethernet (RoCE) rather than InfiniBand.
    pub ethernet: bool,
    /// Entries in its GID table.
    pub gid_table_len: u32,
}

/// A GID table entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GidEntry {
    /// Its index.
    pub index: u32,
    /// The GID.
    pub gid: [u8; 16],
    /// `IBV_GID_TYPE_*` (IB, RoCE v1, RoCE v2).
    pub gid_type: u32,
}

impl GidEntry {
    /// Whether the GID is RoCE v2.
    pub fn roce_v2(&self) -> bool {
        self.gid_type == ffi::IBV_GID_TYPE_ROCE_V2
    }

    /// Whether the GID is an IPv4 address mapped into IPv6 (`::ffff:a.b.c.d`).
    pub fn ipv4(&self) -> bool {
        self.gid[..10].iter().all(|b| *b == 0) && self.gid[10] == 0xff && self.gid[11] == 0xff
    }

    /// Whether the entry holds a GID at all.
    pub fn is_set(&self) -> bool {
        self.gid.iter().any(|b| *b != 0)
    }
}

impl Context {
    /// Opens the device called `name`.
    pub fn open(name: &str) -> Result<Arc<Context>, Error> {
        let mut n = 0i32;
        // SAFETY: as in `device_names`.
        let list = unsafe { ffi::ibv_get_device_list(&mut n) };
        if list.is_null() {
            return Err(os_error("listing RDMA devices".into()));
        }
        let mut raw = std::ptr::null_mut();
        for i in 0..n.max(0) as usize {
            // SAFETY: `i < n` entries are valid while the list lives.
            let dev = unsafe { *list.add(i) };
            if dev.is_null() {
                break;
            }
            // SAFETY: a NUL-terminated name owned by the list.
            let dn = unsafe { CStr::from_ptr(ffi::ibv_get_device_name(dev)) };
            if dn.to_bytes() == name.as_bytes() {
                // SAFETY: a device of the live list; the context it opens outlives the list.
                raw = unsafe { ffi::ibv_open_device(dev) };
                if raw.is_null() {
                    let e = os_error(format!("opening RDMA device {name}"));
                    // SAFETY: freed once.
                    unsafe { ffi::ibv_free_device_list(list) };
                    return Err(e);
                }
                break;
            }
        }
        // SAFETY: freed once; an open context does not need the list.
        unsafe { ffi::ibv_free_device_list(list) };
        if raw.is_null() {
            return Err(Error::invalid(format!("no RDMA device is called {name}")));
        }
        Ok(Arc::new(Context {
            raw,
            name: name.to_string(),
        }))
    }

    /// The device's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// How many ports the device has.
    pub fn port_count(&self) -> Result<u8, Error> {
        // SAFETY: a plain C struct; all zeroes is a valid value.
        let mut attr: ffi::ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: `raw` is an open context and `attr` is writable.
        let rc = unsafe { ffi::ibv_query_device(self.raw, &mut attr) };
        check(rc, || format!("querying RDMA device {}", self.name))?;
        Ok(attr.phys_port_cnt)
    }

    /// What port `port` is.
    pub fn port(&self, port: u8) -> Result<PortInfo, Error> {
        // SAFETY: a plain C struct; all zeroes is a valid value.
        let mut attr: ffi::ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the exported `ibv_query_port` fills the older, shorter layout, whose fields sit at
        // the same offsets in `ibv_port_attr`; the buffer is the larger of the two.
        let rc = unsafe {
            ffi::ibv_query_port(
                self.raw,
                port,
                (&mut attr as *mut ffi::ibv_port_attr).cast(),
            )
        };
        check(rc, || format!("querying port {port} of {}", self.name))?;
        Ok(PortInfo {
            port,
            active: attr.state == ffi::ibv_port_state::IBV_PORT_ACTIVE,
            active_mtu: attr.active_mtu,
            lid: attr.lid,
            ethernet: u32::from(attr.link_layer) == ffi::IBV_LINK_LAYER_ETHERNET,
            gid_table_len: attr.gid_tbl_len.max(0) as u32,
        })
    }

    /// The GID at `index` of `port`, or `None` where the entry is empty or cannot be read.
    pub fn gid(&self, port: u8, index: u32) -> Option<GidEntry> {
        // SAFETY: a plain C struct; all zeroes is a valid value.
        let mut e: ffi::ibv_gid_entry = unsafe { std::mem::zeroed() };
        // SAFETY: `e` is writable and its size is passed.
        let rc = unsafe {
            ffi::_ibv_query_gid_ex(
                self.raw,
                u32::from(port),
                index,
                &mut e,
                0,
                std::mem::size_of::<ffi::ibv_gid_entry>(),
            )
        };
        if rc != 0 {
            return None;
        }
        // SAFETY: every bit pattern of the union is a valid `[u8; 16]`.
        let gid = unsafe { e.gid.raw };
        let entry = GidEntry {
            index,
            gid,
            gid_type: e.gid_type,
        };
        entry.is_set().then_some(entry)
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: opened once, closed once, after everything made from it (they hold this `Arc`).
        unsafe { ffi::ibv_close_device(self.raw) };
    }
}

/// A protection domain.
pub struct Pd {
    raw: *mut ffi::ibv_pd,
    ctx: Arc<Context>,
}

// SAFETY: as for `Context`.
unsafe impl Send for Pd {}
// SAFETY: as for `Context`.
unsafe impl Sync for Pd {}

impl Pd {
    /// Allocates a protection domain on `ctx`.
    pub fn new(ctx: &Arc<Context>) -> Result<Arc<Pd>, Error> {
        // SAFETY: `ctx` is open.
        let raw = unsafe { ffi::ibv_alloc_pd(ctx.raw) };
        if raw.is_null() {
            return Err(os_error(format!(
                "allocating a protection domain on {}",
                ctx.name
            )));
        }
        Ok(Arc::new(Pd {
            raw,
            ctx: ctx.clone(),
        }))
    }

    /// The device it belongs to.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }
}

impl Drop for Pd {
    fn drop(&mut self) {
        // SAFETY: allocated once, freed once, after its memory regions and queue pairs (which hold it).
        unsafe { ffi::ibv_dealloc_pd(self.raw) };
    }
}

/// A registered memory region over memory it owns (zeroed, page-aligned).
pub struct Mr {
    raw: *mut ffi::ibv_mr,
    mem: *mut u8,
    len: usize,
    /// Whether `mem` was mapped here (and is unmapped with the registration).
    owned: bool,
    _pd: Arc<Pd>,
}

// SAFETY: the registration is thread-safe; the memory is owned and its accesses are governed by the
// link's protocol (the link is used by one thread; the device writes only where peers were told to).
unsafe impl Send for Mr {}
// SAFETY: as above.
unsafe impl Sync for Mr {}

impl Mr {
    /// Allocates `len` zeroed bytes and registers them for local writes and, with `remote_write`,
    /// for peers' RDMA writes.
    pub fn alloc(pd: &Arc<Pd>, len: usize, remote_write: bool) -> Result<Mr, Error> {
        let len = len.max(64);
        // SAFETY: an anonymous private mapping; checked below.
        let mem = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if mem == libc::MAP_FAILED {
            return Err(os_error(format!("allocating {len} bytes for RDMA buffers")));
        }
        let mut access = ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE;
        if remote_write {
            access |= ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE;
        }
        // SAFETY: `mem` is `len` mapped bytes that outlive the registration (unmapped after it in Drop).
        let raw = unsafe { ffi::ibv_reg_mr(pd.raw, mem, len, access.0 as i32) };
        if raw.is_null() {
            let e = os_error(format!(
                "registering {len} bytes with {} (is the locked-memory limit, ulimit -l, too low?)",
                pd.ctx.name
            ));
            // SAFETY: mapped above, unmapped once.
            unsafe { libc::munmap(mem, len) };
            return Err(e);
        }
        Ok(Mr {
            raw,
            mem: mem.cast(),
            len,
            owned: true,
            _pd: pd.clone(),
        })
    }

    /// Registers `len` bytes of the caller's memory at `ptr` for local reads (sends from it).
    ///
    /// # Safety
    /// The memory must stay mapped until the registration drops: the device reads the pages it pinned
    /// now, whatever the address comes to hold later.
    pub unsafe fn register(pd: &Arc<Pd>, ptr: *mut u8, len: usize) -> Result<Mr, Error> {
        // SAFETY: the caller vouches for the memory; registering only pins and maps it for the device.
        let raw = unsafe { ffi::ibv_reg_mr(pd.raw, ptr.cast(), len, 0) };
        if raw.is_null() {
            return Err(os_error(format!(
                "registering {len} bytes of caller memory with {} (is the locked-memory limit, \
                 ulimit -l, too low?)",
                pd.ctx.name
            )));
        }
        Ok(Mr {
            raw,
            mem: ptr,
            len,
            owned: false,
            _pd: pd.clone(),
        })
    }

    /// The first byte.
    pub fn ptr(&self) -> *mut u8 {
        self.mem
    }

    /// Its length.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty (never: at least 64 bytes are allocated).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The address peers write to.
    pub fn addr(&self) -> u64 {
        self.mem as u64
    }

    /// The local key.
    pub fn lkey(&self) -> u32 {
        // SAFETY: `raw` is a live registration.
        unsafe { (*self.raw).lkey }
    }

    /// The remote key.
    pub fn rkey(&self) -> u32 {
        // SAFETY: `raw` is a live registration.
        unsafe { (*self.raw).rkey }
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: registered once and deregistered once, before the memory it covers is unmapped
        // (memory mapped here; the caller's stays the caller's).
        unsafe {
            ffi::ibv_dereg_mr(self.raw);
            if self.owned {
                libc::munmap(self.mem.cast(), self.len);
            }
        }
    }
}

/// A completion channel: a file descriptor that turns readable when an armed completion queue has a
/// new completion.
pub struct Channel {
    raw: *mut ffi::ibv_comp_channel,
    _ctx: Arc<Context>,
}

// SAFETY: as for `Context`.
unsafe impl Send for Channel {}
// SAFETY: as for `Context`.
unsafe impl Sync for Channel {}

impl Channel {
    /// Creates a channel on `ctx`, its descriptor non-blocking.
    pub fn new(ctx: &Arc<Context>) -> Result<Arc<Channel>, Error> {
        // SAFETY: `ctx` is open.
        let raw = unsafe { ffi::ibv_create_comp_channel(ctx.raw) };
        if raw.is_null() {
            return Err(os_error(format!(
                "creating a completion channel on {}",
                ctx.name
            )));
        }
        let ch = Arc::new(Channel {
            raw,
            _ctx: ctx.clone(),
        });
        let fd = ch.fd();
        // SAFETY: `fd` is the channel's open descriptor.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        // SAFETY: as above.
        if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
            return Err(os_error("making a completion channel non-blocking".into()));
        }
        Ok(ch)
    }

    /// Its descriptor.
    pub fn fd(&self) -> i32 {
        // SAFETY: `raw` is a live channel.
        unsafe { (*self.raw).fd }
    }

    /// Takes one pending event, if any (the descriptor is non-blocking), and returns whether there was
    /// one. The caller acknowledges it on its queue with [`Cq::ack_events`].
    pub fn take_event(&self) -> bool {
        let mut cq = std::ptr::null_mut();
        let mut cq_ctx = std::ptr::null_mut();
        // SAFETY: `raw` is live; on a non-blocking descriptor this returns -1 when nothing is pending.
        unsafe { ffi::ibv_get_cq_event(self.raw, &mut cq, &mut cq_ctx) == 0 }
    }
}

impl Drop for Channel {
    fn drop(&mut self) {
        // SAFETY: created once, destroyed once, after the queues bound to it (they hold it).
        unsafe { ffi::ibv_destroy_comp_channel(self.raw) };
    }
}

/// A completion queue.
pub struct Cq {
    raw: *mut ffi::ibv_cq,
    ctx: Arc<Context>,
    _channel: Arc<Channel>,
}

// SAFETY: as for `Context`.
unsafe impl Send for Cq {}
// SAFETY: as for `Context`.
unsafe impl Sync for Cq {}

/// One work completion, as this layer reports it.
#[derive(Clone, Copy, Debug)]
pub struct Completion {
    /// The work request's id.
    pub wr_id: u64,
    /// `None` on success, else the status's name and the vendor syndrome.
    pub error: Option<(&'static str, u32)>,
    /// Whether it completes a receive (an incoming write with immediate, or a send).
    pub recv: bool,
    /// The immediate data (host order), for a receive that carried one.
    pub imm: Option<u32>,
    /// Bytes received.
    pub len: u32,
}

/// What a work completion status means.
pub fn status_name(status: u32) -> &'static str {
    use ffi::ibv_wc_status as S;
    match status {
        S::IBV_WC_SUCCESS => "success",
        S::IBV_WC_LOC_LEN_ERR => "local length error",
        S::IBV_WC_LOC_QP_OP_ERR => "local QP operation error",
        S::IBV_WC_LOC_PROT_ERR => "local protection error",
        S::IBV_WC_WR_FLUSH_ERR => "work request flushed (queue pair in error)",
        S::IBV_WC_REM_ACCESS_ERR => "remote access error (bad key or address)",
        S::IBV_WC_REM_INV_REQ_ERR => "remote invalid request error",
        S::IBV_WC_REM_OP_ERR => "remote operation error",
        S::IBV_WC_RETRY_EXC_ERR => "transport retry counter exceeded (peer unreachable or gone)",
        S::IBV_WC_RNR_RETRY_EXC_ERR => "receiver-not-ready retries exceeded",
        S::IBV_WC_LOC_ACCESS_ERR => "local access error",
        S::IBV_WC_FATAL_ERR => "fatal error",
        _ => "error",
    }
}

impl Cq {
    /// Creates a queue of at least `entries` completions, reporting to `channel`.
    pub fn new(ctx: &Arc<Context>, channel: &Arc<Channel>, entries: u32) -> Result<Arc<Cq>, Error> {
        let entries = entries.clamp(1, i32::MAX as u32) as i32;
        // SAFETY: `ctx` and `channel` are live and of the same device.
        let raw =
            unsafe { ffi::ibv_create_cq(ctx.raw, entries, std::ptr::null_mut(), channel.raw, 0) };
        if raw.is_null() {
            return Err(os_error(format!(
                "creating a completion queue of {entries} entries on {}",
                ctx.name
            )));
        }
        Ok(Arc::new(Cq {
            raw,
            ctx: ctx.clone(),
            _channel: channel.clone(),
        }))
    }

    /// Moves up to `out.len()` completions into `out`; returns how many.
    pub fn poll(&self, out: &mut Vec<Completion>, max: usize) -> Result<usize, Error> {
        const BATCH: usize = 32;
        let mut wc = [ffi::ibv_wc::default(); BATCH];
        // SAFETY: `ctx.raw` is open; its provider table is set by the library.
        let poll = unsafe { (*self.ctx.raw).ops.poll_cq };
        let Some(poll) = poll else {
            return Err(Error::Internal("the RDMA provider has no poll_cq".into()));
        };
        let want = max.min(BATCH) as i32;
        // SAFETY: `raw` is live and `wc` holds `want` entries.
        let n = unsafe { poll(self.raw, want, wc.as_mut_ptr()) };
        if n < 0 {
            return Err(Error::Internal(format!(
                "polling a completion queue of {} failed",
                self.ctx.name
            )));
        }
        for w in &wc[..n as usize] {
            let op = w.opcode();
            let error = w.error().map(|(s, vendor)| (status_name(s), vendor));
            out.push(Completion {
                wr_id: w.wr_id(),
                error,
                recv: error.is_none()
                    && (op == ffi::ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM
                        || op == ffi::ibv_wc_opcode::IBV_WC_RECV),
                imm: if error.is_none() {
                    w.imm_data().map(u32::from_be)
                } else {
                    None
                },
                len: w.len() as u32,
            });
        }
        Ok(n as usize)
    }

    /// Asks for an event on the channel at the next completion.
    pub fn arm(&self) -> Result<(), Error> {
        // SAFETY: `ctx.raw` is open; its provider table is set by the library.
        let Some(notify) = (unsafe { (*self.ctx.raw).ops.req_notify_cq }) else {
            return Err(Error::Internal(
                "the RDMA provider has no req_notify_cq".into(),
            ));
        };
        // SAFETY: `raw` is live.
        check(unsafe { notify(self.raw, 0) }, || {
            "arming a completion queue".into()
        })
    }

    /// Acknowledges `n` events taken from the channel.
    pub fn ack_events(&self, n: u32) {
        if n > 0 {
            // SAFETY: `raw` is live; `n` events were taken for it.
            unsafe { ffi::ibv_ack_cq_events(self.raw, n) };
        }
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: created once, destroyed once, after the queue pairs that use it (they hold it).
        unsafe { ffi::ibv_destroy_cq(self.raw) };
    }
}

/// Queue pair state: created and moved to INIT (receives may be posted).
pub struct Init;
/// Queue pair state: ready to receive.
pub struct Rtr;
/// Queue pair state: ready to send.
pub struct Rts;

/// How many work requests a queue pair holds.
#[derive(Clone, Copy, Debug)]
pub struct QpCaps {
    /// Send queue depth.
    pub send: u32,
    /// Receive queue depth.
    pub recv: u32,
    /// Bytes a send may carry inline (a request; the device may grant less or more).
    pub inline: u32,
}

/// The far end of a queue pair, as its owner published it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Remote {
    /// Its queue pair number.
    pub qpn: u32,
    /// Its first packet sequence number.
    pub psn: u32,
    /// Its port's GID.
    pub gid: [u8; 16],
    /// Its port's LID (InfiniBand).
    pub lid: u16,
    /// `IBV_MTU_*` it runs at.
    pub mtu: u32,
}

/// How a connection travels.
#[derive(Clone, Copy, Debug)]
pub struct PathOpts {
    /// The local port.
    pub port: u8,
    /// The local GID index.
    pub gid_index: u8,
    /// Whether to route by GID (RoCE always; InfiniBand across subnets).
    pub global: bool,
    /// `IBV_MTU_*` for the path (the smaller of both ends').
    pub mtu: u32,
    /// Traffic class (RoCE: DSCP and ECN bits).
    pub traffic_class: u8,
    /// Local ACK timeout exponent: 4.096 µs × 2^timeout.
    pub timeout: u8,
    /// Transport retries before the queue pair fails.
    pub retry_cnt: u8,
}

/// A reliable-connected queue pair in state `S`.
pub struct Qp<S> {
    raw: *mut ffi::ibv_qp,
    ctx: Arc<Context>,
    inline: u32,
    _pd: Arc<Pd>,
    _cq: Arc<Cq>,
    _state: PhantomData<S>,
}

// SAFETY: as for `Context`: posting and modifying are thread-safe in libibverbs.
unsafe impl<S> Send for Qp<S> {}
// SAFETY: as above.
unsafe impl<S> Sync for Qp<S> {}

impl<S> Qp<S> {
    /// Its number.
    pub fn qpn(&self) -> u32 {
        // SAFETY: `raw` is live.
        unsafe { (*self.raw).qp_num }
    }

    /// Bytes a send may carry inline.
    pub fn max_inline(&self) -> u32 {
        self.inline
    }

    fn modify(
        &self,
        attr: &mut ffi::ibv_qp_attr,
        mask: ffi::ibv_qp_attr_mask,
        to: &str,
    ) -> Result<(), Error> {
        // SAFETY: `raw` is live and `attr` is a valid attribute block for `mask`.
        let rc = unsafe { ffi::ibv_modify_qp(self.raw, attr, mask.0 as i32) };
        check(rc, || format!("moving queue pair {} to {to}", self.qpn()))
    }

    fn into_state<T>(self) -> Qp<T> {
        let me = std::mem::ManuallyDrop::new(self);
        // SAFETY: every field is moved out exactly once and `me` is not dropped.
        unsafe {
            Qp {
                raw: me.raw,
                ctx: std::ptr::read(&me.ctx),
                inline: me.inline,
                _pd: std::ptr::read(&me._pd),
                _cq: std::ptr::read(&me._cq),
                _state: PhantomData,
            }
        }
    }

    /// Moves the queue pair to the error state: outstanding work is flushed and the peer's next
    /// request fails. Used to fail a link on abort.
    pub fn set_error(&self) {
        // SAFETY: a plain C struct; all zeroes is a valid value.
        let mut attr: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ffi::ibv_qp_state::IBV_QPS_ERR;
        let _ = self.modify(
            &mut attr,
            ffi::ibv_qp_attr_mask::IBV_QP_STATE,
            "the error state",
        );
    }
}

impl<S> Drop for Qp<S> {
    fn drop(&mut self) {
        // SAFETY: created once, destroyed once.
        unsafe { ffi::ibv_destroy_qp(self.raw) };
    }
}

impl Qp<Init> {
    /// Creates a queue pair whose sends and receives complete on `cq`, and moves it to INIT on
    /// `port` with remote writes allowed.
    pub fn create(pd: &Arc<Pd>, cq: &Arc<Cq>, caps: QpCaps, port: u8) -> Result<Qp<Init>, Error> {
        // SAFETY: a plain C struct; all zeroes is a valid value.
        let mut init: ffi::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = cq.raw;
        init.recv_cq = cq.raw;
        init.cap.max_send_wr = caps.send;
        init.cap.max_recv_wr = caps.recv;
        // Two: a slot's header from the staging ring, its payload from the caller's memory.
        init.cap.max_send_sge = 2;
        init.cap.max_recv_sge = 1;
        init.cap.max_inline_data = caps.inline;
        init.qp_type = ffi::ibv_qp_type::IBV_QPT_RC;
        // SAFETY: `pd` and `cq` are live and of one device; `init` is filled in.
        let mut raw = unsafe { ffi::ibv_create_qp(pd.raw, &mut init) };
        if raw.is_null() && caps.inline > 0 {
            // Some devices take no inline data at all.
            init.cap.max_inline_data = 0;
            // SAFETY: as above.
            raw = unsafe { ffi::ibv_create_qp(pd.raw, &mut init) };
        }
        if raw.is_null() {
            return Err(os_error(format!(
                "creating a queue pair on {} ({} send, {} receive requests)",
                pd.ctx.name, caps.send, caps.recv
            )));
        }
        let qp = Qp {
            raw,
            ctx: pd.ctx.clone(),
            inline: init.cap.max_inline_data,
            _pd: pd.clone(),
            _cq: cq.clone(),
            _state: PhantomData,
        };
        // SAFETY: a plain C struct; all zeroes is a valid value.
        let mut attr: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ffi::ibv_qp_state::IBV_QPS_INIT;
        attr.pkey_index = 0;
        attr.port_num = port;
        attr.qp_access_flags = (ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
            | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE)
            .0;
        use ffi::ibv_qp_attr_mask as M;
        qp.modify(
            &mut attr,
            M::IBV_QP_STATE | M::IBV_QP_PKEY_INDEX | M::IBV_QP_PORT | M::IBV_QP_ACCESS_FLAGS,
            "INIT",
        )?;
        Ok(qp)
    }

    /// Connects to `remote` and moves to RTR (ready to receive).
    pub fn ready_to_receive(self, remote: &Remote, path: &PathOpts) -> Result<Qp<Rtr>, Error> {
        // SAFETY: a plain C struct; all zeroes is a valid value.
        let mut attr: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ffi::ibv_qp_state::IBV_QPS_RTR;
        attr.path_mtu = path.mtu;
        attr.dest_qp_num = remote.qpn;
        attr.rq_psn = remote.psn;
        attr.max_dest_rd_atomic = 1;
        attr.min_rnr_timer = 12;
        attr.ah_attr.dlid = remote.lid;
        attr.ah_attr.sl = 0;
        attr.ah_attr.src_path_bits = 0;
        attr.ah_attr.port_num = path.port;
        if path.global {
            attr.ah_attr.is_global = 1;
            attr.ah_attr.grh.dgid = ffi::ibv_gid { raw: remote.gid };
            attr.ah_attr.grh.sgid_index = path.gid_index;
            attr.ah_attr.grh.hop_limit = 255;
            attr.ah_attr.grh.traffic_class = path.traffic_class;
        }
        use ffi::ibv_qp_attr_mask as M;
        self.modify(
            &mut attr,
            M::IBV_QP_STATE
                | M::IBV_QP_AV
                | M::IBV_QP_PATH_MTU
                | M::IBV_QP_DEST_QPN
                | M::IBV_QP_RQ_PSN
                | M::IBV_QP_MAX_DEST_RD_ATOMIC
                | M::IBV_QP_MIN_RNR_TIMER,
            "RTR",
        )?;
        Ok(self.into_state())
    }
}

impl Qp<Rtr> {
    /// Moves to RTS (ready to send), starting at packet sequence number `psn`.
    pub fn ready_to_send(self, psn: u32, path: &PathOpts) -> Result<Qp<Rts>, Error> {
        // SAFETY: a plain C struct; all zeroes is a valid value.
        let mut attr: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ffi::ibv_qp_state::IBV_QPS_RTS;
        attr.sq_psn = psn;
        attr.timeout = path.timeout;
        attr.retry_cnt = path.retry_cnt;
        // 7: retry forever while the receiver has no receive posted (it reposts as it polls).
        attr.rnr_retry = 7;
        attr.max_rd_atomic = 1;
        use ffi::ibv_qp_attr_mask as M;
        self.modify(
            &mut attr,
            M::IBV_QP_STATE
                | M::IBV_QP_SQ_PSN
                | M::IBV_QP_TIMEOUT
                | M::IBV_QP_RETRY_CNT
                | M::IBV_QP_RNR_RETRY
                | M::IBV_QP_MAX_QP_RD_ATOMIC,
            "RTS",
        )?;
        Ok(self.into_state())
    }
}

/// Queue pair states that take receives.
pub trait Receives {}
impl Receives for Init {}
impl Receives for Rtr {}
impl Receives for Rts {}

impl<S: Receives> Qp<S> {
    /// Posts a receive of up to `sge.1` bytes at `sge.0` (key `sge.2`), or with no buffer (enough for
    /// a write with immediate).
    pub fn post_recv(&self, wr_id: u64, sge: Option<(u64, u32, u32)>) -> Result<(), Error> {
        let mut list = sge.map(|(addr, length, lkey)| ffi::ibv_sge { addr, length, lkey });
        let mut wr = ffi::ibv_recv_wr {
            wr_id,
            next: std::ptr::null_mut(),
            sg_list: list
                .as_mut()
                .map_or(std::ptr::null_mut(), |s| s as *mut ffi::ibv_sge),
            num_sge: i32::from(list.is_some()),
        };
        let mut bad = std::ptr::null_mut();
        // SAFETY: `ctx.raw` is open; its provider table is set by the library.
        let Some(post) = (unsafe { (*self.ctx.raw).ops.post_recv }) else {
            return Err(Error::Internal("the RDMA provider has no post_recv".into()));
        };
        // SAFETY: `raw` is live; `wr` and its list live across the call (the provider copies them).
        let rc = unsafe { post(self.raw, &mut wr, &mut bad) };
        check(rc, || {
            format!("posting a receive on queue pair {}", self.qpn())
        })
    }
}

/// One RDMA write to post.
#[derive(Clone, Copy, Debug)]
pub struct Write {
    /// The work request's id (its completion carries it).
    pub wr_id: u64,
    /// Local bytes: address, length, local key; gathered in order into one remote range.
    pub local: [(u64, u32, u32); 2],
    /// How many of `local` are used (0 to 2).
    pub pieces: usize,
    /// Remote address and key.
    pub remote: (u64, u32),
    /// Immediate data (host order) for the receiver's completion, if any.
    pub imm: Option<u32>,
    /// Whether its completion is reported.
    pub signaled: bool,
    /// Whether the bytes go inline (copied at post time; at most [`Qp::max_inline`]).
    pub inline: bool,
}

impl Qp<Rts> {
    /// Posts one RDMA write (with immediate when `w.imm` is set).
    pub fn post_write(&self, w: &Write) -> Result<(), Error> {
        let mut sge = w
            .local
            .map(|(addr, length, lkey)| ffi::ibv_sge { addr, length, lkey });
        // SAFETY: a plain C struct; all zeroes is a valid value.
        let mut wr: ffi::ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = w.wr_id;
        wr.sg_list = sge.as_mut_ptr();
        wr.num_sge = w.pieces.min(2) as i32;
        wr.opcode = match w.imm {
            Some(imm) => {
                wr.__bindgen_anon_1.imm_data = imm.to_be();
                ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM
            }
            None => ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE,
        };
        let mut flags = ffi::ibv_send_flags(0);
        if w.signaled {
            flags |= ffi::ibv_send_flags::IBV_SEND_SIGNALED;
        }
        if w.inline {
            flags |= ffi::ibv_send_flags::IBV_SEND_INLINE;
        }
        wr.send_flags = flags.0;
        wr.wr.rdma = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 {
            remote_addr: w.remote.0,
            rkey: w.remote.1,
        };
        self.post(&mut wr)
    }

    /// Posts a send of local bytes into the peer's next posted receive.
    pub fn post_send(&self, wr_id: u64, local: (u64, u32, u32)) -> Result<(), Error> {
        let mut sge = ffi::ibv_sge {
            addr: local.0,
            length: local.1,
            lkey: local.2,
        };
        // SAFETY: a plain C struct; all zeroes is a valid value.
        let mut wr: ffi::ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        wr.opcode = ffi::ibv_wr_opcode::IBV_WR_SEND;
        wr.send_flags = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
        self.post(&mut wr)
    }

    fn post(&self, wr: &mut ffi::ibv_send_wr) -> Result<(), Error> {
        let mut bad = std::ptr::null_mut();
        // SAFETY: `ctx.raw` is open; its provider table is set by the library.
        let Some(post) = (unsafe { (*self.ctx.raw).ops.post_send }) else {
            return Err(Error::Internal("the RDMA provider has no post_send".into()));
        };
        // SAFETY: `raw` is live; `wr` and its scatter list live across the call (the provider copies
        // them; inline bytes are copied too, other bytes stay registered until the completion).
        let rc = unsafe { post(self.raw, wr, &mut bad) };
        check(rc, || {
            format!("posting a write on queue pair {}", self.qpn())
        })
    }
}
