//! Reading and writing tensor files: `.npy` and `.safetensors`, told apart by their content.
//!
//! A `.safetensors` input holds the tensor under its role's name (`q`, `k`, `v`), or is a file
//! with a single tensor; outputs are written under the names `out` and `lse`. The formats
//! themselves (size-checked reading, encoding) are fa-io's ([`fa_io::files`]); this module
//! gives them the command's error type and writes outputs atomically (a device or FIFO such as
//! `/dev/null` is written through, never replaced), never over an input.

use crate::error::CliError;
use crate::tensor::HostTensor;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

pub use fa_io::files::FileFormat;

fn bad_file(path: &Path, reason: impl ToString) -> CliError {
    CliError::BadFile {
        path: path.to_path_buf(),
        reason: reason.to_string(),
    }
}

/// Reads an integer `.npy` file (`--seqused-k`, `--block-table`: int32, or int64 whose values
/// fit): its shape and values.
pub fn read_index_file(path: &Path) -> Result<(Vec<usize>, Vec<i32>), CliError> {
    Ok(fa_io::files::read_index_file(path)?)
}

/// Reads the tensor `name` from `path` (`.npy`, or `.safetensors` by content), and the format.
pub fn read_tensor(path: &Path, name: &str) -> Result<(HostTensor, FileFormat), CliError> {
    Ok(fa_io::files::read_tensor(path, name)?)
}

/// Encodes named tensors as the bytes of a `format` file (`.npy` holds exactly one tensor).
pub fn encode_tensors(
    path: &Path,
    format: FileFormat,
    tensors: &[(&str, &HostTensor)],
) -> Result<Vec<u8>, CliError> {
    Ok(fa_io::files::encode_tensors(path, format, tensors)?)
}

/// Writes named tensors to `path` in `format` (`.npy` holds exactly one tensor), atomically
/// (see [`write_files`]).
pub fn write_tensors(
    path: &Path,
    format: FileFormat,
    tensors: &[(&str, &HostTensor)],
) -> Result<(), CliError> {
    let bytes = encode_tensors(path, format, tensors)?;
    write_files(&[(path.to_path_buf(), bytes)])
}

