//! FP8 attention on the CPU, structured as FlashAttention-3's FP8 forward, running on
//! fa-cpu's tiles.
//!
//! 1. Q and K are optionally rotated by the same randomised Hadamard `M` ([`crate::hadamard`]),
//!    which leaves `QKᵀ` unchanged and spreads outliers.
//! 2. Q, K, V are quantised to FP8 (e4m3 by default), per tensor or per block
//!    ([`crate::scale`]); with per-block scaling the blocks are the kernel's `Br × d` tiles of
//!    Q and `Bc × d` tiles of K and V.
//! 3. fa-cpu runs the tiled forward on the **dequantised** values `code·scale` — exactly the
//!    operands an FP8 kernel multiplies, up to where the scale multiply happens: a GPU
//!    kernel multiplies codes and scales the f32 product tile by `scale_q·scale_k` (or `scale_v`),
//!    here each operand is scaled before the product; the two differ by f32 rounding
//!    (~1e-7 relative), far below FP8's 2^-4. Scores, the online softmax and the P·V
//!    accumulation are f32.
//! 4. P is quantised to e4m3 on every tile, with FlashAttention-3's `2^8` offset: the
//!    unnormalised probabilities `exp2(x − m) ∈ [0, 1]` are multiplied by 256 before the
//!    conversion (so they use e4m3's range up to 448 instead of crowding into its subnormals)
//!    and divided by 256 after (FlashAttention-3 folds the offset into the exponent,
//!    `exp2(x − (m − 8))`, and its row sum carries the same factor 256, which cancels in
//!    `O = acc/ℓ`: the same arithmetic, since multiplying by a power of two is exact).
//!    The reference max moves whenever the row max grows ([`RescalePolicy::Always`]), so
//!    P ≤ 1 and `P·256 ≤ 256 < 448`; a threshold policy is accepted only when
//!    `τ + 8 < log2(448) = 8.807`, and rejected with [`Fp8Error::PRange`] otherwise.
//!
//! # The row sum uses the unquantised P
//! fa-cpu takes each row's sum `ℓ` before the hook quantises the tile, so `ℓ = Σ P` in f32
//! while the numerator is `Σ round(P)·V`. This is what FlashAttention-3's FP8 kernel does (its
//! `row_sum` is accumulated from the f32 probabilities, before the conversion to e4m3 for
//! the P·V wgmma), so the CPU path reproduces the GPU's numbers rather than a variant of them.
//! It is also sound: the rounding errors of P are zero-mean (ties to even), so they enter
//! `O` as noise of relative size ~2^-4/√(effective keys), not as a bias, and `ℓ` keeps f32
//! accuracy (and with it the LSE, which the backward pass needs). Summing the quantised P
//! instead would make each row's weights sum to exactly one (a constant V comes out exact)
//! at the price of an LSE computed from rounded terms; the accuracy example measures both
//! choices on sampled rows (see the README's results).

use crate::codec::round_in_place_unchecked;
use crate::error::Fp8Error;
use crate::format::Fp8Format;
use crate::hadamard::RandomHadamard;
use crate::scale::{map_rows, quantize, Granularity, Operand, Quantized, ScaleOptions};
use fa_cpu::{forward, Exp2Impl, ForwardOptions, ForwardStats};
use softmax_core::{BufferLens, Out, Problem, ProblemDesc, Qkv, RescalePolicy};

/// FlashAttention-3's P offset in log2 units: P is multiplied by `2^8` before the e4m3
/// conversion.
pub const P_OFFSET_LOG2: f32 = 8.0;

/// The probability hook's type (fa-cpu's `ForwardOptions::probability_hook`).
type PHook<'a> = dyn Fn(&mut [f32]) + Sync + 'a;

/// How Q, K and V are scaled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fp8Scaling {
    /// One scale per tensor (the baseline).
    PerTensor,
    /// One scale per `block_q × d` tile of Q and per `block_k × d` tile of K and V, per head.
    PerBlock {
        /// Query rows per tile (`Br`).
        block_q: usize,
        /// Keys per tile (`Bc`).
        block_k: usize,
    },
}

