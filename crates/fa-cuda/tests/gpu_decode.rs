//! GPU tests of the decode family (split-KV over a KV cache, the combine step, the append)
//! against the f64 reference (`fa_reference::attention_f64`, which reads caches through
//! `Problem::k_offset`/`v_offset`) on fresh random inputs rounded to bf16/fp16, with O and the
//! LSE poisoned (NaN) before each launch. Bounds as for the forward: normwise
//! ‖out − ref‖/‖ref‖ ≤ 1e-2, LSE within 1e-3; split results agree with the unsplit call within
//! the same normwise bound. Ignored by default: they need a CUDA GPU
//! (`cargo test -p fa-cuda --test gpu_decode -- --include-ignored`).

mod common;
use common::{device, raw, read_back, LSE_BOUND, REL_L2_BOUND};
use cudarc::driver::CudaStream;
use fa_cuda::{
    block_walk, CacheTables, CudaElement, CudaError, DType, ForwardOptions, ForwardStats, RawTensor,
};
use fa_reference::{attention_f64, compare, poison, Element, Rng, Rounding};
use half::{bf16, f16};
use softmax_core::{Mask, Out, Problem, ProblemDesc, ProblemError, Qkv};
use std::sync::Arc;

/// Where a case's keys live.
#[derive(Clone, Debug)]
enum Layout {
    /// `[batch, capacity, heads_kv, head_dim]`.
    Padded { capacity: usize },
    /// `[num_blocks, block_size, heads_kv, head_dim]` through a shuffled block table.
    Paged {
        block_size: usize,
        blocks_per_seq: usize,
        num_blocks: usize,
        table: Vec<i32>,
    },
}

/// A random decode problem with its owned tensors (f32 storage, rounded to the test dtype).
#[derive(Clone, Debug)]
struct CacheCase {
    batch: usize,
    seqlen_q: usize,
    heads_q: usize,
    heads_kv: usize,
    head_dim: usize,
    mask: Mask,
    softcap: Option<f32>,
    seqused: Vec<u32>,
    layout: Layout,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
}

impl CacheCase {
    /// A case with random inputs; `seqused` gives the batch. A padded cache holds 8–12 keys
    /// more than the longest sequence; a paged one gets `blocks_per_seq` = what the longest
    /// sequence plus 8 keys needs, plus one, and a shuffled table
    /// (every block used by at most one sequence, a few spare blocks).
    #[allow(clippy::too_many_arguments)]
    fn new(
        rng: &mut Rng,
        seqused: &[u32],
        seqlen_q: usize,
        heads_q: usize,
        heads_kv: usize,
        head_dim: usize,
        block_size: Option<usize>,
        rounding: Rounding,
    ) -> CacheCase {
        let batch = seqused.len();
        // Room for a few more tokens (the append test grows the cache).
        let longest = seqused.iter().copied().max().unwrap_or(0) as usize + 8;
        let layout = match block_size {
            None => Layout::Padded {
                capacity: longest + rng.below(5),
            },
            Some(bs) => {
                let blocks_per_seq = longest.div_ceil(bs) + 1;
                let num_blocks = batch * blocks_per_seq + 3;
                let mut ids: Vec<i32> = (0..num_blocks as i32).collect();
                for i in (1..ids.len()).rev() {
                    ids.swap(i, rng.below(i + 1));
                }
                Layout::Paged {
                    block_size: bs,
                    blocks_per_seq,
                    num_blocks,
                    table: ids[..batch * blocks_per_seq].to_vec(),
                }
            }
        };
        let mut case = CacheCase {
            batch,
            seqlen_q,
            heads_q,
            heads_kv,
            head_dim,
            mask: Mask::NONE,
            softcap: None,
            seqused: seqused.to_vec(),
            layout,
            q: Vec::new(),
            k: Vec::new(),
            v: Vec::new(),
        };
        let lens = case.problem().min_buffer_lens();
        let mut draw = |n: usize| -> Vec<f32> {
            (0..n)
                .map(|_| rounding.apply(rng.normal() as f32))
                .collect()
        };
        case.q = draw(lens.q);
        case.k = draw(lens.k);
        case.v = draw(lens.v);
        case
    }

    /// Keys a sequence's cache can hold (used or not).
    fn capacity(&self) -> usize {
        match &self.layout {
            Layout::Padded { capacity } => *capacity,
            Layout::Paged {
                block_size,
                blocks_per_seq,
                ..
            } => block_size * blocks_per_seq,
        }
    }

    fn desc(&self) -> ProblemDesc<'_> {
        let capacity = match self.layout {
            Layout::Padded { capacity } => capacity,
            Layout::Paged { .. } => 0,
        };
        let mut desc = ProblemDesc::new(
            self.batch,
            self.seqlen_q,
            capacity,
            self.heads_q,
            self.heads_kv,
            self.head_dim,
        )
        .with_mask(self.mask);
        desc.softcap = self.softcap;
        match &self.layout {
            Layout::Padded { .. } => desc.padded_cache(&self.seqused),
            Layout::Paged {
                block_size,
                blocks_per_seq,
                num_blocks,
                table,
            } => desc.paged_cache(
                &self.seqused,
                table,
                *blocks_per_seq,
                *block_size,
                *num_blocks,
            ),
        }
    }

    fn problem(&self) -> Problem<'_> {
        self.desc().validate(256).expect("valid case")
    }

    fn label(&self) -> String {
        let layout = match &self.layout {
            Layout::Padded { capacity } => format!("padded cap {capacity}"),
            Layout::Paged { block_size, .. } => format!("paged bs {block_size}"),
        };
        format!(
            "b{} sq{} h{}/{} d{} {layout} used {:?}{}{}",
            self.batch,
            self.seqlen_q,
            self.heads_q,
            self.heads_kv,
            self.head_dim,
            &self.seqused[..self.seqused.len().min(4)],
            if self.mask.is_none() { "" } else { " masked" },
            if self.softcap.is_some() {
                " softcap"
            } else {
                ""
            }
        )
    }
}

