//! The sm_90a (Hopper, `wgmma`) forward family: its source, its variants and its plan.
//!
//! Both matrix products on `wgmma` (S = QKᵀ with Q and K from 128-byte-swizzled shared
//! memory, O += PV with P from registers and V through a transposed descriptor), one consumer
//! warpgroup per 64 query rows, two per CTA, in two pipelines ([`Pipeline`]): `cp.async` loads
//! by every thread (step 1 of issue 13), or warp specialization with a TMA producer warpgroup
//! and mbarriers (steps 2–3; dense problems only), optionally with each consumer's softmax
//! overlapping its previous PV. Covers bf16/fp16, head dims up to 256 (padded to 64/128/256),
//! every mask, GQA and varlen (up to hdim 128); softcap and non-positive scales go to the
//! sm80 family (the plan returns `None`).

use super::{
    DType, DeviceProps, ForwardVariant, KernelFamily, KernelVariant, LaunchShape, SourceFile,
    COMMON_HEADERS,
};
use softmax_core::{Problem, ProblemError};

/// The headers of the sm90 family: the common ones it includes (the shared parameter block
/// among them) and its `wgmma` wrappers.
static HEADERS: [SourceFile; 6] = [
    COMMON_HEADERS[0],
    COMMON_HEADERS[1],
    COMMON_HEADERS[2],
    COMMON_HEADERS[3],
    COMMON_HEADERS[5],
    SourceFile {
        name: "sm90/wgmma.cuh",
        text: include_str!("sm90/wgmma.cuh"),
    },
];

/// The Hopper forward kernel (sm_90a only: `wgmma` does not exist elsewhere).
pub static FAMILY: KernelFamily = KernelFamily {
    name: "flash_fwd_sm90",
    main: SourceFile {
        name: "sm90/flash_fwd.cu",
        text: include_str!("sm90/flash_fwd.cu"),
    },
    headers: &HEADERS,
    entries: &["flash_fwd_sm90"],
    min_capability: (9, 0),
    max_major: Some(9),
};

/// How the sm90 kernel moves K/V tiles into shared memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Pipeline {
    /// Every thread loads with `cp.async`; one CTA barrier per tile. Any problem (varlen too).
    CpAsync,
    /// A producer warpgroup issues TMA loads (tensor maps encoded per launch), completing on
    /// mbarriers; two consumer warpgroups run independently. Dense problems only.
    WarpSpecialized,
    /// [`Pipeline::WarpSpecialized`] with intra-warpgroup overlap: each consumer runs a tile's
    /// QKᵀ and softmax while the previous tile's PV is in flight. Dense problems only.
    WarpSpecializedOverlap,
}

/// One compiled specialisation of the sm90 forward kernel (two consumer warpgroups, 128 query
/// rows per CTA).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Variant {
    /// Head dim the tiles are laid out for (64, 128, 256).
    pub hdp: u32,
    /// Keys per K/V tile (multiple of 64).
    pub block_n: u32,
    /// The load pipeline.
    pub pipeline: Pipeline,
    /// Element type.
    pub dtype: DType,
}

impl KernelVariant for Variant {
    fn family(&self) -> &'static KernelFamily {
        &FAMILY
    }
    fn defines(&self) -> Vec<String> {
        vec![
            format!("-DHDP={}", self.hdp),
            format!("-DBLOCK_N={}", self.block_n),
            format!("-DIS_BF16={}", u32::from(self.dtype == DType::Bf16)),
            format!("-DWS={}", u32::from(self.ws())),
            format!(
                "-DOVERLAP={}",
                u32::from(self.pipeline == Pipeline::WarpSpecializedOverlap)
            ),
        ]
    }
    fn entry(&self) -> &'static str {
        FAMILY.entries[0]
    }
    fn name(&self) -> String {
        format!(
            "fwd_sm90_{}_d{}_{}x{}{}",
            self.dtype.name(),
            self.hdp,
            self.block_m(),
            self.block_n,
            match self.pipeline {
                Pipeline::CpAsync => "_cpasync",
                Pipeline::WarpSpecialized => "_ws",
                Pipeline::WarpSpecializedOverlap => "_wso",
            }
        )
    }
}

