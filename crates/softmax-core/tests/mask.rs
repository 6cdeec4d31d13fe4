//! Mask rules against brute force: per element, per tile, and the tile-range used to skip.

use proptest::prelude::*;
use softmax_core::{Mask, TileKind};

/// The rule written out from the definition (bottom-right aligned).
fn brute(mask: &Mask, i: usize, j: usize, sq: usize, sk: usize) -> bool {
    let a = i as i64 + sk as i64 - sq as i64;
    let j = j as i64;
    mask.left.is_none_or(|l| j >= a - l as i64) && mask.right.is_none_or(|r| j <= a + r as i64)
}

fn mask() -> impl Strategy<Value = Mask> {
    (prop::option::of(0usize..40), prop::option::of(0usize..40))
        .prop_map(|(left, right)| Mask { left, right })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn key_range_matches_definition(m in mask(), sq in 0usize..70, sk in 0usize..70) {
        for i in 0..sq {
            let range = m.key_range(i, sq, sk);
            for j in 0..sk {
                prop_assert_eq!(range.contains(&j), brute(&m, i, j, sq, sk), "i={} j={}", i, j);
            }
        }
    }

    #[test]
    fn tile_classification_matches_brute_force(
        m in mask(), sq in 1usize..70, sk in 1usize..70, br in 1usize..17, bc in 1usize..17,
    ) {
        for r0 in (0..sq).step_by(br) {
            let rows = r0..(r0 + br).min(sq);
            let tiles = m.key_tile_range(rows.clone(), bc, sq, sk);
            for c0 in (0..sk).step_by(bc) {
                let cols = c0..(c0 + bc).min(sk);
                let visible = rows.clone()
                    .flat_map(|i| cols.clone().map(move |j| (i, j)))
                    .filter(|&(i, j)| brute(&m, i, j, sq, sk))
                    .count();
                let want = if visible == 0 {
                    TileKind::Empty
                } else if visible == rows.len() * cols.len() {
                    TileKind::Full
                } else {
                    TileKind::Partial
                };
                prop_assert_eq!(m.classify_tile(rows.clone(), cols.clone(), sq, sk), want,
                    "rows {:?} cols {:?}", rows, cols);
                // Every non-empty tile lies inside the range of tiles to visit.
                if want != TileKind::Empty {
                    prop_assert!(tiles.contains(&(c0 / bc)), "tile {} outside {:?}", c0 / bc, tiles);
                }
            }
        }
    }
}

#[test]
fn causal_is_bottom_right_aligned() {
    // 2 queries, 5 keys: the last query sees every key, the first all but the last.
    let m = Mask::CAUSAL;
    assert_eq!(m.key_range(0, 2, 5), 0..4);
    assert_eq!(m.key_range(1, 2, 5), 0..5);
    // More queries than keys: the first rows see nothing (output 0, LSE −∞).
    assert_eq!(m.key_range(0, 5, 2), 0..0);
    assert_eq!(m.key_range(3, 5, 2), 0..1);
}

#[test]
fn flash_args_convention() {
    assert_eq!(Mask::from_flash_args(false, -1, -1), Mask::NONE);
    assert_eq!(Mask::from_flash_args(true, -1, -1), Mask::CAUSAL);
    assert_eq!(Mask::from_flash_args(true, -1, 0), Mask::CAUSAL);
    // Causal and a window intersect.
    let m = Mask::from_flash_args(true, 3, 5);
    assert_eq!(
        m,
        Mask {
            left: Some(3),
            right: Some(0)
        }
    );
    assert_eq!(m.key_range(10, 20, 20), 7..11);
}
