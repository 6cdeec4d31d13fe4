//! `fa run`: attention over Q, K, V read from files, output (and LSE) written back.

use crate::backend::{Backend, BackendChoice, Options};
use crate::error::CliError;
use crate::files::{
    check_outputs_are_not_inputs, encode_tensors, read_tensor, same_file, write_files, FileFormat,
};
use crate::rows::{compare_rows, reference_rows, sample_rows, RowErrors};
use crate::tensor::{HostTensor, TensorViews};
use flash_attention::DTypes;
use softmax_core::{Out, ProblemDesc, Qkv};
use std::path::PathBuf;

/// What `fa run` does.
#[derive(Clone, Debug)]
pub struct RunRequest {
    /// Queries `[batch, seqlen_q, heads_q, head_dim]` (or `[seqlen_q, heads_q, head_dim]`).
    pub q: PathBuf,
    /// Keys `[batch, seqlen_k, heads_kv, head_dim]`.
    pub k: PathBuf,
    /// Values `[batch, seqlen_k, heads_kv, head_dim_v]`.
    pub v: PathBuf,
    /// Output path.
    pub output: PathBuf,
    /// LSE path (`[batch, heads_q, seqlen_q]`, f32).
    pub lse: Option<PathBuf>,
    /// Causal (bottom-right aligned) mask.
    pub causal: bool,
    /// Sliding window `(left, right)`; `-1` is unbounded, other negatives are refused.
    pub window: Option<(i64, i64)>,
    /// Softcap (`0`: none; negative, NaN or infinite: refused).
    pub softcap: Option<f32>,
    /// Softmax scale (default `1/sqrt(head_dim)`; finite and non-zero).
    pub scale: Option<f32>,
    /// Backend.
    pub backend: BackendChoice,
    /// Thread bound, exp2 choice and rescale policy.
    pub options: Options,
    /// Rows to check against the f64 reference after the run (0: none).
    pub check_rows: usize,
    /// The backward's files, when gradients are asked for.
    pub backward: Option<crate::run_backward::BackwardFiles>,
    /// Keys used per sequence of a KV cache (int32 `[batch]`): K/V are then a padded cache
    /// `[batch, capacity, heads_kv, head_dim]`, or a paged one with `block_table`.
    pub seqused_k: Option<PathBuf>,
    /// The block table of a paged cache (int32 `[batch, max_blocks]`): K/V are then
    /// `[num_blocks, block_size, heads_kv, head_dim]`. Needs `seqused_k`.
    pub block_table: Option<PathBuf>,
}

/// The KV-cache tables of a run, read from their files.
#[derive(Clone, Debug, Default)]
pub struct CacheTables {
    /// Keys used per sequence.
    pub seqused_k: Vec<u32>,
    /// Row-major `[batch, blocks_per_seq]`, empty for a padded cache.
    pub block_table: Vec<i32>,
    /// Columns of the block table.
    pub blocks_per_seq: usize,
}

/// Reads `--seqused-k` (and `--block-table`) and checks their shapes against the batch.
pub fn read_cache_tables(
    seqused_k: &std::path::Path,
    block_table: Option<&std::path::Path>,
    batch: usize,
) -> Result<CacheTables, CliError> {
    let (shape, lens) = crate::files::read_index_file(seqused_k)?;
    if shape.len() != 1 || shape[0] != batch {
        return Err(CliError::Shape(format!(
            "--seqused-k has shape {shape:?}: expected [{batch}] (one length per sequence)"
        )));
    }
    let seqused_k = lens
        .iter()
        .map(|&l| {
            u32::try_from(l).map_err(|_| {
                CliError::Shape(format!("--seqused-k holds {l}: lengths are at least 0"))
            })
        })
        .collect::<Result<Vec<u32>, _>>()?;
    let Some(path) = block_table else {
        return Ok(CacheTables {
            seqused_k,
            ..CacheTables::default()
        });
    };
    let (shape, table) = crate::files::read_index_file(path)?;
    match *shape {
        [b, blocks] if b == batch => Ok(CacheTables {
            seqused_k,
            block_table: table,
            blocks_per_seq: blocks,
        }),
        _ => Err(CliError::Shape(format!(
            "--block-table has shape {shape:?}: expected [{batch}, max_blocks_per_seq]"
        ))),
    }
}

