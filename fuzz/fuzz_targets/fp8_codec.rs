//! FP8 codecs on arbitrary inputs: every code round-trips through f32, every f32 encodes to
//! a nearest code (ties to even, saturating, NaN to the canonical NaN), and the slice paths
//! agree with the scalar codec.
#![no_main]

use fa_fp8::codec::{decode_with_path, encode_with_path, CodecPath};
use fa_fp8::{Fp8Format, NAN_CODE};
use libfuzzer_sys::fuzz_target;

fn check(format: Fp8Format, x: f32, code: u8) {
    // Round trip of the code.
    let v = format.decode(code);
    if format.is_nan(code) {
        assert!(v.is_nan());
        assert_eq!(format.encode(v), NAN_CODE);
    } else if v.is_infinite() {
        // e5m2's infinities saturate back to the largest finite code (satfinite).
        assert_eq!(format.encode(v), if v > 0.0 { 0x7b } else { 0xfb });
    } else {
        assert_eq!(format.encode(v), code, "{} {code:#04x}", format.name());
    }
    // Nearest-code property of the encoder.
    let c = format.encode(x);
    let y = format.decode(c);
    if x.is_nan() {
        assert_eq!(c, NAN_CODE);
        return;
    }
    assert_eq!(y.is_sign_negative(), x.is_sign_negative());
    let target = (x as f64).clamp(-(format.max() as f64), format.max() as f64);
    let err = (y as f64 - target).abs();
    for n in 0..=255u8 {
        let w = format.decode(n);
        if w.is_finite() {
            let e = (w as f64 - target).abs();
            assert!(err <= e, "{x:e} -> {y:e}, but {w:e} is nearer");
            if e == err && w != y {
                // A tie: the chosen code has an even mantissa.
                assert_eq!(c & 1, 0, "{x:e}: tie not to even");
            }
        }
    }
}

fuzz_target!(|data: (u8, [u8; 4], Vec<u32>)| {
    let (code, xb, more) = data;
    let x = f32::from_le_bytes(xb);
    for format in Fp8Format::ALL {
        check(format, x, code);
        let xs: Vec<f32> = more.iter().map(|&b| f32::from_bits(b)).collect();
        let mut a = vec![0u8; xs.len()];
        let mut b = vec![0u8; xs.len()];
        encode_with_path(CodecPath::Portable, format, &xs, None, &mut a).unwrap();
        encode_with_path(CodecPath::Avx2, format, &xs, None, &mut b).unwrap();
        let mut da = vec![0f32; xs.len()];
        let mut db = vec![0f32; xs.len()];
        decode_with_path(CodecPath::Portable, format, &a, None, &mut da).unwrap();
        decode_with_path(CodecPath::Avx2, format, &a, None, &mut db).unwrap();
        for i in 0..xs.len() {
            assert_eq!(a[i], format.encode(xs[i]));
            assert_eq!(b[i], a[i]);
            let t = format.decode(a[i]);
            assert!(da[i].to_bits() == t.to_bits() || (da[i].is_nan() && t.is_nan()));
            assert!(db[i].to_bits() == da[i].to_bits());
        }
    }
});
