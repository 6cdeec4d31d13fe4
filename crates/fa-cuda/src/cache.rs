//! The disk cache of compiled cubins: one file per (kernel variant, architecture), named after
//! the variant and its key, so that a second process loads what the first compiled instead of
//! running NVRTC again.
//!
//! The key hashes everything the cubin depends on: the family's source text and headers, the
//! defines and compile options, the entry point, the architecture, the NVRTC version and this
//! crate's version. A file holds a header (magic, key, ptxas' resource report, length, checksum
//! of the cubin) and the cubin; an entry whose header does not match (another key, another
//! format, truncated, a flipped byte) is a miss and is rebuilt, never loaded. Entries are
//! written to a temporary file and renamed into place, so a reader never sees half a file. A
//! cache that cannot be written (read-only or missing directory) only misses.
//!
//! Location: `$FA_CUDA_CACHE_DIR`, else `$XDG_CACHE_HOME/flash-attention-rs/cubins`, else
//! `~/.cache/flash-attention-rs/cubins`; `FA_CUDA_CACHE=off` turns the cache off.

use crate::compile::ResourceUsage;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// A 64-bit FNV-1a hash; collisions only matter between entries of the same variant name, so
/// 64 bits are plenty, and it keeps the crate free of a hashing dependency.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Fnv64(u64);

impl Fnv64 {
    pub(crate) fn new() -> Fnv64 {
        Fnv64(0xcbf2_9ce4_8422_2325)
    }
    pub(crate) fn bytes(&mut self, data: &[u8]) -> &mut Fnv64 {
        for &b in data {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
        self
    }
    /// A length-prefixed field, so that ("ab", "c") and ("a", "bc") hash differently.
    pub(crate) fn field(&mut self, data: &[u8]) -> &mut Fnv64 {
        self.bytes(&(data.len() as u64).to_le_bytes()).bytes(data)
    }
    pub(crate) fn finish(&self) -> u64 {
        self.0
    }
}

/// FNV-1a of a byte string (the cubin checksum).
pub(crate) fn fnv64(data: &[u8]) -> u64 {
    Fnv64::new().bytes(data).finish()
}

/// Identifies one compiled cubin: the hash of everything it was built from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CacheKey(pub u64);

const MAGIC: [u8; 8] = *b"FACUBIN\x01";
const HEADER_LEN: usize = 48;

/// Why a cache file was not used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BadEntry {
    /// Shorter than its header says.
    Truncated,
    /// Not a cache file of this format.
    Magic,
    /// Built from other inputs.
    Key,
    /// The cubin's checksum does not match.
    Checksum,
}

/// Serialises one entry: header (magic, key, registers, stack frame, spill stores, spill loads,
/// cubin length, cubin checksum; little-endian) and the cubin.
pub(crate) fn encode(key: CacheKey, usage: &ResourceUsage, cubin: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + cubin.len());
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&key.0.to_le_bytes());
    for x in [
        usage.registers,
        usage.stack_frame,
        usage.spill_stores,
        usage.spill_loads,
    ] {
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.extend_from_slice(&(cubin.len() as u64).to_le_bytes());
    out.extend_from_slice(&fnv64(cubin).to_le_bytes());
    out.extend_from_slice(cubin);
    out
}

/// Reads one entry back, checking everything the header states against `key` and the data.
pub(crate) fn decode(bytes: &[u8], key: CacheKey) -> Result<(Vec<u8>, ResourceUsage), BadEntry> {
    let u64_at = |i: usize| -> Option<u64> {
        Some(u64::from_le_bytes(bytes.get(i..i + 8)?.try_into().ok()?))
    };
    let u32_at = |i: usize| -> Option<u32> {
        Some(u32::from_le_bytes(bytes.get(i..i + 4)?.try_into().ok()?))
    };
    if bytes.len() < HEADER_LEN {
        return Err(if bytes.starts_with(&MAGIC) || MAGIC.starts_with(bytes) {
            BadEntry::Truncated
        } else {
            BadEntry::Magic
        });
    }
    if bytes[..8] != MAGIC {
        return Err(BadEntry::Magic);
    }
    if u64_at(8) != Some(key.0) {
        return Err(BadEntry::Key);
    }
    let field = |i| u32_at(i).ok_or(BadEntry::Truncated);
    let usage = ResourceUsage {
        registers: field(16)?,
        stack_frame: field(20)?,
        spill_stores: field(24)?,
        spill_loads: field(28)?,
    };
    let len = u64_at(32).ok_or(BadEntry::Truncated)?;
    let checksum = u64_at(40).ok_or(BadEntry::Truncated)?;
    let cubin = &bytes[HEADER_LEN..];
    if cubin.len() as u64 != len {
        return Err(BadEntry::Truncated);
    }
    if fnv64(cubin) != checksum {
        return Err(BadEntry::Checksum);
    }
    Ok((cubin.to_vec(), usage))
}

