//! The tiled forward kernel, written once over [`Simd`] and instantiated per architecture.
//!
//! # Layout: query rows along the vector lanes
//! A task owns a block of query rows (the rows of every query head of one GQA group, for a
//! range of query positions) and keeps them **transposed**: `Qᵀ[c][r]` (`head_dim × rows`),
//! the score tile `Sᵀ[j][r]` (`keys × rows`) and the accumulator `Oᵀ[c][r]`. Then
//! - `Sᵀ = K·Qᵀ` is a GEMM micro-kernel that broadcasts `K[j][c]` (K in its natural
//!   row-major layout: packing a K tile is a plain copy, no transposition) against vectors of
//!   `Qᵀ[c][r..r+W]`, `MR × NR` accumulators in registers;
//! - the online softmax runs down the key axis with one row per lane: row maxima and sums are
//!   vertical `max`/`add` of vectors (no horizontal reductions), `exp2` is vectorised;
//! - `Oᵀ += Vᵀ·Pᵀ` broadcasts `V[j][c]` (natural layout again) against vectors of `Pᵀ[j][r..]`,
//!   and the accumulator correction of the online softmax is folded into the load of `Oᵀ`.
//!
//! The transposed tiles are stored **panel-major**: the rows are cut into panels of `W·NR`
//! (the micro-kernels' width) and each panel is contiguous (`Qᵀ` panel `p` holds
//! `[c][W·NR]` at `p·d·W·NR`), so a micro-kernel walks unit-stride memory; a row-major
//! `[c][rows]` layout put every `Qᵀ` row a multiple of 1 KiB apart, into a handful of L1 sets.
//!
//! Q is transposed once per task and O once at the end; K and V tiles are copied (and widened
//! from bf16/f16) once per key tile for all the query heads of the group.

use crate::arch::{exp2_cubic, exp2_exact, tanh, Simd};
use crate::element::{sealed, Element};
use crate::Exp2Impl;
use softmax_core::{Problem, RescalePolicy, RescaleStats, RowState, TileKind};

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
    /// Query rows per task for these head dims: as many as keep `Qᵀ` and `Oᵀ` within
    /// 2.5 MiB, a multiple of the micro-kernel's rows, at most `rows`. Large blocks pay: every
    /// row of a block reuses each K/V tile (packed once per task and tile, then in L2), while
    /// `Qᵀ`/`Oᵀ` panels stream through once per key tile at a rate the caches serve easily
    /// (measured on Zen 3: D=256 went from 61 to 80 GFLOP per CPU-second going from 112 to
    /// 1008 rows; 512 KiB to 2 MiB of `Qᵀ`/`Oᵀ` made no difference). 2.5 MiB rather than 2
    /// lets D=256 take 1024 rows: with 1008, 1024-token sequences split into two tasks and
    /// pack every K/V tile twice.
    pub fn rows_for(&self, head_dim: usize, head_dim_v: usize) -> usize {
        let panel = self.lanes * self.row_vectors;
        let dv_pad = head_dim_v.div_ceil(self.pv_channels) * self.pv_channels;
        let budget = (5 * 512 * 1024) / (4 * (head_dim + dv_pad));
        (budget / panel * panel).clamp(panel, self.rows.max(panel))
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

/// What one task counted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct TaskStats {
    /// Rescale decisions over all rows and key tiles.
    pub rescale: RescaleStats,
    /// (row panel, key tile) pairs computed.
    pub computed: u64,
    /// (row panel, key tile) pairs skipped because the mask hides them.
    pub skipped: u64,
}

impl TaskStats {
    /// Adds another task's counts.
    pub fn add(mut self, other: TaskStats) -> TaskStats {
        self.rescale.add(&other.rescale);
        self.computed += other.computed;
        self.skipped += other.skipped;
        self
    }
}

/// A pointer to an output buffer shared by the tasks, each writing its own elements.
#[derive(Debug)]
pub(crate) struct SharedOut<E> {
    ptr: *mut E,
    len: usize,
}

impl<E> Clone for SharedOut<E> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<E> Copy for SharedOut<E> {}

// SAFETY: tasks write disjoint elements (each (sequence, head, query) row belongs to exactly
// one task, and validation rejects output strides under which two rows overlap), and the
// buffer outlives the parallel region (it is borrowed mutably by `forward` for its whole run).
unsafe impl<E: Send> Send for SharedOut<E> {}
// SAFETY: as for Send: concurrent writes never touch the same element.
unsafe impl<E: Send> Sync for SharedOut<E> {}

impl<E> SharedOut<E> {
    /// Wraps a buffer that outlives every use of the result.
    pub fn new(buf: &mut [E]) -> Self {
        SharedOut {
            ptr: buf.as_mut_ptr(),
            len: buf.len(),
        }
    }

    /// Writes `value` at `index` (ignored out of bounds, which validation rules out).
    #[inline(always)]
    fn write(&self, index: usize, value: E) {
        if index < self.len {
            // SAFETY: in bounds (checked); no other task writes this element (see Send).
            unsafe { self.ptr.add(index).write(value) };
        }
    }

    /// Prefetches the cache lines of `start..start + n` (nothing if that range is out of
    /// bounds). No effect on the contents.
    #[inline(always)]
    fn prefetch_row<S: Simd>(&self, start: usize, n: usize) {
        if start.checked_add(n).is_some_and(|end| end <= self.len) {
            // `start + n ≤ len`: the range is inside the buffer.
            prefetch_lines::<S>(
                self.ptr.wrapping_add(start) as *const u8,
                n * std::mem::size_of::<E>(),
            );
        }
    }

