//! Speed of the slice codecs: the AVX2 path, the portable path (SSE2 on x86-64) and a
//! one-element-at-a-time scalar loop (table lookup for decode), on 16 Mi elements, best of
//! several rounds, interleaved so that machine drift hits every variant alike.
//!
//! ```text
//! cargo run --release -p fa-fp8 --example codec_speed
//! ```

use fa_fp8::codec::{decode_with_path, encode_with_path, CodecPath};
use fa_fp8::Fp8Format;
use std::hint::black_box;
use std::time::Instant;

const N: usize = 1 << 24;
const ROUNDS: usize = 7;

fn main() {
    let xs: Vec<f32> = (0..N)
        .map(|i| ((i as f32) * 0.618_034).sin() * 300.0)
        .collect();
    let format = Fp8Format::E4m3;
    let mut codes = vec![0u8; N];
    let mut back = vec![0f32; N];
    let names = [
        "encode avx2",
        "encode portable",
        "encode scalar",
        "decode avx2",
        "decode portable",
        "decode scalar table",
    ];
    let mut best = [f64::INFINITY; 6];
    for _ in 0..ROUNDS {
        for (i, slot) in best.iter_mut().enumerate() {
            let t = Instant::now();
            match i {
                0 => encode_with_path(CodecPath::Avx2, format, &xs, None, &mut codes).unwrap(),
                1 => encode_with_path(CodecPath::Portable, format, &xs, None, &mut codes).unwrap(),
                2 => {
                    for (c, &x) in codes.iter_mut().zip(&xs) {
                        *c = format.encode(black_box(x));
                    }
                }
                3 => decode_with_path(CodecPath::Avx2, format, &codes, None, &mut back).unwrap(),
                4 => {
                    decode_with_path(CodecPath::Portable, format, &codes, None, &mut back).unwrap()
                }
                _ => {
                    for (b, &c) in back.iter_mut().zip(&codes) {
                        *b = format.decode(black_box(c));
                    }
                }
            }
            *slot = slot.min(t.elapsed().as_secs_f64());
        }
    }
    black_box((&codes, &back));
    println!("e4m3, {N} elements, best of {ROUNDS} (ns per element; Gelem/s):");
    for (name, t) in names.iter().zip(best) {
        println!(
            "  {name:22} {:6.3} ns  {:6.2} Gelem/s",
            t * 1e9 / N as f64,
            N as f64 / t / 1e9
        );
    }
    println!("codec path on this CPU: {:?}", fa_fp8::codec::codec_path());
}
