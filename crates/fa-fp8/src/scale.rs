//! Scaling: per-tensor (the baseline) and per-block quantisation of Q, K and V.
//!
//! A scale maps a group's largest magnitude onto the format's largest finite value:
//! `scale = amax / max` (optionally rounded **up** to a power of two, so nothing saturates and
//! the dequantising multiply is exact), code `= encode(x · (1/scale))`, value `= decode(code) ·
//! scale`. `amax` is taken over the finite entries: a NaN stays NaN through the codec and
//! reaches the output as in the reference; an infinity saturates to `±max·scale` (CUDA's
//! satfinite) instead of widening the range to infinity. An all-zero group gets scale 1.
//!
//! # Groups
//! - [`Granularity::PerTensor`]: one scale for the whole tensor (all batches, heads, tokens).
//! - [`Granularity::PerBlock`]: one scale per `rows × head_dim` tile of one head of one
//!   sequence, tiles starting at the sequence's first token: exactly the tiles a kernel with
//!   `Br = rows` (for Q) or `Bc = rows` (for K and V) loads, so the kernel fuses the
//!   dequantisation into the tile it consumes (Q·Kᵀ tile `× scale_q·scale_k`, P·V tile
//!   `× scale_v`).
//!
//! # Scale layout (what a GPU kernel reads)
//! [`ScaleLayout::PerBlock`]: a dense f32 array `[batch][heads][blocks]`, `blocks =
//! ceil(max_seqlen / rows)`; the scale of token `t` of sequence `b`, head `h` is at
//! `(b·heads + h)·blocks + t / rows` ([`ScaleLayout::index`]). For a packed (varlen) problem
//! `b` is the sequence index and tokens count from the sequence's start; entries past a short
//! sequence's last block are 1.0. `heads` is `heads_q` for Q and `heads_kv` for K and V (GQA
//! query heads read their KV head's scales). [`ScaleLayout::PerTensor`]: one f32.
//! The codes keep the input's layout and strides (BSHD), one byte per element.

use crate::codec::{decode_scaled, encode_scaled};
use crate::error::Fp8Error;
use crate::format::Fp8Format;
use softmax_core::{Problem, Tensor};

/// How many values share one scale.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Granularity {
    /// One scale for the whole tensor.
    PerTensor,
    /// One scale per `rows` tokens × head dim of one head of one sequence.
    PerBlock {
        /// Tokens per block (the kernel's `Br` for Q, `Bc` for K and V).
        rows: usize,
    },
}

/// How to quantise one tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScaleOptions {
    /// Target format.
    pub format: Fp8Format,
    /// Scale groups.
    pub granularity: Granularity,
    /// Round each scale up to a power of two.
    pub power_of_two: bool,
}

/// Which input of the attention problem a tensor is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Operand {
    /// Queries (`heads_q` heads of `head_dim`).
    Q,
    /// Keys (`heads_kv` heads of `head_dim`).
    K,
    /// Values (`heads_kv` heads of `head_dim_v`).
    V,
}

impl Operand {
    fn tensor(self) -> Tensor {
        match self {
            Operand::Q => Tensor::Q,
            Operand::K => Tensor::K,
            Operand::V => Tensor::V,
        }
    }
}

/// Where a tensor's scales live (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScaleLayout {
    /// One scale.
    PerTensor,
    /// `[batch][heads][blocks]`, `rows` tokens per block.
    PerBlock {
        /// Sequences.
        batch: usize,
        /// Heads of this tensor.
        heads: usize,
        /// Blocks per (sequence, head): `ceil(max_seqlen / rows)`.
        blocks: usize,
        /// Tokens per block.
        rows: usize,
    },
}

impl ScaleLayout {
    /// Number of scales.
    pub fn len(&self) -> usize {
        match *self {
            ScaleLayout::PerTensor => 1,
            ScaleLayout::PerBlock {
                batch,
                heads,
                blocks,
                ..
            } => batch * heads * blocks,
        }
    }

    /// Whether there are no scales (never: at least one).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Index of the scale of token `token` (within sequence `b`) of head `h`.
    #[inline]
    pub fn index(&self, b: usize, h: usize, token: usize) -> usize {
        match *self {
            ScaleLayout::PerTensor => 0,
            ScaleLayout::PerBlock {
                heads,
                blocks,
                rows,
                ..
            } => (b * heads + h) * blocks + token / rows,
        }
    }
}

