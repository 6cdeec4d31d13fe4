//! The kernel sources and their registry: each family (one main `.cu` source, the shared
//! `common/*.cuh` headers it includes, its entry points and the architectures it runs on), its
//! compile-time variants and its launch-choice (plan) function, which takes the device's
//! properties.
//!
//! Layout of the sources (`src/kernels/`): `common/` holds the PTX helpers, the mask, the
//! online-softmax steps and the row epilogue that every family shares; `sm80/` the
//! `mma.sync` forward kernel ([`sm80`]); `sm90/` the Hopper `wgmma` forward kernel ([`sm90`]);
//! `decode/` the split-KV decode, combine and append kernels ([`decode`]); `bwd_sm80/` the
//! `mma.sync` backward with its pre/post-pass ([`bwd_sm80`]).
//! [`plan_forward`] picks the forward family ([`KernelFamilyChoice`]) and asks its plan.

pub mod bwd_sm80;
pub mod decode;
pub mod sm80;
pub mod sm90;

pub use sm80::{Tiles, Variant};

pub use softmax_core::DType;

/// One source file of a kernel family: the name NVRTC knows it by (the `#include` name for a
/// header) and its text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SourceFile {
    /// File name as NVRTC sees it, e.g. `common/ptx.cuh`.
    pub name: &'static str,
    /// The source text (embedded with `include_str!`).
    pub text: &'static str,
}

/// The headers every family may include (`#include "common/…"`).
pub const COMMON_HEADERS: [SourceFile; 6] = [
    SourceFile {
        name: "common/ptx.cuh",
        text: include_str!("kernels/common/ptx.cuh"),
    },
    SourceFile {
        name: "common/mask.cuh",
        text: include_str!("kernels/common/mask.cuh"),
    },
    SourceFile {
        name: "common/softmax.cuh",
        text: include_str!("kernels/common/softmax.cuh"),
    },
    SourceFile {
        name: "common/epilogue.cuh",
        text: include_str!("kernels/common/epilogue.cuh"),
    },
    SourceFile {
        name: "common/tile.cuh",
        text: include_str!("kernels/common/tile.cuh"),
    },
    SourceFile {
        name: "common/params.cuh",
        text: include_str!("kernels/common/params.cuh"),
    },
];

/// A kernel family: one main source compiled with per-variant defines, the headers it
/// includes, its entry points and the compute capabilities it runs on.
#[derive(Debug, PartialEq, Eq)]
pub struct KernelFamily {
    /// The family's name, e.g. `flash_fwd_sm80` (part of cache keys and file names).
    pub name: &'static str,
    /// The main source.
    pub main: SourceFile,
    /// Headers handed to NVRTC (all of them; the source includes what it needs).
    pub headers: &'static [SourceFile],
    /// The `extern "C"` entry points of a compiled variant.
    pub entries: &'static [&'static str],
    /// Lowest compute capability (major, minor) the family runs on.
    pub min_capability: (i32, i32),
    /// Highest compute capability major it is meant for (`None`: any newer one too).
    pub max_major: Option<i32>,
}

impl KernelFamily {
    /// Whether the family runs on a device of compute capability `major.minor`.
    pub fn supports(&self, major: i32, minor: i32) -> bool {
        (major, minor) >= self.min_capability && self.max_major.is_none_or(|m| major <= m)
    }
}

/// Every kernel family of the crate.
pub fn families() -> &'static [&'static KernelFamily] {
    static FAMILIES: [&KernelFamily; 7] = [
        &sm80::FAMILY,
        &sm90::FAMILY,
        &decode::FAMILY,
        &decode::COMBINE_FAMILY,
        &decode::APPEND_FAMILY,
        &bwd_sm80::FAMILY,
        &bwd_sm80::PREP_FAMILY,
    ];
    &FAMILIES
}

/// One compile-time specialisation of a kernel family: what the compiler needs to build it.
pub trait KernelVariant {
    /// The family the variant belongs to.
    fn family(&self) -> &'static KernelFamily;
    /// The NVRTC `-D` options of the variant.
    fn defines(&self) -> Vec<String>;
    /// The entry point to load from the compiled module.
    fn entry(&self) -> &'static str;
    /// A readable, unique name (for logs, errors and cache file names).
    fn name(&self) -> String;
}

/// A variant of any forward family: what a launch runs and the device's kernel table keys on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ForwardVariant {
    /// The `mma.sync` family (sm_80 and newer).
    Sm80(sm80::Variant),
    /// The `wgmma` family (sm_90a).
    Sm90(sm90::Variant),
}

impl ForwardVariant {
    /// A readable, unique name, e.g. `fwd_sm90_bf16_d128_128x128_ws`.
    pub fn name(&self) -> String {
        KernelVariant::name(self)
    }

