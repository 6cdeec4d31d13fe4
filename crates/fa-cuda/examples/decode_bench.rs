//! Times the decode family on the issue's shapes (default: Llama-3 70B's layer, 64 query /
//! 8 KV heads, head dim 128, bf16, one query per sequence, batch 1 and 16, caches 4k–128k,
//! padded and paged with blocks of 16 and 256) and prints one JSON document: the device-copy
//! bandwidth measured in the same run (read + write), and per shape the median kernel time
//! (decode + combine, CUDA events), the K/V read bandwidth and its fraction of the copy
//! bandwidth, with the plan's split count. Beside `scripts/torch_sdpa_decode.py` in one device
//! call this gives the issue's table.
//!
//! ```text
//! cargo run --release -p fa-cuda --example decode_bench -- [--batches 1,16]
//!     [--caches 4096,16384,65536,131072] [--heads-q 64] [--heads-kv 8] [--hdim 128]
//!     [--queries 1] [--layouts padded,paged16,paged256,paged16seq] [--splits plan,8,15,30]
//!     [--stages plan,3,2] [--block-n plan,128] [--warps plan,2] [--flush read|copy|none]
//!     [--walk on|off|both] [--iters 50]
//! ```
//! Each timed call follows a flush on the same stream: the L2 cache holds none of the cache,
//! and the GPU is still busy with the flush while the host queues the call, so the host's
//! launch overhead is not timed (`scripts/torch_sdpa_decode.py` does the same). `--flush read`
//! (the default) is a decode call over another 512 MiB cache: it leaves the L2 full of clean
//! lines, as the previous layer's attention and weight reads do in a decode step; `--flush
//! copy` a 256 MiB device-to-device copy, which leaves up to the L2's size of dirty lines whose
//! write-back then shares DRAM with the timed call (the method of the first decode tables,
//! 2026-12-01 in docs/history/gpu-notes.md); `--flush none` (or `--no-flush`) times
//! back-to-back calls.
//!
//! `--splits` lists split counts to time per shape (`plan`: the plan's own choice, the
//! default), for tuning the split rule; `--stages` the K/V stage counts (fewer stages, more
//! CTAs per SM), each with the plan's split count for it unless `--splits` forces one.
//! Layouts: `padded` is FlashAttention's KV cache `[batch, cache, heads_kv, head_dim]` (one
//! head's keys 2 KiB apart at 8 heads of 128), `padded_bhsd` the same cache stored head-major
//! `[batch, heads_kv, cache, head_dim]` (one head's keys contiguous: the layout
//! `torch_sdpa_decode.py` gives SDPA by default), `paged<N>` blocks of N keys in a random
//! order (a random permutation of the pool), `paged<N>seq` the same blocks in order (each
//! sequence's keys contiguous: isolates the cost of scattered blocks). Two diagnostic orders
//! between those: `paged<N>win<W>` shuffles the blocks only within windows of W consecutive
//! blocks of the pool (scattered at a fine grain, local at a coarse one: e.g. W = 64 keeps each
//! sequence's 16-key blocks of a head inside 2 MiB runs of the pool), and `paged<N>sort<C>`
//! takes the random permutation and sorts it within runs of C table entries (each run of a
//! sequence walks its scattered blocks in address order, as a split that sorted its own blocks
//! would).
//! `--walk on` (the default) passes a paged cache's block walk (`fa_cuda::block_walk`, built
//! on the host once per shape, as a runtime would once per decode step: its build time is
//! printed) and the plan reads the blocks in address order where it can; `off` passes none
//! (table order); `both` times each.
//! The caches are filled with random bf16 values (a 32 MiB random chunk copied over them on
//! the device).

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use fa_cuda::{block_walk, CacheTables, DType, Device, ForwardOptions, RawTensor};
use half::bf16;
use softmax_core::{Out, ProblemDesc, Qkv, Strides, Tensor, MAX_HEAD_DIM};
use std::sync::Arc;

/// The block order a `paged<N>…` layout asks for.
#[derive(Clone, Copy)]
enum BlockOrder {
    /// A random permutation of the pool.
    Scattered,
    /// The pool in order.
    InOrder,
    /// Shuffled within windows of this many consecutive blocks.
    Window(usize),
    /// A random permutation, sorted within runs of this many table entries.
    SortedRuns(usize),
}

