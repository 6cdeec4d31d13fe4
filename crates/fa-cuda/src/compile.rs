//! NVRTC: compiling a kernel variant to a cubin for one architecture, reading ptxas' resource
//! report (registers, spills, stack), and the per-process cache of compiled variants.

use crate::error::CudaError;
use crate::kernels::{Variant, FLASH_FWD_SM80_SRC};
use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys};
use std::collections::HashMap;
use std::ffi::{CStr, CString};
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
pub struct Compiled {
    /// The variant.
    pub variant: Variant,
    /// The architecture, e.g. `sm_90a`.
    pub arch: String,
    /// The cubin.
    pub cubin: Vec<u8>,
    /// NVRTC's log (ptxas' info lines included).
    pub log: String,
    /// Resource usage read off the log.
    pub usage: ResourceUsage,
    /// Wall time of the compilation in milliseconds.
    pub compile_ms: f64,
}

/// Owns an NVRTC program and destroys it on drop.
struct Program(nvrtc_sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the program was created by `create_program` and is destroyed only here.
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

/// Compiles `variant` to a cubin for `arch` (`sm_80`, `sm_90a`, ...) with ptxas' verbose report.
pub fn compile_variant(variant: &Variant, arch: &str) -> Result<Compiled, CudaError> {
    compile_variant_with(variant, arch, &[])
}

/// [`compile_variant`] with extra NVRTC options (e.g. a define that defeats a compile cache,
/// so that ptxas runs and reports).
pub fn compile_variant_with(
    variant: &Variant,
    arch: &str,
    extra_options: &[String],
) -> Result<Compiled, CudaError> {
    if !nvrtc_available() {
        return Err(CudaError::NoNvrtc);
    }
    let start = Instant::now();
    let compile_err = |log: String| CudaError::Compile {
        variant: format!("{} ({arch})", variant.name()),
        log,
    };
    let src = CString::new(FLASH_FWD_SM80_SRC).map_err(|_| compile_err("NUL in source".into()))?;
    let name = CString::new("flash_fwd_sm80.cu").map_err(|_| compile_err("bad name".into()))?;
    let prog = Program(
        nvrtc::create_program(&src, Some(&name))
            .map_err(|e| compile_err(format!("nvrtcCreateProgram: {e:?}")))?,
    );
    let mut options = variant.defines();
    options.extend([
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_string(),
        "--ptxas-options=-v".to_string(),
        "--fmad=true".to_string(),
        // The source has no host code; this makes its local lambda a device function.
        "-default-device".to_string(),
    ]);
    options.extend(extra_options.iter().cloned());
    // Tuning experiments: extra `-D` switches of the kernel source (e.g.
    // `FA_CUDA_DEFINES="-DQK_UNROLL_ALL=1"`); not for production use.
    if let Ok(extra) = std::env::var("FA_CUDA_DEFINES") {
        options.extend(extra.split_whitespace().map(str::to_string));
    }
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
        variant: *variant,
        arch: arch.to_string(),
        cubin,
        log,
        usage,
        compile_ms: start.elapsed().as_secs_f64() * 1e3,
    })
}

type Cache = Mutex<HashMap<(Variant, String), Arc<Compiled>>>;

/// Compiles `variant` for `arch` once per process; later calls return the cached cubin.
/// The flag says whether this call compiled it.
pub fn compile_cached(variant: &Variant, arch: &str) -> Result<(Arc<Compiled>, bool), CudaError> {
    static CACHE: OnceLock<Cache> = OnceLock::new();
    let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
    let key = (*variant, arch.to_string());
    if let Some(hit) = cache.lock().ok().and_then(|c| c.get(&key).cloned()) {
        return Ok((hit, false));
    }
    let compiled = Arc::new(compile_variant(variant, arch)?);
    if let Ok(mut c) = cache.lock() {
        c.insert(key, compiled.clone());
    }
    Ok((compiled, true))
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
}
