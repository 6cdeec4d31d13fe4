//! NVRTC: compiling any kernel family's variant to a cubin for one architecture, reading ptxas'
//! resource report (registers, spills, stack), the per-process cache of compiled variants, the
//! disk cache ([`DiskCache`]) behind it, and [`precompile`], which fills the disk cache without
//! a GPU.

pub use crate::cache::{CacheKey, DiskCache};
use crate::error::CudaError;
use crate::kernels::{ForwardVariant, KernelFamily, KernelVariant, Variant};
use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys};
use std::any::Any;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, CStr, CString};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

/// Whether `libnvrtc` can be loaded. `cudarc` panics on the first NVRTC call when it cannot,
/// so every compilation checks this first.
pub fn nvrtc_available() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: `is_culib_present` only tries `dlopen` on the candidate library names.
    *PRESENT.get_or_init(|| unsafe { nvrtc_sys::is_culib_present() })
}

/// ptxas' resource report of one compiled kernel.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ResourceUsage {
    /// Registers per thread.
    pub registers: u32,
    /// Bytes of stack frame per thread.
    pub stack_frame: u32,
    /// Bytes spilled to local memory (stores).
    pub spill_stores: u32,
    /// Bytes re-loaded from local memory.
    pub spill_loads: u32,
}

impl ResourceUsage {
    /// Parses ptxas' `-v` info lines from an NVRTC log (the last report in it).
    pub fn parse(log: &str) -> Option<ResourceUsage> {
        let mut usage = None;
        let number_before = |line: &str, key: &str| -> Option<u32> {
            let at = line.find(key)?;
            line[..at].split_whitespace().last()?.parse().ok()
        };
        let mut current = ResourceUsage::default();
        for line in log.lines() {
            if line.contains("bytes stack frame") {
                current.stack_frame = number_before(line, "bytes stack frame").unwrap_or(0);
                current.spill_stores = number_before(line, "bytes spill stores").unwrap_or(0);
                current.spill_loads = number_before(line, "bytes spill loads").unwrap_or(0);
            }
            if line.contains("Used") && line.contains("registers") {
                let after = &line[line.find("Used").map_or(0, |i| i + 4)..];
                current.registers = after
                    .split_whitespace()
                    .next()
                    .and_then(|n| n.parse().ok())
                    .unwrap_or(0);
                usage = Some(current);
            }
        }
        usage
    }

    /// Whether anything went to local memory.
    pub fn spills(&self) -> bool {
        self.spill_stores > 0 || self.spill_loads > 0
    }
}

/// A variant compiled to machine code for one architecture.
#[derive(Clone, Debug)]
pub struct Compiled<V = Variant> {
    /// The variant.
    pub variant: V,
    /// The architecture, e.g. `sm_90a`.
    pub arch: String,
    /// The cubin.
    pub cubin: Vec<u8>,
    /// NVRTC's log (ptxas' info lines included); empty when the cubin came from the disk cache.
    pub log: String,
    /// Resource usage read off the log (stored with the cubin in the disk cache).
    pub usage: ResourceUsage,
    /// Wall time of the compilation in milliseconds (0 for a disk-cache hit).
    pub compile_ms: f64,
}

/// Where a call's kernel came from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KernelOrigin {
    /// NVRTC compiled it in this call, taking `ms` milliseconds.
    Compiled {
        /// Compile time in milliseconds.
        ms: f64,
    },
    /// Loaded from the disk cache (compiled by an earlier process or [`precompile`]).
    DiskCache,
    /// Already compiled (or loaded) in this process.
    ProcessCache,
}

/// Owns an NVRTC program and destroys it on drop.
struct Program(nvrtc_sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the program was created by `nvrtcCreateProgram` and is destroyed only here.
        let _ = unsafe { nvrtc::destroy_program(self.0) };
    }
}

fn log_of(prog: &Program) -> String {
    // SAFETY: `prog` is a live program; the log is NUL-terminated by NVRTC.
    match unsafe { nvrtc::get_program_log(prog.0) } {
        Ok(raw) => {
            let bytes: Vec<u8> = raw.iter().map(|&c| c as u8).collect();
            CStr::from_bytes_until_nul(&bytes)
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default()
        }
        Err(e) => format!("(no log: {e:?})"),
    }
}

/// NVRTC's version (major, minor), part of every cache key.
pub fn nvrtc_version() -> Result<(i32, i32), CudaError> {
    if !nvrtc_available() {
        return Err(CudaError::NoNvrtc);
    }
    static VERSION: OnceLock<(i32, i32, nvrtc_sys::nvrtcResult)> = OnceLock::new();
    let &(major, minor, rc) = VERSION.get_or_init(|| {
        let (mut major, mut minor) = (0 as c_int, 0 as c_int);
        // SAFETY: NVRTC is loadable (checked above); both pointers are valid for one write.
        let rc = unsafe { nvrtc_sys::nvrtcVersion(&mut major, &mut minor) };
        (major, minor, rc)
    });
    if rc != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(CudaError::Compile {
            variant: "(none)".into(),
            log: format!("nvrtcVersion: {rc:?}"),
        });
    }
    Ok((major, minor))
}

