//! `fa_forward_cpu` and `fa_forward_cache_cpu`: forward attention on host memory with fa-cpu
//! (through flash-attention), over dense/packed K/V or a KV cache; `fa_backward_cpu`: its
//! gradients; `fa_append_kv_cpu`: new tokens into a host KV cache, in place.

use crate::convert::*;
use crate::error::{guard, Failure};
use crate::types::*;
use flash_attention::host::{view_mut, view_ref, HostBackward, HostForward, HostTensor};
use flash_attention::{DType, Exp2, Options};

/// The problem and the four tensor descriptors of a call, copied out of the caller's memory.
pub(crate) struct Call {
    pub problem: FaProblem,
    pub tensors: [FaTensor; 4],
}

impl Call {
    /// The tensor descriptors as `describe` takes them.
    pub fn tensor_refs(&self) -> [&FaTensor; 4] {
        let [q, k, v, o] = &self.tensors;
        [q, k, v, o]
    }
}

/// Reads the problem and the Q, K, V, O descriptors.
///
/// # Safety
/// Each non-null, aligned pointer must point to a readable, initialised struct.
pub(crate) unsafe fn read_call(
    problem: *const FaProblem,
    q: *const FaTensor,
    k: *const FaTensor,
    v: *const FaTensor,
    o: *const FaTensor,
) -> Result<Call, Failure> {
    // SAFETY: forwarded from this function's contract.
    unsafe {
        Ok(Call {
            problem: read_struct(problem, "problem")?,
            tensors: [
                read_struct(q, "q")?,
                read_struct(k, "k")?,
                read_struct(v, "v")?,
                read_struct(o, "o")?,
            ],
        })
    }
}

/// A forward entry refuses `options.d_sinks` (a backward output).
fn forward_only(opts: &FaOptions, entry: &str) -> Result<(), Failure> {
    if opts.d_sinks.is_null() {
        Ok(())
    } else {
        Err(Failure::invalid(format!(
            "options.d_sinks is set but {entry} is a forward (fa_backward_cpu writes it)"
        )))
    }
}

fn cpu_options(opts: &FaOptions) -> Result<Options, Failure> {
    // A local pool of that many OS threads is started: more than the machine has is refused
    // (as `fa --threads` does) rather than left to exhaust the process.
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if opts.threads as usize > cores {
        return Err(Failure::invalid(format!(
            "options.threads is {}: more than the {cores} available here",
            opts.threads
        )));
    }
    Ok(Options {
        threads: (opts.threads != 0).then_some(opts.threads as usize),
        exp2: match opts.exp2 {
            FA_EXP2_AUTO => Exp2::Auto,
            FA_EXP2_EXACT => Exp2::Exact,
            FA_EXP2_CUBIC => Exp2::Cubic,
            other => {
                return Err(Failure::invalid(format!(
                    "options.exp2 is {other}: not an FA_EXP2_* value"
                )))
            }
        },
        ..Options::default()
    })
}

/// Forward attention on host memory: `o` (and `lse`, when not null: f32, natural log,
/// `[batch, heads_q, seqlen_q]` dense or `[heads_q, total_q]` packed) receive
/// `softmax(q·kᵀ·scale)·v`, computed by the SIMD CPU kernel.
///
/// Q, K and V share one dtype; O is that dtype or f32. `options->sinks` (API version 8) adds
/// attention sinks (see [`FaOptions::sinks`]). Every argument is checked before anything is
/// written: on an error code the outputs are untouched (except `FA_ERR_PANIC`) and
/// `fa_last_error_message()` says why. `options` may be null (defaults).
///
/// # Safety
/// Every non-null pointer must point to what its type says: the descriptors to initialised
/// structs; each tensor's `data` to host memory holding every element its shape and strides
/// reach (the library computes that extent from the problem), writable for `o`; `lse` to
/// `heads_q · total_q` (packed) or `batch · heads_q · seqlen_q` floats; host prefix sums to
/// `batch + 1` int32s. Inputs must not be written by anyone during the call. The library
/// refuses null (for non-empty tensors), misaligned, overflowing and overlapping outputs.
#[no_mangle]
pub unsafe extern "C" fn fa_forward_cpu(
    problem: *const FaProblem,
    q: *const FaTensor,
    k: *const FaTensor,
    v: *const FaTensor,
    o: *const FaTensor,
    lse: *mut f32,
    options: *const FaOptions,
) -> i32 {
    guard(|| {
        // SAFETY: the descriptor pointers follow this function's contract.
        let call = unsafe { read_call(problem, q, k, v, o) }?;
        // SAFETY: as above.
        let raw = unsafe { read_options(options) }?;
        let opts = cpu_options(&raw)?;
        forward_only(&raw, "fa_forward_cpu")?;
        // SAFETY: the sinks follow this function's contract.
        let sinks = unsafe { read_sinks(&raw, &call.problem) }?;
        // SAFETY: the prefix sums follow this function's contract.
        let seqlens = unsafe { read_seqlens(&call.problem, false) }?;
        let mut desc = describe(&call.problem, &seqlens, call.tensor_refs())?;
        desc.sinks = sinks;
        let problem = desc.validate(softmax_core::MAX_HEAD_DIM)?;
        // SAFETY: the tensors and `lse` follow this function's contract.
        unsafe { run_host(&call, &problem, lse, &opts) }
    })
}

