//! `fa plan`: the memory arithmetic of attention at long context.
//!
//! - KV cache: `2 · layers · batch · tokens · heads_kv · head_dim · bytes` (K and V of every
//!   layer), shown for MHA, the model's GQA and MQA side by side.
//! - The score matrix a naive implementation materialises: `batch · tokens² · bytes` per head,
//!   times the heads of a layer, against what the tiled kernel holds: Q, K, V, O and the LSE
//!   (all O(tokens)) plus a fixed tile scratch per thread.
//! - Decode (`fa plan --decode`): each step (one new token per sequence) reads every layer's K
//!   and V once, so attention's share of the time per step is at least
//!   `kv_cache_bytes / bandwidth`; shown for a few bandwidths beside a measured step when one
//!   is given (one layer timed, times the layers). The weights' read is out of scope.

use std::fmt::Write as _;

/// The shape of a model and a context, as the arithmetic needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelShape {
    /// Display name.
    pub name: String,
    /// Attention layers.
    pub layers: u64,
    /// Query heads per layer.
    pub heads_q: u64,
    /// Key/value heads per layer.
    pub heads_kv: u64,
    /// Head dimension.
    pub head_dim: u64,
    /// Context length in tokens.
    pub tokens: u64,
    /// Sequences.
    pub batch: u64,
    /// Bytes per element (2 for fp16/bf16).
    pub bytes: u64,
}

/// Llama-3 70B at its 128k context in fp16: 80 layers, 64 query heads, 8 KV heads of 128.
pub fn llama3_70b() -> ModelShape {
    ModelShape {
        name: "Llama-3 70B".into(),
        layers: 80,
        heads_q: 64,
        heads_kv: 8,
        head_dim: 128,
        tokens: 128 * 1024,
        batch: 1,
        bytes: 2,
    }
}

/// The long-context example of the lessons ("Qwen3.8-27B"): 262,144 tokens, 24 query heads,
/// fp16. Its layer count (64), KV heads (4) and head dim (256, the full-attention layers' size)
/// are assumptions of this preset, not quoted figures; override them with the free parameters.
pub fn qwen_27b() -> ModelShape {
    ModelShape {
        name: "Qwen3.8-27B".into(),
        layers: 64,
        heads_q: 24,
        heads_kv: 4,
        head_dim: 256,
        tokens: 262_144,
        batch: 1,
        bytes: 2,
    }
}

/// The preset called `name` (`llama3-70b` or `qwen3.8-27b`, case-insensitive).
pub fn preset(name: &str) -> Option<ModelShape> {
    match name.to_ascii_lowercase().as_str() {
        "llama3-70b" | "llama-3-70b" | "llama3" => Some(llama3_70b()),
        "qwen3.8-27b" | "qwen" | "qwen-27b" => Some(qwen_27b()),
        _ => None,
    }
}

/// The names `preset` accepts (first of each).
pub const PRESETS: [&str; 2] = ["llama3-70b", "qwen3.8-27b"];

/// KV-cache bytes: `2 · layers · batch · tokens · heads_kv · head_dim · bytes`.
pub fn kv_cache_bytes(m: &ModelShape) -> u128 {
    2 * m.layers as u128
        * m.batch as u128
        * m.tokens as u128
        * m.heads_kv as u128
        * m.head_dim as u128
        * m.bytes as u128
}

/// Bytes of one head's naive score matrix over the batch: `batch · tokens² · bytes`.
pub fn score_matrix_bytes_per_head(m: &ModelShape) -> u128 {
    m.batch as u128 * m.tokens as u128 * m.tokens as u128 * m.bytes as u128
}

/// Bytes of the naive score matrices of one layer (all query heads at once).
pub fn score_matrix_bytes_per_layer(m: &ModelShape) -> u128 {
    score_matrix_bytes_per_head(m) * m.heads_q as u128
}

/// Per-thread scratch of fa-cpu's tiled kernel for this head dim on this CPU (its tiles are
/// fixed by the SIMD level, never by the sequence length).
pub fn tile_scratch_bytes(head_dim: u64) -> u128 {
    fa_cpu::scratch_bytes_per_thread(
        head_dim as usize,
        head_dim as usize,
        fa_cpu::SimdLevel::Auto,
    ) as u128
}

