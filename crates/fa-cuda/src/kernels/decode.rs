//! The decode family (sm_80 and newer): split-KV attention of a few queries per sequence
//! against a KV cache (padded with `seqused_k`, or paged through an int32 block table), the
//! combine kernel that merges the splits, and the in-place append of new K/V tokens. Its
//! sources (`decode/*.cu`, `common/merge.cuh`; the parameter block is the forward's,
//! `common/params.cuh`), variants and plan: the split count from the problem and [`DeviceProps::sm_count`] (FlashAttention's
//! wave-efficiency rule), overridable by [`crate::ForwardOptions::splits`].

use super::{DType, DeviceProps, KernelFamily, KernelVariant, SourceFile, COMMON_HEADERS};
use crate::params::{tau_of, Params};
use softmax_core::{KvCache, Problem, ProblemError, RescalePolicy};

/// The headers of the decode family: the common ones (the shared parameter block among them)
/// and the merge rule.
pub static DECODE_HEADERS: [SourceFile; 7] = [
    COMMON_HEADERS[0],
    COMMON_HEADERS[1],
    COMMON_HEADERS[2],
    COMMON_HEADERS[3],
    COMMON_HEADERS[4],
    COMMON_HEADERS[5],
    SourceFile {
        name: "common/merge.cuh",
        text: include_str!("common/merge.cuh"),
    },
];

/// The split-KV decode kernel.
pub static FAMILY: KernelFamily = KernelFamily {
    name: "flash_decode_sm80",
    main: SourceFile {
        name: "decode/flash_decode.cu",
        text: include_str!("decode/flash_decode.cu"),
    },
    headers: &DECODE_HEADERS,
    entries: &["flash_decode"],
    min_capability: (8, 0),
    max_major: None,
};

/// The combine kernel: merges the splits' partial rows and writes O and the LSE.
pub static COMBINE_FAMILY: KernelFamily = KernelFamily {
    name: "flash_decode_combine",
    main: SourceFile {
        name: "decode/combine.cu",
        text: include_str!("decode/combine.cu"),
    },
    headers: &DECODE_HEADERS,
    entries: &["flash_decode_combine"],
    min_capability: (8, 0),
    max_major: None,
};

/// The append kernel: new K/V tokens written into the cache at each sequence's used length.
pub static APPEND_FAMILY: KernelFamily = KernelFamily {
    name: "append_kv",
    main: SourceFile {
        name: "decode/append.cu",
        text: include_str!("decode/append.cu"),
    },
    headers: &DECODE_HEADERS,
    entries: &["append_kv"],
    min_capability: (8, 0),
    max_major: None,
};

/// One compiled specialisation of the decode kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DecodeVariant {
    /// Head dim the tiles are laid out for (64, 128, 256).
    pub hdp: u32,
    /// 16-row m-tiles per CTA (the query heads of a KV group times the queries).
    pub mt: u32,
    /// Keys per warp per tile.
    pub wn: u32,
    /// Warps per CTA (they split each tile's keys).
    pub warps: u32,
    /// K/V tiles in flight.
    pub stages: u32,
    /// Element type.
    pub dtype: DType,
    /// Softcap or a non-positive scale: scores transformed before the max.
    pub general_scores: bool,
}

impl DecodeVariant {
    /// Query rows per CTA.
    pub fn block_m(&self) -> u32 {
        16 * self.mt
    }
    /// Keys per tile.
    pub fn block_n(&self) -> u32 {
        self.warps * self.wn
    }
    /// Threads per CTA.
    pub fn threads(&self) -> u32 {
        self.warps * 32
    }
    /// K/V rows each thread copies per tile (one 16-byte chunk column of each).
    pub fn load_iters(&self) -> u32 {
        self.block_n() * (self.hdp / 8) / self.threads()
    }
    /// Whether the kernel reads a paged cache of `block_size`-key blocks through one
    /// block-table entry per thread and tile, each thread's rows a constant step apart (as in
    /// a padded cache): blocks that are whole multiples of the tile, and power-of-two blocks
    /// that divide the tile and hold at least [`DecodeVariant::load_iters`] keys, a power of
    /// two (the kernel then deals each thread its rows from one block). Smaller or odd blocks
    /// take one table entry per row.
    pub fn reads_whole_blocks(&self, block_size: usize) -> bool {
        let block_n = self.block_n() as usize;
        let rows = self.load_iters() as usize;
        block_size.is_power_of_two()
            && (block_size % block_n == 0
                || (rows.is_power_of_two() && block_n % block_size == 0 && block_size >= rows))
    }
    /// Dynamic shared memory: the Q tile, `stages` K and V tiles (16-bit) and the paged
    /// cache's two rings of `2·stages` tiles of int32 (block-table entries, and a block walk's
    /// logical blocks), or, if larger, the warps' partial rows (f32) that the final merge reads.
    pub fn smem_bytes(&self) -> u32 {
        // Q, the K and V stages, and the two rings (TAB_RING = 2·STAGES tiles of int32 each).
        let tiles = (self.block_m() + 2 * self.stages * self.block_n()) * self.hdp * 2
            + 2 * 2 * self.stages * self.block_n() * 4;
        let merge = self.warps * self.block_m() * (self.hdp + 2) * 4;
        tiles.max(merge)
    }
    /// The NVRTC `-D` options.
    pub fn defines(&self) -> Vec<String> {
        vec![
            format!("-DHDP={}", self.hdp),
            format!("-DMT={}", self.mt),
            format!("-DWN={}", self.wn),
            format!("-DWARPS={}", self.warps),
            format!("-DSTAGES={}", self.stages),
            format!("-DIS_BF16={}", u32::from(self.dtype == DType::Bf16)),
            format!("-DGENERAL_SCORES={}", u32::from(self.general_scores)),
        ]
    }
    /// A readable name, e.g. `decode_sm80_bf16_d128_m16_n64_w4_s4` (`_gen`: general scores).
    pub fn name(&self) -> String {
        format!(
            "decode_sm80_{}_d{}_m{}_n{}_w{}_s{}{}",
            self.dtype.name(),
            self.hdp,
            self.block_m(),
            self.block_n(),
            self.warps,
            self.stages,
            if self.general_scores { "_gen" } else { "" }
        )
    }
    /// The tuned variant for a padded head dim, a row count per KV head and a dtype: one
    /// 16-row m-tile, or two where the rows need them and the registers allow (head dim ≤ 128);
    /// tiles of 64 keys (128 at head dim 64); 3 stages at head dim 64 and 128 (two CTAs of
    /// ~100 KiB per SM: 1.1-1.6x faster than one CTA with 4 stages from 16k keys up, batch 1
    /// and 16, padded and paged; 0.94x at batch 1 with 4k keys; docs/history/gpu-notes.md,
    /// 2026-12-01), 2 at 256 (one CTA of 139 KiB). See [`DecodeVariant::with_stages`] for the
    /// other counts.
    pub fn for_shape(hdp: u32, rows: usize, dtype: DType, general_scores: bool) -> DecodeVariant {
        let mt = if hdp <= 128 && rows > 16 { 2 } else { 1 };
        let (wn, stages) = match hdp {
            64 => (32, 3),
            128 => (16, 3),
            _ => (16, 2),
        };
        DecodeVariant {
            hdp,
            mt,
            wn,
            warps: 4,
            stages,
            dtype,
            general_scores,
        }
    }
    /// This variant with `warps` warps per CTA and tiles of `block_n` keys (each warp a
    /// multiple of 16 keys; at most 256 keys and 8 warps, and at least 16 output columns
    /// per thread in the final merge).
    pub fn with_tile(self, warps: u32, block_n: u32) -> Result<DecodeVariant, ProblemError> {
        let merge_cols = (self.hdp * self.mt).checked_div(2 * warps).unwrap_or(0);
        if !(1..=8).contains(&warps)
            || block_n == 0
            || block_n % (16 * warps) != 0
            || block_n > 256
            || merge_cols < 8
            || merge_cols % 8 != 0
        {
            return Err(ProblemError::Unsupported {
                what: "decode tiles take 1-8 warps of a multiple of 16 keys each, at most 256 keys",
            });
        }
        Ok(DecodeVariant {
            warps,
            wn: block_n / warps,
            ..self
        })
    }
    /// This variant with `stages` K/V tiles in flight (2 to [`MAX_DECODE_STAGES`]).
    pub fn with_stages(self, stages: u32) -> DecodeVariant {
        DecodeVariant {
            stages: stages.clamp(2, MAX_DECODE_STAGES),
            ..self
        }
    }
    /// CTAs of this variant one SM holds at once (by shared memory, with the 1 KiB the
    /// runtime reserves per CTA, and by threads), at least 1.
    pub fn ctas_per_sm(&self, props: &DeviceProps) -> u32 {
        let by_smem = props.smem_per_sm_bytes / (self.smem_bytes() + 1024);
        let by_threads = 2048 / self.threads();
        by_smem.min(by_threads).max(1)
    }
    /// Every variant the plan picks by default (three stages, and two for long caches over
    /// many sequences at head dim ≤ 128), and the bf16 plain-score ones with the stage
    /// counts of [`DECODE_TUNING_STAGES`] that fit an A100 (what the CI compile check and
    /// `fa warmup` build; other overrides compile on first use).
    pub fn all() -> Vec<DecodeVariant> {
        let mut all = Vec::new();
        for dtype in [DType::Bf16, DType::F16] {
            for hdp in [64, 128, 256] {
                for rows in [16, 32] {
                    for general in [false, true] {
                        let v = DecodeVariant::for_shape(hdp, rows, dtype, general);
                        // Tuning stage counts for the benchmarked kind only (bf16, plain
                        // scores): the others compile on first use.
                        let tuned = dtype == DType::Bf16 && !general;
                        // The plan's long-cache choice (STREAMING_STAGES) for every kind.
                        let streaming = (hdp <= 128).then(|| v.with_stages(STREAMING_STAGES));
                        for v in std::iter::once(v).chain(streaming).chain(
                            DECODE_TUNING_STAGES
                                .iter()
                                .filter(|_| tuned)
                                .map(|&s| v.with_stages(s))
                                .filter(|t| t.smem_bytes() <= DeviceProps::a100().smem_optin_bytes),
                        ) {
                            if !all.contains(&v) {
                                all.push(v);
                            }
                        }
                    }
                }
            }
        }
        all
    }
}

