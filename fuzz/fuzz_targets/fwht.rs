//! The FWHT and the randomised Hadamard transform on arbitrary vectors: involution, inverse,
//! norm preservation, dot products kept, bad lengths rejected without touching the data.
#![no_main]

use fa_fp8::hadamard::{fwht, RandomHadamard};
use libfuzzer_sys::fuzz_target;

fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum()
}

fuzz_target!(|data: (u8, u64, Vec<i16>)| {
    let (log_dim, seed, raw) = data;
    let dim = 1usize << (log_dim % 10); // 1..=512: 512 must be rejected
    // Bounded finite inputs (i16 / 64), so that f32 sums cannot overflow.
    let x: Vec<f32> = raw.iter().take(2 * dim).map(|&v| v as f32 / 64.0).collect();
    if x.len() < 2 * dim {
        return;
    }
    let Ok(m) = RandomHadamard::new(dim, seed) else {
        assert!(dim > 256);
        let mut y = x[..dim].to_vec();
        assert!(fwht(&mut y).is_err());
        assert_eq!(y, x[..dim]);
        return;
    };
    let tol = |scale: f64| 1e-5 * (1.0 + scale) * (1.0 + (dim as f64).log2());
    // FWHT is its own inverse.
    let mut y = x[..dim].to_vec();
    fwht(&mut y).unwrap();
    fwht(&mut y).unwrap();
    let norm = dot(&x[..dim], &x[..dim]).sqrt();
    for (a, b) in x[..dim].iter().zip(&y) {
        assert!(((a - b) as f64).abs() <= tol(norm));
    }
    // M keeps norms and dot products; Mᵀ undoes M.
    let mut z = x.clone();
    m.apply(&mut z).unwrap();
    let (q, k) = x.split_at(dim);
    let (qm, km) = z.split_at(dim);
    let scale = dot(q, q).sqrt() * dot(k, k).sqrt();
    assert!((dot(q, k) - dot(qm, km)).abs() <= tol(scale));
    assert!((dot(q, q) - dot(qm, qm)).abs() <= tol(dot(q, q)));
    m.invert(&mut z).unwrap();
    for (a, b) in x.iter().zip(&z) {
        assert!(((a - b) as f64).abs() <= tol(norm.max(dot(k, k).sqrt())));
    }
});
