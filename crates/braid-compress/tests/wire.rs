//! The byte encoding: golden bytes, canonical round trips, and validation of hostile input.

mod common;

use braid_compress::mx::MxElement;
use braid_compress::wire::HEADER_BYTES;
use braid_compress::{Codec, Compressed, Error, Layout, Mx, Payload, Piece, PowerSgd};
use common::{all_codecs, grad};
use half::{bf16, f16};
use proptest::prelude::*;

fn header(kind: u8, len: u64) -> Vec<u8> {
    let mut b = vec![b'B', b'C', 1, kind];
    b.extend_from_slice(&len.to_le_bytes());
    b
}

fn le32(b: &mut Vec<u8>, v: u32) {
    b.extend_from_slice(&v.to_le_bytes());
}

fn malformed(bytes: &[u8]) -> (usize, String) {
    match Compressed::decode(bytes) {
        Err(Error::Malformed { offset, detail }) => (offset, detail),
        other => panic!("expected a malformed-input error, got {other:?}"),
    }
}

/// Valid encodings of every codec's output for a gradient of `len` elements, and of per-layer PowerSGD
/// over a layout of that length (matrices, a 1-D tensor, a matrix too small to factorise).
fn valid_encodings(seed: u64, len: usize) -> Vec<Vec<u8>> {
    let x = grad(seed, len);
    let mut out: Vec<Vec<u8>> = all_codecs(seed)
        .iter_mut()
        .map(|c| c.compress(&x, seed).encode())
        .collect();
    let (big, rest) = (len / 24, len % 24);
    let mut shapes = vec![vec![4, 6]; big];
    match rest {
        0 => {}
        1 => shapes.push(vec![1]),
        _ => shapes.extend([vec![1, 1], vec![rest - 1]]),
    }
    let layout = Layout::new(&shapes, len).unwrap();
    let mut layered = PowerSgd::new(2, seed).unwrap().with_layout(layout);
    out.push(layered.compress(&x, seed).encode());
    out
}

proptest! {
    #[test]
    fn decode_never_panics_on_random_bytes(bytes in prop::collection::vec(any::<u8>(), 0..300)) {
        if let Ok(c) = Compressed::decode(&bytes) {
            prop_assert_eq!(c.encode(), bytes);
        }
    }

    #[test]
    fn decode_never_panics_on_random_bodies(
        kind in 0u8..10,
        len in prop_oneof![0u64..64, any::<u64>()],
        body in prop::collection::vec(any::<u8>(), 0..300),
    ) {
        let mut bytes = header(kind, len);
        bytes.extend_from_slice(&body);
        if let Ok(c) = Compressed::decode(&bytes) {
            prop_assert_eq!(c.encode(), bytes.clone());
            // Sparse kinds can describe huge tensors in a few bytes; only expand the small ones.
            if c.len() <= 1 << 16 {
                let mut out = vec![0.0; c.len()];
                c.decompress(&mut out).unwrap();
            }
        }
    }

    #[test]
    fn decode_never_panics_on_mutated_encodings(
        seed in any::<u64>(),
        len in 0usize..40,
        which in any::<prop::sample::Index>(),
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
        cut in prop::option::of(any::<prop::sample::Index>()),
        extra in prop::collection::vec(any::<u8>(), 0..3),
    ) {
        let all = valid_encodings(seed, len);
        let mut bytes = all[which.index(all.len())].clone();
        for (at, v) in edits {
            let i = at.index(bytes.len());
            bytes[i] = v;
        }
        if let Some(c) = cut {
            bytes.truncate(c.index(bytes.len() + 1));
        }
        bytes.extend_from_slice(&extra);
        if let Ok(c) = Compressed::decode(&bytes) {
            prop_assert_eq!(c.encode(), bytes.clone(), "accepted bytes must be canonical");
            if c.len() <= 1 << 16 {
                let mut out = vec![0.0; c.len()];
                c.decompress(&mut out).unwrap();
            }
        }
    }

    #[test]
    fn every_codec_round_trips(seed in any::<u64>(), len in 0usize..300) {
        for bytes in valid_encodings(seed, len) {
            let c = Compressed::decode(&bytes).unwrap();
            prop_assert_eq!(c.wire_bytes(), bytes.len());
            prop_assert_eq!(c.encode(), bytes);
            prop_assert_eq!(c.dense_bytes(), 4 * len);
        }
    }
}

