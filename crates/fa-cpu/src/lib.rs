//! SIMD tiled CPU implementation of exact attention: the fallback for hosts without a GPU.
//!
//! **Status: not implemented yet** (issue "fa-cpu: SIMD tiled exact forward attention").
//! This crate will hold the tiled forward and backward passes, runtime SIMD dispatch
//! (AVX-512 / AVX2 / portable) and rayon parallelism, all calling `softmax-core` for the
//! online softmax. Until then it exports nothing: there is no placeholder that pretends to
//! compute attention.
