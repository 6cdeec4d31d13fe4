//! The entry points' instances that the workspace's callers use, compiled once, here.
//!
//! [`crate::forward()`], [`crate::backward()`] and their `_with_workspace` forms are generic over
//! the element types, so every crate that calls them compiled the whole kernel tree again for
//! its types (each SIMD level, the AMX and decode paths). Measured on the 2-core development
//! VM (`cargo test --workspace --no-run --timings`, a cold target, the dev profile with line
//! tables): fa-cpu itself took 2.7 s, but flash-attention 267 s, its unit tests 248 s, each of
//! fa-cpu's large integration tests ~140 s and each example ~85 s; 917 s in all. Under the
//! dev profile (`opt-level = 1`) rustc shares generic instances: a crate links to an instance
//! that a dependency already compiled instead of compiling its own. So fa-cpu compiles here,
//! once, the pairs and triples of element types that `flash-attention` exposes (input;
//! output and gradient: the input's type or f32). With them the same build took 396 s
//! (fa-cpu 273 s, flash-attention under 1 s). Other combinations still work; they are
//! compiled where they are used. Optimised builds (`opt-level` 2 and 3) do not share
//! instances: there these would be compiled for nothing, so the module exists only with
//! debug assertions (the dev profile) and not under cargo-fuzz (`cfg(fuzzing)`, whose
//! release build keeps debug assertions on).

use crate::{backward, backward_with_workspace, forward, forward_with_workspace, Element};
use half::{bf16, f16};

/// Addresses of the instances of the forward's entry points for input `T`, output `O`.
fn forward_pair<T: Element, O: Element>() -> [*const (); 2] {
    [
        forward::<T, O> as *const (),
        forward_with_workspace::<T, O> as *const (),
    ]
}

/// Addresses of the instances of the backward's entry points for input `T`, output `O`,
/// gradient `G`.
fn backward_triple<T: Element, O: Element, G: Element>() -> [*const (); 2] {
    [
        backward::<T, O, G> as *const (),
        backward_with_workspace::<T, O, G> as *const (),
    ]
}

/// Makes the instances exist in this crate (a public non-generic function is compiled, and
/// with it everything it names). Nothing needs to call it.
#[doc(hidden)]
pub fn shared_instances() -> [[*const (); 2]; 14] {
    [
        forward_pair::<f32, f32>(),
        forward_pair::<bf16, bf16>(),
        forward_pair::<bf16, f32>(),
        forward_pair::<f16, f16>(),
        forward_pair::<f16, f32>(),
        backward_triple::<f32, f32, f32>(),
        backward_triple::<bf16, bf16, bf16>(),
        backward_triple::<bf16, bf16, f32>(),
        backward_triple::<bf16, f32, bf16>(),
        backward_triple::<bf16, f32, f32>(),
        backward_triple::<f16, f16, f16>(),
        backward_triple::<f16, f16, f32>(),
        backward_triple::<f16, f32, f16>(),
        backward_triple::<f16, f32, f32>(),
    ]
}