    /// Writes `values` at `start..start + values.len()` (nothing if that range is out of
    /// bounds, which validation rules out). One bounds check per row, so the compiler emits
    /// plain stores (per-element checks became masked stores, slow on Zen).
    #[inline(always)]
    fn write_row(&self, start: usize, values: impl ExactSizeIterator<Item = E>) {
        let n = values.len();
        if start.checked_add(n).is_some_and(|end| end <= self.len) {
            for (i, v) in values.enumerate() {
                // SAFETY: start + i < start + n ≤ len (checked); no other task writes these
                // elements (see Send).
                unsafe { self.ptr.add(start + i).write(v) };
            }
        }
    }
}

/// Everything a task reads, shared by all tasks of a call.
pub(crate) struct Ctx<'a, T, O> {
    pub problem: &'a Problem<'a>,
    pub q: &'a [T],
    pub k: &'a [T],
    pub v: &'a [T],
    pub out: SharedOut<O>,
    pub lse: Option<SharedOut<f32>>,
    pub policy: RescalePolicy<f32>,
    pub exp2: Exp2Impl,
    pub hook: Option<crate::ProbabilityHook<'a>>,
    pub tiling: Tiling,
}

/// Per-thread scratch, grown on demand and reused across tasks and calls.
#[derive(Debug, Default)]
pub(crate) struct Scratch {
    qt: Vec<f32>,
    ot: Vec<f32>,
    st: Vec<f32>,
    kt: Vec<f32>,
    vt: Vec<f32>,
    row: Vec<f32>,
    probs: Vec<f32>,
    corr: Vec<f32>,
    states: Vec<RowState<f32>>,
    kinds: Vec<TileKind>,
}

/// f32 elements a task's scratch needs (the companion of [`crate::Workspace`]).
pub(crate) fn scratch_elems(
    tiling: &Tiling,
    head_dim: usize,
    head_dim_v: usize,
    hook: bool,
) -> usize {
    let rows = tiling.rows;
    let dv_pad = head_dim_v.div_ceil(tiling.pv_channels) * tiling.pv_channels;
    let keys = tiling.keys_for(head_dim, head_dim_v, false); // the larger of the two
    head_dim * rows
        + dv_pad * rows
        + keys * tiling.lanes * tiling.row_vectors
        + keys * head_dim
        + keys * Tiling::v_stride(dv_pad)
        + tiling.lanes * tiling.row_vectors * head_dim.max(head_dim_v)
        + if hook {
            keys * tiling.lanes * tiling.row_vectors
        } else {
            0
        }
        + rows * 3
        + 6 * ALIGN_SLACK
}

impl Scratch {
    /// Bytes currently held.
    pub fn bytes(&self) -> usize {
        4 * (self.qt.capacity()
            + self.ot.capacity()
            + self.st.capacity()
            + self.kt.capacity()
            + self.vt.capacity()
            + self.row.capacity()
            + self.probs.capacity()
            + self.corr.capacity())
            + self.states.capacity() * std::mem::size_of::<RowState<f32>>()
    }
}

/// Floats of slack per vector buffer, so that its slice can start on a cache line.
const ALIGN_SLACK: usize = CACHE_LINE / 4;
/// The alignment of the scratch slices the micro-kernels stream through.
const CACHE_LINE: usize = 64;

/// Like [`ensure`], but the returned `len` floats start on a 64-byte boundary (the buffer
/// keeps [`ALIGN_SLACK`] floats of slack). The panels of `Qᵀ`, `Oᵀ` and the scores are whole
/// cache lines (`W·NR` floats, 64 or 192 bytes), so from an aligned start no vector load or
/// store of the micro-kernels crosses a line; from the allocator's 16-byte-aligned start,
/// every 64-byte AVX-512 access and every other 32-byte AVX2 access did. The contents are
/// unspecified (callers write before they read), and only speed depends on the alignment.
fn ensure_aligned(buf: &mut Vec<f32>, len: usize) -> &mut [f32] {
    let whole = ensure(buf, len + ALIGN_SLACK, 0.0);
    let offset = whole.as_ptr().align_offset(CACHE_LINE).min(ALIGN_SLACK);
    &mut whole[offset..offset + len]
}

/// Grows `buf` to at least `len` elements (never shrinks) and returns the first `len`.
fn ensure<E: Copy>(buf: &mut Vec<E>, len: usize, fill: E) -> &mut [E] {
    if buf.len() < len {
        // Exactly what is asked: `resize` alone may double the capacity when a later task
        // needs a little more, past what `scratch_elems` promises.
        buf.reserve_exact(len - buf.len());
        buf.resize(len, fill);
    }
    &mut buf[..len]
}

/// Widens `n` elements of `src` starting at `offset` into `dst[..n]`.
#[inline(always)]
unsafe fn widen<S: Simd, T: Element>(src: &[T], offset: usize, n: usize, dst: &mut [f32]) {
    let dst = &mut dst[..n];
    match <T as sealed::Sealed>::view(src) {
        sealed::Slice::F32(s) => {
            // A vector loop rather than memcpy: rows are short (≤ 256 floats), where the
            // library call's start-up cost showed up in profiles.
            let s = &s[offset..offset + n];
            let mut i = 0;
            while i + S::W <= n {
                // SAFETY: i + W ≤ n on both sides; S available (caller).
                unsafe { S::store(dst.as_mut_ptr().add(i), S::load(s.as_ptr().add(i))) };
                i += S::W;
            }
            dst[i..].copy_from_slice(&s[i..]);
        }
        sealed::Slice::Bf16(s) => {
            for (d, x) in dst.iter_mut().zip(&s[offset..offset + n]) {
                *d = f32::from_bits((x.to_bits() as u32) << 16);
            }
        }
        sealed::Slice::F16(s) => {
            let s = &s[offset..offset + n];
            // SAFETY: f16 is a transparent u16; `s` and `dst` both hold n elements; the caller
            // runs on S's architecture.
            unsafe { S::widen_f16(s.as_ptr() as *const u16, dst.as_mut_ptr(), n) }
        }
    }
}