/// `amax / format.max()` (rounded up to a power of two if asked), 1 for an all-zero group,
/// never below the smallest normal f32 (so that `1/scale` is finite).
pub fn scale_from_amax(amax: f32, format: Fp8Format, power_of_two: bool) -> f32 {
    if amax.is_nan() || amax <= 0.0 || amax.is_infinite() {
        return 1.0;
    }
    let mut scale = (amax / format.max()).max(f32::MIN_POSITIVE);
    if power_of_two {
        let bits = scale.to_bits();
        // Up to the next power of two unless already one (a zero mantissa field).
        if bits & 0x007f_ffff != 0 {
            scale = f32::from_bits((bits & 0x7f80_0000) + 0x0080_0000);
        }
    }
    scale
}

/// Largest finite magnitude of a slice (0 if none).
#[inline]
pub fn amax(values: &[f32]) -> f32 {
    values.iter().fold(0.0f32, |m, &x| {
        let a = x.abs();
        if a.is_finite() && a > m {
            a
        } else {
            m
        }
    })
}

/// A quantised tensor: codes in the input's layout plus its scales.
#[derive(Clone, Debug, PartialEq)]
pub struct Quantized {
    /// Which input it is.
    pub operand: Operand,
    /// Format of the codes.
    pub format: Fp8Format,
    /// One code per element, at the input's offsets (elements outside the tensor are 0).
    pub codes: Vec<u8>,
    /// The scales, laid out as `layout` says.
    pub scales: Vec<f32>,
    /// Scale layout.
    pub layout: ScaleLayout,
}

/// Geometry of one operand of a problem: its heads, row length and row offsets.
struct Geometry<'p, 'a> {
    problem: &'p Problem<'a>,
    operand: Operand,
}

impl Geometry<'_, '_> {
    fn heads(&self) -> usize {
        match self.operand {
            Operand::Q => self.problem.heads_q(),
            Operand::K | Operand::V => self.problem.heads_kv(),
        }
    }
    fn dim(&self) -> usize {
        match self.operand {
            Operand::Q | Operand::K => self.problem.head_dim(),
            Operand::V => self.problem.head_dim_v(),
        }
    }
    fn seqlen(&self, b: usize) -> usize {
        let s = self.problem.seq(b);
        match self.operand {
            Operand::Q => s.seqlen_q,
            Operand::K | Operand::V => s.seqlen_k,
        }
    }
    fn max_seqlen(&self) -> usize {
        match self.operand {
            Operand::Q => self.problem.max_seqlen_q(),
            Operand::K | Operand::V => self.problem.max_seqlen_k(),
        }
    }
    fn offset(&self, b: usize, t: usize, h: usize) -> usize {
        match self.operand {
            Operand::Q => self.problem.q_offset(b, t, h),
            Operand::K => self.problem.k_offset(b, t, h),
            Operand::V => self.problem.v_offset(b, t, h),
        }
    }
    fn required_len(&self) -> usize {
        let lens = self.problem.min_buffer_lens();
        match self.operand {
            Operand::Q => lens.q,
            Operand::K => lens.k,
            Operand::V => lens.v,
        }
    }
    fn check(&self, len: usize) -> Result<(), Fp8Error> {
        let need = self.required_len();
        if len < need {
            return Err(Fp8Error::Problem(
                softmax_core::ProblemError::BufferTooSmall {
                    tensor: self.operand.tensor(),
                    needed: need,
                    len,
                },
            ));
        }
        Ok(())
    }
    /// Calls `f(b, h, token, offset)` for every row of the tensor.
    fn for_each_row(&self, mut f: impl FnMut(usize, usize, usize, usize)) {
        for b in 0..self.problem.batch() {
            for h in 0..self.heads() {
                for t in 0..self.seqlen(b) {
                    f(b, h, t, self.offset(b, t, h));
                }
            }
        }
    }
}

