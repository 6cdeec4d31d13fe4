//! Properties of the randomised Hadamard transform: `M` orthogonal, the inverse undoes it,
//! `(QM)(KM)ᵀ = QKᵀ` within rounding, the FWHT equals the dense Sylvester matrix, outliers are
//! spread.

use fa_fp8::hadamard::{fwht, RandomHadamard};
use fa_reference::Rng;
use proptest::prelude::*;

/// Entry `(i, j)` of the Sylvester Hadamard matrix: `(−1)^popcount(i & j)`.
fn h(i: usize, j: usize) -> f64 {
    if (i & j).count_ones().is_multiple_of(2) {
        1.0
    } else {
        -1.0
    }
}

/// The dense matrix `M = H·diag(s)/√d` built entry by entry from the definition, via the
/// transform's public signs.
fn dense(m: &RandomHadamard) -> Vec<f64> {
    let d = m.dim();
    let s = m.signs();
    let mut out = vec![0.0; d * d];
    for i in 0..d {
        for j in 0..d {
            out[i * d + j] = h(i, j) * s[j] as f64 / (d as f64).sqrt();
        }
    }
    out
}

fn dims() -> impl Strategy<Value = usize> {
    (0u32..=8).prop_map(|k| 1usize << k)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn m_is_orthogonal_and_matches_the_dense_definition(dim in dims(), seed in any::<u64>()) {
        let m = RandomHadamard::new(dim, seed).unwrap();
        let dense = dense(&m);
        // MᵀM = I, entry by entry.
        for a in 0..dim {
            for b in 0..dim {
                let dot: f64 = (0..dim).map(|i| dense[i * dim + a] * dense[i * dim + b]).sum();
                let want = if a == b { 1.0 } else { 0.0 };
                prop_assert!((dot - want).abs() < 1e-12, "MᵀM[{a},{b}] = {dot}");
            }
        }
        // The fast transform of each basis vector is the corresponding column of M.
        for j in 0..dim {
            let mut e = vec![0.0f32; dim];
            e[j] = 1.0;
            m.apply(&mut e).unwrap();
            for i in 0..dim {
                prop_assert!((e[i] as f64 - dense[i * dim + j]).abs() < 1e-6);
            }
        }
    }

    #[test]
    fn inverse_undoes_and_norms_are_kept(dim in dims(), seed in any::<u64>(), data_seed in any::<u64>()) {
        let m = RandomHadamard::new(dim, seed).unwrap();
        let mut rng = Rng::new(data_seed);
        let x: Vec<f32> = (0..3 * dim).map(|_| rng.normal() as f32 * 3.0).collect();
        let mut y = x.clone();
        m.apply(&mut y).unwrap();
        for (xr, yr) in x.chunks(dim).zip(y.chunks(dim)) {
            let nx: f64 = xr.iter().map(|&v| (v as f64).powi(2)).sum();
            let ny: f64 = yr.iter().map(|&v| (v as f64).powi(2)).sum();
            prop_assert!((nx - ny).abs() <= 1e-5 * nx.max(1e-30), "norm {nx} -> {ny}");
        }
        m.invert(&mut y).unwrap();
        for (a, b) in x.iter().zip(&y) {
            prop_assert!((a - b).abs() <= 1e-5 * (1.0 + a.abs()), "{a} -> {b}");
        }
    }

    #[test]
    fn scores_are_unchanged(dim in dims(), seed in any::<u64>(), data_seed in any::<u64>()) {
        let m = RandomHadamard::new(dim, seed).unwrap();
        let mut rng = Rng::new(data_seed);
        let (rows_q, rows_k) = (5, 7);
        // Outlier-heavy rows, as in the FlashAttention-3 experiment.
        let mut draw = |n: usize| -> Vec<f32> {
            (0..n)
                .map(|_| {
                    let base = rng.normal();
                    let spike = if rng.uniform() < 0.05 { 10.0 * rng.normal() } else { 0.0 };
                    (base + spike) as f32
                })
                .collect()
        };
        let q = draw(rows_q * dim);
        let k = draw(rows_k * dim);
        let (mut qm, mut km) = (q.clone(), k.clone());
        m.apply(&mut qm).unwrap();
        m.apply(&mut km).unwrap();
        for i in 0..rows_q {
            for j in 0..rows_k {
                let dot = |a: &[f32], b: &[f32]| -> f64 {
                    a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum()
                };
                let (qi, kj) = (&q[i * dim..][..dim], &k[j * dim..][..dim]);
                let exact = dot(qi, kj);
                let rotated = dot(&qm[i * dim..][..dim], &km[j * dim..][..dim]);
                // f32 rounding of the transform: relative to ‖q‖‖k‖, a few ulps times log2 d.
                let norms = dot(qi, qi).sqrt() * dot(kj, kj).sqrt();
                let bound = 4.0 * f32::EPSILON as f64 * (1.0 + (dim as f64).log2()) * norms;
                prop_assert!((exact - rotated).abs() <= bound, "{exact} vs {rotated} (bound {bound})");
            }
        }
    }
}