/// `dst[c·dst_stride + r] = src[r·src_stride + c]` for `r < rows`, `c < cols`: whole `W × W`
/// blocks with [`Simd::transpose`], the edges element by element. (Transposing `Qᵀ` in and
/// `Oᵀ` out one float at a time cost ~5–10 % of a single-thread run at N=1024.)
///
/// # Safety
/// `src` readable for `rows` rows of stride `src_stride` and `cols` columns, `dst` writable
/// for `cols` rows of stride `dst_stride` and `rows` columns, not overlapping; S available.
#[inline(always)]
pub(crate) unsafe fn transpose_region<S: Simd>(
    src: *const f32,
    src_stride: usize,
    rows: usize,
    cols: usize,
    dst: *mut f32,
    dst_stride: usize,
) {
    let w = S::W;
    let (rb, cb) = (rows / w * w, cols / w * w);
    // SAFETY: every index stays below rows (resp. cols) of its block (caller's contract).
    unsafe {
        for r0 in (0..rb).step_by(w) {
            for c0 in (0..cb).step_by(w) {
                S::transpose(
                    src.add(r0 * src_stride + c0),
                    src_stride,
                    dst.add(c0 * dst_stride + r0),
                    dst_stride,
                );
            }
        }
        for r in 0..rows {
            let c_start = if r < rb { cb } else { 0 };
            for c in c_start..cols {
                *dst.add(c * dst_stride + r) = *src.add(r * src_stride + c);
            }
        }
    }
}

/// `group[c·MR + j] = keys[j·d + c]` for `j < MR`, `c < d`: a group of `MR` key rows in the
/// QKᵀ micro-kernel's `[c][MR]` layout. With `MR = 8` (AVX-512) by 8 × 8 block transposes,
/// the rest element by element (one scalar store per element was a few per cent of a call
/// at N=1024 on the Xeon).
///
/// # Safety
/// `keys` readable for `MR·d` floats, `group` writable for `d·MR`, not overlapping; S
/// available.
#[inline(always)]
pub(crate) unsafe fn pack_group<S: Simd, const MR: usize>(
    keys: *const f32,
    d: usize,
    group: *mut f32,
) {
    // SAFETY: every index stays below MR rows of d (keys) and d rows of MR (group).
    unsafe {
        let mut c0 = 0;
        if MR == 8 {
            while c0 + 8 <= d {
                S::transpose8(keys.add(c0), d, group.add(c0 * 8), 8);
                c0 += 8;
            }
        }
        for c in c0..d {
            for j in 0..MR {
                *group.add(c * MR + j) = *keys.add(j * d + c);
            }
        }
    }
}

/// The widest row panel (`lanes · row_vectors`) of any architecture: AVX-512's 3 × 16.
const MAX_PANEL: usize = 64;

/// Hides the keys outside each row's visible range in a panel's score tile: `Sᵀ[j][l] = −∞`
/// unless `lo[l] ≤ j < hi[l]`, for keys `j < nk`. Two vector compares and blends per score
/// vector; a row at a time, the same −∞ went in one scalar store per hidden score (a column
/// walk through the tile, a few per cent of a causal call at D=64).
///
/// # Safety
/// `st` read/writable for `nk` rows of stride `st_stride` and `NR·W` columns; `lo` and `hi`
/// hold at least `NR·W` values; S available.
#[inline(always)]
unsafe fn mask_panel<S: Simd, const NR: usize>(
    st: *mut f32,
    st_stride: usize,
    nk: usize,
    lo: &[f32],
    hi: &[f32],
) {
    // SAFETY: bounds are the caller's contract.
    unsafe {
        let lo: [S::V; NR] = std::array::from_fn(|n| S::load(lo.as_ptr().add(n * S::W)));
        let hi: [S::V; NR] = std::array::from_fn(|n| S::load(hi.as_ptr().add(n * S::W)));
        let hidden = S::splat(f32::NEG_INFINITY);
        for j in 0..nk {
            let key = S::splat(j as f32);
            for n in 0..NR {
                let p = st.add(j * st_stride + n * S::W);
                let x = S::select_lt(key, lo[n], hidden, S::load(p));
                S::store(p, S::select_lt(key, hi[n], x, hidden));
            }
        }
    }
}

/// How many rows ahead the Q packing and the O write-back prefetch. Rows of one head are a
/// head stride apart (4 KiB and more), each in its own page, where the hardware prefetchers
/// do not follow; a few rows ahead cover the latency without flooding the miss queue.
const ROW_PREFETCH_AHEAD: usize = 6;

/// Prefetches the cache lines of `src[offset..offset + n]` (bounds-checked: nothing past the
/// slice is touched).
#[inline(always)]
fn prefetch_row<S: Simd, T: Element>(src: &[T], offset: usize, n: usize) {
    if let Some(row) = src.get(offset..offset + n) {
        prefetch_lines::<S>(row.as_ptr() as *const u8, std::mem::size_of_val(row));
    }
}

