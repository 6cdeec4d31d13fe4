//! Forward benchmark of the fa-cuda kernel on the FlashAttention paper shapes: 16k tokens
//! (batch·seqlen = 16384), hidden 2048 (heads = 2048/hdim), bf16, seqlen 512…16k, hdim
//! 64/128/256, causal and not. Timed with CUDA events around each launch, median of `--iters`
//! launches after `--warmup`; FLOPs = 4·B·H·N²·D, halved when causal.
//!
//! ```text
//! fa-cuda-bench [--hdims 64,128,256] [--seqlens 512,...,16384] [--causal both|yes|no]
//!               [--iters 30] [--warmup 5] [--peers torch_sdpa.json] [--tiles default,128x64x4x2]
//! ```
//! With `--peers` (the `--json` output of `torch_sdpa.py`, run in the same device call) it
//! prints our TFLOP/s over PyTorch SDPA's flash and cudnn backends for each shape.

use fa_cuda::{Device, ForwardOptions, Tiles};
use fa_reference::Rng;
use half::bf16;
use softmax_core::ProblemDesc;
use std::process::ExitCode;

struct Args {
    hdims: Vec<usize>,
    seqlens: Vec<usize>,
    causal: Vec<bool>,
    iters: usize,
    warmup: usize,
    peers: Option<String>,
    tiles: Vec<Option<Tiles>>,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        hdims: vec![64, 128, 256],
        seqlens: vec![512, 1024, 2048, 4096, 8192, 16384],
        causal: vec![false, true],
        iters: 30,
        warmup: 5,
        peers: None,
        tiles: vec![None],
    };
    let list = |s: &str| -> Result<Vec<usize>, String> {
        s.split(',')
            .map(|x| x.trim().parse().map_err(|e| format!("{x}: {e}")))
            .collect()
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--hdims" => args.hdims = list(&value()?)?,
            "--seqlens" => args.seqlens = list(&value()?)?,
            "--causal" => {
                args.causal = match value()?.as_str() {
                    "both" => vec![false, true],
                    "yes" => vec![true],
                    "no" => vec![false],
                    other => return Err(format!("--causal both|yes|no, not {other}")),
                }
            }
            "--iters" => args.iters = value()?.parse().map_err(|e| format!("--iters: {e}"))?,
            "--warmup" => args.warmup = value()?.parse().map_err(|e| format!("--warmup: {e}"))?,
            "--peers" => args.peers = Some(value()?),
            // Tile overrides to compare (tuning), e.g. `default,128x64x4x2,64x128x4x3`.
            "--tiles" => {
                args.tiles = value()?
                    .split(',')
                    .map(|t| match t {
                        "default" => Ok(None),
                        t => Tiles::parse(t).map(Some).ok_or(format!("bad tiles {t}")),
                    })
                    .collect::<Result<_, _>>()?
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(args)
}

/// One peer row of torch_sdpa.py's JSON: (hdim, seqlen, causal) → (flash, cudnn) TFLOP/s.
struct PeerRow {
    hdim: usize,
    seqlen: usize,
    causal: bool,
    flash: Option<f64>,
    cudnn: Option<f64>,
}

/// Reads the flat JSON objects torch_sdpa.py writes (no nesting, known keys).
fn read_peers(path: &str) -> Result<Vec<PeerRow>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))?;
    let field = |obj: &str, key: &str| -> Option<String> {
        let at = obj.find(&format!("\"{key}\""))?;
        let rest = &obj[at + key.len() + 2..];
        let rest = rest[rest.find(':')? + 1..].trim_start();
        let end = rest.find([',', '}']).unwrap_or(rest.len());
        Some(rest[..end].trim().to_string())
    };
    let mut rows = Vec::new();
    for obj in text.split('{').skip(1) {
        let num = |k: &str| field(obj, k).and_then(|v| v.parse::<f64>().ok());
        let (Some(hdim), Some(seqlen), Some(causal)) =
            (num("hdim"), num("seqlen"), field(obj, "causal"))
        else {
            continue;
        };
        rows.push(PeerRow {
            hdim: hdim as usize,
            seqlen: seqlen as usize,
            causal: causal == "true",
            flash: num("flash_fwd_tflops"),
            cudnn: num("cudnn_fwd_tflops"),
        });
    }
    Ok(rows)
}

fn median(mut xs: Vec<f32>) -> f32 {
    xs.sort_by(|a, b| a.total_cmp(b));
    xs.get(xs.len() / 2).copied().unwrap_or(f32::NAN)
}