/// Applies `transform` to every row (one head of one token) of the operand in `data`:
/// the Hadamard rotation of Q and K before quantisation.
pub(crate) fn map_rows(
    problem: &Problem,
    operand: Operand,
    data: &mut [f32],
    mut transform: impl FnMut(&mut [f32]),
) -> Result<(), Fp8Error> {
    let geo = Geometry { problem, operand };
    geo.check(data.len())?;
    let d = geo.dim();
    geo.for_each_row(|_, _, _, off| transform(&mut data[off..off + d]));
    Ok(())
}

/// Quantises one operand of `problem` (whose buffer is `data`) to FP8.
pub fn quantize(
    problem: &Problem,
    operand: Operand,
    data: &[f32],
    options: &ScaleOptions,
) -> Result<Quantized, Fp8Error> {
    let geo = Geometry { problem, operand };
    geo.check(data.len())?;
    let d = geo.dim();
    let format = options.format;
    let layout = match options.granularity {
        Granularity::PerTensor => ScaleLayout::PerTensor,
        Granularity::PerBlock { rows } => {
            if rows == 0 {
                return Err(Fp8Error::ZeroBlock);
            }
            ScaleLayout::PerBlock {
                batch: problem.batch(),
                heads: geo.heads(),
                blocks: geo.max_seqlen().div_ceil(rows).max(1),
                rows,
            }
        }
    };
    let mut amaxes = vec![0.0f32; layout.len()];
    geo.for_each_row(|b, h, t, off| {
        let slot = &mut amaxes[layout.index(b, h, t)];
        *slot = slot.max(amax(&data[off..off + d]));
    });
    let scales: Vec<f32> = amaxes
        .iter()
        .map(|&a| scale_from_amax(a, format, options.power_of_two))
        .collect();
    let mut codes = vec![0u8; data.len()];
    let mut result = Ok(());
    geo.for_each_row(|b, h, t, off| {
        let scale = scales[layout.index(b, h, t)];
        if result.is_ok() {
            result = encode_scaled(
                format,
                &data[off..off + d],
                1.0 / scale,
                &mut codes[off..off + d],
            );
        }
    });
    result?;
    Ok(Quantized {
        operand,
        format,
        codes,
        scales,
        layout,
    })
}

impl Quantized {
    /// The scale of token `token` of sequence `b`, head `h`.
    pub fn scale(&self, b: usize, h: usize, token: usize) -> f32 {
        self.scales[self.layout.index(b, h, token)]
    }

    /// The codes transposed per (sequence, head) to token-contiguous
    /// `[batch][heads][dim][padded]`, `padded = ceil(max_seqlen / pad_to)·pad_to`: the
    /// K-major V that FP8 `wgmma` needs for P·V (see the crate doc). Entries past a sequence's
    /// end are 0 (the code of +0). `problem` must be the one the tensor was quantised for.
    pub fn transposed(&self, problem: &Problem, pad_to: usize) -> Result<Vec<u8>, Fp8Error> {
        if pad_to == 0 {
            return Err(Fp8Error::ZeroBlock);
        }
        let geo = Geometry {
            problem,
            operand: self.operand,
        };
        geo.check(self.codes.len())?;
        let (heads, dim) = (geo.heads(), geo.dim());
        let padded = geo.max_seqlen().div_ceil(pad_to) * pad_to;
        let mut out = vec![0u8; problem.batch() * heads * dim * padded];
        geo.for_each_row(|b, h, t, off| {
            let base = (b * heads + h) * dim * padded;
            for (c, &code) in self.codes[off..off + dim].iter().enumerate() {
                out[base + c * padded + t] = code;
            }
        });
        Ok(out)
    }

    /// Writes `decode(code)·scale` for every element of the tensor into `out` (same layout as
    /// the input; elements outside the tensor are left as they are). `problem` must be the
    /// one the tensor was quantised for.
    pub fn dequantize_into(&self, problem: &Problem, out: &mut [f32]) -> Result<(), Fp8Error> {
        let geo = Geometry {
            problem,
            operand: self.operand,
        };
        geo.check(out.len())?;
        geo.check(self.codes.len())?;
        let d = geo.dim();
        let mut result = Ok(());
        geo.for_each_row(|b, h, t, off| {
            if result.is_ok() {
                result = decode_scaled(
                    self.format,
                    &self.codes[off..off + d],
                    self.scale(b, h, t),
                    &mut out[off..off + d],
                );
            }
        });
        result
    }
}
