//! CI compile check: every kernel variant compiles with NVRTC for each of sm_80 and sm_90a
//! that its family runs on (the sm90 `wgmma` family for sm_90a only), with no register spill
//! and no stack frame. Needs libnvrtc, not a GPU, so the check is `#[ignore]`d
//! with that reason (a test that cannot run must not count as passed) and fails when run
//! without libnvrtc; `.ci/run` sources `.ci/install-nvrtc.sh` and runs it with
//! `--include-ignored`. Locally: `source .ci/install-nvrtc.sh && cargo test -p fa-cuda --test
//! nvrtc_compile -- --include-ignored`. `ci_has_libnvrtc` (not ignored) fails when `CI` is set
//! and libnvrtc cannot be loaded.

use fa_cuda::compile::{capability_of, compile_variant_with, nvrtc_available, Compiled};
use fa_cuda::kernels::KernelVariant;
use fa_cuda::ForwardVariant;
use std::sync::Mutex;

const ARCHS: [&str; 2] = ["sm_80", "sm_90a"];

/// Under CI the compile check must be able to run.
#[test]
fn ci_has_libnvrtc() {
    assert!(
        std::env::var_os("CI").is_none() || nvrtc_available(),
        "CI is set but libnvrtc cannot be loaded: source .ci/install-nvrtc.sh first"
    );
}

