//! Dtype-erased entry points: the crate's one dtype dispatch, and the place where every kernel
//! instance that the workspace's callers reach is compiled, once.
//!
//! [`crate::forward()`], [`crate::backward()`] and [`crate::append_kv()`] are generic over the
//! element types. A caller that learns the dtype at run time (files, the C ABI, Python, the
//! `flash-attention` facade) would otherwise write the match from dtypes to typed calls
//! itself, and every crate that wrote it compiled the whole kernel tree again for its types
//! (each SIMD level, the AMX and decode paths): under optimised profiles rustc does not share
//! generic instances across crates, so the facade's release build held every kernel, and each
//! differently-featured build of it (the CLI, the C library, the Python extension) held them
//! again. The functions here are not generic: they are compiled in this crate, with the
//! kernels they reach, and callers link to them.
//!
//! The accepted combinations are those of the facade: inputs f32, bf16 or f16 (one dtype for
//! Q, K and V); the output (and the backward's O and dO) in the inputs' dtype or f32; the
//! gradients in the inputs' dtype or f32.

use crate::{
    backward, backward_sinks, backward_with_workspace, forward, forward_with_workspace,
    BackwardInputs, BackwardOptions, BackwardStats, BackwardWorkspace, Element, ForwardOptions,
    ForwardStats, Workspace,
};
use half::{bf16, f16};
use softmax_core::{Append, DType, Extent, Grads, Out, Problem, ProblemError, Qkv};

/// A borrowed, read-only host tensor of any supported dtype (elements only; the shape and
/// strides live in the [`softmax_core::Problem`]).
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub enum TensorRef<'a> {
    /// f32 elements.
    F32(&'a [f32]),
    /// bf16 elements.
    Bf16(&'a [bf16]),
    /// f16 elements.
    F16(&'a [f16]),
}

/// A borrowed, writable host tensor of any supported dtype.
#[derive(Debug, PartialEq)]
#[non_exhaustive]
pub enum TensorMut<'a> {
    /// f32 elements.
    F32(&'a mut [f32]),
    /// bf16 elements.
    Bf16(&'a mut [bf16]),
    /// f16 elements.
    F16(&'a mut [f16]),
}

impl TensorRef<'_> {
    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            TensorRef::F32(_) => DType::F32,
            TensorRef::Bf16(_) => DType::Bf16,
            TensorRef::F16(_) => DType::F16,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            TensorRef::F32(s) => s.len(),
            TensorRef::Bf16(s) => s.len(),
            TensorRef::F16(s) => s.len(),
        }
    }

    /// Whether the view holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl TensorMut<'_> {
    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            TensorMut::F32(_) => DType::F32,
            TensorMut::Bf16(_) => DType::Bf16,
            TensorMut::F16(_) => DType::F16,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            TensorMut::F32(s) => s.len(),
            TensorMut::Bf16(s) => s.len(),
            TensorMut::F16(s) => s.len(),
        }
    }

    /// Whether the view holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A shorter-lived writable view of the same elements (to pass the view to several calls).
    pub fn reborrow(&mut self) -> TensorMut<'_> {
        match self {
            TensorMut::F32(s) => TensorMut::F32(s),
            TensorMut::Bf16(s) => TensorMut::Bf16(s),
            TensorMut::F16(s) => TensorMut::F16(s),
        }
    }

    /// A read-only view of the same elements.
    pub fn as_ref(&self) -> TensorRef<'_> {
        match self {
            TensorMut::F32(s) => TensorRef::F32(s),
            TensorMut::Bf16(s) => TensorRef::Bf16(s),
            TensorMut::F16(s) => TensorRef::F16(s),
        }
    }
}

impl Extent for TensorRef<'_> {
    fn elems(&self) -> usize {
        self.len()
    }
}

impl Extent for TensorMut<'_> {
    fn elems(&self) -> usize {
        self.len()
    }
}

/// The `From` conversions of one element type into the views.
macro_rules! views_of {
    ($($t:ty => $variant:ident),*) => {$(
        impl<'a> From<&'a [$t]> for TensorRef<'a> {
            fn from(s: &'a [$t]) -> Self {
                TensorRef::$variant(s)
            }
        }
        impl<'a> From<&'a mut [$t]> for TensorRef<'a> {
            fn from(s: &'a mut [$t]) -> Self {
                TensorRef::$variant(s)
            }
        }
        impl<'a> From<&'a Vec<$t>> for TensorRef<'a> {
            fn from(s: &'a Vec<$t>) -> Self {
                TensorRef::$variant(s)
            }
        }
        impl<'a> From<&'a mut [$t]> for TensorMut<'a> {
            fn from(s: &'a mut [$t]) -> Self {
                TensorMut::$variant(s)
            }
        }
        impl<'a> From<&'a mut Vec<$t>> for TensorMut<'a> {
            fn from(s: &'a mut Vec<$t>) -> Self {
                TensorMut::$variant(s)
            }
        }
    )*};
}

