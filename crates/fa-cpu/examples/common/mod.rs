//! What the fa-cpu examples share: their deterministic inputs, a median, and the flags, shapes
//! and table of the phase profilers (`bwd_phases`, `amx_phases`).

// Each example uses a part of this module.
#![allow(dead_code)]

use fa_cpu::Element;
use softmax_core::{Problem, ProblemDesc};

/// Deterministic pseudo-random inputs in [-1, 1): a cheap LCG (the values only need to be
/// ordinary numbers), one stream drawn in order, the same in every example.
pub struct Inputs {
    state: u64,
}

impl Inputs {
    /// A stream from the examples' one seed.
    pub fn new() -> Inputs {
        Inputs {
            state: 0x2545_f491_4f6c_dd1d,
        }
    }

    /// The next `n` values of the stream, rounded to `T`.
    pub fn draw<T: Element>(&mut self, n: usize) -> Vec<T> {
        (0..n)
            .map(|_| {
                self.state = self
                    .state
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                T::from_f32(((self.state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0)
            })
            .collect()
    }
}

/// Values placed `misalign` bytes past a 64-byte boundary (a multiple of the element size
/// below 64): 0 puts them on a cache line, as PyTorch's CPU allocator and inference runtimes
/// place a KV cache. A `Vec<T>` alone promises no such thing (glibc returns large blocks 16
/// bytes past a page), and the AMX decode reads K and V rows in place, where a 64-byte tile
/// row that straddles two lines costs twice the lines (docs/history/gpu-notes.md, 2026-12-05).
pub struct Placed<T> {
    buf: Vec<T>,
    at: usize,
}

impl<T: Copy> Placed<T> {
    /// A copy of `values` (not empty) at the placement.
    pub fn new(values: &[T], misalign: usize) -> Placed<T> {
        let size = std::mem::size_of::<T>();
        assert!(
            misalign < 64 && misalign.is_multiple_of(size),
            "misalign {misalign}"
        );
        let slack = (64 + misalign) / size;
        let mut buf = Vec::with_capacity(values.len() + slack);
        let start = buf.as_ptr() as usize;
        let at = (((64 - start % 64) % 64) + misalign) / size;
        // The capacity never changes below, so the placement holds.
        buf.extend(std::iter::repeat_n(values[0], at));
        buf.extend_from_slice(values);
        Placed { buf, at }
    }

    /// The values.
    pub fn as_slice(&self) -> &[T] {
        &self.buf[self.at..]
    }
}

/// The median of `xs` (the upper one of an even count), sorting them.
pub fn median(xs: &mut [f64]) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// The flags of a phase profiler: `--heads`, `--seqlens` and `--head-dims` (comma-separated
/// lists), `--threads`, `--reps` and `--masks` (comma-separated: `causal`, or anything else
/// for none).
pub struct PhaseArgs {
    /// Heads (query and KV) of every shape.
    pub heads: usize,
    /// Sequence lengths swept (queries = keys).
    pub seqlens: Vec<usize>,
    /// Head dims swept.
    pub head_dims: Vec<usize>,
    /// Worker threads.
    pub threads: usize,
    /// Timed calls per shape (after one untimed call).
    pub reps: usize,
    /// Masks swept: causal or not.
    pub masks: Vec<bool>,
}

impl PhaseArgs {
    /// These values, overridden by the command line's flags (a bad flag panics: a profiling
    /// aid).
    pub fn parse(mut self) -> PhaseArgs {
        let mut it = std::env::args().skip(1);
        let list = |s: String| -> Vec<usize> { s.split(',').map(|x| x.parse().unwrap()).collect() };
        while let Some(flag) = it.next() {
            let v = it.next().expect("flag value");
            match flag.as_str() {
                "--heads" => self.heads = v.parse().unwrap(),
                "--seqlens" => self.seqlens = list(v),
                "--head-dims" => self.head_dims = list(v),
                "--threads" => self.threads = v.parse().unwrap(),
                "--reps" => self.reps = v.parse().unwrap(),
                "--masks" => self.masks = v.split(',').map(|m| m == "causal").collect(),
                other => panic!("unknown flag {other}"),
            }
        }
        self
    }

    /// The shapes swept, `(seqlen, head_dim, causal)`, seqlens outermost.
    pub fn shapes(&self) -> Vec<(usize, usize, bool)> {
        let mut out = Vec::new();
        for &n in &self.seqlens {
            for &d in &self.head_dims {
                for &causal in &self.masks {
                    out.push((n, d, causal));
                }
            }
        }
        out
    }

    /// The validated problem of one shape: one sequence of `seqlen` queries and keys, `heads`
    /// heads of `head_dim`.
    pub fn problem(&self, seqlen: usize, head_dim: usize, causal: bool) -> Problem<'static> {
        let mut desc = ProblemDesc::new(1, seqlen, seqlen, self.heads, self.heads, head_dim);
        if causal {
            desc = desc.causal();
        }
        desc.validate(256).unwrap()
    }
}

/// A phase profiler's table: per shape the median wall time and throughput, then per named
/// phase its milliseconds per call and share of the tasks' time, then the tasks' time outside
/// the named phases (`other`) and the workers' time outside the tasks (`idle`).
pub struct PhaseTable<'a> {
    /// The phases' names, in the order of the sums.
    pub names: &'a [&'a str],
    /// Digits of a phase's milliseconds (its column is `2·digits − 1` wide).
    pub digits: usize,
    /// Decimals of a phase's milliseconds.
    pub decimals: usize,
}

impl PhaseTable<'_> {
    /// Prints the header line.
    pub fn header(&self) {
        let w = 2 * self.digits - 1;
        print!(
            "{:>5} {:>4} {:>6} {:>8} {:>7}",
            "N", "D", "causal", "wall_ms", "GFLOP/s"
        );
        for name in self.names {
            print!(" {name:>w$}");
        }
        println!(" {:>w$} {:>w$}", "other", "idle");
    }

    /// Prints one shape's line: `walls` the timed calls' wall seconds, `flops` one call's
    /// floating-point operations, `phases` the named phases' seconds (summed over workers
    /// and calls), `task` the tasks' seconds.
    pub fn row(
        &self,
        (n, d, causal): (usize, usize, bool),
        walls: &mut [f64],
        flops: f64,
        phases: &[f64],
        task: f64,
        threads: usize,
    ) {
        let reps = walls.len();
        let wall_sum: f64 = walls.iter().sum();
        let median = median(walls);
        print!(
            "{n:>5} {d:>4} {:>6} {:>8.2} {:>7.1}",
            if causal { "yes" } else { "no" },
            median * 1e3,
            flops / median / 1e9
        );
        let idle = threads as f64 * wall_sum - task;
        let named: f64 = phases.iter().sum();
        for x in phases.iter().copied().chain([task - named, idle]) {
            print!(
                " {:>w$.p$}/{:>pw$.0}%",
                x / reps as f64 * 1e3,
                100.0 * x / task,
                w = self.digits,
                p = self.decimals,
                pw = self.digits - 3,
            );
        }
        println!();
    }
}
