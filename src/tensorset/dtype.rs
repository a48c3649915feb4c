//! DLPack element types ([`DType`], DLPack 1.1's `DLDataType`): the type codes, the common types
//! as constants, and their sizes in bytes.

/// A DLPack `DLDataType`: type code ([`DType::INT`] .. [`DType::FLOAT4_E2M1FN`], DLPack 1.1), bits
/// per lane and lanes (1 for scalars).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct DType {
    /// `DLDataTypeCode`.
    pub code: u8,
    /// Bits of one lane.
    pub bits: u8,
    /// Lanes (vector width; 1 for scalars).
    pub lanes: u16,
}

impl DType {
    /// `kDLInt`.
    pub const INT: u8 = 0;
    /// `kDLUInt`.
    pub const UINT: u8 = 1;
    /// `kDLFloat`.
    pub const FLOAT: u8 = 2;
    /// `kDLOpaqueHandle` (no size: refused in tensor sets).
    pub const OPAQUE_HANDLE: u8 = 3;
    /// `kDLBfloat`.
    pub const BFLOAT: u8 = 4;
    /// `kDLComplex`.
    pub const COMPLEX: u8 = 5;
    /// `kDLBool`.
    pub const BOOL_CODE: u8 = 6;
    /// `kDLFloat8_e3m4`.
    pub const FLOAT8_E3M4: u8 = 7;
    /// `kDLFloat8_e4m3`.
    pub const FLOAT8_E4M3: u8 = 8;
    /// `kDLFloat8_e4m3b11fnuz`.
    pub const FLOAT8_E4M3B11FNUZ: u8 = 9;
    /// `kDLFloat8_e4m3fn`.
    pub const FLOAT8_E4M3FN: u8 = 10;
    /// `kDLFloat8_e4m3fnuz`.
    pub const FLOAT8_E4M3FNUZ: u8 = 11;
    /// `kDLFloat8_e5m2`.
    pub const FLOAT8_E5M2: u8 = 12;
    /// `kDLFloat8_e5m2fnuz`.
    pub const FLOAT8_E5M2FNUZ: u8 = 13;
    /// `kDLFloat8_e8m0fnu`.
    pub const FLOAT8_E8M0FNU: u8 = 14;
    /// `kDLFloat6_e2m3fn`.
    pub const FLOAT6_E2M3FN: u8 = 15;
    /// `kDLFloat6_e3m2fn`.
    pub const FLOAT6_E3M2FN: u8 = 16;
    /// `kDLFloat4_e2m1fn`.
    pub const FLOAT4_E2M1FN: u8 = 17;
    /// The highest type code DLPack 1.1 defines.
    pub const MAX_CODE: u8 = 17;

    /// A scalar type of `code` and `bits`.
    pub const fn scalar(code: u8, bits: u8) -> DType {
        DType {
            code,
            bits,
            lanes: 1,
        }
    }

    /// `float32`.
    pub const F32: DType = DType::scalar(Self::FLOAT, 32);
    /// `float16`.
    pub const F16: DType = DType::scalar(Self::FLOAT, 16);
    /// `bfloat16`.
    pub const BF16: DType = DType::scalar(Self::BFLOAT, 16);
    /// `float64`.
    pub const F64: DType = DType::scalar(Self::FLOAT, 64);
    /// `int8`.
    pub const I8: DType = DType::scalar(Self::INT, 8);
    /// `int16`.
    pub const I16: DType = DType::scalar(Self::INT, 16);
    /// `int32`.
    pub const I32: DType = DType::scalar(Self::INT, 32);
    /// `int64`.
    pub const I64: DType = DType::scalar(Self::INT, 64);
    /// `uint8`.
    pub const U8: DType = DType::scalar(Self::UINT, 8);
    /// `uint16`.
    pub const U16: DType = DType::scalar(Self::UINT, 16);
    /// `uint32`.
    pub const U32: DType = DType::scalar(Self::UINT, 32);
    /// `uint64`.
    pub const U64: DType = DType::scalar(Self::UINT, 64);
    /// `bool` (one byte each, as PyTorch stores it).
    pub const BOOL: DType = DType::scalar(Self::BOOL_CODE, 8);
    /// `complex64`.
    pub const C64: DType = DType::scalar(Self::COMPLEX, 64);
    /// `complex128`.
    pub const C128: DType = DType::scalar(Self::COMPLEX, 128);
    /// `float8_e4m3fn` (PyTorch's `torch.float8_e4m3fn`).
    pub const F8_E4M3FN: DType = DType::scalar(Self::FLOAT8_E4M3FN, 8);
    /// `float8_e4m3fnuz`.
    pub const F8_E4M3FNUZ: DType = DType::scalar(Self::FLOAT8_E4M3FNUZ, 8);
    /// `float8_e5m2` (PyTorch's `torch.float8_e5m2`).
    pub const F8_E5M2: DType = DType::scalar(Self::FLOAT8_E5M2, 8);
    /// `float8_e5m2fnuz`.
    pub const F8_E5M2FNUZ: DType = DType::scalar(Self::FLOAT8_E5M2FNUZ, 8);
    /// `float8_e8m0fnu`.
    pub const F8_E8M0FNU: DType = DType::scalar(Self::FLOAT8_E8M0FNU, 8);