/// Checks the host buffers of a validated call (spans from the problem, dtypes, overlap) and
/// runs it on the CPU backend; nothing is written before every check has passed.
///
/// # Safety
/// Each tensor's `data` (and a non-null `lse`) must be host memory holding what the problem
/// reaches, as [`fa_forward_cpu`] states.
unsafe fn run_host(
    call: &Call,
    problem: &softmax_core::Problem,
    lse: *mut f32,
    opts: &Options,
) -> Result<(), Failure> {
    let names = ["q", "k", "v", "o"];
    let mut host = [HostTensor {
        addr: 0,
        dtype: DType::F32,
    }; 4];
    for (i, t) in call.tensors.iter().enumerate() {
        host[i] = HostTensor {
            addr: t.data as usize,
            dtype: dtype(t, names[i])?,
        };
    }
    let [q, k, v, o] = host;
    let buffers = HostForward {
        q,
        k,
        v,
        o,
        lse: (!lse.is_null()).then_some(lse as usize),
    };
    // SAFETY: the tensors and `lse` follow the caller's contract; the facade checks every
    // span and overlap before it writes.
    unsafe { flash_attention::host::forward(problem, &buffers, opts) }?;
    Ok(())
}

/// Gradients of a loss with respect to Q, K and V on host memory (the backward of
/// [`fa_forward_cpu`]), computed by the SIMD CPU kernel: exact, recomputing the attention
/// probabilities from the forward's `lse` (no N×N storage), deterministic (the same bits for
/// any thread count). GQA/MQA: `dk`/`dv` are summed over each KV head's group of query heads.
///
/// `problem` is the forward's (fixed-length or varlen with host prefix sums; the mask,
/// window, scale and softcap as given to the forward). Inputs: `q`, `k`, `v` (one dtype `T`:
/// f32, bf16 or f16), the forward's output `o` and `∂L/∂O` `d_o` (one dtype, `T` or f32; `d_o`
/// laid out as `o`: the same strides), and `lse`, the forward's log-sum-exp as it wrote it
/// (f32 `[batch, heads_q, seqlen_q]` dense or `[heads_q, total_q]` packed; required).
/// Outputs: `dq`, `dk`, `dv` (one dtype, `T` or f32), laid out as `q`, `k` and `v` (the same
/// strides). `options` may be null (defaults; `threads` applies, `exp2` is not read). With
/// attention sinks (API version 8), `options->sinks` is the forward's and
/// `options->d_sinks`, when not null, receives their gradient (`heads_q` f32s, summed in a
/// fixed order: deterministic); `d_sinks` without `sinks` is `FA_ERR_INVALID_ARGUMENT`.
///
/// Every argument is checked before anything is written: on an error code the gradients
/// are untouched (except `FA_ERR_PANIC`) and `fa_last_error_message()` says why. Strides that
/// differ from their input's are `FA_ERR_INVALID_ARGUMENT`, as are null, misaligned and
/// overflowing buffers and gradients that overlap any other buffer; dtype combinations the
/// kernel lacks are `FA_ERR_UNSUPPORTED`. Since API version 6.
///
/// # Safety
/// As [`fa_forward_cpu`] for the problem and the descriptors; each tensor's `data` must hold
/// every element its shape and strides reach (`d_o` as `o`, each gradient as its input),
/// writable for `dq`, `dk` and `dv`; `lse` must point to `heads_q · total_q` (packed) or
/// `batch · heads_q · seqlen_q` floats. Inputs must not be written by anyone during the call.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn fa_backward_cpu(
    problem: *const FaProblem,
    q: *const FaTensor,
    k: *const FaTensor,
    v: *const FaTensor,
    o: *const FaTensor,
    lse: *const f32,
    d_o: *const FaTensor,
    dq: *const FaTensor,
    dk: *const FaTensor,
    dv: *const FaTensor,
    options: *const FaOptions,
) -> i32 {
    guard(|| {
        // SAFETY: the descriptor pointers follow this function's contract.
        let call = unsafe { read_call(problem, q, k, v, o) }?;
        // SAFETY: as above.
        let [d_o, dq, dk, dv] = unsafe {
            [
                read_struct(d_o, "d_o")?,
                read_struct(dq, "dq")?,
                read_struct(dk, "dk")?,
                read_struct(dv, "dv")?,
            ]
        };
        let varlen = call.problem.seqlens != FA_SEQLENS_FIXED;
        let [tq, tk, tv, to] = &call.tensors;
        for (grad, input, names) in [
            (&d_o, to, ("d_o", "o")),
            (&dq, tq, ("dq", "q")),
            (&dk, tk, ("dk", "k")),
            (&dv, tv, ("dv", "v")),
        ] {
            check_same_layout(grad, input, names, varlen)?;
        }
        // SAFETY: as above.
        let raw = unsafe { read_options(options) }?;
        let opts = cpu_options(&raw)?;
        // SAFETY: the sinks follow this function's contract.
        let sinks = unsafe { read_sinks(&raw, &call.problem) }?;
        // SAFETY: the prefix sums follow this function's contract.
        let seqlens = unsafe { read_seqlens(&call.problem, false) }?;
        let mut desc = describe(&call.problem, &seqlens, call.tensor_refs())?;
        desc.sinks = sinks;
        let problem = desc.validate(softmax_core::MAX_HEAD_DIM)?;
        let host = |t: &FaTensor, name: &str| -> Result<HostTensor, Failure> {
            Ok(HostTensor {
                addr: t.data as usize,
                dtype: dtype(t, name)?,
            })
        };
        let buffers = HostBackward {
            q: host(tq, "q")?,
            k: host(tk, "k")?,
            v: host(tv, "v")?,
            o: host(to, "o")?,
            lse: lse as usize,
            d_o: host(&d_o, "d_o")?,
            dq: host(&dq, "dq")?,
            dk: host(&dk, "dk")?,
            dv: host(&dv, "dv")?,
            d_sinks: (!raw.d_sinks.is_null()).then_some(raw.d_sinks as usize),
        };
        // SAFETY: the tensors and `lse` follow this function's contract; the facade checks
        // every span and overlap before it writes.
        unsafe { flash_attention::host::backward(&problem, &buffers, &opts) }?;
        Ok(())
    })
}

