//! The shared memory of one communicator (every rank's board and every allocation) and where a
//! buffer lies in it: a [`Place`] in an allocation, and that place as an address in this process.

use std::sync::Arc;

use braid_transport::shm::window::{Board, Window};
use braid_transport::{Span, WaitPolicy};

use crate::call::{Call, Kind};

/// One allocation as this rank sees it.
pub(super) struct Allocation {
    /// This rank's window, also held by its [`SharedBuffer`](super::SharedBuffer) until that is
    /// dropped (then it stays mapped, so its addresses are never reused under this table, but takes no
    /// collectives).
    pub(super) own: Arc<Window>,
    /// Every rank's window, as (address here, bytes); the peers' mappings are kept in `maps`.
    pub(super) places: Vec<(usize, usize)>,
    #[allow(dead_code)]
    pub(super) maps: Vec<Window>,
}

/// The shared memory of one communicator: every rank's board and every allocation.
pub(crate) struct Shared {
    pub(super) rank: usize,
    /// Every rank's board; this rank's is also marked failed when the communicator fails.
    pub(super) boards: Vec<Arc<Board>>,
    pub(super) allocations: Vec<Allocation>,
    pub(super) policy: WaitPolicy,
    /// Per stream, the counter's value after the last collective on shared buffers, and how many
    /// such collectives have run (their parity picks the descriptor and inline area).
    pub(super) next: Vec<(u32, u64)>,
}

impl Shared {
    pub(super) fn world(&self) -> usize {
        self.boards.len()
    }

    pub(super) fn own(&self) -> &Board {
        &self.boards[self.rank]
    }

    /// Rank `p`'s buffer `place` as an address here, when it lies inside `p`'s allocation and is
    /// `len` bytes long (an empty one resolves to 0).
    pub(super) fn resolve(&self, p: usize, place: Place, len: usize) -> Option<usize> {
        if len == 0 {
            return (place.len == 0).then_some(0);
        }
        let a = self.allocations.get(usize::try_from(place.alloc).ok()?)?;
        let (base, size) = *a.places.get(p)?;
        let off = usize::try_from(place.offset).ok()?;
        (place.len == len as u64 && off.checked_add(len)? <= size).then_some(base + off)
    }

    /// Where `span` lies in this rank's allocations (`None` if not in one).
    pub(super) fn place(&self, span: &Span) -> Option<Place> {
        if span.is_empty() {
            return Some(Place::NONE);
        }
        span.host_ptr()?;
        self.allocations.iter().enumerate().find_map(|(i, a)| {
            if Arc::strong_count(&a.own) < 2 {
                return None;
            }
            let off = a.own.offset_of(span.addr(), span.len())?;
            Some(Place {
                alloc: i as u64,
                offset: off as u64,
                len: span.len() as u64,
            })
        })
    }

    /// Where `op`'s input and output lie, when its kind takes the shared path and both are shared.
    pub(super) fn places(&self, op: &Call) -> Option<(Place, Place)> {
        if self.world() < 2 || op.count == 0 || op.has_blocks() {
            return None;
        }
        if matches!(op.kind, Kind::Barrier | Kind::AllToAll) {
            return None;
        }
        let (send, recv) = op.spans();
        Some((self.place(&send)?, self.place(&recv)?))
    }
}

/// A buffer as a descriptor names it: which allocation, where in it, how long (`u64::MAX` for none).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Place {
    pub alloc: u64,
    pub offset: u64,
    pub len: u64,
}

impl Place {
    pub(super) const NONE: Place = Place {
        alloc: u64::MAX,
        offset: 0,
        len: 0,
    };
}
