//! Inputs whose reduction is exact whatever the order, as nccl-tests uses them, so that a benchmark or a
//! test can count wrong elements without tolerances: small integers (exact in every float type, including
//! bf16 for up to 16 ranks) and, for prod, 1 or 2 (products are powers of two).

use crate::reduce::{reduce_ordered, Src};
use crate::{DType, ReduceOp};

/// Element `i` of rank `rank`'s input.
pub fn value(op: ReduceOp, i: usize, rank: usize) -> f64 {
    if op == ReduceOp::Prod {
        1.0 + ((i + rank) % 2) as f64
    } else {
        ((i * 7 + rank * 3) % 17) as f64
    }
}

/// Fills `buf` (whole elements of `dtype`) with rank `rank`'s input.
pub fn fill(buf: &mut [u8], dtype: DType, op: ReduceOp, rank: usize) {
    for (i, e) in buf.chunks_exact_mut(dtype.size()).enumerate() {
        let v = value(op, i, rank);
        match dtype {
            DType::I8 => e.copy_from_slice(&(v as i8).to_ne_bytes()),
            DType::U8 => e.copy_from_slice(&(v as u8).to_ne_bytes()),
            DType::I32 => e.copy_from_slice(&(v as i32).to_ne_bytes()),
            DType::U32 => e.copy_from_slice(&(v as u32).to_ne_bytes()),
            DType::I64 => e.copy_from_slice(&(v as i64).to_ne_bytes()),
            DType::U64 => e.copy_from_slice(&(v as u64).to_ne_bytes()),
            DType::F16 => e.copy_from_slice(&half::f16::from_f64(v).to_ne_bytes()),
            DType::BF16 => e.copy_from_slice(&half::bf16::from_f64(v).to_ne_bytes()),
            DType::F32 => e.copy_from_slice(&(v as f32).to_ne_bytes()),
            DType::F64 => e.copy_from_slice(&v.to_ne_bytes()),
        }
    }
}

/// Every rank's input of `bytes` bytes.
pub fn inputs(bytes: usize, dtype: DType, op: ReduceOp, world: usize) -> Vec<Vec<u8>> {
    (0..world)
        .map(|r| {
            let mut b = vec![0u8; bytes];
            fill(&mut b, dtype, op, r);
            b
        })
        .collect()
}

/// The reduction of `inputs` in rank order (any order gives the same bits for these inputs).
pub fn reduced(inputs: &[Vec<u8>], dtype: DType, op: ReduceOp) -> Vec<u8> {
    let mut out = vec![0u8; inputs.first().map_or(0, |b| b.len())];
    let srcs: Vec<Src> = inputs.iter().map(|b| Src::Buf(b)).collect();
    reduce_ordered(dtype, op, &mut out, &srcs);
    out
}

/// The all-reduce result of `world` ranks' inputs of `bytes` bytes.
pub fn expected(bytes: usize, dtype: DType, op: ReduceOp, world: usize) -> Vec<u8> {
    reduced(&inputs(bytes, dtype, op, world), dtype, op)
}

/// How many elements of `got` differ from `want` (a missing element counts as wrong).
pub fn wrong(got: &[u8], want: &[u8], elem: usize) -> u64 {
    let n = got.len().max(want.len()).div_ceil(elem.max(1));
    let same = got
        .chunks(elem)
        .zip(want.chunks(elem))
        .filter(|(a, b)| a == b)
        .count();
    (n - same) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expected_values_are_exact_sums_and_wrong_counts_elements() {
        let want = expected(4 * 3, DType::F32, ReduceOp::Sum, 2);
        let vals: Vec<f32> = want
            .chunks_exact(4)
            .map(|b| f32::from_ne_bytes(b.try_into().unwrap()))
            .collect();
        // Element i of rank r is (7i + 3r) mod 17: [0, 7, 14] + [3, 10, 0].
        assert_eq!(vals, vec![3.0, 17.0, 14.0]);
        let mut bad = want.clone();
        bad[5] ^= 1;
        assert_eq!(wrong(&bad, &want, 4), 1);
        assert_eq!(wrong(&want[..8], &want, 4), 1);
    }
}
