//! The fingerprint ranks compare before a collective when debug checks are on.

use braid_sched::Collective;

/// What a rank is about to run, compared across ranks when `BRAID_DEBUG_CHECKS` is on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fingerprint {
    /// Collective code: [`Collective::index`] (0 all_reduce, 1 reduce_scatter, 2 all_gather, 3 broadcast,
    /// 4 reduce, 5 barrier, 6 all_to_all).
    pub kind: u8,
    /// Element type code.
    pub dtype: u8,
    /// Reduction code.
    pub redop: u8,
    /// Root rank (0 where there is none).
    pub root: u32,
    /// Sequence number on the communicator.
    pub seq: u64,
    /// Element count (NCCL convention).
    pub count: u64,
}

const DTYPE_NAMES: [&str; 10] = [
    "int8", "uint8", "int32", "uint32", "int64", "uint64", "half", "float", "double", "bfloat16",
];
const OP_NAMES: [&str; 8] = ["sum", "prod", "max", "min", "avg", "band", "bor", "bxor"];

impl Fingerprint {
    /// Encoded size in bytes.
    pub const LEN: usize = 24;

    /// Fixed little-endian layout.
    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[0] = self.kind;
        b[1] = self.dtype;
        b[2] = self.redop;
        b[4..8].copy_from_slice(&self.root.to_le_bytes());
        b[8..16].copy_from_slice(&self.seq.to_le_bytes());
        b[16..24].copy_from_slice(&self.count.to_le_bytes());
        b
    }

    /// Decodes a fingerprint a peer wrote into shared memory, checking length and codes.
    pub fn decode(b: &[u8]) -> Result<Fingerprint, String> {
        if b.len() != Self::LEN {
            return Err(format!(
                "fingerprint of {} bytes, expected {}",
                b.len(),
                Self::LEN
            ));
        }
        if b[3] != 0 {
            return Err("fingerprint with a non-zero reserved byte".into());
        }
        let f = Fingerprint {
            kind: b[0],
            dtype: b[1],
            redop: b[2],
            root: u32::from_le_bytes(b[4..8].try_into().expect("4 bytes")),
            seq: u64::from_le_bytes(b[8..16].try_into().expect("8 bytes")),
            count: u64::from_le_bytes(b[16..24].try_into().expect("8 bytes")),
        };
        if f.kind as usize >= Collective::ALL.len()
            || f.dtype as usize >= DTYPE_NAMES.len()
            || f.redop as usize >= OP_NAMES.len()
        {
            return Err(format!(
                "fingerprint with unknown codes {}/{}/{}",
                f.kind, f.dtype, f.redop
            ));
        }
        Ok(f)
    }
}

impl std::fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        fn name(t: &[&'static str], i: u8) -> &'static str {
            t.get(i as usize).copied().unwrap_or("?")
        }
        let coll = Collective::ALL.get(self.kind as usize).copied();
        write!(
            f,
            "{} #{} count {} {}",
            coll.map_or("?", Collective::name),
            self.seq,
            self.count,
            name(&DTYPE_NAMES, self.dtype)
        )?;
        match coll {
            Some(Collective::AllReduce | Collective::ReduceScatter) => {
                write!(f, " {}", name(&OP_NAMES, self.redop))
            }
            Some(Collective::Broadcast) => write!(f, " root {}", self.root),
            Some(Collective::Reduce) => {
                write!(f, " {} root {}", name(&OP_NAMES, self.redop), self.root)
            }
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_name_tables_follow_the_codes() {
        for o in braid_core::ReduceOp::ALL {
            assert_eq!(OP_NAMES[o as usize], o.name());
        }
        assert_eq!(OP_NAMES.len(), braid_core::ReduceOp::ALL.len());
        for d in braid_core::DType::ALL {
            assert_eq!(DTYPE_NAMES[d as usize], d.name());
        }
    }

    proptest! {
        #[test]
        fn fingerprints_round_trip_and_garbage_is_refused(kind in 0u8..7, dtype in 0u8..10, redop in 0u8..5,
            root in any::<u32>(), seq in any::<u64>(), count in any::<u64>(), junk in prop::collection::vec(any::<u8>(), 0..40)) {
            let f = Fingerprint { kind, dtype, redop, root, seq, count };
            prop_assert_eq!(Fingerprint::decode(&f.encode()), Ok(f));
            let _ = Fingerprint::decode(&junk);
        }
    }
}
