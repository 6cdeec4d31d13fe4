//! All 512 codes against an independent decoder written from the format definitions, the
//! encoder against exact round-to-nearest-even at every midpoint between adjacent codes, the
//! slice paths against the scalar codec, and a cross-check against the `float8` crate's port
//! of CUDA's `cuda_fp8.hpp` conversion.

use fa_fp8::codec::{decode_with_path, encode_with_path, CodecPath};
use fa_fp8::{Fp8Format, NAN_CODE};

/// The value of `code`, from the definition (OCP 8-bit floating point spec / the FP8 paper):
/// `(−1)^s · 2^(e − bias) · (1 + m/2^M)` for a non-zero exponent field, `(−1)^s · 2^(1 − bias)
/// · m/2^M` for a zero one; e4m3 has no infinity and only `S.1111.111` is NaN; e5m2 follows
/// IEEE 754 (exponent 31: infinity when m = 0, NaN otherwise). `None` means NaN.
fn definition(format: Fp8Format, code: u8) -> Option<f64> {
    let (e_bits, m_bits, bias) = match format {
        Fp8Format::E4m3 => (4u32, 3u32, 7i32),
        Fp8Format::E5m2 => (5, 2, 15),
    };
    let s = code >> 7;
    let e = ((code >> m_bits) & ((1 << e_bits) - 1)) as i32;
    let m = (code & ((1 << m_bits) - 1)) as f64;
    let all_ones = (1 << e_bits) - 1;
    let sign = if s == 1 { -1.0 } else { 1.0 };
    match format {
        Fp8Format::E4m3 if e == all_ones && m == 7.0 => return None,
        Fp8Format::E5m2 if e == all_ones => {
            return if m == 0.0 {
                Some(sign * f64::INFINITY)
            } else {
                None
            };
        }
        _ => {}
    }
    let frac = m / f64::from(1u32 << m_bits);
    let magnitude = if e == 0 {
        2f64.powi(1 - bias) * frac
    } else {
        2f64.powi(e - bias) * (1.0 + frac)
    };
    Some(sign * magnitude)
}

fn same(a: f32, b: Option<f64>) -> bool {
    match b {
        None => a.is_nan(),
        Some(b) => a as f64 == b && a.is_sign_negative() == b.is_sign_negative(),
    }
}

#[test]
fn every_code_decodes_as_the_definition_says() {
    let paths = [CodecPath::Portable, CodecPath::Avx2];
    let mut checked = 0;
    for format in Fp8Format::ALL {
        let codes: Vec<u8> = (0..=255).collect();
        for path in paths {
            let mut out = vec![f32::NAN; 256];
            decode_with_path(path, format, &codes, None, &mut out).unwrap();
            for &c in &codes {
                let want = definition(format, c);
                assert!(
                    same(format.decode(c), want),
                    "{} {c:#04x} table",
                    format.name()
                );
                assert!(
                    same(out[c as usize], want),
                    "{} {c:#04x} {path:?}",
                    format.name()
                );
                assert_eq!(format.is_nan(c), want.is_none());
            }
        }
        checked += 256;
    }
    assert_eq!(checked, 512);
    // Landmarks stated by the formats (and wrong in the `float8` crate's constants).
    assert_eq!(definition(Fp8Format::E4m3, 0x7e), Some(448.0));
    assert_eq!(definition(Fp8Format::E5m2, 0x7b), Some(57344.0));
    assert_eq!(Fp8Format::E4m3.max(), 448.0);
    assert_eq!(Fp8Format::E5m2.max(), 57344.0);
}

/// Every finite non-negative code, sorted by value (each value once: +0 only).
fn ladder(format: Fp8Format) -> Vec<(u8, f64)> {
    let mut v: Vec<(u8, f64)> = (0..=0x7fu8)
        .filter_map(|c| definition(format, c).map(|x| (c, x)))
        .filter(|(_, x)| x.is_finite())
        .collect();
    v.sort_by(|a, b| a.1.total_cmp(&b.1));
    v
}

fn up(x: f32) -> f32 {
    f32::from_bits(x.to_bits() + 1)
}
fn down(x: f32) -> f32 {
    f32::from_bits(x.to_bits() - 1)
}

/// Encodes through the scalar codec and both slice paths, and checks that they agree.
fn enc(format: Fp8Format, x: f32) -> u8 {
    let scalar = format.encode(x);
    for path in [CodecPath::Portable, CodecPath::Avx2] {
        let mut out = [0xa5u8];
        encode_with_path(path, format, &[x], None, &mut out).unwrap();
        assert_eq!(out[0], scalar, "{} {x:e} {path:?}", format.name());
    }
    scalar
}