#[test]
fn sparse_encoding_is_pinned() {
    let c = Compressed::new(
        5,
        Payload::Sparse {
            indices: vec![1, 3],
            values: vec![1.0, -2.0],
        },
    )
    .unwrap();
    #[rustfmt::skip]
    let want = [
        b'B', b'C', 1, 1, 5, 0, 0, 0, 0, 0, 0, 0,   // header: magic, version, kind sparse, len 5
        2, 0, 0, 0,                                  // k
        1, 0, 0, 0, 3, 0, 0, 0,                      // indices
        0, 0, 0x80, 0x3f, 0, 0, 0, 0xc0,             // 1.0, -2.0
    ];
    assert_eq!(c.encode(), want);
    assert_eq!(c.wire_bytes(), want.len());
    assert_eq!(c.to_dense(), [0.0, 1.0, 0.0, -2.0, 0.0]);
}

#[test]
fn sign_and_int8_encodings_are_pinned() {
    let c = Compressed::new(
        10,
        Payload::Sign {
            block: 8,
            scales: vec![0.5, 2.0],
            bits: vec![0b1000_0001, 0b10],
        },
    )
    .unwrap();
    #[rustfmt::skip]
    let want = [
        b'B', b'C', 1, 4, 10, 0, 0, 0, 0, 0, 0, 0,
        8, 0, 0, 0,                                  // block
        0, 0, 0, 0x3f, 0, 0, 0, 0x40,                // scales 0.5, 2.0
        0b1000_0001, 0b10,                           // bits, LSB first
    ];
    assert_eq!(c.encode(), want);
    assert_eq!(
        c.to_dense(),
        [-0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, -0.5, 2.0, -2.0]
    );

    let c = Compressed::new(
        3,
        Payload::Int8 {
            block: 2,
            scales: vec![1.0, 0.25],
            quants: vec![-127, 3, 4],
        },
    )
    .unwrap();
    let mut want = header(3, 3);
    le32(&mut want, 2);
    want.extend_from_slice(&[0, 0, 0x80, 0x3f, 0, 0, 0x80, 0x3e, 0x81, 3, 4]);
    assert_eq!(c.encode(), want);
    assert_eq!(c.to_dense(), [-127.0, 3.0, 1.0]);
}

#[test]
fn mx_encodings_are_pinned_and_checked() {
    // MXFP8 E4M3, 33 elements: two blocks, the second of one element.
    let mut x = vec![0.0f32; 33];
    x[0] = 1.0; // amax 1: scale 2^(0 − 8), and 1 / 2^-8 = 256 = 2^8
    x[1] = -0.5;
    x[32] = 3.0; // amax 3: scale 2^(1 − 8), 3 / 2^-7 = 384 = 1.5 · 2^8: code 0x7C
    let c = Mx::new(MxElement::E4M3).compress(&x, 0);
    let mut want = header(9, 33);
    want.push(0); // E4M3
    want.extend_from_slice(&[127 - 8, 127 - 7]); // scales
    let mut codes = vec![0u8; 33];
    codes[0] = 0x78; // 256 = 2^8: exponent field 15, mantissa 0
    codes[1] = 0xF0; // −128 = −2^7: sign, exponent field 14
    codes[32] = 0x7C; // 384 = 1.5 · 2^8
    want.extend_from_slice(&codes);
    assert_eq!(c.encode(), want);
    assert_eq!(c.to_dense(), x);
    assert_eq!(Compressed::decode(&want).unwrap(), c);

    // MXFP4, 3 elements: codes two a byte, low nibble first, the last high nibble zero.
    let c = Mx::new(MxElement::E2M1).compress(&[6.0, -1.0, 0.5], 0);
    let mut want = header(9, 3);
    want.extend_from_slice(&[2, 127, 0x7 | 0xA << 4, 0x1]);
    assert_eq!(c.encode(), want);
    assert_eq!(c.to_dense(), [6.0, -1.0, 0.5]);

    let mut bad = want.clone();
    bad[HEADER_BYTES] = 3;
    assert!(
        malformed(&bad).1.contains("element format 3"),
        "{:?}",
        malformed(&bad)
    );
    let mut bad = want.clone();
    *bad.last_mut().unwrap() |= 0x10;
    assert!(
        malformed(&bad).1.contains("high nibble"),
        "{:?}",
        malformed(&bad)
    );
    let short = &want[..want.len() - 1];
    assert!(
        malformed(short).1.contains("element codes"),
        "{:?}",
        malformed(short)
    );
    // A NaN scale decodes to NaN everywhere in its block.
    let mut nan = want.clone();
    nan[HEADER_BYTES + 1] = 255;
    assert!(Compressed::decode(&nan)
        .unwrap()
        .to_dense()
        .iter()
        .all(|v| v.is_nan()));
}

