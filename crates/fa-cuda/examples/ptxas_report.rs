//! Compiles the kernel variants (forward and decode) with NVRTC (no GPU needed) and prints
//! ptxas' report; with `--cubin-dir DIR` also writes each cubin, for reading the SASS with
//! `nvdisasm`/`cuobjdump` or comparing two versions byte for byte.
//!
//! ```text
//! cargo run --release -p fa-cuda --example ptxas_report -- [--arch sm_90a] [--only d128] [--cubin-dir DIR]
//! ```
//! It always compiles (the disk cache is not used), so the report is ptxas' own.

use fa_cuda::compile::{capability_of, compile_variant};
use fa_cuda::kernels::decode::DecodeVariant;
use fa_cuda::kernels::KernelVariant;
use fa_cuda::ForwardVariant;

fn main() {
    let mut arch = "sm_90a".to_string();
    let mut only = String::new();
    let mut dir: Option<std::path::PathBuf> = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--arch" => arch = args.next().unwrap_or(arch),
            "--only" => only = args.next().unwrap_or_default(),
            "--cubin-dir" => dir = args.next().map(Into::into),
            _ => {
                eprintln!("usage: ptxas_report [--arch A] [--only SUBSTRING] [--cubin-dir DIR]");
                std::process::exit(2);
            }
        }
    }
    let mut failed = false;
    let (major, minor) = capability_of(&arch).unwrap_or((0, 0));
    let selected = |name: String, family: &fa_cuda::kernels::KernelFamily| {
        name.contains(&only) && family.supports(major, minor)
    };
    for variant in ForwardVariant::all()
        .into_iter()
        .filter(|v| selected(v.name(), v.family()))
    {
        failed |= !report(&variant, &arch, dir.as_deref());
    }
    for variant in DecodeVariant::all()
        .into_iter()
        .filter(|v| selected(v.name(), v.family()))
    {
        failed |= !report(&variant, &arch, dir.as_deref());
    }
    if failed {
        std::process::exit(1);
    }
}

/// Compiles one variant, prints its ptxas report and writes its cubin into `dir`; false on
/// failure.
fn report<V: KernelVariant + Clone>(
    variant: &V,
    arch: &str,
    dir: Option<&std::path::Path>,
) -> bool {
    match compile_variant(variant, arch) {
        Ok(c) => {
            println!(
                "{:<44} {arch:<7} {:>4} regs  stack {:>3}  spill st/ld {:>3}/{:<3} {:>6.0} ms",
                variant.name(),
                c.usage.registers,
                c.usage.stack_frame,
                c.usage.spill_stores,
                c.usage.spill_loads,
                c.compile_ms
            );
            if let Some(dir) = dir {
                let path = dir.join(format!("{}_{arch}.cubin", variant.name()));
                if let Err(e) =
                    std::fs::create_dir_all(dir).and_then(|_| std::fs::write(&path, &c.cubin))
                {
                    eprintln!("cannot write {}: {e}", path.display());
                    return false;
                }
            }
            true
        }
        Err(e) => {
            eprintln!("{}: {e}", variant.name());
            false
        }
    }
}