/// Prefetches the cache lines of the `bytes` bytes at `base`.
#[inline(always)]
fn prefetch_lines<S: Simd>(base: *const u8, bytes: usize) {
    let mut at = 0;
    while at < bytes {
        // SAFETY: a prefetch never faults and has no architectural effect, whatever the
        // address; callers pass ranges inside their buffers anyway.
        unsafe { S::prefetch(base.wrapping_add(at)) };
        at += CACHE_LINE;
    }
}

/// `Sᵀ[j][r] = Σ_c K[j][c]·Qᵀ[c][r]` for `MR` keys × `NR·W` rows, K packed as `[c][MR]`
/// (the `MR` broadcasts of a step are adjacent floats behind one pointer).
///
/// # Safety
/// `qt` readable for `d` rows of stride `qt_stride` and `NR·W` columns; `k` readable for
/// `d·MR` floats; `st` writable for `MR` rows of stride `st_stride` and `NR·W` columns; S's
/// architecture available.
#[inline(always)]
pub(crate) unsafe fn qk_micro<S: Simd, const MR: usize, const NR: usize>(
    qt: *const f32,
    qt_stride: usize,
    k: *const f32,
    d: usize,
    st: *mut f32,
    st_stride: usize,
) {
    // SAFETY: the bounds are the caller's contract.
    unsafe {
        let mut acc = [[S::splat(0.0); NR]; MR];
        for c in 0..d {
            rank1_update::<S, MR, NR>(&mut acc, qt.add(c * qt_stride), k.add(c * MR));
        }
        store_block::<S, MR, NR>(&acc, st, st_stride);
    }
}

/// `Oᵀ[c][r] = Oᵀ[c][r]·corr[r] + Σ_j V[j][c]·Pᵀ[j][r]` for `MR` channels × `NR·W` rows and
/// `nk` keys (`corr` null: no correction).
///
/// # Safety
/// `pt` readable for `nk` rows of stride `pt_stride` and `NR·W` columns; `v` readable for `nk`
/// rows of stride `v_stride` and `MR` columns; `ot` read/writable for `MR` rows of stride
/// `ot_stride` and `NR·W` columns; `corr` null or readable for `NR·W`; S available.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn pv_micro<S: Simd, const MR: usize, const NR: usize>(
    pt: *const f32,
    pt_stride: usize,
    v: *const f32,
    v_stride: usize,
    nk: usize,
    ot: *mut f32,
    ot_stride: usize,
    corr: *const f32,
) {
    // SAFETY: the bounds are the caller's contract.
    unsafe {
        let mut acc = [[S::splat(0.0); NR]; MR];
        for (m, row) in acc.iter_mut().enumerate() {
            for (n, a) in row.iter_mut().enumerate() {
                *a = S::load(ot.add(m * ot_stride + n * S::W));
                if !corr.is_null() {
                    *a = S::mul(*a, S::load(corr.add(n * S::W)));
                }
            }
        }
        for j in 0..nk {
            rank1_update::<S, MR, NR>(&mut acc, pt.add(j * pt_stride), v.add(j * v_stride));
        }
        store_block::<S, MR, NR>(&acc, ot, ot_stride);
    }
}

/// Calls a micro-kernel (`qk_micro` or `pv_micro`, written with `_` for its row-vector count)
/// on the first `live` of `NR` row vectors (`1 ≤ live ≤ NR`): the narrower kernels serve a
/// block's last, partly filled panel.
macro_rules! on_live_vectors {
    ($live:expr, $nr:ident, $kernel:ident::<$s:ident, $mr:ident, _>($($arg:expr),* $(,)?)) => {
        match $live {
            1 if $nr > 1 => $kernel::<$s, $mr, 1>($($arg),*),
            2 if $nr > 2 => $kernel::<$s, $mr, 2>($($arg),*),
            _ => $kernel::<$s, $mr, $nr>($($arg),*),
        }
    };
}

/// The step both micro-kernels are made of: `acc[m][n] += b[m] · x[n·W..(n+1)·W]` for `MR`
/// broadcasts `b` (adjacent floats) against `NR` vectors `x` (adjacent vectors).
///
/// # Safety
/// `x` readable for `NR·W` floats, `b` for `MR`; S available.
#[inline(always)]
unsafe fn rank1_update<S: Simd, const MR: usize, const NR: usize>(
    acc: &mut [[S::V; NR]; MR],
    x: *const f32,
    b: *const f32,
) {
    // SAFETY: the bounds are the caller's contract.
    unsafe {
        let mut xv = [S::splat(0.0); NR];
        for (n, v) in xv.iter_mut().enumerate() {
            *v = S::load(x.add(n * S::W));
        }
        for (m, row) in acc.iter_mut().enumerate() {
            let bm = S::splat(*b.add(m));
            for (a, &v) in row.iter_mut().zip(&xv) {
                *a = S::fma(bm, v, *a);
            }
        }
    }
}

/// Stores an `MR × NR` block of vectors: row `m` at `dst + m·stride`, its vectors adjacent.
///
/// # Safety
/// `dst` writable for `MR` rows of stride `stride` and `NR·W` columns; S available.
#[inline(always)]
unsafe fn store_block<S: Simd, const MR: usize, const NR: usize>(
    acc: &[[S::V; NR]; MR],
    dst: *mut f32,
    stride: usize,
) {
    for (m, row) in acc.iter().enumerate() {
        for (n, &a) in row.iter().enumerate() {
            // SAFETY: m < MR, n < NR: inside the block (caller's contract).
            unsafe { S::store(dst.add(m * stride + n * S::W), a) };
        }
    }
}

