//! Times split-KV decode (`fa_cpu::forward` over a padded or paged KV cache) beside a
//! STREAM-like copy on the same threads, in alternating rounds, and prints the K/V read
//! bandwidth, the copy bandwidth (read + write bytes) and the median per-round ratio — the
//! measurement of `fa bench --decode`, without the CLI's dependencies:
//!
//! ```text
//! cargo run --release -p fa-cpu --example bench_decode -- \
//!     --dtype bf16 --batch 4 --cache 8192 --heads 32 --heads-kv 8 --head-dim 128 --page 16
//! ```
//!
//! Flags: `--dtype f32|bf16|f16`, `--batch`, `--cache` (keys per sequence), `--heads`,
//! `--heads-kv`, `--head-dim`, `--queries` (per sequence, default 1), `--page` (block size;
//! 0: padded cache), `--threads` (default: all cores), `--splits` (default: the library's
//! rule), `--rounds` (default 9), `--copy-mib` (copy buffer size; default the K/V bytes
//! within 256 MiB..1 GiB; 0: a token copy, to profile the decode alone), `--pf` (prefetch
//! schedules to alternate, e.g. `phase,next,ahead:4,off`; see `fa_cpu::DecodePrefetch::parse`),
//! `--misalign` (bytes past a 64-byte boundary where K and V start; default 0, on a line as a
//! runtime allocates a cache: the AMX path reads them in place, and misaligned rows cost it),
//! `--simd auto|amx|avx512f|avx2|scalar` (default auto), `--no-amx-pv` (the decode's `P·V`
//! in f32 on the SIMD kernels, not on AMX tiles: `fa_cpu::DecodeOptions::amx_pv`),
//! `--bf16-dots` (the bf16 `Q·Kᵀ` by `vdpbf16ps` off AMX: `DecodeOptions::bf16_dots`).

mod common;

use common::{median, Inputs, Placed};
use fa_cpu::{
    forward_with_workspace, DecodeOptions, DecodePrefetch, Element, ForwardOptions, SimdLevel,
    Workspace,
};
use softmax_core::{Out, ProblemDesc, Qkv};
use std::time::Instant;

fn arg(args: &[String], name: &str, default: usize) -> usize {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map_or(default, |v| {
            v.parse()
                .unwrap_or_else(|_| panic!("{name} {v}: not a number"))
        })
}

