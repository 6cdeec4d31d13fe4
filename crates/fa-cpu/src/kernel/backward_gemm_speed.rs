//! Timing of the backward's tile products alone (ignored test: `cargo test --release -p fa-cpu
//! --lib gemm_speed -- --ignored --nocapture`): GFLOP/s of each product's shape, one thread.

use super::backward_gemm::{gemm, gemm_wide, Dest, Operands};
use crate::arch::{Arch, SimdLevel};
use crate::dispatch::{dispatch, Isa, SimdTask};
use std::time::Instant;

struct Speed {
    nk: usize,
    rows: usize,
    cols: usize,
    b_stride: usize,
    x_stride: usize,
    c_stride: usize,
    accumulate: bool,
    variant: usize,
    reps: usize,
}

impl SimdTask for Speed {
    type Output = f64;
    #[inline(always)]
    unsafe fn run<A: Arch, const QK: usize, const NR: usize, const PV: usize>(self) -> f64 {
        let b = vec![0.5f32; self.nk * self.b_stride + 64];
        let x = vec![0.25f32; self.nk * self.x_stride + 64];
        let mut c = vec![0.0f32; self.rows * self.c_stride + 64];
        let ops = Operands {
            b: b.as_ptr(),
            b_stride: self.b_stride,
            x: x.as_ptr(),
            x_stride: self.x_stride,
        };
        let mut best = f64::INFINITY;
        for _ in 0..15 {
            let start = Instant::now();
            for _ in 0..self.reps {
                let dest = Dest {
                    c: c.as_mut_ptr(),
                    c_stride: self.c_stride,
                    accumulate: self.accumulate,
                };
                let (nk, rows, cols) = (self.nk, self.rows, self.cols);
                // SAFETY: buffers sized above for these strides; A available.
                unsafe {
                    match self.variant {
                        0 => gemm::<A, PV, NR>(ops, nk, rows, cols, dest, None),
                        1 => gemm::<A, 4, 4>(ops, nk, rows, cols, dest, None),
                        2 => gemm::<A, 8, 2>(ops, nk, rows, cols, dest, None),
                        4 => gemm_wide::<A>(ops.into(), nk, rows, cols, dest),
                        _ => gemm::<A, 6, 4>(ops, nk, rows, cols, dest, None),
                    }
                }
                std::hint::black_box(&mut c);
            }
            best = best.min(start.elapsed().as_secs_f64());
        }
        2.0 * (self.nk * self.rows * self.cols * self.reps) as f64 / best / 1e9
    }
}

pub fn gemm_speed() {
    let Some(isa) = Isa::new(SimdLevel::Avx512f) else {
        return;
    };
    // (name, nk, rows, cols, b_stride, x_stride, c_stride, accumulate)
    for (name, nk, rows, cols, bs, xs, cs, acc) in [
        ("S d64", 64, 64, 64, 64, 64, 64, false),
        ("S d64 odd", 64, 64, 64, 80, 80, 80, false),
        ("S d128", 128, 64, 64, 64, 64, 64, false),
        ("S d128 odd", 128, 64, 64, 80, 80, 80, false),
        ("dV d64", 64, 64, 64, 64, 64, 64, true),
        ("dV d64 odd", 64, 64, 64, 80, 80, 80, true),
        ("dV d128", 64, 64, 128, 64, 128, 128, true),
        ("dV d128 odd", 64, 64, 128, 80, 144, 144, true),
        ("S 96x96 d128", 128, 96, 96, 112, 112, 112, false),
        ("dV 96 d128", 96, 96, 128, 112, 144, 144, true),
    ] {
        let mut line = format!("{name:>14}:");
        for variant in 0..5 {
            if (variant == 3 && rows % 6 != 0) || (variant == 1 && cols % 64 != 0 && cols != 64) {
                line += "      -";
                continue;
            }
            let g = dispatch(
                isa,
                Speed {
                    nk,
                    rows,
                    cols,
                    b_stride: bs,
                    x_stride: xs,
                    c_stride: cs,
                    accumulate: acc,
                    variant,
                    reps: 200,
                },
            );
            line += &format!(" {g:6.1}");
        }
        println!("{line}   (8x3, 4x4, 8x2, 6x4, wide 6x4 + tail)");
    }
}
