//! The tiling of the work: tile sizes per architecture ([`Tiling`]) and the plan of a call,
//! its list of [`Task`]s ([`tasks`]).

use super::CACHE_LINE;
use crate::arch::{Arch, SimdLevel};
use crate::dispatch::{with_arch, ArchFn, Entry};
use softmax_core::{Problem, ProblemError};

/// Tile sizes of one architecture (all in elements).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Tiling {
    /// Largest number of query rows (heads × positions) in a task: a multiple of `W·NR`
    /// (see [`Tiling::rows_for`]).
    pub rows: usize,
    /// Keys per key tile (`Bc`): a multiple of the QKᵀ micro-kernel's `MR`.
    pub keys: usize,
    /// Lanes per vector.
    pub lanes: usize,
    /// Row vectors per micro-kernel (`NR`): rows are padded to a multiple of `lanes·NR`.
    pub row_vectors: usize,
    /// Keys per QKᵀ micro-kernel (`MR`).
    pub qk_keys: usize,
    /// Channels per PV micro-kernel (`MR`): `head_dim_v` is padded to a multiple of it.
    pub pv_channels: usize,
}

impl Tiling {
    /// The tiling of architecture `A`.
    pub const fn of<A: Arch>() -> Tiling {
        Tiling {
            rows: A::TASK_ROWS,
            keys: A::TILE_KEYS,
            lanes: A::W,
            row_vectors: A::ROW_VECTORS,
            qk_keys: A::QK_KEYS,
            pv_channels: A::PV_CHANNELS,
        }
    }

    /// The tiling of `level`'s architecture (`Auto`: the detected one), whether or not this
    /// CPU can run it.
    pub fn for_level(level: SimdLevel) -> Tiling {
        /// [`Tiling::of`] as an [`ArchFn`].
        struct Of;
        impl ArchFn for Of {
            type Output = Tiling;
            fn call<A: Entry>(self) -> Tiling {
                Tiling::of::<A>()
            }
        }
        with_arch(level, Of)
    }

    /// Query rows per task for these head dims: as many as keep `Qᵀ` and `Oᵀ` within
    /// 2.5 MiB, a multiple of the micro-kernel's rows, at most `rows`. Large blocks pay: every
    /// row of a block reuses each K/V tile (packed once per task and tile, then in L2), while
    /// `Qᵀ`/`Oᵀ` panels stream through once per key tile at a rate the caches serve easily
    /// (measured on Zen 3: D=256 went from 61 to 80 GFLOP per CPU-second going from 112 to
    /// 1008 rows; 512 KiB to 2 MiB of `Qᵀ`/`Oᵀ` made no difference). 2.5 MiB rather than 2
    /// lets D=256 take 1024 rows: with 1008, 1024-token sequences split into two tasks and
    /// pack every K/V tile twice.
    pub fn rows_for(&self, head_dim: usize, head_dim_v: usize) -> usize {
        self.rows_within(5 * 512 * 1024, head_dim, head_dim_v)
    }

    /// As many query rows as keep `Qᵀ` and `Oᵀ` (f32, padded head dims) within `budget`
    /// bytes, in whole panels, at least one panel and at most `rows`.
    fn rows_within(&self, budget: usize, head_dim: usize, head_dim_v: usize) -> usize {
        let panel = self.lanes * self.row_vectors;
        let dv_pad = head_dim_v.div_ceil(self.pv_channels) * self.pv_channels;
        let rows = budget / (4 * (head_dim + dv_pad));
        (rows / panel * panel).clamp(panel, self.rows.max(panel))
    }

    /// Query rows per task of the AMX forward: [`Tiling::rows_for`], except without a mask at
    /// head dims above 128, where as many rows as keep `Qᵀ` and `Oᵀ` within 8 MiB (at most
    /// `rows`): a head of up to 4096 positions at head dim 256 is then one task and packs each
    /// K/V tile once (packing was ~10 % of a D=256 call). Against the 2.5 MiB rule, on the
    /// development VM (a Xeon with AMX; B=1, H=8, bf16, process CPU time, 5 alternating
    /// rounds, median of paired ratios), one thread: unmasked N=2048 D=256 1.02–1.08×,
    /// N=4096 D=256 1.04–1.06×, N=4096 D=128 1.01–1.02×; causal N=2048 D=256 0.99×, N=4096
    /// D=256 0.98× (a causal head's tasks pack only the keys up to their diagonal, so fewer
    /// tasks save less); two threads: N=4096 D=256 1.01×, N=2048 D=256 0.98×, N=4096 D=128
    /// 0.97×. Hence masks and head dims up to 128 keep the 2.5 MiB rule.
    pub fn amx_rows_for(&self, head_dim: usize, head_dim_v: usize, masked: bool) -> usize {
        if masked || head_dim.max(head_dim_v) <= 128 {
            return self.rows_for(head_dim, head_dim_v);
        }
        self.rows_within(8 << 20, head_dim, head_dim_v)
    }

    /// Keys per key tile for these head dims: twice `keys` for head dims up to 64 without a
    /// mask (per-tile costs — the softmax's per-row bookkeeping, the accumulator loads and
    /// stores of every PV micro-kernel call — weigh most against the short dot products
    /// there: +2–5 % measured), `keys` otherwise (under a mask larger tiles compute more
    /// masked scores on the diagonal: −10 % at D=128 causal).
    pub fn keys_for(&self, head_dim: usize, head_dim_v: usize, masked: bool) -> usize {
        if head_dim.max(head_dim_v) <= 64 && !masked {
            2 * self.keys
        } else {
            self.keys
        }
    }