    /// Dynamic shared memory per CTA in bytes.
    pub fn smem_bytes(&self) -> u32 {
        match self {
            ForwardVariant::Sm80(v) => v.smem_bytes(),
            ForwardVariant::Sm90(v) => v.smem_bytes(),
        }
    }

    /// Whether the kernel carries mask code (the sm90 kernel always does, for partial tiles).
    pub fn masked(&self) -> bool {
        match self {
            ForwardVariant::Sm80(v) => v.masked,
            ForwardVariant::Sm90(_) => true,
        }
    }

    /// Every variant of every forward family (what the CI compile check and `fa warmup`
    /// build, each for the architectures its family supports).
    pub fn all() -> Vec<ForwardVariant> {
        let sm80 = sm80::Variant::all().into_iter().map(ForwardVariant::Sm80);
        let sm90 = sm90::Variant::all().into_iter().map(ForwardVariant::Sm90);
        sm80.chain(sm90).collect()
    }
}

impl KernelVariant for ForwardVariant {
    fn family(&self) -> &'static KernelFamily {
        match self {
            ForwardVariant::Sm80(v) => v.family(),
            ForwardVariant::Sm90(v) => v.family(),
        }
    }
    fn defines(&self) -> Vec<String> {
        match self {
            ForwardVariant::Sm80(v) => KernelVariant::defines(v),
            ForwardVariant::Sm90(v) => v.defines(),
        }
    }
    fn entry(&self) -> &'static str {
        match self {
            ForwardVariant::Sm80(v) => KernelVariant::entry(v),
            ForwardVariant::Sm90(v) => v.entry(),
        }
    }
    fn name(&self) -> String {
        match self {
            ForwardVariant::Sm80(v) => KernelVariant::name(v),
            ForwardVariant::Sm90(v) => v.name(),
        }
    }
}

/// Grid, block and shared memory of one launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchShape {
    /// The kernel variant (and with it the family).
    pub variant: ForwardVariant,
    /// Grid (query blocks, query heads, batch).
    pub grid: (u32, u32, u32),
    /// Threads per CTA.
    pub block: u32,
    /// Dynamic shared memory in bytes.
    pub smem_bytes: u32,
}

/// Which forward family a call may use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum KernelFamilyChoice {
    /// The measured-best family for the device and problem: on sm_90 the sm90 family's
    /// warp-specialized kernel for dense problems it covers (1.26–2.15× the sm80 family in the
    /// same device call, every head dim and mask at 2k and 8k: docs/history/gpu-notes.md,
    /// 2026-12-01);
    /// the sm80 family otherwise (varlen, softcap, scale ≤ 0, other GPUs).
    #[default]
    Auto,
    /// The `mma.sync` family, on any device (the fallback).
    Sm80,
    /// The `wgmma` family where its plan covers the problem on this device (sm_90), the sm80
    /// family otherwise ([`ForwardStats::launch`](crate::ForwardStats) says which ran).
    Sm90,
}

/// The launch choice of a forward call: the family `choice` allows for the device `props`
/// describes, then that family's plan. `tiles` overrides the sm80 family's tiles (and with it
/// forces that family); `pipeline` the sm90 family's load pipeline. `Ok(None)` when there is
/// nothing to compute.
pub fn plan_forward(
    problem: &softmax_core::Problem,
    dtype: DType,
    choice: KernelFamilyChoice,
    tiles: Option<Tiles>,
    pipeline: Option<sm90::Pipeline>,
    props: &DeviceProps,
) -> Result<Option<LaunchShape>, softmax_core::ProblemError> {
    // Auto: only what was measured faster (the warp-specialized pipeline, dense problems);
    // the cp.async pipeline that varlen takes has not been timed against sm80 yet.
    let try_sm90 = match choice {
        KernelFamilyChoice::Sm90 => true,
        KernelFamilyChoice::Auto => !problem.is_varlen(),
        KernelFamilyChoice::Sm80 => false,
    };
    if try_sm90 && tiles.is_none() {
        if let Some(launch) = sm90::plan_forward(problem, dtype, pipeline, props)? {
            return Ok(Some(launch));
        }
    }
    sm80::plan_forward(problem, dtype, tiles, props)
}

/// What the plan functions need to know about a device. [`crate::Device::open`] reads it from
/// the driver; the constructors describe known GPUs for planning without one (tests, ahead of
/// time compilation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeviceProps {
    /// Compute capability major.
    pub major: i32,
    /// Compute capability minor.
    pub minor: i32,
    /// Streaming multiprocessors.
    pub sm_count: u32,
    /// Shared memory one CTA may use after opting in (bytes).
    pub smem_optin_bytes: u32,
    /// Shared memory per SM (bytes).
    pub smem_per_sm_bytes: u32,
    /// 32-bit registers per SM.
    pub regs_per_sm: u32,
    /// L2 cache (bytes).
    pub l2_bytes: u32,
}

