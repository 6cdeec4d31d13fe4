//! The sm_80 (`mma.sync`) backward family: its sources (the main kernel and the pre/post-pass
//! kernels), its variants and its plan ([`plan_backward`]: variant, grids and the workspace a
//! call needs, from the problem and the device's properties only).

use super::{DType, DeviceProps, KernelFamily, KernelVariant, SourceFile, COMMON_HEADERS};
use softmax_core::{Problem, ProblemError};

/// The headers of the backward family: the shared `common/*.cuh` ones (the one parameter block
/// among them) and its own helpers (`bwd_sm80/params.cuh`).
pub const BWD_HEADERS: [SourceFile; 7] = [
    COMMON_HEADERS[0],
    COMMON_HEADERS[1],
    COMMON_HEADERS[2],
    COMMON_HEADERS[3],
    COMMON_HEADERS[4],
    COMMON_HEADERS[5],
    SourceFile {
        name: "bwd_sm80/params.cuh",
        text: include_str!("bwd_sm80/params.cuh"),
    },
];

/// The main backward kernel: one CTA per (key block, KV head, sequence), dK/dV of its keys
/// summed over the GQA group's query heads in registers, dQ added to an f32 accumulator with
/// atomics (see `bwd_sm80/flash_bwd.cu`).
pub static FAMILY: KernelFamily = KernelFamily {
    name: "flash_bwd_sm80",
    main: SourceFile {
        name: "bwd_sm80/flash_bwd.cu",
        text: include_str!("bwd_sm80/flash_bwd.cu"),
    },
    headers: &BWD_HEADERS,
    entries: &["flash_bwd"],
    min_capability: (8, 0),
    max_major: None,
};

/// The backward's pre-pass (`D = rowsum(dO∘O)`, the LSE in log2 units, the dQ accumulator
/// zeroed) and post-pass (the accumulator scaled and rounded into dQ).
pub static PREP_FAMILY: KernelFamily = KernelFamily {
    name: "flash_bwd_prep_sm80",
    main: SourceFile {
        name: "bwd_sm80/prep.cu",
        text: include_str!("bwd_sm80/prep.cu"),
    },
    headers: &BWD_HEADERS,
    entries: &["flash_bwd_dot_do_o", "flash_bwd_convert_dq"],
    min_capability: (8, 0),
    max_major: None,
};

/// One compiled specialisation of the main backward kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BwdVariant {
    /// Head dim the tiles are laid out for (64, 128, 256).
    pub hdp: u32,
    /// Queries per step.
    pub block_m: u32,
    /// Keys per CTA (16 per key warp).
    pub block_n: u32,
    /// Warps per CTA: `block_n / 16 · dsplit`.
    pub warps: u32,
    /// Parts the dK/dV columns of a 16-key slab are split in (one warp each).
    pub dsplit: u32,
    /// Parts each step's queries are processed in (fewer live registers).
    pub subs: u32,
    /// CTAs per SM the register cap is set for.
    pub min_blocks: u32,
    /// Q/dO buffers (1 or 2).
    pub stages: u32,
    /// Element type of every tensor (inputs, O, dO, gradients).
    pub dtype: DType,
    /// Softcap: scores `cap·tanh(s·scale/cap)` and their derivative.
    pub softcap: bool,
    /// Unroll every k-step of `Sᵀ = K·Qᵀ` and `dPᵀ = V·dOᵀ` (more registers).
    pub qk_unroll: bool,
    /// dQ's f32 additions as 2-element vector reductions on sm_90 (`red.global.add.v2.f32`;
    /// scalar atomics on older devices).
    pub red_v2: bool,
    /// Columns of one dQ item: 64, or 32 (a smaller accumulator: fewer registers).
    pub dq_cols: u32,
}

impl BwdVariant {
    /// Threads per CTA.
    pub fn threads(&self) -> u32 {
        self.warps * 32
    }

    /// Dynamic shared memory per CTA in bytes: K and V, `stages` Q and dO tiles (16-bit),
    /// dSᵀ (16-bit, keys × queries) and `stages` LSE2 and D rows (f32).
    pub fn smem_bytes(&self) -> u32 {
        let tiles = (2 * self.block_n + 2 * self.stages * self.block_m) * self.hdp * 2;
        tiles + self.block_n * self.block_m * 2 + 2 * self.stages * self.block_m * 4
    }

