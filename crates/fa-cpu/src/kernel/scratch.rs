//! Per-thread scratch ([`Scratch`], grown on demand and reused across tasks and calls) and the
//! output buffers the tasks share ([`SharedOut`]).

use super::decode_stream::{StreamLens, TILE_KEYS};
use super::pack::prefetch_lines;
use super::tiling::Tiling;
use super::CACHE_LINE;
use crate::arch::Simd;
use softmax_core::{RowState, TileKind};

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
    pub fn write(&self, index: usize, value: E) {
        if index < self.len {
            // SAFETY: in bounds (checked); no other task writes this element (see Send).
            unsafe { self.ptr.add(index).write(value) };
        }
    }

    /// Prefetches the cache lines of `start..start + n` (nothing if that range is out of
    /// bounds). No effect on the contents.
    #[inline(always)]
    pub fn prefetch_row<S: Simd>(&self, start: usize, n: usize) {
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
    pub fn write_row(&self, start: usize, values: impl ExactSizeIterator<Item = E>) {
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
/// Per-thread scratch, grown on demand and reused across tasks and calls.
#[derive(Debug, Default)]
pub(crate) struct Scratch {
    /// `Qᵀ`, panel-major.
    pub qt: Vec<f32>,
    /// `Oᵀ`, panel-major.
    pub ot: Vec<f32>,
    /// One panel's score tile `Sᵀ` (then `Pᵀ`).
    pub st: Vec<f32>,
    /// The packed K tile.
    pub kt: Vec<f32>,
    /// The packed V tile.
    pub vt: Vec<f32>,
    /// A panel of rows (or a group of keys) on its way in or out of a transpose.
    pub row: Vec<f32>,
    /// Row-major probabilities for the hook.
    pub probs: Vec<f32>,
    /// Each row's accumulator correction for the current key tile.
    pub corr: Vec<f32>,
    /// Each row's online-softmax state.
    pub states: Vec<RowState<f32>>,
    /// Each row panel's kind against the current key tile.
    pub kinds: Vec<TileKind>,
    /// K and V row offsets of the current and the next key tile (paged caches make them
    /// irregular).
    pub kv_offsets: Vec<usize>,
    /// The AMX kernel's bf16 tiles ([`super::amx_task`]), bf16 pairs as dwords: Q (B tiles),
    /// Vᵀ (A tiles), P (B tiles), and the row-major pairs on their way into a transpose; K
    /// (A tiles) as bf16.
    pub amx_q: Vec<u32>,
    /// See `amx_q`.
    pub amx_k: Vec<u16>,
    /// See `amx_q`.
    pub amx_v: Vec<u32>,
    /// See `amx_q`.
    pub amx_p: Vec<u32>,
    /// See `amx_q`.
    pub amx_pairs: Vec<u32>,
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
        // The K/V row offsets (usize: two f32s each on 64-bit targets).
        + 8 * keys
        // Padding of the few-rows path's row-major layouts to whole vectors.
        + 2 * (keys + tiling.lanes) * tiling.lanes
}

/// The lengths [`Scratch`]'s buffers grow to for the tasks of one call: what `run_task` asks of
/// [`ensure`]/[`ensure_aligned`] for its largest task, so that reserving them up front (where a
/// failure is a typed error) leaves nothing to allocate while the tasks run.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ScratchLens {
    /// Query rows of the largest task (heads × positions).
    pub max_rows: usize,
    /// Head dims of Q/K and of V.
    pub head_dim: usize,
    /// Head dim of V and O.
    pub head_dim_v: usize,
    /// Whether the problem has a mask (smaller key tiles).
    pub masked: bool,
    /// Whether a probability hook runs (its row-major copy).
    pub hook: bool,
    /// Whether the AMX kernel runs (its bf16 tiles, 32-row panels), and on which inputs.
    pub amx: Option<super::amx_task::HalfKind>,
}

impl Scratch {
    /// Reserves every buffer for `lens` (nothing where it is already large enough). Mirrors
    /// the lengths `run_task` asks for; a buffer reserved short would only grow later.
    pub(crate) fn try_reserve(
        &mut self,
        tiling: &Tiling,
        lens: ScratchLens,
    ) -> Result<(), std::collections::TryReserveError> {
        fn grow<E>(buf: &mut Vec<E>, len: usize) -> Result<(), std::collections::TryReserveError> {
            buf.try_reserve_exact(len.saturating_sub(buf.len()))
        }
        let (d, dv) = (lens.head_dim, lens.head_dim_v);
        let panel = tiling.lanes * tiling.row_vectors;
        let dv_pad = dv.div_ceil(tiling.pv_channels) * tiling.pv_channels;
        let br = tiling.padded_rows(lens.max_rows);
        let bc = tiling.keys_for(d, dv, lens.masked);
        // The few-rows (decode) path keeps W rows of Q and O row-major, padded to whole
        // vectors, and K/V tiles row-major (`run_task` asks for the larger of both layouts).
        let w = tiling.lanes;
        let (d_w, dv_w) = (d.div_ceil(w) * w, dv.div_ceil(w) * w);
        grow(&mut self.qt, (d * br).max(w * d_w) + ALIGN_SLACK)?;
        grow(&mut self.ot, (dv_pad * br).max(w * dv_w) + ALIGN_SLACK)?;
        grow(&mut self.st, bc * panel + ALIGN_SLACK)?;
        grow(&mut self.kt, bc * d_w + ALIGN_SLACK)?;
        grow(
            &mut self.vt,
            bc * Tiling::v_stride(dv_pad).max(dv_w) + ALIGN_SLACK,
        )?;
        grow(&mut self.row, panel * d.max(dv) + ALIGN_SLACK)?;
        grow(&mut self.corr, br)?;
        grow(&mut self.states, br)?;
        grow(&mut self.kinds, br / panel)?;
        grow(&mut self.kv_offsets, 4 * bc)?;
        if lens.hook {
            grow(&mut self.probs, panel * bc)?;
        }
        if let Some(kind) = lens.amx {
            use super::amx_task::{amx_pair_dwords, amx_row_floats};
            // What `amx_task` asks for: 32-row panels, head dims and keys padded to 32, Q·Kᵀ's
            // and Vᵀ's operands in `kind`'s parts.
            let (d32, dv32) = (d.div_ceil(32) * 32, dv.div_ceil(32) * 32);
            let (dk, v_parts) = (kind.qk_parts() * d32, kind.v_parts());
            let (br32, bc32) = (lens.max_rows.div_ceil(32) * 32, super::amx_task::amx_keys());
            grow(&mut self.ot, dv32 * br32 + ALIGN_SLACK)?;
            // Scores and P double-buffered (the panel pipeline of `amx_task`).
            grow(&mut self.st, 2 * bc32 * 32 + ALIGN_SLACK)?;
            grow(&mut self.corr, br32)?;
            grow(&mut self.states, br32)?;
            grow(&mut self.kinds, br32 / 32)?;
            grow(&mut self.kv_offsets, 4 * bc32)?;
            grow(&mut self.row, amx_row_floats(d, dv) + ALIGN_SLACK)?;
            // The tile operands start on cache lines (`line_slack`).
            let slack32 = line_slack::<u32>();
            grow(&mut self.amx_q, br32 * dk / 2 + slack32)?;
            grow(&mut self.amx_k, bc32 * dk + line_slack::<u16>())?;
            grow(&mut self.amx_v, v_parts * dv32 * bc32 / 2 + slack32)?;
            grow(&mut self.amx_p, 2 * bc32 * 16 + slack32)?;
            grow(&mut self.amx_pairs, amx_pair_dwords(d, dv, bc32, kind))?;
        }
        Ok(())
    }

    /// Reserves the buffers the streaming decode kernel (`decode_stream`) asks for: Q, O and
    /// score rows of its largest item, one natural-order row, states, two tiles' K/V
    /// offsets, and the AMX `Q·Kᵀ`'s tile buffers when it runs.
    pub(crate) fn try_reserve_stream(
        &mut self,
        lens: StreamLens,
    ) -> Result<(), std::collections::TryReserveError> {
        fn grow<E>(buf: &mut Vec<E>, len: usize) -> Result<(), std::collections::TryReserveError> {
            buf.try_reserve_exact(len.saturating_sub(buf.len()))
        }
        let rows = lens.rows;
        grow(&mut self.qt, rows * lens.d_pad + ALIGN_SLACK)?;
        grow(&mut self.ot, rows * lens.dv_pad + ALIGN_SLACK)?;
        grow(&mut self.st, rows * TILE_KEYS + ALIGN_SLACK)?;
        grow(&mut self.row, lens.d_pad.max(lens.dv_pad) + ALIGN_SLACK)?;
        grow(&mut self.states, rows)?;
        grow(&mut self.kv_offsets, 4 * TILE_KEYS)?;
        if lens.amx_q > 0 {
            // On cache lines (`ensure_on_line`).
            grow(&mut self.amx_q, lens.amx_q + line_slack::<u32>())?;
            grow(
                &mut self.amx_pairs,
                lens.amx_pair_dwords() + line_slack::<u32>(),
            )?;
            grow(&mut self.kt, StreamLens::AMX_C_FLOATS + ALIGN_SLACK)?;
        }
        Ok(())
    }

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
            + self.kv_offsets.capacity() * std::mem::size_of::<usize>()
            + 2 * self.amx_k.capacity()
            + 4 * (self.amx_q.capacity()
                + self.amx_v.capacity()
                + self.amx_p.capacity()
                + self.amx_pairs.capacity())
    }
}

