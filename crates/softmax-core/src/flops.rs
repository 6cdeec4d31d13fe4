//! The forward pass's FLOP count, written once for every benchmark and report (DESIGN.md §7).

/// Floating-point operations of one attention forward pass, FlashAttention's convention:
/// `4·B·H·Nq·Nk·D` (two matrix products of `2·Nq·Nk·D` each per head), halved when causal
/// with `Nq = Nk`, where the mask hides half of the score matrix.
///
/// A causal problem with `Nq ≠ Nk` is counted in full: its bottom-right aligned mask hides a
/// share that depends on both lengths, and every report so far counted it unhalved.
///
/// ```
/// use softmax_core::flops;
/// assert_eq!(flops::forward(1, 8, 1024, 1024, 128, false), 4.0 * 8.0 * 1024.0 * 1024.0 * 128.0);
/// assert_eq!(flops::forward(1, 8, 1024, 1024, 128, true), 2.0 * 8.0 * 1024.0 * 1024.0 * 128.0);
/// ```
pub fn forward(
    batch: usize,
    heads_q: usize,
    seqlen_q: usize,
    seqlen_k: usize,
    head_dim: usize,
    causal: bool,
) -> f64 {
    let full =
        4.0 * batch as f64 * heads_q as f64 * seqlen_q as f64 * seqlen_k as f64 * head_dim as f64;
    if causal && seqlen_q == seqlen_k {
        full / 2.0
    } else {
        full
    }
}

/// Floating-point operations of one attention backward pass: `2.5 ×` [`forward`], the usual
/// convention (FlashAttention's benchmarks): five matrix products of `2·Nq·Nk·D` each per head
/// (`S = QKᵀ` recomputed, `dP = dO·Vᵀ`, `dV = Pᵀ·dO`, `dQ = dS·K`, `dK = dSᵀ·Q`) against the
/// forward's two, with the same causal halving. Element-wise work (exponentials, `dS`) is not
/// counted, as in the forward.
///
/// ```
/// use softmax_core::flops;
/// assert_eq!(flops::backward(1, 8, 1024, 1024, 128, true), 2.5 * flops::forward(1, 8, 1024, 1024, 128, true));
/// ```
pub fn backward(
    batch: usize,
    heads_q: usize,
    seqlen_q: usize,
    seqlen_k: usize,
    head_dim: usize,
    causal: bool,
) -> f64 {
    2.5 * forward(batch, heads_q, seqlen_q, seqlen_k, head_dim, causal)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_halved_only_for_square_causal() {
        assert_eq!(
            forward(2, 3, 5, 7, 11, false),
            4.0 * 2.0 * 3.0 * 5.0 * 7.0 * 11.0
        );
        // seqlen_q ≠ seqlen_k: no halving, as every earlier copy of the formula did.
        assert_eq!(
            forward(2, 3, 5, 7, 11, true),
            4.0 * 2.0 * 3.0 * 5.0 * 7.0 * 11.0
        );
        assert_eq!(
            forward(2, 3, 5, 5, 11, true),
            2.0 * 2.0 * 3.0 * 5.0 * 5.0 * 11.0
        );
        assert_eq!(forward(0, 3, 5, 5, 11, true), 0.0);
    }

    #[test]
    fn backward_is_five_products() {
        let one_product = 2.0 * 2.0 * 3.0 * 5.0 * 7.0 * 11.0;
        assert_eq!(backward(2, 3, 5, 7, 11, false), 5.0 * one_product);
        assert_eq!(
            backward(2, 3, 5, 5, 11, true),
            2.5 * 2.0 * 2.0 * 3.0 * 25.0 * 11.0
        );
    }
}