/// Applies `exp2` (exact or cubic) to `n` values (a multiple of `W`) at `x`, in place.
///
/// # Safety
/// `x` read/writable for `n` f32, `n % W == 0`; S available.
#[inline(always)]
#[cfg(test)]
pub(crate) unsafe fn exp2_slice<S: Simd>(x: *mut f32, n: usize, imp: Exp2Impl) {
    let mut i = 0;
    while i < n {
        // SAFETY: i + W ≤ n (n is a multiple of W).
        unsafe {
            let v = S::load(x.add(i));
            let e = match imp {
                Exp2Impl::Exact => exp2_exact::<S>(v),
                Exp2Impl::Cubic => exp2_cubic::<S>(v),
            };
            S::store(x.add(i), e);
        }
        i += S::W;
    }
}

/// Applies `tanh` to `n` values (a multiple of `W`) at `x`, multiplied by `post`, in place.
///
/// # Safety
/// As [`exp2_slice`].
#[inline(always)]
pub(crate) unsafe fn softcap_slice<S: Simd>(x: *mut f32, n: usize, post: f32) {
    let mut i = 0;
    while i < n {
        // SAFETY: i + W ≤ n.
        unsafe {
            let v = S::load(x.add(i));
            S::store(x.add(i), S::mul(tanh::<S>(v), S::splat(post)));
        }
        i += S::W;
    }
}

/// The online-softmax step of one score tile for a panel of `NR` row vectors, rows
/// `rv0..rv0 + NR·W`, whose scores are `NR·W` floats at `st + j·st_stride` for keys `j < nk`:
/// block maxima, [`RowState::begin_block`] per row, `exp2(x − offset)` in place, row sums,
/// [`RowState::add_sum`]. Writes each row's accumulator correction into `corr`. The `NR` row
/// vectors go through each loop together (independent dependency chains), and the exponential
/// is chosen once per call, outside the loops ([`exp2_pass`]).
///
/// # Safety
/// `st` read/writable for `nk` rows of stride `st_stride` and `NR·W` columns; `states`
/// and `corr` hold at least `rv0 + NR·W` entries; S available.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn softmax_panel<S: Simd, const NR: usize>(
    st: *mut f32,
    st_stride: usize,
    nk: usize,
    rv0: usize,
    valid_rows: usize,
    states: &mut [RowState<f32>],
    corr: &mut [f32],
    policy: &RescalePolicy<f32>,
    stats: &mut RescaleStats,
    imp: Exp2Impl,
) {
    let w = S::W;
    let mut lanes = [0.0f32; 16];
    // SAFETY: bounds are the caller's contract; `lanes` holds 16 ≥ W floats.
    unsafe {
        let mut mx = [S::splat(f32::NEG_INFINITY); NR];
        for j in 0..nk {
            for (n, m) in mx.iter_mut().enumerate() {
                *m = S::max(S::load(st.add(j * st_stride + n * w)), *m);
            }
        }
        let mut offset = [S::splat(0.0); NR];
        for (n, (m, off)) in mx.iter().zip(offset.iter_mut()).enumerate() {
            let base = rv0 + n * w;
            if base + w <= valid_rows {
                // The common case after a row's first tiles: no row of the vector moves its
                // reference. Then the offsets are the current references and the corrections
                // 1, with no per-row work.
                for (lane, x) in lanes.iter_mut().enumerate().take(w) {
                    *x = states[base + lane].max;
                }
                let current = S::load(lanes.as_ptr());
                if let Some(skipped) = all_keep::<S>(policy, current, *m) {
                    stats.blocks += w as u64;
                    stats.skipped += u64::from(skipped);
                    *off = current;
                    corr[base..base + w].fill(1.0);
                    continue;
                }
            }
            S::store(lanes.as_mut_ptr(), *m);
            for (lane, x) in lanes.iter_mut().enumerate().take(w) {
                let r = base + lane;
                if r < valid_rows {
                    let step = states[r].begin_block(*x, policy, stats);
                    *x = step.offset;
                    corr[r] = step.correction;
                } else {
                    *x = 0.0;
                    corr[r] = 1.0;
                }
            }
            *off = S::load(lanes.as_ptr());
        }
        let sum = match imp {
            Exp2Impl::Exact => exp2_pass::<S, NR, false>(st, st_stride, nk, &offset),
            Exp2Impl::Cubic => exp2_pass::<S, NR, true>(st, st_stride, nk, &offset),
        };
        for (n, total) in sum.iter().enumerate() {
            S::store(lanes.as_mut_ptr(), *total);
            for (lane, &x) in lanes.iter().enumerate().take(w) {
                let r = rv0 + n * w + lane;
                if r < valid_rows {
                    states[r].add_sum(x);
                }
            }
        }
    }
}

/// Whether [`RescalePolicy::decide`] keeps the reference of every lane, for references
/// `current` and block maxima `block_max`; if so, how many of those lanes it counts as
/// skipped rescales. `None` when any lane would move (or has no reference yet, `−∞`): the
/// caller then runs the per-row rule. The vector form of `decide`'s `Keep` outcome (tested
/// against it lane by lane), so a vector that takes this path gets exactly the offsets,
/// corrections and statistics the per-row calls would give.
///
/// # Safety
/// S available.
#[inline(always)]
pub(crate) unsafe fn all_keep<S: Simd>(
    policy: &RescalePolicy<f32>,
    current: S::V,
    block_max: S::V,
) -> Option<u32> {
    // SAFETY: S available (caller).
    unsafe {
        // −∞ is the only value below f32::MIN.
        if S::gt_mask(S::splat(f32::MIN), current) != 0 {
            return None;
        }
        // `block_max > current` is false for a NaN maximum, as in `decide`.
        let above = S::gt_mask(block_max, current);
        match *policy {
            RescalePolicy::Always => (above == 0).then_some(0),
            RescalePolicy::Threshold(tau) => {
                (S::gt_mask(S::sub(block_max, current), S::splat(tau)) == 0)
                    .then_some(above.count_ones())
            }
        }
    }
}