/// What the tiled kernel holds for one layer: every term is O(tokens) except the fixed tiles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TiledBytes {
    /// Q and O: `2 · batch · tokens · heads_q · head_dim · bytes`.
    pub q_and_o: u128,
    /// K and V: `2 · batch · tokens · heads_kv · head_dim · bytes`.
    pub k_and_v: u128,
    /// The f32 LSE: `batch · heads_q · tokens · 4`.
    pub lse: u128,
    /// `threads ·` [`tile_scratch_bytes`].
    pub scratch: u128,
}

impl TiledBytes {
    /// Sum of the parts.
    pub fn total(&self) -> u128 {
        self.q_and_o + self.k_and_v + self.lse + self.scratch
    }
}

/// The memory of one layer's attention computed by the tiled kernel on `threads` threads.
pub fn tiled_bytes(m: &ModelShape, threads: u64) -> TiledBytes {
    let tokens = m.batch as u128 * m.tokens as u128;
    let per_head = tokens * m.head_dim as u128 * m.bytes as u128;
    TiledBytes {
        q_and_o: 2 * per_head * m.heads_q as u128,
        k_and_v: 2 * per_head * m.heads_kv as u128,
        lse: tokens * m.heads_q as u128 * 4,
        scratch: threads as u128 * tile_scratch_bytes(m.head_dim),
    }
}

/// Checks that every size the reports print fits (checked arithmetic): `Err` says which one is
/// too large, instead of a silent overflow.
pub fn check_sizes(m: &ModelShape, threads: u64) -> Result<(), String> {
    let product = |factors: &[u64]| {
        factors
            .iter()
            .try_fold(1u128, |acc, &f| acc.checked_mul(f as u128))
    };
    let too_large = |what: &str| {
        format!(
            "too large: {what} of {} overflows 128-bit arithmetic; use smaller --tokens, \
             --batch, --layers, --heads or --head-dim",
            m.name
        )
    };
    // The scratch estimate sizes tiles from head_dim; far beyond any real model it overflows.
    if m.head_dim > u32::MAX as u64 {
        return Err(too_large("the tile scratch (--head-dim)"));
    }
    let heads = m.heads_q.max(m.heads_kv);
    product(&[2, m.layers, m.batch, m.tokens, heads, m.head_dim, m.bytes])
        .ok_or_else(|| too_large("the KV cache"))?;
    product(&[m.batch, m.tokens, m.tokens, m.bytes, m.heads_q])
        .ok_or_else(|| too_large("the score matrix"))?;
    let tiled = product(&[2, m.batch, m.tokens, m.head_dim, m.bytes, heads])
        .and_then(|x| x.checked_mul(2))
        .and_then(|x| x.checked_add(product(&[m.batch, m.tokens, m.heads_q, 4])?))
        .and_then(|x| {
            x.checked_add(product(&[threads])?.checked_mul(tile_scratch_bytes(m.head_dim))?)
        });
    tiled.ok_or_else(|| too_large("the tiled kernel's memory"))?;
    Ok(())
}

/// The decode view's check: its one size, the KV cache over the batch (checked arithmetic);
/// `Err` says "too large" as [`check_sizes`] does.
pub fn check_decode_sizes(m: &ModelShape) -> Result<(), String> {
    [
        2, m.layers, m.batch, m.tokens, m.heads_kv, m.head_dim, m.bytes,
    ]
    .iter()
    .try_fold(1u128, |acc, &f| acc.checked_mul(f as u128))
    .map(|_| ())
    .ok_or_else(|| {
        format!(
            "too large: the KV cache of {} overflows 128-bit arithmetic; use smaller \
                 --tokens, --batch, --layers, --heads-kv or --head-dim",
            m.name
        )
    })
}

/// `bytes` in binary units (fa-io's, whose size errors print the same way).
pub use fa_io::memory::human_bytes;

