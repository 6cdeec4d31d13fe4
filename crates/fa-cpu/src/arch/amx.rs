//! Intel AMX: detection, Linux's tile-data permission, and the few tile operations the bf16
//! forward uses ([`Tiles`]), in two implementations: the hardware ([`HwTiles`], `asm!`) and,
//! for tests, a software emulation of exactly the same operations ([`EmuTiles`]), so the
//! packing and the driver logic are tested on any CPU and the hardware is tested against the
//! emulation where it exists.
//!
//! One tile configuration serves everything ([`TILE_ROWS`] × [`TILE_ROW_BYTES`] for all eight
//! tiles): a C tile holds 16 × 16 f32, an A tile 16 rows of 32 bf16, a B tile 16 rows of 16
//! bf16 pairs (the "VNNI" layout: `B[k][2n + e]` multiplies `A[m][2k + e]`).
//!
//! `tdpbf16ps` semantics (Intel ISA reference): for each `C[m][n]`, for `k` in order, two
//! fused multiply-adds `C += A[m][2k]·B[k][2n]`, then `C += A[m][2k+1]·B[k][2n+1]`, each
//! rounded to nearest even; bf16 input denormals are read as zero, f32 output denormals are
//! flushed to zero; MXCSR is neither read nor written. A bf16 × bf16 product is exact in f32,
//! so the emulation's `acc + a·b` in f32 is that fused step.

use std::sync::OnceLock;

/// Rows of every tile in the one configuration.
pub(crate) const TILE_ROWS: usize = 16;
/// Bytes per tile row (16 f32, 32 bf16, 16 bf16 pairs).
pub(crate) const TILE_ROW_BYTES: usize = 64;
/// Whether this CPU has AMX-TILE and AMX-BF16 (with AVX-512F, AVX512-BW and AVX512-BF16,
/// which the kernel around the tiles uses), the OS enables the tile state, and Linux
/// granted this process the tile-data permission (asked once, on the first call).
pub(crate) fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(detect_and_request)
}

#[cfg(target_arch = "x86_64")]
fn detect_and_request() -> bool {
    use std::arch::x86_64::__cpuid_count;
    #[allow(unused_unsafe)]
    // SAFETY: CPUID exists on every x86_64 CPU; reading leaves 0, 1 and 7 has no effect.
    let (max_leaf, leaf1, leaf7) = unsafe {
        (
            __cpuid_count(0, 0).eax,
            __cpuid_count(1, 0),
            __cpuid_count(7, 0),
        )
    };
    if max_leaf < 7 {
        return false;
    }
    let amx_bf16 = leaf7.edx & (1 << 22) != 0;
    let amx_tile = leaf7.edx & (1 << 24) != 0;
    let osxsave = leaf1.ecx & (1 << 27) != 0;
    // The kernel around the tiles converts P with AVX512-BF16 and permutes words with
    // AVX512-BW (every AMX-BF16 CPU so far has both; one without them runs without AMX).
    let avx512 = leaf7.ebx & (1 << 16) != 0 && leaf7.ebx & (1 << 30) != 0;
    // SAFETY: as above (leaf 7 exists: max_leaf ≥ 7).
    #[allow(unused_unsafe)]
    let avx512_bf16 = unsafe { __cpuid_count(7, 1) }.eax & (1 << 5) != 0;
    if !(amx_bf16 && amx_tile && osxsave && avx512 && avx512_bf16) {
        return false;
    }
    let (lo, _hi): (u32, u32);
    // SAFETY: XGETBV with ECX = 0 reads XCR0; it exists because CPUID reported OSXSAVE
    // (checked above). It touches no memory.
    unsafe {
        std::arch::asm!("xgetbv", in("ecx") 0u32, out("eax") lo, out("edx") _hi,
            options(nomem, nostack, preserves_flags));
    }
    // XCR0 bits 17 (XTILECFG) and 18 (XTILEDATA): the OS saves and restores the tile state.
    if lo & (0b11 << 17) != 0b11 << 17 {
        return false;
    }
    request_tile_permission()
}

#[cfg(not(target_arch = "x86_64"))]
fn detect_and_request() -> bool {
    false
}

