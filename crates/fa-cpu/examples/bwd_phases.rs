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

mod common;

use common::{Inputs, PhaseArgs, PhaseTable};
use fa_cpu::{
    backward_with_workspace, forward, take_backward_phases, BackwardInputs, BackwardOptions,
    BackwardWorkspace, ForwardOptions, BACKWARD_PHASE_NAMES,
};
use softmax_core::{Grads, Out, Qkv};
use std::time::Instant;

fn main() {
    let args = PhaseArgs {
        heads: 8,
        seqlens: vec![1024, 2048],
        head_dims: vec![64, 128],
        threads: 2,
        reps: 3,
        masks: vec![false, true],
    }
    .parse();
    let table = PhaseTable {
        names: &BACKWARD_PHASE_NAMES[..10],
        digits: 5,
        decimals: 1,
    };
    table.header();
    for (n, d, causal) in args.shapes() {
        let problem = args.problem(n, d, causal);
        let lens = problem.min_buffer_lens();
        let mut inputs = Inputs::new();
        let (q, k, v, d_o) = (
            inputs.draw::<f32>(lens.q),
            inputs.draw::<f32>(lens.k),
            inputs.draw::<f32>(lens.v),
            inputs.draw::<f32>(lens.o),
        );
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
            threads: Some(args.threads),
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
        let mut walls: Vec<f64> = (0..args.reps).map(|_| call()).collect();
        let phases = take_backward_phases();
        let flops = 2.5 * softmax_core::flops::forward(1, args.heads, n, n, d, causal);
        table.row(
            (n, d, causal),
            &mut walls,
            flops,
            &phases[..10],
            phases[10],
            args.threads,
        );
    }
}
