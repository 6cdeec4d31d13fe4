//! Foreign host memory as checked tensor views: the one mapping from raw addresses (what a C
//! caller or the Python package's shim holds) to the [`TensorRef`] / [`TensorMut`] views the
//! backends take. The C ABI (`fa-capi`) and the Python module both call it, so that null,
//! alignment, address-space and overlap rules are written once.
//!
//! The lengths are never the caller's: they come from the validated [`Problem`]
//! (`min_buffer_lens`, `lse_len`), so a view spans exactly what the kernels read or write.
//! [`check_sizes`] is the one size check a description needs before
//! [`ProblemDesc::validate`] (which computes dense strides with plain multiplication).
//!
//! [`forward`] and [`backward`] are whole CPU calls on raw host addresses: every span and
//! overlap is checked (the problem's attention sinks included), then [`Backend::forward`] /
//! [`Backend::backward`] (and [`Backend::backward_sinks`] when `d_sinks` is asked for) run on
//! the CPU; nothing is written on error.

use crate::backend::{Backend, Error, ForwardStats, Options};
use crate::backward::{BackwardInputs, BackwardStats};
use crate::tensor::{TensorMut, TensorRef};
use core::ops::Range;
use half::{bf16, f16};
use softmax_core::{DType, Grads, Out, Problem, ProblemDesc, ProblemError, Qkv, Sequences};

/// The byte range `len` elements of `elem_size` bytes at `addr` span, checked: `None` when
/// empty (any address, null included); [`Error::InvalidArgument`] for null, misaligned (to
/// the element size), or a range past `isize::MAX` bytes or the end of the address space.
/// `name` names the buffer in the message.
pub fn span(
    name: &str,
    addr: usize,
    len: usize,
    elem_size: usize,
) -> Result<Option<Range<usize>>, Error> {
    if len == 0 {
        return Ok(None);
    }
    if addr == 0 {
        return Err(Error::InvalidArgument(format!("{name} is a null pointer")));
    }
    if elem_size == 0 || !addr.is_multiple_of(elem_size) {
        return Err(Error::InvalidArgument(format!(
            "{name} is misaligned: {addr:#x} is not a multiple of {elem_size}"
        )));
    }
    let end = len
        .checked_mul(elem_size)
        .filter(|&bytes| bytes <= isize::MAX as usize)
        .and_then(|bytes| addr.checked_add(bytes))
        .ok_or_else(|| {
            Error::InvalidArgument(format!("{name}: {len} elements overflow the address space"))
        })?;
    Ok(Some(addr..end))
}

/// Refuses an output whose bytes overlap another buffer of the call (a shared and a mutable
/// view of the same memory): `spans` lists `(name, span, is_output)`.
pub fn check_disjoint(spans: &[(&str, Option<Range<usize>>, bool)]) -> Result<(), Error> {
    for (i, (a, ra, a_out)) in spans.iter().enumerate() {
        for (b, rb, b_out) in &spans[i + 1..] {
            if let (Some(ra), Some(rb)) = (ra, rb) {
                if (*a_out || *b_out) && ra.start < rb.end && rb.start < ra.end {
                    return Err(Error::InvalidArgument(format!("{a} and {b} overlap")));
                }
            }
        }
    }
    Ok(())
}

/// A shared slice of `len` elements at `addr` (empty when `len` is 0).
///
/// # Safety
/// Unless `len` is 0, `addr` must have passed [`span`] for `T` and point to `len`
/// initialised `T`s that nothing writes while the slice lives.
pub unsafe fn slice_ref<'a, T>(addr: usize, len: usize) -> &'a [T] {
    if len == 0 {
        return &[];
    }
    // SAFETY: non-null, aligned, within isize::MAX bytes (span); readable (contract).
    unsafe { core::slice::from_raw_parts(addr as *const T, len) }
}

