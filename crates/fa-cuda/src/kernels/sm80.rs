//! The sm_80 (`mma.sync`) forward family: its source, its variants and its plan (the launch
//! choice for a problem on a device).

use super::{
    DType, DeviceProps, ForwardVariant, KernelFamily, KernelVariant, LaunchShape, SourceFile,
    COMMON_HEADERS,
};
use softmax_core::{Problem, ProblemError};

/// The FlashAttention-2 style forward kernel (sm_80 and newer; it also runs on Hopper, until an
/// sm_90 family replaces it there).
pub static FAMILY: KernelFamily = KernelFamily {
    name: "flash_fwd_sm80",
    main: SourceFile {
        name: "sm80/flash_fwd.cu",
        text: include_str!("sm80/flash_fwd.cu"),
    },
    headers: &COMMON_HEADERS,
    entries: &["flash_fwd"],
    min_capability: (8, 0),
    max_major: None,
};

/// One compiled specialisation of the sm_80 forward kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Variant {
    /// Head dim the tiles are laid out for (64, 128, 256).
    pub hdp: u32,
    /// Query rows per CTA.
    pub block_m: u32,
    /// Keys per K/V tile.
    pub block_n: u32,
    /// Warps per CTA.
    pub warps: u32,
    /// CTAs per SM the register cap is set for.
    pub min_blocks: u32,
    /// K/V buffers: 1 (FlashAttention-2's single buffers) or 2 (double buffering).
    pub stages: u32,
    /// Element type.
    pub dtype: DType,
    /// General score transform (softcap, or a scale ≤ 0) applied before the row max; without
    /// it the scale must be positive and is folded into the exponent's FMA.
    pub general_scores: bool,
    /// Whether the kernel applies the mask element by element. `false` compiles the mask code
    /// out; only for problems where every key tile is full for every query (see
    /// [`plan_forward`]).
    pub masked: bool,
}

impl KernelVariant for Variant {
    fn family(&self) -> &'static KernelFamily {
        &FAMILY
    }
    fn defines(&self) -> Vec<String> {
        Variant::defines(self)
    }
    fn entry(&self) -> &'static str {
        FAMILY.entries[0]
    }
    fn name(&self) -> String {
        Variant::name(self)
    }
}

impl Variant {
    /// The NVRTC `-D` options of this variant.
    pub fn defines(&self) -> Vec<String> {
        vec![
            format!("-DHDP={}", self.hdp),
            format!("-DBLOCK_M={}", self.block_m),
            format!("-DBLOCK_N={}", self.block_n),
            format!("-DWARPS={}", self.warps),
            format!("-DMIN_BLOCKS={}", self.min_blocks),
            format!("-DSTAGES={}", self.stages),
            format!("-DIS_BF16={}", u32::from(self.dtype == DType::Bf16)),
            format!("-DGENERAL_SCORES={}", u32::from(self.general_scores)),
            format!("-DMASKED={}", u32::from(self.masked)),
        ]
    }

    /// A readable name, e.g. `fwd_sm80_bf16_d128_128x64_w4_b2_s1` (`_gen`: general scores,
    /// `_full`: no mask code).
    pub fn name(&self) -> String {
        format!(
            "fwd_sm80_{}_d{}_{}x{}_w{}_b{}_s{}{}{}",
            self.dtype.name(),
            self.hdp,
            self.block_m,
            self.block_n,
            self.warps,
            self.min_blocks,
            self.stages,
            if self.general_scores { "_gen" } else { "" },
            if self.masked { "" } else { "_full" }
        )
    }

    /// Threads per CTA.
    pub fn threads(&self) -> u32 {
        self.warps * 32
    }

    /// Dynamic shared memory per CTA in bytes: the Q tile and `stages` K and V tiles (16-bit).
    pub fn smem_bytes(&self) -> u32 {
        (self.block_m + 2 * self.stages * self.block_n) * self.hdp * 2
    }

    /// Every variant the launch choice can select (what the CI compile check builds).
    pub fn all() -> Vec<Variant> {
        let mut all = Vec::new();
        for dtype in [DType::Bf16, DType::F16] {
            for hdp in [64, 128, 256] {
                for general_scores in [false, true] {
                    for masked in [true, false] {
                        all.push(tile_config(hdp, dtype, general_scores, false, masked));
                    }
                }
                if hdp <= 128 {
                    all.push(tile_config(hdp, dtype, false, true, true));
                }
            }
        }
        all
    }
}