/// A directory of cached cubins.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiskCache {
    dir: PathBuf,
}

impl DiskCache {
    /// A cache in `dir` (created on the first store).
    pub fn at(dir: impl Into<PathBuf>) -> DiskCache {
        DiskCache { dir: dir.into() }
    }

    /// The cache the environment asks for: `None` when `FA_CUDA_CACHE=off` (or `0`, `false`) or
    /// when no location can be found (no `$FA_CUDA_CACHE_DIR`, `$XDG_CACHE_HOME` or `$HOME`).
    pub fn from_env() -> Option<DiskCache> {
        DiskCache::from_vars(|name| std::env::var_os(name))
    }

    /// [`DiskCache::from_env`] over any source of variables (tests pass a closure).
    fn from_vars(var: impl Fn(&str) -> Option<std::ffi::OsString>) -> Option<DiskCache> {
        let var = |name: &str| var(name).filter(|v| !v.is_empty());
        if let Some(v) = var("FA_CUDA_CACHE") {
            if matches!(
                v.to_string_lossy().to_ascii_lowercase().as_str(),
                "off" | "0" | "false" | "no"
            ) {
                return None;
            }
        }
        if let Some(dir) = var("FA_CUDA_CACHE_DIR") {
            return Some(DiskCache::at(dir));
        }
        let base = match var("XDG_CACHE_HOME") {
            Some(x) => PathBuf::from(x),
            None => PathBuf::from(var("HOME")?).join(".cache"),
        };
        Some(DiskCache::at(
            base.join("flash-attention-rs").join("cubins"),
        ))
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file of one entry: the variant's name (for people listing the directory), the
    /// architecture and the key.
    pub fn path_for(&self, name: &str, arch: &str, key: CacheKey) -> PathBuf {
        let safe: String = name
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '_' {
                    c
                } else {
                    '-'
                }
            })
            .collect();
        self.dir.join(format!("{safe}_{arch}_{:016x}.cubin", key.0))
    }

    /// The cubin and resource report stored for `key`, when a valid entry is there.
    pub(crate) fn load(
        &self,
        name: &str,
        arch: &str,
        key: CacheKey,
    ) -> Option<(Vec<u8>, ResourceUsage)> {
        let bytes = std::fs::read(self.path_for(name, arch, key)).ok()?;
        decode(&bytes, key).ok()
    }

    /// Stores an entry (temporary file, then rename); `false` when the cache cannot be written.
    pub(crate) fn store(
        &self,
        name: &str,
        arch: &str,
        key: CacheKey,
        usage: &ResourceUsage,
        cubin: &[u8],
    ) -> bool {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let path = self.path_for(name, arch, key);
        let tmp = path.with_extension(format!(
            "tmp.{}.{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        let written = std::fs::create_dir_all(&self.dir)
            .and_then(|_| std::fs::write(&tmp, encode(key, usage, cubin)))
            .and_then(|_| std::fs::rename(&tmp, &path));
        if written.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        written.is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const USAGE: ResourceUsage = ResourceUsage {
        registers: 255,
        stack_frame: 0,
        spill_stores: 4,
        spill_loads: 8,
    };

    #[test]
    fn entries_round_trip() {
        let cubin: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
        let bytes = encode(CacheKey(42), &USAGE, &cubin);
        assert_eq!(bytes.len(), HEADER_LEN + cubin.len());
        assert_eq!(decode(&bytes, CacheKey(42)), Ok((cubin, USAGE)));
    }

    #[test]
    fn bad_entries_are_detected() {
        let cubin = vec![1u8, 2, 3, 4, 5, 6, 7, 8, 9];
        let bytes = encode(CacheKey(7), &USAGE, &cubin);
        assert_eq!(decode(&bytes, CacheKey(8)), Err(BadEntry::Key));
        for cut in [0, 5, 20, HEADER_LEN, bytes.len() - 1] {
            assert_eq!(
                decode(&bytes[..cut], CacheKey(7)),
                Err(BadEntry::Truncated),
                "cut at {cut}"
            );
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert_eq!(decode(&longer, CacheKey(7)), Err(BadEntry::Truncated));
        for at in HEADER_LEN..bytes.len() {
            let mut flipped = bytes.clone();
            flipped[at] ^= 0x10;
            assert_eq!(decode(&flipped, CacheKey(7)), Err(BadEntry::Checksum));
        }
        let mut other = bytes.clone();
        other[7] = 2; // a later format
        assert_eq!(decode(&other, CacheKey(7)), Err(BadEntry::Magic));
        assert_eq!(
            decode(b"ELF and more bytes than the header, surely", CacheKey(7)).err(),
            Some(BadEntry::Magic)
        );
    }

    #[test]
    fn hash_fields_are_length_prefixed() {
        let a = Fnv64::new().field(b"ab").field(b"c").finish();
        let b = Fnv64::new().field(b"a").field(b"bc").finish();
        assert_ne!(a, b);
        // FNV-1a's published test vector.
        assert_eq!(fnv64(b"a"), 0xaf63_dc4c_8601_ec8c);
    }

    #[test]
    fn store_and_load_in_a_directory() {
        let dir = std::env::temp_dir().join(format!("fa-cuda-cache-unit-{}", std::process::id()));
        let cache = DiskCache::at(&dir);
        let cubin = vec![9u8; 64];
        assert!(cache.store("fwd/x y", "sm_80", CacheKey(1), &USAGE, &cubin));
        assert_eq!(
            cache.load("fwd/x y", "sm_80", CacheKey(1)),
            Some((cubin, USAGE))
        );
        assert_eq!(cache.load("fwd/x y", "sm_80", CacheKey(2)), None);
        assert!(cache
            .path_for("fwd/x y", "sm_80", CacheKey(1))
            .starts_with(&dir));
        // A cache below a regular file cannot be created: a miss, not an error.
        let blocked = DiskCache::at(cache.path_for("fwd/x y", "sm_80", CacheKey(1)).join("sub"));
        assert!(!blocked.store("v", "sm_80", CacheKey(1), &USAGE, &[1]));
        assert_eq!(blocked.load("v", "sm_80", CacheKey(1)), None);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn location_follows_the_environment() {
        let from = |vars: &[(&str, &str)]| {
            DiskCache::from_vars(|name| {
                vars.iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| std::ffi::OsString::from(v))
            })
            .map(|c| c.dir().to_path_buf())
        };
        let home = [("HOME", "/home/u")];
        assert_eq!(
            from(&home),
            Some(PathBuf::from("/home/u/.cache/flash-attention-rs/cubins"))
        );
        let xdg = [("HOME", "/home/u"), ("XDG_CACHE_HOME", "/x")];
        assert_eq!(
            from(&xdg),
            Some(PathBuf::from("/x/flash-attention-rs/cubins"))
        );
        let own = [("XDG_CACHE_HOME", "/x"), ("FA_CUDA_CACHE_DIR", "/c")];
        assert_eq!(from(&own), Some(PathBuf::from("/c")));
        for off in ["off", "OFF", "0", "false"] {
            assert_eq!(
                from(&[("FA_CUDA_CACHE_DIR", "/c"), ("FA_CUDA_CACHE", off)]),
                None
            );
        }
        assert!(from(&[("FA_CUDA_CACHE", "on"), ("HOME", "/h")]).is_some());
        assert_eq!(from(&[("HOME", "")]), None);
    }
}
