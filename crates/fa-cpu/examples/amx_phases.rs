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

mod common;

use common::{Inputs, PhaseArgs, PhaseTable};
use fa_cpu::{
    forward_with_workspace, take_amx_forward_phases, ForwardOptions, SimdLevel, Workspace,
    AMX_FORWARD_PHASE_NAMES,
};
use half::bf16;
use softmax_core::{Out, Qkv};
use std::time::Instant;

fn main() {
    let args = PhaseArgs {
        heads: 8,
        seqlens: vec![2048],
        head_dims: vec![64, 128, 256],
        threads: 1,
        reps: 3,
        masks: vec![false, true],
    }
    .parse();
    let table = PhaseTable {
        names: &AMX_FORWARD_PHASE_NAMES[..7],
        digits: 6,
        decimals: 2,
    };
    table.header();
    for (n, d, causal) in args.shapes() {
        let problem = args.problem(n, d, causal);
        let lens = problem.min_buffer_lens();
        let mut inputs = Inputs::new();
        let (q, k, v) = (
            inputs.draw::<bf16>(lens.q),
            inputs.draw::<bf16>(lens.k),
            inputs.draw::<bf16>(lens.v),
        );
        let mut o = vec![bf16::ZERO; lens.o];
        let mut lse = vec![0.0f32; problem.lse_len()];
        let opts = ForwardOptions {
            threads: Some(args.threads),
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
        let mut walls: Vec<f64> = (0..args.reps).map(|_| call()).collect();
        let phases = take_amx_forward_phases();
        let flops = softmax_core::flops::forward(1, args.heads, n, n, d, causal);
        table.row(
            (n, d, causal),
            &mut walls,
            flops,
            &phases[..7],
            phases[7],
            args.threads,
        );
    }
}