#[test]
fn random_k_low_rank_and_casts_are_pinned() {
    let c = Compressed::new(
        4,
        Payload::RandomK {
            seed: 7,
            step: 9,
            values: vec![1.5],
        },
    )
    .unwrap();
    let mut want = header(2, 4);
    want.extend_from_slice(&7u64.to_le_bytes());
    want.extend_from_slice(&9u64.to_le_bytes());
    le32(&mut want, 1);
    want.extend_from_slice(&1.5f32.to_le_bytes());
    assert_eq!(c.encode(), want);
    let kept = braid_compress::random_k_indices(7, 9, 4, 1)[0] as usize;
    assert_eq!(
        c.to_dense()
            .iter()
            .enumerate()
            .filter(|p| *p.1 != 0.0)
            .map(|p| p.0)
            .collect::<Vec<_>>(),
        [kept]
    );

    let c = Compressed::new(
        3,
        Payload::LowRank {
            rows: 2,
            cols: 2,
            rank: 1,
            p: vec![1.0, 2.0],
            q: vec![3.0, 4.0],
        },
    )
    .unwrap();
    assert_eq!(c.wire_bytes(), 12 + 12 + 16);
    assert_eq!(
        c.to_dense(),
        [3.0, 4.0, 6.0],
        "row-major, last row truncated to len"
    );

    let c = Compressed::new(1, Payload::F16(vec![f16::from_f32(1.0)])).unwrap();
    assert_eq!(c.encode()[12..], [0x00, 0x3c]);
    let c = Compressed::new(1, Payload::Bf16(vec![bf16::from_f32(1.0)])).unwrap();
    assert_eq!(c.encode()[12..], [0x80, 0x3f]);
}

#[test]
fn decode_rejects_bad_headers() {
    assert_eq!(malformed(b""), (0, "magic needs 2 bytes, 0 left".into()));
    assert!(malformed(b"XC\x01\x01").1.contains("magic"));
    assert_eq!(malformed(b"BC\x02\x01").0, 2);
    assert!(malformed(b"BC\x02\x01").1.contains("version 2"));
    let (at, detail) = malformed(&header(0, 0));
    assert_eq!(at, 3);
    assert!(detail.contains("unknown kind 0"));
    assert!(malformed(&header(10, 0)).1.contains("unknown kind 10"));
    assert!(malformed(&header(1, 0)[..10])
        .1
        .contains("length needs 8 bytes"));
}

