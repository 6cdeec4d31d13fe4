//! Mask rules: causal (bottom-right aligned) and sliding window, per element and per tile.
//!
//! Query `i` of a sequence with `seqlen_q` queries and `seqlen_k` keys sits at key position
//! `i' = i + seqlen_k − seqlen_q` (bottom-right alignment, as FlashAttention ≥ 2.1 and KV-cache
//! decode need). A window `(left, right)` lets it see keys `j` with `i' − left ≤ j ≤ i' + right`;
//! an unbounded side is `None`. Causal is the window `(None, Some(0))`; causal together with a
//! window intersects the two. The set of visible keys of a row is always one contiguous range,
//! which is what lets tiles be classified and skipped.

use core::ops::Range;

/// Which keys each query may attend to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Mask {
    /// How many keys before the aligned diagonal a query sees (`None`: unbounded).
    pub left: Option<usize>,
    /// How many keys after the aligned diagonal a query sees (`None`: unbounded).
    pub right: Option<usize>,
}

/// How a (query tile, key tile) pair relates to the mask.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TileKind {
    /// Every (query, key) pair of the tile is visible: no per-element masking needed.
    Full,
    /// Some pairs are visible and some are not: mask element by element.
    Partial,
    /// No pair is visible: the tile can be skipped.
    Empty,
}

impl Mask {
    /// No mask: every query sees every key.
    pub const NONE: Mask = Mask {
        left: None,
        right: None,
    };
    /// Causal, bottom-right aligned.
    pub const CAUSAL: Mask = Mask {
        left: None,
        right: Some(0),
    };

    /// Builds a mask from FlashAttention's conventions: `causal`, and a window `(left, right)`
    /// where a negative bound means unbounded. Causal and a window intersect. For values from
    /// a user (where only `-1` means unbounded and other negatives are errors), use
    /// [`crate::mask_from_flash`].
    pub fn from_flash_args(causal: bool, window_left: i64, window_right: i64) -> Mask {
        let left = usize::try_from(window_left).ok();
        let mut right = usize::try_from(window_right).ok();
        if causal {
            // A window's right bound is never negative, so the intersection is the diagonal.
            right = Some(0);
        }
        Mask { left, right }
    }

    /// Whether the mask restricts anything at all.
    pub fn is_none(&self) -> bool {
        self.left.is_none() && self.right.is_none()
    }

    /// Whether this mask is (at least) causal: no key after the aligned diagonal is visible.
    pub fn is_causal(&self) -> bool {
        self.right == Some(0)
    }

    /// Unclamped-to-empty bounds `[lo, hi)` of row `i`, clipped to `[0, seqlen_k]`; both are
    /// non-decreasing in `i`, which is what makes tile classification exact from two rows.
    fn bounds(&self, i: usize, seqlen_q: usize, seqlen_k: usize) -> (i128, i128) {
        // i128: huge lengths or windows cannot overflow.
        let aligned = i as i128 + seqlen_k as i128 - seqlen_q as i128;
        let lo = match self.left {
            Some(l) => (aligned - l as i128).max(0),
            None => 0,
        };
        let hi = match self.right {
            Some(r) => (aligned + r as i128 + 1).min(seqlen_k as i128),
            None => seqlen_k as i128,
        };
        (lo, hi)
    }

    /// The contiguous range of keys query `i` sees (possibly empty).
    pub fn key_range(&self, i: usize, seqlen_q: usize, seqlen_k: usize) -> Range<usize> {
        let (lo, hi) = self.bounds(i, seqlen_q, seqlen_k);
        if hi <= lo {
            return 0..0;
        }
        lo as usize..hi as usize
    }

    /// Whether query `i` sees key `j`.
    pub fn allows(&self, i: usize, j: usize, seqlen_q: usize, seqlen_k: usize) -> bool {
        self.key_range(i, seqlen_q, seqlen_k).contains(&j)
    }

    /// The keys seen by at least one query of `rows`: one contiguous range, because the
    /// aligned position grows by one per row and every window is at least one key wide.
    pub fn union_key_range(
        &self,
        rows: Range<usize>,
        seqlen_q: usize,
        seqlen_k: usize,
    ) -> Range<usize> {
        if rows.is_empty() {
            return 0..0;
        }
        let (lo, _) = self.bounds(rows.start, seqlen_q, seqlen_k);
        let (_, hi) = self.bounds(rows.end - 1, seqlen_q, seqlen_k);
        if hi <= lo {
            return 0..0;
        }
        lo as usize..hi as usize
    }

    /// Classifies the tile of queries `rows` × keys `cols` as full, partial or empty.
    ///
    /// Both ends of a row's visible range are non-decreasing in the row, so the first and
    /// last rows decide: the tile is full when the last row's start and the first row's end
    /// enclose `cols`, empty when `cols` misses the union of the rows' ranges.
    pub fn classify_tile(
        &self,
        rows: Range<usize>,
        cols: Range<usize>,
        seqlen_q: usize,
        seqlen_k: usize,
    ) -> TileKind {
        if rows.is_empty() || cols.is_empty() {
            return TileKind::Empty;
        }
        let union = self.union_key_range(rows.clone(), seqlen_q, seqlen_k);
        if cols.end <= union.start || cols.start >= union.end {
            return TileKind::Empty;
        }
        let (_, first_hi) = self.bounds(rows.start, seqlen_q, seqlen_k);
        let (last_lo, _) = self.bounds(rows.end - 1, seqlen_q, seqlen_k);
        if last_lo <= cols.start as i128 && first_hi >= cols.end as i128 {
            TileKind::Full
        } else {
            TileKind::Partial
        }
    }

    /// The range of key tiles (of `block_k` keys each) that the query tile `rows` must visit;
    /// tiles outside it are empty and skipped. Empty when no row sees any key.
    pub fn key_tile_range(
        &self,
        rows: Range<usize>,
        block_k: usize,
        seqlen_q: usize,
        seqlen_k: usize,
    ) -> Range<usize> {
        if block_k == 0 {
            return 0..0;
        }
        let union = self.union_key_range(rows, seqlen_q, seqlen_k);
        if union.is_empty() {
            return 0..0;
        }
        union.start / block_k..union.end.div_ceil(block_k)
    }
}