impl KernelVariant for DecodeVariant {
    fn family(&self) -> &'static KernelFamily {
        &FAMILY
    }
    fn defines(&self) -> Vec<String> {
        DecodeVariant::defines(self)
    }
    fn entry(&self) -> &'static str {
        FAMILY.entries[0]
    }
    fn name(&self) -> String {
        DecodeVariant::name(self)
    }
}

/// The combine kernel of one dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CombineVariant {
    /// Element type of O.
    pub dtype: DType,
}

impl CombineVariant {
    /// Warps (rows) per CTA, as the source's `WARPS`.
    pub const WARPS: u32 = 4;
}

impl KernelVariant for CombineVariant {
    fn family(&self) -> &'static KernelFamily {
        &COMBINE_FAMILY
    }
    fn defines(&self) -> Vec<String> {
        vec![format!(
            "-DIS_BF16={}",
            u32::from(self.dtype == DType::Bf16)
        )]
    }
    fn entry(&self) -> &'static str {
        COMBINE_FAMILY.entries[0]
    }
    fn name(&self) -> String {
        format!("decode_combine_{}", self.dtype.name())
    }
}

/// The append kernel (a byte copy: one variant for both 16-bit dtypes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AppendVariant;

impl KernelVariant for AppendVariant {
    fn family(&self) -> &'static KernelFamily {
        &APPEND_FAMILY
    }
    fn defines(&self) -> Vec<String> {
        Vec::new()
    }
    fn entry(&self) -> &'static str {
        APPEND_FAMILY.entries[0]
    }
    fn name(&self) -> String {
        "append_kv".to_string()
    }
}

/// The launch choice of a decode call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodePlan {
    /// The decode kernel's variant.
    pub variant: DecodeVariant,
    /// Grid (m-blocks × splits, KV heads, sequences).
    pub grid: (u32, u32, u32),
    /// Threads per CTA.
    pub block: u32,
    /// Dynamic shared memory in bytes.
    pub smem_bytes: u32,
    /// Key splits (1: the decode kernel writes O itself, no combine).
    pub num_splits: u32,
    /// CTAs of the combine kernel (0 without splits).
    pub combine_blocks: u32,
    /// Bytes of f32 workspace the splits need (0 without splits).
    pub workspace_bytes: usize,
    /// Whether the kernel reads the paged blocks in the order of a block walk
    /// ([`block_walk`]: each sequence's blocks in ascending address order) where the call has
    /// one. The plan allows it for blocks of 8 keys or more that a tile's threads read whole
    /// ([`DecodeVariant::reads_whole_blocks`]), without a left window, unless
    /// [`DecodeOverrides::table_order`] asks for the table's order; a call's stats report
    /// whether its launch did walk.
    pub block_walk: bool,
}

/// The tuning overrides of a decode plan ([`crate::ForwardOptions`]' `splits` and
/// `decode_stages`); `None` leaves each to the plan.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DecodeOverrides {
    /// Force this many key splits (`Some(0)` is an error).
    pub splits: Option<u32>,
    /// K/V stages in flight (2 to [`MAX_DECODE_STAGES`]).
    pub stages: Option<u32>,
    /// Keys per K/V tile (a multiple of 16 × the warps: 64, 128 or 256 with 4 warps).
    pub block_n: Option<u32>,
    /// Warps per CTA (1 to 8; the tile keeps its keys unless `block_n` says otherwise).
    pub warps: Option<u32>,
    /// Read a paged cache's blocks in the block table's order even where a block walk could
    /// be used (A/B tests and tuning).
    pub table_order: bool,
}

impl From<&crate::ForwardOptions> for DecodeOverrides {
    fn from(opts: &crate::ForwardOptions) -> DecodeOverrides {
        DecodeOverrides {
            splits: opts.splits,
            stages: opts.decode_stages,
            block_n: opts.decode_block_n,
            warps: opts.decode_warps,
            table_order: opts.decode_table_order,
        }
    }
}

/// The most K/V stages a decode variant may keep in flight.
pub const MAX_DECODE_STAGES: u32 = 8;
/// The stage counts besides the default that tuning runs ([`crate::ForwardOptions`]'s
/// `decode_stages`) and the compile check cover, where they fit an A100's shared memory.
pub const DECODE_TUNING_STAGES: [u32; 3] = [2, 3, 4];

/// The fewest key tiles a split gets from the split rule: a split of fewer tiles spends most
/// of its time in its prologue and partial write (on the H200, 32 splits of 2 tiles at batch
/// 1, 4k keys, ran 1.19x slower than 16 of 4).
pub const MIN_TILES_PER_SPLIT: u32 = 4;

/// The largest split count (FlashAttention-2's cap).
pub const MAX_SPLITS: u32 = 128;

/// The split count of a launch of `ctas` CTAs (without splitting) whose longest sequence has
/// `n_tiles` key tiles, on `slots` CTA slots (SMs × CTAs per SM): 1 when the CTAs already
/// fill 80 % of the slots; otherwise as many splits as fill one wave of slots (every SM
/// then carries the same number of CTAs, so none streams more bytes than the others), at
/// most [`MAX_SPLITS`] and one per [`MIN_TILES_PER_SPLIT`] tiles, and among those counts the
/// largest that shortens the longest split (a count whose longest split equals the next
/// smaller count's only adds combine work). FlashAttention's rule (`hopper/heuristics.h`)
/// takes instead the smallest count within 85 % of the best wave efficiency, which with two
/// CTAs per SM left 40 of 132 SMs with one CTA and the others with two (on the H200).
pub fn num_splits_heuristic(ctas: u32, slots: u32, n_tiles: u32) -> u32 {
    let slots = slots.max(1);
    if ctas == 0 || ctas as f64 >= 0.8 * slots as f64 {
        return 1;
    }
    let cap = MAX_SPLITS
        .min(slots / ctas)
        .min(n_tiles / MIN_TILES_PER_SPLIT)
        .max(1);
    let eligible = |s: u32| s == 1 || n_tiles.div_ceil(s) != n_tiles.div_ceil(s - 1);
    (1..=cap).rev().find(|&s| eligible(s)).unwrap_or(1)
}

