//! The CPU decode loop's flags (`--prefetch`, `--no-amx-pv`, `--bf16-dots`): what used to be
//! fa-cpu's environment variables (`FA_CPU_DECODE_PREFETCH`, `FA_CPU_DECODE_AMX_PV`,
//! `FA_CPU_DECODE_DPBF16`) are plain flags of the compute options now.

use std::process::{Command, Output};

fn fa(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_fa"))
        .args(args)
        .output()
        .expect("the fa binary runs")
}

/// A small `fa bench --decode` (one padded and one paged cache) with `extra` flags.
fn bench_decode(extra: &[&str]) -> Output {
    let mut args = vec![
        "bench",
        "--decode",
        "--backend",
        "cpu",
        "--dtype",
        "bf16",
        "--batch",
        "1",
        "--cache-len",
        "300",
        "--heads",
        "4",
        "--heads-kv",
        "1",
        "--head-dim",
        "32",
        "--page-size",
        "0,16",
        "--iters",
        "1",
        "--json",
    ];
    args.extend_from_slice(extra);
    fa(&args)
}

#[test]
fn decode_flags_are_accepted_and_checked() {
    for extra in [
        &["--prefetch", "next", "--no-amx-pv", "--bf16-dots"][..],
        &["--prefetch", "phase+ahead:64"],
        &["--prefetch", "off"],
    ] {
        let o = bench_decode(extra);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "{extra:?}: {err}");
        let out = String::from_utf8_lossy(&o.stdout);
        assert_eq!(out.lines().count(), 2, "{extra:?}: {out}");
    }
    for bad in ["ahead:0", "ahead:65", "sometimes", ""] {
        let o = bench_decode(&["--prefetch", bad]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{bad:?}: {err}");
        assert!(
            err.contains("--prefetch") && err.contains("phase+ahead:N"),
            "{bad:?}: {err}"
        );
    }
    // The help documents the flags; no environment variable is mentioned any more.
    let o = fa(&["bench", "--help"]);
    let help = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success());
    for flag in ["--prefetch", "--no-amx-pv", "--bf16-dots"] {
        assert!(help.contains(flag), "{flag} missing from\n{help}");
    }
    assert!(!help.contains("FA_CPU_"), "{help}");
}
