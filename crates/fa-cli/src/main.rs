//! The `fa` command. **Status:** only `fa exp2-error` exists so far; `run`, `verify`, `bench`,
//! `plan` and `demo` come with the fa-cpu issue.

use softmax_core::EXP2_CUBIC_MAX_REL_ERROR;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("exp2-error") => {
            let (worst_x, worst) = sweep_exp2();
            println!(
                "exp2_cubic: max relative error {worst:.3e} at x = {worst_x:e} over every f32 in [-125, 128) (documented bound {EXP2_CUBIC_MAX_REL_ERROR:e})"
            );
            if worst > EXP2_CUBIC_MAX_REL_ERROR {
                std::process::exit(1);
            }
        }
        _ => {
            eprintln!("usage: fa exp2-error   (measures the software exp2 over every f32 input)");
            std::process::exit(2);
        }
    }
}

/// Every f32 in [-125, 128): returns the input with the largest relative error and that error.
fn sweep_exp2() -> (f32, f64) {
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
