//! Where the AMX forward's time goes: per phase (kernel/amx_phases.rs), summed over workers,
//! as milliseconds per call and as a share of the tasks' time, for bf16 shapes B=1 on AMX:
//!
//! ```text
//! cargo run --release -p fa-cpu --features phase-timing --example amx_phases -- \
//!     --heads 8 --seqlens 2048 --head-dims 64,128,256 --threads 1 --reps 3
//! ```
//!
//! `idle` is workers × wall time minus the tasks' time (a worker waiting for the others, or
//! the call's set-up). A profiling aid: the time-stamp reads cost a few per cent at D=64.

use fa_cpu::{
    forward_with_workspace, take_amx_forward_phases, ForwardOptions, SimdLevel, Workspace,
    AMX_FORWARD_PHASE_NAMES,
};
use half::bf16;
use softmax_core::{Out, ProblemDesc, Qkv};
use std::time::Instant;

fn main() {
    let mut heads = 8usize;
    let mut seqlens = vec![2048usize];
    let mut head_dims = vec![64usize, 128, 256];
    let mut threads = 1usize;
    let mut reps = 3usize;
    let mut masks = vec![false, true];
    let mut it = std::env::args().skip(1);
    let list = |s: String| -> Vec<usize> { s.split(',').map(|x| x.parse().unwrap()).collect() };
    while let Some(flag) = it.next() {
        let v = it.next().expect("flag value");
        match flag.as_str() {
            "--heads" => heads = v.parse().unwrap(),
            "--seqlens" => seqlens = list(v),
            "--head-dims" => head_dims = list(v),
            "--threads" => threads = v.parse().unwrap(),
            "--reps" => reps = v.parse().unwrap(),
            "--masks" => {
                masks = v.split(',').map(|m| m == "causal").collect();
            }
            other => panic!("unknown flag {other}"),
        }
    }
    print!(
        "{:>5} {:>4} {:>6} {:>8} {:>7}",
        "N", "D", "causal", "wall_ms", "GFLOP/s"
    );
    for name in AMX_FORWARD_PHASE_NAMES.iter().take(7) {
        print!(" {name:>11}");
    }
    println!(" {:>11} {:>11}", "other", "idle");
    for &n in &seqlens {
        for &d in &head_dims {
            for &causal in &masks {
                let mut desc = ProblemDesc::new(1, n, n, heads, heads, d);
                if causal {
                    desc = desc.causal();
                }
                let problem = desc.validate(256).unwrap();
                let lens = problem.min_buffer_lens();
                let mut state = 0x2545_f491_4f6c_dd1du64;
                let mut draw = |len: usize| -> Vec<bf16> {
                    (0..len)
                        .map(|_| {
                            state = state
                                .wrapping_mul(6_364_136_223_846_793_005)
                                .wrapping_add(1_442_695_040_888_963_407);
                            bf16::from_f32(((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0)
                        })
                        .collect()
                };
                let (q, k, v) = (draw(lens.q), draw(lens.k), draw(lens.v));
                let mut o = vec![bf16::ZERO; lens.o];
                let mut lse = vec![0.0f32; problem.lse_len()];
                let opts = ForwardOptions {
                    threads: Some(threads),
                    simd: SimdLevel::Amx,
                    ..ForwardOptions::default()
                };
                let mut ws = Workspace::new();
                let mut call = || {
                    let qkv = Qkv::new(&q[..], &k[..], &v[..]);
                    let start = Instant::now();
                    forward_with_workspace(
                        &problem,
                        qkv,
                        Out::with_lse(&mut o[..], &mut lse[..]),
                        &opts,
                        &mut ws,
                    )
                    .unwrap();
                    start.elapsed().as_secs_f64()
                };
                call();
                take_amx_forward_phases();
                let mut walls: Vec<f64> = (0..reps).map(|_| call()).collect();
                let phases = take_amx_forward_phases();
                let wall: f64 = walls.iter().sum::<f64>();
                walls.sort_by(f64::total_cmp);
                let flops = softmax_core::flops::forward(1, heads, n, n, d, causal);
                let per = |x: f64| x / reps as f64 * 1e3;
                let task = phases[7];
                print!(
                    "{n:>5} {d:>4} {:>6} {:>8.2} {:>7.1}",
                    if causal { "yes" } else { "no" },
                    walls[reps / 2] * 1e3,
                    flops / walls[reps / 2] / 1e9
                );
                let mut named = 0.0;
                for &x in phases.iter().take(7) {
                    named += x;
                    print!(" {:>6.2}/{:>3.0}%", per(x), 100.0 * x / task);
                }
                let idle = threads as f64 * wall - task;
                println!(
                    " {:>6.2}/{:>3.0}% {:>6.2}/{:>3.0}%",
                    per(task - named),
                    100.0 * (task - named) / task,
                    per(idle),
                    100.0 * idle / task
                );
            }
        }
    }
}
