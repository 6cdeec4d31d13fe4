//! The crate's error type: every failure is a value with a message, never a panic.

use crate::memory::human_bytes;
use softmax_core::DType;
use std::path::PathBuf;

/// Why a tensor could not be read, encoded or allocated.
///
/// The messages are the `fa` command's: fa-cli turns each variant into the `CliError` of the
/// same name (an unsupported dtype into its usage error) with the same text.
#[derive(Debug)]
pub enum Error {
    /// A file could not be read.
    Io {
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// A file was read but its content is not usable, or tensors cannot be encoded in a format.
    BadFile {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A size this machine cannot hold (or that overflows), found before allocating.
    TooLarge {
        /// What was being sized.
        what: String,
        /// Bytes it needs (`None`: the size overflows).
        needed: Option<u128>,
        /// Bytes available (`None`: unknown).
        available: Option<u64>,
    },
    /// A dtype host tensors do not hold (`DType` may grow, e.g. fp8).
    UnsupportedDtype(DType),
}

impl core::fmt::Display for Error {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Error::Io { path, source } => write!(f, "{}: {source}", path.display()),
            Error::BadFile { path, reason } => write!(f, "{}: {reason}", path.display()),
            Error::TooLarge {
                what,
                needed,
                available,
            } => match needed {
                None => write!(f, "too large: the size of {what} overflows"),
                Some(n) => {
                    write!(
                        f,
                        "too large for this machine: {what} needs {}",
                        human_bytes(*n)
                    )?;
                    match available {
                        Some(a) => write!(f, ", {} available", human_bytes(*a as u128)),
                        None => f.write_str(", more than this process can address"),
                    }
                }
            },
            Error::UnsupportedDtype(dtype) => write!(
                f,
                "{dtype} tensors are not supported by fa (f32, bf16, f16 are)"
            ),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}