/// `padded…` → no block size; `paged<N>[seq|win<W>|sort<C>]` → N and the order.
fn parse_paged(layout: &str) -> (Option<usize>, BlockOrder) {
    let Some(rest) = layout.strip_prefix("paged") else {
        return (None, BlockOrder::Scattered);
    };
    let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
    let bs: usize = rest[..digits]
        .parse()
        .expect("paged<N>[seq|win<W>|sort<C>]");
    let tail = &rest[digits..];
    let count = |s: &str| -> usize { s.parse().expect("paged<N>win<W> / sort<C>: a count") };
    let order = if tail.is_empty() {
        BlockOrder::Scattered
    } else if tail == "seq" {
        BlockOrder::InOrder
    } else if let Some(w) = tail.strip_prefix("win") {
        BlockOrder::Window(count(w).max(1))
    } else if let Some(c) = tail.strip_prefix("sort") {
        BlockOrder::SortedRuns(count(c).max(1))
    } else {
        panic!("paged<N>[seq|win<W>|sort<C>], not {layout}")
    };
    (Some(bs), order)
}

/// A block table of `blocks` entries over a pool of as many blocks, in `order`.
fn block_table(blocks: usize, order: BlockOrder, rng: &mut Lcg) -> Vec<i32> {
    let mut t: Vec<i32> = (0..blocks as i32).collect();
    let mut shuffle = |t: &mut [i32]| {
        for i in (1..t.len()).rev() {
            t.swap(i, (rng.next() % (i as u64 + 1)) as usize);
        }
    };
    match order {
        BlockOrder::InOrder => {}
        BlockOrder::Scattered => shuffle(&mut t),
        BlockOrder::Window(w) => t.chunks_mut(w).for_each(shuffle),
        BlockOrder::SortedRuns(c) => {
            shuffle(&mut t);
            t.chunks_mut(c).for_each(|run| run.sort_unstable());
        }
    }
    t
}

