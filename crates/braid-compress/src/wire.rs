//! [`Compressed`]: what a codec produces, its byte encoding and its decompression.
//!
//! # Byte encoding (version 1)
//!
//! All integers and floats are little-endian; floats are carried bit for bit (NaN payloads included) and are
//! not validated. Every encoding starts with a 12-byte header:
//!
//! | bytes | field                                                                           |
//! |-------|---------------------------------------------------------------------------------|
//! | 0..2  | magic `b"BC"`                                                                   |
//! | 2     | version, `1`                                                                    |
//! | 3     | kind: 1 sparse, 2 random-k, 3 int8, 4 sign, 5 f16, 6 bf16, 7 low-rank, 8 layered, 9 mx |
//! | 4..12 | `len: u64`, the number of elements of the dense tensor (`≤ u32::MAX` for sparse and random-k) |
//!
//! then the body of its kind, and nothing after it:
//!
//! | kind     | body                                                                                        |
//! |----------|---------------------------------------------------------------------------------------------|
//! | sparse   | `k: u32`, `k × u32` indices (strictly increasing, each `< len`), `k × f32` values          |
//! | random-k | `seed: u64`, `step: u64`, `k: u32` (`≤ len`), `k × f32` values in ascending index order    |
//! | int8     | `block: u32` (`≥ 1`), `⌈len/block⌉ × f32` scales, `len × i8` (each in `−127..=127`)        |
//! | sign     | `block: u32` (`≥ 1`), `⌈len/block⌉ × f32` scales, `⌈len/8⌉` bytes of bits, LSB first (bit `i` is bit `i % 8` of byte `i / 8`; 1 = negative), unused high bits of the last byte zero |
//! | f16      | `len × u16`, IEEE binary16 bit patterns                                                     |
//! | bf16     | `len × u16`, bfloat16 bit patterns                                                          |
//! | low-rank | `rows: u32`, `cols: u32` (`≥ 1`), `rank: u32`, `rows·rank × f32` P row-major, `cols·rank × f32` Q row-major; `rows = ⌈len/cols⌉`, `rank ≤ min(rows, cols)` |
//! | mx       | `element: u8` (0 E4M3, 1 E5M2, 2 E2M1), `⌈len/32⌉` E8M0 scale bytes (255 NaN), then the element codes: `len` bytes for E4M3 and E5M2, `⌈len/2⌉` bytes for E2M1 (element `i` in the low nibble of byte `i / 2` when `i` is even, the high nibble when odd; the unused high nibble of the last byte zero) |
//! | layered  | `count: u32`, then `count` pieces whose elements add up to `len`, each a tag byte and its body: `0` dense, `n: u64` (`≥ 1`), `n × f32`; `1` low-rank, `rows: u32`, `cols: u32` (both `≥ 1`), `rank: u32` (`≤ min(rows, cols)`), `rows·rank × f32` P, `cols·rank × f32` Q, for exactly `rows·cols` elements |
//!
//! The encoding is canonical: [`Compressed::decode`] accepts exactly the byte strings that
//! [`Compressed::encode`] can produce, so a decoded value re-encodes to the same bytes. Random-k carries no
//! indices: the receiver regenerates them from `(seed, step, len, k)` with
//! [`random_k_indices`].

use half::{bf16, f16};

use crate::mx::{scale_value, MxElement, MX_BLOCK};
use crate::select::random_k_indices;
use crate::{Error, Result};

/// The first two bytes of every encoding.
pub const MAGIC: [u8; 2] = *b"BC";
/// The encoding version this crate writes and reads.
pub const VERSION: u8 = 1;
/// Length of the header in bytes.
pub const HEADER_BYTES: usize = 12;

const KIND_SPARSE: u8 = 1;
const KIND_RANDOM_K: u8 = 2;
const KIND_INT8: u8 = 3;
const KIND_SIGN: u8 = 4;
const KIND_F16: u8 = 5;
const KIND_BF16: u8 = 6;
const KIND_LOW_RANK: u8 = 7;
const KIND_LAYERED: u8 = 8;
const KIND_MX: u8 = 9;

/// The element formats of an mx body, by their code on the wire.
const MX_ELEMENTS: [MxElement; 3] = [MxElement::E4M3, MxElement::E5M2, MxElement::E2M1];

/// The wire code of an mx element format.
fn element_code(e: MxElement) -> u8 {
    MX_ELEMENTS
        .iter()
        .position(|&x| x == e)
        .expect("every format has a code") as u8
}

const PIECE_DENSE: u8 = 0;
const PIECE_LOW_RANK: u8 = 1;