/// Options of an FP8 forward call.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Fp8Options {
    /// Format of Q, K and V (e4m3 in FlashAttention-3).
    pub format: Fp8Format,
    /// Scale granularity.
    pub scaling: Fp8Scaling,
    /// Round scales up to powers of two.
    pub power_of_two_scales: bool,
    /// Rotate Q and K by the randomised Hadamard transform with signs from this seed
    /// (incoherent processing); `None`: no rotation.
    pub hadamard_seed: Option<u64>,
    /// Quantise P to e4m3 (with the `2^8` offset) before P·V, as the FP8 kernel must; `false`
    /// keeps P in f32 (to isolate the error of the inputs).
    pub quantize_p: bool,
    /// Rescale policy of the online softmax: [`RescalePolicy::Always`] (the default), or a
    /// threshold `τ` with `τ + 8 < log2(448)`.
    pub rescale: RescalePolicy<f32>,
    /// Worker threads for fa-cpu (`None`: all cores).
    pub threads: Option<usize>,
}

impl Default for Fp8Options {
    /// FlashAttention-3's recipe: e4m3, per-block 128×128 scales, Hadamard on, P quantised.
    fn default() -> Self {
        Fp8Options {
            format: Fp8Format::E4m3,
            scaling: Fp8Scaling::PerBlock {
                block_q: 128,
                block_k: 128,
            },
            power_of_two_scales: false,
            hadamard_seed: Some(0x5eed_f8f8),
            quantize_p: true,
            rescale: RescalePolicy::Always,
            threads: None,
        }
    }
}

/// Checks that unnormalised probabilities under `policy`, times `2^offset_log2`, stay inside
/// e4m3: `τ + offset < log2(448)` (`τ = 0` for [`RescalePolicy::Always`]).
pub fn check_p_range(policy: &RescalePolicy<f32>, offset_log2: f32) -> Result<(), Fp8Error> {
    // The rule itself lives in softmax-core (`RescalePolicy::check`).
    policy
        .check(Fp8Format::E4m3.max(), offset_log2)
        .map_err(|_| Fp8Error::PRange {
            tau: policy.max_term_log2(),
            offset: offset_log2,
        })
}

/// Quantised operands as an FP8 kernel would receive them: codes in the inputs' layouts,
/// their scales, and the Hadamard transform applied to Q and K (if any).
#[derive(Clone, Debug)]
pub struct Fp8Operands {
    /// Queries (rotated if `hadamard` is set).
    pub q: Quantized,
    /// Keys (rotated if `hadamard` is set).
    pub k: Quantized,
    /// Values.
    pub v: Quantized,
    /// The rotation applied to Q and K.
    pub hadamard: Option<RandomHadamard>,
}

/// FP8's own checks on a validated problem: host sequence lengths, buffer lengths, the P range
/// under the rescale policy, block sizes; returns the Hadamard rotation the options ask for.
fn check(
    problem: &Problem,
    lens: BufferLens,
    opts: &Fp8Options,
) -> Result<Option<RandomHadamard>, Fp8Error> {
    problem.require_host_seqlens()?;
    problem.check_buffers(lens)?;
    check_p_range(&opts.rescale, P_OFFSET_LOG2)?;
    if let Fp8Scaling::PerBlock { block_q, block_k } = opts.scaling {
        if block_q == 0 || block_k == 0 {
            return Err(Fp8Error::ZeroBlock);
        }
    }
    match opts.hadamard_seed {
        Some(seed) => Ok(Some(RandomHadamard::new(problem.head_dim(), seed)?)),
        None => Ok(None),
    }
}

fn quantize_operands(
    problem: &Problem,
    Qkv { q, k, v }: Qkv<&[f32]>,
    hadamard: Option<RandomHadamard>,
    opts: &Fp8Options,
) -> Result<Fp8Operands, Fp8Error> {
    let (gq, gk) = match opts.scaling {
        Fp8Scaling::PerTensor => (Granularity::PerTensor, Granularity::PerTensor),
        Fp8Scaling::PerBlock { block_q, block_k } => (
            Granularity::PerBlock { rows: block_q },
            Granularity::PerBlock { rows: block_k },
        ),
    };
    let options = |granularity| ScaleOptions {
        format: opts.format,
        granularity,
        power_of_two: opts.power_of_two_scales,
    };
    let (q, k) = match &hadamard {
        Some(m) => {
            let (mut qr, mut kr) = (q.to_vec(), k.to_vec());
            map_rows(problem, Operand::Q, &mut qr, |x| m.apply_one(x))?;
            map_rows(problem, Operand::K, &mut kr, |x| m.apply_one(x))?;
            (
                quantize(problem, Operand::Q, &qr, &options(gq))?,
                quantize(problem, Operand::K, &kr, &options(gk))?,
            )
        }
        None => (
            quantize(problem, Operand::Q, q, &options(gq))?,
            quantize(problem, Operand::K, k, &options(gk))?,
        ),
    };
    let v = quantize(problem, Operand::V, v, &options(gk))?;
    Ok(Fp8Operands { q, k, v, hadamard })
}