    /// The NVRTC `-D` options of this variant.
    pub fn defines(&self) -> Vec<String> {
        vec![
            format!("-DHDP={}", self.hdp),
            format!("-DBLOCK_M={}", self.block_m),
            format!("-DBLOCK_N={}", self.block_n),
            format!("-DWARPS={}", self.warps),
            format!("-DDSPLIT={}", self.dsplit),
            format!("-DSUBS={}", self.subs),
            format!("-DMIN_BLOCKS={}", self.min_blocks),
            format!("-DSTAGES={}", self.stages),
            format!("-DIS_BF16={}", u32::from(self.dtype == DType::Bf16)),
            format!("-DSOFTCAP={}", u32::from(self.softcap)),
            format!("-DQK_UNROLL={}", u32::from(self.qk_unroll)),
            format!("-DRED_V2={}", u32::from(self.red_v2)),
            format!("-DDQ_COLS={}", self.dq_cols),
        ]
    }

    /// A readable name, e.g. `bwd_sm80_bf16_d128_64x128_w8_b1_s2_q2` (`_split`: dK/dV
    /// columns split over warps, `_cap`: softcap, `_u`: unrolled `Sᵀ`, `_v2`: vector dQ
    /// reductions, `_n`: 32-column dQ items).
    pub fn name(&self) -> String {
        format!(
            "bwd_sm80_{}_d{}_{}x{}_w{}_b{}_s{}_q{}{}{}{}{}{}",
            self.dtype.name(),
            self.hdp,
            self.block_m,
            self.block_n,
            self.warps,
            self.min_blocks,
            self.stages,
            self.subs,
            if self.dsplit > 1 { "_split" } else { "" },
            if self.softcap { "_cap" } else { "" },
            if self.qk_unroll { "_u" } else { "" },
            if self.red_v2 { "_v2" } else { "" },
            if self.dq_cols == 32 { "_n" } else { "" }
        )
    }

    /// Every variant the plan can select (what the CI compile check builds).
    pub fn all() -> Vec<BwdVariant> {
        let mut all = Vec::new();
        for dtype in [DType::Bf16, DType::F16] {
            for hdp in [64, 128, 256] {
                for softcap in [false, true] {
                    all.push(tile_config(hdp, dtype, softcap));
                }
            }
        }
        all
    }
}

impl KernelVariant for BwdVariant {
    fn family(&self) -> &'static KernelFamily {
        &FAMILY
    }
    fn defines(&self) -> Vec<String> {
        BwdVariant::defines(self)
    }
    fn entry(&self) -> &'static str {
        FAMILY.entries[0]
    }
    fn name(&self) -> String {
        BwdVariant::name(self)
    }
}

/// One of the two small kernels of the backward's pre/post-pass, for one dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BwdPrepVariant {
    /// Element type.
    pub dtype: DType,
    /// `false`: the pre-pass (`flash_bwd_dot_do_o`); `true`: the post-pass
    /// (`flash_bwd_convert_dq`).
    pub post: bool,
}

impl BwdPrepVariant {
    /// Every variant (both passes, both dtypes).
    pub fn all() -> Vec<BwdPrepVariant> {
        let mut all = Vec::new();
        for dtype in [DType::Bf16, DType::F16] {
            for post in [false, true] {
                all.push(BwdPrepVariant { dtype, post });
            }
        }
        all
    }
}

impl KernelVariant for BwdPrepVariant {
    fn family(&self) -> &'static KernelFamily {
        &PREP_FAMILY
    }
    fn defines(&self) -> Vec<String> {
        vec![format!(
            "-DIS_BF16={}",
            u32::from(self.dtype == DType::Bf16)
        )]
    }
    fn entry(&self) -> &'static str {
        PREP_FAMILY.entries[usize::from(self.post)]
    }
    fn name(&self) -> String {
        format!(
            "bwd_sm80_{}_{}",
            if self.post { "convert_dq" } else { "dot_do_o" },
            self.dtype.name()
        )
    }
}

/// Query rows of one pre/post-pass CTA (8 warps of 8 rows).
pub const PREP_ROWS_PER_CTA: u32 = 64;
/// Threads of one pre/post-pass CTA.
pub const PREP_THREADS: u32 = 256;

