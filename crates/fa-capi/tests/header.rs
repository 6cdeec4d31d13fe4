//! The checked-in header `include/flash_attention_rs.h` is what cbindgen makes of this crate
//! now: a stale header fails here (run with `FA_CAPI_BLESS=1` to rewrite it).

use std::path::PathBuf;

fn generate() -> String {
    let crate_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let config =
        cbindgen::Config::from_file(crate_dir.join("cbindgen.toml")).expect("cbindgen.toml reads");
    // The sources themselves (no `cargo metadata` run): lib.rs and the modules it declares.
    let builder = cbindgen::Builder::new()
        .with_config(config)
        .with_src(crate_dir.join("src/lib.rs"));
    let mut out = Vec::new();
    builder
        .generate()
        .expect("cbindgen generates the header")
        .write(&mut out);
    String::from_utf8(out).expect("the header is UTF-8")
}

#[test]
fn header_is_current() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../include/flash_attention_rs.h");
    let fresh = generate();
    if std::env::var_os("FA_CAPI_BLESS").is_some() {
        std::fs::write(&path, &fresh).expect("writes the header");
        return;
    }
    let current = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        current == fresh,
        "{} is stale or missing: regenerate it with `FA_CAPI_BLESS=1 cargo test -p fa-capi --test header` \
         and commit it",
        path.display()
    );
}
