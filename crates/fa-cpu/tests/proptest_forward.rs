//! Random problems against the f64 oracle: shapes, masks (causal, windows, seqlen_q ≠
//! seqlen_k, fully masked rows), GQA/MQA ratios, varlen packs with empty and length-1
//! sequences, padded strides, softcap, scale, f32/bf16/f16, every SIMD level.

mod common;

use common::{check, levels};
use fa_cpu::{Exp2Impl, ForwardOptions, SimdLevel};
use fa_reference::{bf16_pv_slack_for, f32_forward_bound, pv_cancellation, Case, Rng, Rounding};
use half::{bf16, f16};
use proptest::prelude::*;
use softmax_core::{Mask, RescalePolicy};

/// A random problem from a seed and a few drawn parameters.
#[derive(Clone, Debug)]
struct Params {
    seed: u64,
    varlen: bool,
    batch: usize,
    seqlen_q: usize,
    seqlen_k: usize,
    heads_kv: usize,
    group: usize,
    head_dim: usize,
    head_dim_v: usize,
    mask: (bool, i64, i64),
    softcap: Option<f32>,
    scale: Option<f32>,
    pad: usize,
    rounding: u8,
    always_rescale: bool,
}

fn params() -> impl Strategy<Value = Params> {
    (
        (
            any::<u64>(),
            any::<bool>(),
            1usize..4,
            0usize..90,
            0usize..150,
        ),
        (1usize..3, prop::sample::select(vec![1usize, 2, 3, 4, 8])),
        (
            prop::sample::select(vec![1usize, 3, 8, 16, 31, 32, 64, 65, 128, 256]),
            any::<bool>(),
        ),
        (any::<bool>(), -1i64..40, -1i64..40),
        (
            prop::option::of(1.0f32..30.0),
            prop::option::of(0.01f32..1.0),
        ),
        (0usize..3, 0u8..3, any::<bool>()),
    )
        .prop_map(
            |(
                (seed, varlen, batch, seqlen_q, seqlen_k),
                (heads_kv, group),
                (head_dim, same_v),
                mask,
                (softcap, scale),
                (pad, rounding, always_rescale),
            )| Params {
                seed,
                varlen,
                batch,
                seqlen_q,
                seqlen_k,
                heads_kv,
                group,
                head_dim,
                head_dim_v: if same_v {
                    head_dim
                } else {
                    (head_dim / 2).max(1)
                },
                mask,
                softcap,
                scale,
                pad,
                rounding,
                always_rescale,
            },
        )
}

fn build(p: &Params) -> Case {
    let mut rng = Rng::new(p.seed);
    let heads_q = p.heads_kv * p.group;
    let rounding = [Rounding::F32, Rounding::Bf16, Rounding::F16][p.rounding as usize];
    let mut case = if p.varlen {
        // Lengths drawn per sequence, including empty and length-1 ones.
        let mut lens = |max: usize| -> Vec<u32> {
            (0..p.batch)
                .map(|_| match rng.next_u64() % 4 {
                    0 => 0,
                    1 => 1,
                    _ => (rng.next_u64() % (max as u64 + 1)) as u32,
                })
                .collect()
        };
        let lq = lens(p.seqlen_q);
        let lk = lens(p.seqlen_k);
        Case::varlen(&mut rng, &lq, &lk, heads_q, p.heads_kv, p.head_dim)
    } else {
        Case::dense(
            &mut rng,
            p.batch,
            p.seqlen_q.max(1),
            p.seqlen_k,
            heads_q,
            p.heads_kv,
            p.head_dim,
        )
    };
    case.head_dim_v = p.head_dim_v;
    case.mask = Mask::from_flash_args(p.mask.0, p.mask.1, p.mask.2);
    case.softcap = p.softcap;
    case.softmax_scale = p.scale;
    if p.pad > 0 {
        case = case.padded(&mut rng, p.pad, rounding);
    } else {
        case.fill(&mut rng, rounding);
    }
    case
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn forward_matches_f64_reference(p in params()) {
        let case = build(&p);
        // Normwise bounds grow where V's values cancel in O (a single output element of a few
        // keys can be near zero while its rounding error is not): `pv_cancellation`. f32
        // keeps 1e-5 up to a ratio of 4 and grows in proportion beyond.
        let cancel = {
            let problem = case.desc().validate(256).expect("valid case");
            pv_cancellation(&problem, &case.q, &case.k, &case.v)
        };
        for level in levels() {
            let opts = ForwardOptions {
                simd: level,
                rescale: if p.always_rescale { RescalePolicy::Always } else { RescalePolicy::default() },
                exp2: Exp2Impl::Exact,
                ..ForwardOptions::default()
            };
            // bf16 and f16 on AMX round P to bf16 before P·V: their own slack on top, 2⁻⁸ times
            // the cancellation (`fa_reference::bf16_pv_slack`).
            let amx = level == SimdLevel::Amx && p.rounding != 0;
            let slack = if amx { bf16_pv_slack_for(cancel) } else { 0.0 };
            let f32_bound = f32_forward_bound(cancel);
            let (rep, bound) = match p.rounding {
                0 => (check::<f32, f32>(&case, &opts), f32_bound),
                1 => (check::<bf16, bf16>(&case, &opts), 1e-2 + slack),
                _ => (check::<f16, f16>(&case, &opts), 1e-2 + slack),
            };
            prop_assert!(rep.within(bound, 1e-3), "{level:?} {p:?}: {rep:?}");
            // 16-bit inputs with an f32 output: only the f32 accumulation error remains (and,
            // on AMX, P's rounding to bf16 before P·V).
            if p.rounding != 0 {
                let rep = match p.rounding {
                    1 => check::<bf16, f32>(&case, &opts),
                    _ => check::<f16, f32>(&case, &opts),
                };
                let bound = if amx { (f32_bound + slack).max(5e-3) } else { f32_bound };
                prop_assert!(rep.within(bound, 1e-3), "{level:?} {p:?} (f32 out): {rep:?}");
            }
        }
    }
}