/// Tile sizes per padded head dim, measured on the H200 (docs/history/gpu-notes.md,
/// 2026-11-30): 128 query rows per CTA; 4 warps of 32 rows for head dims up to 128 (two CTAs
/// per SM), 8 warps of 16 rows for 256 (one CTA per SM). Causal at hdim 64 and 128 runs 8 warps
/// over 128-key tiles: with 16 rows per warp the kernel has registers for two copies of the
/// tile body (`SPLIT_TILES`), so only the diagonal tiles pay for the mask (hdim 128 causal at
/// 8k: 1.03× FlashAttention-2 against 0.92× with the 4-warp tiles).
fn tile_config(
    hdp: u32,
    dtype: DType,
    general_scores: bool,
    causal: bool,
    masked: bool,
) -> Variant {
    // hdim 64 with softcap: the tanh needs registers that 128-key tiles leave no room for.
    let (block_n, warps, min_blocks) = match (hdp, general_scores, causal) {
        (64, false, false) => (128, 4, 2),
        (64 | 128, false, true) => (128, 8, 1),
        (64, true, _) | (128, _, _) => (64, 4, 2),
        _ => (64, 8, 1),
    };
    Variant {
        hdp,
        block_m: 128,
        block_n,
        warps,
        min_blocks,
        stages: 1,
        dtype,
        general_scores,
        masked,
    }
}

/// Tile sizes of the sm_80 kernel, for overriding the launch choice in tuning experiments
/// (see [`crate::ForwardOptions::tiles`]); `block_m` must be a multiple of `16·warps`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Tiles {
    /// Query rows per CTA.
    pub block_m: u32,
    /// Keys per K/V tile (multiple of 16).
    pub block_n: u32,
    /// Warps per CTA.
    pub warps: u32,
    /// CTAs per SM the register cap is set for.
    pub min_blocks: u32,
    /// K/V buffers (1 or 2).
    pub stages: u32,
}

impl Tiles {
    /// Parses `BMxBNxWARPSxMINBLOCKS[xSTAGES]`, e.g. `128x64x4x2` or `128x64x4x2x2`.
    pub fn parse(s: &str) -> Option<Tiles> {
        let v: Vec<u32> = s
            .split('x')
            .map(|x| x.parse().ok())
            .collect::<Option<_>>()?;
        let (block_m, block_n, warps, min_blocks, stages) = match v[..] {
            [m, n, w, b] => (m, n, w, b, 1),
            [m, n, w, b, st] => (m, n, w, b, st),
            _ => return None,
        };
        let ok = warps > 0
            && block_m % (16 * warps) == 0
            && block_n % 16 == 0
            && block_n > 0
            && min_blocks > 0
            && (stages == 1 || stages == 2);
        ok.then_some(Tiles {
            block_m,
            block_n,
            warps,
            min_blocks,
            stages,
        })
    }
}

/// The launch choice of the sm_80 forward family on a device: variant (head-dim padding, tiles,
/// warps) and grid over (query block, head, batch). `Ok(None)` when the problem has nothing to
/// compute (checked first); an error when the chosen (or overriding) tiles need more shared memory than the
/// device lets one CTA use.
pub fn plan_forward(
    problem: &Problem,
    dtype: DType,
    tiles: Option<Tiles>,
    props: &DeviceProps,
) -> Result<Option<LaunchShape>, ProblemError> {
    // Tiles are laid out for 64, 128 or 256 columns; smaller head dims are zero-padded.
    let dim = problem.head_dim().max(problem.head_dim_v()) as u32;
    let hdp = match dim {
        0..=64 => 64,
        65..=128 => 128,
        _ => 256,
    };
    let general = problem.softcap().is_some() || problem.softmax_scale() <= 0.0;
    // hdim 64 causal: the 8-warp split kernel wins from 4k queries on (0.92–0.98× against
    // 0.89×), the 4-warp one below 2k (1.10× against 0.94× at 512; docs/history/gpu-notes.md,
    // 2026-11-30).
    // Measured on the H200's 132 SMs only: see `sm_count_hook`.
    let causal = problem.mask().is_causal() && !(hdp == 64 && problem.max_seqlen_q() <= 2048);
    let mut variant = tile_config(hdp, dtype, general, causal, true);
    if let Some(t) = tiles {
        variant.block_m = t.block_m;
        variant.block_n = t.block_n;
        variant.warps = t.warps;
        variant.min_blocks = t.min_blocks;
        variant.stages = t.stages;
    }
    // Without a mask and with every sequence's keys a whole number of tiles, every tile is
    // full for every query: the variant without mask code (FlashAttention-2's "even" kernel).
    // Prefix sums on the device: the host cannot see the lengths, so the mask code stays (its
    // loads check every row against the sequence's length).
    variant.masked = !(problem.mask().is_none()
        && problem.has_host_seqlens()
        && (0..problem.batch()).all(|b| problem.seq(b).seqlen_k % variant.block_n as usize == 0));
    let m_blocks = (problem.max_seqlen_q() as u32).div_ceil(variant.block_m);
    if m_blocks == 0 {
        return Ok(None);
    }
    if variant.smem_bytes() > props.smem_optin_bytes {
        return Err(ProblemError::Unsupported {
            what: "the kernel's shared memory exceeds this device's limit",
        });
    }
    let grid = (m_blocks, problem.heads_q() as u32, problem.batch() as u32);
    let variant = sm_count_hook(variant, grid, props);
    Ok(Some(LaunchShape {
        variant: ForwardVariant::Sm80(variant),
        grid,
        block: variant.threads(),
        smem_bytes: variant.smem_bytes(),
    }))
}