/// The options every compilation gets besides the variant's defines and the caller's extras.
fn base_options(arch: &str) -> [String; 5] {
    [
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_string(),
        "--ptxas-options=-v".to_string(),
        "--fmad=true".to_string(),
        // The sources have no host code; this makes their local lambdas device functions.
        "-default-device".to_string(),
    ]
}

/// All NVRTC options of one compilation.
fn options_of<V: KernelVariant>(variant: &V, arch: &str, extra_options: &[String]) -> Vec<String> {
    let mut options = variant.defines();
    options.extend(base_options(arch));
    options.extend(extra_options.iter().cloned());
    options
}

/// The disk-cache key of `variant` for `arch`: the family's sources and headers, the options,
/// the entry point, the architecture, the NVRTC version and this crate's version.
pub fn cache_key<V: KernelVariant>(
    variant: &V,
    arch: &str,
    extra_options: &[String],
) -> Result<CacheKey, CudaError> {
    let (major, minor) = nvrtc_version()?;
    let family = variant.family();
    let mut h = crate::cache::Fnv64::new();
    h.field(b"fa-cuda cubin")
        .field(env!("CARGO_PKG_VERSION").as_bytes())
        .field(&major.to_le_bytes())
        .field(&minor.to_le_bytes())
        .field(family.name.as_bytes())
        .field(family.main.name.as_bytes())
        .field(family.main.text.as_bytes());
    for header in family.headers {
        h.field(header.name.as_bytes())
            .field(header.text.as_bytes());
    }
    for option in options_of(variant, arch, extra_options) {
        h.field(option.as_bytes());
    }
    h.field(variant.entry().as_bytes()).field(arch.as_bytes());
    Ok(CacheKey(h.finish()))
}

fn c_string(s: &str, what: &str) -> Result<CString, String> {
    CString::new(s).map_err(|_| format!("NUL in {what}"))
}

/// Creates the NVRTC program of `family` with its headers.
fn create_program(family: &KernelFamily) -> Result<Program, String> {
    let src = c_string(family.main.text, family.main.name)?;
    let name = c_string(family.main.name, "a source name")?;
    let texts = family
        .headers
        .iter()
        .map(|h| c_string(h.text, h.name))
        .collect::<Result<Vec<_>, _>>()?;
    let names = family
        .headers
        .iter()
        .map(|h| c_string(h.name, "a header name"))
        .collect::<Result<Vec<_>, _>>()?;
    let text_ptrs: Vec<*const c_char> = texts.iter().map(|t| t.as_ptr()).collect();
    let name_ptrs: Vec<*const c_char> = names.iter().map(|n| n.as_ptr()).collect();
    let count = c_int::try_from(texts.len()).map_err(|_| "too many headers".to_string())?;
    let mut prog = std::mem::MaybeUninit::uninit();
    // SAFETY: every pointer is a NUL-terminated string that outlives the call (NVRTC copies
    // them); both header arrays hold `count` entries; `prog` is valid for one write.
    let rc = unsafe {
        nvrtc_sys::nvrtcCreateProgram(
            prog.as_mut_ptr(),
            src.as_ptr(),
            name.as_ptr(),
            count,
            text_ptrs.as_ptr(),
            name_ptrs.as_ptr(),
        )
    };
    if rc != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(format!("nvrtcCreateProgram: {rc:?}"));
    }
    // SAFETY: NVRTC wrote the program handle on success.
    Ok(Program(unsafe { prog.assume_init() }))
}

/// Compiles `variant` to a cubin for `arch` (`sm_80`, `sm_90a`, ...) with ptxas' verbose report.
pub fn compile_variant<V: KernelVariant + Clone>(
    variant: &V,
    arch: &str,
) -> Result<Compiled<V>, CudaError> {
    compile_variant_with(variant, arch, &[])
}

