//! `fa exp2-error`: the software exp2's relative error measured over every f32 input.

/// Every f32 in [-125, 128), split over the cores: the input with the largest relative error
/// of `softmax_core::exp2_cubic` and that error.
pub fn sweep_exp2() -> (f32, f64) {
    use softmax_core::exp2::{exp2_max_rel_error, EXP2_DOMAIN_LEN};
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
    let chunk = EXP2_DOMAIN_LEN.div_ceil(threads);
    let handles: Vec<_> = (0..threads)
        .map(|t| std::thread::spawn(move || exp2_max_rel_error(t * chunk..(t + 1) * chunk, 1)))
        .collect();
    handles
        .into_iter()
        .filter_map(|h| h.join().ok())
        .fold((0.0, 0.0), |a, b| if b.1 > a.1 { b } else { a })
}