/// `exp2(x − offset)` in place over `nk` rows of a panel's `NR` row vectors (the exponential
/// fixed at compile time, `CUBIC`: [`exp2_cubic`], else [`exp2_exact`]); returns the row sums.
///
/// # Safety
/// As [`softmax_panel`].
#[inline(always)]
unsafe fn exp2_pass<S: Simd, const NR: usize, const CUBIC: bool>(
    st: *mut f32,
    st_stride: usize,
    nk: usize,
    offset: &[S::V; NR],
) -> [S::V; NR] {
    // SAFETY: bounds are the caller's contract.
    unsafe {
        let mut sum = [S::splat(0.0); NR];
        for j in 0..nk {
            for (n, total) in sum.iter_mut().enumerate() {
                let p = st.add(j * st_stride + n * S::W);
                let x = S::sub(S::load(p), offset[n]);
                let e = if CUBIC {
                    exp2_cubic::<S>(x)
                } else {
                    exp2_exact::<S>(x)
                };
                S::store(p, e);
                *total = S::add(*total, e);
            }
        }
        sum
    }
}

/// Runs one task: packs Qᵀ, streams the key tiles the mask leaves, writes O and the LSE.
///
/// # Safety
/// S's architecture must be available; `T::NR`-style constants must match the tiling
/// (`QMR == tiling.qk_keys`, `NR == tiling.row_vectors`, `VMR == tiling.pv_channels`,
/// `S::W == tiling.lanes`); the context's problem validated and buffers checked.
#[inline(always)]
pub(crate) unsafe fn run_task<
    S: Simd,
    T: Element,
    O: Element,
    const QMR: usize,
    const NR: usize,
    const VMR: usize,
