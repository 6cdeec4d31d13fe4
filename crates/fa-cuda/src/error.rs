//! The crate's error type: bad input (the same typed errors as every backend) or a failure of
//! the CUDA driver, NVRTC or a launch.

use core::fmt;
use softmax_core::{ProblemError, Tensor};

/// Why a CUDA call of this crate failed.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum CudaError {
    /// The problem or the buffers were rejected before anything ran (outputs untouched).
    Problem(ProblemError),
    /// The CUDA driver library (`libcuda.so`) could not be loaded: no driver on this machine.
    NoDriver,
    /// The NVRTC library (`libnvrtc.so`) could not be loaded.
    NoNvrtc,
    /// The driver found no device with this ordinal.
    NoDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// Devices the driver sees.
        count: usize,
    },
    /// The device is older than the kernels need (compute capability 8.0).
    UnsupportedArch {
        /// Compute capability major.
        major: i32,
        /// Compute capability minor.
        minor: i32,
    },
    /// A CUDA driver call failed (`what` names the call).
    Driver {
        /// The call that failed.
        what: &'static str,
        /// The driver's error name and code.
        error: String,
    },
    /// NVRTC rejected a kernel variant.
    Compile {
        /// The variant (its defines).
        variant: String,
        /// NVRTC's log.
        log: String,
    },
    /// A device buffer belongs to another device or context than the one asked to run.
    ForeignBuffer,
    /// The stream belongs to another context than the device's.
    ForeignStream,
    /// A raw device address is null while its tensor is not empty (nothing was queued).
    NullPointer {
        /// The tensor.
        tensor: Tensor,
    },
    /// A raw device address is not aligned as the kernel needs (nothing was queued).
    Misaligned {
        /// The tensor.
        tensor: Tensor,
        /// The address given.
        ptr: u64,
        /// The alignment needed, in bytes.
        align: u64,
    },
    /// A raw `CUcontext` is not its device's primary context: only primary contexts can be
    /// shared without taking ownership (wrap other contexts in a `CudaContext` and use
    /// [`crate::Device::from_context`]).
    NotPrimaryContext,
    /// The caller's split-KV workspace is smaller than the call needs (see
    /// [`crate::Device::decode_workspace_bytes`]); nothing was queued.
    WorkspaceTooSmall {
        /// Bytes needed.
        needed: usize,
        /// Bytes given.
        len: usize,
    },
    /// The split-KV workspace's address is null or not 16-byte aligned (nothing was queued).
    BadWorkspace {
        /// The address given.
        ptr: u64,
    },
}

impl CudaError {
    /// Wraps a driver error with the name of the call that returned it.
    pub(crate) fn driver(what: &'static str, error: cudarc::driver::DriverError) -> CudaError {
        CudaError::Driver {
            what,
            error: format!("{error:?}"),
        }
    }
}

impl From<ProblemError> for CudaError {
    fn from(e: ProblemError) -> Self {
        CudaError::Problem(e)
    }
}

impl fmt::Display for CudaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CudaError::Problem(e) => write!(f, "invalid problem: {e}"),
            CudaError::NoDriver => f.write_str("no CUDA driver: libcuda could not be loaded"),
            CudaError::NoNvrtc => {
                f.write_str("NVRTC not found: libnvrtc could not be loaded (set LD_LIBRARY_PATH)")
            }
            CudaError::NoDevice { ordinal, count } => {
                write!(f, "no CUDA device {ordinal}: the driver sees {count}")
            }
            CudaError::UnsupportedArch { major, minor } => write!(
                f,
                "compute capability {major}.{minor} is not supported: sm_80 or newer is needed"
            ),
            CudaError::Driver { what, error } => {
                write!(f, "CUDA driver call {what} failed: {error}")
            }
            CudaError::Compile { variant, log } => {
                write!(f, "NVRTC failed on kernel variant {variant}:\n{log}")
            }
            CudaError::ForeignBuffer => {
                f.write_str("a device buffer belongs to another CUDA context than this device")
            }
            CudaError::ForeignStream => {
                f.write_str("the stream belongs to another CUDA context than this device")
            }
            CudaError::NullPointer { tensor } => {
                write!(f, "{tensor}: null device pointer for a non-empty tensor")
            }
            CudaError::Misaligned { tensor, ptr, align } => {
                write!(
                    f,
                    "{tensor}: device pointer {ptr:#x} is not {align}-byte aligned"
                )
            }
            CudaError::NotPrimaryContext => {
                f.write_str("the CUcontext is not its device's primary context")
            }
            CudaError::BadWorkspace { ptr } => write!(
                f,
                "the decode workspace at {ptr:#x} is null or not 16-byte aligned"
            ),
            CudaError::WorkspaceTooSmall { needed, len } => write!(
                f,
                "the decode workspace holds {len} bytes; this call needs {needed}"
            ),
        }
    }
}

impl std::error::Error for CudaError {}
