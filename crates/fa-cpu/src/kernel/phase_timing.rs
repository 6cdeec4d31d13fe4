//! Wall time per phase of the backward pass, summed over every worker (feature
//! `phase-timing`, off by default: a profiling aid, not part of the API's promises). Each
//! phase adds the nanoseconds between two [`std::time::Instant`]s to a process-wide counter;
//! `take_backward_phases` reads and clears them. Without the feature the
//! [`timed`] macro is the plain expression and nothing is counted.

#[cfg(feature = "phase-timing")]
use std::sync::atomic::{AtomicU64, Ordering};

/// The phases counted, in the order of `PHASE_NAMES`.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Phase {
    /// Q and dO rows of a task: widening, padding, transposes, `D`, `lse·log2 e`.
    PackRows,
    /// K and V of a key block: widening, padding, transposes.
    PackKeys,
    /// `S = Q·Kᵀ`.
    S,
    /// `dP = dO·Vᵀ`.
    DP,
    /// `P` and `dS` (the element-wise step).
    Probs,
    /// `dV += Pᵀ·dO`.
    DV,
    /// `dK += dSᵀ·Q`.
    DK,
    /// `dSᵀ` (the transpose dQ's product reads).
    DsT,
    /// `dQ += dS·K`.
    DQ,
    /// Writing dK, dV and dQ out.
    Write,
    /// A whole task (the phases above plus what they leave out).
    Task,
}

/// The phases' names, in [`Phase`]'s order.
#[cfg(feature = "phase-timing")]
pub const PHASE_NAMES: [&str; 11] = [
    "pack_rows",
    "pack_keys",
    "S",
    "dP",
    "probs",
    "dV",
    "dK",
    "dS_T",
    "dQ",
    "write",
    "task",
];

#[cfg(feature = "phase-timing")]
static NANOS: [AtomicU64; 11] = [const { AtomicU64::new(0) }; 11];

/// `timed!(phase, expr)`: evaluates `expr`, adding its wall time to `phase` when the feature
/// is on. A macro, not a function taking a closure: a closure body would not inherit the
/// caller's `target_feature`s, and the SIMD code inside it would stop being inlined.
macro_rules! timed {
    ($phase:expr, $body:expr) => {{
        #[cfg(feature = "phase-timing")]
        let start = std::time::Instant::now();
        let r = $body;
        #[cfg(feature = "phase-timing")]
        $crate::kernel::phase_timing::add($phase, start.elapsed());
        #[cfg(not(feature = "phase-timing"))]
        let _ = $phase;
        r
    }};
}
pub(crate) use timed;

/// Adds `elapsed` to `phase`'s counter.
#[cfg(feature = "phase-timing")]
pub(crate) fn add(phase: Phase, elapsed: std::time::Duration) {
    NANOS[phase as usize].fetch_add(elapsed.as_nanos() as u64, Ordering::Relaxed);
}

/// Seconds per phase since the last call (summed over workers), in [`PHASE_NAMES`]' order,
/// and clears the counters.
#[cfg(feature = "phase-timing")]
pub fn take_backward_phases() -> [f64; 11] {
    let mut out = [0.0; 11];
    for (o, n) in out.iter_mut().zip(&NANOS) {
        *o = n.swap(0, Ordering::Relaxed) as f64 * 1e-9;
    }
    out
}