/// The problem of a run over a KV cache: Q `[batch, seqlen_q, heads_q, head_dim]`; K/V a
/// padded cache `[batch, capacity, heads_kv, head_dim]` or, with a block table, a paged one
/// `[num_blocks, block_size, heads_kv, head_dim]`.
pub fn cache_problem_from_shapes<'a>(
    q: &HostTensor,
    k: &HostTensor,
    v: &HostTensor,
    tables: &'a CacheTables,
    paged: bool,
) -> Result<ProblemDesc<'a>, CliError> {
    if !paged {
        return Ok(problem_from_shapes(q, k, v)?.padded_cache(&tables.seqused_k));
    }
    let [b, sq, hq, dq] = bshd("q", &q.shape)?;
    let four = |name: &str, t: &HostTensor| match *t.shape {
        [n, s, h, d] => Ok([n, s, h, d]),
        _ => Err(CliError::Shape(format!(
            "{name} has shape {:?}: a paged cache is [num_blocks, block_size, heads_kv, head_dim]",
            t.shape
        ))),
    };
    let [nk, bk, hk, dk] = four("k", k)?;
    let [nv, bv, hv, dv] = four("v", v)?;
    if (nk, bk, hk) != (nv, bv, hv) {
        return Err(CliError::Shape(format!(
            "k is {:?} but v is {:?}: the paged caches must match but for head_dim",
            k.shape, v.shape
        )));
    }
    if q.dtype() != k.dtype() || k.dtype() != v.dtype() {
        return Err(CliError::Shape(format!(
            "q, k and v must share one dtype (got q {}, k {}, v {})",
            q.dtype(),
            k.dtype(),
            v.dtype()
        )));
    }
    if dq != dk {
        return Err(CliError::Shape(format!(
            "q's head_dim {dq} differs from k's {dk}"
        )));
    }
    Ok(ProblemDesc::new(b, sq, 0, hq, hk, dq)
        .head_dim_v(dv)
        .paged_cache(
            &tables.seqused_k,
            &tables.block_table,
            tables.blocks_per_seq,
            bk,
            nk,
        ))
}

/// What `fa run` did.
#[derive(Clone, Debug)]
pub struct RunSummary {
    /// Backend description.
    pub backend: String,
    /// Shape summary.
    pub shape: String,
    /// Seconds of the forward call.
    pub seconds: f64,
    /// The check of sampled rows, when asked.
    pub check: Option<RowCheck>,
    /// Seconds of the backward call, when gradients were asked for.
    pub backward_seconds: Option<f64>,
}

/// The check of sampled rows against the f64 reference.
#[derive(Clone, Copy, Debug)]
pub struct RowCheck {
    /// Rows checked (the request clamped to the rows the problem has).
    pub rows: usize,
    /// Rows asked for.
    pub requested: usize,
    /// Their errors.
    pub errors: RowErrors,
    /// Bound on the normwise error.
    pub bound: f64,
    /// Bound on the LSE error.
    pub lse_bound: f64,
    /// Whether every bound holds (a NaN where the reference is finite fails).
    pub pass: bool,
}

/// The `[batch, seqlen, heads, head_dim]` view of a rank-3 or rank-4 shape.
fn bshd(name: &str, shape: &[usize]) -> Result<[usize; 4], CliError> {
    match *shape {
        [b, s, h, d] => Ok([b, s, h, d]),
        [s, h, d] => Ok([1, s, h, d]),
        _ => Err(CliError::Shape(format!(
            "{name} has shape {shape:?}: expected [batch, seqlen, heads, head_dim] \
             (or [seqlen, heads, head_dim])"
        ))),
    }
}

/// Checks that Q, K and V fit together and builds the problem (GQA from the head counts).
pub fn problem_from_shapes(
    q: &HostTensor,
    k: &HostTensor,
    v: &HostTensor,
) -> Result<ProblemDesc<'static>, CliError> {
    let [bq, sq, hq, dq] = bshd("q", &q.shape)?;
    let [bk, sk, hk, dk] = bshd("k", &k.shape)?;
    let [bv, sv, hv, dv] = bshd("v", &v.shape)?;
    if q.shape.len() != k.shape.len() || k.shape.len() != v.shape.len() {
        return Err(CliError::Shape(format!(
            "q, k and v must have the same rank (got {:?}, {:?}, {:?})",
            q.shape, k.shape, v.shape
        )));
    }
    if q.dtype() != k.dtype() || k.dtype() != v.dtype() {
        return Err(CliError::Shape(format!(
            "q, k and v must share one dtype (got q {}, k {}, v {})",
            q.dtype(),
            k.dtype(),
            v.dtype()
        )));
    }
    if bq != bk || bk != bv {
        return Err(CliError::Shape(format!(
            "batch differs: q {bq}, k {bk}, v {bv}"
        )));
    }
    if sk != sv {
        return Err(CliError::Shape(format!(
            "k has {sk} keys per sequence but v has {sv}"
        )));
    }
    if hk != hv {
        return Err(CliError::Shape(format!("k has {hk} heads but v has {hv}")));
    }
    if dq != dk {
        return Err(CliError::Shape(format!(
            "q's head_dim {dq} differs from k's {dk}"
        )));
    }
    Ok(ProblemDesc::new(bq, sq, sk, hq, hk, dq).head_dim_v(dv))
}

