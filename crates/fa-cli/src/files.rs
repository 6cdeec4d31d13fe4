//! Reading and writing tensor files: `.npy` and `.safetensors`, told apart by their content.
//!
//! A `.safetensors` input holds the tensor under its role's name (`q`, `k`, `v`), or is a file
//! with a single tensor; outputs are written under the names `out` and `lse`.

use crate::error::CliError;
use crate::npy;
use crate::tensor::{DType, Data, HostTensor};
use std::path::{Path, PathBuf};

/// A tensor file format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileFormat {
    /// NumPy `.npy`.
    Npy,
    /// Hugging Face `.safetensors`.
    Safetensors,
}

impl FileFormat {
    /// The format a path's extension names, if any.
    pub fn from_extension(path: &Path) -> Option<FileFormat> {
        match path.extension()?.to_str()?.to_ascii_lowercase().as_str() {
            "npy" => Some(FileFormat::Npy),
            "safetensors" => Some(FileFormat::Safetensors),
            _ => None,
        }
    }
}

fn bad_file(path: &Path, reason: impl ToString) -> CliError {
    CliError::BadFile {
        path: path.to_path_buf(),
        reason: reason.to_string(),
    }
}

fn st_dtype(data: &Data) -> safetensors::Dtype {
    match data {
        Data::F32(_) => safetensors::Dtype::F32,
        Data::Bf16(_) => safetensors::Dtype::BF16,
        Data::F16(_) => safetensors::Dtype::F16,
    }
}

/// Reads the tensor `name` from `path` (`.npy`, or `.safetensors` by content), and the format.
pub fn read_tensor(path: &Path, name: &str) -> Result<(HostTensor, FileFormat), CliError> {
    let bytes = std::fs::read(path).map_err(|source| CliError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    if bytes.starts_with(b"\x93NUMPY") {
        let t = npy::read_npy(&bytes).map_err(|e| bad_file(path, e))?;
        return Ok((t, FileFormat::Npy));
    }
    // Not .npy: try safetensors (8-byte little-endian header length, then a JSON header).
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| {
        let hint = match FileFormat::from_extension(path) {
            Some(FileFormat::Npy) => "not a .npy file (missing the \\x93NUMPY magic)".to_string(),
            _ => format!("neither a .npy file nor a valid .safetensors file ({e})"),
        };
        bad_file(path, hint)
    })?;
    let names = st.names();
    let view = match st.tensor(name) {
        Ok(v) => v,
        Err(_) if names.len() == 1 => st.tensor(names[0]).map_err(|e| bad_file(path, e))?,
        Err(_) => {
            let mut names: Vec<&str> = names.into_iter().collect();
            names.sort_unstable();
            return Err(bad_file(
                path,
                format!(
                    "no tensor named '{name}' (the file holds: {})",
                    names.join(", ")
                ),
            ));
        }
    };
    let dtype = match view.dtype() {
        safetensors::Dtype::F32 => DType::F32,
        safetensors::Dtype::BF16 => DType::Bf16,
        safetensors::Dtype::F16 => DType::F16,
        other => {
            return Err(bad_file(
                path,
                format!("unsupported dtype {other:?}: fa reads F32, BF16 and F16"),
            ))
        }
    };
    let t = HostTensor::from_bytes(dtype, view.shape().to_vec(), view.data(), false)?;
    Ok((t, FileFormat::Safetensors))
}

/// Writes named tensors to `path` in `format` (`.npy` holds exactly one tensor).
pub fn write_tensors(
    path: &Path,
    format: FileFormat,
    tensors: &[(&str, &HostTensor)],
) -> Result<(), CliError> {
    let bytes = match format {
        FileFormat::Npy => match tensors {
            [(_, t)] => npy::write_npy(t),
            _ => return Err(bad_file(path, "a .npy file holds exactly one tensor")),
        },
        FileFormat::Safetensors => {
            let mut raw = Vec::with_capacity(tensors.len());
            for (name, t) in tensors {
                let mut buf = Vec::new();
                t.append_le_bytes(&mut buf);
                raw.push((*name, t, buf));
            }
            let mut views = Vec::with_capacity(raw.len());
            for (name, t, buf) in &raw {
                let view =
                    safetensors::tensor::TensorView::new(st_dtype(&t.data), t.shape.clone(), buf)
                        .map_err(|e| bad_file(path, e))?;
                views.push((*name, view));
            }
            safetensors::serialize(views, None).map_err(|e| bad_file(path, e))?
        }
    };
    std::fs::write(path, bytes).map_err(|source| CliError::Io {
        path: PathBuf::from(path),
        source,
    })
}