/// Asks Linux for this process's permission to use the AMX tile data
/// (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`); `true` when granted. Other
/// operating systems: `false` (not tried).
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn request_tile_permission() -> bool {
    /// `arch_prctl`'s system call number on x86_64.
    const SYS_ARCH_PRCTL: u64 = 158;
    /// `ARCH_REQ_XCOMP_PERM`.
    const ARCH_REQ_XCOMP_PERM: u64 = 0x1023;
    /// `XFEATURE_XTILEDATA`.
    const XFEATURE_XTILEDATA: u64 = 18;
    let ret: i64;
    // SAFETY: a plain Linux system call with two integer arguments and no pointers; the
    // kernel clobbers rcx and r11 (declared) and returns in rax. The request only widens
    // which xstate components this process may use; it changes no memory of ours.
    unsafe {
        std::arch::asm!(
            "syscall",
            inlateout("rax") SYS_ARCH_PRCTL as i64 => ret,
            in("rdi") ARCH_REQ_XCOMP_PERM,
            in("rsi") XFEATURE_XTILEDATA,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    ret == 0
}

#[cfg(all(target_arch = "x86_64", not(target_os = "linux")))]
fn request_tile_permission() -> bool {
    false
}

/// The tile operations of the bf16 forward, on tiles `0..8` of the one configuration
/// (`TILE_ROWS` × `TILE_ROW_BYTES` each). Generic over the tile numbers so the hardware
/// version encodes them in the instruction.
///
/// # Safety
/// Implementors execute the operations exactly as described (the kernels' results depend on
/// it). Callers: every pointer is valid for `TILE_ROWS` rows of `TILE_ROW_BYTES` bytes at
/// `stride` bytes apart (read for loads, written for stores); tile numbers are below 8.
pub(crate) unsafe trait Tiles {
    /// Whether these tiles run on the CPU's AMX (which implies AVX512-BF16 and AVX512-BW:
    /// [`available`]), so code around them may use those instructions.
    const HARDWARE: bool;
    /// Tile `T` ← 16 rows of 64 bytes from `src`, `stride` bytes apart.
    unsafe fn load<const T: u8>(&mut self, src: *const u8, stride: usize);
    /// 16 rows of 64 bytes at `dst`, `stride` bytes apart ← tile `T`.
    unsafe fn store<const T: u8>(&mut self, dst: *mut u8, stride: usize);
    /// Tile `T` ← zeros.
    fn zero<const T: u8>(&mut self);
    /// `C += A·B` as `tdpbf16ps`: `C` 16 × 16 f32, `A` 16 × 32 bf16, `B` 16 × 16 bf16 pairs.
    fn dot<const C: u8, const A: u8, const B: u8>(&mut self);
}

/// The 64-byte tile configuration (`ldtilecfg`'s operand): palette 1, all eight tiles
/// `TILE_ROWS` rows of `TILE_ROW_BYTES` bytes.
#[cfg(target_arch = "x86_64")]
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

#[cfg(target_arch = "x86_64")]
impl TileConfig {
    const fn all_tiles() -> TileConfig {
        let mut cfg = [0u8; 64];
        cfg[0] = 1; // palette 1
        let mut t = 0;
        while t < 8 {
            // colsb[t] (u16 little-endian at 16 + 2t), rows[t] (u8 at 48 + t).
            cfg[16 + 2 * t] = TILE_ROW_BYTES as u8;
            cfg[48 + t] = TILE_ROWS as u8;
            t += 1;
        }
        TileConfig(cfg)
    }
}

/// The hardware tiles of the current thread, configured: made by [`HwTiles::configure`]
/// (which checks [`available`] and loads the configuration), released when dropped. Not
/// `Send`: the configuration belongs to the thread that loaded it.
#[cfg(target_arch = "x86_64")]
pub(crate) struct HwTiles {
    _not_send: std::marker::PhantomData<*const ()>,
}

#[cfg(target_arch = "x86_64")]
impl HwTiles {
    /// Loads the one configuration on this thread; `None` when AMX is not [`available`].
    pub fn configure() -> Option<HwTiles> {
        if !available() {
            return None;
        }
        static CONFIG: TileConfig = TileConfig::all_tiles();
        // SAFETY: AMX-TILE is present and permitted (`available`); the operand is a valid
        // 64-byte palette-1 configuration (reserved bytes zero) that lives forever.
        unsafe {
            std::arch::asm!("ldtilecfg [{cfg}]", cfg = in(reg) CONFIG.0.as_ptr(),
                options(nostack, readonly, preserves_flags));
        }
        Some(HwTiles {
            _not_send: std::marker::PhantomData,
        })
    }
}

#[cfg(target_arch = "x86_64")]
impl Drop for HwTiles {
    fn drop(&mut self) {
        // SAFETY: this thread configured the tiles (`configure`); releasing them returns the
        // tile state to its initial (unused) state and touches no memory.
        unsafe { std::arch::asm!("tilerelease", options(nomem, nostack, preserves_flags)) };
    }
}

// SAFETY: each method is the single instruction its documentation names, on tiles that
// `configure` set to the one configuration; the caller's pointer contract is the
// instruction's memory footprint (16 rows of 64 bytes at `stride`).
#[cfg(target_arch = "x86_64")]
unsafe impl Tiles for HwTiles {
    const HARDWARE: bool = true;
    #[inline(always)]
    unsafe fn load<const T: u8>(&mut self, src: *const u8, stride: usize) {
        // SAFETY: tiles configured (self exists on this thread); 16 rows of 64 readable bytes
        // at `stride` (caller).
        unsafe {
            std::arch::asm!("tileloadd tmm{t}, [{src} + {stride}*1]", t = const T,
                src = in(reg) src, stride = in(reg) stride,
                options(nostack, readonly, preserves_flags));
        }
    }
    #[inline(always)]
    unsafe fn store<const T: u8>(&mut self, dst: *mut u8, stride: usize) {
        // SAFETY: tiles configured; 16 rows of 64 writable bytes at `stride` (caller).
        unsafe {
            std::arch::asm!("tilestored [{dst} + {stride}*1], tmm{t}", t = const T,
                dst = in(reg) dst, stride = in(reg) stride,
                options(nostack, preserves_flags));
        }
    }
    #[inline(always)]
    fn zero<const T: u8>(&mut self) {
        // SAFETY: tiles configured (self exists on this thread); no memory is touched.
        unsafe {
            std::arch::asm!("tilezero tmm{t}", t = const T,
                options(nomem, nostack, preserves_flags));
        }
    }
    #[inline(always)]
    fn dot<const C: u8, const A: u8, const B: u8>(&mut self) {
        // SAFETY: AMX-BF16 present and tiles configured (self exists on this thread); all
        // tiles have the shapes tdpbf16ps needs (C 16 × 64 B, A 16 × 64 B, B 16 × 64 B).
        unsafe {
            std::arch::asm!("tdpbf16ps tmm{c}, tmm{a}, tmm{b}", c = const C, a = const A,
                b = const B, options(nomem, nostack, preserves_flags));
        }
    }
}

/// Software tiles: eight 16 × 16-dword registers and the operations of [`Tiles`], exactly as
/// the instructions define them (the twin of [`HwTiles`]).
#[cfg(feature = "internal-tests")]
pub(crate) struct EmuTiles {
    regs: Box<[[u32; 256]; 8]>,
}

#[cfg(feature = "internal-tests")]
impl EmuTiles {
    /// Eight zero tiles.
    pub fn new() -> EmuTiles {
        EmuTiles {
            regs: Box::new([[0; 256]; 8]),
        }
    }
}

/// A bf16 (the low or high half of a dword) as f32, denormals read as zero.
#[cfg(feature = "internal-tests")]
fn bf16_daz(bits: u16) -> f32 {
    let x = f32::from_bits((bits as u32) << 16);
    if x.is_subnormal() {
        0.0f32.copysign(x)
    } else {
        x
    }
}

/// `x`, a subnormal flushed to zero (sign kept).
#[cfg(feature = "internal-tests")]
fn ftz(x: f32) -> f32 {
    if x.is_subnormal() {
        0.0f32.copysign(x)
    } else {
        x
    }
}

// SAFETY: the loads and stores copy exactly 16 rows of 64 bytes at `stride`; `dot` follows
// the instruction's definition (module docs).
#[cfg(feature = "internal-tests")]
unsafe impl Tiles for EmuTiles {
    const HARDWARE: bool = false;
    unsafe fn load<const T: u8>(&mut self, src: *const u8, stride: usize) {
        for r in 0..TILE_ROWS {
            for w in 0..16 {
                // SAFETY: 64 readable bytes at src + r·stride (caller); unaligned read.
                self.regs[T as usize][r * 16 + w] =
                    unsafe { (src.add(r * stride + 4 * w) as *const u32).read_unaligned() };
            }
        }
    }
    unsafe fn store<const T: u8>(&mut self, dst: *mut u8, stride: usize) {
        for r in 0..TILE_ROWS {
            for w in 0..16 {
                // SAFETY: 64 writable bytes at dst + r·stride (caller); unaligned write.
                unsafe {
                    (dst.add(r * stride + 4 * w) as *mut u32)
                        .write_unaligned(self.regs[T as usize][r * 16 + w])
                };
            }
        }
    }
    fn zero<const T: u8>(&mut self) {
        self.regs[T as usize] = [0; 256];
    }
    fn dot<const C: u8, const A: u8, const B: u8>(&mut self) {
        let (a, b) = (self.regs[A as usize], self.regs[B as usize]);
        let c = &mut self.regs[C as usize];
        for m in 0..16 {
            for n in 0..16 {
                let mut acc = f32::from_bits(c[m * 16 + n]);
                for k in 0..16 {
                    let (x, y) = (a[m * 16 + k], b[k * 16 + n]);
                    for half in 0..2 {
                        let (xs, ys) = ((x >> (16 * half)) as u16, (y >> (16 * half)) as u16);
                        acc = ftz(acc + bf16_daz(xs) * bf16_daz(ys));
                    }
                }
                c[m * 16 + n] = acc.to_bits();
            }
        }
    }
}
