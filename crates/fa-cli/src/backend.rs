//! Command-line glue for the library's backend choice: clap value enums for `--backend` and
//! `--exp2`. Choosing, checking and calling a backend is `flash_attention`'s work.

pub use flash_attention::{Backend, BackendChoice, Exp2, Options};

/// `--backend auto|cpu|cuda`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendArg {
    /// CUDA when a device opens and takes the dtype, otherwise the CPU.
    #[default]
    Auto,
    /// The SIMD tiled CPU kernel (fa-cpu).
    Cpu,
    /// The CUDA kernels (fa-cuda).
    Cuda,
}

impl From<BackendArg> for BackendChoice {
    fn from(a: BackendArg) -> Self {
        match a {
            BackendArg::Auto => BackendChoice::Auto,
            BackendArg::Cpu => BackendChoice::Cpu,
            BackendArg::Cuda => BackendChoice::Cuda,
        }
    }
}

/// `--exp2 auto|exact|cubic`: the software exp2 of the CPU kernel.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Exp2Arg {
    /// The library's choice: the cubic in the AMX forward (P rounded to bf16 there), the
    /// accurate polynomial elsewhere.
    #[default]
    Auto,
    /// The accurate polynomial.
    Exact,
    /// FlashAttention-4's cubic polynomial (softmax-core's `exp2_cubic`).
    Cubic,
}

impl From<Exp2Arg> for Exp2 {
    fn from(a: Exp2Arg) -> Self {
        match a {
            Exp2Arg::Auto => Exp2::Auto,
            Exp2Arg::Exact => Exp2::Exact,
            Exp2Arg::Cubic => Exp2::Cubic,
        }
    }
}

/// Parses a dtype name (`f32`, `bf16`, `f16`) for clap.
pub fn parse_dtype(name: &str) -> Result<softmax_core::DType, String> {
    softmax_core::DType::from_name(name).ok_or_else(|| {
        let known: Vec<&str> = softmax_core::DType::ALL.iter().map(|d| d.name()).collect();
        format!("unknown dtype '{name}' (known: {})", known.join(", "))
    })
}