/// The stage count for long caches over many sequences: two stages, three CTAs per SM at
/// head dim ≤ 128.
pub const STREAMING_STAGES: u32 = 2;

/// Whether a paged call of blocks smaller than a tile streams long caches over enough CTAs
/// that [`STREAMING_STAGES`] (more CTAs per SM, fewer tiles in flight each) reads faster
/// than the default three stages:
/// unsplit CTAs for at least half the SMs, and a longest cache of at least 16k keys, at head
/// dim ≤ 128. H200, bf16, Llama-3 70B layer at batch 16 (docs/history/gpu-notes.md, 2026-12-01):
/// paged 16 at 16k keys 253.8 (3 stages, 2 splits) → 252.9 µs, 64k 981.9 → 973.4; at 4k keys
/// and at batch 1 three stages stay ahead. A padded cache keeps three stages and one CTA
/// per SM (the plan's slots), and so do blocks read in a block walk's address order: H100,
/// batch 16, paged 16 walked, 16k / 64k / 128k keys 361.6 / 1409.3 / 2806.5 µs under this
/// rule against 350.6 / 1394.4 / 2790.3 with one CTA per SM (docs/history/gpu-notes.md,
/// 2026-12-05).
fn use_streaming_stages(
    variant: &DecodeVariant,
    ctas: usize,
    longest_keys: usize,
    props: &DeviceProps,
) -> bool {
    variant.hdp <= 128
        && variant.stages > STREAMING_STAGES
        && 2 * ctas >= props.sm_count as usize
        && longest_keys >= 16 * 1024
}

/// Padded head dim of the tiles.
fn hdp_of(problem: &Problem) -> u32 {
    match problem.head_dim().max(problem.head_dim_v()) {
        0..=64 => 64,
        65..=128 => 128,
        _ => 256,
    }
}

/// The plan of a decode call on a device: variant, split count (`splits` forces it; `Some(0)`
/// is an error), grid and workspace. `Ok(None)` when there is nothing to compute (no query).
/// Errors: a problem without a KV cache, more CTAs than a grid holds, shared memory over the
/// device's limit.
pub fn plan_decode(
    problem: &Problem,
    dtype: DType,
    overrides: DecodeOverrides,
    props: &DeviceProps,
) -> Result<Option<DecodePlan>, ProblemError> {
    let DecodeOverrides {
        splits,
        stages,
        block_n,
        warps,
        table_order,
    } = overrides;
    let unsupported = |what: &'static str| Err(ProblemError::Unsupported { what });
    if !problem.has_kv_cache() {
        return unsupported("the decode kernels read a KV cache");
    }
    if splits == Some(0) {
        return unsupported("a forced split count must be at least 1");
    }
    // The kernel offsets a row inside its paged block, and steps from block to block, in
    // 32 bits.
    if let KvCache::Paged { block_size, .. } = problem.kv_cache() {
        let strides = problem.strides();
        let span = block_size.saturating_mul(strides[1].seq.max(strides[2].seq));
        if span > i32::MAX as usize || strides[1].batch.max(strides[2].batch) > i32::MAX as usize {
            return unsupported("a paged K/V block must span fewer than 2^31 elements");
        }
    }
    let seqlen_q = problem.max_seqlen_q();
    if seqlen_q == 0 {
        return Ok(None);
    }
    let rows = problem.group_size() * seqlen_q;
    let general = problem.softcap().is_some() || problem.softmax_scale() <= 0.0;
    let mut variant = DecodeVariant::for_shape(hdp_of(problem), rows, dtype, general);
    if block_n.is_some() || warps.is_some() {
        variant = variant.with_tile(
            warps.unwrap_or(variant.warps),
            block_n.unwrap_or(variant.block_n()),
        )?;
    }
    let m_blocks = rows.div_ceil(variant.block_m() as usize);
    let ctas = m_blocks
        .checked_mul(problem.heads_kv() * problem.batch())
        .ok_or(ProblemError::Overflow)?;
    let longest = (0..problem.batch())
        .map(|b| problem.seq(b).seqlen_k)
        .max()
        .unwrap_or(0);
    // Paged blocks smaller than a tile: the kernel deals them out whole where it can (one
    // table entry per thread and tile, see `reads_whole_blocks`), else it looks up every row.
    let (small_blocks, per_row_blocks) = match problem.kv_cache() {
        KvCache::Paged { block_size, .. } => (
            block_size < variant.block_n() as usize,
            !variant.reads_whole_blocks(block_size),
        ),
        _ => (false, false),
    };
    // The block walk (see `DecodePlan::block_walk`): blocks read whole and at least one
    // 8-key n-tile each; every used block is read, so no left window.
    let block_walk = match problem.kv_cache() {
        KvCache::Paged { block_size, .. } => {
            !table_order && block_size >= 8 && !per_row_blocks && problem.mask().left.is_none()
        }
        _ => false,
    };
    let streaming = stages.is_none()
        && small_blocks
        && !block_walk
        && use_streaming_stages(&variant, ctas, longest, props);
    match stages {
        Some(stages) => variant = variant.with_stages(stages),
        None if streaming => variant = variant.with_stages(STREAMING_STAGES),
        None => {}
    }
    if variant.smem_bytes() > props.smem_optin_bytes {
        return unsupported("the decode kernel's shared memory exceeds this device's limit");
    }
    let n_tiles = longest.div_ceil(variant.block_n() as usize);
    // The wave rule's slots. A padded cache streams at the copy rate with one CTA per SM
    // (its K/V addresses step by a constant per row): on the H200, batch 16 unsplit 0.95–1.07
    // of copy, 1–7 % ahead of 2–3 splits at two or three CTAs per SM, and batch 1 16 splits
    // over its 8 CTAs ahead of 32–33 at 16k and 64k keys. Paged blocks of a tile or more,
    // and small blocks read whole outside the streaming rule (walked or not), do the same
    // (blocks of 16 at batch 1 and at batch 16 with 4k keys, 4–10 % ahead of the older per-row
    // reads over two CTAs per SM; both: docs/history/gpu-notes.md, 2026-12-01). A paged cache
    // of blocks looked up per row, or streamed, reads faster over all the CTAs the device holds
    // at once.
    let slots = if per_row_blocks || streaming {
        props.sm_count * variant.ctas_per_sm(props)
    } else {
        props.sm_count
    };
    let num_splits = match splits {
        Some(s) => s.min(1024),
        None => num_splits_heuristic(
            u32::try_from(ctas).unwrap_or(u32::MAX),
            slots,
            u32::try_from(n_tiles).unwrap_or(u32::MAX),
        ),
    };
    let grid_x = m_blocks
        .checked_mul(num_splits as usize)
        .filter(|&x| x < i32::MAX as usize)
        .ok_or(ProblemError::Unsupported {
            what: "too many decode CTAs for one grid",
        })?;
    let out_rows = problem.batch() * problem.heads_q() * seqlen_q;
    let (combine_blocks, workspace_bytes) = if num_splits > 1 {
        let blocks = out_rows.div_ceil(CombineVariant::WARPS as usize);
        let bytes = (num_splits as usize)
            .checked_mul(out_rows)
            .and_then(|n| n.checked_mul((problem.head_dim_v() + 2) * 4))
            .ok_or(ProblemError::Overflow)?;
        (
            u32::try_from(blocks).map_err(|_| ProblemError::Overflow)?,
            bytes,
        )
    } else {
        (0, 0)
    };
    Ok(Some(DecodePlan {
        variant,
        grid: (
            grid_x as u32,
            problem.heads_kv() as u32,
            problem.batch() as u32,
        ),
        block: variant.threads(),
        smem_bytes: variant.smem_bytes(),
        num_splits,
        combine_blocks,
        workspace_bytes,
        block_walk,
    }))
}