/// A mutable slice of `len` elements at `addr` (empty when `len` is 0).
///
/// # Safety
/// As [`slice_ref`], and the memory must be writable and not overlap any other slice alive
/// at the same time ([`check_disjoint`]).
pub unsafe fn slice_mut<'a, T>(addr: usize, len: usize) -> &'a mut [T] {
    if len == 0 {
        return &mut [];
    }
    // SAFETY: non-null, aligned, within isize::MAX bytes (span); writable and not aliased
    // (contract).
    unsafe { core::slice::from_raw_parts_mut(addr as *mut T, len) }
}

/// A dtype that has no host view (yet).
fn no_view(dtype: DType) -> Error {
    Error::InvalidArgument(format!("there is no host view of {dtype} tensors"))
}

/// A read-only host view of `len` elements of `dtype` at `addr`.
///
/// # Safety
/// As [`slice_ref`] for the dtype's element type.
pub unsafe fn view_ref<'a>(dtype: DType, addr: usize, len: usize) -> Result<TensorRef<'a>, Error> {
    // SAFETY: forwarded; f32, bf16 and f16 are valid for every bit pattern.
    unsafe {
        Ok(match dtype {
            DType::F32 => TensorRef::F32(slice_ref::<f32>(addr, len)),
            DType::Bf16 => TensorRef::Bf16(slice_ref::<bf16>(addr, len)),
            DType::F16 => TensorRef::F16(slice_ref::<f16>(addr, len)),
            #[allow(unreachable_patterns)]
            other => return Err(no_view(other)),
        })
    }
}

/// A writable host view of `len` elements of `dtype` at `addr`.
///
/// # Safety
/// As [`slice_mut`] for the dtype's element type.
pub unsafe fn view_mut<'a>(dtype: DType, addr: usize, len: usize) -> Result<TensorMut<'a>, Error> {
    // SAFETY: forwarded; f32, bf16 and f16 are valid for every bit pattern.
    unsafe {
        Ok(match dtype {
            DType::F32 => TensorMut::F32(slice_mut::<f32>(addr, len)),
            DType::Bf16 => TensorMut::Bf16(slice_mut::<bf16>(addr, len)),
            DType::F16 => TensorMut::F16(slice_mut::<f16>(addr, len)),
            #[allow(unreachable_patterns)]
            other => return Err(no_view(other)),
        })
    }
}

/// Refuses shapes whose contiguous strides (tokens × heads × head dim) overflow `usize`.
/// `ProblemDesc::validate` computes them even when explicit strides are given, with plain
/// multiplication (a panic in debug builds), so every edge that takes sizes from a foreign
/// caller checks them first.
pub fn check_sizes(desc: &ProblemDesc) -> Result<(), Error> {
    let (seq_q, seq_k) = match desc.sequences {
        Sequences::Fixed {
            seqlen_q, seqlen_k, ..
        } => (seqlen_q, seqlen_k),
        Sequences::Varlen {
            cu_seqlens_q,
            cu_seqlens_k,
        } => {
            let last = |cu: &[u32]| cu.iter().copied().max().unwrap_or(0) as usize;
            (last(cu_seqlens_q), last(cu_seqlens_k))
        }
        Sequences::VarlenDevice {
            total_q, total_k, ..
        } => (total_q, total_k),
    };
    let dim = desc.head_dim.max(desc.head_dim_v);
    for (seq, heads) in [(seq_q, desc.heads_q), (seq_k, desc.heads_kv)] {
        seq.checked_mul(heads)
            .and_then(|x| x.checked_mul(dim))
            .ok_or(Error::Problem(ProblemError::Overflow))?;
    }
    Ok(())
}

/// One host tensor by address: its first element and its dtype (the shape and strides are
/// the problem's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostTensor {
    /// Address of the first element (may be 0 only when the tensor spans no element).
    pub addr: usize,
    /// Element type.
    pub dtype: DType,
}

/// The buffers of a forward call in host memory, by address: Q, K, V (inputs), O (written)
/// and optionally the LSE (written: `problem.lse_len()` f32s).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostForward {
    /// Queries.
    pub q: HostTensor,
    /// Keys.
    pub k: HostTensor,
    /// Values.
    pub v: HostTensor,
    /// The output (written).
    pub o: HostTensor,
    /// The log-sum-exp (written) or `None`.
    pub lse: Option<usize>,
}