/// The body of a compressed tensor. See the [module documentation](self) for the invariants of each kind.
#[derive(Clone, Debug, PartialEq)]
pub enum Payload {
    /// Explicit `(index, value)` pairs; every other element is zero. Produced by top-k and threshold top-k.
    Sparse {
        /// Strictly increasing element indices.
        indices: Vec<u32>,
        /// The value at each index.
        values: Vec<f32>,
    },
    /// Values at the indices [`random_k_indices(seed, step, len, values.len())`](crate::random_k_indices)
    /// (ascending); every other element is zero.
    RandomK {
        /// The seed shared by all ranks.
        seed: u64,
        /// The training step.
        step: u64,
        /// One value per selected index, in ascending index order.
        values: Vec<f32>,
    },
    /// Element `i` is `quants[i] as f32 * scales[i / block]`.
    Int8 {
        /// Elements per scale.
        block: u32,
        /// One scale per block (the last block may be short).
        scales: Vec<f32>,
        /// One quantised value per element, in `−127..=127`.
        quants: Vec<i8>,
    },
    /// Element `i` is `−scales[i / block]` if bit `i` is set, else `+scales[i / block]`.
    Sign {
        /// Elements per scale.
        block: u32,
        /// One scale per block.
        scales: Vec<f32>,
        /// `⌈len/8⌉` bytes, bit `i` at bit `i % 8` of byte `i / 8`.
        bits: Vec<u8>,
    },
    /// One IEEE binary16 value per element.
    F16(Vec<f16>),
    /// One bfloat16 value per element.
    Bf16(Vec<bf16>),
    /// `P·Qᵀ` of the `rows × cols` row-major matrix view of the tensor, zero-padded to `rows·cols`:
    /// element `i·cols + j` (for `i·cols + j < len`) is `Σ_r p[i·rank + r]·q[j·rank + r]`, summed in f32
    /// in ascending `r`.
    LowRank {
        /// Rows of the matrix view, `⌈len/cols⌉`.
        rows: u32,
        /// Columns of the matrix view.
        cols: u32,
        /// Number of factors.
        rank: u32,
        /// `rows × rank`, row-major, columns orthonormal.
        p: Vec<f32>,
        /// `cols × rank`, row-major.
        q: Vec<f32>,
    },
    /// Block-scaled floats (OCP MX): element `i` is `element`'s value of code `i` times
    /// `2^(scales[i / 32] − 127)` (NaN where the scale is 255). See [`crate::mx`].
    Mx {
        /// The element format.
        element: MxElement,
        /// One E8M0 scale code per block of 32 elements (the last block may be short).
        scales: Vec<u8>,
        /// The element codes: one a byte, or for E2M1 two a byte, low nibble first.
        codes: Vec<u8>,
    },
    /// Consecutive pieces, each a run of the tensor's elements: per-layer PowerSGD
    /// ([`Plan`](crate::power_sgd::Plan)), where each layer's matrix has its own factors and 1-D tensors
    /// travel as they are.
    Layered(Vec<Piece>),
}

/// One run of elements of a [`Payload::Layered`] tensor.
#[derive(Clone, Debug, PartialEq)]
pub enum Piece {
    /// The values as they are (at least one).
    Dense(Vec<f32>),
    /// `P·Qᵀ` of a `rows × cols` row-major matrix of exactly `rows·cols` elements: element `i·cols + j`
    /// is `Σ_r p[i·rank + r]·q[j·rank + r]`, summed in f32 in ascending `r`.
    LowRank {
        /// Rows, at least 1.
        rows: u32,
        /// Columns, at least 1.
        cols: u32,
        /// Number of factors, at most `min(rows, cols)`.
        rank: u32,
        /// `rows × rank`, row-major.
        p: Vec<f32>,
        /// `cols × rank`, row-major.
        q: Vec<f32>,
    },
}

impl Piece {
    /// Number of elements of the run.
    pub fn len(&self) -> usize {
        match self {
            Piece::Dense(v) => v.len(),
            Piece::LowRank { rows, cols, .. } => (*rows as usize).saturating_mul(*cols as usize),
        }
    }

    /// Whether the run has no elements (never, in a valid payload).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn bytes(&self) -> usize {
        match self {
            Piece::Dense(v) => 1 + 8 + 4 * v.len(),
            Piece::LowRank { p, q, .. } => 1 + 12 + 4 * p.len() + 4 * q.len(),
        }
    }
}

impl Payload {
    /// The kind's name, as used in error messages.
    pub fn kind_name(&self) -> &'static str {
        match self {
            Payload::Sparse { .. } => "sparse",
            Payload::RandomK { .. } => "random-k",
            Payload::Int8 { .. } => "int8",
            Payload::Sign { .. } => "sign",
            Payload::F16(_) => "f16",
            Payload::Bf16(_) => "bf16",
            Payload::LowRank { .. } => "low-rank",
            Payload::Layered(_) => "layered",
            Payload::Mx { .. } => "mx",
        }
    }

    fn kind_code(&self) -> u8 {
        match self {
            Payload::Sparse { .. } => KIND_SPARSE,
            Payload::RandomK { .. } => KIND_RANDOM_K,
            Payload::Int8 { .. } => KIND_INT8,
            Payload::Sign { .. } => KIND_SIGN,
            Payload::F16(_) => KIND_F16,
            Payload::Bf16(_) => KIND_BF16,
            Payload::LowRank { .. } => KIND_LOW_RANK,
            Payload::Layered(_) => KIND_LAYERED,
            Payload::Mx { .. } => KIND_MX,
        }
    }

    fn body_bytes(&self) -> usize {
        match self {
            Payload::Sparse { indices, values } => 4 + 4 * indices.len() + 4 * values.len(),
            Payload::RandomK { values, .. } => 20 + 4 * values.len(),
            Payload::Int8 { scales, quants, .. } => 4 + 4 * scales.len() + quants.len(),
            Payload::Sign { scales, bits, .. } => 4 + 4 * scales.len() + bits.len(),
            Payload::F16(v) => 2 * v.len(),
            Payload::Bf16(v) => 2 * v.len(),
            Payload::LowRank { p, q, .. } => 12 + 4 * p.len() + 4 * q.len(),
            Payload::Layered(pieces) => 4 + pieces.iter().map(Piece::bytes).sum::<usize>(),
            Payload::Mx { scales, codes, .. } => 1 + scales.len() + codes.len(),
        }
    }
}

