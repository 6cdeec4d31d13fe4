//! Sizes checked before allocating: a request larger than the machine gets a typed
//! [`Error::TooLarge`] instead of an allocation abort.
//!
//! Sizes are computed with checked arithmetic; they are compared with `MemAvailable` of
//! `/proc/meminfo` on Linux (elsewhere that part of the check is skipped), and host buffers are
//! reserved with `try_reserve_exact`, so that an allocation the system refuses is an error too.

use crate::error::Error;

/// Bytes the system can still give this process (`MemAvailable` of `/proc/meminfo`), when known.
pub fn available_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// `Err(TooLarge)` when `needed` bytes (`None`: the size overflowed) exceed what the machine
/// has available.
pub fn ensure_fits(what: &str, needed: Option<u128>) -> Result<(), Error> {
    let too_large = |available| Error::TooLarge {
        what: what.to_string(),
        needed,
        available,
    };
    let needed = needed.ok_or_else(|| too_large(None))?;
    if needed > usize::MAX as u128 {
        return Err(too_large(available_bytes()));
    }
    match available_bytes() {
        Some(avail) if needed > avail as u128 => Err(too_large(Some(avail))),
        _ => Ok(()),
    }
}

/// The product of `dims` (an element count), `None` on overflow.
pub fn checked_product(dims: &[usize]) -> Option<usize> {
    dims.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))
}

/// `dims`' element count times `elem_size` bytes, `None` on overflow.
pub fn checked_bytes(dims: &[usize], elem_size: usize) -> Option<u128> {
    dims.iter()
        .try_fold(elem_size as u128, |acc, &d| acc.checked_mul(d as u128))
}

/// An empty vector with room for `n` elements, or `TooLarge` when the allocation is refused.
pub fn try_with_capacity<T>(n: usize, what: &str) -> Result<Vec<T>, Error> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| Error::TooLarge {
        what: what.to_string(),
        needed: (n as u128).checked_mul(core::mem::size_of::<T>() as u128),
        available: available_bytes(),
    })?;
    Ok(v)
}

/// `n` copies of `value`, allocated fallibly (see [`try_with_capacity`]).
pub fn try_filled<T: Clone>(n: usize, value: T, what: &str) -> Result<Vec<T>, Error> {
    let mut v = try_with_capacity(n, what)?;
    v.resize(n, value);
    Ok(v)
}

/// `bytes` in binary units: an exact multiple prints without decimals (`40 GiB`).
pub fn human_bytes(bytes: u128) -> String {
    const UNITS: [&str; 7] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut unit = 0;
    let mut div = 1u128;
    while unit + 1 < UNITS.len() && bytes >= div * 1024 {
        div *= 1024;
        unit += 1;
    }
    if bytes.is_multiple_of(div) {
        format!("{} {}", bytes / div, UNITS[unit])
    } else {
        format!("{:.2} {}", bytes as f64 / div as f64, UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overflow_and_refused_allocations_are_errors() {
        assert_eq!(checked_product(&[usize::MAX, 2]), None);
        assert_eq!(checked_bytes(&[3, 5], 4), Some(60));
        let e = ensure_fits("test buffer", None).unwrap_err();
        assert!(e.to_string().contains("too large"), "{e}");
        let e = ensure_fits("test buffer", Some(u128::MAX)).unwrap_err();
        assert!(e.to_string().contains("too large for this machine"), "{e}");
        assert!(try_filled(usize::MAX / 2, 0u64, "huge").is_err());
        assert_eq!(try_filled(3, 1u8, "small").unwrap(), vec![1, 1, 1]);
    }

    #[test]
    fn byte_formatting() {
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(1023), "1023 B");
        assert_eq!(human_bytes(1536), "1.50 KiB");
    }
}
