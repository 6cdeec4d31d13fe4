//! The two FP8 formats of Hopper/Ada/Blackwell tensor cores and their scalar codecs.
//!
//! | | e4m3 (`E4M3FN`) | e5m2 |
//! |---|---|---|
//! | bits | sign, 4 exponent (bias 7), 3 mantissa | sign, 5 exponent (bias 15), 2 mantissa |
//! | largest finite | 448 = 1.75·2^8 (`0x7e`) | 57344 = 1.75·2^15 (`0x7b`) |
//! | smallest normal | 2^-6 | 2^-14 |
//! | smallest subnormal | 2^-9 | 2^-16 |
//! | infinity | none | `0x7c`/`0xfc` |
//! | NaN | `0x7f`/`0xff` only | exponent 31 with a non-zero mantissa |
//!
//! # Encoding contract (CUDA's `__nv_cvt_float_to_fp8(x, __NV_SATFINITE, ..)`)
//! Round to nearest, ties to even, with subnormals, then **saturate**: every finite value
//! whose rounding would exceed the largest finite value becomes ±max, and so do **±∞** (in
//! both formats: CUDA's satfinite conversion compares `|x|` against the overflow threshold
//! `max + ½ulp` before anything else, and `∞` is above it; the PTX `cvt.rn.satfinite` rule
//! is the same: "results greater than MAX_NORM saturate to MAX_NORM"). NaN becomes the
//! canonical `0x7f` in both formats, sign dropped (CUDA's float path canonicalises a NaN input
//! to `0x7fffffff` first). `−0` keeps its sign (`0x80`), and so does any value that rounds
//! to zero.
//!
//! The encoder works on the f32 bit pattern: a normal result is the bit pattern rounded at
//! the FP8 mantissa width (an integer add of `½ulp − 1 + lsb`) with the exponent re-biased; a
//! subnormal result lets the FPU do the round-to-nearest-even by adding a power of two whose
//! ulp is the FP8 subnormal spacing. Both are branch-free selects, so a slice loop vectorises
//! (see [`crate::codec`]).

/// One of the two FP8 formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fp8Format {
    /// 4 exponent bits, 3 mantissa bits, no infinity (`E4M3FN`): the format of Q, K, V and P
    /// in FlashAttention-3's FP8 forward.
    E4m3,
    /// 5 exponent bits, 2 mantissa bits, IEEE-like infinities and NaNs: the gradient format.
    E5m2,
}

/// Bit-level parameters of a format, shared by the scalar and the vectorised codecs.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Params {
    /// Explicit mantissa bits.
    pub mantissa_bits: u32,
    /// Exponent bias.
    pub bias: u32,
    /// f32 bit pattern of the smallest normal value.
    pub min_normal_bits: u32,
    /// f32 bit pattern from which (inclusive) every value saturates to the max code:
    /// `max + ½ulp` (the tie there rounds to even, which is the max code in e4m3 and the
    /// would-be infinity in e5m2, so saturating at the tie is right in both).
    pub saturate_bits: u32,
    /// Code of the largest finite value.
    pub max_code: u8,
    /// A power of two whose f32 ulp is the format's subnormal spacing.
    pub subnormal_magic: f32,
}

/// e4m3 parameters.
pub(crate) const E4M3: Params = Params {
    mantissa_bits: 3,
    bias: 7,
    min_normal_bits: 0x3c80_0000, // 2^-6
    saturate_bits: 0x43e8_0000,   // 464 = 448 + 16
    max_code: 0x7e,
    subnormal_magic: 16384.0, // 2^14: ulp 2^-9
};

/// e5m2 parameters.
pub(crate) const E5M2: Params = Params {
    mantissa_bits: 2,
    bias: 15,
    min_normal_bits: 0x3880_0000, // 2^-14
    saturate_bits: 0x4770_0000,   // 61440 = 57344 + 4096
    max_code: 0x7b,
    subnormal_magic: 128.0, // 2^7: ulp 2^-16
};