views_of!(f32 => F32, bf16 => Bf16, f16 => F16);

/// What the backward reads besides Q, K and V, dtype-erased: the forward's O and LSE and
/// `∂L/∂O` (the typed form is [`BackwardInputs`]).
#[derive(Clone, Copy, Debug)]
pub struct DynBackwardInputs<'a> {
    /// The forward's output (the problem's O layout).
    pub o: TensorRef<'a>,
    /// `∂L/∂O`, in O's layout and dtype.
    pub d_o: TensorRef<'a>,
    /// The forward's natural-log LSE, as the forward writes it.
    pub lse: &'a [f32],
}

/// The dtypes [`forward_dyn`] refuses.
pub const FORWARD_DTYPES: ProblemError = ProblemError::Unsupported {
    what: "fa-cpu takes f32, bf16 or f16 inputs with an output of the same dtype or f32",
};

/// The dtypes [`backward_dyn`] refuses.
pub const BACKWARD_DTYPES: ProblemError = ProblemError::Unsupported {
    what: "the CPU backward takes Q/K/V in f32, bf16 or f16, O and dO in that dtype or f32, \
           and gradients in that dtype or f32",
};

/// The dtypes [`append_kv_dyn`] refuses.
pub const APPEND_DTYPES: ProblemError = ProblemError::Unsupported {
    what: "the cache and the new keys and values must share one dtype",
};

/// [`crate::forward()`] (`workspace: None`: the calling thread's cached workspace) or
/// [`crate::forward_with_workspace()`] on dtype-erased views. Errors: the dtypes of
/// [`FORWARD_DTYPES`] (Q, K, V of one dtype; O of that dtype or f32), then the typed call's.
/// On error nothing is written.
pub fn forward_dyn(
    problem: &Problem,
    qkv: Qkv<TensorRef<'_>>,
    out: Out<TensorMut<'_>, &mut [f32]>,
    opts: &ForwardOptions,
    workspace: Option<&mut Workspace>,
) -> Result<ForwardStats, ProblemError> {
    /// The typed call.
    fn typed<T: Element, O: Element>(
        problem: &Problem,
        qkv: Qkv<&[T]>,
        out: Out<&mut [O], &mut [f32]>,
        opts: &ForwardOptions,
        workspace: Option<&mut Workspace>,
    ) -> Result<ForwardStats, ProblemError> {
        match workspace {
            Some(ws) => forward_with_workspace(problem, qkv, out, opts, ws),
            None => forward(problem, qkv, out, opts),
        }
    }
    use TensorMut as M;
    use TensorRef as R;
    let Out { o, lse } = out;
    match (qkv.q, qkv.k, qkv.v, o) {
        (R::F32(q), R::F32(k), R::F32(v), M::F32(o)) => {
            typed(problem, Qkv::new(q, k, v), Out { o, lse }, opts, workspace)
        }
        (R::Bf16(q), R::Bf16(k), R::Bf16(v), M::Bf16(o)) => {
            typed(problem, Qkv::new(q, k, v), Out { o, lse }, opts, workspace)
        }
        (R::Bf16(q), R::Bf16(k), R::Bf16(v), M::F32(o)) => {
            typed(problem, Qkv::new(q, k, v), Out { o, lse }, opts, workspace)
        }
        (R::F16(q), R::F16(k), R::F16(v), M::F16(o)) => {
            typed(problem, Qkv::new(q, k, v), Out { o, lse }, opts, workspace)
        }
        (R::F16(q), R::F16(k), R::F16(v), M::F32(o)) => {
            typed(problem, Qkv::new(q, k, v), Out { o, lse }, opts, workspace)
        }
        _ => Err(FORWARD_DTYPES),
    }
}

