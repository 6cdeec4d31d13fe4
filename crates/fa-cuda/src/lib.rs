//! CUDA kernels of exact attention, compiled at run time by NVRTC through `cudarc`.
//!
//! **Status: not implemented yet** (issue "fa-cuda: NVRTC-compiled forward kernel").
//! This crate will hold the Ampere-class (`mma.sync`) and Hopper (`wgmma`, TMA, warp
//! specialisation) forward kernels behind a safe API validated by `softmax-core`.
