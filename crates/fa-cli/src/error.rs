//! The command's error type: every failure is a value with a message, never a panic.

use softmax_core::ProblemError;
use std::path::PathBuf;

/// Why a subcommand failed.
#[derive(Debug)]
pub enum CliError {
    /// A file could not be read or written.
    Io {
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// A file was read but its content is not usable.
    BadFile {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The inputs' shapes or dtypes do not fit together.
    Shape(String),
    /// The attention problem was rejected (softmax-core's typed error).
    Problem(ProblemError),
    /// The requested backend is not available or failed.
    Backend(String),
    /// A bad combination of arguments.
    Usage(String),
    /// A size this machine cannot hold (or that overflows), found before allocating.
    TooLarge {
        /// What was being sized.
        what: String,
        /// Bytes it needs (`None`: the size overflows).
        needed: Option<u128>,
        /// Bytes available (`None`: unknown).
        available: Option<u64>,
    },
}

impl core::fmt::Display for CliError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            CliError::Io { path, source } => write!(f, "{}: {source}", path.display()),
            CliError::BadFile { path, reason } => write!(f, "{}: {reason}", path.display()),
            CliError::Shape(why) => write!(f, "shape mismatch: {why}"),
            CliError::Problem(e) => write!(f, "invalid attention problem: {e}"),
            CliError::Backend(why) => write!(f, "backend: {why}"),
            CliError::Usage(why) => f.write_str(why),
            CliError::TooLarge {
                what,
                needed,
                available,
            } => {
                let human = crate::plan::human_bytes;
                match needed {
                    None => write!(f, "too large: the size of {what} overflows"),
                    Some(n) => {
                        write!(f, "too large for this machine: {what} needs {}", human(*n))?;
                        match available {
                            Some(a) => write!(f, ", {} available", human(*a as u128)),
                            None => f.write_str(", more than this process can address"),
                        }
                    }
                }
            }
        }
    }
}

impl std::error::Error for CliError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            CliError::Io { source, .. } => Some(source),
            CliError::Problem(e) => Some(e),
            _ => None,
        }
    }
}

impl From<ProblemError> for CliError {
    fn from(e: ProblemError) -> Self {
        CliError::Problem(e)
    }
}

/// fa-io's errors become the command's variants of the same name, with the same messages; an
/// unsupported dtype is a usage error.
impl From<fa_io::Error> for CliError {
    fn from(e: fa_io::Error) -> Self {
        match e {
            fa_io::Error::Io { path, source } => CliError::Io { path, source },
            fa_io::Error::BadFile { path, reason } => CliError::BadFile { path, reason },
            fa_io::Error::TooLarge {
                what,
                needed,
                available,
            } => CliError::TooLarge {
                what,
                needed,
                available,
            },
            e @ fa_io::Error::UnsupportedDtype(_) => CliError::Usage(e.to_string()),
        }
    }
}

impl From<flash_attention::Error> for CliError {
    fn from(e: flash_attention::Error) -> Self {
        match e {
            flash_attention::Error::Problem(p) => CliError::Problem(p),
            other => CliError::Backend(other.to_string()),
        }
    }
}
