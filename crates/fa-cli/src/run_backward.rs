//! `fa run --dout dO.npy --dq dq.npy --dk dk.npy --dv dv.npy`: the backward pass after the
//! forward of `fa run`, so gradients can be checked from outside Rust. dO is read in O's
//! layout and dtype; dQ, dK, dV are written in Q's, K's and V's layouts, in the input dtype
//! (or f32 with `--grad-dtype f32`), in the same atomic write as the forward's files.

use crate::backend::{Backend, Options};
use crate::error::CliError;
use crate::files::{encode_tensors, read_tensor, FileFormat};
use crate::tensor::{DType, HostTensor, TensorViews};
use flash_attention::backward::BackwardInputs;
use softmax_core::{Grads, Problem, Qkv};
use std::path::{Path, PathBuf};

/// Files encoded and not yet written: `(path, bytes)`.
pub type EncodedFiles = Vec<(PathBuf, Vec<u8>)>;

/// The backward files of a `fa run`.
#[derive(Clone, Debug)]
pub struct BackwardFiles {
    /// `∂L/∂O`, shaped and typed as the output.
    pub d_o: PathBuf,
    /// Where dQ goes.
    pub dq: PathBuf,
    /// Where dK goes.
    pub dk: PathBuf,
    /// Where dV goes.
    pub dv: PathBuf,
    /// Gradient dtype (`None`: the input dtype; else it or f32).
    pub grad_dtype: Option<DType>,
}

impl BackwardFiles {
    /// The input flag and path (dO), for the outputs-are-not-inputs check.
    pub fn inputs(&self) -> [(&'static str, &Path); 1] {
        [("--dout", self.d_o.as_path())]
    }

    /// The output flags and paths.
    pub fn outputs(&self) -> [(&'static str, &Path); 3] {
        [
            ("--dq", self.dq.as_path()),
            ("--dk", self.dk.as_path()),
            ("--dv", self.dv.as_path()),
        ]
    }
}

/// Runs the backward on the forward's `out` and `lse` and returns the encoded gradient files
/// (written by the caller with the forward's, all at once) and the seconds of the call.
#[allow(clippy::too_many_arguments)]
pub fn backward_files(
    files: &BackwardFiles,
    backend: &Backend,
    problem: &Problem,
    (q, k, v): (&HostTensor, &HostTensor, &HostTensor),
    out: &HostTensor,
    lse: &[f32],
    options: &Options,
    default_format: FileFormat,
) -> Result<(EncodedFiles, f64), CliError> {
    let (d_o, _) = read_tensor(&files.d_o, "dout")?;
    if d_o.shape != out.shape || d_o.dtype() != out.dtype() {
        return Err(CliError::Shape(format!(
            "--dout must have the output's shape {:?} and dtype {} (got {:?} {})",
            out.shape,
            out.dtype(),
            d_o.shape,
            d_o.dtype()
        )));
    }
    let grad_dtype = files.grad_dtype.unwrap_or(q.dtype());
    if grad_dtype != q.dtype() && grad_dtype != DType::F32 {
        return Err(CliError::Usage(format!(
            "--grad-dtype must be the input dtype ({}) or f32, not {grad_dtype}",
            q.dtype()
        )));
    }
    let mut dq = HostTensor::zeros(grad_dtype, q.shape.clone())?;
    let mut dk = HostTensor::zeros(grad_dtype, k.shape.clone())?;
    let mut dv = HostTensor::zeros(grad_dtype, v.shape.clone())?;
    let start = std::time::Instant::now();
    backend.backward(
        problem,
        Qkv::new(q.view(), k.view(), v.view()),
        BackwardInputs {
            o: out.view(),
            d_o: d_o.view(),
            lse,
        },
        Grads::new(dq.data.view_mut(), dk.data.view_mut(), dv.data.view_mut()),
        options,
    )?;
    let seconds = start.elapsed().as_secs_f64();
    let mut encoded = Vec::with_capacity(3);
    for (path, name, t) in [
        (&files.dq, "dq", &dq),
        (&files.dk, "dk", &dk),
        (&files.dv, "dv", &dv),
    ] {
        let format = FileFormat::from_extension(path).unwrap_or(default_format);
        encoded.push((path.clone(), encode_tensors(path, format, &[(name, t)])?));
    }
    Ok((encoded, seconds))
}