/// A compressed tensor of `len` f32 elements: the value a codec produces, sends and decompresses.
///
/// Always valid: [`Compressed::new`] and [`Compressed::decode`] check every invariant of the
/// [encoding](self), so [`decompress`](Compressed::decompress) cannot index out of bounds.
#[derive(Clone, Debug, PartialEq)]
pub struct Compressed {
    len: usize,
    payload: Payload,
}

#[inline(always)]
fn put<const ADD: bool>(o: &mut f32, v: f32) {
    if ADD {
        *o += v
    } else {
        *o = v
    }
}

/// Writes (or adds) `P·Qᵀ` of a row-major matrix with `cols` columns into `out`, whose last row may be
/// short.
fn low_rank<const ADD: bool>(out: &mut [f32], cols: usize, rank: usize, p: &[f32], q: &[f32]) {
    for (i, row) in out.chunks_mut(cols).enumerate() {
        let pi = &p[i * rank..(i + 1) * rank];
        for (j, o) in row.iter_mut().enumerate() {
            let qj = &q[j * rank..(j + 1) * rank];
            let mut acc = 0.0f32;
            for r in 0..rank {
                acc += pi[r] * qj[r];
            }
            put::<ADD>(o, acc);
        }
    }
}

/// A broken invariant: the byte offset in the encoding where it shows, and what it is.
struct Bad {
    at: usize,
    detail: String,
}

fn bad<T>(at: usize, detail: impl Into<String>) -> Result<T, Bad> {
    Err(Bad {
        at,
        detail: detail.into(),
    })
}

