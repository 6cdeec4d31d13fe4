//! `fa bench --decode`: decode over a KV cache (padded or paged), reported as time, GB/s of
//! K/V read and the fraction of the memory bandwidth a plain copy reaches in the same run.
//!
//! Decode is memory-bound: its ceiling is the bytes of K and V read (once per KV head: the
//! query heads of a group share them) over the bandwidth. On the CPU the bandwidth is
//! measured here, with the same number of threads, by a STREAM-like copy between two buffers
//! of [`PROBE_BYTES`] each, far past the caches (bytes read plus bytes written per second, as
//! STREAM counts a copy), and by a plain read of one of them (bytes read per second: the
//! ceiling of a read-only kernel on these cores, which decode is). Rounds alternate the
//! probes and decode, and the fractions reported are medians of per-round ratios: on machines
//! whose speed drifts over minutes only ratios taken side by side mean anything. Other
//! backends report no copy figure (the caller's device copy belongs beside them).
//!
//! The probe size is fixed, not the shape's: with buffers sized by the K/V bytes (256 MiB to
//! 1 GiB, before 2026-12-01) the copy figure on the GPU machine's Xeon moved from ~20 GB/s
//! (256 MiB) to ~34 (512 MiB) and ~42 (1 GiB) with the buffer alone — the C library's copy
//! changes strategy with the size (docs/history/benchmarks-lab.md, "The bandwidth bound") —
//! so the fraction of copy moved with the shape's probe rather than with the decode.
//!
//! K and V start on a cache line ([`OnLine`]), as a runtime's allocator places a cache:
//! before 2026-12-05 they lay wherever the C library put a `Vec` (16 bytes past a line for
//! large blocks), which cost fa-cpu's AMX decode, reading rows in place, ~1.3× in cache.

use crate::backend::{Backend, Options};
use crate::bench::median;
use crate::error::CliError;
use crate::tensor::{random_normal, DType, HostTensor, OnLine, TensorViews};
use flash_attention::BackendKind;
use softmax_core::{Out, ProblemDesc, Qkv};

/// One decode shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct DecodeShape {
    /// Sequences.
    pub batch: usize,
    /// New queries per sequence.
    pub queries: usize,
    /// Keys in each sequence's cache.
    pub cache_len: usize,
    /// Query heads.
    pub heads: usize,
    /// KV heads.
    pub heads_kv: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Keys per block of a paged cache (0: a padded cache).
    pub page_size: usize,
}

impl DecodeShape {
    /// Bytes of K and V one call reads (each KV head once).
    pub fn kv_bytes(&self, dtype: DType) -> u128 {
        2 * self.batch as u128
            * self.cache_len as u128
            * self.heads_kv as u128
            * self.head_dim as u128
            * dtype.size() as u128
    }

    /// Blocks per sequence of the paged cache.
    fn blocks_per_seq(&self) -> usize {
        self.cache_len.div_ceil(self.page_size.max(1)).max(1)
    }
}

/// The measurement of one decode shape; serialises as one JSON line.
#[derive(Clone, Debug, serde::Serialize)]
pub struct DecodeResult {
    /// Backend name.
    pub backend: &'static str,
    /// Input dtype's name.
    pub dtype: &'static str,
    /// The shape (its fields at the top level of the JSON).
    #[serde(flatten)]
    pub shape: DecodeShape,
    /// CPU threads used (0 on CUDA).
    pub threads: usize,
    /// Median time of one call, milliseconds.
    pub time_ms_median: f64,
    /// Fastest call, milliseconds.
    pub time_ms_min: f64,
    /// Timed rounds.
    pub iters: usize,
    /// K/V bytes read per call over the median time, GB/s.
    pub kv_gbps: f64,
    /// The copy bandwidth measured in the same rounds (read + write), GB/s; `None` off the
    /// CPU.
    pub copy_gbps: Option<f64>,
    /// Median over rounds of (K/V GB/s ÷ copy GB/s).
    pub fraction_of_copy: Option<f64>,
    /// A plain read of the probe buffer in the same rounds (bytes read), GB/s; `None` off the
    /// CPU.
    pub read_gbps: Option<f64>,
    /// Median over rounds of (K/V GB/s ÷ read GB/s).
    pub fraction_of_read: Option<f64>,
    /// Key splits per task the backend used (when it reports them).
    pub kv_splits: Option<usize>,
}

/// Bytes of each buffer of the CPU bandwidth probes: past any CPU's last-level cache that the
/// targets name, and the same for every shape.
pub const PROBE_BYTES: usize = 1 << 30;

/// Host buffers of a copy-bandwidth measurement.
pub struct CopyProbe {
    src: Vec<u8>,
    dst: Vec<u8>,
}