/// Tile sizes and code choices per padded head dim: 64 queries per step and 128 keys over 8
/// warps of one 16-key slab each up to hdim 128, with double-buffered Q/dO; at hdim 256, 64
/// keys and each slab's dK/dV columns split over two warps (the accumulators of whole rows
/// do not fit the registers), one Q/dO buffer (the shared memory of two does not fit an
/// A100), each step's queries in two parts of 32.
///
/// Measured on an H100 (bf16, 16k tokens, seqlen 2k and 8k, causal and not, one device call
/// A/B against the first choice, 2026-12-07; TFLOP/s at 2.5× the forward's FLOPs):
/// - hdim 64: two CTAs per SM (a 128-register cap, 16 warps per SM) with the step's queries
///   in four parts of 16 and 32-column dQ items (which keep that cap spill-free), and sm_90
///   vector dQ reductions: 208 / 171 / 221 / 206 (2k, 2k causal, 8k, 8k causal) against 159 /
///   132 / 170 / 159 for one CTA per SM with whole steps;
/// - hdim 128: one CTA per SM (the accumulators need the registers), two parts of 32,
///   unrolled `Sᵀ`/`dPᵀ` k-steps and vector dQ reductions: 202 / 164 / 217 / 202 against 168
///   / 140 / 180 / 168 (two CTAs per SM with split dK/dV columns: 113–142, slower);
/// - hdim 256: the first choice, not yet measured.
///
/// The vector reductions halve dQ's atomic instructions; they are the largest single gain
/// (+13–17 %). The two-CTA hdim-64 choice was measured on the H100's 228 KiB of shared memory
/// per SM (an A100's 164 KiB holds one such CTA).
fn tile_config(hdp: u32, dtype: DType, softcap: bool) -> BwdVariant {
    let (block_n, dsplit, subs, stages, min_blocks, qk_unroll, red_v2, dq_cols) = match hdp {
        64 => (128, 1, 4, 2, 2, false, true, 32),
        128 => (128, 1, 2, 2, 1, true, true, 64),
        _ => (64, 2, 2, 1, 1, false, false, 64),
    };
    BwdVariant {
        hdp,
        block_m: 64,
        block_n,
        warps: block_n / 16 * dsplit,
        dsplit,
        subs,
        min_blocks,
        stages,
        dtype,
        softcap,
        qk_unroll,
        red_v2,
        dq_cols,
    }
}

/// Tile sizes and code choices of the backward kernel, overriding the plan's (tuning
/// experiments only; see [`crate::BackwardOptions::tiles`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BwdTiles {
    /// Queries per step (a multiple of 64).
    pub block_m: u32,
    /// Keys per CTA (a multiple of 16).
    pub block_n: u32,
    /// Warps sharing a 16-key slab's dK/dV columns.
    pub dsplit: u32,
    /// Parts each step's queries run in.
    pub subs: u32,
    /// Q/dO buffers (1 or 2).
    pub stages: u32,
    /// CTAs per SM for the register cap.
    pub min_blocks: u32,
    /// See [`BwdVariant::qk_unroll`].
    pub qk_unroll: bool,
    /// See [`BwdVariant::red_v2`].
    pub red_v2: bool,
    /// 32-column dQ items (see [`BwdVariant::dq_cols`]).
    pub narrow_dq: bool,
}

impl BwdTiles {
    /// Parses `BMxBNxDSPLITxSUBSxSTAGESxMINBLOCKS` with optional flags `u` (unrolled Sᵀ),
    /// `v` (vector dQ reductions) and `n` (32-column dQ items) after a `+`, e.g.
    /// `64x128x1x2x2x1+uv`.
    pub fn parse(s: &str) -> Option<BwdTiles> {
        let (dims, flags) = s.split_once('+').unwrap_or((s, ""));
        let v: Vec<u32> = dims
            .split('x')
            .map(|x| x.parse().ok())
            .collect::<Option<_>>()?;
        let [block_m, block_n, dsplit, subs, stages, min_blocks] = v[..] else {
            return None;
        };
        if !flags.chars().all(|c| matches!(c, 'u' | 'v' | 'n')) {
            return None;
        }
        let ok = block_m > 0
            && block_m % 64 == 0
            && block_n > 0
            && block_n % 16 == 0
            && matches!(dsplit, 1 | 2 | 4)
            && subs > 0
            && block_m % (16 * subs) == 0
            && (stages == 1 || stages == 2)
            && min_blocks > 0
            && (block_n / 16) * dsplit <= 16;
        ok.then_some(BwdTiles {
            block_m,
            block_n,
            dsplit,
            subs,
            stages,
            min_blocks,
            qk_unroll: flags.contains('u'),
            red_v2: flags.contains('v'),
            narrow_dq: flags.contains('n'),
        })
    }
}

/// The launch geometry of a backward call: the main kernel's variant, grid and shared memory,
/// and the pre/post-pass grid (`None` parts: nothing for that kernel to do).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BwdLaunch {
    /// The main kernel's variant.
    pub variant: BwdVariant,
    /// Main kernel grid (key blocks, KV heads, sequences); `None` when there are no keys.
    pub grid: Option<(u32, u32, u32)>,
    /// Threads per main-kernel CTA.
    pub block: u32,
    /// Dynamic shared memory of the main kernel in bytes.
    pub smem_bytes: u32,
    /// Pre/post-pass grid (query-row blocks, query heads, sequences); `None` when there are
    /// no queries.
    pub prep_grid: Option<(u32, u32, u32)>,
}