/// The block walk of a paged KV cache, the order in which the decode kernel reads the blocks
/// when its plan allows it ([`DecodePlan::block_walk`]): per sequence, its used blocks (those
/// holding its first `seqused_k` keys) sorted by physical block index, so that each split
/// streams one ascending run of addresses instead of blocks scattered over the pool (on an
/// H200, scattered 16-key blocks read 3–5 % slower than blocks in order; docs/history/gpu-notes.md,
/// 2026-12-02). Layout: int32 `[batch, 2, blocks_per_seq]`; for sequence `b` and walk step `j`
/// (below the sequence's used block count), `[b][0][j]` is the physical block and `[b][1][j]`
/// its logical index (its place in the block table); entries past the used blocks are 0 and
/// never read.
///
/// The walk depends only on the problem's host tables (`seqused_k` and the block table), so a
/// runtime builds it once per decode step and passes it, on the device, to every layer's call
/// ([`crate::CacheTables::block_walk`]). A walk that does not match the call's tables gives
/// wrong results (every index is still clamped to the cache). Errors: a problem without a
/// paged cache, a size that overflows.
pub fn block_walk(problem: &Problem) -> Result<Vec<i32>, ProblemError> {
    let KvCache::Paged {
        seqused_k,
        block_table,
        blocks_per_seq,
        block_size,
        ..
    } = problem.kv_cache()
    else {
        return Err(ProblemError::Unsupported {
            what: "a block walk orders the blocks of a paged cache",
        });
    };
    let row = blocks_per_seq
        .checked_mul(2)
        .ok_or(ProblemError::Overflow)?;
    let len = row
        .checked_mul(problem.batch())
        .ok_or(ProblemError::Overflow)?;
    let mut walk = vec![0i32; len];
    if row == 0 {
        // No table columns: no used block to order (and no row to chunk by).
        return Ok(walk);
    }
    let mut order: Vec<(i32, i32)> = Vec::with_capacity(blocks_per_seq);
    for (b, (&used, out)) in seqused_k.iter().zip(walk.chunks_exact_mut(row)).enumerate() {
        // Validated: the used keys fit the sequence's table row, and every entry of it that
        // they reach is a block of the pool.
        let blocks = (used as usize).div_ceil(block_size).min(blocks_per_seq);
        let entries = &block_table[b * blocks_per_seq..b * blocks_per_seq + blocks];
        order.clear();
        order.extend(
            entries
                .iter()
                .zip(0..)
                .map(|(&phys, logical)| (phys, logical)),
        );
        order.sort_unstable();
        let (phys, logical) = out.split_at_mut(blocks_per_seq);
        for (j, &(p, l)) in order.iter().enumerate() {
            phys[j] = p;
            logical[j] = l;
        }
    }
    Ok(walk)
}

/// The kernel parameters of a decode call (device pointers still zero) and the element offset
/// of the (m, l) part inside the workspace.
pub(crate) fn decode_params(
    problem: &Problem,
    plan: &DecodePlan,
    rescale: RescalePolicy<f32>,
) -> (Params, usize) {
    let transform = problem.score_transform::<f64>();
    let mask = problem.mask();
    let window = |w: Option<usize>| w.map_or(-1, |w| w.min(1 << 30) as i32);
    let seqlen_q = problem.max_seqlen_q();
    let params = Params {
        seqlen_q: seqlen_q as i32,
        win_left: window(mask.left),
        win_right: window(mask.right),
        rows: (problem.group_size() * seqlen_q) as i32,
        num_m_blocks: (plan.grid.0 / plan.num_splits) as i32,
        num_splits: plan.num_splits as i32,
        pre: transform.pre_factor() as f32,
        softcap_post: transform.softcap_post_factor().unwrap_or(0.0) as f32,
        tau: tau_of(rescale),
        ..cache_params(problem)
    };
    let out_rows = problem.batch() * problem.heads_q() * seqlen_q;
    let ml_offset = plan.num_splits as usize * out_rows * problem.head_dim_v();
    (params, ml_offset)
}

/// The parameters that describe the cache and the tensors' strides (shared by the decode and
/// the append kernel): strides, capacity per sequence, paged shape, head counts and dims.
pub(crate) fn cache_params(problem: &Problem) -> Params {
    let strides = problem.strides();
    let triple = |s: &softmax_core::Strides| [s.batch as i64, s.seq as i64, s.head as i64];
    let (capacity, block_size, blocks_per_seq, num_blocks) = cache_shape(problem);
    let seqlen_q = problem.max_seqlen_q();
    Params {
        q_strides: triple(&strides[0]),
        k_strides: triple(&strides[1]),
        v_strides: triple(&strides[2]),
        o_strides: triple(&strides[3]),
        lse_bs: (problem.heads_q() * seqlen_q) as i64,
        lse_hs: seqlen_q as i64,
        capacity: capacity as i32,
        group: problem.group_size() as i32,
        head_dim: problem.head_dim() as i32,
        head_dim_v: problem.head_dim_v() as i32,
        block_size: block_size as i32,
        blocks_per_seq: blocks_per_seq as i32,
        num_blocks: num_blocks.min(i32::MAX as usize) as i32,
        batch: problem.batch() as i32,
        heads_q: problem.heads_q() as i32,
        ..Params::default()
    }
}

/// `(capacity, block_size, blocks_per_seq, num_blocks)` of the problem's cache: keys one
/// sequence can hold, and the paged shape (block size 0: padded, or no cache).
pub(crate) fn cache_shape(problem: &Problem) -> (usize, usize, usize, usize) {
    match problem.kv_cache() {
        KvCache::Paged {
            blocks_per_seq,
            block_size,
            num_blocks,
            ..
        } => (
            // No block at all: nothing can be read, whatever device-side lengths say.
            if num_blocks == 0 {
                0
            } else {
                blocks_per_seq * block_size
            },
            block_size,
            blocks_per_seq,
            num_blocks,
        ),
        _ => (problem.total_k(), 0, 0, 0),
    }
}

/// The key tiles `[begin, end)` that split `split` of m-block `m_block` reads for a sequence
/// of `seqused` keys: the host's mirror of `flash_decode`'s split arithmetic (tests check
/// that the splits cover every visible tile exactly once). `split` is (split, split count).
/// With a block walk (`walks`) the tiles are walk positions and cover every used block whole.
pub fn split_tiles(
    variant: &DecodeVariant,
    problem: &Problem,
    seqused: usize,
    walks: bool,
    split: (u32, u32),
    m_block: usize,
) -> (usize, usize) {
    let (split, num_splits) = split;
    let sq = problem.max_seqlen_q();
    let rows = problem.group_size() * sq;
    let m0 = m_block * variant.block_m() as usize;
    if m0 >= rows {
        return (0, 0);
    }
    let last = (m0 + variant.block_m() as usize).min(rows) - 1;
    let (i_min, i_max) = if m0 / sq == last / sq {
        (m0 % sq, last % sq)
    } else {
        (0, sq - 1)
    };
    let mask = problem.mask();
    let diag = seqused as i64 - sq as i64;
    let lo = mask
        .left
        .filter(|_| !walks)
        .map_or(0, |l| (i_min as i64 + diag - l as i64).max(0));
    let walked = match problem.kv_cache() {
        KvCache::Paged { block_size, .. } if walks => seqused.div_ceil(block_size) * block_size,
        _ => seqused,
    };
    let hi = mask.right.filter(|_| !walks).map_or(walked as i64, |r| {
        (i_max as i64 + diag + r as i64 + 1).min(seqused as i64)
    });
    if hi <= lo {
        return (0, 0);
    }
    let bn = variant.block_n() as i64;
    let (t_lo, t_hi) = (lo / bn, (hi + bn - 1) / bn);
    let per = (t_hi - t_lo + num_splits as i64 - 1) / num_splits as i64;
    let begin = (t_lo + split as i64 * per).min(t_hi);
    let end = (begin + per).min(t_hi);
    (begin as usize, end as usize)
}