#[test]
#[ignore = "needs libnvrtc (source .ci/install-nvrtc.sh); CI runs it with --include-ignored"]
fn every_variant_compiles_without_spills() {
    assert!(
        nvrtc_available(),
        "libnvrtc cannot be loaded: source .ci/install-nvrtc.sh first"
    );
    // FA_NVRTC_ONLY=<substring> narrows the check to matching variants while developing.
    let only = std::env::var("FA_NVRTC_ONLY").unwrap_or_default();
    let jobs: Vec<(ForwardVariant, &str)> = ForwardVariant::all()
        .into_iter()
        .filter(|v| v.name().contains(&only))
        .flat_map(|v| {
            ARCHS.iter().filter_map(move |a| {
                let (major, minor) = capability_of(a).expect("an NVRTC arch");
                v.family().supports(major, minor).then_some((v, *a))
            })
        })
        .collect();
    // Both families are checked: the sm90 one for sm_90a.
    assert!(jobs
        .iter()
        .any(|(v, a)| matches!(v, ForwardVariant::Sm90(_)) && *a == "sm_90a"));
    let results: Mutex<Vec<Result<Compiled<ForwardVariant>, String>>> = Mutex::new(Vec::new());
    let next = Mutex::new(0usize);
    let threads = std::thread::available_parallelism()
        .map_or(2, |n| n.get())
        .min(8);
    let start = std::time::Instant::now();
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = {
                    let mut n = next.lock().expect("lock");
                    let i = *n;
                    *n += 1;
                    i
                };
                let Some((variant, arch)) = jobs.get(i) else {
                    break;
                };
                // A unique symbol defeats any NVRTC compile cache (seen on the GPU machine:
                // no ptxas report for sm_90a), which would skip ptxas and its report.
                let nonce = (std::process::id() % 100_000) * 1000 + i as u32;
                let nonce = vec![format!("-DFA_COMPILE_CHECK_NONCE={nonce}")];
                let r = compile_variant_with(variant, arch, &nonce).map_err(|e| e.to_string());
                results.lock().expect("lock").push(r);
            });
        }
    });
    let wall = start.elapsed().as_secs_f64();
    let results = results.into_inner().expect("lock");
    assert_eq!(results.len(), jobs.len());
    let mut failures = Vec::new();
    let mut total_ms = 0.0;
    for r in &results {
        match r {
            Err(e) => failures.push(e.clone()),
            Ok(c) => {
                total_ms += c.compile_ms;
                println!(
                    "{:<40} {:<7} {:>4} regs  stack {:>3}  spill st/ld {:>3}/{:<3} {:>7.0} ms",
                    c.variant.name(),
                    c.arch,
                    c.usage.registers,
                    c.usage.stack_frame,
                    c.usage.spill_stores,
                    c.usage.spill_loads,
                    c.compile_ms
                );
                if c.usage.registers == 0 {
                    failures.push(format!(
                        "{} {}: no ptxas report in log:\n{}",
                        c.variant.name(),
                        c.arch,
                        c.log
                    ));
                } else if c.usage.spills() || c.usage.stack_frame > 0 {
                    failures.push(format!(
                        "{} {}: spills or stack frame: {:?}",
                        c.variant.name(),
                        c.arch,
                        c.usage
                    ));
                }
            }
        }
    }
    println!(
        "{} compilations: {:.1} s of NVRTC time, {:.1} s wall on {} threads",
        results.len(),
        total_ms / 1e3,
        wall,
        threads
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Compiles `variant` for both architectures; a failure, a missing ptxas report, a spill or a
/// stack frame is returned as a message.
fn check_variant<V: fa_cuda::kernels::KernelVariant + Clone>(variant: &V, out: &mut Vec<String>) {
    for (n, arch) in ARCHS.iter().enumerate() {
        let nonce = (std::process::id() % 100_000) * 1000 + 900 + n as u32;
        let nonce = vec![format!("-DFA_COMPILE_CHECK_NONCE={nonce}")];
        match compile_variant_with(variant, arch, &nonce) {
            Err(e) => out.push(e.to_string()),
            Ok(c) => {
                println!(
                    "{:<40} {:<7} {:>4} regs  stack {:>3}  spill st/ld {:>3}/{:<3} {:>7.0} ms",
                    variant.name(),
                    arch,
                    c.usage.registers,
                    c.usage.stack_frame,
                    c.usage.spill_stores,
                    c.usage.spill_loads,
                    c.compile_ms
                );
                if c.usage.registers == 0 {
                    out.push(format!("{} {arch}: no ptxas report", variant.name()));
                } else if c.usage.spills() || c.usage.stack_frame > 0 {
                    out.push(format!(
                        "{} {arch}: spills or stack frame: {:?}",
                        variant.name(),
                        c.usage
                    ));
                }
            }
        }
    }
}

/// The decode family (every variant the plan can pick), its combine kernel (both dtypes) and
/// the append kernel, for sm_80 and sm_90a, without spills.
#[test]
#[ignore = "needs libnvrtc (source .ci/install-nvrtc.sh); CI runs it with --include-ignored"]
fn decode_family_compiles_without_spills() {
    use fa_cuda::kernels::decode::{AppendVariant, CombineVariant, DecodeVariant};
    use fa_cuda::DType;
    assert!(
        nvrtc_available(),
        "libnvrtc cannot be loaded: source .ci/install-nvrtc.sh first"
    );
    let only = std::env::var("FA_NVRTC_ONLY").unwrap_or_default();
    let variants: Vec<DecodeVariant> = DecodeVariant::all()
        .into_iter()
        .filter(|v| v.name().contains(&only))
        .collect();
    // A few threads, each taking every n-th variant.
    let threads = std::thread::available_parallelism()
        .map_or(2, |n| n.get())
        .min(8);
    let mut failures: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let variants = &variants;
                s.spawn(move || {
                    let mut out = Vec::new();
                    for v in variants.iter().skip(t).step_by(threads) {
                        check_variant(v, &mut out);
                    }
                    out
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("compile thread"))
            .collect()
    });
    for dtype in [DType::Bf16, DType::F16] {
        check_variant(&CombineVariant { dtype }, &mut failures);
    }
    check_variant(&AppendVariant, &mut failures);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The backward family (every variant the plan can pick) and its pre/post-pass kernels (both
/// dtypes), for sm_80 and sm_90a, without spills.
#[test]
#[ignore = "needs libnvrtc (source .ci/install-nvrtc.sh); CI runs it with --include-ignored"]
fn backward_family_compiles_without_spills() {
    use fa_cuda::kernels::bwd_sm80::{BwdPrepVariant, BwdVariant};
    assert!(
        nvrtc_available(),
        "libnvrtc cannot be loaded: source .ci/install-nvrtc.sh first"
    );
    let only = std::env::var("FA_NVRTC_ONLY").unwrap_or_default();
    let variants: Vec<BwdVariant> = BwdVariant::all()
        .into_iter()
        .filter(|v| v.name().contains(&only))
        .collect();
    let threads = std::thread::available_parallelism()
        .map_or(2, |n| n.get())
        .min(8);
    let mut failures: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let variants = &variants;
                s.spawn(move || {
                    let mut out = Vec::new();
                    for v in variants.iter().skip(t).step_by(threads) {
                        check_variant(v, &mut out);
                    }
                    out
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("compile thread"))
            .collect()
    });
    for v in BwdPrepVariant::all() {
        check_variant(&v, &mut failures);
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