/// [`compile_variant`] with extra NVRTC options (e.g. a define that defeats a compile cache,
/// so that ptxas runs and reports).
pub fn compile_variant_with<V: KernelVariant + Clone>(
    variant: &V,
    arch: &str,
    extra_options: &[String],
) -> Result<Compiled<V>, CudaError> {
    if !nvrtc_available() {
        return Err(CudaError::NoNvrtc);
    }
    let start = Instant::now();
    let compile_err = |log: String| CudaError::Compile {
        variant: format!("{} ({arch})", variant.name()),
        log,
    };
    let prog = create_program(variant.family()).map_err(compile_err)?;
    let options = options_of(variant, arch, extra_options);
    // SAFETY: `prog` is live; the options are plain strings without NUL bytes.
    let compiled = unsafe { nvrtc::compile_program(prog.0, &options) };
    let log = log_of(&prog);
    if let Err(e) = compiled {
        return Err(compile_err(format!("{e:?}\n{log}")));
    }
    let mut size = 0usize;
    // SAFETY: `prog` compiled successfully for a real architecture, so it holds a cubin whose
    // size NVRTC writes into `size`.
    let rc = unsafe { nvrtc_sys::nvrtcGetCUBINSize(prog.0, &mut size) };
    if rc != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS || size == 0 {
        return Err(compile_err(format!("nvrtcGetCUBINSize: {rc:?}")));
    }
    let mut cubin = vec![0u8; size];
    // SAFETY: `cubin` holds exactly `size` bytes, as NVRTC asked for.
    let rc = unsafe { nvrtc_sys::nvrtcGetCUBIN(prog.0, cubin.as_mut_ptr().cast()) };
    if rc != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(compile_err(format!("nvrtcGetCUBIN: {rc:?}")));
    }
    let usage = ResourceUsage::parse(&log).unwrap_or_default();
    Ok(Compiled {
        variant: variant.clone(),
        arch: arch.to_string(),
        cubin,
        log,
        usage,
        compile_ms: start.elapsed().as_secs_f64() * 1e3,
    })
}

/// Compiles `variant` for `arch` through a disk cache: a valid entry is loaded instead of
/// compiling; a missing, stale or corrupt one is rebuilt and (if the cache can be written)
/// replaced. `cache: None` always compiles.
pub fn compile_with_cache<V: KernelVariant + Clone>(
    variant: &V,
    arch: &str,
    cache: Option<&DiskCache>,
) -> Result<(Compiled<V>, KernelOrigin), CudaError> {
    let Some(cache) = cache else {
        let c = compile_variant(variant, arch)?;
        let ms = c.compile_ms;
        return Ok((c, KernelOrigin::Compiled { ms }));
    };
    let key = cache_key(variant, arch, &[])?;
    let name = variant.name();
    if let Some((cubin, usage)) = cache.load(&name, arch, key) {
        let compiled = Compiled {
            variant: variant.clone(),
            arch: arch.to_string(),
            cubin,
            log: String::new(),
            usage,
            compile_ms: 0.0,
        };
        return Ok((compiled, KernelOrigin::DiskCache));
    }
    let compiled = compile_variant(variant, arch)?;
    // A cache that cannot be written is only a miss next time.
    let _ = cache.store(&name, arch, key, &compiled.usage, &compiled.cubin);
    let ms = compiled.compile_ms;
    Ok((compiled, KernelOrigin::Compiled { ms }))
}

type Cache = Mutex<HashMap<(&'static str, String, String), Arc<dyn Any + Send + Sync>>>;

/// Compiles `variant` for `arch` once per process (through the disk cache the environment
/// names, see [`DiskCache::from_env`]); later calls return the same cubin. The origin says
/// where this call's cubin came from.
pub fn compile_cached<V: KernelVariant + Clone + Send + Sync + 'static>(
    variant: &V,
    arch: &str,
) -> Result<(Arc<Compiled<V>>, KernelOrigin), CudaError> {
    static CACHE: OnceLock<Cache> = OnceLock::new();
    let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
    let key = (variant.family().name, variant.name(), arch.to_string());
    let hit = cache.lock().ok().and_then(|c| c.get(&key).cloned());
    if let Some(hit) = hit.and_then(|h| h.downcast::<Compiled<V>>().ok()) {
        return Ok((hit, KernelOrigin::ProcessCache));
    }
    let (compiled, origin) = compile_with_cache(variant, arch, DiskCache::from_env().as_ref())?;
    let compiled = Arc::new(compiled);
    if let Ok(mut c) = cache.lock() {
        c.insert(key, compiled.clone());
    }
    Ok((compiled, origin))
}

/// The compute capability an NVRTC architecture names (`sm_90a` → (9, 0), `sm_120` → (12, 0)).
pub fn capability_of(arch: &str) -> Option<(i32, i32)> {
    let digits = arch.strip_prefix("sm_")?.trim_end_matches(['a', 'f']);
    if digits.len() < 2 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let (major, minor) = digits.split_at(digits.len() - 1);
    Some((major.parse().ok()?, minor.parse().ok()?))
}

/// One variant that [`precompile`] handled.
#[derive(Clone, Debug, PartialEq)]
pub struct PrecompiledKernel {
    /// The variant's name.
    pub name: String,
    /// Compiled now, or already in the disk cache.
    pub origin: KernelOrigin,
    /// Whether the cache holds it now (false: the cache could not be written, or is off).
    pub cached: bool,
}

