//! The `fa` command's library: tensor files, the subcommands' logic and their reports.
//!
//! The binary (`src/main.rs`) parses arguments with clap and calls into these modules, which
//! run attention through the `flash_attention` library (backend choice, checks, calls):
//!
//! - [`run`]: attention over Q, K, V read from `.npy` / `.safetensors` files (BSHD, f32, bf16,
//!   f16; GQA inferred from the head counts), output written in the input's format and dtype.
//! - [`verify`]: a backend against the f64 reference (`fa-reference`) on random problems.
//! - [`bench`](mod@bench): time, GFLOP/s and peak memory over the paper shapes or given
//!   ones, with [`peers`]: ratios over PyTorch SDPA's numbers.
//! - [`plan`]: KV-cache and score-matrix arithmetic against the tiled kernel's O(N) memory,
//!   and decode's bandwidth bound per token beside a measured step.
//! - [`demo`]: one long sequence on the best backend, checked on sampled rows.
//!
//! # Example
//! ```
//! use fa_cli::npy::{read_npy, write_npy};
//! use fa_cli::tensor::{DType, HostTensor};
//!
//! let t = HostTensor::from_f32(DType::Bf16, vec![1, 2, 1, 2], &[1.0, -2.0, 0.5, 3.0])?;
//! let bytes = write_npy(&t);
//! assert_eq!(read_npy(&bytes).unwrap(), t);
//! assert_eq!(fa_cli::plan::human_bytes(fa_cli::plan::kv_cache_bytes(&fa_cli::plan::llama3_70b())), "40 GiB");
//! # Ok::<(), fa_cli::CliError>(())
//! ```

pub mod alloc_count;
pub mod backend;
pub mod bench;
pub mod bench_backward;
pub mod decode_bench;
pub mod demo;
pub mod error;
pub mod exp2_error;
pub mod files;
pub mod memory;
pub mod peers;
pub mod plan;
pub mod rows;
pub mod run;
pub mod run_backward;
pub mod tensor;
pub mod verify;
pub mod verify_backward;

pub use error::CliError;
/// The `.npy` codec (fa-io's; `fa_cli::npy` is kept for callers).
pub use fa_io::npy;