impl Variant {
    /// Whether the variant is warp-specialized (TMA producer; tensor-map kernel parameters).
    pub fn ws(&self) -> bool {
        self.pipeline != Pipeline::CpAsync
    }

    /// Query rows per CTA.
    pub fn block_m(&self) -> u32 {
        128
    }

    /// Threads per CTA: two consumer warpgroups, and the producer's.
    pub fn threads(&self) -> u32 {
        if self.ws() {
            384
        } else {
            256
        }
    }

    /// Dynamic shared memory per CTA in bytes: the Q tile, two K and two V tiles (16-bit),
    /// the mbarriers (9 of 8 bytes, 128 reserved), and 1 KiB for aligning the tiles to the
    /// 1024-byte swizzle period by hand.
    pub fn smem_bytes(&self) -> u32 {
        (self.block_m() + 4 * self.block_n) * self.hdp * 2 + 128 + 1024
    }

    /// Every variant the plan can select (what the CI compile check builds for sm_90a).
    pub fn all() -> Vec<Variant> {
        let mut all = Vec::new();
        for dtype in [DType::Bf16, DType::F16] {
            for hdp in [64, 128, 256] {
                for pipeline in [
                    Pipeline::CpAsync,
                    Pipeline::WarpSpecialized,
                    Pipeline::WarpSpecializedOverlap,
                ] {
                    let v = tile_config(hdp, dtype, pipeline);
                    if v.pipeline == pipeline && covered(&v) {
                        all.push(v);
                    }
                }
            }
        }
        all
    }
}

/// Tiles per padded head dim: 128 query rows (two consumer warpgroups); 128-key tiles up to
/// hdim 128, 64 at 256 (the O accumulator takes 128 registers a thread there). Not tuned yet.
/// Whether the family runs a variant: the cp.async pipeline at hdim 256 (256 threads, no
/// `setmaxnreg`) spills 12 bytes since the tile body was split for the overlapped pipeline, so
/// varlen hdim-256 problems go to the sm80 family.
fn covered(v: &Variant) -> bool {
    !(v.hdp == 256 && v.pipeline == Pipeline::CpAsync)
}

/// The overlapped pipeline holds two tiles' worth of S/P registers: at hdim 256 it spills
/// (8 bytes), so it falls back to the plain warp-specialized one there.
fn tile_config(hdp: u32, dtype: DType, pipeline: Pipeline) -> Variant {
    let pipeline = match (hdp, pipeline) {
        (256, Pipeline::WarpSpecializedOverlap) => Pipeline::WarpSpecialized,
        (_, p) => p,
    };
    Variant {
        hdp,
        block_n: if hdp == 256 { 64 } else { 128 },
        pipeline,
        dtype,
    }
}

/// The pipeline a fixed-length problem gets unless the caller forces one: the overlapped one at
/// head dim 64, where two H200 calls (docs/history/gpu-notes.md, 2026-12-01) measured it 8–10 %
/// faster without a mask and 3.6 % faster causal at 8k; the plain warp-specialized one above
/// (hdim 128: +3 % / −0.5 %, inside run-to-run noise; hdim 256: the overlap spills).
fn default_pipeline(hdp: u32) -> Pipeline {
    if hdp == 64 {
        Pipeline::WarpSpecializedOverlap
    } else {
        Pipeline::WarpSpecialized
    }
}