/// [`Backend::forward`] on the CPU over host memory given by address: every buffer's span
/// (from the problem: null, alignment, overflow) and every overlap of an output with another
/// buffer is checked, then the backend checks dtypes and runs. On error nothing is written.
///
/// # Safety
/// Each address must point to host memory holding the elements its span covers (the
/// problem's `min_buffer_lens` for its tensor, `lse_len` f32s for the LSE), initialised for
/// the inputs and writable for O and the LSE, and nothing else may write any of them during
/// the call.
pub unsafe fn forward(
    problem: &Problem,
    t: &HostForward,
    opts: &Options,
) -> Result<ForwardStats, Error> {
    let lens = problem.min_buffer_lens();
    let lse_len = problem.lse_len();
    let buffers = [
        ("q", t.q, lens.q, false),
        ("k", t.k, lens.k, false),
        ("v", t.v, lens.v, false),
        ("o", t.o, lens.o, true),
    ];
    let mut spans = Vec::with_capacity(buffers.len() + 1);
    for (name, tensor, len, out) in buffers {
        spans.push((
            name,
            span(name, tensor.addr, len, tensor.dtype.size())?,
            out,
        ));
    }
    if let Some(lse) = t.lse {
        spans.push(("lse", span("lse", lse, lse_len, 4)?, true));
    }
    spans.push(("sinks", sinks_span(problem)?, false));
    check_disjoint(&spans)?;
    // SAFETY: each address passed `span` for its dtype and length, the outputs overlap
    // nothing (check_disjoint), and the memory is what the contract promises.
    let (qkv, out) = unsafe {
        let qkv = Qkv::new(
            view_ref(t.q.dtype, t.q.addr, lens.q)?,
            view_ref(t.k.dtype, t.k.addr, lens.k)?,
            view_ref(t.v.dtype, t.v.addr, lens.v)?,
        );
        let o = view_mut(t.o.dtype, t.o.addr, lens.o)?;
        let lse = t.lse.map(|addr| slice_mut::<f32>(addr, lse_len));
        (qkv, Out { o, lse })
    };
    Backend::cpu().forward(problem, qkv, out, opts)
}

/// The bytes of the problem's attention sinks (an input every output must stay clear of:
/// the sinks are read while O, the LSE or the gradients are written).
fn sinks_span(problem: &Problem) -> Result<Option<Range<usize>>, Error> {
    match problem.sinks() {
        Some(s) => span("sinks", s.as_ptr() as usize, s.len(), 4),
        None => Ok(None),
    }
}

/// The buffers of a backward call in host memory, by address: inputs Q, K, V (the problem's
/// Q/K/V layouts), the forward's O and LSE (f32, as the forward writes it), `∂L/∂O` (O's
/// layout), and the outputs dQ, dK, dV (laid out as Q, K and V).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostBackward {
    /// Queries.
    pub q: HostTensor,
    /// Keys.
    pub k: HostTensor,
    /// Values.
    pub v: HostTensor,
    /// The forward's output.
    pub o: HostTensor,
    /// The forward's log-sum-exp: `problem.lse_len()` f32s.
    pub lse: usize,
    /// `∂L/∂O`.
    pub d_o: HostTensor,
    /// `∂L/∂Q` (written).
    pub dq: HostTensor,
    /// `∂L/∂K` (written; summed over a GQA group's query heads).
    pub dk: HostTensor,
    /// `∂L/∂V` (written; summed likewise).
    pub dv: HostTensor,
    /// `∂L/∂sinks` (written: `heads_q` f32s, [`Backend::backward_sinks`]) or `None`; only for
    /// a problem with attention sinks.
    pub d_sinks: Option<usize>,
}