/// Checks every invariant of `payload` for a tensor of `len` elements.
fn validate(len: usize, payload: &Payload) -> Result<(), Bad> {
    let h = HEADER_BYTES;
    let indexed = matches!(payload, Payload::Sparse { .. } | Payload::RandomK { .. });
    if indexed && len > u32::MAX as usize {
        return bad(
            4,
            format!(
                "a {} tensor of {len} elements cannot be indexed with u32 (at most {})",
                payload.kind_name(),
                u32::MAX
            ),
        );
    }
    match payload {
        Payload::Sparse { indices, values } => {
            if indices.len() != values.len() {
                return bad(
                    h,
                    format!("{} indices but {} values", indices.len(), values.len()),
                );
            }
            if indices.len() > u32::MAX as usize {
                return bad(
                    h,
                    format!("{} entries do not fit a u32 count", indices.len()),
                );
            }
            let mut prev: Option<u32> = None;
            for (j, &i) in indices.iter().enumerate() {
                let at = h + 4 + 4 * j;
                if i as usize >= len {
                    return bad(
                        at,
                        format!("index {i} (entry {j}) is out of range for length {len}"),
                    );
                }
                if prev.is_some_and(|p| p >= i) {
                    return bad(
                        at,
                        format!(
                            "index {i} (entry {j}) does not follow {} in increasing order",
                            prev.unwrap()
                        ),
                    );
                }
                prev = Some(i);
            }
        }
        Payload::RandomK { values, .. } => {
            if values.len() > len {
                return bad(h + 16, format!("k = {} exceeds length {len}", values.len()));
            }
            if values.len() > u32::MAX as usize {
                return bad(h + 16, format!("k = {} does not fit a u32", values.len()));
            }
        }
        Payload::Int8 {
            block,
            scales,
            quants,
        } => {
            check_blocks(len, *block, scales.len())?;
            if quants.len() != len {
                return bad(
                    h,
                    format!("{} quantised values for length {len}", quants.len()),
                );
            }
            let base = h + 4 + 4 * scales.len();
            if let Some(j) = quants.iter().position(|&q| q == i8::MIN) {
                return bad(
                    base + j,
                    format!("quantised value −128 at element {j} (range is −127..=127)"),
                );
            }
        }
        Payload::Sign {
            block,
            scales,
            bits,
        } => {
            check_blocks(len, *block, scales.len())?;
            if bits.len() != len.div_ceil(8) {
                return bad(
                    h,
                    format!(
                        "{} sign bytes for length {len} (expected {})",
                        bits.len(),
                        len.div_ceil(8)
                    ),
                );
            }
            if len % 8 != 0 {
                let last = bits[bits.len() - 1];
                if last >> (len % 8) != 0 {
                    return bad(
                        h + 4 + 4 * scales.len() + bits.len() - 1,
                        format!("padding bits of the last sign byte {last:#04x} are not zero"),
                    );
                }
            }
        }
        Payload::Mx {
            element,
            scales,
            codes,
        } => {
            if scales.len() != len.div_ceil(MX_BLOCK) {
                return bad(
                    h + 1,
                    format!(
                        "{} scales for length {len} in blocks of {MX_BLOCK} (expected {})",
                        scales.len(),
                        len.div_ceil(MX_BLOCK)
                    ),
                );
            }
            let want = element.code_bytes(len);
            if codes.len() != want {
                return bad(
                    h + 1 + scales.len(),
                    format!(
                        "{} bytes of {} codes for length {len} (expected {want})",
                        codes.len(),
                        element.name()
                    ),
                );
            }
            if element.bits() == 4 && len % 2 == 1 && codes[want - 1] >> 4 != 0 {
                return bad(
                    h + 1 + scales.len() + want - 1,
                    format!(
                        "the unused high nibble of the last code byte {:#04x} is not zero",
                        codes[want - 1]
                    ),
                );
            }
        }
        Payload::F16(v) => {
            if v.len() != len {
                return bad(h, format!("{} values for length {len}", v.len()));
            }
        }
        Payload::Bf16(v) => {
            if v.len() != len {
                return bad(h, format!("{} values for length {len}", v.len()));
            }
        }
        Payload::LowRank {
            rows,
            cols,
            rank,
            p,
            q,
        } => {
            let (rows, cols, rank) = (*rows as usize, *cols as usize, *rank as usize);
            if cols == 0 {
                return bad(h + 4, "cols is 0");
            }
            if rows != len.div_ceil(cols) {
                return bad(
                    h,
                    format!(
                        "rows = {rows} but a {len}-element tensor with {cols} columns has {} rows",
                        len.div_ceil(cols)
                    ),
                );
            }
            check_factors((rows, cols, rank), (p.len(), q.len()), h + 8)?;
        }
        Payload::Layered(pieces) => {
            if pieces.len() > u32::MAX as usize {
                return bad(h, format!("{} pieces do not fit a u32 count", pieces.len()));
            }
            let (mut at, mut total) = (h + 4, 0usize);
            for (i, piece) in pieces.iter().enumerate() {
                check_piece(piece, at).map_err(|b| Bad {
                    at: b.at,
                    detail: format!("piece {i}: {}", b.detail),
                })?;
                total = match total.checked_add(piece.len()) {
                    Some(t) if t <= len => t,
                    _ => {
                        return bad(
                            at,
                            format!("piece {i} ends past the tensor's {len} elements"),
                        )
                    }
                };
                at += piece.bytes();
            }
            if total != len {
                return bad(
                    at,
                    format!("the pieces hold {total} elements, the tensor has {len}"),
                );
            }
        }
    }
    Ok(())
}

/// Checks one piece of a layered payload whose encoding starts at byte `at` (its tag).
fn check_piece(piece: &Piece, at: usize) -> Result<(), Bad> {
    match piece {
        Piece::Dense(v) => {
            if v.is_empty() {
                return bad(at + 1, "a dense piece has no elements");
            }
        }
        Piece::LowRank {
            rows,
            cols,
            rank,
            p,
            q,
        } => {
            let (rows, cols, rank) = (*rows as usize, *cols as usize, *rank as usize);
            if rows == 0 || cols == 0 {
                return bad(at + 1, format!("a {rows} × {cols} matrix has no elements"));
            }
            check_factors((rows, cols, rank), (p.len(), q.len()), at + 9)?;
        }
    }
    Ok(())
}

/// Checks the factors of a `rows × cols` matrix of rank `rank`: the rank fits and P and Q have
/// `rows·rank` and `cols·rank` elements. `rank_at` is the byte of the rank field; P follows 4 bytes on.
fn check_factors(
    (rows, cols, rank): (usize, usize, usize),
    (p, q): (usize, usize),
    rank_at: usize,
) -> Result<(), Bad> {
    if rank > rows.min(cols) {
        return bad(
            rank_at,
            format!("rank {rank} exceeds min(rows, cols) = {}", rows.min(cols)),
        );
    }
    if Some(p) != rows.checked_mul(rank) {
        return bad(
            rank_at + 4,
            format!("P has {p} elements, expected rows·rank = {rows}·{rank}"),
        );
    }
    if Some(q) != cols.checked_mul(rank) {
        return bad(
            rank_at + 4 + 4 * p,
            format!("Q has {q} elements, expected cols·rank = {cols}·{rank}"),
        );
    }
    Ok(())
}

fn check_blocks(len: usize, block: u32, scales: usize) -> Result<(), Bad> {
    if block == 0 {
        return bad(HEADER_BYTES, "block size is 0");
    }
    let want = len.div_ceil(block as usize);
    if scales != want {
        return bad(
            HEADER_BYTES + 4,
            format!("{scales} scales for length {len} in blocks of {block} (expected {want})"),
        );
    }
    Ok(())
}

