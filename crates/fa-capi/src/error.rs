//! Errors at the boundary: a code and a message per failure, the thread-local last message,
//! and [`guard`], which every entry point runs its body in so that no panic crosses into C.

use crate::types::*;
use core::ffi::c_char;
use softmax_core::ProblemError;
use std::cell::RefCell;
use std::ffi::CString;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Why a call failed: the code C sees and the message `fa_last_error_message` returns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Failure {
    pub code: i32,
    pub message: String,
}

impl Failure {
    pub fn invalid(message: impl Into<String>) -> Failure {
        Failure {
            code: FA_ERR_INVALID_ARGUMENT,
            message: message.into(),
        }
    }
    pub fn unsupported(message: impl Into<String>) -> Failure {
        Failure {
            code: FA_ERR_UNSUPPORTED,
            message: message.into(),
        }
    }
}

impl From<ProblemError> for Failure {
    fn from(e: ProblemError) -> Failure {
        let code = match e {
            ProblemError::Unsupported { .. } => FA_ERR_UNSUPPORTED,
            _ => FA_ERR_INVALID_ARGUMENT,
        };
        Failure {
            code,
            message: e.to_string(),
        }
    }
}

impl From<flash_attention::Error> for Failure {
    fn from(e: flash_attention::Error) -> Failure {
        use flash_attention::Error as E;
        match e {
            E::Problem(p) => p.into(),
            E::Cuda(c) => c.into(),
            E::Unavailable { .. } => Failure {
                code: FA_ERR_NO_DEVICE,
                message: e.to_string(),
            },
            E::InvalidArgument(message) => Failure::invalid(message),
            other => Failure {
                code: FA_ERR_CUDA,
                message: other.to_string(),
            },
        }
    }
}

impl From<fa_cuda::CudaError> for Failure {
    fn from(e: fa_cuda::CudaError) -> Failure {
        use fa_cuda::CudaError as C;
        let code = match &e {
            C::Problem(p) => return (*p).into(),
            C::NoDriver | C::NoNvrtc | C::NoDevice { .. } => FA_ERR_NO_DEVICE,
            C::UnsupportedArch { .. } => FA_ERR_UNSUPPORTED,
            C::ForeignBuffer
            | C::ForeignStream
            | C::NullPointer { .. }
            | C::Misaligned { .. }
            | C::WorkspaceTooSmall { .. }
            | C::BadWorkspace { .. }
            | C::NotPrimaryContext => FA_ERR_INVALID_ARGUMENT,
            _ => FA_ERR_CUDA,
        };
        Failure {
            code,
            message: e.to_string(),
        }
    }
}

thread_local! {
    /// The message of the last failed call on this thread (empty after a success).
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last_error(message: &str) {
    // A NUL inside the message would cut it short in C: drop them.
    let text = CString::new(message.replace('\0', "")).unwrap_or_default();
    LAST_ERROR.with(|last| *last.borrow_mut() = text);
}

/// The last message of this thread, as a pointer valid until the next call that sets it.
pub(crate) fn last_error_ptr() -> *const c_char {
    LAST_ERROR.with(|last| last.borrow().as_ptr())
}

/// Runs an entry point's body: clears the last error, turns `Err` into its code and message
/// and a panic into `FA_ERR_PANIC` with the panic's message.
pub(crate) fn guard(body: impl FnOnce() -> Result<(), Failure>) -> i32 {
    set_last_error("");
    // AssertUnwindSafe: after a panic nothing the body touched is used again, except the
    // caller's outputs, which the code documents as unspecified.
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => FA_OK,
        Ok(Err(failure)) => {
            set_last_error(&failure.message);
            failure.code
        }
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown payload".to_string());
            set_last_error(&format!(
                "internal error (panic caught at the C boundary): {what}"
            ));
            FA_ERR_PANIC
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;

    fn last() -> String {
        // SAFETY: the pointer is this thread's message, alive until the next `set_last_error`.
        unsafe { CStr::from_ptr(last_error_ptr()) }
            .to_string_lossy()
            .into_owned()
    }

    #[test]
    fn a_panic_becomes_a_code_and_a_message() {
        let code = guard(|| panic!("boom {}", 42));
        assert_eq!(code, FA_ERR_PANIC);
        assert!(last().contains("boom 42"), "{}", last());
        let code = guard(|| std::panic::panic_any(7u8));
        assert_eq!(code, FA_ERR_PANIC);
        assert!(last().contains("unknown payload"));
        // A success clears the message.
        assert_eq!(guard(|| Ok(())), FA_OK);
        assert_eq!(last(), "");
    }

    #[test]
    fn failures_keep_their_code_and_message_without_nuls() {
        let code = guard(|| Err(Failure::invalid("bad\0 thing")));
        assert_eq!(code, FA_ERR_INVALID_ARGUMENT);
        assert_eq!(last(), "bad thing");
        let f: Failure = ProblemError::Unsupported { what: "nope" }.into();
        assert_eq!(f.code, FA_ERR_UNSUPPORTED);
        let f: Failure = fa_cuda::CudaError::NoDriver.into();
        assert_eq!(f.code, FA_ERR_NO_DEVICE);
    }
}
