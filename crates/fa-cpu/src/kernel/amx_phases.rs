//! Time per phase of the AMX forward ([`super::amx_task`]), summed over every worker (feature
//! `phase-timing`, off by default: a profiling aid, not part of the API's promises). A phase
//! is the time-stamp-counter ticks between two [`Lap`] marks, added to a process-wide
//! counter; `take_amx_forward_phases` converts them to seconds with the tasks' wall time
//! (measured alongside) and clears them. Without the feature [`Lap`] is empty and nothing is
//! counted.
//!
//! The time-stamp counter is read with `rdtsc` (about 10 ns, against `Instant`'s ~25 ns: a
//! panel's phases last 0.2–2 µs). Tile instructions complete asynchronously, but each phase
//! of the products ends with the tile stores that wait for them, so the split is the
//! instructions' real cost.

#[cfg(feature = "phase-timing")]
use std::sync::atomic::{AtomicU64, Ordering};

/// The phases counted, in the order of [`AMX_FORWARD_PHASE_NAMES`].
#[derive(Clone, Copy, Debug)]
#[allow(dead_code)]
pub(crate) enum AmxPhase {
    /// Q's rows of a task into the B-tile pair layout.
    PackQ,
    /// K and V of a key tile (bf16 copy, `Vᵀ` pairs), prefetch bookkeeping.
    PackKv,
    /// `Sᵀ = K·Qᵀ` on tiles, including the score tiles' stores: only a key tile's first
    /// panel (the pipeline's fill); the other panels' scores run inside `Softmax`.
    Scores,
    /// Scale/softcap, the mask, the online softmax fused with P's packing, and the tile work
    /// issued between its key pairs (the next panel's scores, the previous panel's products).
    Softmax,
    /// `Oᵀ *= corr` (the online softmax's correction).
    Rescale,
    /// `Oᵀ += Vᵀ·Pᵀ` on tiles, with the accumulator tiles' loads and stores: only a key
    /// tile's last panel (the pipeline's drain); the others run inside `Softmax`.
    Products,
    /// Writing O (and the LSE) out.
    Write,
    /// A whole task (the phases above plus what they leave out).
    Task,
}

/// The phases' names, in [`AmxPhase`]'s order.
#[cfg(feature = "phase-timing")]
pub const AMX_FORWARD_PHASE_NAMES: [&str; 8] = [
    "pack_q", "pack_kv", "S", "softmax", "rescale", "PV", "write", "task",
];

#[cfg(feature = "phase-timing")]
static TICKS: [AtomicU64; 8] = [const { AtomicU64::new(0) }; 8];
/// Wall nanoseconds of the tasks (the `Task` phase by `Instant`), to convert ticks.
#[cfg(feature = "phase-timing")]
static TASK_NANOS: AtomicU64 = AtomicU64::new(0);

/// The time-stamp counter (0 off x86_64).
#[cfg(feature = "phase-timing")]
#[inline(always)]
fn ticks() -> u64 {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `rdtsc` exists on every x86_64 CPU; it reads a counter and touches no memory.
    return unsafe { std::arch::x86_64::_rdtsc() };
    #[cfg(not(target_arch = "x86_64"))]
    0
}

/// A running mark: [`Lap::lap`] adds the ticks since the last mark to a phase.
pub(crate) struct Lap {
    #[cfg(feature = "phase-timing")]
    last: u64,
    #[cfg(feature = "phase-timing")]
    task_start: (u64, std::time::Instant),
}

impl Lap {
    /// A mark now (the start of a task).
    #[inline(always)]
    pub fn start() -> Lap {
        Lap {
            #[cfg(feature = "phase-timing")]
            last: ticks(),
            #[cfg(feature = "phase-timing")]
            task_start: (ticks(), std::time::Instant::now()),
        }
    }

    /// Adds the time since the last mark to `phase`; this is the new mark.
    #[inline(always)]
    pub fn lap(&mut self, phase: AmxPhase) {
        #[cfg(feature = "phase-timing")]
        {
            let now = ticks();
            TICKS[phase as usize].fetch_add(now.wrapping_sub(self.last), Ordering::Relaxed);
            self.last = now;
        }
        #[cfg(not(feature = "phase-timing"))]
        let _ = phase;
    }

    /// Ends the task: its ticks to [`AmxPhase::Task`], its wall time to the conversion.
    #[inline(always)]
    pub fn end_task(self) {
        #[cfg(feature = "phase-timing")]
        {
            let (t0, i0) = self.task_start;
            let nanos = i0.elapsed().as_nanos() as u64;
            TICKS[AmxPhase::Task as usize].fetch_add(ticks().wrapping_sub(t0), Ordering::Relaxed);
            TASK_NANOS.fetch_add(nanos, Ordering::Relaxed);
        }
    }
}

/// Seconds per phase since the last call (summed over workers), in
/// [`AMX_FORWARD_PHASE_NAMES`]' order, and clears the counters.
#[cfg(feature = "phase-timing")]
pub fn take_amx_forward_phases() -> [f64; 8] {
    let ticks: [u64; 8] = std::array::from_fn(|i| TICKS[i].swap(0, Ordering::Relaxed));
    let nanos = TASK_NANOS.swap(0, Ordering::Relaxed) as f64;
    let task = ticks[AmxPhase::Task as usize].max(1) as f64;
    ticks.map(|t| t as f64 / task * nanos * 1e-9)
}