/// Floats of slack per vector buffer, so that its slice can start on a cache line.
const ALIGN_SLACK: usize = line_slack::<f32>();

/// Like [`ensure`], but the returned `len` floats start on a 64-byte boundary (the buffer
/// keeps [`ALIGN_SLACK`] floats of slack). The panels of `Qᵀ`, `Oᵀ` and the scores are whole
/// cache lines (`W·NR` floats, 64 or 192 bytes), so from an aligned start no vector load or
/// store of the micro-kernels crosses a line; from the allocator's 16-byte-aligned start,
/// every 64-byte AVX-512 access and every other 32-byte AVX2 access did. The contents are
/// unspecified (callers write before they read), and only speed depends on the alignment.
pub(crate) fn ensure_aligned(buf: &mut Vec<f32>, len: usize) -> &mut [f32] {
    ensure_on_line(buf, len)
}

/// Grows `buf` to at least `len` elements (never shrinks) and returns the first `len`.
pub(crate) fn ensure<E: Copy>(buf: &mut Vec<E>, len: usize, fill: E) -> &mut [E] {
    if buf.len() < len {
        // Exactly what is asked: `resize` alone may double the capacity when a later task
        // needs a little more, past what `scratch_elems` promises.
        buf.reserve_exact(len - buf.len());
        buf.resize(len, fill);
    }
    &mut buf[..len]
}