/// The canonical NaN code the encoder produces (both formats).
pub const NAN_CODE: u8 = 0x7f;

impl Fp8Format {
    /// Both formats, for sweeps.
    pub const ALL: [Fp8Format; 2] = [Fp8Format::E4m3, Fp8Format::E5m2];

    pub(crate) const fn params(self) -> Params {
        match self {
            Fp8Format::E4m3 => E4M3,
            Fp8Format::E5m2 => E5M2,
        }
    }

    /// Short name (`"e4m3"`, `"e5m2"`).
    pub const fn name(self) -> &'static str {
        match self {
            Fp8Format::E4m3 => "e4m3",
            Fp8Format::E5m2 => "e5m2",
        }
    }

    /// Largest finite value: 448 (e4m3) or 57344 (e5m2).
    pub const fn max(self) -> f32 {
        match self {
            Fp8Format::E4m3 => 448.0,
            Fp8Format::E5m2 => 57344.0,
        }
    }

    /// Smallest positive normal value: 2^-6 (e4m3) or 2^-14 (e5m2).
    pub const fn min_normal(self) -> f32 {
        f32::from_bits(self.params().min_normal_bits)
    }

    /// Smallest positive subnormal value: 2^-9 (e4m3) or 2^-16 (e5m2).
    pub const fn min_subnormal(self) -> f32 {
        match self {
            Fp8Format::E4m3 => 1.0 / 512.0,
            Fp8Format::E5m2 => 1.0 / 65536.0,
        }
    }

    /// Explicit mantissa bits: 3 (e4m3) or 2 (e5m2).
    pub const fn mantissa_bits(self) -> u32 {
        self.params().mantissa_bits
    }

    /// Exponent bias: 7 (e4m3) or 15 (e5m2).
    pub const fn bias(self) -> u32 {
        self.params().bias
    }

    /// `log2` of [`Fp8Format::max`], the headroom available to a P operand: 8.807 for e4m3.
    pub fn log2_max(self) -> f32 {
        self.max().log2()
    }

    /// Whether `code` is a NaN of this format.
    pub const fn is_nan(self, code: u8) -> bool {
        match self {
            Fp8Format::E4m3 => code & 0x7f == 0x7f,
            Fp8Format::E5m2 => code & 0x7f > 0x7c,
        }
    }

    /// Decodes one code (exact: every FP8 value is an f32).
    #[inline]
    pub fn decode(self, code: u8) -> f32 {
        match self {
            Fp8Format::E4m3 => E4M3_TABLE[code as usize],
            Fp8Format::E5m2 => E5M2_TABLE[code as usize],
        }
    }

    /// Encodes one f32 with saturating round-to-nearest-even (see the module doc).
    #[inline]
    pub fn encode(self, x: f32) -> u8 {
        match self {
            Fp8Format::E4m3 => encode_with(x, &E4M3),
            Fp8Format::E5m2 => encode_with(x, &E5M2),
        }
    }

    /// `decode(encode(x))`: the value the format keeps of `x`.
    #[inline]
    pub fn round(self, x: f32) -> f32 {
        self.decode(self.encode(x))
    }
}