/// A bounds-checked cursor over untrusted bytes.
struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        let left = self.bytes.len() - self.pos;
        if n > left {
            return Err(Error::Malformed {
                offset: self.pos,
                detail: format!("{what} needs {n} bytes, {left} left"),
            });
        }
        let s = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(
            self.take(4, what)?.try_into().expect("4 bytes"),
        ))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(
            self.take(8, what)?.try_into().expect("8 bytes"),
        ))
    }

    /// `count` items of `size` bytes, checked against what is left before anything is allocated.
    fn items(&mut self, count: usize, size: usize, what: &str) -> Result<&'a [u8]> {
        let n = count.checked_mul(size).ok_or_else(|| Error::Malformed {
            offset: self.pos,
            detail: format!("{what}: {count} items of {size} bytes overflow"),
        })?;
        self.take(n, what)
    }

    fn f32s(&mut self, count: usize, what: &str) -> Result<Vec<f32>> {
        Ok(self
            .items(count, 4, what)?
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().expect("4")))
            .collect())
    }

    /// Piece `i` of a layered body; its shape is checked before its values are read.
    fn piece(&mut self, i: u32) -> Result<Piece> {
        let at = self.pos;
        let malformed = |offset: usize, detail: String| Error::Malformed {
            offset,
            detail: format!("piece {i}: {detail}"),
        };
        let piece = match self.take(1, "piece tag")?[0] {
            PIECE_DENSE => {
                let n = self.u64("dense piece length")?;
                let n = usize::try_from(n)
                    .map_err(|_| malformed(at + 1, format!("{n} elements do not fit usize")))?;
                Piece::Dense(self.f32s(n, "dense piece values")?)
            }
            PIECE_LOW_RANK => {
                let rows = self.u32("rows")?;
                let cols = self.u32("cols")?;
                let rank = self.u32("rank")?;
                let shape = Piece::LowRank {
                    rows,
                    cols,
                    rank,
                    p: Vec::new(),
                    q: Vec::new(),
                };
                if let Err(b) = check_piece(&shape, at) {
                    if b.at < at + 13 {
                        return Err(malformed(b.at, b.detail));
                    }
                }
                let p = self.f32s((rows as usize).saturating_mul(rank as usize), "P")?;
                let q = self.f32s((cols as usize).saturating_mul(rank as usize), "Q")?;
                Piece::LowRank {
                    rows,
                    cols,
                    rank,
                    p,
                    q,
                }
            }
            tag => {
                return Err(malformed(
                    at,
                    format!("unknown piece tag {tag} (known: 0, 1)"),
                ))
            }
        };
        if let Err(b) = check_piece(&piece, at) {
            return Err(malformed(b.at, b.detail));
        }
        Ok(piece)
    }

    fn u16s(&mut self, count: usize, what: &str) -> Result<Vec<u16>> {
        Ok(self
            .items(count, 2, what)?
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes(c.try_into().expect("2")))
            .collect())
    }
}

impl Compressed {
    /// A compressed tensor of `len` elements, after checking every invariant of `payload`'s kind.
    pub fn new(len: usize, payload: Payload) -> Result<Self> {
        validate(len, &payload).map_err(|b| Error::InvalidPayload {
            kind: payload.kind_name(),
            detail: b.detail,
        })?;
        Ok(Compressed { len, payload })
    }

    /// For codecs that build payloads valid by construction: checked in debug builds only.
    pub(crate) fn new_unchecked(len: usize, payload: Payload) -> Self {
        debug_assert!(
            validate(len, &payload).is_ok(),
            "codec built an invalid {} payload",
            payload.kind_name()
        );
        Compressed { len, payload }
    }

    /// Number of elements of the dense tensor.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the dense tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The body.
    pub fn payload(&self) -> &Payload {
        &self.payload
    }

    /// The body, by value.
    pub fn into_payload(self) -> Payload {
        self.payload
    }

    /// Exact length of [`encode`](Self::encode)'s output, computed without encoding.
    pub fn wire_bytes(&self) -> usize {
        HEADER_BYTES + self.payload.body_bytes()
    }

    /// Bytes of the same tensor sent dense in f32: `4 · len`.
    pub fn dense_bytes(&self) -> usize {
        4 * self.len
    }