/// The sm80 backward's launch for a validated problem on a device: the variant (head-dim
/// padding, tiles; `tiles` overrides the tuned choice), the grids, and the check that the
/// shared memory fits. `dtype` is that of
/// every tensor of the call. Pure: the same inputs always give the same launch.
pub fn plan_backward(
    problem: &Problem,
    dtype: DType,
    tiles: Option<BwdTiles>,
    props: &DeviceProps,
) -> Result<BwdLaunch, ProblemError> {
    let dim = problem.head_dim().max(problem.head_dim_v()) as u32;
    let hdp = match dim {
        0..=64 => 64,
        65..=128 => 128,
        _ => 256,
    };
    let mut variant = tile_config(hdp, dtype, problem.softcap().is_some());
    if let Some(t) = tiles {
        if hdp % (64 * t.dsplit) != 0 {
            return Err(ProblemError::Unsupported {
                what: "the backward tiles split the head dim into parts narrower than 64",
            });
        }
        variant.block_m = t.block_m;
        variant.block_n = t.block_n;
        variant.dsplit = t.dsplit;
        variant.warps = t.block_n / 16 * t.dsplit;
        variant.subs = t.subs;
        variant.stages = t.stages;
        variant.min_blocks = t.min_blocks;
        variant.qk_unroll = t.qk_unroll;
        variant.red_v2 = t.red_v2;
        variant.dq_cols = if t.narrow_dq { 32 } else { 64 };
    }
    if variant.smem_bytes() > props.smem_optin_bytes {
        return Err(ProblemError::Unsupported {
            what: "the backward kernel's shared memory exceeds this device's limit",
        });
    }
    let batch = problem.batch() as u32;
    let n_blocks = (problem.max_seqlen_k() as u32).div_ceil(variant.block_n);
    let q_blocks = (problem.max_seqlen_q() as u32).div_ceil(PREP_ROWS_PER_CTA);
    Ok(BwdLaunch {
        variant,
        grid: (n_blocks > 0).then_some((n_blocks, problem.heads_kv() as u32, batch)),
        block: variant.threads(),
        smem_bytes: variant.smem_bytes(),
        prep_grid: (q_blocks > 0).then_some((q_blocks, problem.heads_q() as u32, batch)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_variant_has_a_distinct_name_and_fits_both_reference_devices() {
        let all = BwdVariant::all();
        let mut names: Vec<String> = all.iter().map(BwdVariant::name).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), all.len());
        for v in &all {
            assert_eq!(v.warps, v.block_n / 16 * v.dsplit);
            assert!(
                v.smem_bytes() <= DeviceProps::a100().smem_optin_bytes,
                "{}",
                v.name()
            );
        }
        let prep: Vec<String> = BwdPrepVariant::all().iter().map(|v| v.name()).collect();
        assert_eq!(prep.len(), 4);
        assert!(prep.iter().all(|n| !names.contains(n)));
    }

    #[test]
    fn plan_follows_the_problem() {
        let p = softmax_core::ProblemDesc::new(2, 300, 129, 8, 2, 96)
            .causal()
            .validate(256)
            .expect("valid");
        let l = plan_backward(&p, DType::F16, None, &DeviceProps::h200()).expect("plan");
        assert_eq!(l.variant.hdp, 128);
        assert_eq!(l.grid, Some((2, 2, 2)));
        assert_eq!(l.prep_grid, Some((5, 8, 2)));
        let empty_k = softmax_core::ProblemDesc::new(1, 5, 0, 2, 2, 64)
            .validate(256)
            .expect("valid");
        let l = plan_backward(&empty_k, DType::Bf16, None, &DeviceProps::a100()).expect("plan");
        assert_eq!(l.grid, None);
        assert!(l.prep_grid.is_some());
        let t = BwdTiles::parse("64x64x2x2x2x2+uv").expect("tiles");
        assert!(t.qk_unroll && t.red_v2 && t.dsplit == 2);
        let l = plan_backward(&p, DType::F16, Some(t), &DeviceProps::h200()).expect("plan");
        assert_eq!((l.variant.warps, l.block), (8, 256));
        assert!(BwdTiles::parse("64x64x3x2x2x2").is_none());
        assert!(BwdTiles::parse("64x64x1x2x2x1+w").is_none());
        let d64 = softmax_core::ProblemDesc::new(1, 10, 10, 1, 1, 64)
            .validate(256)
            .expect("valid");
        assert!(plan_backward(&d64, DType::F16, Some(t), &DeviceProps::h200()).is_err());
    }
}