/// The launch choice of the sm90 family: `Ok(None)` when the device is not sm_90 or the
/// problem needs what the family does not cover (softcap, a non-positive scale) — the caller
/// then plans with the sm80 family — and also when there is nothing to compute (the sm80
/// plan says so again). `pipeline` overrides the choice of [`Pipeline`] (tests, tuning);
/// varlen problems always take `CpAsync`. An error when the tiles need more shared memory
/// than the device has.
pub fn plan_forward(
    problem: &Problem,
    dtype: DType,
    pipeline: Option<Pipeline>,
    props: &DeviceProps,
) -> Result<Option<LaunchShape>, ProblemError> {
    if (props.major, props.minor) != (9, 0) {
        return Ok(None);
    }
    if problem.softcap().is_some() || problem.softmax_scale() <= 0.0 {
        return Ok(None);
    }
    let dim = problem.head_dim().max(problem.head_dim_v()) as u32;
    let hdp = match dim {
        0..=64 => 64,
        65..=128 => 128,
        _ => 256,
    };
    let pipeline = if problem.is_varlen() {
        Pipeline::CpAsync
    } else {
        pipeline.unwrap_or(default_pipeline(hdp))
    };
    let variant = tile_config(hdp, dtype, pipeline);
    if !covered(&variant) {
        return Ok(None);
    }
    let m_blocks = (problem.max_seqlen_q() as u32).div_ceil(variant.block_m());
    if m_blocks == 0 {
        return Ok(None);
    }
    if variant.smem_bytes() > props.smem_optin_bytes {
        return Err(ProblemError::Unsupported {
            what: "the kernel's shared memory exceeds this device's limit",
        });
    }
    Ok(Some(LaunchShape {
        variant: ForwardVariant::Sm90(variant),
        grid: (m_blocks, problem.heads_q() as u32, problem.batch() as u32),
        block: variant.threads(),
        smem_bytes: variant.smem_bytes(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use softmax_core::ProblemDesc;

    #[test]
    fn plans_only_on_hopper_and_only_what_it_covers() {
        let problem = ProblemDesc::new(2, 1000, 1000, 4, 2, 128)
            .causal()
            .validate(256)
            .expect("valid");
        let h200 = DeviceProps::h200();
        let launch = plan_forward(&problem, DType::Bf16, None, &h200)
            .expect("plan")
            .expect("launch");
        assert_eq!(launch.grid, (8, 4, 2));
        assert_eq!(launch.block, 384);
        assert!(matches!(launch.variant, ForwardVariant::Sm90(v) if v.hdp == 128 && v.ws()));
        let cp = plan_forward(&problem, DType::Bf16, Some(Pipeline::CpAsync), &h200)
            .expect("plan")
            .expect("launch");
        assert_eq!(cp.block, 256);
        // The default pipeline per head dim: overlapped at 64, plain warp-specialized above.
        for (d, want) in [
            (64, Pipeline::WarpSpecializedOverlap),
            (128, Pipeline::WarpSpecialized),
            (256, Pipeline::WarpSpecialized),
        ] {
            let p = ProblemDesc::new(1, 300, 300, 2, 2, d)
                .validate(256)
                .expect("valid");
            let launch = plan_forward(&p, DType::Bf16, None, &h200)
                .expect("plan")
                .expect("launch");
            assert!(
                matches!(launch.variant, ForwardVariant::Sm90(v) if v.pipeline == want),
                "hdim {d}: {:?}",
                launch.variant
            );
        }
        assert!(
            plan_forward(&problem, DType::Bf16, None, &DeviceProps::a100())
                .expect("plan")
                .is_none()
        );
        // Varlen: TMA bounds are per tensor, so the cp.async pipeline.
        let (cu_q, cu_k) = ([0u32, 100, 300], [0u32, 50, 400]);
        let varlen = ProblemDesc::varlen(&cu_q, &cu_k, 4, 4, 128)
            .validate(256)
            .expect("valid");
        let launch = plan_forward(&varlen, DType::Bf16, Some(Pipeline::WarpSpecialized), &h200)
            .expect("plan")
            .expect("launch");
        assert!(matches!(launch.variant, ForwardVariant::Sm90(v) if !v.ws()));
        // ... except at hdim 256, where that pipeline spills: sm80.
        let varlen_256 = ProblemDesc::varlen(&cu_q, &cu_k, 4, 4, 256)
            .validate(256)
            .expect("valid");
        assert!(plan_forward(&varlen_256, DType::Bf16, None, &h200)
            .expect("plan")
            .is_none());
        let softcap = ProblemDesc::new(1, 64, 64, 1, 1, 128)
            .softcap(5.0)
            .validate(256)
            .expect("valid");
        assert!(plan_forward(&softcap, DType::Bf16, None, &h200)
            .expect("plan")
            .is_none());
    }

    #[test]
    fn every_variant_fits_the_h200_and_has_a_distinct_name() {
        let all = Variant::all();
        for v in &all {
            assert!(v.smem_bytes() <= DeviceProps::h200().smem_optin_bytes);
        }
        let mut names: Vec<String> = all.iter().map(KernelVariant::name).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), all.len());
    }
}