/// The identity of an existing file: device and inode on Unix (so that hard links, symlinks
/// and `..` resolve to one file), its canonical path elsewhere.
#[cfg(unix)]
fn existing_identity(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

/// The identity of an existing file: its canonical path (no inodes here).
#[cfg(not(unix))]
fn existing_identity(path: &Path) -> Option<PathBuf> {
    std::fs::canonicalize(path).ok()
}

/// Where a path's file lives: its canonical parent directory and its name (for paths whose file
/// does not exist yet), or the path itself when the parent cannot be resolved.
fn canonical_location(path: &Path) -> PathBuf {
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    match (std::fs::canonicalize(parent), path.file_name()) {
        (Ok(dir), Some(name)) => dir.join(name),
        _ => path.to_path_buf(),
    }
}

/// Whether `a` and `b` name the same file (existing: same device and inode; otherwise the same
/// canonical location).
pub fn same_file(a: &Path, b: &Path) -> bool {
    match (existing_identity(a), existing_identity(b)) {
        (Some(x), Some(y)) => x == y,
        (None, None) => canonical_location(a) == canonical_location(b),
        _ => false,
    }
}

/// Refuses an output path that is, or resolves to, one of the inputs: checked before anything
/// is read or written, so that a run never overwrites what it reads.
pub fn check_outputs_are_not_inputs(
    inputs: &[(&str, &Path)],
    outputs: &[(&str, &Path)],
) -> Result<(), CliError> {
    for (out_flag, out) in outputs {
        for (in_flag, input) in inputs {
            if same_file(out, input) {
                return Err(CliError::Usage(format!(
                    "{out_flag} {} is the same file as the input {in_flag} {}: refusing to \
                     overwrite an input; choose another output path",
                    out.display(),
                    input.display()
                )));
            }
        }
    }
    Ok(())
}

/// Refuses two outputs that are the same file (the gradients of `fa run` would overwrite one
/// another, or the output). A device or FIFO (`/dev/null`) may take several outputs: each is
/// written through in turn, nothing is replaced.
pub fn check_distinct_outputs(outputs: &[(&str, &Path)]) -> Result<(), CliError> {
    for (i, (a_flag, a)) in outputs.iter().enumerate() {
        for (b_flag, b) in &outputs[i + 1..] {
            if (a == b || same_file(a, b)) && !is_special_file(a) {
                return Err(CliError::Usage(format!(
                    "{a_flag} and {b_flag} name the same file {}: give each output its own path",
                    a.display()
                )));
            }
        }
    }
    Ok(())
}

/// Whether `path` names an existing file that is neither a regular file nor a directory (a
/// character or block device such as `/dev/null`, a FIFO, a socket), following symlinks.
/// Outputs there are written through, never replaced (see [`write_files`]).
pub fn is_special_file(path: &Path) -> bool {
    std::fs::metadata(path).is_ok_and(|m| !m.is_file() && !m.is_dir())
}

/// How one destination of [`write_files`] is written.
enum Dest {
    /// A regular file (existing or new): written beside it and renamed over it.
    Atomic {
        /// The destination, symlinks resolved.
        dest: PathBuf,
        /// Its directory.
        dir: PathBuf,
    },
    /// A device, FIFO or socket: opened and written through (renaming over it would replace
    /// the node with a regular file, e.g. `/dev/null` for the whole system).
    Direct,
}

/// Writes every `(path, bytes)`, all or nothing as far as the file system allows. A
/// destination that exists and is not a regular file (a device such as `/dev/null`, a FIFO)
/// is opened and written through. Every other one is written atomically: its directory must
/// exist; it is written to a temporary file beside it and synced, and only when every file is
/// written (the written-through ones included) are the temporary files renamed over their
/// destinations. On a failure before the renames, the temporary files are removed and no
/// regular file changes. A destination that is a symlink to an existing file is replaced at
/// its target.
pub fn write_files(files: &[(PathBuf, Vec<u8>)]) -> Result<(), CliError> {
    let mut dests = Vec::with_capacity(files.len());
    for (path, _) in files {
        // `missing_dir/` would be written as `./missing_dir` and fail at the rename with
        // "Not a directory": say what is wrong before anything is written.
        if path
            .as_os_str()
            .to_string_lossy()
            .ends_with(std::path::is_separator)
        {
            let why = if path.is_dir() {
                "is a directory".to_string()
            } else {
                format!(
                    "ends with '{}', so it names a directory (which does not exist), not a file",
                    std::path::MAIN_SEPARATOR
                )
            };
            return Err(bad_file(path, why));
        }
        let dest = match std::fs::metadata(path) {
            Ok(m) if m.is_dir() => return Err(bad_file(path, "is a directory")),
            Ok(m) if !m.is_file() => Dest::Direct,
            Ok(_) => {
                let dest = std::fs::canonicalize(path).unwrap_or_else(|_| path.clone());
                let dir = parent_dir(&dest);
                Dest::Atomic { dest, dir }
            }
            Err(_) => {
                let dir = parent_dir(path);
                if !dir.is_dir() {
                    let why = if dir.exists() {
                        format!("{} is not a directory", dir.display())
                    } else {
                        format!("the directory {} does not exist", dir.display())
                    };
                    return Err(bad_file(path, why));
                }
                Dest::Atomic {
                    dest: path.clone(),
                    dir,
                }
            }
        };
        dests.push(dest);
    }
    let mut temps: Vec<(PathBuf, &PathBuf)> = Vec::with_capacity(files.len());
    let cleanup = |temps: &[(PathBuf, &PathBuf)]| {
        for (t, _) in temps {
            let _ = std::fs::remove_file(t);
        }
    };
    for (i, ((path, bytes), dest)) in files.iter().zip(&dests).enumerate() {
        let Dest::Atomic { dest, dir } = dest else {
            continue;
        };
        let name = dest
            .file_name()
            .map_or_else(|| "output".into(), |n| n.to_string_lossy().into_owned());
        let temp = dir.join(format!(".{name}.fa-tmp-{}-{i}", std::process::id()));
        let written = (|| {
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&temp)?;
            temps.push((temp.clone(), dest));
            f.write_all(bytes)?;
            f.sync_all()
        })();
        if let Err(source) = written {
            cleanup(&temps);
            return Err(CliError::Io {
                path: path.clone(),
                source,
            });
        }
    }
    // Written through before any rename: a device or FIFO that fails leaves every regular
    // destination unchanged.
    for ((path, bytes), dest) in files.iter().zip(&dests) {
        if let Dest::Direct = dest {
            let written = std::fs::OpenOptions::new()
                .write(true)
                .open(path)
                .and_then(|mut f| f.write_all(bytes));
            if let Err(source) = written {
                cleanup(&temps);
                return Err(CliError::Io {
                    path: path.clone(),
                    source,
                });
            }
        }
    }
    for (n, (temp, dest)) in temps.iter().enumerate() {
        if let Err(source) = std::fs::rename(temp, dest) {
            cleanup(&temps[n..]);
            return Err(CliError::Io {
                path: (*dest).clone(),
                source,
            });
        }
    }
    // The renames themselves reach the disk with their directories.
    for dest in &dests {
        if let Dest::Atomic { dir, .. } = dest {
            if let Ok(d) = File::open(dir) {
                let _ = d.sync_all();
            }
        }
    }
    Ok(())
}

/// The directory a file path lives in (`.` for a bare name).
fn parent_dir(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}
