//! `fa_io::files::read_tensor` (the reader behind `fa run`) on arbitrary `.safetensors` bytes
//! (the public reader takes a path, so each input goes through a file in the temp directory):
//! never panics or aborts; when it accepts, the tensor holds exactly `product(shape)` elements.
//! Half the inputs get a well-formed frame (length prefix, JSON header with a fuzzed dtype,
//! shape and offsets) so that the checks after the header are reached.
#![no_main]

use fa_io::files::read_tensor;
use libfuzzer_sys::fuzz_target;
use std::path::PathBuf;

fn framed(data: &[u8]) -> Vec<u8> {
    let mut it = data.iter().copied();
    let mut next = || it.next().unwrap_or(0);
    let dtype = ["F32", "BF16", "F16", "F64", "I8", "BOOL"][next() as usize % 6];
    let rank = next() % 4;
    let shape: Vec<String> = (0..rank)
        .map(|_| match next() % 8 {
            0 => u64::from_le_bytes([next(), next(), next(), next(), next(), next(), next(), next()])
                .to_string(),
            _ => (next() % 9).to_string(),
        })
        .collect();
    let (a, b) = (next() as u64 * 4, next() as u64 * 4);
    let name = ["q", "k", "x"][next() as usize % 3];
    let header = format!(
        "{{\"{name}\":{{\"dtype\":\"{dtype}\",\"shape\":[{}],\"data_offsets\":[{a},{b}]}}}}",
        shape.join(",")
    );
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    let rest: Vec<u8> = it.collect();
    out.extend_from_slice(&rest);
    out
}

fuzz_target!(|data: &[u8]| {
    let input = match data.split_first() {
        Some((mode, rest)) if mode % 2 == 1 => framed(rest),
        _ => data.to_vec(),
    };
    let path: PathBuf =
        std::env::temp_dir().join(format!("fa-fuzz-{}.safetensors", std::process::id()));
    std::fs::write(&path, &input).expect("temp file");
    let read = read_tensor(&path, "q");
    let _ = std::fs::remove_file(&path);
    let Ok((t, _format)) = read else { return };
    let elems = t.shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
    assert_eq!(elems, Some(t.len()), "shape {:?} vs {} elements", t.shape, t.len());
});