/// What [`precompile`] did.
#[derive(Clone, Debug, PartialEq)]
pub struct PrecompileReport {
    /// The architecture compiled for.
    pub arch: String,
    /// The cache directory (`None`: the cache is off, so nothing was kept).
    pub cache_dir: Option<PathBuf>,
    /// Every variant, in the order given.
    pub kernels: Vec<PrecompiledKernel>,
}

impl PrecompileReport {
    /// Variants NVRTC compiled in this call.
    pub fn compiled(&self) -> usize {
        self.kernels
            .iter()
            .filter(|k| matches!(k.origin, KernelOrigin::Compiled { .. }))
            .count()
    }
}

/// Fills the disk cache the environment names ([`DiskCache::from_env`]) with `variants` for
/// `arch`, with NVRTC only (no GPU needed): what a later process then loads without compiling.
/// Variants already cached are checked and kept. With the cache off every variant is still
/// compiled (a compile check) and nothing is kept.
pub fn precompile<V: KernelVariant + Clone>(
    arch: &str,
    variants: &[V],
) -> Result<PrecompileReport, CudaError> {
    precompile_into(DiskCache::from_env().as_ref(), arch, variants)
}

/// [`precompile`] into a given cache (`None`: compile only).
pub fn precompile_into<V: KernelVariant + Clone>(
    cache: Option<&DiskCache>,
    arch: &str,
    variants: &[V],
) -> Result<PrecompileReport, CudaError> {
    let (major, minor) = capability_of(arch).ok_or(CudaError::Compile {
        variant: "(none)".into(),
        log: format!("not an NVRTC architecture: {arch}"),
    })?;
    let mut kernels = Vec::with_capacity(variants.len());
    for variant in variants {
        if !variant.family().supports(major, minor) {
            return Err(CudaError::UnsupportedArch { major, minor });
        }
        let (_, origin) = compile_with_cache(variant, arch, cache)?;
        let cached = match cache {
            Some(c) => c
                .load(&variant.name(), arch, cache_key(variant, arch, &[])?)
                .is_some(),
            None => false,
        };
        kernels.push(PrecompiledKernel {
            name: variant.name(),
            origin,
            cached,
        });
    }
    Ok(PrecompileReport {
        arch: arch.to_string(),
        cache_dir: cache.map(|c| c.dir().to_path_buf()),
        kernels,
    })
}

/// [`precompile`] of every variant of every family that supports `arch` (what `fa warmup`
/// runs): the forward families, the decode kernels, their combine and the append, and the
/// sm80 backward with its pre/post-pass.
pub fn precompile_all(arch: &str) -> Result<PrecompileReport, CudaError> {
    use crate::kernels::bwd_sm80::{BwdPrepVariant, BwdVariant};
    use crate::kernels::decode::{AppendVariant, CombineVariant, DecodeVariant};
    use crate::kernels::DType;
    let supported: Vec<ForwardVariant> = match capability_of(arch) {
        Some((major, minor)) => ForwardVariant::all()
            .into_iter()
            .filter(|v| v.family().supports(major, minor))
            .collect(),
        None => ForwardVariant::all(),
    };
    let mut report = precompile(arch, &supported)?;
    let combine = [DType::Bf16, DType::F16].map(|dtype| CombineVariant { dtype });
    for more in [
        precompile(arch, &DecodeVariant::all())?,
        precompile(arch, &combine)?,
        precompile(arch, &[AppendVariant])?,
        precompile(arch, &BwdVariant::all())?,
        precompile(arch, &BwdPrepVariant::all())?,
    ] {
        report.kernels.extend(more.kernels);
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ptxas_report() {
        let log = "ptxas info    : Compiling entry function 'flash_fwd' for 'sm_90a'\n\
                   ptxas info    : Function properties for flash_fwd\n\
                   \x20   8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n\
                   ptxas info    : Used 255 registers, used 1 barriers, 584 bytes cmem[0]\n";
        let u = ResourceUsage::parse(log).expect("a report");
        assert_eq!(
            u,
            ResourceUsage {
                registers: 255,
                stack_frame: 8,
                spill_stores: 4,
                spill_loads: 12
            }
        );
        assert!(u.spills());
        assert_eq!(ResourceUsage::parse("nothing here"), None);
    }

    #[test]
    fn capabilities_of_arch_names() {
        assert_eq!(capability_of("sm_80"), Some((8, 0)));
        assert_eq!(capability_of("sm_90a"), Some((9, 0)));
        assert_eq!(capability_of("sm_120"), Some((12, 0)));
        assert_eq!(capability_of("sm_100f"), Some((10, 0)));
        assert_eq!(capability_of("compute_80"), None);
        assert_eq!(capability_of("sm_"), None);
    }
}
