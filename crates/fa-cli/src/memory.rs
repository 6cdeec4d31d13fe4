//! Sizes checked before allocating: a request larger than the machine gets a typed
//! [`CliError::TooLarge`] instead of an allocation abort.
//!
//! The checks are fa-io's ([`fa_io::memory`]: checked arithmetic, `MemAvailable` of
//! `/proc/meminfo` on Linux, `try_reserve_exact`); this module gives them the command's error
//! type.

use crate::error::CliError;

pub use fa_io::memory::{available_bytes, checked_bytes, checked_product};

/// `Err(TooLarge)` when `needed` bytes (`None`: the size overflowed) exceed what the machine
/// has available.
pub fn ensure_fits(what: &str, needed: Option<u128>) -> Result<(), CliError> {
    Ok(fa_io::memory::ensure_fits(what, needed)?)
}

/// An empty vector with room for `n` elements, or `TooLarge` when the allocation is refused.
pub fn try_with_capacity<T>(n: usize, what: &str) -> Result<Vec<T>, CliError> {
    Ok(fa_io::memory::try_with_capacity(n, what)?)
}

/// `n` copies of `value`, allocated fallibly (see [`try_with_capacity`]).
pub fn try_filled<T: Clone>(n: usize, value: T, what: &str) -> Result<Vec<T>, CliError> {
    Ok(fa_io::memory::try_filled(n, value, what)?)
}