fn run<T: Element>(args: &[String]) {
    let (b, n, h, hkv, d) = (
        arg(args, "--batch", 4),
        arg(args, "--cache", 8192),
        arg(args, "--heads", 32),
        arg(args, "--heads-kv", 8),
        arg(args, "--head-dim", 128),
    );
    let (sq, page, rounds) = (
        arg(args, "--queries", 1),
        arg(args, "--page", 0),
        arg(args, "--rounds", 9),
    );
    let threads = arg(
        args,
        "--threads",
        std::thread::available_parallelism().map_or(1, |n| n.get()),
    );
    let splits = arg(args, "--splits", 0);
    let used = vec![n as u32; b];
    let blocks_per_seq = n.div_ceil(page.max(1));
    // Blocks in a scrambled order (a fixed odd stride through the pool), as an allocator
    // leaves them.
    let pool = b * blocks_per_seq;
    let table: Vec<i32> = (0..pool).map(|i| ((i * 7919) % pool) as i32).collect();
    let (outer, rows) = if page == 0 { (b, n) } else { (pool, page) };
    let base = ProblemDesc::new(b, sq, n, h, hkv, d);
    let desc = if page == 0 {
        base.padded_cache(&used)
    } else {
        base.paged_cache(&used, &table, blocks_per_seq, page, pool)
    };
    let problem = desc.validate(256).expect("valid shape");
    let mut inputs = Inputs::new();
    let q = inputs.draw::<T>(b * sq * h * d);
    // K and V on cache lines unless `--misalign BYTES` asks otherwise (a NumPy array, say,
    // is 16 bytes past one).
    let misalign = arg(args, "--misalign", 0);
    let k = Placed::new(&inputs.draw::<T>(outer * rows * hkv * d), misalign);
    let v = Placed::new(&inputs.draw::<T>(outer * rows * hkv * d), misalign);
    let (k, v) = (k.as_slice(), v.as_slice());
    let mut o = vec![T::from_f32(0.0); b * sq * h * d];
    let flag = |name: &str| args.iter().any(|a| a == name);
    let simd = match args
        .iter()
        .position(|a| a == "--simd")
        .map(|i| args[i + 1].as_str())
    {
        None | Some("auto") => SimdLevel::Auto,
        Some("amx") => SimdLevel::Amx,
        Some("avx512f") => SimdLevel::Avx512f,
        Some("avx2") => SimdLevel::Avx2Fma,
        Some("scalar") => SimdLevel::Scalar,
        Some(other) => panic!("--simd {other}: auto, amx, avx512f, avx2 or scalar"),
    };
    let base = ForwardOptions {
        threads: Some(threads),
        kv_splits: (splits > 0).then_some(splits),
        simd,
        decode: DecodeOptions {
            amx_pv: !flag("--no-amx-pv"),
            bf16_dots: flag("--bf16-dots"),
            ..DecodeOptions::default()
        },
        ..ForwardOptions::default()
    };
    let mut ws = Workspace::new();
    let kv_bytes = (2 * b * n * hkv * d * std::mem::size_of::<T>()) as f64;
    // `--copy-mib 0` leaves the copy out (profiling the decode alone).
    let copy_len = match arg(args, "--copy-mib", 0) {
        0 if args.iter().any(|a| a == "--copy-mib") => 1 << 12,
        0 => (kv_bytes as usize).clamp(256 << 20, 1 << 30),
        mib => mib << 20,
    };
    let (src, mut dst) = (vec![1u8; copy_len], vec![0u8; copy_len]);
    let mut copy = || {
        let chunk = copy_len.div_ceil(threads);
        let t = Instant::now();
        std::thread::scope(|s| {
            for (a, z) in src.chunks(chunk).zip(dst.chunks_mut(chunk)) {
                s.spawn(move || z.copy_from_slice(a));
            }
        });
        2.0 * copy_len as f64 / t.elapsed().as_secs_f64() / 1e9
    };
    let mut call = |prefetch: DecodePrefetch| {
        let opts = ForwardOptions {
            decode: DecodeOptions {
                prefetch,
                ..base.decode
            },
            ..base
        };
        let t = Instant::now();
        let stats = forward_with_workspace(
            &problem,
            Qkv::new(&q[..], k, v),
            Out::new(&mut o[..]),
            &opts,
            &mut ws,
        )
        .expect("decode runs");
        (t.elapsed().as_secs_f64(), stats.kv_splits)
    };
    // `--pf a,b,..`: prefetch schedules alternated within each round (DecodePrefetch::parse).
    let modes: Vec<DecodePrefetch> = match args.iter().position(|a| a == "--pf") {
        Some(i) => args[i + 1]
            .split(',')
            .map(|m| DecodePrefetch::parse(m).unwrap_or_else(|| panic!("--pf {m}?")))
            .collect(),
        None => vec![DecodePrefetch::default()],
    };
    let (_, split_count) = call(modes[0]);
    copy();
    let mut times = vec![Vec::new(); modes.len()];
    let (mut copies, mut ratios) = (times.clone(), times.clone());
    for round in 0..rounds.max(1) {
        for k in 0..modes.len() {
            // The order flips every round.
            let m = if round % 2 == 0 {
                k
            } else {
                modes.len() - 1 - k
            };
            let c = copy();
            let (t, _) = call(modes[m]);
            times[m].push(t);
            copies[m].push(c);
            ratios[m].push(kv_bytes / t / 1e9 / c);
        }
    }
    for m in 0..modes.len() {
        let t = median(&mut times[m]);
        println!(
            "{} b{b} cache {n} h{h}/{hkv} d{d} q{sq} page {} misalign {misalign} threads {threads} \
             splits {split_count} \
             prefetch {:?}: {:.3} ms, K/V {:.2} GB/s, copy {:.2} GB/s, ratio {:.3} (median of {} \
             rounds)",
            T::NAME,
            if page == 0 {
                "pad".to_string()
            } else {
                page.to_string()
            },
            modes[m],
            t * 1e3,
            kv_bytes / t / 1e9,
            median(&mut copies[m]),
            median(&mut ratios[m]),
            rounds.max(1)
        );
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let dtype = args
        .iter()
        .position(|a| a == "--dtype")
        .and_then(|i| args.get(i + 1))
        .map_or("f32", |s| s.as_str());
    match dtype {
        "f32" => run::<f32>(&args),
        "bf16" => run::<half::bf16>(&args),
        "f16" => run::<half::f16>(&args),
        other => panic!("--dtype {other}: f32, bf16 or f16"),
    }
}