#[test]
fn encoder_rounds_every_midpoint_to_even_and_saturates() {
    for format in Fp8Format::ALL {
        let ladder = ladder(format);
        for sign in [1.0f32, -1.0] {
            let flip = |c: u8| if sign < 0.0 { c | 0x80 } else { c };
            for &(c, x) in &ladder {
                assert_eq!(enc(format, sign * x as f32), flip(c), "exact {x}");
            }
            for pair in ladder.windows(2) {
                let ((a, xa), (b, xb)) = (pair[0], pair[1]);
                let mid = ((xa + xb) / 2.0) as f32;
                assert_eq!(mid as f64, (xa + xb) / 2.0, "midpoint exact in f32");
                let even = if a & 1 == 0 { a } else { b };
                assert_eq!(enc(format, sign * mid), flip(even), "tie {xa}..{xb}");
                assert_eq!(enc(format, sign * down(mid)), flip(a), "below {mid}");
                assert_eq!(enc(format, sign * up(mid)), flip(b), "above {mid}");
            }
            // Beyond the largest finite value: everything saturates, ±∞ included.
            let (max_code, max) = *ladder.last().unwrap();
            assert_eq!(max as f32, format.max());
            let ulp = max - ladder[ladder.len() - 2].1;
            let beyond_tie = (max + ulp / 2.0) as f32;
            for x in [
                up(max as f32),
                down(beyond_tie),
                beyond_tie,
                up(beyond_tie),
                1e30,
                f32::MAX,
                f32::INFINITY,
            ] {
                assert_eq!(enc(format, sign * x), flip(max_code), "saturate {x}");
            }
            // Underflow: at most half the smallest subnormal rounds to (signed) zero.
            let half_min = format.min_subnormal() / 2.0;
            for x in [half_min, down(half_min), f32::from_bits(1), 0.0] {
                assert_eq!(enc(format, sign * x), flip(0), "underflow {x:e}");
            }
            assert_eq!(enc(format, sign * up(half_min)), flip(1));
        }
        assert_eq!(enc(format, f32::NAN), NAN_CODE);
        assert_eq!(enc(format, -f32::NAN), NAN_CODE);
        assert_eq!(enc(format, f32::from_bits(0x7f80_0001)), NAN_CODE);
    }
}

/// Nearest code by brute force over the ladder, ties to the even code, saturating.
fn nearest(format: Fp8Format, x: f32) -> u8 {
    if x.is_nan() {
        return NAN_CODE;
    }
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = (x as f64).abs().min(format.max() as f64);
    let mut best = (0u8, f64::INFINITY);
    for (c, v) in ladder(format) {
        let d = (v - a).abs();
        if d < best.1 || (d == best.1 && c & 1 == 0) {
            best = (c, d);
        }
    }
    best.0 | sign
}

#[test]
fn encoder_matches_brute_force_nearest_on_a_sweep() {
    for format in Fp8Format::ALL {
        // Dense around the FP8 range, sparse elsewhere: every 4099th bit pattern.
        let mut n = 0;
        let mut bits = 0u64;
        while bits < 1 << 32 {
            let x = f32::from_bits(bits as u32);
            let want = nearest(format, x);
            assert_eq!(format.encode(x), want, "{} {x:e}", format.name());
            bits += if (0x3a00_0000..0x4800_0000).contains(&(bits & 0x7fff_ffff)) {
                4099
            } else {
                1_000_003
            };
            n += 1;
        }
        assert!(n > 100_000);
    }
}

#[test]
fn encoder_matches_cuda_port_and_slice_paths_agree() {
    let mut xs = Vec::new();
    let mut bits = 7u64;
    while bits < 1 << 32 {
        xs.push(f32::from_bits(bits as u32));
        bits += 65_537;
    }
    for format in Fp8Format::ALL {
        let mut slices = Vec::new();
        for path in [CodecPath::Portable, CodecPath::Avx2] {
            let mut out = vec![0u8; xs.len()];
            encode_with_path(path, format, &xs, None, &mut out).unwrap();
            slices.push(out);
        }
        for (i, &x) in xs.iter().enumerate() {
            let ours = format.encode(x);
            assert_eq!(slices[0][i], ours);
            assert_eq!(slices[1][i], ours);
            if x.is_nan() {
                continue; // the port keeps a NaN's sign; CUDA's float path drops it (as we do)
            }
            let cuda = match format {
                Fp8Format::E4m3 => float8::F8E4M3::from_f32(x).to_bits(),
                Fp8Format::E5m2 => float8::F8E5M2::from_f32(x).to_bits(),
            };
            assert_eq!(ours, cuda, "{} {x:e}", format.name());
        }
    }
}

#[test]
fn scaled_paths_multiply_once() {
    let xs: Vec<f32> = (0..1000).map(|i| (i as f32 - 500.0) * 0.37).collect();
    for format in Fp8Format::ALL {
        let inv = 3.0f32;
        let mut codes = vec![0u8; xs.len()];
        fa_fp8::encode_scaled(format, &xs, inv, &mut codes).unwrap();
        let mut back = vec![0f32; xs.len()];
        fa_fp8::decode_scaled(format, &codes, 1.0 / inv, &mut back).unwrap();
        let mut rounded = xs.clone();
        fa_fp8::round_scaled_in_place(format, &mut rounded, inv, 1.0 / inv).unwrap();
        for i in 0..xs.len() {
            assert_eq!(codes[i], format.encode(xs[i] * inv));
            assert_eq!(back[i], format.decode(codes[i]) * (1.0 / inv));
            assert_eq!(rounded[i], back[i]);
        }
    }
    let mut codes = [0u8; 2];
    assert!(fa_fp8::encode_scaled(Fp8Format::E4m3, &[1.0], 1.0, &mut codes).is_err());
    assert!(fa_fp8::encode_scaled(Fp8Format::E4m3, &[1.0, 2.0], 0.0, &mut codes).is_err());
    assert_eq!(codes, [0, 0], "outputs untouched on error");
}