/// A backward buffer laid out as its input: the same strides (`stride_batch` is not read for
/// packed sequences).
pub(crate) fn check_same_layout(
    t: &FaTensor,
    like: &FaTensor,
    (name, like_name): (&str, &str),
    varlen: bool,
) -> Result<(), Failure> {
    let strides = |x: &FaTensor| {
        (
            if varlen { 0 } else { x.stride_batch },
            x.stride_seq,
            x.stride_head,
        )
    };
    if strides(t) != strides(like) {
        return Err(Failure::invalid(format!(
            "{name} has strides {:?} (batch, seq, head) but {like_name} has {:?}: the backward \
             takes {name} laid out as {like_name}",
            strides(t),
            strides(like)
        )));
    }
    Ok(())
}

/// Forward attention of new queries against a KV cache in host memory (decode, or a few
/// tokens per sequence for speculative decoding): `o` (and `lse`, when not null, f32
/// `[batch, heads_q, seqlen_q]`) receive `softmax(q·kᵀ·scale)·v` over each sequence's first
/// `cache->seqused_k[b]` keys, read from the padded or paged K/V cache that `cache`
/// describes (see [`FaKvCache`]), split over keys and threads and merged by the log-sum-exp
/// (`cache->num_splits` forces the split count).
///
/// `problem` is a fixed-length batch (`FA_SEQLENS_FIXED`): `seqlen_q` queries per sequence,
/// `seqlen_k` the padded cache's capacity (ignored for a paged one); the causal and window
/// masks align bottom-right against each sequence's used length. Q, K and V share one dtype
/// (f32, bf16, f16); O is that dtype or f32. Every argument and table entry is checked before
/// anything is written: a length past the capacity (`blocks_per_seq · block_size` when
/// paged), a used block index outside `0..num_blocks`, null or misaligned tables, and a
/// non-null `cache->block_walk` (the CPU walks no blocks; see [`FaKvCache::block_walk`]) are
/// `FA_ERR_INVALID_ARGUMENT` with the outputs untouched.
///
/// # Safety
/// As [`fa_forward_cpu`], with `cache` pointing to an initialised `FaKvCache` of at least
/// `cache->size` bytes whose `seqused_k` points to `batch` readable int32s and whose
/// non-null `block_table` points to `batch · blocks_per_seq` readable int32s; K and V hold
/// every element of the cache their strides reach (`batch` sequences of `seqlen_k` rows when
/// padded, `num_blocks` blocks of `block_size` rows when paged).
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn fa_forward_cache_cpu(
    problem: *const FaProblem,
    cache: *const FaKvCache,
    q: *const FaTensor,
    k: *const FaTensor,
    v: *const FaTensor,
    o: *const FaTensor,
    lse: *mut f32,
    options: *const FaOptions,
) -> i32 {
    guard(|| {
        // SAFETY: the descriptor pointers follow this function's contract.
        let mut call = unsafe { read_call(problem, q, k, v, o) }?;
        // SAFETY: as above.
        let cache = unsafe { read_versioned(cache) }?;
        // SAFETY: as above.
        let raw = unsafe { read_options(options) }?;
        let mut opts = cpu_options(&raw)?;
        forward_only(&raw, "fa_forward_cache_cpu")?;
        // SAFETY: the sinks follow this function's contract.
        let sinks = unsafe { read_sinks(&raw, &call.problem) }?;
        opts.kv_splits = (cache.num_splits != 0).then_some(cache.num_splits as usize);
        // SAFETY: the tables follow this function's contract.
        let tables = unsafe { HostCache::read(&call.problem, &cache) }?;
        if !cache.block_walk.is_null() {
            // Refused, not ignored: see FaKvCache::block_walk.
            return Err(Failure::invalid(
                "cache.block_walk is set but fa_forward_cache_cpu reads no block walk (the CPU \
                 reads the block table in order; a walk is device memory for \
                 fa_forward_cache_cuda): pass a null walk",
            ));
        }
        if tables.paged.is_some() {
            // A paged cache has no capacity per sequence of its own: seqlen_k is ignored.
            call.problem.seqlen_k = 0;
        }
        let fixed = Seqlens::Fixed;
        let mut desc = tables.apply(describe(&call.problem, &fixed, call.tensor_refs())?)?;
        desc.sinks = sinks;
        let problem = desc.validate(softmax_core::MAX_HEAD_DIM)?;
        // SAFETY: the tensors and `lse` follow this function's contract.
        unsafe { run_host(&call, &problem, lse, &opts) }
    })
}

