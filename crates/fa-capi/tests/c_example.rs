//! Compiles `examples/c/forward_cpu.c` with the system C compiler against the static library
//! cargo built for this test run, runs it and expects exit 0.
//!
//! Under `cargo test` the library is not a root unit, so cargo leaves the archive in
//! `target/<profile>/deps/` (beside this test) and copies it up to `target/<profile>/` only
//! after a `cargo build`; the test takes the one in `deps/`, which this run built.

use std::path::PathBuf;
use std::process::Command;

#[test]
fn the_c_example_compiles_links_and_passes() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    // This test runs from target/<profile>/deps/; cargo puts the library one level up.
    let exe = std::env::current_exe().expect("the test's path");
    let deps_dir = exe.parent().expect("target/<profile>/deps");
    let profile_dir = deps_dir.parent().expect("target/<profile>");
    let lib = deps_dir.join("libflash_attention_rs.a");
    assert!(
        lib.is_file(),
        "{} is missing: cargo builds it with the crate (crate-type staticlib)",
        lib.display()
    );
    let out_dir = profile_dir.join("c-example");
    std::fs::create_dir_all(&out_dir).expect("a build directory");
    let bin = out_dir.join("forward_cpu");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_string());
    let status = Command::new(&cc)
        .arg(root.join("examples/c/forward_cpu.c"))
        .arg("-std=c99")
        .arg("-Wall")
        .arg("-Wextra")
        .arg("-Werror")
        .arg("-I")
        .arg(root.join("include"))
        .arg(&lib)
        .args(["-lpthread", "-ldl", "-lm", "-o"])
        .arg(&bin)
        .status()
        .unwrap_or_else(|e| panic!("cannot run the C compiler `{cc}`: {e}"));
    assert!(status.success(), "{cc} failed on examples/c/forward_cpu.c");
    let run = Command::new(&bin).output().expect("the example runs");
    let stdout = String::from_utf8_lossy(&run.stdout);
    println!("{stdout}{}", String::from_utf8_lossy(&run.stderr));
    assert!(run.status.success(), "the C example failed:\n{stdout}");
    assert!(stdout.contains("all checks passed"), "{stdout}");
}
