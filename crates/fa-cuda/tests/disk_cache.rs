//! The disk cache of cubins with real NVRTC output: a second compile is a disk hit with the same
//! bytes; a corrupt, truncated or foreign entry is rebuilt, never loaded; a cache that cannot be
//! written still compiles. Needs libnvrtc, not a GPU: these tests are `#[ignore]`d with that
//! reason and fail when run without it; `.ci/run` runs them with `--include-ignored`.

use fa_cuda::compile::{
    cache_key, compile_with_cache, nvrtc_available, precompile_into, DiskCache, KernelOrigin,
};
use fa_cuda::{CudaError, Variant};
use std::path::PathBuf;

const ARCH: &str = "sm_80";

/// Fails the test when libnvrtc cannot be loaded (the tests that call it are ignored by
/// default for that reason).
fn require_nvrtc() {
    assert!(
        nvrtc_available(),
        "libnvrtc cannot be loaded: source .ci/install-nvrtc.sh first"
    );
}

/// The variant that compiles fastest (hdim 64, no mask code).
fn small_variant() -> Variant {
    Variant::all()
        .into_iter()
        .find(|v| v.hdp == 64 && !v.masked && !v.general_scores)
        .expect("an hdim-64 variant without mask code")
}

/// A fresh directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!("fa-cuda-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn is_compiled(origin: KernelOrigin) -> bool {
    matches!(origin, KernelOrigin::Compiled { ms } if ms > 0.0)
}

#[test]
#[ignore = "needs libnvrtc (source .ci/install-nvrtc.sh); CI runs it with --include-ignored"]
fn disk_cache_hits_and_rebuilds_bad_entries() {
    require_nvrtc();
    let tmp = TempDir::new("cubin-cache");
    let cache = DiskCache::at(tmp.0.join("cubins"));
    let v = small_variant();
    let path = cache.path_for(&v.name(), ARCH, cache_key(&v, ARCH, &[]).expect("key"));

    // precompile fills the cache; the next compile is a disk hit with identical bytes.
    let report = precompile_into(Some(&cache), ARCH, &[v]).expect("precompile");
    assert_eq!(report.compiled(), 1);
    assert!(report.kernels[0].cached);
    assert_eq!(report.cache_dir.as_deref(), Some(cache.dir()));
    let first = std::fs::read(&path).expect("an entry on disk");
    let (hit, origin) = compile_with_cache(&v, ARCH, Some(&cache)).expect("hit");
    assert_eq!(origin, KernelOrigin::DiskCache);
    assert!(first.ends_with(&hit.cubin) && hit.cubin.len() > 1000);
    // The ptxas report travels with the cubin: a hit returns what the compilation reported.
    // (Not "registers > 0": NVRTC keeps a compile cache of its own on some machines, seen on
    // the H200's, and a repeated compilation there returns the cubin without a report.)
    let other = DiskCache::at(tmp.0.join("report"));
    let (compiled, origin) = compile_with_cache(&v, ARCH, Some(&other)).expect("compiles");
    assert!(is_compiled(origin));
    let (again, origin) = compile_with_cache(&v, ARCH, Some(&other)).expect("hit");
    assert_eq!(origin, KernelOrigin::DiskCache);
    assert_eq!(
        again.usage, compiled.usage,
        "the ptxas report is stored with the cubin"
    );
    let report = precompile_into(Some(&cache), ARCH, &[v]).expect("precompile again");
    assert_eq!(report.compiled(), 0);
    assert_eq!(report.kernels[0].origin, KernelOrigin::DiskCache);

    // A flipped byte in the cubin: detected, rebuilt and replaced.
    let mut bytes = first.clone();
    let at = bytes.len() - 100;
    bytes[at] ^= 0x40;
    std::fs::write(&path, &bytes).expect("corrupt the entry");
    let (rebuilt, origin) = compile_with_cache(&v, ARCH, Some(&cache)).expect("rebuild");
    assert!(is_compiled(origin), "{origin:?}");
    assert_eq!(rebuilt.cubin, hit.cubin);
    same_cubin_entry(&path, &first, &hit.cubin);

    // Truncated, then an entry written for another key: both rebuilt.
    std::fs::write(&path, &first[..first.len() / 2]).expect("truncate");
    let (_, origin) = compile_with_cache(&v, ARCH, Some(&cache)).expect("rebuild");
    assert!(is_compiled(origin), "{origin:?}");
    let mut foreign = first.clone();
    foreign[8] ^= 1; // the key field of the header
    std::fs::write(&path, &foreign).expect("foreign entry");
    let (_, origin) = compile_with_cache(&v, ARCH, Some(&cache)).expect("rebuild");
    assert!(is_compiled(origin), "{origin:?}");
    same_cubin_entry(&path, &first, &hit.cubin);
    let (_, origin) = compile_with_cache(&v, ARCH, Some(&cache)).expect("hit");
    assert_eq!(origin, KernelOrigin::DiskCache);
}

#[test]
#[ignore = "needs libnvrtc (source .ci/install-nvrtc.sh); CI runs it with --include-ignored"]
fn an_unwritable_cache_only_misses() {
    require_nvrtc();
    let tmp = TempDir::new("cubin-cache-ro");
    let v = small_variant();
    // A cache directory below a regular file can never be created.
    let file = tmp.0.join("not-a-dir");
    std::fs::write(&file, b"x").expect("file");
    let blocked = DiskCache::at(file.join("cubins"));
    let (c, origin) = compile_with_cache(&v, ARCH, Some(&blocked)).expect("compiles anyway");
    assert!(is_compiled(origin) && !c.cubin.is_empty());
    let report = precompile_into(Some(&blocked), ARCH, &[v]).expect("precompile anyway");
    assert_eq!(report.compiled(), 1);
    assert!(!report.kernels[0].cached);

    // A read-only directory (root writes anyway: then the entry is simply there).
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let ro = tmp.0.join("ro");
        std::fs::create_dir_all(&ro).expect("dir");
        std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o555)).expect("chmod");
        let (c2, _) = compile_with_cache(&v, ARCH, Some(&DiskCache::at(&ro))).expect("works");
        assert_eq!(c2.cubin, c.cubin);
        let _ = std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o755));
    }
}

#[test]
#[ignore = "needs libnvrtc (source .ci/install-nvrtc.sh); CI runs it with --include-ignored"]
fn precompile_rejects_architectures_the_family_does_not_run_on() {
    require_nvrtc();
    let v = small_variant();
    assert_eq!(
        precompile_into(None, "sm_75", &[v]).unwrap_err(),
        CudaError::UnsupportedArch { major: 7, minor: 5 }
    );
    assert!(precompile_into(None, "compute_80", &[v]).is_err());
}

/// The entry at `path` holds `cubin` under a header as long as `first`'s. The ptxas report in
/// the header may differ from the first compilation's: where NVRTC serves a repeated
/// compilation from a cache of its own (the H200 machine's does), it returns no report.
fn same_cubin_entry(path: &std::path::Path, first: &[u8], cubin: &[u8]) {
    let entry = std::fs::read(path).expect("entry");
    assert!(
        entry.ends_with(cubin),
        "the rebuilt entry holds another cubin"
    );
    assert_eq!(entry.len(), first.len());
}
