//! The one dispatch point, `pulp`-style: the SIMD level is resolved and checked once per call
//! ([`Isa::new`]), then each piece of work — anything that implements [`SimdTask`] — is
//! handed to [`dispatch`], which enters the chosen architecture's `#[target_feature]`
//! trampoline ([`Entry::enter`]) and runs the task's generic body there, so the body (marked
//! `#[inline(always)]`) is compiled with that architecture's instructions.
//!
//! A new pass (backward, decode) implements [`SimdTask`] and calls [`dispatch`]: no new
//! `match` over levels, no new trampoline. A new architecture implements
//! [`crate::arch::Simd`] and [`Arch`] (in `arch/`), [`Entry`] here, and gets one arm in
//! [`with_arch`], the only `match` over levels.

#[cfg(target_arch = "x86_64")]
use crate::arch::{avx2::Avx2, avx512::Avx512};
use crate::arch::{scalar::Scalar, Arch, SimdLevel};

/// A SIMD level this CPU has (never `Auto`): made only by [`Isa::new`], which checks, so
/// holding one is what makes [`dispatch`] safe.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Isa(SimdLevel);

impl Isa {
    /// `level` resolved (`Auto`: the detected level), if this CPU can run it.
    pub fn new(level: SimdLevel) -> Option<Isa> {
        let level = level.resolve();
        level.is_available().then_some(Isa(level))
    }

    /// The level.
    pub fn level(self) -> SimdLevel {
        self.0
    }
}

/// Work written once over the architecture and run through [`dispatch`] (a task of the
/// forward pass; the kernels' slice wrappers in the twin tests).
pub(crate) trait SimdTask {
    /// What the work returns.
    type Output;

    /// Runs the work with architecture `A`'s kernels. `QK`, `NR` and `PV` are
    /// `A::QK_KEYS`, `A::ROW_VECTORS` and `A::PV_CHANNELS` as const generics (the
    /// micro-kernels' register arrays need them as such, and stable Rust cannot take them
    /// from `A` inside a generic body); [`Entry::enter`] passes them. Mark it
    /// `#[inline(always)]`, so that it is compiled into the trampoline with its features.
    ///
    /// # Safety
    /// This CPU has `A`'s features, and the const generics are `A`'s (as [`dispatch`]
    /// guarantees).
    unsafe fn run<A: Arch, const QK: usize, const NR: usize, const PV: usize>(self)
        -> Self::Output;
}

/// An architecture's trampoline: the one function compiled with its features, which runs a
/// task's body.
pub(crate) trait Entry: Arch {
    /// Runs `task` with this architecture's features and kernel sizes.
    ///
    /// # Safety
    /// This CPU has the architecture's features.
    unsafe fn enter<T: SimdTask>(task: T) -> T::Output;
}

#[cfg(target_arch = "x86_64")]
impl Entry for Avx512 {
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn enter<T: SimdTask>(task: T) -> T::Output {
        // SAFETY: the features are present (caller); the const generics are this
        // architecture's sizes.
        unsafe {
            task.run::<Self, { Avx512::QK_KEYS }, { Avx512::ROW_VECTORS }, { Avx512::PV_CHANNELS }>(
            )
        }
    }
}

#[cfg(target_arch = "x86_64")]
impl Entry for Avx2 {
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn enter<T: SimdTask>(task: T) -> T::Output {
        // SAFETY: as for AVX-512.
        unsafe {
            task.run::<Self, { Avx2::QK_KEYS }, { Avx2::ROW_VECTORS }, { Avx2::PV_CHANNELS }>()
        }
    }
}

impl Entry for Scalar {
    unsafe fn enter<T: SimdTask>(task: T) -> T::Output {
        // SAFETY: the scalar path needs no CPU feature; the const generics are its sizes.
        unsafe {
            task.run::<Self, { Scalar::QK_KEYS }, { Scalar::ROW_VECTORS }, { Scalar::PV_CHANNELS }>(
            )
        }
    }
}

/// Something computed from an architecture's type alone ([`with_arch`]).
pub(crate) trait ArchFn {
    /// The result.
    type Output;
    /// Computes it for architecture `A`.
    fn call<A: Entry>(self) -> Self::Output;
}

