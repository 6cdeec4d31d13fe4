//! The software exp2 on arbitrary f32 bit patterns against libm's f64 exp2 and its documented
//! special-value contract.
#![no_main]

use libfuzzer_sys::fuzz_target;
use softmax_core::exp2::{EXP2_CUBIC_MAX, EXP2_CUBIC_MIN};
use softmax_core::{exp2_cubic, EXP2_CUBIC_MAX_REL_ERROR};

fuzz_target!(|data: [u8; 4]| {
    let x = f32::from_le_bytes(data);
    let y = exp2_cubic(x);
    if x.is_nan() {
        assert!(y.is_nan());
    } else if x >= EXP2_CUBIC_MAX {
        assert_eq!(y, f32::INFINITY);
    } else if x < EXP2_CUBIC_MIN {
        assert_eq!(y, 0.0);
    } else {
        let exact = libm::exp2(x as f64);
        let rel = ((y as f64 - exact) / exact).abs();
        if exact < f32::MAX as f64 {
            assert!(rel <= EXP2_CUBIC_MAX_REL_ERROR, "x = {x}: rel error {rel:e}");
        }
    }
});