>(
    ctx: &Ctx<'_, T, O>,
    task: &Task,
    scratch: &mut Scratch,
) -> TaskStats {
    let p = ctx.problem;
    let tiling = ctx.tiling;
    let w = S::W;
    let panel = w * NR;
    // Compile-time: the mask's per-row bounds live in MAX_PANEL-long arrays.
    const { assert!(S::W * NR <= MAX_PANEL) };
    let d = p.head_dim();
    let dv = p.head_dim_v();
    let dv_pad = dv.div_ceil(VMR) * VMR;
    let v_stride = Tiling::v_stride(dv_pad);
    let rows = task.heads * task.len;
    let br = tiling.padded_rows(rows);
    let bc = tiling.keys_for(d, dv, !p.mask().is_none());
    let seq = p.seq(task.batch);
    let (sq, sk) = (seq.seqlen_q, seq.seqlen_k);
    let q_rows = task.i0..task.i0 + task.len;
    let transform = p.score_transform::<f32>();
    let pre = transform.pre_factor();
    let post = transform.softcap_post_factor();
    let mask = p.mask();
    let mut stats = TaskStats::default();

    let Scratch {
        qt,
        ot,
        st,
        kt,
        vt,
        row,
        probs,
        corr,
        states,
        kinds,
    } = scratch;
    let qt = ensure_aligned(qt, d * br);
    let ot = ensure_aligned(ot, dv_pad * br);
    let st = ensure_aligned(st, bc * panel);
    let kt = ensure_aligned(kt, bc * d);
    let vt = ensure_aligned(vt, bc * v_stride);
    let row = ensure_aligned(row, panel * d.max(dv));
    let corr = ensure(corr, br, 1.0);
    let states = ensure(states, br, RowState::new());
    ot.fill(0.0);
    states.fill(RowState::new());

    // Qᵀ, pre-multiplied by scale·log2(e) (or scale/cap under a softcap), one panel at a
    // time: the panel's rows are widened into `row` (rows × d, in L1), then written out
    // column by column, so the stores to Qᵀ are sequential. Padding rows get 0.
    for p0 in (0..br).step_by(panel) {
        let valid = rows.saturating_sub(p0).min(panel);
        for l in 0..valid {
            let (head, i) = task.row(p0 + l);
            let ahead = p0 + l + ROW_PREFETCH_AHEAD;
            if ahead < rows {
                let (head, i) = task.row(ahead);
                prefetch_row::<S, T>(ctx.q, p.q_offset(task.batch, i, head), d);
            }
            // SAFETY: S available (caller); the offsets are inside the checked buffer.
            unsafe { widen::<S, T>(ctx.q, p.q_offset(task.batch, i, head), d, &mut row[l * d..]) };
        }
        row[valid * d..panel * d].fill(0.0);
        let dst = &mut qt[p0 * d..(p0 + panel) * d];
        // SAFETY: `row` holds panel × d floats (stride d), `dst` d × panel (stride panel); S
        // available (caller).
        unsafe { transpose_region::<S>(row.as_ptr(), d, panel, d, dst.as_mut_ptr(), panel) };
        // SAFETY: S available (caller).
        let pre_v = unsafe { S::splat(pre) };
        for chunk in dst.chunks_exact_mut(w) {
            // SAFETY: W floats in the chunk; S available.
            unsafe { S::store(chunk.as_mut_ptr(), S::mul(S::load(chunk.as_ptr()), pre_v)) };
        }
    }

    let [_, k_strides, v_strides, _] = p.strides();
    let (k_seq, v_seq) = (k_strides.seq, v_strides.seq);
    let k_base = p.k_offset(task.batch, 0, task.head_kv);
    let v_base = p.v_offset(task.batch, 0, task.head_kv);
    let total_tiles = sk.div_ceil(bc) as u64;
    let tiles = mask.key_tile_range(q_rows.clone(), bc, sq, sk);
    for tile in tiles.clone() {
        let j0 = tile * bc;
        let nk = bc.min(sk - j0);
        let kind = mask.classify_tile(q_rows.clone(), j0..j0 + nk, sq, sk);
        if kind == TileKind::Empty {
            continue;
        }
        let nk_pad = nk.div_ceil(QMR) * QMR;
        // Pack K and V as f32, QMR keys at a time. Row offsets are linear in the key index:
        // `k_offset(b, j, h) = k_offset(b, 0, h) + j·seq_stride`. A group's K rows are widened
        // into `row` and transposed into `[c][QMR]` (key j of group g at `g·d·QMR + c·QMR +
        // j % QMR`), zero keys after the last; V rows go straight to their place (stride
        // `v_stride`, zeros after `dv`).
        for g in 0..nk_pad / QMR {
            let in_group = nk.saturating_sub(g * QMR).min(QMR);
            for l in 0..in_group {
                let j = g * QMR + l;
                let ko = k_base + (j0 + j) * k_seq;
                let vo = v_base + (j0 + j) * v_seq;
                // SAFETY: S available; offsets inside the checked buffers.
                unsafe {
                    widen::<S, T>(ctx.k, ko, d, &mut row[l * d..]);
                    widen::<S, T>(ctx.v, vo, dv, &mut vt[j * v_stride..]);
                }
                vt[j * v_stride + dv..j * v_stride + dv_pad].fill(0.0);
            }
            row[in_group * d..QMR * d].fill(0.0);
            let group = &mut kt[g * d * QMR..(g + 1) * d * QMR];
            // SAFETY: `row` holds QMR rows of d floats (panel·max(d, dv) ≥ QMR·d), `group` d
            // rows of QMR; S available (caller).
            unsafe { pack_group::<S, QMR>(row.as_ptr(), d, group.as_mut_ptr()) };
        }

        // Classify each panel of rows against this key tile: on the diagonal of a causal or
        // windowed mask whole panels can be empty, and those skip QKᵀ, softmax and PV.
        let kinds = ensure(kinds, br / panel, TileKind::Full);
        for (pi, k) in kinds.iter_mut().enumerate() {
            let (r0, r1) = (pi * panel, ((pi + 1) * panel).min(rows));
            *k = if r0 >= rows {
                TileKind::Empty // padding only
            } else if kind == TileKind::Full {
                TileKind::Full
            } else {
                // Positions of rows r0..r1: contiguous unless the panel crosses into the
                // next head's rows (then take the task's whole range: conservative).
                let i_range = if r0 / task.len == (r1 - 1) / task.len {
                    task.row(r0).1..task.row(r1 - 1).1 + 1
                } else {
                    q_rows.clone()
                };
                mask.classify_tile(i_range, j0..j0 + nk, sq, sk)
            };
        }

        // Each live panel of rows runs the whole tile in turn: Sᵀ = K·Qᵀ into `st` (nk × panel
        // floats, in L1), softcap, mask, online softmax, the hook, then Oᵀ = Oᵀ·corr + Vᵀ·Pᵀ.
        // Fused per panel, the scores never leave L1 (three passes over the whole block's
        // scores went through L2/L3 and cost up to a fifth of the time with two threads).
        // Meanwhile the next tile's K and V rows are prefetched, a few rows per PV micro-kernel
        // call: rows are a head stride apart, too far for the hardware prefetchers, and a
        // burst of prefetches would stall on the miss queue.
        let next_rows = if tile + 1 < tiles.end {
            bc.min(sk.saturating_sub(j0 + bc))
        } else {
            0
        };
        let live_panels = kinds.iter().filter(|&&k| k != TileKind::Empty).count();
        stats.computed += live_panels as u64;
        let (pf_total, calls) = (2 * next_rows, live_panels * (dv_pad / VMR));
        let (mut pf_done, mut call) = (0, 0);
        for rv0 in (0..br).step_by(panel) {
            let kind = kinds[rv0 / panel];
            if kind == TileKind::Empty {
                continue; // P = 0 and the states unchanged: nothing to add
            }
            // Row vectors holding at least one real row: the last panel of a block whose row
            // count is not a multiple of the panel width computes only those (at N=1024 with
            // 48-row AVX-512 panels, 32 of 1056 rows would otherwise be padding). The scores of
            // the other vectors are set to 0, what padding rows' zero queries gave before, so
            // the softmax and the hook see the same values.
            let live = (rows - rv0).min(panel).div_ceil(w);
            for j in (0..nk_pad).step_by(QMR) {
                // SAFETY: rv0 + panel ≤ br; j + QMR ≤ nk_pad ≤ bc; kt holds bc·d (group j/QMR
                // at j·d); qt holds d·br (panel rv0/panel starts at rv0·d); st holds bc·panel;
                // live ≤ NR.
                unsafe {
                    on_live_vectors!(
                        live,
                        NR,
                        qk_micro::<S, QMR, _>(
                            qt.as_ptr().add(rv0 * d),
                            panel,
                            kt.as_ptr().add(j * d),
                            d,
                            st.as_mut_ptr().add(j * panel),
                            panel,
                        )
                    );
                }
            }
            if live < NR {
                for j in 0..nk_pad {
                    st[j * panel + live * w..(j + 1) * panel].fill(0.0);
                }
            }
            // The softcap comes before the mask (tanh(−∞) would be finite).
            if let Some(post) = post {
                // SAFETY: nk_pad·panel is a multiple of W; st holds bc·panel ≥ nk_pad·panel.
                unsafe { softcap_slice::<S>(st.as_mut_ptr(), nk_pad * panel, post) };
            }
            if kind == TileKind::Partial {
                // Each row's visible keys within the tile, `lo..hi` (as floats: below nk ≤ 2^24,
                // exact); padding rows hide nothing.
                let (mut lo, mut hi) = ([0.0f32; MAX_PANEL], [nk as f32; MAX_PANEL]);
                for r in rv0..(rv0 + panel).min(rows) {
                    let visible = mask.key_range(task.row(r).1, sq, sk);
                    let first = visible.start.clamp(j0, j0 + nk) - j0;
                    lo[r - rv0] = first as f32;
                    hi[r - rv0] = (visible.end.clamp(j0 + first, j0 + nk) - j0) as f32;
                }
                // SAFETY: st holds nk ≤ bc rows of `panel` floats; lo and hi hold
                // MAX_PANEL ≥ panel (checked when the kernel starts); S available (caller).
                unsafe { mask_panel::<S, NR>(st.as_mut_ptr(), panel, nk, &lo, &hi) };
            }
            // SAFETY: the panel's scores sit at `j·panel` in st (bc·panel); rv0 + panel ≤ br =
            // the length of states and corr.
            unsafe {
                softmax_panel::<S, NR>(
                    st.as_mut_ptr(),
                    panel,
                    nk,
                    rv0,
                    rows,
                    states,
                    corr,
                    &ctx.policy,
                    &mut stats.rescale,
                    ctx.exp2,
                );
            }
            if let Some(hook) = ctx.hook {
                let probs = ensure(probs, panel * nk, 0.0);
                // SAFETY: st holds nk rows of `panel` floats, probs panel rows of nk; S
                // available (caller).
                unsafe {
                    transpose_region::<S>(st.as_ptr(), panel, nk, panel, probs.as_mut_ptr(), nk)
                };
                hook(probs);
                // SAFETY: as above, the other way round.
                unsafe {
                    transpose_region::<S>(probs.as_ptr(), nk, panel, nk, st.as_mut_ptr(), panel)
                };
            }
            let corr_ptr = if corr[rv0..rv0 + panel].iter().any(|&c| c != 1.0) {
                corr[rv0..].as_ptr()
            } else {
                std::ptr::null()
            };
            for c0 in (0..dv_pad).step_by(VMR) {
                // SAFETY: rv0 + panel ≤ br; c0 + VMR ≤ dv_pad; st holds this panel's nk rows
                // of `panel` floats, ot (dv_pad·br, panel-major) its dv_pad rows; vt holds nk
                // rows of stride v_stride; corr holds br.
                unsafe {
                    on_live_vectors!(
                        live,
                        NR,
                        pv_micro::<S, VMR, _>(
                            st.as_ptr(),
                            panel,
                            vt.as_ptr().add(c0),
                            v_stride,
                            nk,
                            ot.as_mut_ptr().add(rv0 * dv_pad + c0 * panel),
                            panel,
                            corr_ptr,
                        )
                    );
                }
                call += 1;
                let target = call * pf_total / calls.max(1);
                while pf_done < target {
                    let j = j0 + bc + pf_done % next_rows;
                    if pf_done < next_rows {
                        prefetch_row::<S, T>(ctx.k, k_base + j * k_seq, d);
                    } else {
                        prefetch_row::<S, T>(ctx.v, v_base + j * v_seq, dv);
                    }
                    pf_done += 1;
                }
            }
        }
    }
    stats.skipped = total_tiles * rows.div_ceil(panel) as u64 - stats.computed;

    // Normalise once per row and write O and the LSE, one panel at a time: the panel of
    // Oᵀ is read sequentially and transposed into `row` (rows × dv, in L1), then each row
    // is written out contiguously.
    for p0 in (0..br).step_by(panel) {
        let valid = rows.saturating_sub(p0).min(panel);
        let src = &ot[p0 * dv_pad..(p0 + panel) * dv_pad];
        // SAFETY: `src` holds dv_pad ≥ dv rows of `panel` floats, `row` panel rows of dv; S
        // available (caller).
        unsafe { transpose_region::<S>(src.as_ptr(), panel, dv, panel, row.as_mut_ptr(), dv) };
        for l in 0..valid {
            let r = p0 + l;
            let (head, i) = task.row(r);
            let result = states[r].finish();
            let oo = p.o_offset(task.batch, i, head);
            let ahead = r + ROW_PREFETCH_AHEAD;
            if ahead < rows {
                let (head, i) = task.row(ahead);
                ctx.out
                    .prefetch_row::<S>(p.o_offset(task.batch, i, head), dv);
            }
            // A row that saw no key gets 0, whatever V holds.
            let seen = result.inv_sum != 0.0;
            let values = row[l * dv..(l + 1) * dv]
                .iter()
                .map(|&acc| O::from_f32(if seen { acc * result.inv_sum } else { 0.0 }));
            ctx.out.write_row(oo, values);
            if let Some(lse) = &ctx.lse {
                lse.write(p.lse_offset(task.batch, head, i), result.lse);
            }
        }
    }
    stats
}
