//! How many accumulator rescales the threshold policy (τ = 8) saves against "always", on
//! random rows and on rows of increasing scores (the worst case), with 64-key blocks.
//!
//! `cargo run --release -p softmax-core --example rescale_savings`

use softmax_core::{RescalePolicy, RescaleStats, RowState, LOG2_E};

fn count(rows: &[Vec<f32>], policy: RescalePolicy<f32>) -> RescaleStats {
    let mut stats = RescaleStats::default();
    for row in rows {
        let mut state = RowState::new();
        for block in row.chunks(64) {
            let mut b: Vec<f32> = block.iter().map(|s| s * LOG2_E as f32).collect();
            state.update(&mut b, &policy, &mut stats);
        }
    }
    stats
}

fn main() {
    let mut rng = fa_reference::Rng::new(2024);
    let seqlen = 8192;
    let scaled_normal = |rng: &mut fa_reference::Rng, sd: f64| {
        (0..seqlen)
            .map(|_| (rng.normal() * sd) as f32)
            .collect::<Vec<f32>>()
    };
    let cases: Vec<(&str, Vec<Vec<f32>>)> = vec![
        (
            "random N(0,1) scores",
            (0..256).map(|_| scaled_normal(&mut rng, 1.0)).collect(),
        ),
        (
            "random N(0,3) scores",
            (0..256).map(|_| scaled_normal(&mut rng, 3.0)).collect(),
        ),
        (
            "increasing, +0.01 per key",
            vec![(0..seqlen).map(|j| j as f32 * 0.01).collect()],
        ),
        (
            "increasing, +1 per key",
            vec![(0..seqlen).map(|j| j as f32).collect()],
        ),
    ];
    println!("seqlen {seqlen}, blocks of 64 keys, τ = 8 (log2 units)");
    println!(
        "{:<28} {:>10} {:>16} {:>16} {:>8}",
        "rows", "blocks", "rescales always", "rescales τ=8", "saved"
    );
    for (name, rows) in &cases {
        let always = count(rows, RescalePolicy::Always);
        let threshold = count(rows, RescalePolicy::Threshold(8.0));
        let saved = if always.rescales > 0 {
            100.0 * (1.0 - threshold.rescales as f64 / always.rescales as f64)
        } else {
            0.0
        };
        println!(
            "{:<28} {:>10} {:>16} {:>16} {:>7.1}%",
            name, always.blocks, always.rescales, threshold.rescales, saved
        );
    }
}
