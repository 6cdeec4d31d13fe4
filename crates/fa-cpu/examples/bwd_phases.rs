//! Where the backward's time goes: per phase (kernel/phase_timing.rs), summed over workers,
//! as milliseconds per call and as a share of the tasks' time, for f32 shapes B=1:
//!
//! ```text
//! cargo run --release -p fa-cpu --features phase-timing --example bwd_phases -- \
//!     --heads 8 --seqlens 1024,2048 --head-dims 64,128 --threads 2 --reps 3
//! ```
//!
//! `idle` is workers × wall time minus the tasks' time (a worker waiting for the others, or
//! the call's set-up). A profiling aid: the timers themselves cost about 1 % at D=64.

use fa_cpu::{
    backward_with_workspace, forward, take_backward_phases, BackwardInputs, BackwardOptions,
    BackwardWorkspace, ForwardOptions, BACKWARD_PHASE_NAMES,
};
use softmax_core::{Grads, Out, ProblemDesc, Qkv};
use std::time::Instant;

fn main() {
    let mut heads = 8usize;
    let mut seqlens = vec![1024usize, 2048];
    let mut head_dims = vec![64usize, 128];
    let mut threads = 2usize;
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
    for name in BACKWARD_PHASE_NAMES.iter().take(10) {
        print!(" {name:>9}");
    }
    println!(" {:>9} {:>9}", "other", "idle");
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
                let mut draw = |len: usize| -> Vec<f32> {
                    (0..len)
                        .map(|_| {
                            state = state
                                .wrapping_mul(6_364_136_223_846_793_005)
                                .wrapping_add(1_442_695_040_888_963_407);
                            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
                        })
                        .collect()
                };
                let (q, k, v, d_o) = (draw(lens.q), draw(lens.k), draw(lens.v), draw(lens.o));
                let mut o = vec![0.0f32; lens.o];
                let mut lse = vec![0.0f32; problem.lse_len()];
                let qkv = Qkv::new(&q[..], &k[..], &v[..]);
                forward(
                    &problem,
                    qkv,
                    Out::with_lse(&mut o[..], &mut lse[..]),
                    &ForwardOptions::default(),
                )
                .unwrap();
                let (mut dq, mut dk, mut dv) = (
                    vec![0.0f32; lens.q],
                    vec![0.0f32; lens.k],
                    vec![0.0f32; lens.v],
                );
                let opts = BackwardOptions {
                    threads: Some(threads),
                    ..BackwardOptions::default()
                };
                let mut ws = BackwardWorkspace::new();
                let mut call = || {
                    let inputs = BackwardInputs {
                        o: &o[..],
                        d_o: &d_o[..],
                        lse: &lse[..],
                    };
                    let grads = Grads {
                        dq: &mut dq[..],
                        dk: &mut dk[..],
                        dv: &mut dv[..],
                    };
                    let start = Instant::now();
                    backward_with_workspace(&problem, qkv, inputs, grads, &opts, &mut ws).unwrap();
                    start.elapsed().as_secs_f64()
                };
                call();
                take_backward_phases();
                let mut walls: Vec<f64> = (0..reps).map(|_| call()).collect();
                let phases = take_backward_phases();
                walls.sort_by(f64::total_cmp);
                let wall: f64 = walls.iter().sum::<f64>() / reps as f64;
                let flops = 2.5 * softmax_core::flops::forward(1, heads, n, n, d, causal);
                let per = |x: f64| x / reps as f64 * 1e3;
                let task = phases[10];
                print!(
                    "{n:>5} {d:>4} {:>6} {:>8.2} {:>7.1}",
                    if causal { "yes" } else { "no" },
                    walls[reps / 2] * 1e3,
                    flops / walls[reps / 2] / 1e9
                );
                let mut named = 0.0;
                for &x in phases.iter().take(10) {
                    named += x;
                    print!(" {:>5.1}/{:>2.0}%", per(x), 100.0 * x / task);
                }
                let idle = threads as f64 * wall * reps as f64 - task;
                println!(
                    " {:>5.1}/{:>2.0}% {:>5.1}/{:>2.0}%",
                    per(task - named),
                    100.0 * (task - named) / task,
                    per(idle),
                    100.0 * idle / task
                );
            }
        }
    }
}