/// Reads the inputs, runs the forward pass and writes the output (and LSE).
pub fn run(req: &RunRequest) -> Result<RunSummary, CliError> {
    // Before anything is read or written: no output may be an input, and -o and --lse are
    // one file only where one .safetensors file holds both.
    let mut inputs = vec![
        ("--q", req.q.as_path()),
        ("--k", req.k.as_path()),
        ("--v", req.v.as_path()),
    ];
    let mut outputs = vec![("-o", req.output.as_path())];
    if let Some(lse) = &req.lse {
        outputs.push(("--lse", lse.as_path()));
    }
    if let Some(b) = &req.backward {
        inputs.extend(b.inputs());
        outputs.extend(b.outputs());
        crate::files::check_distinct_outputs(&outputs)?;
    }
    check_outputs_are_not_inputs(&inputs, &outputs)?;
    let lse_in_output = match &req.lse {
        // A device such as /dev/null takes both, written through one after the other.
        Some(path)
            if (*path == req.output || same_file(path, &req.output))
                && !crate::files::is_special_file(path) =>
        {
            let same_safetensors = FileFormat::from_extension(path)
                == Some(FileFormat::Safetensors)
                && FileFormat::from_extension(&req.output) == Some(FileFormat::Safetensors);
            if !same_safetensors && *path != req.output {
                return Err(CliError::Usage(format!(
                    "--lse {} and -o {} are the same file: only one .safetensors path holds both",
                    path.display(),
                    req.output.display()
                )));
            }
            true
        }
        _ => false,
    };
    let (q, format) = read_tensor(&req.q, "q")?;
    let (k, _) = read_tensor(&req.k, "k")?;
    let (v, _) = read_tensor(&req.v, "v")?;
    let [batch, ..] = bshd("q", &q.shape)?;
    let tables = match (&req.seqused_k, &req.block_table) {
        (Some(lens), table) => Some(read_cache_tables(lens, table.as_deref(), batch)?),
        (None, Some(_)) => {
            return Err(CliError::Usage(
                "--block-table needs --seqused-k (the keys each sequence uses)".into(),
            ))
        }
        (None, None) => None,
    };
    let mut desc = match &tables {
        Some(t) => cache_problem_from_shapes(&q, &k, &v, t, req.block_table.is_some())?,
        None => problem_from_shapes(&q, &k, &v)?,
    };
    // The flat arguments go through softmax-core's conversions, as the C ABI's do.
    let (left, right) = req.window.unwrap_or((-1, -1));
    desc = desc.with_flash_args(req.causal, left, right, req.softcap.unwrap_or(0.0))?;
    desc.softmax_scale = req.scale.map(softmax_core::explicit_scale).transpose()?;
    let problem = desc.validate(softmax_core::MAX_HEAD_DIM)?;
    // `auto` takes CUDA only for dtypes it runs (f32 files run on the CPU).
    let backend = Backend::open_for(req.backend, DTypes::same(q.dtype()))?;

    let [b, sq, hq, _] = bshd("q", &q.shape)?;
    let mut out_shape = q.shape.clone();
    if let Some(last) = out_shape.last_mut() {
        *last = desc.head_dim_v;
    }
    let mut out = HostTensor::zeros(q.dtype(), out_shape)?;
    let mut lse = crate::memory::try_filled(problem.lse_len(), 0.0f32, "the LSE")?;
    let start = std::time::Instant::now();
    backend.forward(
        &problem,
        Qkv::new(q.view(), k.view(), v.view()),
        Out::with_lse(out.data.view_mut(), &mut lse[..]),
        &req.options,
    )?;
    let seconds = start.elapsed().as_secs_f64();

    let total_rows = crate::rows::row_count(&problem);
    let check = (req.check_rows > 0).then(|| {
        let mut rng = fa_reference::Rng::new(0x5eed);
        let rows = sample_rows(&problem, req.check_rows.min(total_rows), &mut rng);
        let refs = reference_rows(&problem, &q.data, &k.data, &v.data, &rows).unwrap_or_default();
        let errors = compare_rows(&problem, &out.data, &lse, &rows, &refs);
        let (bound, lse_bound) = crate::verify::bounds(q.dtype(), req.options.exp2);
        RowCheck {
            rows: rows.len(),
            requested: req.check_rows,
            pass: errors.passes(bound, lse_bound),
            errors,
            bound,
            lse_bound,
        }
    });

    let out_format = FileFormat::from_extension(&req.output).unwrap_or(format);
    let backward = match &req.backward {
        Some(b) => Some(crate::run_backward::backward_files(
            b,
            &backend,
            &problem,
            (&q, &k, &v),
            &out,
            &lse,
            &req.options,
            format,
        )?),
        None => None,
    };
    let lse_shape = if q.shape.len() == 4 {
        vec![b, hq, sq]
    } else {
        vec![hq, sq]
    };
    let lse_tensor = HostTensor {
        shape: lse_shape,
        data: crate::tensor::Data::F32(lse),
    };
    // Everything is encoded before anything is written; then all files at once, atomically.
    let files = match &req.lse {
        // One .safetensors file can hold both.
        Some(path) if lse_in_output && out_format == FileFormat::Safetensors => vec![(
            path.clone(),
            encode_tensors(path, out_format, &[("out", &out), ("lse", &lse_tensor)])?,
        )],
        Some(_) if lse_in_output => {
            return Err(CliError::Usage(
                "--lse names the output file: only a .safetensors file holds both".into(),
            ))
        }
        Some(path) => {
            let lse_format = FileFormat::from_extension(path).unwrap_or(out_format);
            vec![
                (
                    req.output.clone(),
                    encode_tensors(&req.output, out_format, &[("out", &out)])?,
                ),
                (
                    path.clone(),
                    encode_tensors(path, lse_format, &[("lse", &lse_tensor)])?,
                ),
            ]
        }
        None => vec![(
            req.output.clone(),
            encode_tensors(&req.output, out_format, &[("out", &out)])?,
        )],
    };
    let mut files = files;
    let backward_seconds = backward.map(|(grads, seconds)| {
        files.extend(grads);
        seconds
    });
    write_files(&files)?;
    Ok(RunSummary {
        backend: backend.describe(),
        shape: format!(
            "batch {b}, seqlen_q {sq}, seqlen_k {}, heads {hq}/{} (q/kv), head_dim {}, {}",
            match &desc.kv_cache {
                softmax_core::KvCache::None => desc_seqlen_k(&desc).to_string(),
                softmax_core::KvCache::Padded { .. } => format!(
                    "≤ {} (padded cache, longest {})",
                    desc_seqlen_k(&desc),
                    problem.max_seqlen_k()
                ),
                softmax_core::KvCache::Paged { block_size, .. } => format!(
                    "≤ {} (paged cache, blocks of {block_size})",
                    problem.max_seqlen_k()
                ),
            },
            desc.heads_kv,
            desc.head_dim,
            q.dtype()
        ),
        seconds,
        check,
        backward_seconds,
    })
}

fn desc_seqlen_k(desc: &ProblemDesc) -> usize {
    match desc.sequences {
        softmax_core::Sequences::Fixed { seqlen_k, .. } => seqlen_k,
        softmax_core::Sequences::Varlen { .. } | softmax_core::Sequences::VarlenDevice { .. } => 0,
    }
}

/// Parses `L,R`: each side is -1 (unbounded) or a number of keys ≥ 0.
pub fn parse_window(s: &str) -> Result<(i64, i64), String> {
    let (l, r) = s
        .split_once(',')
        .ok_or_else(|| format!("expected LEFT,RIGHT (e.g. 128,0), got '{s}'"))?;
    let parse = |x: &str| {
        x.trim()
            .parse::<i64>()
            .map_err(|_| format!("'{x}' is not an integer (use -1 for unbounded)"))
    };
    let (l, r) = (parse(l)?, parse(r)?);
    // The problem's own check, so that the message is the C ABI's and Python's.
    softmax_core::mask_from_flash(false, l, r).map_err(|e| e.to_string())?;
    Ok((l, r))
}