/// `n` with thousands separators.
pub fn grouped(n: u128) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn precision(bytes: u64) -> &'static str {
    match bytes {
        1 => "fp8",
        2 => "fp16/bf16",
        4 => "fp32",
        _ => "custom",
    }
}

/// The KV-cache section: MHA, the model's GQA and MQA side by side.
pub fn kv_cache_report(m: &ModelShape) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "KV cache = 2 · layers · batch · tokens · heads_kv · head_dim · bytes\n  \
         {}: {} layers, {} query heads, head_dim {}, batch {}, {} tokens, {} bytes ({})",
        m.name,
        m.layers,
        m.heads_q,
        m.head_dim,
        m.batch,
        grouped(m.tokens as u128),
        m.bytes,
        precision(m.bytes)
    );
    let mut rows: Vec<(String, u64)> =
        vec![(format!("MHA (heads_kv = heads = {})", m.heads_q), m.heads_q)];
    if m.heads_kv != m.heads_q && m.heads_kv != 1 {
        rows.push((format!("GQA-{}", m.heads_kv), m.heads_kv));
    }
    if m.heads_q != 1 {
        rows.push(("MQA".into(), 1));
    }
    let _ = writeln!(
        s,
        "  {:<30} {:>9} {:>12} {:>22}",
        "attention", "heads_kv", "KV cache", "bytes"
    );
    for (label, heads_kv) in rows {
        let shape = ModelShape {
            heads_kv,
            ..m.clone()
        };
        let bytes = kv_cache_bytes(&shape);
        let mark = if heads_kv == m.heads_kv {
            "  <- the model"
        } else {
            ""
        };
        let _ = writeln!(
            s,
            "  {label:<30} {heads_kv:>9} {:>12} {:>22}{mark}",
            human_bytes(bytes),
            grouped(bytes)
        );
    }
    s
}

/// The score-matrix section: the naive N² scores against the tiled kernel's O(N) memory.
pub fn score_report(m: &ModelShape, threads: u64) -> String {
    let mut s = String::new();
    let per_head = score_matrix_bytes_per_head(m);
    let per_layer = score_matrix_bytes_per_layer(m);
    let _ = writeln!(
        s,
        "Naive attention materialises the scores: batch · tokens² · bytes per head\n  \
         {}: {} tokens, batch {}, {} query heads, {} KV heads, head_dim {}, {} bytes ({})",
        m.name,
        grouped(m.tokens as u128),
        m.batch,
        m.heads_q,
        m.heads_kv,
        m.head_dim,
        m.bytes,
        precision(m.bytes)
    );
    let line = |s: &mut String, label: &str, bytes: u128| {
        let _ = writeln!(
            s,
            "  {label:<44} {:>12} {:>24}",
            human_bytes(bytes),
            grouped(bytes)
        );
    };
    line(&mut s, "score matrix, one head", per_head);
    line(
        &mut s,
        &format!("score matrix, one layer ({} heads)", m.heads_q),
        per_layer,
    );
    let t = tiled_bytes(m, threads);
    let _ = writeln!(
        s,
        "Tiled exact attention (fa) for the same layer: O(tokens), no score matrix"
    );
    line(&mut s, "Q and O", t.q_and_o);
    line(&mut s, "K and V", t.k_and_v);
    line(&mut s, "LSE (f32)", t.lse);
    line(
        &mut s,
        &format!(
            "tiles: {threads} threads × {} scratch (fa-cpu)",
            human_bytes(tile_scratch_bytes(m.head_dim))
        ),
        t.scratch,
    );
    line(&mut s, "total", t.total());
    let _ = writeln!(
        s,
        "  the naive score matrix alone is {:.0}× what the tiled kernel needs",
        per_layer as f64 / t.total() as f64
    );
    s
}

/// The H200's HBM3e bandwidth by its specification, GB/s.
pub const H200_SPEC_GBPS: f64 = 4800.0;

/// The H200's device copy (read + write) as measured on it (docs/history/benchmarks-lab.md,
/// the H200 decode tables: 4.0 to 4.3 TB/s over the runs), GB/s.
pub const H200_COPY_GBPS: f64 = 4200.0;