/// Appends new keys and values to a KV cache in host memory, in place (what
/// FlashAttention's `flash_attn_with_kvcache` does with its `k`/`v` arguments before it
/// attends): token `i` of sequence `b` in `k_new`/`v_new` is written at position
/// `cache->seqused_k[b] + i` of that sequence's cache, padded or paged as [`FaKvCache`]
/// describes (block `block_table[b · blocks_per_seq + t / block_size]`, row
/// `t % block_size`). The lengths are not changed: the attention call that follows
/// (`fa_forward_cache_cpu` with the same `problem`) passes `seqused_k[b] + problem.seqlen_q`.
///
/// `problem` is the cache call's (`FA_SEQLENS_FIXED`): `batch`, `heads_kv`, `head_dim`,
/// `head_dim_v` and, for a padded cache, `seqlen_k` (the capacity) describe the cache, and
/// `seqlen_q` is the number of new tokens per sequence: `k_new`/`v_new` are
/// `[batch, seqlen_q, heads_kv, head_dim(_v)]`, any strides with a contiguous head dim.
/// `heads_q`, the masks, the scale and the softcap are not read; `cache->num_splits` and a
/// paged cache's `cache->block_walk` neither (a padded cache's must be null).
/// The four tensors share one dtype (f32, bf16, f16). Everything is checked before anything
/// is written: a sequence without room for its new tokens, a block index of a new position
/// outside `0..num_blocks`, a table too short, cache strides that map two elements to one
/// address, buffers that overlap are `FA_ERR_INVALID_ARGUMENT` with the cache untouched.
///
/// # Safety
/// Every non-null pointer must point to what its type says: the descriptors to initialised
/// structs (`cache` of at least `cache->size` bytes, its `seqused_k` to `batch` readable
/// int32s, its non-null `block_table` to `batch · blocks_per_seq` int32s); `k_new`/`v_new`'s
/// `data` to host memory holding every element their strides reach, `k_cache`/`v_cache`'s to
/// writable host memory holding the whole cache (`batch` sequences of `seqlen_k` rows when
/// padded, `num_blocks` blocks of `block_size` rows when paged). Nobody else may access the
/// memory during the call.
#[no_mangle]
pub unsafe extern "C" fn fa_append_kv_cpu(
    problem: *const FaProblem,
    cache: *const FaKvCache,
    k_new: *const FaTensor,
    v_new: *const FaTensor,
    k_cache: *const FaTensor,
    v_cache: *const FaTensor,
) -> i32 {
    guard(|| {
        // SAFETY: the descriptor pointers follow this function's contract.
        let (p, cache, tensors) = unsafe {
            let p: FaProblem = read_struct(problem, "problem")?;
            let cache: FaKvCache = read_versioned(cache)?;
            let tensors: [FaTensor; 4] = [
                read_struct(k_new, "k_new")?,
                read_struct(v_new, "v_new")?,
                read_struct(k_cache, "k_cache")?,
                read_struct(v_cache, "v_cache")?,
            ];
            (p, cache, tensors)
        };
        // SAFETY: the tables follow this function's contract.
        let host = unsafe { HostCache::read(&p, &cache) }?;
        let names = ["k_new", "v_new", "k_cache", "v_cache"];
        let dtype = append_dtype(&tensors, names)?;
        let head_dim = size(p.head_dim, "problem.head_dim")?;
        let [kn, vn, kc, vc] = &tensors;
        let append = softmax_core::AppendDesc {
            cache: host.kv_cache(),
            batch: size(p.batch, "problem.batch")?,
            seqlen_k: match host.paged {
                Some(_) => 0,
                None => size(p.seqlen_k, "problem.seqlen_k")?,
            },
            seqlen_new: size(p.seqlen_q, "problem.seqlen_q")?,
            heads_kv: size(p.heads_kv, "problem.heads_kv")?,
            head_dim,
            head_dim_v: match p.head_dim_v {
                0 => head_dim,
                dv => size(dv, "problem.head_dim_v")?,
            },
            k_cache_strides: Some(strides(kc, "k_cache")?),
            v_cache_strides: Some(strides(vc, "v_cache")?),
            k_new_strides: Some(strides(kn, "k_new")?),
            v_new_strides: Some(strides(vn, "v_new")?),
        }
        .validate()?;
        let lens = append.min_buffer_lens();
        let lens = [lens.k_new, lens.v_new, lens.k_cache, lens.v_cache];
        let mut spans = Vec::with_capacity(4);
        for (i, t) in tensors.iter().enumerate() {
            let span = host_span(names[i], t.data as usize, lens[i], dtype.size())?;
            spans.push((names[i], span, i >= 2));
        }
        check_disjoint(&spans)?;
        // SAFETY: each address passed host_span for the dtype and its length, the caches
        // overlap nothing (check_disjoint), and the memory is what the contract promises.
        let (k_new, v_new, k_cache, v_cache) = unsafe {
            (
                view_ref(dtype, kn.data as usize, lens[0])?,
                view_ref(dtype, vn.data as usize, lens[1])?,
                view_mut(dtype, kc.data as usize, lens[2])?,
                view_mut(dtype, vc.data as usize, lens[3])?,
            )
        };
        flash_attention::append_kv(&append, k_new, v_new, k_cache, v_cache)?;
        Ok(())
    })
}

/// The one dtype of an append's four tensors (new keys, new values, K cache, V cache).
pub(crate) fn append_dtype(tensors: &[FaTensor; 4], names: [&str; 4]) -> Result<DType, Failure> {
    let first = dtype(&tensors[0], names[0])?;
    for (t, name) in tensors.iter().zip(names).skip(1) {
        let d = dtype(t, name)?;
        if d != first {
            return Err(Failure::unsupported(format!(
                "{name} is {d} but {} is {first}: the cache and the new tokens share one dtype",
                names[0]
            )));
        }
    }
    Ok(first)
}
