//! Host tensors and the files that hold them, with no attention kernels behind them.
//!
//! The `fa` command (fa-cli) reads its inputs and writes its outputs through this crate; the
//! `npy_reader` and `safetensors_reader` fuzz targets exercise the same readers without
//! building flash-attention, fa-cuda or fa-cpu's kernels (that is why it is a crate of its own:
//! it depends only on softmax-core's `DType`, `half`, `safetensors` and `serde_json`).
//!
//! - [`tensor`]: [`HostTensor`], a shape and typed data (f32, bf16, f16) in host memory.
//! - [`npy`]: NumPy `.npy` files, a small strict reader and a writer (and int32 index files).
//! - [`files`]: reading a tensor from a `.npy` or `.safetensors` file (told apart by content;
//!   the file's size is checked against its header before its data is read) and encoding
//!   tensors as the bytes of either format.
//! - [`memory`]: sizes checked before allocating, and fallible allocation: a tensor too large
//!   for the machine is an [`Error::TooLarge`], never an allocation abort.
//!
//! # Example
//! ```
//! use fa_io::files::{encode_tensors, read_tensor, FileFormat};
//! use fa_io::npy::{read_npy, write_npy};
//! use fa_io::{DType, HostTensor};
//!
//! let t = HostTensor::from_f32(DType::Bf16, vec![1, 2, 1, 2], &[1.0, -2.0, 0.5, 3.0])?;
//! assert_eq!(read_npy(&write_npy(&t)).unwrap(), t);
//!
//! let path = std::env::temp_dir().join(format!("fa-io-doctest-{}.safetensors", std::process::id()));
//! let bytes = encode_tensors(&path, FileFormat::Safetensors, &[("q", &t)])?;
//! std::fs::write(&path, bytes).unwrap();
//! let read = read_tensor(&path, "q");
//! std::fs::remove_file(&path).unwrap();
//! assert_eq!(read?, (t, FileFormat::Safetensors));
//! # Ok::<(), fa_io::Error>(())
//! ```

mod error;
pub mod files;
pub mod memory;
pub mod npy;
pub mod tensor;

pub use error::Error;
pub use tensor::{DType, Data, HostTensor};