/// [`Backend::backward`] on the CPU over host memory given by address: every buffer's span
/// (from the problem: null, alignment, overflow) and every overlap of an output with another
/// buffer is checked, then the backend checks dtypes and runs. On error nothing is written.
///
/// # Safety
/// Each address must point to host memory holding the elements its span covers (the
/// problem's `min_buffer_lens` for its tensor, `lse_len` f32s for the LSE), initialised for
/// the inputs and writable for dQ, dK and dV, and nothing else may write any of them during
/// the call.
pub unsafe fn backward(
    problem: &Problem,
    t: &HostBackward,
    opts: &Options,
) -> Result<BackwardStats, Error> {
    let lens = problem.min_buffer_lens();
    let lse_len = problem.lse_len();
    let buffers = [
        ("q", t.q, lens.q, false),
        ("k", t.k, lens.k, false),
        ("v", t.v, lens.v, false),
        ("o", t.o, lens.o, false),
        ("d_o", t.d_o, lens.o, false),
        ("dq", t.dq, lens.q, true),
        ("dk", t.dk, lens.k, true),
        ("dv", t.dv, lens.v, true),
    ];
    let mut spans = Vec::with_capacity(buffers.len() + 1);
    for (name, tensor, len, out) in buffers {
        spans.push((
            name,
            span(name, tensor.addr, len, tensor.dtype.size())?,
            out,
        ));
    }
    spans.push(("lse", span("lse", t.lse, lse_len, 4)?, false));
    spans.push(("sinks", sinks_span(problem)?, false));
    let heads = problem.heads_q();
    if let Some(d_sinks) = t.d_sinks {
        if problem.sinks().is_none() {
            return Err(Error::InvalidArgument(
                "d_sinks is set but the problem has no attention sinks".to_string(),
            ));
        }
        spans.push(("d_sinks", span("d_sinks", d_sinks, heads, 4)?, true));
    }
    check_disjoint(&spans)?;
    // SAFETY: each address passed `span` for its dtype and length, the outputs overlap
    // nothing (check_disjoint), and the memory is what the contract promises.
    let (qkv, inputs, grads) = unsafe {
        (
            Qkv::new(
                view_ref(t.q.dtype, t.q.addr, lens.q)?,
                view_ref(t.k.dtype, t.k.addr, lens.k)?,
                view_ref(t.v.dtype, t.v.addr, lens.v)?,
            ),
            BackwardInputs {
                o: view_ref(t.o.dtype, t.o.addr, lens.o)?,
                d_o: view_ref(t.d_o.dtype, t.d_o.addr, lens.o)?,
                lse: slice_ref::<f32>(t.lse, lse_len),
            },
            Grads::new(
                view_mut(t.dq.dtype, t.dq.addr, lens.q)?,
                view_mut(t.dk.dtype, t.dk.addr, lens.k)?,
                view_mut(t.dv.dtype, t.dv.addr, lens.v)?,
            ),
        )
    };
    let backend = Backend::cpu();
    let stats = backend.backward(problem, qkv, inputs, grads, opts)?;
    if let Some(addr) = t.d_sinks {
        // SAFETY: `d_sinks` passed `span` for `heads` f32s and overlaps no other buffer.
        let d_sinks = unsafe { slice_mut::<f32>(addr, heads) };
        // Every check it makes (sinks present, O/dO dtypes and lengths) passed above.
        backend.backward_sinks(problem, inputs, d_sinks)?;
    }
    Ok(stats)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_refuse_null_misaligned_and_wrapping() {
        assert_eq!(span("q", 0, 0, 4), Ok(None));
        assert!(span("q", 0, 1, 4).is_err());
        assert!(span("q", 0x1002, 1, 4).is_err());
        assert!(span("q", usize::MAX - 3, 2, 4).is_err());
        assert!(span("q", 0x1000, usize::MAX / 2, 4).is_err());
        assert_eq!(span("q", 0x1000, 4, 4), Ok(Some(0x1000..0x1010)));
        let ok = check_disjoint(&[
            ("q", Some(0..16), false),
            ("k", Some(8..24), false),
            ("o", Some(24..40), true),
        ]);
        assert_eq!(ok, Ok(()));
        let bad = check_disjoint(&[("q", Some(0..16), false), ("o", Some(15..40), true)]);
        assert_eq!(
            bad,
            Err(Error::InvalidArgument("q and o overlap".to_string()))
        );
    }

    /// A forward then a backward on raw addresses: the backward's gradients are the facade's
    /// (`Backend::backward` on the same slices) bit for bit; overlapping gradients and a
    /// missing LSE are refused with nothing written.
    #[test]
    fn host_calls_match_the_facade_and_check_before_writing() {
        let p = softmax_core::ProblemDesc::new(1, 13, 17, 4, 2, 16)
            .causal()
            .validate(256)
            .expect("valid");
        let lens = p.min_buffer_lens();
        let draw = |n: usize, seed: f32| -> Vec<f32> {
            (0..n).map(|i| (i as f32 * 0.37 + seed).sin()).collect()
        };
        let (q, k, v, d_o) = (
            draw(lens.q, 1.0),
            draw(lens.k, 2.0),
            draw(lens.v, 3.0),
            draw(lens.o, 4.0),
        );
        let mut o = vec![0.0f32; lens.o];
        let mut lse = vec![0.0f32; p.lse_len()];
        let f32_at = |x: &[f32]| HostTensor {
            addr: x.as_ptr() as usize,
            dtype: DType::F32,
        };
        let fwd = HostForward {
            q: f32_at(&q),
            k: f32_at(&k),
            v: f32_at(&v),
            o: HostTensor {
                addr: o.as_mut_ptr() as usize,
                dtype: DType::F32,
            },
            lse: Some(lse.as_mut_ptr() as usize),
        };
        // SAFETY: live vectors of the problem's lengths; o and lse are written only here.
        unsafe { forward(&p, &fwd, &Options::default()) }.expect("forward");
        let mut want = Grads::new(vec![0.0f32; lens.q], vec![0.0; lens.k], vec![0.0; lens.v]);
        Backend::cpu()
            .backward(
                &p,
                Qkv::new(
                    TensorRef::from(&q),
                    TensorRef::from(&k),
                    TensorRef::from(&v),
                ),
                BackwardInputs {
                    o: TensorRef::from(&o),
                    d_o: TensorRef::from(&d_o),
                    lse: &lse,
                },
                Grads::new(
                    TensorMut::from(&mut want.dq),
                    TensorMut::from(&mut want.dk),
                    TensorMut::from(&mut want.dv),
                ),
                &Options::default(),
            )
            .expect("backward");
        let mut got = Grads::new(vec![7.0f32; lens.q], vec![7.0; lens.k], vec![7.0; lens.v]);
        let mut call = HostBackward {
            q: f32_at(&q),
            k: f32_at(&k),
            v: f32_at(&v),
            o: f32_at(&o),
            lse: lse.as_ptr() as usize,
            d_o: f32_at(&d_o),
            dq: HostTensor {
                addr: got.dq.as_mut_ptr() as usize,
                dtype: DType::F32,
            },
            dk: HostTensor {
                addr: got.dk.as_mut_ptr() as usize,
                dtype: DType::F32,
            },
            dv: HostTensor {
                addr: got.dv.as_mut_ptr() as usize,
                dtype: DType::F32,
            },
            d_sinks: None,
        };
        let bad = |mut c: HostBackward, edit: fn(&mut HostBackward)| {
            edit(&mut c);
            c
        };
        for (edit, what) in [
            (
                (|c: &mut HostBackward| c.dk.addr = c.dv.addr) as fn(&mut HostBackward),
                "dk and dv overlap",
            ),
            (|c: &mut HostBackward| c.lse = 0, "lse is a null pointer"),
            (
                |c: &mut HostBackward| c.dq.addr = c.q.addr,
                "q and dq overlap",
            ),
        ] {
            // SAFETY: as above; the edits make the call invalid in ways checked first.
            let e = unsafe { backward(&p, &bad(call, edit), &Options::default()) }.unwrap_err();
            assert_eq!(e, Error::InvalidArgument(what.to_string()));
            let g = &got;
            assert!(g.dq.iter().chain(&g.dk).chain(&g.dv).all(|&x| x == 7.0));
        }
        call.lse = lse.as_ptr() as usize;
        // SAFETY: as above; the gradients are written only here.
        unsafe { backward(&p, &call, &Options::default()) }.expect("backward");
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got.dq), bits(&want.dq));
        assert_eq!(bits(&got.dk), bits(&want.dk));
        assert_eq!(bits(&got.dv), bits(&want.dv));
    }

    /// Sinks on raw addresses: the forward and the backward's d sinks are the facade's bit for
    /// bit; d sinks overlapping the sinks, or asked for without sinks, are refused with
    /// nothing written.
    #[test]
    fn host_sinks_match_the_facade() {
        let sinks = vec![0.25f32, -1.5, 1.0, 3.0];
        let p = softmax_core::ProblemDesc::new(1, 7, 9, 4, 2, 8)
            .causal()
            .with_sinks(&sinks)
            .validate(256)
            .expect("valid");
        let lens = p.min_buffer_lens();
        let draw = |n: usize, seed: f32| -> Vec<f32> {
            (0..n).map(|i| (i as f32 * 0.53 + seed).sin()).collect()
        };
        let (q, k, v, d_o) = (
            draw(lens.q, 1.0),
            draw(lens.k, 2.0),
            draw(lens.v, 3.0),
            draw(lens.o, 4.0),
        );
        let at = |x: &[f32]| HostTensor {
            addr: x.as_ptr() as usize,
            dtype: DType::F32,
        };
        let mut o = vec![0.0f32; lens.o];
        let mut lse = vec![0.0f32; p.lse_len()];
        let fwd = HostForward {
            q: at(&q),
            k: at(&k),
            v: at(&v),
            o: HostTensor {
                addr: o.as_mut_ptr() as usize,
                dtype: DType::F32,
            },
            lse: Some(lse.as_mut_ptr() as usize),
        };
        // SAFETY: live vectors of the problem's lengths; o and lse are written only here.
        unsafe { forward(&p, &fwd, &Options::default()) }.expect("forward");
        let inputs = BackwardInputs {
            o: TensorRef::from(&o),
            d_o: TensorRef::from(&d_o),
            lse: &lse,
        };
        let mut want = [0.0f32; 4];
        Backend::cpu()
            .backward_sinks(&p, inputs, &mut want)
            .expect("d sinks");
        let mut grads = Grads::new(vec![0.0f32; lens.q], vec![0.0; lens.k], vec![0.0; lens.v]);
        let mut got = [7.0f32; 4];
        let mut call = HostBackward {
            q: at(&q),
            k: at(&k),
            v: at(&v),
            o: at(&o),
            lse: lse.as_ptr() as usize,
            d_o: at(&d_o),
            dq: HostTensor {
                addr: grads.dq.as_mut_ptr() as usize,
                dtype: DType::F32,
            },
            dk: HostTensor {
                addr: grads.dk.as_mut_ptr() as usize,
                dtype: DType::F32,
            },
            dv: HostTensor {
                addr: grads.dv.as_mut_ptr() as usize,
                dtype: DType::F32,
            },
            d_sinks: Some(sinks.as_ptr() as usize),
        };
        // SAFETY: as above; d_sinks overlaps the sinks, which is checked first.
        let e = unsafe { backward(&p, &call, &Options::default()) }.unwrap_err();
        assert_eq!(
            e,
            Error::InvalidArgument("sinks and d_sinks overlap".to_string())
        );
        assert_eq!(sinks, [0.25, -1.5, 1.0, 3.0]);
        call.d_sinks = Some(got.as_mut_ptr() as usize);
        let plain = softmax_core::ProblemDesc::new(1, 7, 9, 4, 2, 8)
            .causal()
            .validate(256)
            .expect("valid");
        // SAFETY: as above.
        let e = unsafe { backward(&plain, &call, &Options::default()) }.unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
        assert_eq!(got, [7.0; 4]);
        // SAFETY: as above; the gradients and d sinks are written only here.
        unsafe { backward(&p, &call, &Options::default()) }.expect("backward");
        assert_eq!(got.map(f32::to_bits), want.map(f32::to_bits));
    }
}