#[cfg(test)]
mod tests {
    use super::*;
    use softmax_core::ProblemDesc;

    fn forced_splits(splits: u32) -> DecodeOverrides {
        DecodeOverrides {
            splits: Some(splits),
            ..DecodeOverrides::default()
        }
    }

    #[test]
    fn splits_follow_the_wave_rule() {
        // Already most of a wave: no split.
        assert_eq!(num_splits_heuristic(128, 132, 1000), 1);
        assert_eq!(num_splits_heuristic(106, 132, 1000), 1);
        // Llama-3 70B, batch 1: 8 KV heads on 132 SMs; 16 splits fill 128 of them, and on
        // 264 slots (two CTAs per SM) 33 splits fill every slot.
        assert_eq!(num_splits_heuristic(8, 132, 1000), 16);
        assert_eq!(num_splits_heuristic(8, 264, 1000), 33);
        // Batch 16 on 264 slots: two splits.
        assert_eq!(num_splits_heuristic(128, 264, 2048), 2);
        // A count that does not shorten the longest split is skipped: 40 tiles in 9 splits
        // take 5 each at most, as in 8.
        assert_eq!(num_splits_heuristic(1, 9, 40), 8);
        // Few tiles cap the count: at least MIN_TILES_PER_SPLIT tiles per split.
        assert_eq!(num_splits_heuristic(8, 132, 16), 4);
        assert_eq!(num_splits_heuristic(8, 132, 4), 1);
        assert_eq!(num_splits_heuristic(8, 132, 1), 1);
        // Never more than the SM count or MAX_SPLITS.
        assert!(num_splits_heuristic(1, 1000, 100_000) <= MAX_SPLITS);
        assert!(num_splits_heuristic(1, 8, 100_000) <= 8);
        for ctas in 1..200 {
            for tiles in [1, 2, 7, 64, 2048] {
                let s = num_splits_heuristic(ctas, 132, tiles);
                assert!(
                    s >= 1 && s <= tiles.max(1) && s <= 132,
                    "{ctas} {tiles} {s}"
                );
            }
        }
    }

    fn paged<'a>(seqused: &'a [u32], table: &'a [i32], bs: usize, sq: usize) -> Problem<'a> {
        let bps = table.len() / seqused.len();
        ProblemDesc::new(seqused.len(), sq, 0, 8, 2, 128)
            .paged_cache(seqused, table, bps, bs, 64)
            .validate(256)
            .expect("valid")
    }

    #[test]
    fn plan_picks_splits_gqa_packing_and_workspace() {
        let used = [1000u32, 7];
        let table: Vec<i32> = (0..2 * 63).map(|i| i % 64).collect();
        let problem = paged(&used, &table, 16, 1);
        let plan = plan_decode(
            &problem,
            DType::Bf16,
            DecodeOverrides::default(),
            &DeviceProps::h200(),
        )
        .expect("plan")
        .expect("work");
        // 4 query heads per KV head, one query: one 16-row m-block per KV head.
        assert_eq!(plan.variant.mt, 1);
        assert_eq!(plan.grid.1, 2);
        assert_eq!(plan.grid.2, 2);
        assert!(plan.num_splits > 1);
        assert_eq!(plan.grid.0, plan.num_splits);
        let out_rows = 2 * 8;
        assert_eq!(
            plan.workspace_bytes,
            plan.num_splits as usize * out_rows * (128 + 2) * 4
        );
        assert_eq!(plan.combine_blocks, 4);
        let forced = plan_decode(
            &problem,
            DType::Bf16,
            forced_splits(3),
            &DeviceProps::a100(),
        )
        .expect("plan")
        .expect("work");
        assert_eq!(forced.num_splits, 3);
        let one = plan_decode(
            &problem,
            DType::Bf16,
            forced_splits(1),
            &DeviceProps::a100(),
        )
        .expect("plan")
        .expect("work");
        assert_eq!((one.workspace_bytes, one.combine_blocks), (0, 0));
        assert!(plan_decode(
            &problem,
            DType::Bf16,
            forced_splits(0),
            &DeviceProps::a100()
        )
        .is_err());
        let dense = ProblemDesc::new(1, 1, 10, 8, 2, 128).validate(256).unwrap();
        assert!(plan_decode(
            &dense,
            DType::Bf16,
            DecodeOverrides::default(),
            &DeviceProps::a100()
        )
        .is_err());
        // 8 queries × 4 heads: 32 rows, two m-tiles.
        let multi = paged(&used, &table, 16, 8);
        let plan = plan_decode(
            &multi,
            DType::F16,
            DecodeOverrides::default(),
            &DeviceProps::h200(),
        )
        .expect("plan")
        .expect("work");
        assert_eq!(plan.variant.mt, 2);
    }

    #[test]
    fn fewer_stages_share_an_sm_and_split_for_the_cta_slots() {
        let h200 = DeviceProps::h200();
        let v = DecodeVariant::for_shape(128, 8, DType::Bf16, false);
        assert_eq!(v.stages, 3);
        assert_eq!(v.ctas_per_sm(&h200), 2);
        assert_eq!(v.with_stages(4).ctas_per_sm(&h200), 1);
        assert_eq!(v.with_stages(2).ctas_per_sm(&h200), 3);
        assert_eq!(v.with_stages(99).stages, MAX_DECODE_STAGES);
        // Llama-3 70B at batch 1 over a paged cache of 4-key blocks (a table entry per row):
        // 8 KV heads; two CTAs per SM (3 stages) split twice as much as one (4 stages).
        let used = [65536u32];
        let table: Vec<i32> = (0..65536 / 4).collect();
        let problem = ProblemDesc::new(1, 1, 0, 64, 8, 128)
            .paged_cache(&used, &table, table.len(), 4, table.len())
            .validate(256)
            .expect("valid");
        let one = plan_decode(
            &problem,
            DType::Bf16,
            DecodeOverrides {
                stages: Some(4),
                ..DecodeOverrides::default()
            },
            &h200,
        )
        .expect("plan")
        .expect("work");
        let two = plan_decode(&problem, DType::Bf16, DecodeOverrides::default(), &h200)
            .expect("plan")
            .expect("work");
        assert_eq!(two.variant.stages, 3);
        assert!(
            two.num_splits >= 2 * one.num_splits - 2,
            "{} vs {}",
            two.num_splits,
            one.num_splits
        );
        // The same layer over a padded cache splits for one CTA per SM: 132 / 8 → 16.
        let padded = padded_layer_plan(1, 65536);
        assert_eq!((padded.variant.stages, padded.num_splits), (3, 16));
    }

    /// The H200 plan of a Llama-3 70B layer (64 / 8 heads, head dim 128) over a padded cache.
    fn padded_layer_plan(batch: usize, keys: usize) -> DecodePlan {
        let used = vec![keys as u32; batch];
        let problem = ProblemDesc::new(batch, 1, keys, 64, 8, 128)
            .padded_cache(&used)
            .validate(256)
            .expect("valid");
        plan_decode(
            &problem,
            DType::Bf16,
            DecodeOverrides::default(),
            &DeviceProps::h200(),
        )
        .expect("plan")
        .expect("work")
    }

