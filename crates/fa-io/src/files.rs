//! Reading and writing tensor files: `.npy` and `.safetensors`, told apart by their content.
//!
//! Inputs are read whole after their size is checked against what their header promises (so
//! that `/dev/zero`, a FIFO or a file with a lying header is an error, not an unbounded read).
//! A `.safetensors` input holds the tensor under the name asked for, or is a file with a single
//! tensor. Writing the bytes to disk (atomically, never over an input) is the caller's: fa-cli
//! does it.

use crate::error::Error;
use crate::npy;
use crate::tensor::{DType, Data, HostTensor};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

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

fn bad_file(path: &Path, reason: impl ToString) -> Error {
    Error::BadFile {
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

/// Reads a whole input file after checking, from its header alone, that it is a regular file
/// whose size is the one its header promises (so that `/dev/zero`, a FIFO or a file with a
/// lying header is an error, not an unbounded read), and that it fits in memory.
fn read_checked(path: &Path) -> Result<Vec<u8>, Error> {
    let io = |source| Error::Io {
        path: path.to_path_buf(),
        source,
    };
    let meta = std::fs::metadata(path).map_err(io)?;
    if !meta.is_file() {
        return Err(bad_file(
            path,
            "not a regular file (a device, FIFO or directory): fa reads .npy and .safetensors files",
        ));
    }
    let size = meta.len();
    let mut file = File::open(path).map_err(io)?;
    let mut prefix = Vec::new();
    (&mut file)
        .take(npy::PREFIX_MAX as u64)
        .read_to_end(&mut prefix)
        .map_err(io)?;
    let promised: u64 = if prefix.starts_with(b"\x93NUMPY") {
        let header_len = npy::header_len(&prefix).map_err(|e| bad_file(path, e))?;
        if header_len as u64 > size {
            return Err(bad_file(path, npy::NpyError::Truncated { what: "header" }));
        }
        let mut header = prefix;
        (&mut file)
            .take(header_len as u64 - header.len() as u64)
            .read_to_end(&mut header)
            .map_err(io)?;
        let h = npy::read_header(&header).map_err(|e| bad_file(path, e))?;
        if size != h.data_start as u64 + h.data_len as u64 {
            return Err(bad_file(
                path,
                npy::NpyError::DataLength {
                    expected: h.data_len,
                    found: (size - h.data_start as u64) as usize,
                },
            ));
        }
        size
    } else {
        safetensors_len(path, &mut file, &prefix, size)?
    };
    if promised != size {
        return Err(bad_file(
            path,
            format!("the file holds {size} bytes, its header promises {promised}"),
        ));
    }
    crate::memory::ensure_fits(&format!("reading {}", path.display()), Some(size as u128))?;
    let mut bytes = crate::memory::try_with_capacity(size as usize, "an input file")?;
    file.seek(SeekFrom::Start(0)).map_err(io)?;
    // One byte more than promised: a file that grew since is seen, not read without end.
    file.take(size + 1).read_to_end(&mut bytes).map_err(io)?;
    if bytes.len() as u64 != size {
        return Err(bad_file(path, "the file changed while it was read"));
    }
    Ok(bytes)
}

/// The length a `.safetensors` file's header promises: 8 bytes, the JSON header, and the data up
/// to the largest `data_offsets` end.
fn safetensors_len(path: &Path, file: &mut File, prefix: &[u8], size: u64) -> Result<u64, Error> {
    let not_either = |why: String| {
        bad_file(
            path,
            match FileFormat::from_extension(path) {
                Some(FileFormat::Npy) => {
                    "not a .npy file (missing the \\x93NUMPY magic)".to_string()
                }
                _ => format!("neither a .npy file nor a valid .safetensors file ({why})"),
            },
        )
    };
    let Some(len) = prefix.get(..8) else {
        return Err(not_either("shorter than the 8-byte header length".into()));
    };
    let n = u64::from_le_bytes([
        len[0], len[1], len[2], len[3], len[4], len[5], len[6], len[7],
    ]);
    if n > size.saturating_sub(8) {
        return Err(not_either(format!(
            "its header length {n} exceeds the file's {size} bytes"
        )));
    }
    // The prefix already read may run past a short header (n = 0, say): keep only the header.
    let in_prefix = usize::try_from(n).map_or(prefix.len(), |n| prefix.len().min(8 + n));
    let mut header = prefix[8..in_prefix].to_vec();
    file.take(n - header.len() as u64)
        .read_to_end(&mut header)
        .map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })?;
    let json: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&header).map_err(|e| not_either(format!("header: {e}")))?;
    let mut end = 0u64;
    for (name, entry) in &json {
        if name == "__metadata__" {
            continue;
        }
        let offsets = entry.get("data_offsets").and_then(|o| o.as_array());
        let last = offsets
            .and_then(|o| o.get(1))
            .and_then(|x| x.as_u64())
            .ok_or_else(|| not_either(format!("tensor '{name}' has no valid data_offsets")))?;
        end = end.max(last);
    }
    Ok(8u64.saturating_add(n).saturating_add(end))
}

/// Reads an integer `.npy` file (`--seqused-k`, `--block-table`: int32, or int64 whose values
/// fit): its shape and values.
pub fn read_index_file(path: &Path) -> Result<(Vec<usize>, Vec<i32>), Error> {
    let io = |source| Error::Io {
        path: path.to_path_buf(),
        source,
    };
    let size = std::fs::metadata(path).map_err(io)?.len();
    crate::memory::ensure_fits(&format!("reading {}", path.display()), Some(size as u128))?;
    let bytes = std::fs::read(path).map_err(io)?;
    npy::read_npy_i32(&bytes).map_err(|e| bad_file(path, e))
}

/// Reads the tensor `name` from `path` (`.npy`, or `.safetensors` by content), and the format.
pub fn read_tensor(path: &Path, name: &str) -> Result<(HostTensor, FileFormat), Error> {
    let bytes = read_checked(path)?;
    if bytes.starts_with(b"\x93NUMPY") {
        let t = npy::read_npy(&bytes).map_err(|e| bad_file(path, e))?;
        return Ok((t, FileFormat::Npy));
    }
    // Not .npy: safetensors (8-byte little-endian header length, then a JSON header).
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

/// Encodes named tensors as the bytes of a `format` file (`.npy` holds exactly one tensor).
pub fn encode_tensors(
    path: &Path,
    format: FileFormat,
    tensors: &[(&str, &HostTensor)],
) -> Result<Vec<u8>, Error> {
    let total: usize = tensors.iter().map(|(_, t)| t.byte_len()).sum();
    crate::memory::ensure_fits("encoding the output", Some(2 * total as u128))?;
    Ok(match format {
        FileFormat::Npy => match tensors {
            [(_, t)] => npy::write_npy(t),
            _ => return Err(bad_file(path, "a .npy file holds exactly one tensor")),
        },
        FileFormat::Safetensors => {
            let mut raw = Vec::with_capacity(tensors.len());
            for (name, t) in tensors {
                let mut buf = crate::memory::try_with_capacity(t.byte_len(), "an output")?;
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
    })
}
