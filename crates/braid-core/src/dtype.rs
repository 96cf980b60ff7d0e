//! Element types and reductions, with the stable numeric codes the C ABI and the wire use.

use std::fmt;
use std::str::FromStr;

use crate::Error;

/// The element type of a buffer.
///
/// The discriminants are stable: the C ABI (`braid_dtype_t`) and the wire format use them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DType {
    I8 = 0,
    U8 = 1,
    I32 = 2,
    U32 = 3,
    I64 = 4,
    U64 = 5,
    F16 = 6,
    F32 = 7,
    F64 = 8,
    BF16 = 9,
}

impl DType {
    /// Every supported dtype, in code order.
    pub const ALL: [DType; 10] = [
        DType::I8,
        DType::U8,
        DType::I32,
        DType::U32,
        DType::I64,
        DType::U64,
        DType::F16,
        DType::F32,
        DType::F64,
        DType::BF16,
    ];

    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DType::I8 | DType::U8 => 1,
            DType::F16 | DType::BF16 => 2,
            DType::I32 | DType::U32 | DType::F32 => 4,
            DType::I64 | DType::U64 | DType::F64 => 8,
        }
    }

    /// The type partial results are kept in: f16 and bf16 accumulate in f32, every other type in itself.
    pub const fn accumulator(self) -> DType {
        match self {
            DType::F16 | DType::BF16 => DType::F32,
            other => other,
        }
    }

    /// Whether the type is a floating-point type.
    pub const fn is_float(self) -> bool {
        matches!(self, DType::F16 | DType::BF16 | DType::F32 | DType::F64)
    }

    /// The name used on the command line, in logs and in JSON (nccl-tests spelling).
    pub const fn name(self) -> &'static str {
        match self {
            DType::I8 => "int8",
            DType::U8 => "uint8",
            DType::I32 => "int32",
            DType::U32 => "uint32",
            DType::I64 => "int64",
            DType::U64 => "uint64",
            DType::F16 => "half",
            DType::F32 => "float",
            DType::F64 => "double",
            DType::BF16 => "bfloat16",
        }
    }

    /// The dtype with numeric code `code`, or an error naming the bad code.
    pub fn from_code(code: u32) -> Result<DType, Error> {
        DType::ALL
            .iter()
            .copied()
            .find(|d| *d as u32 == code)
            .ok_or_else(|| Error::invalid(format!("unknown dtype code {code} (valid: 0..=9)")))
    }

    /// The number of bytes `count` elements take, or an error when that overflows.
    pub fn bytes_for(self, count: usize) -> Result<usize, Error> {
        count
            .checked_mul(self.size())
            .filter(|b| *b <= isize::MAX as usize)
            .ok_or_else(|| {
                Error::invalid(format!(
                    "count {count} of {} overflows the address space",
                    self.name()
                ))
            })
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        let d = match s.to_ascii_lowercase().as_str() {
            "int8" | "i8" | "char" => DType::I8,
            "uint8" | "u8" => DType::U8,
            "int32" | "i32" | "int" => DType::I32,
            "uint32" | "u32" => DType::U32,
            "int64" | "i64" => DType::I64,
            "uint64" | "u64" => DType::U64,
            "half" | "f16" | "float16" => DType::F16,
            "float" | "f32" | "float32" => DType::F32,
            "double" | "f64" | "float64" => DType::F64,
            "bfloat16" | "bf16" => DType::BF16,
            _ => {
                return Err(Error::invalid(format!(
                    "unknown dtype '{s}' (expected one of int8 uint8 int32 uint32 int64 uint64 half float double bfloat16)"
                )))
            }
        };
        Ok(d)
    }
}

/// A reduction applied element-wise across ranks.
///
/// The discriminants are stable (C ABI `braid_redop_t`, wire format). The bitwise reductions apply to
/// the integer dtypes only ([`ReduceOp::check_dtype`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ReduceOp {
    Sum = 0,
    Prod = 1,
    Max = 2,
    Min = 3,
    Avg = 4,
    /// Bitwise AND (integer dtypes).
    BitAnd = 5,
    /// Bitwise OR (integer dtypes).
    BitOr = 6,
    /// Bitwise XOR (integer dtypes).
    BitXor = 7,
}