impl DeviceProps {
    /// The properties a compute capability and these sizes describe.
    pub const fn new(major: i32, minor: i32, sm_count: u32, smem_optin_bytes: u32) -> DeviceProps {
        DeviceProps {
            major,
            minor,
            sm_count,
            smem_optin_bytes,
            smem_per_sm_bytes: smem_optin_bytes,
            regs_per_sm: 65536,
            l2_bytes: 0,
        }
    }

    /// NVIDIA H200 (SXM): sm_90, 132 SMs, 227 KiB of opt-in shared memory per CTA.
    pub const fn h200() -> DeviceProps {
        DeviceProps {
            smem_per_sm_bytes: 228 * 1024,
            l2_bytes: 50 * 1024 * 1024,
            ..DeviceProps::new(9, 0, 132, 227 * 1024)
        }
    }

    /// NVIDIA A100 (SXM): sm_80, 108 SMs, 163 KiB of opt-in shared memory per CTA.
    pub const fn a100() -> DeviceProps {
        DeviceProps {
            smem_per_sm_bytes: 164 * 1024,
            l2_bytes: 40 * 1024 * 1024,
            ..DeviceProps::new(8, 0, 108, 163 * 1024)
        }
    }

    /// The NVRTC architecture kernels are compiled for on this device (see [`arch_for`]).
    pub fn arch(&self) -> String {
        arch_for(self.major, self.minor)
    }
}

/// The NVRTC architecture for a compute capability: `sm_90a` on Hopper (its own instructions
/// need the `a` target), `sm_XY` otherwise.
pub fn arch_for(major: i32, minor: i32) -> String {
    if (major, minor) == (9, 0) {
        "sm_90a".to_string()
    } else {
        format!("sm_{major}{minor}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hopper_gets_the_a_target() {
        assert_eq!(arch_for(9, 0), "sm_90a");
        assert_eq!(arch_for(8, 0), "sm_80");
        assert_eq!(arch_for(8, 9), "sm_89");
        assert_eq!(arch_for(12, 0), "sm_120");
        assert_eq!(DeviceProps::h200().arch(), "sm_90a");
        assert_eq!(DeviceProps::a100().arch(), "sm_80");
    }

    #[test]
    fn every_family_has_entries_and_its_includes() {
        for family in families() {
            assert!(!family.entries.is_empty());
            for line in family.main.text.lines() {
                if let Some(rest) = line.trim().strip_prefix("#include \"") {
                    let name = rest.trim_end_matches('"');
                    assert!(
                        family.headers.iter().any(|h| h.name == name),
                        "{} includes {name}, which is not in its header list",
                        family.name
                    );
                }
            }
        }
        assert!(sm80::FAMILY.supports(8, 0) && sm80::FAMILY.supports(9, 0));
        assert!(!sm80::FAMILY.supports(7, 5));
        assert!(sm90::FAMILY.supports(9, 0) && !sm90::FAMILY.supports(8, 0));
        assert!(!sm90::FAMILY.supports(10, 0));
    }

    #[test]
    fn the_family_choice_reaches_the_plan() {
        let problem = softmax_core::ProblemDesc::new(1, 300, 300, 2, 2, 128)
            .validate(256)
            .expect("valid");
        let plan = |choice, props: &DeviceProps| {
            plan_forward(&problem, DType::Bf16, choice, None, None, props)
                .expect("plan")
                .expect("launch")
                .variant
        };
        let h200 = DeviceProps::h200();
        assert!(matches!(
            plan(KernelFamilyChoice::Auto, &h200),
            ForwardVariant::Sm90(v) if v.ws()
        ));
        assert!(matches!(
            plan(KernelFamilyChoice::Sm80, &h200),
            ForwardVariant::Sm80(_)
        ));
        assert!(matches!(
            plan(KernelFamilyChoice::Sm90, &h200),
            ForwardVariant::Sm90(_)
        ));
        let a100 = DeviceProps::a100();
        assert!(matches!(
            plan(KernelFamilyChoice::Sm90, &a100),
            ForwardVariant::Sm80(_)
        ));
        assert!(matches!(
            plan(KernelFamilyChoice::Auto, &a100),
            ForwardVariant::Sm80(_)
        ));
        // Auto keeps varlen on sm80 (the sm90 cp.async pipeline is not measured faster yet).
        let (cu_q, cu_k) = ([0u32, 100, 300], [0u32, 50, 400]);
        let varlen = softmax_core::ProblemDesc::varlen(&cu_q, &cu_k, 4, 4, 128)
            .validate(256)
            .expect("valid");
        let auto = plan_forward(
            &varlen,
            DType::Bf16,
            KernelFamilyChoice::Auto,
            None,
            None,
            &h200,
        );
        assert!(matches!(
            auto.expect("plan").expect("launch").variant,
            ForwardVariant::Sm80(_)
        ));
    }
}