#[test]
fn decode_rejects_out_of_range_and_unordered_indices() {
    let sparse = |len: u64, idx: &[u32]| {
        let mut b = header(1, len);
        le32(&mut b, idx.len() as u32);
        idx.iter().for_each(|&i| le32(&mut b, i));
        idx.iter()
            .for_each(|_| b.extend_from_slice(&1f32.to_le_bytes()));
        b
    };
    assert!(Compressed::decode(&sparse(10, &[0, 9])).is_ok());
    let (at, detail) = malformed(&sparse(10, &[0, 10]));
    assert_eq!(at, 12 + 4 + 4);
    assert_eq!(detail, "index 10 (entry 1) is out of range for length 10");
    assert!(malformed(&sparse(10, &[5, 5]))
        .1
        .contains("does not follow 5 in increasing order"));
    assert!(malformed(&sparse(10, &[6, 5]))
        .1
        .contains("increasing order"));
    assert!(malformed(&sparse(0, &[0])).1.contains("out of range"));
    // Indices are u32, so sparse kinds cannot describe longer tensors.
    let (at, detail) = malformed(&sparse(1 << 32, &[]));
    assert_eq!(at, 4);
    assert!(detail.contains("cannot be indexed with u32"), "{detail}");
    // A count the bytes cannot back is caught before anything is allocated.
    let mut b = header(1, u32::MAX as u64);
    le32(&mut b, u32::MAX);
    assert!(malformed(&b)
        .1
        .contains("indices needs 17179869180 bytes, 0 left"));
    // Trailing bytes.
    let mut b = sparse(10, &[1]);
    b.push(0);
    assert!(malformed(&b)
        .1
        .contains("1 trailing bytes after the sparse body"));
}

#[test]
fn decode_rejects_bad_counts_blocks_and_shapes() {
    // random-k with k > len.
    let mut b = header(2, 3);
    b.extend_from_slice(&[0; 16]);
    le32(&mut b, 4);
    b.extend_from_slice(&[0; 16]);
    assert!(malformed(&b).1.contains("k = 4 exceeds length 3"));
    // int8: block 0, −128, missing scales.
    let mut b = header(3, 2);
    le32(&mut b, 0);
    assert!(malformed(&b).1.contains("block size is 0"));
    let mut b = header(3, 2);
    le32(&mut b, 2);
    b.extend_from_slice(&1f32.to_le_bytes());
    b.extend_from_slice(&[1, 0x80]);
    let (at, detail) = malformed(&b);
    assert_eq!(
        (at, detail.as_str()),
        (
            21,
            "quantised value −128 at element 1 (range is −127..=127)"
        )
    );
    let mut b = header(3, 1 << 40);
    le32(&mut b, 1);
    assert!(malformed(&b).1.starts_with("scales needs"));
    // sign: non-zero padding bits.
    let mut b = header(4, 3);
    le32(&mut b, 8);
    b.extend_from_slice(&1f32.to_le_bytes());
    b.push(0b1000);
    assert!(malformed(&b).1.contains("padding bits"));
    // f16: too few values.
    let mut b = header(5, 3);
    b.extend_from_slice(&[0; 4]);
    assert!(malformed(&b).1.contains("f16 values needs 6 bytes, 4 left"));
    // low-rank: wrong rows, rank too large, cols 0, and an enormous shape with no bytes behind it.
    let low_rank = |len: u64, rows: u32, cols: u32, rank: u32| {
        let mut b = header(7, len);
        [rows, cols, rank].iter().for_each(|&v| le32(&mut b, v));
        b
    };
    assert!(malformed(&low_rank(10, 3, 3, 1))
        .1
        .contains("rows = 3 but a 10-element tensor with 3 columns has 4 rows"));
    assert!(malformed(&low_rank(10, 4, 3, 4))
        .1
        .contains("rank 4 exceeds min(rows, cols) = 3"));
    assert!(malformed(&low_rank(10, 4, 0, 1)).1.contains("cols is 0"));
    assert!(malformed(&low_rank(u32::MAX as u64 * 3, 3, u32::MAX, 3))
        .1
        .starts_with("P needs"));
}

#[test]
fn decode_for_checks_the_expected_length() {
    let bytes = Compressed::new(
        5,
        Payload::Sparse {
            indices: vec![],
            values: vec![],
        },
    )
    .unwrap()
    .encode();
    assert_eq!(Compressed::decode_for(&bytes, 5).unwrap().len(), 5);
    let (at, detail) = match Compressed::decode_for(&bytes, 6) {
        Err(Error::Malformed { offset, detail }) => (offset, detail),
        other => panic!("{other:?}"),
    };
    assert_eq!((at, detail.as_str()), (4, "length is 5, expected 6"));
}