impl CopyProbe {
    /// Two buffers of `bytes` each (filled, so that their pages exist before timing).
    pub fn new(bytes: usize) -> Result<CopyProbe, CliError> {
        crate::memory::ensure_fits("the copy-bandwidth buffers", Some(2 * bytes as u128))?;
        let src = crate::memory::try_filled(bytes, 1u8, "the copy-bandwidth buffers")?;
        let dst = crate::memory::try_filled(bytes, 0u8, "the copy-bandwidth buffers")?;
        Ok(CopyProbe { src, dst })
    }

    /// One copy of the whole buffer on `threads` threads (each its own contiguous chunk);
    /// returns bytes read plus bytes written per second, in GB/s.
    pub fn copy_gbps(&mut self, threads: usize) -> f64 {
        let threads = threads.max(1);
        let chunk = self.src.len().div_ceil(threads).max(1);
        let start = std::time::Instant::now();
        std::thread::scope(|scope| {
            for (src, dst) in self.src.chunks(chunk).zip(self.dst.chunks_mut(chunk)) {
                scope.spawn(move || dst.copy_from_slice(src));
            }
        });
        let secs = start.elapsed().as_secs_f64();
        std::hint::black_box(&self.dst);
        2.0 * self.src.len() as f64 / secs / 1e9
    }

    /// One read of the whole destination buffer on `threads` threads (each its own
    /// contiguous chunk, summed as 64-byte blocks); returns bytes read per second, in GB/s.
    pub fn read_gbps(&mut self, threads: usize) -> f64 {
        let threads = threads.max(1);
        let chunk = self.dst.len().div_ceil(threads).max(1);
        let start = std::time::Instant::now();
        let sum = std::thread::scope(|scope| {
            let jobs: Vec<_> = self
                .dst
                .chunks(chunk)
                .map(|c| scope.spawn(move || read_sum(c)))
                .collect();
            jobs.into_iter()
                .map(|j| j.join().unwrap_or(0))
                .fold(0u64, u64::wrapping_add)
        });
        let secs = start.elapsed().as_secs_f64();
        std::hint::black_box(sum);
        self.dst.len() as f64 / secs / 1e9
    }
}

/// A sum of `bytes` as 64-byte blocks (a read-only stream; its value only keeps the loads
/// alive): AVX2 loads where the CPU has them, else eight u64 lanes.
fn read_sum(bytes: &[u8]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 is present (checked just above).
        return unsafe { read_sum_avx2(bytes) };
    }
    let mut lanes = [0u64; 8];
    let mut blocks = bytes.chunks_exact(64);
    for block in &mut blocks {
        for (lane, word) in lanes.iter_mut().zip(block.chunks_exact(8)) {
            let mut w = [0u8; 8];
            w.copy_from_slice(word);
            *lane = lane.wrapping_add(u64::from_le_bytes(w));
        }
    }
    let tail: u64 = blocks.remainder().iter().map(|&b| u64::from(b)).sum();
    lanes.iter().fold(tail, |a, &b| a.wrapping_add(b))
}

/// [`read_sum`] with 32-byte loads into four independent sums. Known gap: the probe (with
/// the baseline loop on the Xeon, 17–20 GB/s; with this one on the development VM) reads
/// about half to two thirds of what `scripts/readbw.c` reads on the same cores; the cause
/// is not found yet (docs/history/benchmarks-lab.md), so `fraction_of_read` overstates.
///
/// # Safety
/// The CPU must have AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn read_sum_avx2(bytes: &[u8]) -> u64 {
    use std::arch::x86_64::*;
    let mut acc = [_mm256_setzero_si256(); 4];
    let mut pairs = bytes.chunks_exact(128);
    for pair in &mut pairs {
        let p = pair.as_ptr() as *const __m256i;
        for (i, a) in acc.iter_mut().enumerate() {
            // SAFETY: `pair` holds 128 bytes, so p.add(i) (i < 4) is 32 readable bytes;
            // unaligned loads.
            *a = _mm256_add_epi64(*a, unsafe { _mm256_loadu_si256(p.add(i)) });
        }
    }
    let mut lanes = [0u64; 4];
    let sum = _mm256_add_epi64(
        _mm256_add_epi64(acc[0], acc[1]),
        _mm256_add_epi64(acc[2], acc[3]),
    );
    // SAFETY: `lanes` is 32 writable bytes; unaligned store.
    unsafe { _mm256_storeu_si256(lanes.as_mut_ptr() as *mut __m256i, sum) };
    let tail: u64 = pairs.remainder().iter().map(|&b| u64::from(b)).sum();
    lanes.iter().fold(tail, |a, &b| a.wrapping_add(b))
}

