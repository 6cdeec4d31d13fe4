//! FP8 for attention: e4m3/e5m2 codecs, per-tensor and per-block scaling, randomised
//! Hadamard incoherent processing, and an FP8 attention forward on the CPU that follows
//! FlashAttention-3's FP8 recipe and reproduces its accuracy experiment.
//!
//! - [`format`](mod@format): the two formats and the scalar codecs, bit-exact with CUDA's
//!   `__nv_cvt_float_to_fp8(x, __NV_SATFINITE, ..)` (round to nearest even, subnormals,
//!   saturation to ±max, ±∞ → ±max, NaN → `0x7f`); all 512 codes are tested against a decoder
//!   written from the format definitions and the encoder at every midpoint;
//! - [`codec`]: slice encode/decode (optionally fused with a scale), vectorised, with an AVX2
//!   path chosen at run time;
//! - [`scale`]: `scale = amax / max`, per tensor or per `rows × d` block of each head, optional
//!   power-of-two scales, and the scale layout a kernel reads;
//! - [`hadamard`]: the in-place FWHT and `M = H·diag(s)/√d` with seeded signs;
//! - [`attention`]: Q, K, V quantised (± Hadamard), fa-cpu's tiled forward on the dequantised
//!   operands with P rounded to e4m3 (FlashAttention-3's `2^8` offset) on every tile.
//!
//! The accuracy experiment is `cargo run --release -p fa-fp8 --example fp8_accuracy`; its
//! measured table is in the crate's README.
//!
//! # Example
//! ```
//! use fa_fp8::attention::{forward_fp8, Fp8Options};
//! use fa_fp8::Fp8Format;
//! use softmax_core::{Out, ProblemDesc, Qkv};
//!
//! // The codecs.
//! let e4m3 = Fp8Format::E4m3;
//! assert_eq!(e4m3.decode(e4m3.encode(1.0)), 1.0);
//! assert_eq!(e4m3.encode(1000.0), 0x7e); // saturates to 448
//! assert_eq!(e4m3.decode(0x7e), 448.0);
//!
//! // FP8 attention (per-block scales, Hadamard on Q and K, P in e4m3): one sequence of
//! // 4 queries and 8 keys, one head of dim 16.
//! let desc = ProblemDesc::new(1, 4, 8, 1, 1, 16);
//! let q: Vec<f32> = (0..4 * 16).map(|i| (i as f32 * 0.7).sin()).collect();
//! let k: Vec<f32> = (0..8 * 16).map(|i| (i as f32 * 0.3).cos()).collect();
//! let v: Vec<f32> = (0..8 * 16).map(|i| (i % 5) as f32 - 2.0).collect();
//! let mut out = vec![0.0f32; 4 * 16];
//! forward_fp8(&desc, Qkv::new(&q[..], &k[..], &v[..]), Out::new(&mut out), &Fp8Options::default())?;
//! // Each output is a convex combination of V's entries (up to FP8 rounding of P).
//! assert!(out.iter().all(|&o| (-2.2..=2.2).contains(&o)));
//! # Ok::<(), fa_fp8::Fp8Error>(())
//! ```
//!
//! # What the Hopper FP8 kernel needs from this crate
//! The GPU kernel is not written yet; this crate fixes its inputs and its arithmetic.
//! - **Codes**: one byte per element, e4m3, in the inputs' BSHD layout and strides
//!   ([`scale::Quantized::codes`]).
//! - **Scales**: f32, `[batch][heads][blocks]`, `blocks = ceil(max_seqlen / rows)`, `rows` = the
//!   kernel's `Br` for Q and `Bc` for K and V ([`scale::ScaleLayout`]); the kernel's tile
//!   sizes and the quantisation's block sizes must be the same numbers. The S tile (f32
//!   accumulators of the code products) is multiplied by `scale_q[m-block]·scale_k[n-block]`,
//!   folded into the one multiply by `softmax_scale·log2 e` that the softmax does anyway. A
//!   per-block V scale varies along P·V's reduction dimension, so it cannot be applied after
//!   the accumulation: fold `scale_v[n-block] / max_n scale_v` into the factor that already
//!   multiplies P before its e4m3 conversion (the `2^8` offset) and multiply O by
//!   `max_n scale_v` at the end (the row sum must stay unscaled: it is taken before).
//! - **V transposed**: FP8 `wgmma` takes both operands K-major (only 16-bit types may be
//!   MN-major/transposed in shared memory). In P·V the reduction runs over keys, but BSHD V
//!   has `head_dim` contiguous, so each V tile must be transposed to key-contiguous
//!   `[head_dim][Bc]`: in the kernel (FlashAttention-3 transposes V tiles in shared memory
//!   in the producer warpgroup, overlapped with the GEMMs) or ahead of time with
//!   [`scale::Quantized::transposed`] (`[batch][heads_kv][head_dim_v][padded seqlen_k]`).
//!   P, produced in the S accumulator's register layout, must also be permuted into the FP8
//!   A-operand layout (byte shuffles) before the second `wgmma`.
//! - **P**: `exp2(x − (m − 8))`, i.e. the `2^8` offset folded into the exponent, converted
//!   with `cvt.rn.satfinite.e4m3x2.f32`; the row sum accumulates the f32 values before the
//!   conversion ([`attention`] explains why); the rescale policy must keep `τ + 8 <
//!   log2(448)`, i.e. `τ < 0.807` (or always rescale), checked by
//!   [`attention::check_p_range`].
//! - **Hadamard**: the signs as bit words ([`hadamard::RandomHadamard::sign_bits`]) or the
//!   seed; the rotation is applied to Q and K rows before quantisation (FlashAttention-3 fuses
//!   it with the rotary embedding, outside the attention kernel): `d/2·log2 d` butterflies per
//!   row.

pub mod attention;
pub mod codec;
pub mod error;
pub mod format;
pub mod hadamard;
pub mod scale;

pub use codec::{
    decode_scaled, decode_slice, encode_scaled, encode_slice, round_scaled_in_place, CodecPath,
};
pub use error::Fp8Error;
pub use format::{Fp8Format, NAN_CODE};