fn to_t<T: Element>(x: &[f32]) -> Vec<T> {
    x.iter().map(|&v| T::from_f64(v as f64)).collect()
}

/// [`run_with`] with `splits` and the plan's tiles and stages.
fn run_as<T: CudaElement + Element>(
    case: &CacheCase,
    splits: Option<u32>,
) -> (Vec<f64>, ForwardStats) {
    run_with::<T>(
        case,
        ForwardOptions {
            splits,
            ..ForwardOptions::default()
        },
    )
}

/// Runs `case` through `forward_host` with `opts` (its split, stage and tile overrides;
/// poisoned outputs), checks it against the oracle and that the plan took the overrides, and
/// returns O (as f64) and the stats.
fn run_with<T: CudaElement + Element>(
    case: &CacheCase,
    opts: ForwardOptions,
) -> (Vec<f64>, ForwardStats) {
    let problem = case.problem();
    let (q, k, v) = (to_t::<T>(&case.q), to_t::<T>(&case.k), to_t::<T>(&case.v));
    let lens = problem.min_buffer_lens();
    let mut out = vec![T::from_f64(0.0); lens.o];
    poison(&mut out);
    let mut lse = vec![0.0f32; problem.lse_len()];
    poison(&mut lse);
    let label = format!(
        "{} splits {:?} stages {:?} block_n {:?} warps {:?}",
        case.label(),
        opts.splits,
        opts.decode_stages,
        opts.decode_block_n,
        opts.decode_warps
    );
    let stats = device()
        .forward_host(
            &problem,
            Qkv::new(&q[..], &k[..], &v[..]),
            Out::with_lse(&mut out[..], &mut lse[..]),
            &opts,
        )
        .unwrap_or_else(|e| panic!("{label}: {e}"));
    let oracle = attention_f64(&problem, &case.q, &case.k, &case.v);
    let report = compare(&problem, &out, Some(&lse), &oracle);
    let plan = stats.decode;
    println!(
        "{label:<90} rel_l2 {:.2e} lse {:.2e} splits {:?} {}",
        report.rel_l2,
        report.lse_max_abs,
        plan.map(|p| p.num_splits),
        plan.map_or("no launch".to_string(), |p| p.variant.name())
    );
    assert!(
        report.within(REL_L2_BOUND, LSE_BOUND),
        "{label}: {report:?} exceeds rel_l2 {REL_L2_BOUND} / lse {LSE_BOUND}"
    );
    if let Some(s) = opts.splits {
        assert_eq!(plan.expect("a launch").num_splits, s, "{label}");
    }
    if let Some(plan) = plan {
        let v = plan.variant;
        assert!(opts.decode_stages.is_none_or(|s| v.stages == s), "{label}");
        assert!(
            opts.decode_block_n.is_none_or(|n| v.block_n() == n),
            "{label}"
        );
        assert!(opts.decode_warps.is_none_or(|w| v.warps == w), "{label}");
    }
    (out.iter().map(|x| x.to_f64()).collect(), stats)
}

/// Normwise difference of two outputs over the problem's O elements.
fn rel_diff(problem: &Problem, a: &[f64], b: &[f64]) -> f64 {
    let (mut d2, mut r2) = (0.0, 0.0);
    for bi in 0..problem.batch() {
        for h in 0..problem.heads_q() {
            for i in 0..problem.max_seqlen_q() {
                let o = problem.o_offset(bi, i, h);
                for c in 0..problem.head_dim_v() {
                    d2 += (a[o + c] - b[o + c]).powi(2);
                    r2 += b[o + c].powi(2);
                }
            }
        }
    }
    if r2 > 0.0 {
        (d2 / r2).sqrt()
    } else {
        d2.sqrt()
    }
}