    /// The byte encoding described in the [module documentation](self).
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(self.wire_bytes());
        b.extend_from_slice(&MAGIC);
        b.push(VERSION);
        b.push(self.payload.kind_code());
        b.extend_from_slice(&(self.len as u64).to_le_bytes());
        let f32s = |b: &mut Vec<u8>, v: &[f32]| {
            v.iter().for_each(|x| b.extend_from_slice(&x.to_le_bytes()))
        };
        match &self.payload {
            Payload::Sparse { indices, values } => {
                b.extend_from_slice(&(indices.len() as u32).to_le_bytes());
                indices
                    .iter()
                    .for_each(|i| b.extend_from_slice(&i.to_le_bytes()));
                f32s(&mut b, values);
            }
            Payload::RandomK { seed, step, values } => {
                b.extend_from_slice(&seed.to_le_bytes());
                b.extend_from_slice(&step.to_le_bytes());
                b.extend_from_slice(&(values.len() as u32).to_le_bytes());
                f32s(&mut b, values);
            }
            Payload::Int8 {
                block,
                scales,
                quants,
            } => {
                b.extend_from_slice(&block.to_le_bytes());
                f32s(&mut b, scales);
                b.extend(quants.iter().map(|&q| q as u8));
            }
            Payload::Sign {
                block,
                scales,
                bits,
            } => {
                b.extend_from_slice(&block.to_le_bytes());
                f32s(&mut b, scales);
                b.extend_from_slice(bits);
            }
            Payload::Mx {
                element,
                scales,
                codes,
            } => {
                b.push(element_code(*element));
                b.extend_from_slice(scales);
                b.extend_from_slice(codes);
            }
            Payload::F16(v) => v
                .iter()
                .for_each(|x| b.extend_from_slice(&x.to_bits().to_le_bytes())),
            Payload::Bf16(v) => v
                .iter()
                .for_each(|x| b.extend_from_slice(&x.to_bits().to_le_bytes())),
            Payload::LowRank {
                rows,
                cols,
                rank,
                p,
                q,
            } => {
                b.extend_from_slice(&rows.to_le_bytes());
                b.extend_from_slice(&cols.to_le_bytes());
                b.extend_from_slice(&rank.to_le_bytes());
                f32s(&mut b, p);
                f32s(&mut b, q);
            }
            Payload::Layered(pieces) => {
                b.extend_from_slice(&(pieces.len() as u32).to_le_bytes());
                for piece in pieces {
                    match piece {
                        Piece::Dense(v) => {
                            b.push(PIECE_DENSE);
                            b.extend_from_slice(&(v.len() as u64).to_le_bytes());
                            f32s(&mut b, v);
                        }
                        Piece::LowRank {
                            rows,
                            cols,
                            rank,
                            p,
                            q,
                        } => {
                            b.push(PIECE_LOW_RANK);
                            b.extend_from_slice(&rows.to_le_bytes());
                            b.extend_from_slice(&cols.to_le_bytes());
                            b.extend_from_slice(&rank.to_le_bytes());
                            f32s(&mut b, p);
                            f32s(&mut b, q);
                        }
                    }
                }
            }
        }
        debug_assert_eq!(b.len(), self.wire_bytes());
        b
    }

    /// Parses and validates an encoding. Every count is checked against the bytes present before anything
    /// is allocated, and every index, block, shape and padding bit is checked, so hostile input yields an
    /// [`Error::Malformed`] naming the offset and the problem, never a panic or a huge allocation.
    ///
    /// The length in the header is the sender's claim, and a sparse kind can claim a huge tensor in a few
    /// bytes: check it against the tensor you expect (or use [`decode_for`](Self::decode_for)) before
    /// allocating `len` elements for it.
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        let mut r = Reader { bytes, pos: 0 };
        let magic = r.take(2, "magic")?;
        if magic != MAGIC {
            return Err(Error::Malformed {
                offset: 0,
                detail: format!("magic is {magic:02x?}, expected {MAGIC:02x?} (\"BC\")"),
            });
        }
        let version = r.take(1, "version")?[0];
        if version != VERSION {
            return Err(Error::Malformed {
                offset: 2,
                detail: format!("version {version} is not supported (this build reads {VERSION})"),
            });
        }
        let kind = r.take(1, "kind")?[0];
        let len64 = r.u64("length")?;
        let len = usize::try_from(len64).map_err(|_| Error::Malformed {
            offset: 4,
            detail: format!("length {len64} does not fit this platform's usize"),
        })?;
        let payload = match kind {
            KIND_SPARSE => {
                let k = r.u32("entry count")? as usize;
                let indices = r
                    .items(k, 4, "indices")?
                    .chunks_exact(4)
                    .map(|c| u32::from_le_bytes(c.try_into().expect("4")))
                    .collect();
                let values = r.f32s(k, "values")?;
                Payload::Sparse { indices, values }
            }
            KIND_RANDOM_K => {
                let seed = r.u64("seed")?;
                let step = r.u64("step")?;
                let k = r.u32("k")? as usize;
                if k > len {
                    return Err(Error::Malformed {
                        offset: r.pos - 4,
                        detail: format!("k = {k} exceeds length {len}"),
                    });
                }
                Payload::RandomK {
                    seed,
                    step,
                    values: r.f32s(k, "values")?,
                }
            }
            KIND_INT8 | KIND_SIGN => {
                let block = r.u32("block size")?;
                if block == 0 {
                    return Err(Error::Malformed {
                        offset: r.pos - 4,
                        detail: "block size is 0".into(),
                    });
                }
                let scales = r.f32s(len.div_ceil(block as usize), "scales")?;
                if kind == KIND_INT8 {
                    let quants = r
                        .items(len, 1, "quantised values")?
                        .iter()
                        .map(|&q| q as i8)
                        .collect();
                    Payload::Int8 {
                        block,
                        scales,
                        quants,
                    }
                } else {
                    let bits = r.items(len.div_ceil(8), 1, "sign bits")?.to_vec();
                    Payload::Sign {
                        block,
                        scales,
                        bits,
                    }
                }
            }
            KIND_MX => {
                let at = r.pos;
                let code = r.take(1, "element format")?[0];
                let element = MX_ELEMENTS.get(usize::from(code)).copied().ok_or_else(|| {
                    Error::Malformed {
                        offset: at,
                        detail: format!(
                            "element format {code} is not one of 0 (E4M3), 1 (E5M2), 2 (E2M1)"
                        ),
                    }
                })?;
                let scales = r.items(len.div_ceil(MX_BLOCK), 1, "scales")?.to_vec();
                let codes = r
                    .items(element.code_bytes(len), 1, "element codes")?
                    .to_vec();
                Payload::Mx {
                    element,
                    scales,
                    codes,
                }
            }
            KIND_F16 => Payload::F16(
                r.u16s(len, "f16 values")?
                    .into_iter()
                    .map(f16::from_bits)
                    .collect(),
            ),
            KIND_BF16 => Payload::Bf16(
                r.u16s(len, "bf16 values")?
                    .into_iter()
                    .map(bf16::from_bits)
                    .collect(),
            ),
            KIND_LOW_RANK => {
                let rows = r.u32("rows")?;
                let cols = r.u32("cols")?;
                let rank = r.u32("rank")?;
                // Check the shape before reading the factors so their sizes are known to be consistent.
                let shape = Payload::LowRank {
                    rows,
                    cols,
                    rank,
                    p: Vec::new(),
                    q: Vec::new(),
                };
                if let Err(b) = validate(len, &shape) {
                    if b.at < HEADER_BYTES + 12 {
                        return Err(Error::Malformed {
                            offset: b.at,
                            detail: b.detail,
                        });
                    }
                }
                let p = r.f32s((rows as usize).saturating_mul(rank as usize), "P")?;
                let q = r.f32s((cols as usize).saturating_mul(rank as usize), "Q")?;
                Payload::LowRank {
                    rows,
                    cols,
                    rank,
                    p,
                    q,
                }
            }
            KIND_LAYERED => {
                let count = r.u32("piece count")?;
                let mut pieces = Vec::new();
                for i in 0..count {
                    pieces.push(r.piece(i)?);
                }
                Payload::Layered(pieces)
            }
            other => {
                return Err(Error::Malformed {
                    offset: 3,
                    detail: format!("unknown kind {other} (known: 1..=9)"),
                })
            }
        };
        if r.pos != bytes.len() {
            return Err(Error::Malformed {
                offset: r.pos,
                detail: format!(
                    "{} trailing bytes after the {} body",
                    bytes.len() - r.pos,
                    payload.kind_name()
                ),
            });
        }
        validate(len, &payload).map_err(|b| Error::Malformed {
            offset: b.at,
            detail: b.detail,
        })?;
        Ok(Compressed { len, payload })
    }

    /// [`decode`](Self::decode), and check that the tensor has `expected_len` elements.
    pub fn decode_for(bytes: &[u8], expected_len: usize) -> Result<Self> {
        let c = Self::decode(bytes)?;
        if c.len != expected_len {
            return Err(Error::Malformed {
                offset: 4,
                detail: format!("length is {}, expected {expected_len}", c.len),
            });
        }
        Ok(c)
    }

    /// Writes the dense tensor into `out`, which must have [`len`](Self::len) elements.
    pub fn decompress(&self, out: &mut [f32]) -> Result<()> {
        self.expand::<false>(out)
    }

    /// Adds the dense tensor to `out` (`out += decompressed`), which must have [`len`](Self::len) elements.
    /// This is how the parts of a sparse all-gather are summed.
    pub fn accumulate(&self, out: &mut [f32]) -> Result<()> {
        self.expand::<true>(out)
    }

    /// The dense tensor, in a new vector.
    pub fn to_dense(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.len];
        self.expand::<false>(&mut out).expect("length matches");
        out
    }

    fn expand<const ADD: bool>(&self, out: &mut [f32]) -> Result<()> {
        if out.len() != self.len {
            return Err(Error::LengthMismatch {
                what: "decompression output",
                expected: self.len,
                got: out.len(),
            });
        }
        match &self.payload {
            Payload::Sparse { indices, values } => {
                if !ADD {
                    out.fill(0.0);
                }
                for (&i, &v) in indices.iter().zip(values) {
                    put::<ADD>(&mut out[i as usize], v);
                }
            }
            Payload::RandomK { seed, step, values } => {
                if !ADD {
                    out.fill(0.0);
                }
                for (i, &v) in random_k_indices(*seed, *step, self.len, values.len())
                    .into_iter()
                    .zip(values)
                {
                    put::<ADD>(&mut out[i as usize], v);
                }
            }
            Payload::Int8 {
                block,
                scales,
                quants,
            } => {
                for ((o, q), &s) in out
                    .chunks_mut(*block as usize)
                    .zip(quants.chunks(*block as usize))
                    .zip(scales)
                {
                    for (o, &q) in o.iter_mut().zip(q) {
                        put::<ADD>(o, q as f32 * s);
                    }
                }
            }
            Payload::Sign {
                block,
                scales,
                bits,
            } => {
                let block = *block as usize;
                for (b, (o, &s)) in out.chunks_mut(block).zip(scales).enumerate() {
                    let first = b * block;
                    for (j, o) in o.iter_mut().enumerate() {
                        let i = first + j;
                        let bit = (bits[i / 8] >> (i % 8) & 1) as u32;
                        put::<ADD>(o, f32::from_bits(s.to_bits() ^ (bit << 31)));
                    }
                }
            }
            Payload::Mx {
                element,
                scales,
                codes,
            } => {
                let values: Vec<f32> = (0..1u16 << element.bits())
                    .map(|c| element.decode(c as u8))
                    .collect();
                for (b, (o, &scale)) in out.chunks_mut(MX_BLOCK).zip(scales).enumerate() {
                    let s = scale_value(scale);
                    let first = b * MX_BLOCK;
                    for (j, o) in o.iter_mut().enumerate() {
                        let i = first + j;
                        let code = match element.bits() {
                            8 => codes[i],
                            _ => codes[i / 2] >> (4 * (i % 2)) & 0xF,
                        };
                        put::<ADD>(o, values[usize::from(code)] * s);
                    }
                }
            }
            Payload::F16(v) => {
                if ADD {
                    out.iter_mut().zip(v).for_each(|(o, x)| *o += x.to_f32());
                } else {
                    half::slice::HalfFloatSliceExt::convert_to_f32_slice(v.as_slice(), out);
                }
            }
            Payload::Bf16(v) => {
                if ADD {
                    out.iter_mut().zip(v).for_each(|(o, x)| *o += x.to_f32());
                } else {
                    half::slice::HalfFloatSliceExt::convert_to_f32_slice(v.as_slice(), out);
                }
            }
            Payload::LowRank {
                cols, rank, p, q, ..
            } => low_rank::<ADD>(out, *cols as usize, *rank as usize, p, q),
            Payload::Layered(pieces) => {
                let mut rest = &mut out[..];
                for piece in pieces {
                    let (run, tail) = rest.split_at_mut(piece.len());
                    rest = tail;
                    match piece {
                        Piece::Dense(v) => {
                            run.iter_mut().zip(v).for_each(|(o, &x)| put::<ADD>(o, x))
                        }
                        Piece::LowRank {
                            cols, rank, p, q, ..
                        } => low_rank::<ADD>(run, *cols as usize, *rank as usize, p, q),
                    }
                }
            }
        }
        Ok(())
    }

    /// The element-wise sum of two compressed tensors, in compressed form, for the kinds whose wire format
    /// is closed under addition: random-k with the same `(seed, step, len, k)` (values added in f32) and
    /// f16/bf16 casts of the same length (added in f32, rounded to nearest even once). Every other pair is
    /// [`Error::NotSummable`], with the reason.
    pub fn try_add(&self, other: &Compressed) -> Result<Compressed> {
        if self.len != other.len {
            return Err(Error::NotSummable(format!(
                "lengths differ ({} and {})",
                self.len, other.len
            )));
        }
        let payload = match (&self.payload, &other.payload) {
            (Payload::RandomK { seed, step, values: a }, Payload::RandomK { seed: s2, step: t2, values: b }) => {
                if (seed, step, a.len()) != (s2, t2, b.len()) {
                    return Err(Error::NotSummable(format!(
                        "random-k index sets differ: (seed {seed}, step {step}, k {}) and (seed {s2}, step {t2}, k {})",
                        a.len(),
                        b.len()
                    )));
                }
                Payload::RandomK { seed: *seed, step: *step, values: a.iter().zip(b).map(|(x, y)| x + y).collect() }
            }
            (Payload::F16(a), Payload::F16(b)) => Payload::F16(a.iter().zip(b).map(|(x, y)| f16::from_f32(x.to_f32() + y.to_f32())).collect()),
            (Payload::Bf16(a), Payload::Bf16(b)) => Payload::Bf16(a.iter().zip(b).map(|(x, y)| bf16::from_f32(x.to_f32() + y.to_f32())).collect()),
            (a, b) if a.kind_name() != b.kind_name() => {
                return Err(Error::NotSummable(format!("kinds differ ({} and {})", a.kind_name(), b.kind_name())))
            }
            (Payload::LowRank { .. } | Payload::Layered(_), _) => {
                return Err(Error::NotSummable(
                    "low-rank factors are reduced one at a time (all-reduce P, orthogonalise, all-reduce Q), not as a product".into(),
                ))
            }
            (a, _) => {
                return Err(Error::NotSummable(format!(
                    "{} tensors carry per-rank indices or scales; gather them and accumulate, or decompress, sum and re-compress",
                    a.kind_name()
                )))
            }
        };
        Ok(Compressed {
            len: self.len,
            payload,
        })
    }
}
