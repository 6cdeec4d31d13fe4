//! Tensor bundles: the buffers of one call, grouped so that every backend and every pass
//! takes the same few arguments (`problem, qkv, out, options`) instead of long lists.
//!
//! The bundles are generic over what holds the elements: host slices (`&[T]`, `&mut [T]`),
//! a backend's device buffers, or raw device pointers. [`Extent`] gives their lengths so that
//! [`crate::Problem::check_buffers`] can check any of them against the problem. The backward
//! pass writes its gradients into a [`Grads`] bundle (dQ, dK, dV in the layouts of Q, K, V).

use crate::problem::BufferLens;

/// The inputs of an attention call: queries, keys and values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Qkv<X> {
    /// Queries.
    pub q: X,
    /// Keys.
    pub k: X,
    /// Values.
    pub v: X,
}

impl<X> Qkv<X> {
    /// Bundles Q, K and V.
    pub fn new(q: X, k: X, v: X) -> Self {
        Qkv { q, k, v }
    }

    /// Applies `f` to each of Q, K, V.
    pub fn map<Y>(self, mut f: impl FnMut(X) -> Y) -> Qkv<Y> {
        Qkv {
            q: f(self.q),
            k: f(self.k),
            v: f(self.v),
        }
    }

    /// Borrows each of Q, K, V.
    pub fn as_ref(&self) -> Qkv<&X> {
        Qkv {
            q: &self.q,
            k: &self.k,
            v: &self.v,
        }
    }
}

/// The outputs of a forward call: O and, when requested, the natural-log LSE (f32,
/// `[batch, heads_q, seqlen_q]`, or `[heads_q, total_q]` when packed).
#[derive(Debug, PartialEq, Eq)]
pub struct Out<O, L> {
    /// The attention output.
    pub o: O,
    /// The log-sum-exp of each row, if requested.
    pub lse: Option<L>,
}

impl<O, L> Out<O, L> {
    /// O only, no LSE.
    pub fn new(o: O) -> Self {
        Out { o, lse: None }
    }

    /// O and the LSE.
    pub fn with_lse(o: O, lse: L) -> Self {
        Out { o, lse: Some(lse) }
    }
}

/// The gradients of a backward call: dQ, dK and dV, laid out as Q, K and V (same shapes and
/// strides), so that [`Grads::lens_as_inputs`] checks them like the inputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grads<X> {
    /// Gradient with respect to the queries.
    pub dq: X,
    /// Gradient with respect to the keys (summed over the query heads of a GQA group).
    pub dk: X,
    /// Gradient with respect to the values (summed over the query heads of a GQA group).
    pub dv: X,
}

impl<X> Grads<X> {
    /// Bundles dQ, dK and dV.
    pub fn new(dq: X, dk: X, dv: X) -> Self {
        Grads { dq, dk, dv }
    }

    /// Applies `f` to each of dQ, dK, dV.
    pub fn map<Y>(self, mut f: impl FnMut(X) -> Y) -> Grads<Y> {
        Grads {
            dq: f(self.dq),
            dk: f(self.dk),
            dv: f(self.dv),
        }
    }
}

impl<X: Extent> Grads<X> {
    /// The gradients' lengths as a Q/K/V bundle, for checking them against the inputs'
    /// shapes and strides (`problem.check_buffers(BufferLens::of(&grads.lens_as_inputs(), ..))`
    /// or a direct comparison with [`crate::Problem::min_buffer_lens`]).
    pub fn lens_as_inputs(&self) -> Qkv<usize> {
        Qkv::new(self.dq.elems(), self.dk.elems(), self.dv.elems())
    }
}

/// The number of elements a buffer holds, whatever holds it.
pub trait Extent {
    /// Elements in the buffer.
    fn elems(&self) -> usize;
}

impl<T> Extent for &[T] {
    fn elems(&self) -> usize {
        self.len()
    }
}

impl<T> Extent for &mut [T] {
    fn elems(&self) -> usize {
        self.len()
    }
}

impl<E: Extent> Extent for &E {
    fn elems(&self) -> usize {
        (**self).elems()
    }
}

impl<E: Extent> Extent for &mut E {
    fn elems(&self) -> usize {
        (**self).elems()
    }
}

impl BufferLens {
    /// The lengths of a forward call's buffers (`lse` when an LSE buffer is given).
    pub fn of<X: Extent, O: Extent, L: Extent>(qkv: &Qkv<X>, out: &Out<O, L>) -> BufferLens {
        BufferLens {
            q: qkv.q.elems(),
            k: qkv.k.elems(),
            v: qkv.v.elems(),
            o: out.o.elems(),
            lse: out.lse.as_ref().map(Extent::elems),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lens_of_host_bundles() {
        let (q, k, v) = ([0f32; 6], [0f32; 4], [0f32; 5]);
        let mut o = [0u16; 7];
        let mut lse = [0f32; 2];
        let qkv = Qkv::new(&q[..], &k[..], &v[..]);
        let out = Out::with_lse(&mut o[..], &mut lse[..]);
        assert_eq!(
            BufferLens::of(&qkv, &out),
            BufferLens {
                q: 6,
                k: 4,
                v: 5,
                o: 7,
                lse: Some(2)
            }
        );
        let out: Out<&mut [u16], &mut [f32]> = Out::new(&mut o[..]);
        assert_eq!(BufferLens::of(&qkv, &out).lse, None);
        assert_eq!(qkv.map(|x| x.len()), Qkv::new(6, 4, 5));
    }

    #[test]
    fn lens_of_grads() {
        let (mut dq, mut dk, mut dv) = ([0f32; 3], [0f32; 2], [0f32; 9]);
        let grads = Grads::new(&mut dq[..], &mut dk[..], &mut dv[..]);
        assert_eq!(grads.lens_as_inputs(), Qkv::new(3, 2, 9));
        assert_eq!(grads.map(|x| x.len()), Grads::new(3, 2, 9));
    }
}