/// KV-cache bytes of one sequence (the shape with `batch = 1`).
pub fn kv_cache_bytes_per_sequence(m: &ModelShape) -> u128 {
    kv_cache_bytes(&ModelShape {
        batch: 1,
        ..m.clone()
    })
}

/// KV-cache bytes of one layer over the batch (what one layer's decode step reads).
pub fn kv_cache_bytes_per_layer(m: &ModelShape) -> u128 {
    kv_cache_bytes(&ModelShape {
        layers: 1,
        ..m.clone()
    })
}

/// The bandwidth bound on a decode step: `bytes` read at `gbps` (10⁹ bytes per second), in
/// seconds. Non-positive or non-finite bandwidths give NaN.
pub fn decode_bound_seconds(bytes: u128, gbps: f64) -> f64 {
    if gbps > 0.0 && gbps.is_finite() {
        bytes as f64 / (gbps * 1e9)
    } else {
        f64::NAN
    }
}

/// `seconds` in s, ms or µs with three significant-ish decimals.
pub fn human_seconds(seconds: f64) -> String {
    if !seconds.is_finite() {
        "-".into()
    } else if seconds >= 1.0 {
        format!("{seconds:.3} s")
    } else if seconds >= 1e-3 {
        format!("{:.3} ms", seconds * 1e3)
    } else {
        format!("{:.3} µs", seconds * 1e6)
    }
}

/// A fraction with three decimals, or two significant digits below 0.001 (`2.3e-4`).
pub fn fraction(f: f64) -> String {
    if f.is_finite() && f != 0.0 && f.abs() < 1e-3 {
        format!("{f:.1e}")
    } else {
        format!("{f:.3}")
    }
}

/// One bandwidth of the decode table.
#[derive(Clone, Debug, PartialEq)]
pub struct Bandwidth {
    /// What it is (device, measured or specified).
    pub label: String,
    /// GB/s (10⁹ bytes per second).
    pub gbps: f64,
}

/// One layer's decode step timed on a backend.
#[derive(Clone, Debug, PartialEq)]
pub struct MeasuredDecode {
    /// The backend's description.
    pub backend: String,
    /// Input dtype name.
    pub dtype: &'static str,
    /// Median time of one layer's step, seconds.
    pub layer_seconds: f64,
    /// Key splits the backend used, when reported.
    pub kv_splits: Option<usize>,
    /// The index in the bandwidth list whose bound the headline fraction uses.
    pub reference: usize,
}

/// A measured step (one layer's time × layers) over the bound at `gbps`: 1.0 is the bound.
pub fn fraction_of_bound(m: &ModelShape, layer_seconds: f64, gbps: f64) -> f64 {
    decode_bound_seconds(kv_cache_bytes(m), gbps) / (layer_seconds * m.layers as f64)
}