/// A reusable buffer whose elements start on a cache line: AMX tile rows of 64 bytes then
/// read or write one line each (a misaligned `tileloadd` ran ~3× slower in a loop on the
/// development VM, amx4). A `Vec` with [`line_slack`] elements of slack and the offset of its
/// first aligned element ([`line_offset`], the rule of [`ensure_on_line`]); it dereferences to
/// the aligned `len` elements.
#[derive(Debug, Default)]
pub(crate) struct LineBuf<E> {
    buf: Vec<E>,
    offset: usize,
    len: usize,
}

impl<E: Copy + Default> LineBuf<E> {
    /// Grows the view to at least `len` elements, failing instead of aborting when memory
    /// runs out. A view that grows is all zeros again (as a fresh buffer would be).
    pub(crate) fn try_grow(&mut self, len: usize) -> Result<(), std::collections::TryReserveError> {
        if self.len >= len {
            return Ok(());
        }
        let want = len + line_slack::<E>();
        if self.buf.len() < want {
            self.buf.try_reserve_exact(want - self.buf.len())?;
        }
        self.buf.clear();
        self.buf.resize(want, E::default());
        self.offset = line_offset(self.buf.as_ptr());
        self.len = len;
        Ok(())
    }

    /// Elements allocated (the view, the slack and any spare capacity).
    pub(crate) fn capacity(&self) -> usize {
        self.buf.capacity()
    }
}