impl ReduceOp {
    /// The arithmetic reductions, which every dtype has (and the GPU kernels implement), in code order.
    pub const ARITHMETIC: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Max,
        ReduceOp::Min,
        ReduceOp::Avg,
    ];

    /// The bitwise reductions, for the integer dtypes, in code order.
    pub const BITWISE: [ReduceOp; 3] = [ReduceOp::BitAnd, ReduceOp::BitOr, ReduceOp::BitXor];

    /// Every reduction, in code order.
    pub const ALL: [ReduceOp; 8] = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Max,
        ReduceOp::Min,
        ReduceOp::Avg,
        ReduceOp::BitAnd,
        ReduceOp::BitOr,
        ReduceOp::BitXor,
    ];

    /// The name used on the command line, in logs and in JSON.
    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::Avg => "avg",
            ReduceOp::BitAnd => "band",
            ReduceOp::BitOr => "bor",
            ReduceOp::BitXor => "bxor",
        }
    }

    /// Whether this is a bitwise reduction.
    pub const fn is_bitwise(self) -> bool {
        matches!(self, ReduceOp::BitAnd | ReduceOp::BitOr | ReduceOp::BitXor)
    }

    /// Whether elements of `dtype` reduce with this op: the bitwise reductions take integers only.
    pub fn check_dtype(self, dtype: DType) -> Result<(), Error> {
        if self.is_bitwise() && dtype.is_float() {
            return Err(Error::invalid(format!(
                "the bitwise reduction {self} applies to integer dtypes, not {dtype}"
            )));
        }
        Ok(())
    }

    /// The reduction with numeric code `code`, or an error naming the bad code.
    pub fn from_code(code: u32) -> Result<ReduceOp, Error> {
        ReduceOp::ALL
            .iter()
            .copied()
            .find(|o| *o as u32 == code)
            .ok_or_else(|| Error::invalid(format!("unknown reduce op code {code} (valid: 0..=7)")))
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ReduceOp {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        match s.to_ascii_lowercase().as_str() {
            "sum" => Ok(ReduceOp::Sum),
            "prod" => Ok(ReduceOp::Prod),
            "max" => Ok(ReduceOp::Max),
            "min" => Ok(ReduceOp::Min),
            "avg" => Ok(ReduceOp::Avg),
            "band" => Ok(ReduceOp::BitAnd),
            "bor" => Ok(ReduceOp::BitOr),
            "bxor" => Ok(ReduceOp::BitXor),
            _ => Err(Error::invalid(format!(
                "unknown reduce op '{s}' (expected one of sum prod max min avg band bor bxor)"
            ))),
        }
    }
}

/// A Rust type that braid can move and reduce.
pub trait Element: bytemuck::Pod + Send + Sync + 'static {
    /// The dtype this Rust type stands for.
    const DTYPE: DType;
}

macro_rules! element {
    ($($t:ty => $d:ident),* $(,)?) => { $(impl Element for $t { const DTYPE: DType = DType::$d; })* };
}
element!(i8 => I8, u8 => U8, i32 => I32, u32 => U32, i64 => I64, u64 => U64, half::f16 => F16,
    f32 => F32, f64 => F64, half::bf16 => BF16);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_reject_unknown() {
        for d in DType::ALL {
            assert_eq!(DType::from_code(d as u32).unwrap(), d);
            assert_eq!(d.name().parse::<DType>().unwrap(), d);
        }
        for o in ReduceOp::ALL {
            assert_eq!(ReduceOp::from_code(o as u32).unwrap(), o);
            assert_eq!(o.name().parse::<ReduceOp>().unwrap(), o);
        }
        assert!(DType::from_code(10).unwrap_err().to_string().contains("10"));
        assert!(ReduceOp::from_code(8).is_err());
        for o in ReduceOp::BITWISE {
            assert!(o.is_bitwise());
            for d in DType::ALL {
                assert_eq!(o.check_dtype(d).is_ok(), !d.is_float(), "{o} {d}");
            }
        }
        for o in ReduceOp::ARITHMETIC {
            assert!(!o.is_bitwise());
            assert!(DType::ALL.iter().all(|&d| o.check_dtype(d).is_ok()));
        }
        assert!(ReduceOp::from_code(77)
            .unwrap_err()
            .to_string()
            .contains("77"));
        assert!("complex"
            .parse::<DType>()
            .unwrap_err()
            .to_string()
            .contains("complex"));
    }

    #[test]
    fn byte_counts_check_overflow() {
        assert_eq!(DType::F64.bytes_for(3).unwrap(), 24);
        assert!(DType::F64.bytes_for(usize::MAX / 4).is_err());
        assert!(DType::U8.bytes_for(usize::MAX).is_err());
    }
}