/// xorshift64*: cheap reproducible host randomness.
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// Roughly N(0, 1/3): a sum of three uniforms on [-1, 1).
    fn value(&mut self) -> f32 {
        (0..3)
            .map(|_| (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
            .sum::<f32>()
            / 3.0
    }
}

fn list(s: &str) -> Vec<usize> {
    s.split(',').filter_map(|x| x.parse().ok()).collect()
}

/// A device allocation seen as a raw tensor of `T` (same size as `R`).
fn raw<T, R: cudarc::driver::DeviceRepr>(
    slice: &CudaSlice<R>,
    stream: &CudaStream,
) -> RawTensor<T> {
    let (ptr, _record) = slice.device_ptr(stream);
    // SAFETY: a live allocation of the device's context holding `len` values of `T`'s size,
    // kept alive until after the stream is synchronised.
    unsafe { RawTensor::from_raw(ptr, slice.len()) }
}

/// Fills `dst` with copies of a random chunk (device to device).
fn fill(stream: &Arc<CudaStream>, dst: &mut CudaSlice<u16>, chunk: &CudaSlice<u16>) {
    let n = chunk.len();
    let mut at = 0;
    while at < dst.len() {
        let len = n.min(dst.len() - at);
        let mut view = dst.slice_mut(at..at + len);
        stream
            .memcpy_dtod(&chunk.slice(0..len), &mut view)
            .expect("device copy");
        at += len;
    }
}

fn median(mut v: Vec<f32>) -> f32 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let (mut batches, mut caches) = (vec![1, 16], vec![4096, 16384, 65536, 131072]);
    let (mut hq, mut hk, mut d, mut sq, mut iters) = (64usize, 8usize, 128usize, 1usize, 50usize);
    let mut layouts: Vec<String> = ["padded", "paged16", "paged256"].map(String::from).to_vec();
    let mut split_list: Vec<Option<u32>> = vec![None];
    let mut stage_list: Vec<Option<u32>> = vec![None];
    let mut block_n_list: Vec<Option<u32>> = vec![None];
    let mut warps: Option<u32> = None;
    let mut flush = String::from("read");
    let mut walk_list = vec![true];
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        if a == "--no-flush" {
            flush = String::from("none");
            continue;
        }
        let v = args.next().unwrap_or_default();
        match a.as_str() {
            "--batches" => batches = list(&v),
            "--caches" => caches = list(&v),
            "--heads-q" => hq = v.parse().expect("--heads-q N"),
            "--heads-kv" => hk = v.parse().expect("--heads-kv N"),
            "--hdim" => d = v.parse().expect("--hdim N"),
            "--queries" => sq = v.parse().expect("--queries N"),
            "--iters" => iters = v.parse().expect("--iters N"),
            "--splits" => {
                split_list = v
                    .split(',')
                    .map(|x| (x != "plan").then(|| x.parse().expect("--splits plan,N,...")))
                    .collect()
            }
            "--layouts" => layouts = v.split(',').map(String::from).collect(),
            "--stages" => {
                stage_list = v
                    .split(',')
                    .map(|x| (x != "plan").then(|| x.parse().expect("--stages plan,N,...")))
                    .collect()
            }
            "--flush" => flush = v,
            "--walk" => {
                walk_list = match v.as_str() {
                    "on" => vec![true],
                    "off" => vec![false],
                    "both" => vec![false, true],
                    other => panic!("--walk on|off|both, not {other}"),
                }
            }
            "--warps" => warps = (v != "plan").then(|| v.parse().expect("--warps plan|N")),
            "--block-n" => {
                block_n_list = v
                    .split(',')
                    .map(|x| (x != "plan").then(|| x.parse().expect("--block-n plan,N,...")))
                    .collect()
            }
            other => panic!("unknown argument {other}"),
        }
    }
    let dev = Device::open(0).unwrap_or_else(|e| panic!("needs a CUDA GPU: {e}"));
    let stream = dev.default_stream().clone();
    let ctx = dev.context().clone();
    let mut rng = Lcg(0x9e37_79b9_7f4a_7c15);
    let chunk: Vec<u16> = (0..16 << 20)
        .map(|_| bf16::from_f32(rng.value()).to_bits())
        .collect();
    let chunk = stream.clone_htod(&chunk).expect("upload");
    let max_kv = batches.iter().max().copied().unwrap_or(1)
        * caches.iter().max().copied().unwrap_or(1)
        * hk
        * d;
    let mut k = stream.alloc_zeros::<u16>(max_kv).expect("K cache");
    let mut v = stream.alloc_zeros::<u16>(max_kv).expect("V cache");
    fill(&stream, &mut k, &chunk);
    fill(&stream, &mut v, &chunk);

    // The copy ceiling: K copied onto V, bytes read + written per second.
    let copy_gbs = {
        let mut times = Vec::new();
        for _ in 0..10 {
            let (s, e) = (
                ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                    .expect("event"),
                ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                    .expect("event"),
            );
            s.record(&stream).expect("record");
            stream.memcpy_dtod(&k, &mut v).expect("copy");
            e.record(&stream).expect("record");
            stream.synchronize().expect("sync");
            times.push(s.elapsed_ms(&e).expect("elapsed"));
        }
        2.0 * (max_kv * 2) as f64 / (median(times) as f64 * 1e-3) / 1e9
    };
    fill(&stream, &mut v, &chunk);
    eprintln!("device copy: {copy_gbs:.0} GB/s (read + write)");
    // The flush buffers: 2 x 256 MiB, a copy's source and destination, or the K and V of a
    // padded cache (batch 1, 131072 keys, the shape's heads) that a read flush decodes.
    let mut flush_bufs = (flush != "none").then(|| {
        let a = stream.alloc_zeros::<u16>(128 << 20).expect("flush buffer");
        let b = stream.alloc_zeros::<u16>(128 << 20).expect("flush buffer");
        (a, b)
    });
    let flush_keys = (128usize << 20) / (hk * d);
    let flush_used_host = [flush_keys as u32];
    let flush_problem = ProblemDesc::new(1, 1, flush_keys, hq, hk, d)
        .padded_cache(&flush_used_host)
        .validate(MAX_HEAD_DIM)
        .expect("flush shape");
    let flush_q = stream.alloc_zeros::<u16>(hq * d).expect("flush Q");
    let flush_o = stream.alloc_zeros::<u16>(hq * d).expect("flush O");
    let flush_used = stream.clone_htod(&[flush_keys as i32]).expect("upload");
    let flush_ws = stream
        .alloc_zeros::<f32>(
            dev.decode_workspace_bytes(&flush_problem, DType::Bf16, &ForwardOptions::default())
                .expect("workspace size")
                .div_ceil(4)
                .max(1),
        )
        .expect("flush workspace");
    let mut flush_now = |stream: &Arc<CudaStream>| match (flush.as_str(), flush_bufs.as_mut()) {
        ("copy", Some((a, b))) => stream.memcpy_dtod(&*a, b).expect("flush copy"),
        ("read", Some((a, b))) => {
            let tables = CacheTables {
                seqused_k: raw(&flush_used, stream),
                block_table: None,
                block_walk: None,
            };
            let qkv = Qkv::new(
                raw::<bf16, u16>(&flush_q, stream),
                raw::<bf16, u16>(&*a, stream),
                raw::<bf16, u16>(&*b, stream),
            );
            dev.forward_cache_on_stream(
                &flush_problem,
                tables,
                Some(raw(&flush_ws, stream)),
                qkv,
                Out::new(raw::<bf16, u16>(&flush_o, stream)),
                stream,
                &ForwardOptions::default(),
            )
            .expect("flush decode");
        }
        ("none", _) => {}
        (other, _) => panic!("--flush read|copy|none, not {other}"),
    };

    let mut rows = Vec::new();
    for &batch in &batches {
        for &cache in &caches {
            let q_host: Vec<u16> = (0..batch * sq * hq * d)
                .map(|_| bf16::from_f32(rng.value()).to_bits())
                .collect();
            let q = stream.clone_htod(&q_host).expect("upload");
            let o = stream.alloc_zeros::<u16>(q_host.len()).expect("O");
            let used_host = vec![cache as u32; batch];
            let used_dev = stream
                .clone_htod(&vec![cache as i32; batch])
                .expect("upload");
            for layout in &layouts {
                let (block_size, order) = parse_paged(layout);
                let table: Vec<i32> = match block_size {
                    None => Vec::new(),
                    Some(bs) => block_table(batch * cache.div_ceil(bs), order, &mut rng),
                };
                let head_major = Strides {
                    batch: cache * hk * d,
                    seq: d,
                    head: cache * d,
                };
                let desc = match block_size {
                    None if layout == "padded_bhsd" => {
                        ProblemDesc::new(batch, sq, cache, hq, hk, d)
                            .padded_cache(&used_host)
                            .strides(Tensor::K, head_major)
                            .strides(Tensor::V, head_major)
                    }
                    None => ProblemDesc::new(batch, sq, cache, hq, hk, d).padded_cache(&used_host),
                    Some(bs) => ProblemDesc::new(batch, sq, 0, hq, hk, d).paged_cache(
                        &used_host,
                        &table,
                        cache.div_ceil(bs),
                        bs,
                        table.len(),
                    ),
                };
                let problem = desc.validate(MAX_HEAD_DIM).expect("valid shape");
                let table_dev =
                    (!table.is_empty()).then(|| stream.clone_htod(&table).expect("upload"));
                // The block walk, built on the host as a runtime would once per step.
                let walk_dev = (!table.is_empty()).then(|| {
                    let start = std::time::Instant::now();
                    let walk = block_walk(&problem).expect("a paged cache");
                    let host_us = start.elapsed().as_secs_f64() * 1e6;
                    eprintln!("batch {batch:>2} cache {cache:>6} {layout:<9} block walk built on the host in {host_us:.0} us");
                    stream.clone_htod(&walk).expect("upload")
                });
                for (&splits, &decode_stages, &decode_block_n, &walk) in
                    split_list.iter().flat_map(|s| {
                        stage_list.iter().flat_map({
                            let block_n_list = &block_n_list;
                            let walk_list = &walk_list;
                            move |g| {
                                block_n_list
                                    .iter()
                                    .flat_map(move |n| walk_list.iter().map(move |w| (s, g, n, w)))
                            }
                        })
                    })
                {
                    let opts = ForwardOptions {
                        splits,
                        decode_stages,
                        decode_block_n,
                        decode_warps: warps,
                        time_kernel: true,
                        ..ForwardOptions::default()
                    };
                    // A tuning combination the plan refuses (e.g. more shared memory than the
                    // device has) is skipped with its reason.
                    let bytes = match dev.decode_workspace_bytes(&problem, DType::Bf16, &opts) {
                        Ok(bytes) => bytes,
                        Err(e) => {
                            eprintln!("batch {batch:>2} cache {cache:>6} {layout:<9} skipped ({splits:?} splits, {decode_stages:?} stages, {decode_block_n:?} keys per tile): {e}");
                            continue;
                        }
                    };
                    let ws = stream
                        .alloc_zeros::<f32>(bytes.div_ceil(4).max(1))
                        .expect("workspace");
                    let tables = CacheTables {
                        seqused_k: raw(&used_dev, &stream),
                        block_table: table_dev.as_ref().map(|t| raw(t, &stream)),
                        block_walk: walk_dev.as_ref().filter(|_| walk).map(|w| raw(w, &stream)),
                    };
                    let lens = problem.min_buffer_lens();
                    // SAFETY: prefixes of live allocations (K/V hold max_kv >= lens.k elements).
                    let (kr, vr) = unsafe {
                        (
                            RawTensor::<bf16>::from_raw(
                                raw::<bf16, u16>(&k, &stream).ptr(),
                                lens.k,
                            ),
                            RawTensor::<bf16>::from_raw(
                                raw::<bf16, u16>(&v, &stream).ptr(),
                                lens.v,
                            ),
                        )
                    };
                    let qkv = Qkv::new(raw::<bf16, u16>(&q, &stream), kr, vr);
                    let mut times = Vec::new();
                    let mut plan = None;
                    for it in 0..iters + 5 {
                        flush_now(&stream);
                        let stats = dev
                            .forward_cache_on_stream(
                                &problem,
                                tables,
                                Some(raw(&ws, &stream)),
                                qkv,
                                Out::new(raw::<bf16, u16>(&o, &stream)),
                                &stream,
                                &opts,
                            )
                            .expect("decode");
                        plan = stats.decode;
                        if it >= 5 {
                            times.push(stats.kernel_ms.expect("timed"));
                        }
                    }
                    stream.synchronize().expect("sync");
                    let t_ms = median(times) as f64;
                    let kv_bytes = 2.0 * (batch * cache * hk * d * 2) as f64;
                    let gbs = kv_bytes / (t_ms * 1e-3) / 1e9;
                    let plan = plan.expect("a launch");
                    eprintln!(
                    "batch {batch:>2} cache {cache:>6} {layout:<9} {:>8.1} us {gbs:>6.0} GB/s ({:.2} of copy) splits {} {}{}",
                    t_ms * 1e3,
                    gbs / copy_gbs,
                    plan.num_splits,
                    plan.variant.name(),
                    if plan.block_walk { " walk" } else { "" }
                );
                    rows.push(format!(
                    "{{\"batch\":{batch},\"cache\":{cache},\"queries\":{sq},\"heads_q\":{hq},\"heads_kv\":{hk},\"hdim\":{d},\"layout\":\"{layout}\",\"us\":{:.1},\"kv_gbs\":{gbs:.0},\"frac_of_copy\":{:.3},\"splits\":{},\"forced\":{},\"variant\":\"{}\",\"walk\":{}}}",
                    t_ms * 1e3,
                    gbs / copy_gbs,
                    plan.num_splits,
                    splits.is_some(),
                    plan.variant.name(),
                    plan.block_walk
                ));
                }
            }
        }
    }
    println!(
        "{{\"bench\":\"fa_cuda_decode\",\"device\":\"{}\",\"copy_gbs\":{copy_gbs:.0},\"flush\":\"{flush}\",\"rows\":[\n{}\n]}}",
        dev.name(),
        rows.join(",\n")
    );
}
