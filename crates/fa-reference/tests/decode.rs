//! The oracle over KV caches: a padded or paged cache gives exactly the attention of the same
//! keys gathered into a packed problem without a cache (addressing checked against the
//! layout's definition on the way).

use fa_reference::{attention_f64, CacheLayout, DecodeCase, Rng, Rounding};
use softmax_core::Mask;

#[test]
fn cache_oracle_equals_the_gathered_packed_oracle() {
    let mut rng = Rng::new(41);
    let lens: [&[u32]; 3] = [&[0, 1, 37, 5], &[64], &[3, 0, 17]];
    for used in lens {
        for layout in [
            CacheLayout::Padded { capacity: 70 },
            DecodeCase::paged_layout(used, 1),
            DecodeCase::paged_layout(used, 3),
            DecodeCase::paged_layout(used, 16),
        ] {
            for (sq, mask) in [
                (1, Mask::NONE),
                (3, Mask::CAUSAL),
                (
                    2,
                    Mask {
                        left: Some(4),
                        right: Some(0),
                    },
                ),
            ] {
                let case = DecodeCase::new(&mut rng, used, sq, 4, 2, 8, layout, Rounding::F32)
                    .with_mask(mask);
                let problem = case.desc().validate(256).expect("valid");
                let cached = attention_f64(&problem, &case.q, &case.k, &case.v);
                let packed = case.gathered();
                let pp = packed.desc().validate(256).expect("valid");
                let gathered = attention_f64(&pp, &packed.q, &packed.k, &packed.v);
                // Same arithmetic in the same order: identical bits, O and LSE alike.
                assert_eq!(cached.out, gathered.out, "{layout:?} sq={sq}");
                // The LSE layouts differ (dense `[b, h, i]`, packed `[h, token]`).
                for b in 0..case.batch {
                    for h in 0..case.heads_q {
                        for i in 0..sq {
                            let (x, y) = (
                                cached.lse[problem.lse_offset(b, h, i)],
                                gathered.lse[pp.lse_offset(b, h, i)],
                            );
                            assert!(x == y, "{layout:?} sq={sq} lse {x} vs {y}");
                        }
                    }
                }
                // A sequence with keys has finite LSEs; the empty one has −∞.
                for (b, &u) in used.iter().enumerate() {
                    let at = problem.lse_offset(b, 0, sq - 1);
                    assert_eq!(cached.lse[at].is_finite(), u > 0, "seq {b}");
                }
            }
        }
    }
}