    /// Bytes of one element (`bits × lanes / 8`); `None` for a type code DLPack 1.1 does not
    /// define, the opaque handle, zero bits or lanes, or a size that is not a whole number of
    /// bytes (a single fp4 or fp6 lane: pack them as lanes).
    pub fn size_bytes(&self) -> Option<usize> {
        if self.code > Self::MAX_CODE || self.code == Self::OPAQUE_HANDLE {
            return None;
        }
        let bits = usize::from(self.bits) * usize::from(self.lanes);
        (bits != 0 && bits.is_multiple_of(8)).then_some(bits / 8)
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Each kind's name, and the bits its name says where it says them (`bool`: 8 bits a
        // value; `float8_e4m3fn`: 8): named as PyTorch and NumPy name it where it has those
        // bits; else its bits follow (after a `/` where the name ends in a number).
        let (name, own) = match self.code {
            Self::INT => ("int", None),
            Self::UINT => ("uint", None),
            Self::FLOAT => ("float", None),
            Self::OPAQUE_HANDLE => ("handle", None),
            Self::BFLOAT => ("bfloat", None),
            Self::COMPLEX => ("complex", None),
            Self::BOOL_CODE => ("bool", Some(8)),
            Self::FLOAT8_E3M4 => ("float8_e3m4/", Some(8)),
            Self::FLOAT8_E4M3 => ("float8_e4m3/", Some(8)),
            Self::FLOAT8_E4M3B11FNUZ => ("float8_e4m3b11fnuz/", Some(8)),
            Self::FLOAT8_E4M3FN => ("float8_e4m3fn/", Some(8)),
            Self::FLOAT8_E4M3FNUZ => ("float8_e4m3fnuz/", Some(8)),
            Self::FLOAT8_E5M2 => ("float8_e5m2/", Some(8)),
            Self::FLOAT8_E5M2FNUZ => ("float8_e5m2fnuz/", Some(8)),
            Self::FLOAT8_E8M0FNU => ("float8_e8m0fnu/", Some(8)),
            Self::FLOAT6_E2M3FN => ("float6_e2m3fn/", Some(6)),
            Self::FLOAT6_E3M2FN => ("float6_e3m2fn/", Some(6)),
            Self::FLOAT4_E2M1FN => ("float4_e2m1fn/", Some(4)),
            _ => return write!(f, "code{}/{}x{}", self.code, self.bits, self.lanes),
        };
        if own == Some(self.bits) {
            write!(f, "{}", name.trim_end_matches('/'))?;
        } else {
            write!(f, "{name}{}", self.bits)?;
        }
        if self.lanes != 1 {
            write!(f, "x{}", self.lanes)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_follow_bits_and_lanes_and_unknown_codes_have_none() {
        assert_eq!(DType::F32.size_bytes(), Some(4));
        assert_eq!(DType::BF16.size_bytes(), Some(2));
        assert_eq!(DType::F8_E4M3FN.size_bytes(), Some(1));
        assert_eq!(DType::C128.size_bytes(), Some(16));
        assert_eq!(DType::BOOL.size_bytes(), Some(1));
        let fp4x2 = DType {
            code: DType::FLOAT4_E2M1FN,
            bits: 4,
            lanes: 2,
        };
        assert_eq!(fp4x2.size_bytes(), Some(1));
        assert_eq!(DType::scalar(DType::FLOAT4_E2M1FN, 4).size_bytes(), None);
        assert_eq!(DType::scalar(18, 8).size_bytes(), None);
        assert_eq!(DType::scalar(DType::OPAQUE_HANDLE, 64).size_bytes(), None);
        assert_eq!(DType::scalar(DType::FLOAT, 0).size_bytes(), None);
        assert_eq!(DType::BF16.to_string(), "bfloat16");
        // Named as PyTorch names them (the names `tensors`' specs take), bits only where they
        // are not the kind's own.
        assert_eq!(DType::BOOL.to_string(), "bool");
        assert_eq!(DType::F8_E4M3FN.to_string(), "float8_e4m3fn");
        assert_eq!(DType::F8_E5M2.to_string(), "float8_e5m2");
        assert_eq!(DType::scalar(DType::BOOL_CODE, 16).to_string(), "bool16");
        assert_eq!(
            DType::scalar(DType::FLOAT8_E5M2, 16).to_string(),
            "float8_e5m2/16"
        );
        assert_eq!(fp4x2.to_string(), "float4_e2m1fnx2");
        assert_eq!(DType::I64.to_string(), "int64");
    }
}