    #[test]
    fn long_caches_over_many_sequences_take_the_streaming_stages() {
        let h200 = DeviceProps::h200();
        // Paged caches (blocks of `block` keys, each sequence's blocks in order).
        let paged_with = |batch: usize, keys: usize, hdim: usize, block: usize, table_order| {
            let used = vec![keys as u32; batch];
            let table: Vec<i32> = (0..(batch * keys / block) as i32).collect();
            let problem = ProblemDesc::new(batch, 1, 0, 64, 8, hdim)
                .paged_cache(&used, &table, keys / block, block, table.len())
                .validate(256)
                .expect("valid");
            let overrides = DecodeOverrides {
                table_order,
                ..DecodeOverrides::default()
            };
            plan_decode(&problem, DType::Bf16, overrides, &h200)
                .expect("plan")
                .expect("work")
        };
        let paged = |batch, keys, hdim, block| paged_with(batch, keys, hdim, block, false);
        // Blocks of 4 keys (a table entry per row), batch 16: 128 unsplit CTAs; from 16k
        // keys three CTAs per SM, three splits.
        let plan = |batch: usize, keys: usize, hdim: usize| paged(batch, keys, hdim, 4);
        let long = plan(16, 16384, 128);
        assert_eq!(long.variant.stages, STREAMING_STAGES);
        assert_eq!(long.num_splits, 3);
        assert_eq!(plan(16, 4096, 128).variant.stages, 3);
        // Batch 1 (8 CTAs) keeps three stages at any length; head dim 256 keeps its two.
        assert_eq!(plan(1, 131072, 128).variant.stages, 3);
        assert_eq!(plan(16, 16384, 256).variant.stages, 2);
        // Blocks of 16 and 32 keys are read whole at head dim 128 (8 rows per thread and
        // tile), 8 at head dim 256 is not (16 rows): the former plan like a padded cache.
        let v128 = DecodeVariant::for_shape(128, 8, DType::Bf16, false);
        let v256 = DecodeVariant::for_shape(256, 8, DType::Bf16, false);
        assert_eq!((v128.load_iters(), v256.load_iters()), (8, 16));
        assert!([8, 16, 32, 64, 256]
            .iter()
            .all(|&b| v128.reads_whole_blocks(b)));
        assert!(![1, 4, 7, 48].iter().any(|&b| v128.reads_whole_blocks(b)));
        assert!(!v256.reads_whole_blocks(8) && v256.reads_whole_blocks(16));
        // Two warps of 48 keys copy 24 rows each per tile (not a power of two): blocks of 32,
        // which divide the tile, are read per row.
        let odd = v128.with_tile(2, 96).expect("2 warps x 48 keys");
        assert_eq!(odd.load_iters(), 24);
        assert!(!odd.reads_whole_blocks(32));
        for block in [16, 32] {
            // Batch 16, read in table order: from 16k keys the streaming rule (small blocks,
            // long caches over many CTAs) as for per-row blocks; below it one CTA per SM,
            // unsplit. Walked in address order: one CTA per SM at every length, as padded.
            let p = paged_with(16, 16384, 128, block, true);
            assert_eq!((p.variant.stages, p.num_splits), (STREAMING_STAGES, 3));
            assert!(!p.block_walk);
            let p = paged(16, 16384, 128, block);
            assert_eq!((p.variant.stages, p.num_splits), (3, 1), "block {block}");
            assert!(p.block_walk);
            let p = paged(16, 4096, 128, block);
            assert_eq!((p.variant.stages, p.num_splits), (3, 1), "block {block}");
            // Batch 1: one CTA per SM, 16 splits as for a padded cache.
            assert_eq!(paged(1, 65536, 128, block).num_splits, 16, "block {block}");
        }
        // A padded cache at batch 16 keeps three stages and one CTA per SM: no split.
        let padded = padded_layer_plan(16, 16384);
        assert_eq!((padded.variant.stages, padded.num_splits), (3, 1));
        // The tile override: 128 keys per tile, and a refused count.
        let used = [4096u32];
        let problem = ProblemDesc::new(1, 1, 4096, 64, 8, 128)
            .padded_cache(&used)
            .validate(256)
            .expect("valid");
        let wide = DecodeOverrides {
            block_n: Some(128),
            ..DecodeOverrides::default()
        };
        let p = plan_decode(&problem, DType::Bf16, wide, &h200)
            .expect("plan")
            .expect("work");
        assert_eq!(p.variant.block_n(), 128);
        let odd = DecodeOverrides {
            block_n: Some(72),
            ..DecodeOverrides::default()
        };
        assert!(plan_decode(&problem, DType::Bf16, odd, &h200).is_err());
        // Two warps of 16 keys; nine warps, or too few merge columns, are refused.
        let v = DecodeVariant::for_shape(128, 8, DType::Bf16, false);
        let two = v.with_tile(2, 32).expect("2 warps x 16 keys");
        assert_eq!((two.warps, two.block_n(), two.threads()), (2, 32, 64));
        assert!(v.with_tile(9, 144).is_err());
        assert!(v.with_tile(4, 32).is_err());
        assert!(v.with_tile(8, 128).is_ok());
        assert!(DecodeVariant::for_shape(64, 8, DType::Bf16, false)
            .with_tile(8, 128)
            .is_err());
    }