#[test]
fn new_checks_payloads_and_decompress_checks_lengths() {
    let e = Compressed::new(
        4,
        Payload::Sparse {
            indices: vec![4],
            values: vec![1.0],
        },
    )
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid sparse payload: index 4 (entry 0) is out of range for length 4"
    );
    let e = Compressed::new(
        4,
        Payload::Sparse {
            indices: vec![1, 2],
            values: vec![1.0],
        },
    )
    .unwrap_err();
    assert!(e.to_string().contains("2 indices but 1 values"));
    let e = Compressed::new(4, Payload::Bf16(vec![bf16::ZERO; 3])).unwrap_err();
    assert!(e.to_string().contains("3 values for length 4"));
    let c = Compressed::new(
        4,
        Payload::Sparse {
            indices: vec![2],
            values: vec![1.0],
        },
    )
    .unwrap();
    let e = c.decompress(&mut [0.0; 3]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "length mismatch: decompression output has 3 elements, expected 4"
    );
    let mut acc = [1.0; 4];
    c.accumulate(&mut acc).unwrap();
    c.accumulate(&mut acc).unwrap();
    assert_eq!(acc, [1.0, 1.0, 3.0, 1.0]);
}

#[test]
fn only_sum_closed_kinds_add() {
    let x = grad(1, 100);
    let mut codecs = all_codecs(3);
    let parts: Vec<Compressed> = codecs.iter_mut().map(|c| c.compress(&x, 0)).collect();
    for (c, codec) in parts.iter().zip(&codecs) {
        let summed = c.try_add(c);
        let closed = codec.transport() == braid_compress::Transport::SumClosed;
        assert_eq!(summed.is_ok(), closed, "{}", codec.name());
        if let Ok(s) = summed {
            let (a, b) = (s.to_dense(), c.to_dense());
            assert!(
                a.iter().zip(&b).all(|(a, b)| *a == 2.0 * b),
                "{}",
                codec.name()
            );
        }
    }
    let other = all_codecs(3)[3].compress(&x, 1);
    let e = parts[3].try_add(&other).unwrap_err();
    assert!(e.to_string().contains("random-k index sets differ"), "{e}");
    assert!(parts[0]
        .try_add(&parts[5])
        .unwrap_err()
        .to_string()
        .contains("kinds differ (sparse and int8)"));
    assert!(
        parts[12]
            .try_add(&parts[12])
            .unwrap_err()
            .to_string()
            .contains("all-reduce P"),
        "low-rank"
    );
}

#[test]
fn layered_encoding_is_pinned() {
    let c = Compressed::new(
        7,
        Payload::Layered(vec![
            Piece::Dense(vec![1.0, -2.0]),
            Piece::LowRank {
                rows: 2,
                cols: 2,
                rank: 1,
                p: vec![1.0, 2.0],
                q: vec![3.0, 4.0],
            },
            Piece::Dense(vec![0.5]),
        ]),
    )
    .unwrap();
    let mut want = header(8, 7);
    le32(&mut want, 3);
    want.push(0);
    want.extend_from_slice(&2u64.to_le_bytes());
    [1.0f32, -2.0]
        .iter()
        .for_each(|v| want.extend_from_slice(&v.to_le_bytes()));
    want.push(1);
    [2, 2, 1].iter().for_each(|&v| le32(&mut want, v));
    [1.0f32, 2.0, 3.0, 4.0]
        .iter()
        .for_each(|v| want.extend_from_slice(&v.to_le_bytes()));
    want.push(0);
    want.extend_from_slice(&1u64.to_le_bytes());
    want.extend_from_slice(&0.5f32.to_le_bytes());
    assert_eq!(c.encode(), want);
    assert_eq!(c.wire_bytes(), want.len());
    assert_eq!(c.to_dense(), [1.0, -2.0, 3.0, 4.0, 6.0, 8.0, 0.5]);
    let mut acc = [1.0; 7];
    c.accumulate(&mut acc).unwrap();
    assert_eq!(acc, [2.0, -1.0, 4.0, 5.0, 7.0, 9.0, 1.5]);
    assert_eq!(Compressed::decode(&want).unwrap(), c);
    assert!(matches!(c.try_add(&c), Err(Error::NotSummable(_))));
    let empty = Compressed::new(0, Payload::Layered(vec![])).unwrap();
    assert_eq!(Compressed::decode(&empty.encode()).unwrap(), empty);
}