/// The decode section: cache sizes, the bound per step at each bandwidth and, when given, the
/// measured step and its fraction of each bound; `notes` close it (why a figure is absent).
pub fn decode_report(
    m: &ModelShape,
    bandwidths: &[Bandwidth],
    measured: Option<&MeasuredDecode>,
    notes: &[String],
) -> String {
    let mut s = String::new();
    let total = kv_cache_bytes(m);
    let _ = writeln!(
        s,
        "Decode: each step (one new token per sequence) reads every layer's K and V once
  \
         time per step >= KV cache bytes / bandwidth (attention's share only: the weights' \
         read is not counted)
  \
         {}: {} layers, {} query heads, {} KV heads, head_dim {}, batch {}, {} tokens, {} bytes ({})",
        m.name,
        m.layers,
        m.heads_q,
        m.heads_kv,
        m.head_dim,
        m.batch,
        grouped(m.tokens as u128),
        m.bytes,
        precision(m.bytes)
    );
    let line = |s: &mut String, label: &str, bytes: u128| {
        let _ = writeln!(
            s,
            "  {label:<32} {:>12} {:>24}",
            human_bytes(bytes),
            grouped(bytes)
        );
    };
    line(
        &mut s,
        "KV cache per sequence:",
        kv_cache_bytes_per_sequence(m),
    );
    line(
        &mut s,
        "KV cache per layer (batch):",
        kv_cache_bytes_per_layer(m),
    );
    line(&mut s, &format!("KV cache, batch {}:", m.batch), total);
    let _ = writeln!(
        s,
        "  {:<48} {:>10} {:>14}{}",
        "bandwidth",
        "GB/s",
        "bound/step",
        if measured.is_some() {
            format!(" {:>16}", "fraction of it")
        } else {
            String::new()
        }
    );
    for b in bandwidths {
        let bound = decode_bound_seconds(total, b.gbps);
        let frac = measured.map_or(String::new(), |r| {
            format!(
                " {:>16}",
                fraction(fraction_of_bound(m, r.layer_seconds, b.gbps))
            )
        });
        let _ = writeln!(
            s,
            "  {:<48} {:>10.1} {:>14}{frac}",
            b.label,
            b.gbps,
            human_seconds(bound)
        );
    }
    if let Some(r) = measured {
        let step = r.layer_seconds * m.layers as f64;
        let _ = writeln!(
            s,
            "  measured on {}, {}{}: {} per layer x {} layers = {} per step, {:.1} GB/s",
            r.backend,
            r.dtype,
            r.kv_splits
                .map_or(String::new(), |n| format!(", splits: {n}")),
            human_seconds(r.layer_seconds),
            m.layers,
            human_seconds(step),
            total as f64 / step / 1e9
        );
        if let Some(b) = bandwidths.get(r.reference) {
            let _ = writeln!(
                s,
                "  fraction of the bound: {} (at {}: {:.1} GB/s)",
                fraction(fraction_of_bound(m, r.layer_seconds, b.gbps)),
                b.label,
                b.gbps
            );
        }
    }
    for n in notes {
        let _ = writeln!(s, "  note: {n}");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u128 = 1 << 30;

    #[test]
    fn llama3_70b_kv_cache_is_40_gib_per_sequence() {
        let m = llama3_70b();
        assert_eq!(kv_cache_bytes(&m), 40 * GIB);
        assert_eq!(human_bytes(kv_cache_bytes(&m)), "40 GiB");
        let mha = ModelShape {
            heads_kv: 64,
            ..m.clone()
        };
        assert_eq!(kv_cache_bytes(&mha), 320 * GIB);
        let mqa = ModelShape { heads_kv: 1, ..m };
        assert_eq!(kv_cache_bytes(&mqa), 5 * GIB);
    }

    #[test]
    fn qwen_scores_are_128_gib_per_head_3_tib_per_layer() {
        let m = qwen_27b();
        assert_eq!(score_matrix_bytes_per_head(&m), 262_144u128 * 262_144 * 2);
        assert_eq!(score_matrix_bytes_per_head(&m), 128 * GIB);
        assert_eq!(score_matrix_bytes_per_layer(&m), 3 * 1024 * GIB);
        assert_eq!(human_bytes(score_matrix_bytes_per_layer(&m)), "3 TiB");
    }

    #[test]
    fn tiled_memory_is_linear_in_tokens() {
        let m = qwen_27b();
        let t = tiled_bytes(&m, 2);
        // Q and O: 2 · 262144 · 24 · 256 · 2 bytes = 6 GiB; K and V with 4 heads: 1 GiB.
        assert_eq!(t.q_and_o, 6 * GIB);
        assert_eq!(t.k_and_v, GIB);
        assert_eq!(t.lse, 262_144 * 24 * 4);
        let doubled = tiled_bytes(
            &ModelShape {
                tokens: 2 * m.tokens,
                ..m.clone()
            },
            2,
        );
        assert_eq!(
            doubled.total() - doubled.scratch,
            2 * (t.total() - t.scratch)
        );
        assert_eq!(doubled.scratch, t.scratch);
    }

    #[test]
    fn huge_shapes_are_too_large_not_wrapped() {
        let mut m = llama3_70b();
        assert_eq!(check_sizes(&m, 8), Ok(()));
        m.tokens = u64::MAX;
        m.batch = u64::MAX;
        m.layers = u64::MAX;
        let e = check_sizes(&m, 8).unwrap_err();
        assert!(e.starts_with("too large"), "{e}");
        let e = check_decode_sizes(&m).unwrap_err();
        assert!(e.starts_with("too large: the KV cache"), "{e}");
        assert_eq!(check_decode_sizes(&llama3_70b()), Ok(()));
    }

    #[test]
    fn byte_formatting() {
        assert_eq!(grouped(42_949_672_960), "42,949,672,960");
        assert_eq!(grouped(999), "999");
    }

    #[test]
    fn presets_by_name() {
        assert_eq!(preset("Llama3-70B"), Some(llama3_70b()));
        assert_eq!(preset("qwen3.8-27b"), Some(qwen_27b()));
        assert_eq!(preset("gpt-9"), None);
    }

    #[test]
    fn decode_bound_of_llama3_70b_at_128k() {
        let m = llama3_70b();
        assert_eq!(kv_cache_bytes_per_sequence(&m), 40 * GIB);
        assert_eq!(kv_cache_bytes_per_layer(&m), GIB / 2);
        let batch4 = ModelShape {
            batch: 4,
            ..m.clone()
        };
        assert_eq!(kv_cache_bytes_per_sequence(&batch4), 40 * GIB);
        assert_eq!(kv_cache_bytes(&batch4), 160 * GIB);
        assert_eq!(kv_cache_bytes_per_layer(&batch4), 2 * GIB);
        // 42,949,672,960 bytes at 4.8 TB/s: 8.947848533 ms; at 4.2 TB/s: 10.226112 ms.
        let spec = decode_bound_seconds(40 * GIB, H200_SPEC_GBPS);
        assert!((spec - 42_949_672_960.0 / 4.8e12).abs() < 1e-15, "{spec}");
        assert_eq!(human_seconds(spec), "8.948 ms");
        let copy = decode_bound_seconds(40 * GIB, H200_COPY_GBPS);
        assert_eq!(human_seconds(copy), "10.226 ms");
        assert!(decode_bound_seconds(GIB, 0.0).is_nan());
        assert!(decode_bound_seconds(GIB, f64::INFINITY).is_nan());
        // A step measured at exactly the bound is 1.0 of it; twice as slow, 0.5.
        let layer = spec / 80.0;
        assert!((fraction_of_bound(&m, layer, H200_SPEC_GBPS) - 1.0).abs() < 1e-12);
        assert!((fraction_of_bound(&m, 2.0 * layer, H200_SPEC_GBPS) - 0.5).abs() < 1e-12);
    }

    #[test]
    fn decode_report_lists_bounds_and_the_measured_step() {
        let m = llama3_70b();
        let bw = [
            Bandwidth {
                label: "H200 HBM3e (spec)".into(),
                gbps: H200_SPEC_GBPS,
            },
            Bandwidth {
                label: "host copy".into(),
                gbps: 10.0,
            },
        ];
        let plain = decode_report(&m, &bw, None, &["no GPU".into()]);
        assert!(
            plain.contains("40 GiB") && plain.contains("8.948 ms"),
            "{plain}"
        );
        assert!(plain.contains("4.295 s"), "{plain}");
        assert!(
            plain.contains("note: no GPU") && !plain.contains("measured on"),
            "{plain}"
        );
        let r = MeasuredDecode {
            backend: "cpu".into(),
            dtype: "bf16",
            layer_seconds: 4.294_967_296 / 80.0 * 2.0,
            kv_splits: Some(3),
            reference: 1,
        };
        let text = decode_report(&m, &bw, Some(&r), &[]);
        assert!(text.contains("fraction of the bound: 0.500"), "{text}");
        assert!(text.contains("= 8.590 s per step"), "{text}");
    }

    #[test]
    fn seconds_formatting() {
        assert_eq!(human_seconds(2.5), "2.500 s");
        assert_eq!(human_seconds(0.0125), "12.500 ms");
        assert_eq!(human_seconds(2.5e-5), "25.000 µs");
        assert_eq!(human_seconds(f64::NAN), "-");
        assert_eq!(fraction(0.5), "0.500");
        assert_eq!(fraction(0.000_234), "2.3e-4");
        assert_eq!(fraction(0.0), "0.000");
    }
}