    #[test]
    fn every_variant_fits_both_reference_devices_and_has_a_distinct_name() {
        let all = DecodeVariant::all();
        let mut names: Vec<String> = all.iter().map(DecodeVariant::name).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), all.len());
        for v in &all {
            assert!(
                v.smem_bytes() <= DeviceProps::a100().smem_optin_bytes,
                "{}",
                v.name()
            );
            assert_eq!(v.block_m() % 16, 0);
            assert_eq!((v.threads() / v.block_m()) * v.block_m(), v.threads());
            // Columns per thread of the final merge: whole 16-byte chunks.
            assert_eq!((v.hdp / (v.threads() / v.block_m())) % 8, 0);
        }
    }

    /// The decode and combine kernels' index arithmetic, emulated in f64 on the host with the
    /// sources' own expressions (row packing `r = g·seqlen_q + i`, split tiles, each warp's key
    /// slice with its own online softmax, the warps' merge, the workspace rows
    /// `((split·batch + b)·heads_q + h)·seqlen_q + i` and the (m, l) block after the
    /// accumulators, the combine's row decomposition, the LSE index), through the parameters
    /// `decode_params` fills, against the f64 reference on random padded and paged caches.
    #[test]
    fn emulated_kernels_match_the_reference() {
        use fa_reference::{attention_f64, Rng};
        use softmax_core::Mask;
        let mut rng = Rng::new(21);
        let masks = [
            Mask::NONE,
            Mask::CAUSAL,
            Mask {
                left: Some(9),
                right: Some(1),
            },
        ];
        // Blocks of 5 keys are looked up per row; 8, 16, 32 (within a tile) and 64, 128 (whole
        // tiles; 128 at head dim 128 holds two 64-key tiles, so the partial block may come
        // first in the walk) are read whole and walked in address order (except under the left window),
        // and also run in table order.
        for (block, sq, hq, hk, d, splits) in [
            (None, 1, 8, 2, 64, 1),
            (Some(5), 3, 8, 2, 64, 3),
            (Some(5), 2, 16, 1, 72, 16),
            (None, 4, 4, 4, 128, 2),
            (Some(16), 1, 8, 2, 128, 3),
            (Some(8), 3, 16, 2, 128, 1),
            (Some(32), 2, 8, 1, 64, 5),
            (Some(64), 1, 8, 2, 128, 3),
            (Some(128), 2, 8, 2, 128, 2),
            (Some(128), 1, 8, 1, 64, 1),
        ] {
            for mask in masks {
                // Several sequences of two or more blocks: with blocks larger than a tile,
                // the partial block comes first in the walk for about half of them.
                let used = [
                    0u32,
                    1,
                    77,
                    130 + rng.below(40) as u32,
                    140 + rng.below(50) as u32,
                    199,
                    160 + rng.below(30) as u32,
                ];
                let bs = block.unwrap_or(1);
                let bps = 200usize.div_ceil(bs);
                let num_blocks = used.len() * bps;
                let mut ids: Vec<i32> = (0..num_blocks as i32).collect();
                for i in (1..ids.len()).rev() {
                    ids.swap(i, rng.below(i + 1));
                }
                let desc = ProblemDesc::new(used.len(), sq, 200, hq, hk, d).with_mask(mask);
                let desc = match block {
                    Some(bs) => desc.paged_cache(&used, &ids, bps, bs, num_blocks),
                    None => desc.padded_cache(&used),
                };
                let problem = desc.validate(256).expect("valid");
                let lens = problem.min_buffer_lens();
                let mut draw = |n: usize| (0..n).map(|_| rng.normal()).collect::<Vec<f64>>();
                let (q, k, v) = (draw(lens.q), draw(lens.k), draw(lens.v));
                let table: Vec<i32> = if block.is_some() {
                    ids.clone()
                } else {
                    Vec::new()
                };
                let plan = plan_decode(
                    &problem,
                    DType::Bf16,
                    forced_splits(splits),
                    &DeviceProps::h200(),
                )
                .expect("plan")
                .expect("work");
                let walks = block.is_some_and(|bs| bs >= 8) && mask.left.is_none();
                assert_eq!(plan.block_walk, walks, "{block:?} {mask:?}");
                let walk = if walks {
                    block_walk(&problem).expect("a paged cache")
                } else {
                    Vec::new()
                };
                let oracle = attention_f64(&problem, &q, &k, &v);
                let (mut p, ml_offset) =
                    decode_params(&problem, &plan, RescalePolicy::Threshold(8.0));
                for walked in [false, walks] {
                    // Any non-zero address marks the walk for the emulation.
                    p.block_walk = u64::from(walked);
                    let (o, lse) = emulate(&p, ml_offset, &plan, &q, &k, &v, &used, &table, &walk);
                    let report = fa_reference::compare(&problem, &o, Some(&lse), &oracle);
                    assert!(
                        report.within(1e-6, 1e-5),
                        "{block:?} walked {walked} {sq} {hq}/{hk} {mask:?}: {report:?}"
                    );
                }
            }
        }
    }

    /// The block walk: per sequence a permutation of its used blocks' logical indices, in
    /// ascending physical order, each beside its table entry; zeros past the used blocks.
    #[test]
    fn block_walk_sorts_each_sequences_used_blocks() {
        let mut rng = fa_reference::Rng::new(5);
        let (bs, bps) = (16usize, 9usize);
        let used = [0u32, 1, 16, 17, 100, 144];
        let num_blocks = used.len() * bps + 4;
        let mut ids: Vec<i32> = (0..num_blocks as i32).collect();
        for i in (1..ids.len()).rev() {
            ids.swap(i, rng.below(i + 1));
        }
        let table = &ids[..used.len() * bps];
        let problem = ProblemDesc::new(used.len(), 1, 0, 8, 2, 128)
            .paged_cache(&used, table, bps, bs, num_blocks)
            .validate(256)
            .expect("valid");
        let walk = block_walk(&problem).expect("paged");
        assert_eq!(walk.len(), used.len() * 2 * bps);
        for (b, &u) in used.iter().enumerate() {
            let blocks = (u as usize).div_ceil(bs);
            let row = &walk[b * 2 * bps..(b + 1) * 2 * bps];
            let (phys, logical) = row.split_at(bps);
            let mut seen: Vec<i32> = logical[..blocks].to_vec();
            seen.sort_unstable();
            assert_eq!(seen, (0..blocks as i32).collect::<Vec<_>>(), "sequence {b}");
            for j in 0..blocks {
                assert_eq!(phys[j], table[b * bps + logical[j] as usize]);
                if j > 0 {
                    assert!(phys[j - 1] < phys[j], "sequence {b} not ascending");
                }
            }
            assert!(phys[blocks..]
                .iter()
                .chain(&logical[blocks..])
                .all(|&x| x == 0));
        }
        let used = [5u32];
        let padded = ProblemDesc::new(1, 1, 8, 8, 2, 128)
            .padded_cache(&used)
            .validate(256)
            .expect("valid");
        assert!(block_walk(&padded).is_err());
        // A table with no columns (every sequence empty) has nothing to walk and must not
        // panic.
        let empty = [0u32, 0];
        let problem = ProblemDesc::new(2, 1, 0, 8, 2, 128)
            .paged_cache(&empty, &[], 0, 16, 4)
            .validate(256)
            .expect("an empty table validates");
        assert_eq!(block_walk(&problem).expect("paged"), Vec::<i32>::new());
    }

    /// `flash_decode` then `flash_decode_combine` on the host, statement by statement as far
    /// as indices go (f64 arithmetic, exact exponentials, τ = 8 threshold rescale).
    #[allow(clippy::too_many_arguments)]
    fn emulate(
        p: &Params,
        ml_offset: usize,
        plan: &DecodePlan,
        q: &[f64],
        k: &[f64],
        v: &[f64],
        seqused: &[u32],
        table: &[i32],
        walk: &[i32],
    ) -> (Vec<f64>, Vec<f32>) {
        use softmax_core::RowState;
        let var = plan.variant;
        // The kernel's `walking`: a walk, blocks read whole, 8 keys or more.
        let bs = p.block_size as i64;
        let walking =
            p.block_walk != 0 && p.block_size >= 8 && var.reads_whole_blocks(p.block_size as usize);
        let (block_m, block_n, wn) = (var.block_m() as i64, var.block_n() as i64, var.wn as i64);
        let sq = p.seqlen_q as i64;
        let rows_total = p.batch as i64 * p.heads_q as i64 * sq;
        let o_len = (p.batch as i64 * p.o_strides[0]) as usize;
        let mut o = vec![f64::NAN; o_len];
        let mut lse = vec![f32::NAN; rows_total as usize];
        let mut ws = vec![f64::NAN; ml_offset + 2 * rows_total as usize * p.num_splits as usize];
        let key_lo = |i: i64, diag: i64| {
            if p.win_left >= 0 {
                (i + diag - p.win_left as i64).max(0)
            } else {
                0
            }
        };
        let key_hi = |i: i64, diag: i64, sk: i64| {
            if p.win_right >= 0 {
                (i + diag + p.win_right as i64 + 1).min(sk)
            } else {
                sk
            }
        };
        let (gx, gy, gz) = plan.grid;
        for b in 0..gz as i64 {
            for hk in 0..gy as i64 {
                for x in 0..gx as i64 {
                    let split = x % p.num_splits as i64;
                    let m_block = x / p.num_splits as i64;
                    let m0 = m_block * block_m;
                    if m0 >= p.rows as i64 {
                        continue;
                    }
                    let rows_here = block_m.min(p.rows as i64 - m0);
                    let sk = (seqused[b as usize] as i64).clamp(0, p.capacity as i64);
                    let diag = sk - sq;
                    let (r_first, r_last) = (m0, m0 + rows_here - 1);
                    let (mut i_min, mut i_max) = (0, sq - 1);
                    if r_first / sq == r_last / sq {
                        i_min = r_first % sq;
                        i_max = r_last % sq;
                    }
                    let walked = if walking { (sk + bs - 1) / bs * bs } else { sk };
                    let (ulo, uhi) = if walking {
                        (0, walked)
                    } else {
                        (key_lo(i_min, diag), key_hi(i_max, diag, sk))
                    };
                    let bps = p.blocks_per_seq as i64;
                    // A tile position's logical key and physical block (the walk's planes, or
                    // the table's order; keys past the used ones are masked, their block 0);
                    // `None` past the used blocks of a walk.
                    let place = |pos: i64| -> Option<(i64, i64)> {
                        if walking {
                            if pos >= walked {
                                return None;
                            }
                            let at = (b * 2 * bps + pos / bs) as usize;
                            let logical = (walk[at + bps as usize] as i64).clamp(0, bps - 1);
                            Some((logical * bs + pos % bs, walk[at] as i64))
                        } else if bs > 0 && pos < sk {
                            Some((pos, table[(b * bps + pos / bs) as usize] as i64))
                        } else {
                            Some((pos, 0))
                        }
                    };
                    let (mut t_begin, mut t_end) = (0, 0);
                    if uhi > ulo {
                        let (tl, th) = (ulo / block_n, (uhi + block_n - 1) / block_n);
                        let per = (th - tl + p.num_splits as i64 - 1) / p.num_splits as i64;
                        t_begin = (tl + split * per).min(th);
                        t_end = (t_begin + per).min(th);
                    }
                    // Key offset as load_kv computes it (a paged key's physical block from
                    // `place`).
                    let kv_off = |key: i64, phys: i64, strides: [i64; 3]| -> i64 {
                        if p.block_size > 0 {
                            let in_block = key % bs;
                            let blk = phys.clamp(0, p.num_blocks as i64 - 1);
                            blk * strides[0] + in_block * strides[1]
                        } else {
                            b * strides[0] + key * strides[1]
                        }
                    };
                    for row in 0..rows_here {
                        let r = m0 + row;
                        let (i, h) = (r % sq, hk * p.group as i64 + r / sq);
                        let (lo, hi) = (key_lo(i, diag), key_hi(i, diag, sk));
                        let qo =
                            (b * p.q_strides[0] + i * p.q_strides[1] + h * p.q_strides[2]) as usize;
                        // One online softmax per warp over its key slices, then the merge.
                        let mut state = RowState::<f64>::new();
                        let mut acc = vec![0.0f64; p.head_dim_v as usize];
                        for w in 0..var.warps as i64 {
                            let mut ws_state = RowState::<f64>::new();
                            let mut ws_acc = vec![0.0f64; p.head_dim_v as usize];
                            for t in t_begin..t_end {
                                let n0 = t * block_n + w * wn;
                                let cols: Vec<((i64, i64), f64)> = (n0..n0 + wn)
                                    .map(|pos| {
                                        let Some((col, phys)) = place(pos) else {
                                            return ((0, 0), f64::NEG_INFINITY);
                                        };
                                        if col < lo || col >= hi {
                                            return ((col, phys), f64::NEG_INFINITY);
                                        }
                                        let ko = (kv_off(col, phys, p.k_strides)
                                            + hk * p.k_strides[2])
                                            as usize;
                                        let dot: f64 = (0..p.head_dim as usize)
                                            .map(|c| q[qo + c] * k[ko + c])
                                            .sum();
                                        ((col, phys), dot * p.pre as f64)
                                    })
                                    .collect();
                                let bm = cols.iter().fold(f64::NEG_INFINITY, |m, c| m.max(c.1));
                                let m = ws_state.max;
                                if bm > m && (m == f64::NEG_INFINITY || bm - m > p.tau as f64) {
                                    let c = (m - bm).exp2();
                                    ws_state.sum *= c;
                                    ws_acc.iter_mut().for_each(|a| *a *= c);
                                    ws_state.max = bm;
                                }
                                let off = if ws_state.max == f64::NEG_INFINITY {
                                    0.0
                                } else {
                                    ws_state.max
                                };
                                for ((col, phys), x) in cols {
                                    let pr = (x - off).exp2();
                                    ws_state.sum += pr;
                                    if pr > 0.0 {
                                        let vo = (kv_off(col, phys, p.v_strides)
                                            + hk * p.v_strides[2])
                                            as usize;
                                        for c in 0..p.head_dim_v as usize {
                                            ws_acc[c] += pr * v[vo + c];
                                        }
                                    }
                                }
                            }
                            softmax_core::merge_into(&mut state, &mut acc, &ws_state, &ws_acc);
                        }
                        if p.num_splits == 1 {
                            let fin = state.finish();
                            let oo = (b * p.o_strides[0] + i * p.o_strides[1] + h * p.o_strides[2])
                                as usize;
                            for c in 0..p.head_dim_v as usize {
                                o[oo + c] = acc[c] * fin.inv_sum;
                            }
                            lse[(b * p.lse_bs + h * p.lse_hs + i) as usize] = fin.lse as f32;
                        } else {
                            let prow =
                                ((split * p.batch as i64 + b) * p.heads_q as i64 + h) * sq + i;
                            let at = (prow * p.head_dim_v as i64) as usize;
                            ws[at..at + p.head_dim_v as usize].copy_from_slice(&acc);
                            ws[ml_offset + 2 * prow as usize] = state.max;
                            ws[ml_offset + 2 * prow as usize + 1] = state.sum;
                        }
                    }
                }
            }
        }
        if p.num_splits > 1 {
            for r in 0..rows_total {
                let i = r % sq;
                let h = (r / sq) % p.heads_q as i64;
                let b = r / (sq * p.heads_q as i64);
                let mut state = RowState::<f64>::new();
                let mut acc = vec![0.0f64; p.head_dim_v as usize];
                for s in 0..p.num_splits as i64 {
                    let prow = (s * rows_total + r) as usize;
                    let part = RowState {
                        max: ws[ml_offset + 2 * prow],
                        sum: ws[ml_offset + 2 * prow + 1],
                    };
                    let at = prow * p.head_dim_v as usize;
                    let src = ws[at..at + p.head_dim_v as usize].to_vec();
                    assert!(
                        src.iter().all(|x| !x.is_nan()),
                        "workspace row {prow} never written"
                    );
                    softmax_core::merge_into(&mut state, &mut acc, &part, &src);
                }
                let fin = state.finish();
                let oo = (b * p.o_strides[0] + i * p.o_strides[1] + h * p.o_strides[2]) as usize;
                for c in 0..p.head_dim_v as usize {
                    o[oo + c] = acc[c] * fin.inv_sum;
                }
                lse[(b * p.lse_bs + h * p.lse_hs + i) as usize] = fin.lse as f32;
            }
        }
        (o, lse)
    }

    /// The splits of every m-block cover each visible key tile exactly once, for masks,
    /// lengths (0 and 1 included), query counts and split counts.
    #[test]
    fn splits_cover_every_visible_tile_once() {
        let masks = [
            softmax_core::Mask::NONE,
            softmax_core::Mask::CAUSAL,
            softmax_core::Mask {
                left: Some(70),
                right: Some(0),
            },
            softmax_core::Mask {
                left: Some(5),
                right: Some(3),
            },
        ];
        for &used in &[0u32, 1, 63, 64, 65, 300, 1000] {
            for sq in [1usize, 3, 4] {
                for mask in masks {
                    let seqused = [used];
                    let problem = ProblemDesc::new(1, sq, 1024, 8, 2, 128)
                        .padded_cache(&seqused)
                        .with_mask(mask)
                        .validate(256)
                        .expect("valid");
                    let v = DecodeVariant::for_shape(128, 4 * sq, DType::Bf16, false);
                    let bn = v.block_n() as usize;
                    let m_blocks = (4 * sq).div_ceil(v.block_m() as usize);
                    for m_block in 0..m_blocks {
                        let whole =
                            split_tiles(&v, &problem, used as usize, false, (0, 1), m_block);
                        for splits in [1u32, 2, 3, 16] {
                            let mut covered = Vec::new();
                            for s in 0..splits {
                                let (b, e) = split_tiles(
                                    &v,
                                    &problem,
                                    used as usize,
                                    false,
                                    (s, splits),
                                    m_block,
                                );
                                covered.extend(b..e);
                            }
                            let expected: Vec<usize> = (whole.0..whole.1).collect();
                            assert_eq!(covered, expected, "used {used} sq {sq} {mask:?} {splits}");
                        }
                        // Every key a row of the block sees lies in the whole range.
                        let rows = 4 * sq;
                        for r in m_block * 16..((m_block + 1) * 16).min(rows) {
                            let i = r % sq;
                            for j in 0..used as usize {
                                if mask.allows(i, j, sq, used as usize) {
                                    let t = j / bn;
                                    assert!(t >= whole.0 && t < whole.1);
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}
