//! FP8 attention support (work in progress).
pub mod codec;
pub mod error;
pub mod format;
pub mod hadamard;
pub mod scale;

pub use codec::{
    decode_scaled, decode_slice, encode_scaled, encode_slice, round_scaled_in_place, CodecPath,
};
pub use error::Fp8Error;
pub use format::{Fp8Format, NAN_CODE};