/// Calls `f` with the architecture of `level` (`Auto`: the detected one; a level this target
/// has no code for: the scalar one). The only `match` over levels. It runs nothing of the
/// architecture by itself, so `level` may be one this CPU lacks (its tiling, say); code of the
/// architecture runs only through [`dispatch`].
pub(crate) fn with_arch<F: ArchFn>(level: SimdLevel, f: F) -> F::Output {
    match level.resolve() {
        // AMX runs its tile products itself; everything around them is AVX-512.
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx512f | SimdLevel::Amx => f.call::<Avx512>(),
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx2Fma => f.call::<Avx2>(),
        _ => f.call::<Scalar>(),
    }
}

/// Runs `task` on the architecture of `isa`, inside its `#[target_feature]` trampoline.
pub(crate) fn dispatch<T: SimdTask>(isa: Isa, task: T) -> T::Output {
    /// Enters the trampoline of the architecture [`with_arch`] picks. Made only below, from
    /// an [`Isa`]'s level.
    struct Enter<T>(T);
    impl<T: SimdTask> ArchFn for Enter<T> {
        type Output = T::Output;
        #[inline(always)]
        fn call<A: Entry>(self) -> T::Output {
            // SAFETY: `Enter` is only made in `dispatch`, for an `Isa`'s level, which `Isa::new`
            // checked this CPU has; `with_arch` maps that level to its own architecture.
            unsafe { A::enter(self.0) }
        }
    }
    with_arch(isa.level(), Enter(task))
}

/// The AVX-512 trampoline with AVX512-BF16 and AVX512-BW, so that the kernels' native bf16
/// instructions (`Simd::bf16_pairs_v::<true>`, `Simd::dot_bf16_pairs::<true>`) compile inline.
///
/// # Safety
/// This CPU has AVX-512F, AVX2, FMA, F16C, AVX512-BF16 and AVX512-BW.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2,fma,f16c")]
unsafe fn enter_bf16<T: SimdTask>(task: T) -> T::Output {
    // SAFETY: the features are present (caller); the const generics are AVX-512's.
    unsafe {
        task.run::<Avx512, { Avx512::QK_KEYS }, { Avx512::ROW_VECTORS }, { Avx512::PV_CHANNELS }>()
    }
}

/// [`dispatch`] for the AMX kernel on hardware tiles: at [`SimdLevel::Amx`], when AMX is
/// [`crate::arch::amx::available`] (which includes AVX512-BF16 and AVX512-BW), the AVX-512
/// task runs in a trampoline that also enables those two, so the kernel's bf16 conversion
/// (`Simd::bf16_pairs_v::<true>`) compiles inline; otherwise as [`dispatch`].
pub(crate) fn dispatch_amx<T: SimdTask>(isa: Isa, task: T) -> T::Output {
    #[cfg(target_arch = "x86_64")]
    if isa.level() == SimdLevel::Amx && crate::arch::amx::available() {
        // SAFETY: the level is Amx, which `Isa::new` checked this CPU runs (AVX-512F with
        // AVX2, FMA, F16C), and `available` checked AVX512-BF16 and AVX512-BW.
        return unsafe { enter_bf16(task) };
    }
    dispatch(isa, task)
}

/// [`dispatch`] for a task that uses the CPU's own bf16 instructions (the decode's
/// `vdpbf16ps` `Q·Kᵀ`): at the AVX-512 levels on a CPU with AVX512-BF16 and AVX512-BW
/// ([`crate::arch::has_avx512_bf16`]), the AVX-512 trampoline that enables them; otherwise
/// as [`dispatch`] (the task must then not ask for them).
pub(crate) fn dispatch_bf16<T: SimdTask>(isa: Isa, task: T) -> T::Output {
    #[cfg(target_arch = "x86_64")]
    if matches!(isa.level(), SimdLevel::Avx512f | SimdLevel::Amx) && crate::arch::has_avx512_bf16()
    {
        // SAFETY: the level is an AVX-512 one, which `Isa::new` checked this CPU runs
        // (AVX-512F with AVX2, FMA, F16C), and `has_avx512_bf16` checked AVX512-BF16 and
        // AVX512-BW.
        return unsafe { enter_bf16(task) };
    }
    dispatch(isa, task)
}