/// The branch-free encoder shared by the scalar and slice paths.
#[inline(always)]
pub(crate) fn encode_with(x: f32, p: &Params) -> u8 {
    let bits = x.to_bits();
    let sign = (bits >> 24) & 0x80;
    let abs = bits & 0x7fff_ffff;
    let drop = 23 - p.mantissa_bits;
    // Normal range: round the f32 pattern at the FP8 mantissa width (ties to even; a carry
    // into the exponent is the right answer), then re-bias the exponent.
    let lsb = (abs >> drop) & 1;
    let rounded = abs.wrapping_add((1u32 << (drop - 1)) - 1 + lsb);
    let normal = (rounded >> drop).wrapping_sub((127 - p.bias) << p.mantissa_bits);
    // Subnormal range: |x| + 2^k rounds |x| to a multiple of the subnormal spacing (the FPU's
    // round-to-nearest-even); the bit difference is the code, up to the smallest normal code.
    let shifted = f32::from_bits(abs) + p.subnormal_magic;
    let subnormal = shifted.to_bits().wrapping_sub(p.subnormal_magic.to_bits());
    let magnitude = if abs < p.min_normal_bits {
        subnormal
    } else {
        normal
    };
    let magnitude = if abs >= p.saturate_bits {
        p.max_code as u32
    } else {
        magnitude
    };
    let code = magnitude | sign;
    let code = if abs > 0x7f80_0000 {
        NAN_CODE as u32
    } else {
        code
    };
    code as u8
}

/// Decodes from the bit fields (used at compile time to build the lookup tables; the tests
/// check it against an independent decoder written from the format definition).
const fn decode_fields(code: u8, format: Fp8Format) -> f32 {
    let p = format.params();
    let m = p.mantissa_bits;
    let exp_mask = (0x7f >> m) as u32;
    let sign = ((code as u32) >> 7) << 31;
    let exponent = ((code as u32) >> m) & exp_mask;
    let mantissa = (code as u32) & ((1 << m) - 1);
    if format.is_nan(code) {
        return f32::NAN;
    }
    if exponent == exp_mask {
        // Only e5m2 gets here (e4m3's all-ones exponent is finite except for 0x7f).
        if matches!(format, Fp8Format::E5m2) {
            return f32::from_bits(sign | 0x7f80_0000);
        }
    }
    if exponent == 0 {
        // Subnormal: mantissa · 2^(1 − bias − m), exact in f32.
        let ulp = f32::from_bits((127 + 1 - p.bias - m) << 23);
        let magnitude = mantissa as f32 * ulp;
        return if sign != 0 { -magnitude } else { magnitude };
    }
    f32::from_bits(sign | ((exponent + 127 - p.bias) << 23) | (mantissa << (23 - m)))
}

const fn build_table(format: Fp8Format) -> [f32; 256] {
    let mut table = [0.0f32; 256];
    let mut code = 0;
    while code < 256 {
        table[code] = decode_fields(code as u8, format);
        code += 1;
    }
    table
}

/// Every e4m3 code's value, indexed by code.
pub static E4M3_TABLE: [f32; 256] = build_table(Fp8Format::E4m3);
/// Every e5m2 code's value, indexed by code.
pub static E5M2_TABLE: [f32; 256] = build_table(Fp8Format::E5m2);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn landmarks() {
        let f = Fp8Format::E4m3;
        assert_eq!(f.decode(0x7e), 448.0);
        assert_eq!(f.decode(0xfe), -448.0);
        assert_eq!(f.decode(0x08), f.min_normal());
        assert_eq!(f.decode(0x01), f.min_subnormal());
        assert!(f.decode(0x7f).is_nan() && f.decode(0xff).is_nan());
        assert_eq!(f.encode(f32::INFINITY), 0x7e);
        assert_eq!(f.encode(f32::NEG_INFINITY), 0xfe);
        assert_eq!(f.encode(-0.0), 0x80);
        assert_eq!(f.encode(f32::NAN), NAN_CODE);
        let g = Fp8Format::E5m2;
        assert_eq!(g.decode(0x7b), 57344.0);
        assert_eq!(g.decode(0x7c), f32::INFINITY);
        assert_eq!(g.decode(0xfc), f32::NEG_INFINITY);
        assert_eq!(g.encode(f32::INFINITY), 0x7b);
        assert_eq!(g.encode(61440.0), 0x7b);
        assert_eq!(g.encode(-1e30), 0xfb);
        assert_eq!(g.decode(0x04), g.min_normal());
        assert_eq!(g.decode(0x01), g.min_subnormal());
    }
}