/// Where choices that depend on how the grid fills the device go (e.g. splitting the keys
/// across CTAs when `grid` is a fraction of a wave of `props.sm_count`, or the hdim-64 causal
/// threshold above, which was measured on 132 SMs only). Nothing is tuned by SM count yet, so
/// the variant passes unchanged: a choice goes here once measured on more than one GPU.
fn sm_count_hook(variant: Variant, _grid: (u32, u32, u32), _props: &DeviceProps) -> Variant {
    variant
}

#[cfg(test)]
mod tests {
    use super::*;
    use softmax_core::ProblemDesc;

    fn masked(desc: ProblemDesc) -> bool {
        let problem = desc.validate(256).expect("valid");
        plan_forward(&problem, DType::Bf16, None, &DeviceProps::h200())
            .expect("a plan")
            .expect("a launch")
            .variant
            .masked()
    }

    #[test]
    fn mask_code_is_dropped_only_when_every_tile_is_full() {
        // hdim 128 tiles are 64 keys, hdim 64 tiles 128 keys.
        assert!(!masked(ProblemDesc::new(2, 100, 1024, 4, 4, 128)));
        assert!(!masked(ProblemDesc::new(1, 7, 64, 4, 1, 128)));
        assert!(masked(ProblemDesc::new(1, 100, 1000, 4, 4, 128))); // key tail
        assert!(masked(ProblemDesc::new(1, 64, 64, 4, 4, 64))); // tail of a 128-key tile
        assert!(masked(ProblemDesc::new(1, 1024, 1024, 4, 4, 128).causal()));
        assert!(masked(
            ProblemDesc::new(1, 1024, 1024, 4, 4, 128).window(Some(256), None)
        ));
        let (cu_q, cu_k) = ([0u32, 5, 5, 300], [0u32, 128, 128, 512]);
        assert!(!masked(ProblemDesc::varlen(&cu_q, &cu_k, 4, 4, 64)));
        let cu_k = [0u32, 128, 128, 500];
        assert!(masked(ProblemDesc::varlen(&cu_q, &cu_k, 4, 4, 64)));
    }

    #[test]
    fn every_variant_has_a_distinct_name() {
        let all = Variant::all();
        let mut names: Vec<String> = all.iter().map(Variant::name).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), all.len());
        assert!(all.iter().any(|v| !v.masked) && all.iter().any(|v| v.masked));
    }

    #[test]
    fn plan_rejects_tiles_beyond_the_shared_memory_limit() {
        let problem = ProblemDesc::new(1, 512, 512, 4, 4, 256)
            .validate(256)
            .expect("valid");
        // 128 + 2·2·128 rows of 256 bf16 columns: 320 KiB, more than any device allows.
        let big = Tiles::parse("128x128x8x1x2");
        assert!(big.is_some());
        for props in [DeviceProps::h200(), DeviceProps::a100()] {
            assert!(plan_forward(&problem, DType::Bf16, big, &props).is_err());
            assert!(plan_forward(&problem, DType::Bf16, None, &props).is_ok());
        }
        // hdim 256, 128x64 tiles, 8 warps, 2 stages: 192 KiB, fits the H200 but not the A100.
        let two_stage = Tiles::parse("128x64x8x1x2");
        assert!(plan_forward(&problem, DType::Bf16, two_stage, &DeviceProps::h200()).is_ok());
        assert!(plan_forward(&problem, DType::Bf16, two_stage, &DeviceProps::a100()).is_err());
    }

    #[test]
    fn every_variant_fits_both_reference_devices() {
        for v in Variant::all() {
            assert!(
                v.smem_bytes() <= DeviceProps::a100().smem_optin_bytes,
                "{}",
                v.name()
            );
        }
    }
}
