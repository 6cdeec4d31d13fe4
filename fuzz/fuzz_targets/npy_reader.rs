//! `fa_io::npy::read_npy` on arbitrary bytes: never panics, aborts or allocates what the
//! bytes do not hold; when it accepts, the tensor holds exactly `product(shape)` elements and
//! writing it back and reading again gives the same tensor. Half the inputs get a well-formed
//! magic, version and header (dtype, order, shape from the fuzz bytes) so that the parser's
//! deeper paths are reached, not only the magic check.
#![no_main]

use fa_io::npy::{read_npy, write_npy};
use libfuzzer_sys::fuzz_target;

fn framed(data: &[u8]) -> Vec<u8> {
    let mut it = data.iter().copied();
    let mut next = || it.next().unwrap_or(0);
    let descr = ["<f4", "<f2", "<V2", ">f4", "<f8", "|u1", "<e", "f4"][next() as usize % 8];
    let fortran = if next() % 4 == 0 { "True" } else { "False" };
    let rank = next() % 4;
    let dims: Vec<String> = (0..rank)
        .map(|_| match next() % 8 {
            0 => u64::from_le_bytes([next(), next(), next(), next(), next(), next(), next(), next()])
                .to_string(),
            _ => (next() % 9).to_string(),
        })
        .collect();
    let shape = match dims.len() {
        1 => format!("({},)", dims[0]),
        _ => format!("({})", dims.join(", ")),
    };
    let mut header = format!("{{'descr': '{descr}', 'fortran_order': {fortran}, 'shape': {shape}, }}");
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
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
    let Ok(t) = read_npy(&input) else { return };
    let elems = t.shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
    assert_eq!(elems, Some(t.len()), "shape {:?} vs {} elements", t.shape, t.len());
    let again = read_npy(&write_npy(&t)).expect("what fa writes, fa reads");
    assert_eq!(again.shape, t.shape);
    assert_eq!(again.dtype(), t.dtype());
    assert_eq!(write_npy(&again), write_npy(&t), "round trip changed the data");
});