/// Rotates (if asked) and quantises Q, K and V: the inputs of an FP8 kernel.
pub fn prepare(
    desc: &ProblemDesc,
    qkv: Qkv<&[f32]>,
    opts: &Fp8Options,
) -> Result<Fp8Operands, Fp8Error> {
    let problem = desc.validate(softmax_core::MAX_HEAD_DIM)?;
    // There is no output here: the inputs are checked, and O's length is taken as given.
    let mut lens = BufferLens::of(&qkv, &Out::<&[f32], &[f32]>::new(&[]));
    lens.o = problem.min_buffer_lens().o;
    let hadamard = check(&problem, lens, opts)?;
    quantize_operands(&problem, qkv, hadamard, opts)
}

/// FP8 attention forward (see the module doc): writes `out.o` (the problem's O layout, f32)
/// and, if given, the natural-log LSE. Q, K, V are f32 in the problem's layouts. On error
/// nothing is written.
pub fn forward_fp8(
    desc: &ProblemDesc,
    qkv: Qkv<&[f32]>,
    out: Out<&mut [f32], &mut [f32]>,
    opts: &Fp8Options,
) -> Result<ForwardStats, Fp8Error> {
    let problem = desc.validate(softmax_core::MAX_HEAD_DIM)?;
    let hadamard = check(&problem, BufferLens::of(&qkv, &out), opts)?;
    let operands = quantize_operands(&problem, qkv, hadamard, opts)?;
    forward_operands(&problem, &operands, out, opts)
}

/// Runs fa-cpu on already quantised operands (from [`prepare`] with the same `desc`).
pub fn forward_prepared(
    desc: &ProblemDesc,
    operands: &Fp8Operands,
    out: Out<&mut [f32], &mut [f32]>,
    opts: &Fp8Options,
) -> Result<ForwardStats, Fp8Error> {
    let (q, k, v) = (&operands.q.codes, &operands.k.codes, &operands.v.codes);
    let lens = BufferLens::of(&Qkv::new(&q[..], &k[..], &v[..]), &out);
    let problem = desc.validate(softmax_core::MAX_HEAD_DIM)?;
    check(&problem, lens, opts)?;
    forward_operands(&problem, operands, out, opts)
}

fn forward_operands(
    problem: &Problem,
    operands: &Fp8Operands,
    out: Out<&mut [f32], &mut [f32]>,
    opts: &Fp8Options,
) -> Result<ForwardStats, Fp8Error> {
    let dequantized = |t: &Quantized| -> Result<Vec<f32>, Fp8Error> {
        let mut buf = vec![0.0f32; t.codes.len()];
        t.dequantize_into(problem, &mut buf)?;
        Ok(buf)
    };
    let (q, k, v) = (
        dequantized(&operands.q)?,
        dequantized(&operands.k)?,
        dequantized(&operands.v)?,
    );
    let offset = P_OFFSET_LOG2.exp2();
    let quantize_p = |p: &mut [f32]| {
        round_in_place_unchecked(Fp8Format::E4m3, p, offset, 1.0 / offset);
    };
    let hook: Option<&PHook> = if opts.quantize_p {
        Some(&quantize_p)
    } else {
        None
    };
    let fwd = ForwardOptions {
        threads: opts.threads,
        rescale: opts.rescale,
        exp2: Exp2Impl::Exact,
        probability_hook: hook,
        ..ForwardOptions::default()
    };
    let qkv = Qkv::new(&q[..], &k[..], &v[..]);
    Ok(forward(problem, qkv, out, &fwd)?)
}
