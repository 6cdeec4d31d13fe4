//! Incoherent processing: the randomised Hadamard transform `M = H·diag(s)/√d`.
//!
//! `H` is the `d×d` Walsh–Hadamard matrix (Sylvester order, entries ±1, `H·H = d·I`) and `s`
//! a vector of random signs. As a map on a head vector `x` (a row of Q or K):
//! `x ↦ M·x = H·(s ∘ x)/√d` — the signs first, then the Hadamard, the order that spreads an
//! outlier of any input over all `d` entries (random signs after `H` would leave `H`'s fixed
//! worst cases in place). `M` is orthogonal (`MᵀM = diag(s)·H·H·diag(s)/d = I`), so applying
//! the same `M` to every row of Q and K leaves every score unchanged: `(M q)·(M k) = q·k`.
//! The inverse is `Mᵀ·y = s ∘ (H·y)/√d`.
//!
//! [`fwht`] is the in-place fast Walsh–Hadamard transform: `log2 d` passes of `d/2` add/subtract
//! butterflies (O(d log d)), then one multiply by `1/√d`.
//!
//! # Signs
//! The signs come from a tiny SplitMix64 generator written out here (not `rand`, and not the
//! test helper `fa_reference::Rng`): the stream is fixed by this documentation, so a GPU kernel
//! or another language reproduces `s` from the seed alone, and the library gains no dependency
//! whose stream may change between versions (`rand` makes no such promise for its `StdRng`).
//! Word `w` is the SplitMix64 output number `w + 1` from state `seed`; sign `i` is `−1` when
//! bit `i mod 64` of word `i / 64` is set. [`RandomHadamard::sign_bits`] hands those words to a
//! kernel.

use crate::error::Fp8Error;

/// Largest dimension the transform supports (the largest head dim).
pub const MAX_HADAMARD_DIM: usize = 256;

fn check_dim(dim: usize) -> Result<(), Fp8Error> {
    if dim == 0 || dim > MAX_HADAMARD_DIM || !dim.is_power_of_two() {
        return Err(Fp8Error::HadamardDim { dim });
    }
    Ok(())
}

/// In-place normalised fast Walsh–Hadamard transform of a vector of power-of-two length up to
/// 256: `x ← H·x/√d`. Its own inverse.
pub fn fwht(x: &mut [f32]) -> Result<(), Fp8Error> {
    check_dim(x.len())?;
    fwht_unchecked(x);
    scale(x, 1.0 / (x.len() as f32).sqrt());
    Ok(())
}

/// The butterflies, unnormalised (`x ← H·x`); `x.len()` is a power of two.
#[inline]
fn fwht_unchecked(x: &mut [f32]) {
    let n = x.len();
    let mut half = 1;
    while half < n {
        for block in x.chunks_exact_mut(2 * half) {
            let (lo, hi) = block.split_at_mut(half);
            for (a, b) in lo.iter_mut().zip(hi.iter_mut()) {
                let (u, v) = (*a, *b);
                *a = u + v;
                *b = u - v;
            }
        }
        half *= 2;
    }
}

#[inline]
fn scale(x: &mut [f32], factor: f32) {
    x.iter_mut().for_each(|v| *v *= factor);
}

/// One SplitMix64 step (Steele, Lea, Flood 2014): advances `state`, returns the next output.
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The randomised Hadamard transform `M = H·diag(s)/√d` of one head dimension.
#[derive(Clone, Debug, PartialEq)]
pub struct RandomHadamard {
    seed: u64,
    /// `s`, as ±1.0.
    signs: Vec<f32>,
    /// `s`, as bits (set = −1), 64 per word.
    sign_bits: Vec<u64>,
    /// `1/√d`.
    norm: f32,
}

impl RandomHadamard {
    /// The transform of dimension `dim` (a power of two up to 256) with signs drawn from
    /// `seed` (see the module doc for the stream).
    pub fn new(dim: usize, seed: u64) -> Result<Self, Fp8Error> {
        check_dim(dim)?;
        let mut state = seed;
        let sign_bits: Vec<u64> = (0..dim.div_ceil(64))
            .map(|_| splitmix64(&mut state))
            .collect();
        let signs = (0..dim)
            .map(|i| {
                if (sign_bits[i / 64] >> (i % 64)) & 1 == 1 {
                    -1.0
                } else {
                    1.0
                }
            })
            .collect();
        Ok(RandomHadamard {
            seed,
            signs,
            sign_bits,
            norm: 1.0 / (dim as f32).sqrt(),
        })
    }

    /// The dimension `d`.
    pub fn dim(&self) -> usize {
        self.signs.len()
    }

    /// The seed the signs came from.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The signs `s` as ±1.0.
    pub fn signs(&self) -> &[f32] {
        &self.signs
    }

    /// The signs as bit words (bit `i mod 64` of word `i/64` set means `s_i = −1`), the form
    /// a GPU kernel takes.
    pub fn sign_bits(&self) -> &[u64] {
        &self.sign_bits
    }

    /// `x ← M·x = H·(s ∘ x)/√d` on every consecutive `d`-vector of `rows` (its length must be
    /// a multiple of `d`).
    pub fn apply(&self, rows: &mut [f32]) -> Result<(), Fp8Error> {
        self.check_rows(rows.len())?;
        for x in rows.chunks_exact_mut(self.dim()) {
            self.apply_one(x);
        }
        Ok(())
    }

    /// `y ← Mᵀ·y = s ∘ (H·y)/√d` on every consecutive `d`-vector (the inverse of
    /// [`RandomHadamard::apply`]).
    pub fn invert(&self, rows: &mut [f32]) -> Result<(), Fp8Error> {
        self.check_rows(rows.len())?;
        for y in rows.chunks_exact_mut(self.dim()) {
            fwht_unchecked(y);
            for (v, &s) in y.iter_mut().zip(&self.signs) {
                *v *= s * self.norm;
            }
        }
        Ok(())
    }

    /// `M·x` of one vector of exactly `d` elements (the caller checked the length).
    #[inline]
    pub(crate) fn apply_one(&self, x: &mut [f32]) {
        for (v, &s) in x.iter_mut().zip(&self.signs) {
            *v *= s;
        }
        fwht_unchecked(x);
        scale(x, self.norm);
    }

    fn check_rows(&self, len: usize) -> Result<(), Fp8Error> {
        if !len.is_multiple_of(self.dim()) {
            return Err(Fp8Error::LengthMismatch {
                what: "hadamard rows",
                expected: len.next_multiple_of(self.dim()),
                got: len,
            });
        }
        Ok(())
    }
}
