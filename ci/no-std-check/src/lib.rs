//! A no_std consumer of softmax-core (see Cargo.toml for why this is a static library).
#![no_std]

use softmax_core::{exp2_cubic, Mask, ProblemDesc, RescalePolicy, RescaleStats, RowState};

/// Runs the online softmax over a C array, so that the symbols are really linked.
#[no_mangle]
pub extern "C" fn no_std_check(scores: *mut f32, len: usize) -> f32 {
    if scores.is_null() {
        return f32::NAN;
    }
    // SAFETY: the caller passes a valid, exclusive array of `len` floats.
    let row = unsafe { core::slice::from_raw_parts_mut(scores, len) };
    let mut state = RowState::new();
    let mut stats = RescaleStats::default();
    state.update_with(row, &RescalePolicy::default(), &mut stats, exp2_cubic);
    let valid = ProblemDesc::new(1, len, len, 1, 1, 64)
        .with_mask(Mask::CAUSAL)
        .validate(256)
        .is_ok();
    if valid {
        state.finish().lse
    } else {
        f32::NAN
    }
}

#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    loop {}
}
