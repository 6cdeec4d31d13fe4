//! FP8 attention support: e4m3/e5m2 codecs, per-block scaling and the randomized Hadamard
//! transform (incoherent processing).
//!
//! **Status: not implemented yet** (issue "fa-fp8: FP8 formats, per-block scaling and
//! Hadamard incoherent processing").