impl<E> LineBuf<E> {
    /// Bytes a fresh buffer allocates for a view of `len` elements: the view and
    /// [`line_slack`] elements (saturating: an absurd size fails to allocate). The
    /// reserved-size companion of [`LineBuf::try_grow`].
    pub(crate) const fn bytes_for(len: usize) -> usize {
        len.saturating_add(line_slack::<E>())
            .saturating_mul(std::mem::size_of::<E>())
    }
}

impl<E> std::ops::Deref for LineBuf<E> {
    type Target = [E];
    fn deref(&self) -> &[E] {
        &self.buf[self.offset..self.offset + self.len]
    }
}

impl<E> std::ops::DerefMut for LineBuf<E> {
    fn deref_mut(&mut self) -> &mut [E] {
        &mut self.buf[self.offset..self.offset + self.len]
    }
}

/// Elements of slack a buffer of `E` holds so that its slice can start on a cache
/// line ([`ensure_on_line`]; `Scratch::try_reserve` reserves them).
pub(crate) const fn line_slack<E>() -> usize {
    CACHE_LINE / std::mem::size_of::<E>()
}

/// The index of the first element at or after `start` that lies on a cache line, at most
/// [`line_slack`] (where no element can be aligned, as for an `E` whose size does not divide a
/// line, the view starts at `line_slack` and only speed suffers): where the view of a buffer of
/// `len` + [`line_slack`] elements starts ([`ensure_on_line`], [`LineBuf`]).
fn line_offset<E>(start: *const E) -> usize {
    start.align_offset(CACHE_LINE).min(line_slack::<E>())
}

/// `buf` grown to `len` + [`line_slack`] elements (zeros), and `len` of them starting on
/// a cache line (nothing grown for `len` 0).
pub(crate) fn ensure_on_line<E: Copy + Default>(buf: &mut Vec<E>, len: usize) -> &mut [E] {
    // An empty view needs no line: asking for none (a buffer a variant does not use) must not
    // grow the buffer past what the plan reserved.
    if len == 0 {
        return &mut buf[..0];
    }
    let whole = ensure(buf, len + line_slack::<E>(), E::default());
    let offset = line_offset(whole.as_ptr());
    &mut whole[offset..offset + len]
}

#[cfg(feature = "internal-tests")]
#[allow(missing_docs)]
pub mod tests {
    use super::*;

    /// Both users of [`line_offset`] give views on a cache line, of the asked length, at every
    /// element size they are used with; a view that grows keeps the rule.
    pub fn line_views_start_on_a_cache_line() {
        fn check<E: Copy + Default + std::fmt::Debug>() {
            let mut line = LineBuf::<E>::default();
            let mut plain = Vec::<E>::new();
            for len in [1, 3, 17, 64, 1000, 4099] {
                line.try_grow(len).expect("small");
                assert_eq!(line.len(), len);
                assert_eq!(line.as_ptr() as usize % CACHE_LINE, 0, "LineBuf, {len}");
                assert!(line.capacity() >= len + line_slack::<E>());
                let view = ensure_on_line(&mut plain, len);
                assert_eq!(view.len(), len);
                assert_eq!(
                    view.as_ptr() as usize % CACHE_LINE,
                    0,
                    "ensure_on_line, {len}"
                );
            }
        }
        check::<u16>();
        check::<u32>();
        check::<f32>();
    }
}