#[test]
fn fwht_is_an_involution_and_rejects_bad_dims() {
    let mut rng = Rng::new(11);
    for k in 0..=8 {
        let n = 1 << k;
        let x: Vec<f32> = (0..n).map(|_| rng.normal() as f32).collect();
        let mut y = x.clone();
        fwht(&mut y).unwrap();
        // y = H x/√n from the definition.
        for (i, &yi) in y.iter().enumerate() {
            let want: f64 = (0..n).map(|j| h(i, j) * x[j] as f64).sum::<f64>() / (n as f64).sqrt();
            assert!((yi as f64 - want).abs() < 1e-5 * (1.0 + want.abs()));
        }
        fwht(&mut y).unwrap();
        for (a, b) in x.iter().zip(&y) {
            assert!((a - b).abs() < 1e-5 * (1.0 + a.abs()));
        }
    }
    for bad in [0usize, 3, 96, 512] {
        let mut v = vec![1.0f32; bad];
        assert!(fwht(&mut v).is_err());
        assert!(v.iter().all(|&x| x == 1.0), "untouched on error");
        assert!(RandomHadamard::new(bad, 1).is_err());
    }
    let m = RandomHadamard::new(8, 1).unwrap();
    let mut v = vec![2.0f32; 12];
    assert!(m.apply(&mut v).is_err());
    assert!(v.iter().all(|&x| x == 2.0));
}

#[test]
fn an_outlier_is_spread_over_the_whole_vector() {
    let m = RandomHadamard::new(128, 42).unwrap();
    let mut x = vec![0.0f32; 128];
    x[17] = 100.0;
    m.apply(&mut x).unwrap();
    let expect = 100.0 / 128f32.sqrt();
    assert!(x.iter().all(|&v| (v.abs() - expect).abs() < 1e-4));
}

#[test]
fn signs_follow_the_documented_splitmix_stream() {
    // SplitMix64 from state 0: the first output is 0xe220a8397b1dcdaf (Vigna's reference).
    let m = RandomHadamard::new(64, 0).unwrap();
    assert_eq!(m.sign_bits(), &[0xe220_a839_7b1d_cdaf]);
    for (i, &s) in m.signs().iter().enumerate() {
        let bit = (0xe220_a839_7b1d_cdafu64 >> i) & 1;
        assert_eq!(s, if bit == 1 { -1.0 } else { 1.0 });
    }
    let a = RandomHadamard::new(256, 5).unwrap();
    let b = RandomHadamard::new(256, 6).unwrap();
    assert_ne!(a.signs(), b.signs());
    let negatives = a.signs().iter().filter(|&&s| s < 0.0).count();
    assert!(
        (80..=176).contains(&negatives),
        "{negatives} of 256 signs negative"
    );
}