    /// The row stride of the packed V tile for `dv_pad` channels: `dv_pad`, plus one cache
    /// line when `dv_pad` is a whole even number of lines. A PV micro-kernel call reads the
    /// same `pv_channels` columns from each of a tile's rows; at a stride of 512 or 1024 bytes
    /// (D=128, 256) those 64 lines fall into 8 or 4 of an L1's 64 sets (48 KiB of 12 ways on
    /// the Xeon, 32 KiB of 8 on Zen 3): 8 or 16 lines per set, at or past what a set holds.
    /// An odd number of lines spreads them over all sets.
    pub fn v_stride(dv_pad: usize) -> usize {
        const LINE: usize = CACHE_LINE / 4;
        if dv_pad.is_multiple_of(2 * LINE) {
            dv_pad + LINE
        } else {
            dv_pad
        }
    }

    /// Rows padded for the micro-kernels.
    pub fn padded_rows(&self, rows: usize) -> usize {
        rows.div_ceil(self.lanes * self.row_vectors) * self.lanes * self.row_vectors
    }
}

/// One unit of parallel work: query heads `head0..head0+heads` (all reading KV head `head_kv`)
/// × query positions `i0..i0+len` of sequence `batch`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Task {
    /// Sequence.
    pub batch: usize,
    /// KV head shared by the task's query heads.
    pub head_kv: usize,
    /// First query head.
    pub head0: usize,
    /// Query heads.
    pub heads: usize,
    /// First query position (within the sequence).
    pub i0: usize,
    /// Query positions.
    pub len: usize,
}

impl Task {
    /// The (query head, query position) of the task's row `r`: rows run over positions
    /// first, then heads.
    #[inline(always)]
    pub fn row(&self, r: usize) -> (usize, usize) {
        (self.head0 + r / self.len, self.i0 + r % self.len)
    }
}

/// The tasks of a problem: (sequence, KV head, group of query heads, query block), in an
/// order that depends only on the problem and the tiling (never on the thread count).
///
/// The list is allocated with `try_reserve` (counted first), so a list too large for memory is
/// [`ProblemError::OutOfMemory`] rather than an abort.
pub(crate) fn tasks(p: &Problem, tiling: &Tiling) -> Result<Vec<Task>, ProblemError> {
    tasks_of_rows(p, tiling, tiling.rows_for(p.head_dim(), p.head_dim_v()))
}

/// [`tasks`] with at most `rows` query rows per task (a multiple of the tiling's panel, as
/// [`Tiling::rows_for`] and [`Tiling::amx_rows_for`] give).
pub(crate) fn tasks_of_rows(
    p: &Problem,
    tiling: &Tiling,
    rows: usize,
) -> Result<Vec<Task>, ProblemError> {
    /// Enough tasks that a worker slowed down by a noisy neighbour does not hold up the
    /// end of the call (a problem-size rule: the split never depends on the thread count).
    const MIN_TASKS: usize = 8;
    /// Rows below which K/V tiles are reused too little to be worth packing.
    const MIN_ROWS: usize = 256;
    let group = p.group_size();
    let heads_per_task = group.min(rows);
    let block_max = (rows / heads_per_task).max(1);
    let block_min = (MIN_ROWS / heads_per_task).clamp(1, block_max);
    let units = p.batch() * p.heads_kv() * group.div_ceil(heads_per_task);
    let wanted_blocks = MIN_TASKS.div_ceil(units.max(1));
    // With one head per task, blocks are whole row panels.
    let align = if heads_per_task == 1 {
        tiling.lanes * tiling.row_vectors
    } else {
        1
    };
    let block_of = |seqlen_q: usize| {
        let blocks = seqlen_q
            .div_ceil(block_max)
            .max(wanted_blocks.min(seqlen_q.div_ceil(block_min)))
            .max(1);
        let block = seqlen_q.div_ceil(blocks).div_ceil(align) * align;
        block.clamp(1, block_max.max(align))
    };
    let groups_per_head = group.div_ceil(heads_per_task);
    let mut count = 0usize;
    for batch in 0..p.batch() {
        let seqlen_q = p.seq(batch).seqlen_q;
        let per_head = seqlen_q.div_ceil(block_of(seqlen_q)) * groups_per_head;
        count = count
            .checked_add(
                per_head
                    .checked_mul(p.heads_kv())
                    .ok_or(ProblemError::Overflow)?,
            )
            .ok_or(ProblemError::Overflow)?;
    }
    let mut out = Vec::new();
    out.try_reserve_exact(count)
        .map_err(|_| ProblemError::OutOfMemory {
            what: "the task list",
            bytes: count.saturating_mul(std::mem::size_of::<Task>()),
        })?;
    for batch in 0..p.batch() {
        let seq = p.seq(batch);
        let block = block_of(seq.seqlen_q);
        for head_kv in 0..p.heads_kv() {
            for head0 in (head_kv * group..(head_kv + 1) * group).step_by(heads_per_task) {
                let heads = heads_per_task.min((head_kv + 1) * group - head0);
                // Last query block first: under a causal mask it is the heaviest.
                for i0 in (0..seq.seqlen_q).step_by(block).rev() {
                    out.push(Task {
                        batch,
                        head_kv,
                        head0,
                        heads,
                        i0,
                        len: block.min(seq.seqlen_q - i0),
                    });
                }
            }
        }
    }
    Ok(out)
}