/// [`crate::backward()`] (`workspace: None`: the calling thread's cached workspace) or
/// [`crate::backward_with_workspace()`] on dtype-erased views. Errors: the dtypes of
/// [`BACKWARD_DTYPES`], then the typed call's. On error the gradients are untouched.
pub fn backward_dyn(
    problem: &Problem,
    qkv: Qkv<TensorRef<'_>>,
    inputs: DynBackwardInputs<'_>,
    grads: Grads<TensorMut<'_>>,
    opts: &BackwardOptions,
    workspace: Option<&mut BackwardWorkspace>,
) -> Result<BackwardStats, ProblemError> {
    /// The typed call.
    fn typed<T: Element, O: Element, G: Element>(
        problem: &Problem,
        qkv: Qkv<&[T]>,
        inputs: BackwardInputs<'_, O>,
        grads: Grads<&mut [G]>,
        opts: &BackwardOptions,
        workspace: Option<&mut BackwardWorkspace>,
    ) -> Result<BackwardStats, ProblemError> {
        match workspace {
            Some(ws) => backward_with_workspace(problem, qkv, inputs, grads, opts, ws),
            None => backward(problem, qkv, inputs, grads, opts),
        }
    }
    /// The gradients' dtype for typed inputs (`$g`: the inputs' own gradient variant).
    macro_rules! with_grads {
        ($q:expr, $k:expr, $v:expr, $o:expr, $d_o:expr, $g:ident) => {{
            let typed_inputs = BackwardInputs {
                o: $o,
                d_o: $d_o,
                lse: inputs.lse,
            };
            let qkv = Qkv::new($q, $k, $v);
            match (grads.dq, grads.dk, grads.dv) {
                (M::F32(dq), M::F32(dk), M::F32(dv)) => typed(
                    problem,
                    qkv,
                    typed_inputs,
                    Grads::new(dq, dk, dv),
                    opts,
                    workspace,
                ),
                // For f32 inputs this is the arm above.
                #[allow(unreachable_patterns)]
                (M::$g(dq), M::$g(dk), M::$g(dv)) => typed(
                    problem,
                    qkv,
                    typed_inputs,
                    Grads::new(dq, dk, dv),
                    opts,
                    workspace,
                ),
                _ => Err(BACKWARD_DTYPES),
            }
        }};
    }
    use TensorMut as M;
    use TensorRef as R;
    match (qkv.q, qkv.k, qkv.v, inputs.o, inputs.d_o) {
        (R::F32(q), R::F32(k), R::F32(v), R::F32(o), R::F32(d_o)) => {
            with_grads!(q, k, v, o, d_o, F32)
        }
        (R::Bf16(q), R::Bf16(k), R::Bf16(v), R::Bf16(o), R::Bf16(d_o)) => {
            with_grads!(q, k, v, o, d_o, Bf16)
        }
        (R::Bf16(q), R::Bf16(k), R::Bf16(v), R::F32(o), R::F32(d_o)) => {
            with_grads!(q, k, v, o, d_o, Bf16)
        }
        (R::F16(q), R::F16(k), R::F16(v), R::F16(o), R::F16(d_o)) => {
            with_grads!(q, k, v, o, d_o, F16)
        }
        (R::F16(q), R::F16(k), R::F16(v), R::F32(o), R::F32(d_o)) => {
            with_grads!(q, k, v, o, d_o, F16)
        }
        _ => Err(BACKWARD_DTYPES),
    }
}

/// [`crate::backward_sinks()`] on dtype-erased views (O and dO of one dtype, f32, bf16 or
/// f16; [`BACKWARD_DTYPES`] otherwise). On error `d_sinks` is untouched.
pub fn backward_sinks_dyn(
    problem: &Problem,
    inputs: DynBackwardInputs<'_>,
    d_sinks: &mut [f32],
) -> Result<(), ProblemError> {
    use TensorRef as R;
    let lse = inputs.lse;
    match (inputs.o, inputs.d_o) {
        (R::F32(o), R::F32(d_o)) => {
            backward_sinks(problem, BackwardInputs { o, d_o, lse }, d_sinks)
        }
        (R::Bf16(o), R::Bf16(d_o)) => {
            backward_sinks(problem, BackwardInputs { o, d_o, lse }, d_sinks)
        }
        (R::F16(o), R::F16(d_o)) => {
            backward_sinks(problem, BackwardInputs { o, d_o, lse }, d_sinks)
        }
        _ => Err(BACKWARD_DTYPES),
    }
}

/// [`crate::append_kv()`] on dtype-erased views: the cache and the new tokens share one
/// dtype ([`APPEND_DTYPES`] otherwise). On error the cache is untouched.
pub fn append_kv_dyn(
    append: &Append,
    k_new: TensorRef<'_>,
    v_new: TensorRef<'_>,
    k_cache: TensorMut<'_>,
    v_cache: TensorMut<'_>,
) -> Result<(), ProblemError> {
    use TensorMut as M;
    use TensorRef as R;
    match (k_new, v_new, k_cache, v_cache) {
        (R::F32(k), R::F32(v), M::F32(kc), M::F32(vc)) => crate::append_kv(append, k, v, kc, vc),
        (R::Bf16(k), R::Bf16(v), M::Bf16(kc), M::Bf16(vc)) => {
            crate::append_kv(append, k, v, kc, vc)
        }
        (R::F16(k), R::F16(v), M::F16(kc), M::F16(vc)) => crate::append_kv(append, k, v, kc, vc),
        _ => Err(APPEND_DTYPES),
    }
}