#[test]
fn layered_payloads_are_checked_piece_by_piece() {
    let piece = |tag: u8, body: &[u8]| {
        let mut b = vec![tag];
        b.extend_from_slice(body);
        b
    };
    let layered = |len: u64, pieces: &[Vec<u8>]| {
        let mut b = header(8, len);
        le32(&mut b, pieces.len() as u32);
        pieces.iter().for_each(|p| b.extend_from_slice(p));
        b
    };
    let dense = |n: u64| {
        let mut b = n.to_le_bytes().to_vec();
        (0..n).for_each(|_| b.extend_from_slice(&1f32.to_le_bytes()));
        piece(0, &b)
    };
    let low_rank = |rows: u32, cols: u32, rank: u32| {
        let mut b = Vec::new();
        [rows, cols, rank].iter().for_each(|&v| le32(&mut b, v));
        b.resize(12 + 4 * (rows * rank + cols * rank) as usize, 0);
        piece(1, &b)
    };
    assert!(Compressed::decode(&layered(6, &[dense(2), low_rank(2, 2, 1)])).is_ok());
    let (at, detail) = malformed(&layered(7, &[dense(2), low_rank(2, 2, 1)]));
    assert_eq!(
        (at, detail.as_str()),
        (
            12 + 4 + 17 + 29,
            "the pieces hold 6 elements, the tensor has 7"
        )
    );
    let (at, detail) = malformed(&layered(5, &[dense(2), low_rank(2, 2, 1)]));
    assert_eq!(
        (at, detail.as_str()),
        (12 + 4 + 17, "piece 1 ends past the tensor's 5 elements")
    );
    let (at, detail) = malformed(&layered(0, &[dense(0)]));
    assert_eq!(
        (at, detail.as_str()),
        (17, "piece 0: a dense piece has no elements")
    );
    assert!(malformed(&layered(4, &[low_rank(2, 2, 3)]))
        .1
        .contains("piece 0: rank 3 exceeds min(rows, cols) = 2"));
    assert!(malformed(&layered(0, &[low_rank(0, 2, 0)]))
        .1
        .contains("piece 0: a 0 × 2 matrix has no elements"));
    let (at, detail) = malformed(&layered(1, &[piece(7, &[])]));
    assert_eq!(
        (at, detail.as_str()),
        (16, "piece 0: unknown piece tag 7 (known: 0, 1)")
    );
    // Counts the bytes cannot back are caught before anything is allocated.
    assert!(
        malformed(&layered(1, &[piece(0, &(1u64 << 40).to_le_bytes())]))
            .1
            .contains("dense piece values needs")
    );
    let mut b = Vec::new();
    [1 << 16, 1 << 16, 1 << 16]
        .iter()
        .for_each(|&v| le32(&mut b, v));
    assert!(malformed(&layered(1 << 32, &[piece(1, &b)]))
        .1
        .starts_with("P needs 17179869184 bytes"));
    let mut b = header(8, 0);
    le32(&mut b, u32::MAX);
    assert!(malformed(&b).1.contains("piece tag needs 1 bytes, 0 left"));
    // Compressed::new checks the same invariants.
    let e = Compressed::new(3, Payload::Layered(vec![Piece::Dense(vec![1.0; 2])])).unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid layered payload: the pieces hold 2 elements, the tensor has 3"
    );
    let e = Compressed::new(
        4,
        Payload::Layered(vec![Piece::LowRank {
            rows: 2,
            cols: 2,
            rank: 1,
            p: vec![1.0],
            q: vec![1.0; 2],
        }]),
    )
    .unwrap_err();
    assert!(e.to_string().contains("piece 0: P has 1 elements"), "{e}");
}