fn run(args: &Args) -> Result<(), String> {
    let device = Device::open(0).map_err(|e| e.to_string())?;
    println!(
        "device: {} ({}, {} SMs)",
        device.name(),
        device.arch(),
        device.sm_count()
    );
    let peers = match &args.peers {
        Some(p) => read_peers(p).unwrap_or_else(|e| {
            eprintln!("no peer numbers: {e}");
            Vec::new()
        }),
        None => Vec::new(),
    };
    // Every shape holds 16384 tokens × 2048 hidden per tensor: one random set serves all.
    let elements = 16384 * 2048;
    let mut rng = Rng::new(2024);
    let mut draw = || -> Vec<bf16> {
        (0..elements)
            .map(|_| bf16::from_f64(rng.normal()))
            .collect()
    };
    let (hq, hk, hv) = (draw(), draw(), draw());
    let err = |e: fa_cuda::CudaError| e.to_string();
    let q = device.upload(&hq).map_err(err)?;
    let k = device.upload(&hk).map_err(err)?;
    let v = device.upload(&hv).map_err(err)?;
    let mut out = device.alloc_zeroed::<bf16>(elements).map_err(err)?;
    println!(
        "{:>5} {:>6} {:>5} {:>5} {:>6} {:>10} {:>9} {:>8} {:>8} {:>7} {:>7}",
        "hdim",
        "seqlen",
        "batch",
        "heads",
        "causal",
        "median_ms",
        "TFLOP/s",
        "flash",
        "cudnn",
        "/flash",
        "/cudnn"
    );
    let mut lines = Vec::new();
    for &tiles in &args.tiles {
        let opts = ForwardOptions {
            tiles,
            ..ForwardOptions::default()
        };
        for &d in &args.hdims {
            for &n in &args.seqlens {
                for &causal in &args.causal {
                    let (batch, heads) = ((16384 / n).max(1), 2048 / d);
                    let mut desc = ProblemDesc::new(batch, n, n, heads, heads, d);
                    if causal {
                        desc = desc.causal();
                    }
                    let t0 = std::time::Instant::now();
                    let times = desc.validate(256).map_err(Into::into).and_then(|problem| {
                        device.time_forward(
                            &problem,
                            softmax_core::Qkv::new(&q, &k, &v),
                            &mut out,
                            &opts,
                            args.warmup,
                            args.iters,
                        )
                    });
                    let times = match times {
                        Ok(t) => t,
                        Err(e) => {
                            println!("{d:>5} {n:>6} causal={causal} tiles {tiles:?}: {e}");
                            continue;
                        }
                    };
                    let ms = median(times) as f64;
                    let flops = 4.0 * (batch * heads) as f64 * (n * n * d) as f64
                        / if causal { 2.0 } else { 1.0 };
                    let tflops = flops / (ms * 1e-3) / 1e12;
                    let peer = peers
                        .iter()
                        .find(|p| p.hdim == d && p.seqlen == n && p.causal == causal);
                    let f = peer.and_then(|p| p.flash);
                    let c = peer.and_then(|p| p.cudnn);
                    let fmt = |x: Option<f64>| x.map_or("-".to_string(), |x| format!("{x:.1}"));
                    let ratio = |x: Option<f64>| {
                        x.map_or("-".to_string(), |x| format!("{:.2}", tflops / x))
                    };
                    let line = format!(
                    "{d:>5} {n:>6} {batch:>5} {heads:>5} {causal:>6} {ms:>10.3} {tflops:>9.1} {:>8} {:>8} {:>7} {:>7}",
                    fmt(f), fmt(c), ratio(f), ratio(c)
                );
                    let name = tiles.map_or("default".to_string(), |t| {
                        format!(
                            "{}x{}x{}x{}x{}",
                            t.block_m, t.block_n, t.warps, t.min_blocks, t.stages
                        )
                    });
                    let line = format!("{line} {name}");
                    println!(
                        "{line}  ({:.1} s incl. warm-up)",
                        t0.elapsed().as_secs_f64()
                    );
                    lines.push(line);
                }
            }
        }
    }
    println!("\nsummary (TFLOP/s; ratios over PyTorch SDPA measured in the same device call):");
    for l in lines {
        println!("{l}");
    }
    Ok(())
}

fn main() -> ExitCode {
    match parse_args().and_then(|a| run(&a)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("fa-cuda-bench: {e}");
            ExitCode::FAILURE
        }
    }
}