/// The case with the plan's split count and with forced counts 1, 3 and 16, with 2 and 4
/// stages in flight (2 only at head dim 256), and with 128-key tiles of 4 warps and 32-key
/// tiles of 2 warps (head dim ≤ 128): each against the oracle, and every result against the
/// unsplit one.
fn check_splits<T: CudaElement + Element>(case: &CacheCase) {
    let problem = case.problem();
    let (unsplit, _) = run_as::<T>(case, Some(1));
    // More than two stages of head dim 256 exceed an A100's shared memory and four an H200's
    // (the plan refuses them): head dim 256 forces its default 2.
    let deep = if case.head_dim <= 128 { 4 } else { 2 };
    let small = case.head_dim <= 128;
    let runs = [
        (None, None, None, None),
        (Some(3), None, None, None),
        (Some(16), None, None, None),
        (None, Some(2), None, None),
        (Some(3), Some(deep), None, None),
        (Some(3), Some(2), small.then_some(128), None),
        (Some(5), Some(3), small.then_some(32), small.then_some(2)),
    ];
    for (splits, decode_stages, decode_block_n, decode_warps) in runs {
        let opts = ForwardOptions {
            splits,
            decode_stages,
            decode_block_n,
            decode_warps,
            ..ForwardOptions::default()
        };
        let (out, _) = run_with::<T>(case, opts);
        let d = rel_diff(&problem, &out, &unsplit);
        assert!(
            d <= REL_L2_BOUND,
            "{} {opts:?}: {d:.2e} from the unsplit call",
            case.label()
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn padded_cache_lengths_gqa_and_splits() {
    let mut rng = Rng::fresh();
    // GQA 1, 4 and 8, and MQA; lengths 0, 1, odd, a tile edge and longer.
    for (heads_q, heads_kv) in [(4, 4), (8, 2), (16, 2), (8, 1)] {
        for seqlen_q in [1, 2, 4] {
            let used = [0u32, 1, 63, 64, 65, 517, 1000 + rng.below(300) as u32];
            let case = CacheCase::new(
                &mut rng,
                &used,
                seqlen_q,
                heads_q,
                heads_kv,
                128,
                None,
                Rounding::Bf16,
            );
            check_splits::<bf16>(&case);
        }
    }
}

/// A cache's slots past each sequence's used length may hold anything (a runtime reuses its
/// memory): NaN and infinities there must not reach the output, nor block-table entries
/// outside the pool past the used blocks. Short lengths take the decode kernel's early-issue
/// fix-up (padded split 0 loads its first tiles before it knows the length, then zeroes the
/// rows past it).
#[test]
#[ignore = "needs a CUDA GPU"]
fn garbage_past_the_used_length_is_never_read_into_o() {
    let mut rng = Rng::fresh();
    for block_size in [None, Some(16), Some(64)] {
        let used = [
            0u32,
            1,
            5,
            63,
            64,
            100,
            127,
            129,
            300 + rng.below(200) as u32,
        ];
        let mut case = CacheCase::new(&mut rng, &used, 1, 8, 2, 128, block_size, Rounding::Bf16);
        let problem = case.problem();
        let capacity = case.capacity();
        let bad = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY];
        let mut slots = Vec::new();
        for b in 0..case.batch {
            for t in case.seqused[b] as usize..capacity {
                for h in 0..case.heads_kv {
                    let k_at = offset_of(&problem, b, t, h, false);
                    let v_at = offset_of(&problem, b, t, h, true);
                    slots.push((k_at, v_at));
                }
            }
        }
        for (i, (k_at, v_at)) in slots.into_iter().enumerate() {
            case.k[k_at..k_at + case.head_dim].fill(bad[i % 3]);
            case.v[v_at..v_at + case.head_dim].fill(bad[(i + 1) % 3]);
        }
        // Table entries past a sequence's used blocks are unchecked as well (validation reads
        // only the used ones): indices outside the pool there must change nothing either.
        if let Layout::Paged {
            block_size,
            blocks_per_seq,
            num_blocks,
            table,
        } = &mut case.layout
        {
            let junk = [-1, i32::MAX, *num_blocks as i32, i32::MIN];
            for (b, row) in table.chunks_exact_mut(*blocks_per_seq).enumerate() {
                let used_blocks = (case.seqused[b] as usize).div_ceil(*block_size);
                for (j, entry) in row.iter_mut().enumerate().skip(used_blocks) {
                    *entry = junk[j % junk.len()];
                }
            }
        }
        check_splits::<bf16>(&case);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn paged_cache_block_sizes_and_splits() {
    let mut rng = Rng::fresh();
    // 8, 16, 32: blocks dealt out whole within a tile (one table entry per thread and
    // tile); 64, 256: whole tiles per block; 1, 7: a table entry per row.
    for block_size in [1, 8, 16, 32, 64, 256, 7] {
        for (heads_q, heads_kv, seqlen_q) in [(8, 1, 1), (16, 2, 3), (8, 8, 2)] {
            let used = [1u32, 0, 300 + rng.below(200) as u32, 255, 257];
            let case = CacheCase::new(
                &mut rng,
                &used,
                seqlen_q,
                heads_q,
                heads_kv,
                128,
                Some(block_size),
                Rounding::Bf16,
            );
            check_splits::<bf16>(&case);
        }
    }
}

/// Paged blocks that a tile's threads read whole (8 keys or more) are walked in address order
/// (the plan's default, built from the host tables per call here) and give the oracle's result
/// as the walk in table order does, to rounding: head dims 64, 128 and 256, GQA and MQA,
/// several queries with the causal mask and a right window, softcap, split counts 1 to 16.
#[test]
#[ignore = "needs a CUDA GPU"]
fn paged_blocks_walked_in_address_order() {
    let mut rng = Rng::fresh();
    let cases = [
        (8, 128, 8, 2, 1),
        (16, 128, 8, 1, 1),
        (32, 128, 16, 2, 3),
        (16, 64, 8, 8, 2),
        (32, 64, 8, 2, 4),
        (16, 256, 8, 2, 1),
        (8, 256, 8, 2, 2),
        (64, 128, 8, 2, 2),
        (256, 128, 8, 1, 1),
        (256, 256, 16, 2, 1),
    ];
    for (block_size, head_dim, heads_q, heads_kv, seqlen_q) in cases {
        for variant in 0..3 {
            let used = [0u32, 1, 9, 64, 65, 700 + rng.below(400) as u32];
            let mut case = CacheCase::new(
                &mut rng,
                &used,
                seqlen_q,
                heads_q,
                heads_kv,
                head_dim,
                Some(block_size),
                Rounding::Bf16,
            );
            match variant {
                1 => case.mask = Mask::CAUSAL,
                2 => {
                    case.mask = Mask {
                        left: None,
                        right: Some(1),
                    };
                    case.softcap = Some(20.0);
                }
                _ => {}
            }
            let problem = case.problem();
            // Head dim 256 copies 16 rows per thread and tile: blocks of 8 go per row there.
            let walks = !(head_dim == 256 && block_size == 8);
            for splits in [Some(1), None, Some(16)] {
                let opts = |table_order: bool| ForwardOptions {
                    splits,
                    decode_table_order: table_order,
                    ..ForwardOptions::default()
                };
                let (walked, stats) = run_with::<bf16>(&case, opts(false));
                let (ordered, ordered_stats) = run_with::<bf16>(&case, opts(true));
                let plan = stats.decode.expect("a launch");
                assert_eq!(plan.block_walk, walks, "{}", case.label());
                assert!(!ordered_stats.decode.expect("a launch").block_walk);
                let d = rel_diff(&problem, &walked, &ordered);
                assert!(
                    d <= REL_L2_BOUND,
                    "{} splits {splits:?}: walked {d:.2e} from table order",
                    case.label()
                );
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn head_dims_fp16_masks_and_softcap() {
    let mut rng = Rng::fresh();
    for head_dim in [64, 96, 128, 256] {
        for block_size in [None, Some(16)] {
            let used = [700u32, 3, 129];
            let mut case = CacheCase::new(
                &mut rng,
                &used,
                4,
                8,
                2,
                head_dim,
                block_size,
                Rounding::F16,
            );
            // Causal (bottom-right against each sequence's used length), then a window.
            case.mask = Mask::CAUSAL;
            check_splits::<f16>(&case);
            case.mask = Mask {
                left: Some(100),
                right: Some(0),
            };
            check_splits::<f16>(&case);
            case.mask = Mask::NONE;
            case.softcap = Some(5.0);
            check_splits::<f16>(&case);
        }
    }
    // Causal with more queries than used keys: early rows see nothing (output 0, LSE -inf).
    let mut case = CacheCase::new(&mut rng, &[2, 0, 5], 4, 8, 2, 128, Some(16), Rounding::Bf16);
    case.mask = Mask::CAUSAL;
    check_splits::<bf16>(&case);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn many_query_heads_use_several_m_blocks() {
    let mut rng = Rng::fresh();
    // MQA with 64 query heads and 3 queries: 192 rows per KV head, several m-blocks.
    let case = CacheCase::new(&mut rng, &[333, 1], 3, 64, 1, 128, Some(16), Rounding::Bf16);
    check_splits::<bf16>(&case);
    let case = CacheCase::new(&mut rng, &[333, 70], 2, 32, 1, 64, None, Rounding::Bf16);
    check_splits::<bf16>(&case);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn long_cache_with_the_planned_splits() {
    let mut rng = Rng::fresh();
    // Llama-3 70B's layer shape at a short 8k-ish cache: the plan splits (132 SMs, 8 CTAs).
    let used = [8000 + rng.below(300) as u32];
    let case = CacheCase::new(&mut rng, &used, 1, 64, 8, 128, Some(256), Rounding::Bf16);
    let (_, stats) = run_as::<bf16>(&case, None);
    let plan = stats.decode.expect("a decode launch");
    assert!(plan.num_splits > 1, "{plan:?}");
    check_splits::<bf16>(&case);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn repeated_runs_agree_bitwise() {
    let mut rng = Rng::new(11);
    let case = CacheCase::new(
        &mut rng,
        &[900, 17],
        2,
        16,
        2,
        128,
        Some(16),
        Rounding::Bf16,
    );
    let (a, _) = run_as::<bf16>(&case, Some(5));
    let (b, _) = run_as::<bf16>(&case, Some(5));
    assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn bad_input_is_rejected_and_outputs_untouched() {
    let mut rng = Rng::new(12);
    let case = CacheCase::new(&mut rng, &[40, 3], 1, 8, 2, 64, Some(16), Rounding::Bf16);
    let problem = case.problem();
    let (q, k, v) = (
        to_t::<bf16>(&case.q),
        to_t::<bf16>(&case.k),
        to_t::<bf16>(&case.v),
    );
    let lens = problem.min_buffer_lens();
    let mut out = vec![bf16::from_f32(7.0); lens.o];
    let forced_zero = ForwardOptions {
        splits: Some(0),
        ..ForwardOptions::default()
    };
    let r = device().forward_host(
        &problem,
        Qkv::new(&q[..], &k[..], &v[..]),
        Out::new(&mut out[..]),
        &forced_zero,
    );
    assert!(matches!(
        r,
        Err(CudaError::Problem(ProblemError::Unsupported { .. }))
    ));
    let short = &k[..k.len() - 1];
    let r = device().forward_host(
        &problem,
        Qkv::new(&q[..], short, &v[..]),
        Out::new(&mut out[..]),
        &ForwardOptions::default(),
    );
    assert!(matches!(
        r,
        Err(CudaError::Problem(ProblemError::BufferTooSmall { .. }))
    ));
    assert!(out.iter().all(|&x| x == bf16::from_f32(7.0)));
    // f32 inputs are not this backend's.
    assert!(fa_cuda::supports(&problem, DType::F32).is_err());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn time_forward_times_cache_problems() {
    let mut rng = Rng::new(13);
    let case = CacheCase::new(&mut rng, &[4096], 1, 64, 8, 128, Some(16), Rounding::Bf16);
    let problem = case.problem();
    let d = device();
    let q = d.upload(&to_t::<bf16>(&case.q)).unwrap();
    let k = d.upload(&to_t::<bf16>(&case.k)).unwrap();
    let v = d.upload(&to_t::<bf16>(&case.v)).unwrap();
    let mut o = d.alloc_zeroed::<bf16>(problem.min_buffer_lens().o).unwrap();
    let times = d
        .time_forward(
            &problem,
            Qkv::new(&q, &k, &v),
            &mut o,
            &ForwardOptions::default(),
            2,
            5,
        )
        .expect("timed");
    assert_eq!(times.len(), 5);
    assert!(times.iter().all(|&t| t > 0.0), "{times:?}");
    println!("decode 4k paged bs16, 64/8 heads: {times:?} ms");
}

fn bits(x: &[f32]) -> Vec<u16> {
    x.iter().map(|&v| bf16::from_f32(v).to_bits()).collect()
}

fn table_of(case: &CacheCase) -> Option<Vec<i32>> {
    match &case.layout {
        Layout::Paged { table, .. } => Some(table.clone()),
        Layout::Padded { .. } => None,
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn caller_stream_with_device_tables_and_workspace() {
    let d = device();
    let stream: Arc<CudaStream> = d.context().new_stream().expect("a stream");
    let mut rng = Rng::fresh();
    for block_size in [None, Some(16), Some(1)] {
        let case = CacheCase::new(
            &mut rng,
            &[1000, 1, 0, 77],
            2,
            8,
            2,
            128,
            block_size,
            Rounding::Bf16,
        );
        let problem = case.problem();
        let opts = ForwardOptions {
            splits: Some(7),
            ..ForwardOptions::default()
        };
        let bytes = d
            .decode_workspace_bytes(&problem, DType::Bf16, &opts)
            .expect("workspace size");
        assert!(bytes > 0);
        let up = |x: &[u16]| stream.clone_htod(x).expect("copy");
        let (q, k, v) = (up(&bits(&case.q)), up(&bits(&case.k)), up(&bits(&case.v)));
        let mut o_host = vec![bf16::ZERO; problem.min_buffer_lens().o];
        poison(&mut o_host);
        let o = up(&o_host.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
        let mut lse_host = vec![0.0f32; problem.lse_len()];
        poison(&mut lse_host);
        let lse = stream.clone_htod(&lse_host).expect("copy");
        let used: Vec<i32> = case.seqused.iter().map(|&x| x as i32).collect();
        let used = stream.clone_htod(&used).expect("copy");
        let table = table_of(&case).map(|t| stream.clone_htod(&t).expect("copy"));
        // Blocks of 16 are walked in address order (the walk built once, as a runtime would
        // per step); blocks of 1 are read per row in table order.
        let walks = block_size == Some(16);
        let walk = walks.then(|| {
            let w = block_walk(&problem).expect("a paged cache");
            stream.clone_htod(&w).expect("copy")
        });
        let ws = stream
            .alloc_zeros::<f32>(bytes.div_ceil(4))
            .expect("workspace");
        let tables = CacheTables {
            seqused_k: raw(&used, &stream),
            block_table: table.as_ref().map(|t| raw(t, &stream)),
            block_walk: walk.as_ref().map(|w| raw(w, &stream)),
        };
        let qkv = Qkv::<RawTensor<bf16>>::new(raw(&q, &stream), raw(&k, &stream), raw(&v, &stream));
        let out = || Out::with_lse(raw(&o, &stream), raw(&lse, &stream));
        // A workspace one float short is refused before anything is queued.
        let short = raw::<f32, f32>(&ws, &stream);
        // SAFETY: the same allocation, seen shorter.
        let short = unsafe { RawTensor::<f32>::from_raw(short.ptr(), bytes / 4 - 1) };
        let r =
            d.forward_cache_on_stream(&problem, tables, Some(short), qkv, out(), &stream, &opts);
        assert!(
            matches!(r, Err(CudaError::WorkspaceTooSmall { .. })),
            "{r:?}"
        );
        let r = d.forward_cache_on_stream(&problem, tables, None, qkv, out(), &stream, &opts);
        assert!(
            matches!(r, Err(CudaError::WorkspaceTooSmall { .. })),
            "{r:?}"
        );
        let stats = d
            .forward_cache_on_stream(
                &problem,
                tables,
                Some(raw(&ws, &stream)),
                qkv,
                out(),
                &stream,
                &opts,
            )
            .expect("queued");
        let plan = stats.decode.expect("decode");
        assert_eq!((plan.num_splits, plan.block_walk), (7, walks));
        let (o_back, lse_back) = read_back(&stream, &o, &lse);
        let oracle = attention_f64(&problem, &case.q, &case.k, &case.v);
        let report = compare(&problem, &o_back, Some(&lse_back), &oracle);
        println!(
            "caller stream {:<70} rel_l2 {:.2e} lse {:.2e}",
            case.label(),
            report.rel_l2,
            report.lse_max_abs
        );
        assert!(report.within(REL_L2_BOUND, LSE_BOUND), "{report:?}");
        // The same through forward_on_stream: host tables copied (the walk built from them),
        // workspace allocated there.
        let mut o2_host = vec![bf16::ZERO; problem.min_buffer_lens().o];
        poison(&mut o2_host);
        let o2 = up(&o2_host.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
        let out2 = Out::new(raw(&o2, &stream));
        d.forward_on_stream(&problem, qkv, out2, &stream, &opts)
            .expect("queued");
        stream.synchronize().expect("synchronise");
        let o2_back: Vec<bf16> = stream
            .clone_dtoh(&o2)
            .expect("copy back")
            .into_iter()
            .map(bf16::from_bits)
            .collect();
        stream.synchronize().expect("synchronise");
        assert!(o2_back
            .iter()
            .zip(&o_back)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
    }
}

/// A decode step planned once (`plan_forward`), run eagerly (the first layer) and then
/// captured in a CUDA graph and replayed twice (the next layers, or the next steps): every
/// output is bitwise the eager run's, which matches the f64 reference. The run takes only
/// device memory (tables, walk, workspace), so nothing in it allocates, copies from the host
/// or synchronises while the stream captures.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_planned_decode_step_replays_from_a_cuda_graph() {
    use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    use fa_cuda::{ForwardTensors, PlannedKernels};
    let d = device();
    let stream: Arc<CudaStream> = d.context().new_stream().expect("a stream");
    let mut rng = Rng::fresh();
    for block_size in [None, Some(16)] {
        let case = CacheCase::new(
            &mut rng,
            &[3000, 17, 1, 800],
            1,
            8,
            2,
            128,
            block_size,
            Rounding::Bf16,
        );
        let problem = case.problem();
        let opts = ForwardOptions {
            splits: Some(5),
            ..ForwardOptions::default()
        };
        let plan = d
            .plan_forward(&problem, DType::Bf16, &opts)
            .expect("a plan");
        assert!(matches!(plan.kernels(), PlannedKernels::Decode(_)));
        assert_eq!(
            plan.workspace_bytes(),
            d.decode_workspace_bytes(&problem, DType::Bf16, &opts)
                .expect("size")
        );
        let up = |x: &[u16]| stream.clone_htod(x).expect("copy");
        let (q, k, v) = (up(&bits(&case.q)), up(&bits(&case.k)), up(&bits(&case.v)));
        let lens = problem.min_buffer_lens();
        let poisoned = || {
            let mut o_host = vec![bf16::ZERO; lens.o];
            poison(&mut o_host);
            let mut lse_host = vec![0.0f32; problem.lse_len()];
            poison(&mut lse_host);
            (
                up(&o_host.iter().map(|x| x.to_bits()).collect::<Vec<_>>()),
                stream.clone_htod(&lse_host).expect("copy"),
            )
        };
        let (o_eager, lse_eager) = poisoned();
        let (o_graph, lse_graph) = poisoned();
        let used: Vec<i32> = case.seqused.iter().map(|&x| x as i32).collect();
        let used = stream.clone_htod(&used).expect("copy");
        let table = table_of(&case).map(|t| stream.clone_htod(&t).expect("copy"));
        let walk = block_size.map(|_| {
            let w = block_walk(&problem).expect("a paged cache");
            stream.clone_htod(&w).expect("copy")
        });
        let ws = stream
            .alloc_zeros::<u8>(plan.workspace_bytes().max(1))
            .expect("workspace");
        let tables = CacheTables {
            seqused_k: raw(&used, &stream),
            block_table: table.as_ref().map(|t| raw(t, &stream)),
            block_walk: walk.as_ref().map(|w| raw(w, &stream)),
        };
        let tensors = |o, lse| ForwardTensors::<bf16> {
            qkv: Qkv::new(raw(&q, &stream), raw(&k, &stream), raw(&v, &stream)),
            out: Out::with_lse(raw(o, &stream), raw(lse, &stream)),
            cu_seqlens: None,
            tables: Some(tables),
        };
        let workspace = raw::<u8, u8>(&ws, &stream);
        let stats = d
            .run_on_stream(&plan, tensors(&o_eager, &lse_eager), workspace, &stream)
            .expect("eager run");
        assert_eq!(stats.decode.map(|p| p.num_splits), Some(5));
        // Every address taken before the capture (cudarc records its buffer events then).
        let graph_tensors = tensors(&o_graph, &lse_graph);
        stream.synchronize().expect("synchronise");
        stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .expect("capture");
        let captured = d.run_on_stream(&plan, graph_tensors, workspace, &stream);
        let graph = stream
            .end_capture(CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH)
            .expect("end capture")
            .expect("a graph");
        captured.expect("captured run");
        for _ in 0..2 {
            graph.launch().expect("replay");
        }
        let (o_a, lse_a) = read_back(&stream, &o_eager, &lse_eager);
        let (o_b, lse_b) = read_back(&stream, &o_graph, &lse_graph);
        assert!(o_a
            .iter()
            .zip(&o_b)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
        assert!(lse_a
            .iter()
            .zip(&lse_b)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
        let oracle = attention_f64(&problem, &case.q, &case.k, &case.v);
        let report = compare(&problem, &o_a, Some(&lse_a), &oracle);
        println!(
            "graph replay {:<70} rel_l2 {:.2e} lse {:.2e}",
            case.label(),
            report.rel_l2,
            report.lse_max_abs
        );
        assert!(report.within(REL_L2_BOUND, LSE_BOUND), "{report:?}");
    }
}

/// Appends `new` tokens to the host copy of a case's cache (what append_kv must do).
fn append_host(case: &CacheCase, k_new: &[f32], v_new: &[f32], new: usize) -> CacheCase {
    let mut grown = case.clone();
    let problem = case.problem();
    let row = case.heads_kv * case.head_dim;
    for b in 0..case.batch {
        for j in 0..new {
            let t = case.seqused[b] as usize + j;
            for h in 0..case.heads_kv {
                // The position's offset as the grown problem addresses it.
                let off_k = offset_of(&problem, b, t, h, false);
                let off_v = offset_of(&problem, b, t, h, true);
                let src = (b * new + j) * row + h * case.head_dim;
                grown.k[off_k..off_k + case.head_dim]
                    .copy_from_slice(&k_new[src..src + case.head_dim]);
                grown.v[off_v..off_v + case.head_dim]
                    .copy_from_slice(&v_new[src..src + case.head_dim]);
            }
        }
        grown.seqused[b] += new as u32;
    }
    grown
}

/// Element offset of key `t` of sequence `b`, KV head `h`, in the case's cache (also past the
/// used length, which `Problem::k_offset` is not asked for).
fn offset_of(problem: &Problem, b: usize, t: usize, h: usize, v: bool) -> usize {
    let s = problem.strides()[if v { 2 } else { 1 }];
    match problem.kv_cache() {
        softmax_core::KvCache::Paged {
            block_table,
            blocks_per_seq,
            block_size,
            ..
        } => {
            let blk = block_table[b * blocks_per_seq + t / block_size] as usize;
            blk * s.batch + (t % block_size) * s.seq + h * s.head
        }
        _ => b * s.batch + t * s.seq + h * s.head,
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn append_then_decode() {
    let d = device();
    let mut rng = Rng::fresh();
    for block_size in [None, Some(16), Some(1), Some(5)] {
        let new = 3;
        let case = CacheCase::new(
            &mut rng,
            &[0, 13, 200],
            new,
            8,
            2,
            64,
            block_size,
            Rounding::Bf16,
        );
        let problem = case.problem();
        let n_new = case.batch * new * case.heads_kv * case.head_dim;
        let draw = |rng: &mut Rng| -> Vec<f32> {
            (0..n_new)
                .map(|_| Rounding::Bf16.apply(rng.normal() as f32))
                .collect()
        };
        let (k_new, v_new) = (draw(&mut rng), draw(&mut rng));
        let expected = append_host(&case, &k_new, &v_new, new);
        let kn = d.upload(&to_t::<bf16>(&k_new)).unwrap();
        let vn = d.upload(&to_t::<bf16>(&v_new)).unwrap();
        let mut kc = d.upload(&to_t::<bf16>(&case.k)).unwrap();
        let mut vc = d.upload(&to_t::<bf16>(&case.v)).unwrap();
        d.append_kv(&problem, new, &kn, &vn, &mut kc, &mut vc)
            .expect("appended");
        let mut k_back = vec![bf16::ZERO; case.k.len()];
        let mut v_back = vec![bf16::ZERO; case.v.len()];
        d.download(&kc, &mut k_back).unwrap();
        d.download(&vc, &mut v_back).unwrap();
        // Exactly the host append: new rows in place, everything else untouched.
        assert!(k_back
            .iter()
            .zip(&expected.k)
            .all(|(a, &b)| a.to_f32() == b));
        assert!(v_back
            .iter()
            .zip(&expected.v)
            .all(|(a, &b)| a.to_f32() == b));
        // Decode the new tokens (causal against the grown cache) from the appended cache.
        let mut grown = expected.clone();
        grown.mask = Mask::CAUSAL;
        check_splits::<bf16>(&grown);
        // A cache without room is refused and left as it was.
        let too_many = case.capacity();
        let n_big = case.batch * too_many * case.heads_kv * case.head_dim;
        let big = d.alloc_zeroed::<bf16>(n_big).unwrap();
        let r = d.append_kv(&problem, too_many, &big, &big, &mut kc, &mut vc);
        assert!(
            matches!(
                r,
                Err(CudaError::Problem(ProblemError::CacheOverrun { .. }))
            ),
            "{r:?}"
        );
        let mut k_again = vec![bf16::ZERO; case.k.len()];
        d.download(&kc, &mut k_again).unwrap();
        assert!(k_again
            .iter()
            .zip(&k_back)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
    }
}

/// A decode step as a serving runtime runs it under a CUDA graph: the split count fixed, the
/// cache tables and the split workspace in caller memory, the call captured once on the
/// caller's stream and the graph replayed for later steps after the inputs change in place
/// (fresh queries, one more key per sequence, the block walk rebuilt into the same buffer).
/// Each replay must give the bits of a direct call on the same inputs, and those must pass
/// the f64 reference.
#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_step_captured_in_a_cuda_graph_replays_exactly() {
    use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    let d = device();
    let stream: Arc<CudaStream> = d.context().new_stream().expect("a stream");
    let mut rng = Rng::fresh();
    for block_size in [None, Some(16), Some(1)] {
        let first = CacheCase::new(
            &mut rng,
            &[1000, 1, 37, 300],
            1,
            16,
            2,
            128,
            block_size,
            Rounding::Bf16,
        );
        // The next step: fresh queries, and every sequence one key longer (the key is already
        // in the cache's random contents, as if appended).
        let mut next = first.clone();
        next.seqused.iter_mut().for_each(|n| *n += 1);
        next.q = (0..first.q.len())
            .map(|_| Rounding::Bf16.apply(rng.normal() as f32))
            .collect();
        let opts = ForwardOptions {
            splits: Some(4),
            ..ForwardOptions::default()
        };
        let (p_first, p_next) = (first.problem(), next.problem());
        let bytes = d
            .decode_workspace_bytes(&p_first, DType::Bf16, &opts)
            .expect("workspace size");
        assert_eq!(
            Some(bytes),
            d.decode_workspace_bytes(&p_next, DType::Bf16, &opts).ok(),
            "a fixed split count sizes every step's workspace alike"
        );
        let up = |x: &[u16]| stream.clone_htod(x).expect("copy");
        let (mut q, k, v) = (
            up(&bits(&first.q)),
            up(&bits(&first.k)),
            up(&bits(&first.v)),
        );
        let lens = p_first.min_buffer_lens();
        let (mut o, mut lse) = (
            stream.alloc_zeros::<u16>(lens.o).expect("O"),
            stream.alloc_zeros::<f32>(p_first.lse_len()).expect("LSE"),
        );
        let used_of = |c: &CacheCase| c.seqused.iter().map(|&x| x as i32).collect::<Vec<_>>();
        let mut used = stream.clone_htod(&used_of(&first)).expect("copy");
        let table = table_of(&first).map(|t| stream.clone_htod(&t).expect("copy"));
        let walks = block_size == Some(16);
        let mut walk = walks.then(|| {
            let w = block_walk(&p_first).expect("a paged cache");
            stream.clone_htod(&w).expect("copy")
        });
        let ws = stream
            .alloc_zeros::<f32>(bytes.div_ceil(4).max(1))
            .expect("workspace");
        // Every raw view is taken before the capture: the capture records kernels only.
        let tables = CacheTables {
            seqused_k: raw(&used, &stream),
            block_table: table.as_ref().map(|t| raw(t, &stream)),
            block_walk: walk.as_ref().map(|w| raw(w, &stream)),
        };
        let qkv = Qkv::<RawTensor<bf16>>::new(raw(&q, &stream), raw(&k, &stream), raw(&v, &stream));
        let (o_raw, lse_raw) = (
            raw::<bf16, u16>(&o, &stream),
            raw::<f32, f32>(&lse, &stream),
        );
        let out = || Out::with_lse(o_raw, lse_raw);
        let workspace = Some(raw(&ws, &stream));
        let poison_outputs =
            |o: &mut cudarc::driver::CudaSlice<u16>, lse: &mut cudarc::driver::CudaSlice<f32>| {
                let mut o_host = vec![bf16::ZERO; lens.o];
                poison(&mut o_host);
                let o_bits: Vec<u16> = o_host.iter().map(|x| x.to_bits()).collect();
                stream.memcpy_htod(&o_bits, o).expect("poison O");
                let mut lse_host = vec![0.0f32; p_first.lse_len()];
                poison(&mut lse_host);
                stream.memcpy_htod(&lse_host, lse).expect("poison LSE");
            };
        let label = first.label();
        // A direct call on `problem` (also the warm-up that compiles and loads the kernels
        // before the capture); returns O and the LSE, checked against the reference.
        let direct = |case: &CacheCase, problem: &Problem, o: &mut _, lse: &mut _| {
            poison_outputs(o, lse);
            d.forward_cache_on_stream(problem, tables, workspace, qkv, out(), &stream, &opts)
                .unwrap_or_else(|e| panic!("{label}: {e}"));
            let (o_back, lse_back) = read_back(&stream, o, lse);
            let oracle = attention_f64(problem, &case.q, &case.k, &case.v);
            let report = compare(problem, &o_back, Some(&lse_back), &oracle);
            assert!(
                report.within(REL_L2_BOUND, LSE_BOUND),
                "{label}: {report:?}"
            );
            (o_back, lse_back)
        };
        let (o_first, lse_first) = direct(&first, &p_first, &mut o, &mut lse);
        poison_outputs(&mut o, &mut lse);
        stream.synchronize().expect("synchronise");
        stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .expect("capture begins");
        let queued =
            d.forward_cache_on_stream(&p_first, tables, workspace, qkv, out(), &stream, &opts);
        let graph = stream
            .end_capture(CUgraphInstantiate_flags(0))
            .expect("capture ends")
            .expect("a graph");
        queued.unwrap_or_else(|e| panic!("{label}: queued under capture: {e}"));
        // Capturing ran nothing: the outputs still hold the poison.
        let (o_idle, _) = read_back(&stream, &o, &lse);
        assert!(
            o_idle.iter().all(|x| x.is_nan()),
            "{label}: capture ran kernels"
        );
        graph.launch().expect("replay");
        let (o_replay, lse_replay) = read_back(&stream, &o, &lse);
        let same =
            |a: &[bf16], b: &[bf16]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        let same_f32 =
            |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same(&o_replay, &o_first), "{label}: replayed O differs");
        assert!(
            same_f32(&lse_replay, &lse_first),
            "{label}: replayed LSE differs"
        );
        // The next step: inputs changed in place, the same graph replayed.
        stream
            .memcpy_htod(&bits(&next.q), &mut q)
            .expect("new queries");
        stream
            .memcpy_htod(&used_of(&next), &mut used)
            .expect("new lengths");
        if let Some(w) = walk.as_mut() {
            let rebuilt = block_walk(&p_next).expect("a paged cache");
            stream.memcpy_htod(&rebuilt, w).expect("new walk");
        }
        poison_outputs(&mut o, &mut lse);
        graph.launch().expect("replay");
        let (o_step, lse_step) = read_back(&stream, &o, &lse);
        let (o_direct, lse_direct) = direct(&next, &p_next, &mut o, &mut lse);
        assert!(
            same(&o_step, &o_direct),
            "{label}: the next step's O differs"
        );
        assert!(
            same_f32(&lse_step, &lse_direct),
            "{label}: the next step's LSE differs"
        );
        assert!(
            !same(&o_step, &o_first),
            "{label}: the replay ignored the new inputs"
        );
        println!("cuda graph {label:<70} two replays bit-identical to direct calls");
    }
}