/// Checks a decode shape's arguments (counts, head dims, the GQA ratio) before anything is
/// allocated or printed: what `fa bench --decode` validates for every shape before its table.
pub fn check_decode_shape(s: &DecodeShape) -> Result<(), CliError> {
    if s.batch == 0 || s.queries == 0 || s.heads == 0 || s.heads_kv == 0 {
        return Err(CliError::Usage(
            "--batch, --queries and the head counts must be at least 1".into(),
        ));
    }
    // The problem's own validation on the dense shape (the cache's tables come later).
    ProblemDesc::new(s.batch, s.queries, 1, s.heads, s.heads_kv, s.head_dim)
        .validate(softmax_core::MAX_HEAD_DIM)?;
    Ok(())
}

/// Times one decode shape: `warmup` untimed calls, then `iters` rounds of (one copy on the
/// CPU, one timed call).
pub fn bench_decode(
    backend: &Backend,
    shape: &DecodeShape,
    dtype: DType,
    opts: &Options,
    warmup: usize,
    iters: usize,
    seed: u64,
) -> Result<DecodeResult, CliError> {
    let s = *shape;
    check_decode_shape(&s)?;
    let kv_bytes = s.kv_bytes(dtype);
    crate::memory::ensure_fits(
        &format!(
            "b{} cache {} h{}/{} d{} {dtype} (K/V cache)",
            s.batch, s.cache_len, s.heads, s.heads_kv, s.head_dim
        ),
        Some(kv_bytes),
    )?;
    let mut rng = fa_reference::Rng::new(seed);
    let seqused_k = vec![
        u32::try_from(s.cache_len)
            .map_err(|_| CliError::Usage("--cache-len is past 2^32 keys".into()))?;
        s.batch
    ];
    // A paged cache in shuffled block order, as a runtime's allocator leaves it.
    let (outer, rows, table) = if s.page_size == 0 {
        (s.batch, s.cache_len, Vec::new())
    } else {
        let n = s.batch * s.blocks_per_seq();
        let mut table: Vec<i32> = (0..n)
            .map(|i| i32::try_from(i).map_err(|_| CliError::Usage("too many blocks".into())))
            .collect::<Result<_, _>>()?;
        for i in (1..n).rev() {
            table.swap(i, rng.below(i + 1));
        }
        (n, s.page_size, table)
    };
    let base = ProblemDesc::new(
        s.batch,
        s.queries,
        s.cache_len,
        s.heads,
        s.heads_kv,
        s.head_dim,
    );
    let desc = if s.page_size == 0 {
        base.padded_cache(&seqused_k)
    } else {
        base.paged_cache(&seqused_k, &table, s.blocks_per_seq(), s.page_size, outer)
    };
    let problem = desc.validate(softmax_core::MAX_HEAD_DIM)?;
    let q = random_normal(
        &mut rng,
        dtype,
        vec![s.batch, s.queries, s.heads, s.head_dim],
    )?;
    // K and V on cache lines, as a runtime allocates its cache (`OnLine`).
    let k = OnLine::new(&random_normal(
        &mut rng,
        dtype,
        vec![outer, rows, s.heads_kv, s.head_dim],
    )?)?;
    let v = OnLine::new(&random_normal(
        &mut rng,
        dtype,
        vec![outer, rows, s.heads_kv, s.head_dim],
    )?)?;
    let mut out: HostTensor = HostTensor::zeros(dtype, q.shape.clone())?;
    let mut lse = crate::memory::try_filled(problem.lse_len(), 0.0f32, "the LSE")?;
    let qkv = Qkv::new(q.view(), k.view(), v.view());
    let threads = backend.effective_threads(opts.threads);
    let cpu = backend.kind() == BackendKind::Cpu;
    // Probe buffers larger than any cache level, the same for every shape.
    let mut probe = if cpu {
        Some(CopyProbe::new(PROBE_BYTES)?)
    } else {
        None
    };
    // The warm-up also reports the split count.
    let stats = backend.forward(
        &problem,
        qkv,
        Out::with_lse(out.data.view_mut(), &mut lse[..]),
        opts,
    )?;
    if warmup > 1 {
        backend.time_forward(
            &problem,
            qkv,
            Out::with_lse(out.data.view_mut(), &mut lse[..]),
            opts,
            warmup - 1,
            1,
        )?;
    }
    if let Some(p) = &mut probe {
        p.copy_gbps(threads);
    }
    let (mut times, mut copies, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    let (mut reads, mut read_ratios) = (Vec::new(), Vec::new());
    for _ in 0..iters.max(1) {
        // The read probe first, then the copy: the copy's source and destination (2 GiB)
        // leave no K/V in the caches before the timed call.
        let read = probe.as_mut().map(|p| p.read_gbps(threads));
        let copy = probe.as_mut().map(|p| p.copy_gbps(threads));
        let t = backend.time_forward(
            &problem,
            qkv,
            Out::with_lse(out.data.view_mut(), &mut lse[..]),
            opts,
            0,
            1,
        )?;
        let secs = t.first().copied().unwrap_or(f64::NAN);
        times.push(secs);
        let kv_gbps = kv_bytes as f64 / secs / 1e9;
        if let Some(c) = copy {
            copies.push(c);
            ratios.push(kv_gbps / c);
        }
        if let Some(r) = read {
            reads.push(r);
            read_ratios.push(kv_gbps / r);
        }
    }
    let med = median(&times);
    Ok(DecodeResult {
        backend: backend.name(),
        dtype: dtype.name(),
        shape: s,
        threads,
        time_ms_median: med * 1e3,
        time_ms_min: times.iter().copied().fold(f64::INFINITY, f64::min) * 1e3,
        iters: times.len(),
        kv_gbps: kv_bytes as f64 / med / 1e9,
        copy_gbps: (!copies.is_empty()).then(|| median(&copies)),
        fraction_of_copy: (!ratios.is_empty()).then(|| median(&ratios)),
        read_gbps: (!reads.is_empty()).then(|| median(&reads)),
        fraction_of_read: (!read_ratios.is_empty()).then(|| median(&read_ratios)),
        kv_splits: stats.kv_splits,
    })
}

/// The table header matching [`table_row`].
pub fn table_header() -> String {
    format!(
        "{:<7} {:<5} {:>5} {:>7} {:>7} {:>5} {:>4} {:>5} {:>3} {:>6} {:>11} {:>9} {:>9} {:>6} {:>9} {:>6}",
        "backend",
        "dtype",
        "batch",
        "heads",
        "cache",
        "page",
        "q",
        "hdim",
        "thr",
        "splits",
        "median ms",
        "KV GB/s",
        "copy GB/s",
        "frac",
        "read GB/s",
        "frac"
    )
}

/// One table row.
pub fn table_row(r: &DecodeResult) -> String {
    let s = &r.shape;
    let opt =
        |x: Option<f64>, digits: usize| x.map_or("-".to_string(), |x| format!("{x:.digits$}"));
    format!(
        "{:<7} {:<5} {:>5} {:>7} {:>7} {:>5} {:>4} {:>5} {:>3} {:>6} {:>11.3} {:>9.1} {:>9} {:>6} {:>9} {:>6}",
        r.backend,
        r.dtype,
        s.batch,
        format!("{}/{}", s.heads, s.heads_kv),
        s.cache_len,
        if s.page_size == 0 {
            "pad".to_string()
        } else {
            s.page_size.to_string()
        },
        s.queries,
        s.head_dim,
        if r.threads == 0 {
            "-".to_string()
        } else {
            r.threads.to_string()
        },
        r.kv_splits.map_or("-".to_string(), |n| n.to_string()),
        r.time_ms_median,
        r.kv_gbps,
        opt(r.copy_gbps, 1),
        opt(r.fraction_of_copy, 2),
        opt(r.read_gbps, 1),
        opt(r.fraction_of_read, 2)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_bytes_count_each_kv_head_once() {
        let s = DecodeShape {
            batch: 4,
            queries: 1,
            cache_len: 8192,
            heads: 32,
            heads_kv: 8,
            head_dim: 128,
            page_size: 16,
        };
        assert_eq!(s.kv_bytes(DType::Bf16), 2 * 4 * 8192 * 8 * 128 * 2);
        assert_eq!(s.blocks_per_seq(), 512);
    }

    #[test]
    fn a_small_decode_bench_runs_and_reports_a_fraction() {
        let shape = DecodeShape {
            batch: 2,
            queries: 1,
            cache_len: 1000,
            heads: 8,
            heads_kv: 2,
            head_dim: 64,
            page_size: 16,
        };
        let backend = Backend::cpu();
        let r =
            bench_decode(&backend, &shape, DType::F32, &Options::default(), 1, 2, 1).expect("runs");
        assert_eq!(r.iters, 2);
        assert!(r.kv_gbps > 0.0 && r.time_ms_median > 0.0);
        assert!(r.copy_gbps.is_some_and(|c| c > 0.0));
        assert!(r.fraction_of_copy.is_some_and(|f| f > 0.0));
        assert!(r.read_gbps.is_some_and(|c| c > 0.0));
        assert!(r.fraction_of_read.is_some_and(|f| f > 0.0));
        assert!(r.kv_splits.is_some_and(|n| n >= 1));
        assert!(table_row(&r).contains("8/2"));
    }
}
