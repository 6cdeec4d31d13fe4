//! NumPy `.npy` files (format versions 1.0, 2.0 and 3.0): a small, strict reader and a writer.
//!
//! Accepted element types: `<f4` (float32), `<f2` (float16), and bfloat16 as written by
//! `ml_dtypes` (NumPy has no bfloat16 of its own; `np.save` of an `ml_dtypes.bfloat16` array
//! stores the descr `<V2`, and some tools write `bfloat16`). Big-endian `>f4`/`>f2` are
//! byte-swapped. Arrays must be C-ordered. bfloat16 outputs are written with the descr `<V2`:
//! `np.load(path).view(ml_dtypes.bfloat16)` reads them back.

use crate::tensor::{DType, Data, HostTensor};
use core::fmt;

const MAGIC: &[u8] = b"\x93NUMPY";

/// Why a `.npy` file was rejected.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NpyError {
    /// The file does not start with the `.npy` magic string.
    NotNpy,
    /// The file ends before its header or data do.
    Truncated {
        /// What was being read.
        what: &'static str,
    },
    /// A format version this reader does not know.
    UnsupportedVersion {
        /// Major version.
        major: u8,
        /// Minor version.
        minor: u8,
    },
    /// The header dictionary could not be parsed.
    BadHeader(String),
    /// An element type other than float32, float16 and bfloat16.
    UnsupportedDtype(String),
    /// An index file (`--seqused-k`, `--block-table`) of an element type other than int32 and
    /// int64.
    UnsupportedIndexDtype(String),
    /// Fortran-ordered (column-major) array.
    FortranOrder,
    /// The data section has a different length than the shape and dtype need.
    DataLength {
        /// Bytes the shape and dtype need.
        expected: usize,
        /// Bytes present.
        found: usize,
    },
}

impl fmt::Display for NpyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NpyError::NotNpy => f.write_str("not a .npy file (missing the \\x93NUMPY magic)"),
            NpyError::Truncated { what } => write!(f, "file is truncated (while reading {what})"),
            NpyError::UnsupportedVersion { major, minor } => {
                write!(f, "unsupported .npy format version {major}.{minor}")
            }
            NpyError::BadHeader(why) => write!(f, "malformed .npy header: {why}"),
            NpyError::UnsupportedDtype(d) => write!(
                f,
                "unsupported dtype '{d}': fa reads float32 ('<f4'), float16 ('<f2') and \
                 bfloat16 (ml_dtypes, '<V2'); convert with .astype(np.float32) first"
            ),
            NpyError::UnsupportedIndexDtype(d) => write!(
                f,
                "unsupported dtype '{d}' for an index file: it holds int32 ('<i4') or int64 \
                 ('<i8'); convert with .astype(np.int32) first"
            ),
            NpyError::FortranOrder => {
                f.write_str("Fortran-ordered array: save a C-ordered copy (np.ascontiguousarray)")
            }
            NpyError::DataLength { expected, found } => write!(
                f,
                "data section holds {found} bytes, the header's shape and dtype need {expected}"
            ),
        }
    }
}

impl std::error::Error for NpyError {}

/// A parsed header value.
#[derive(Clone, Debug, PartialEq)]
enum Value {
    Str(String),
    Bool(bool),
    Tuple(Vec<usize>),
}

/// A minimal parser of the Python dict literal that `.npy` headers hold.
struct HeaderParser<'a> {
    s: &'a [u8],
    pos: usize,
}

impl<'a> HeaderParser<'a> {
    fn err<T>(&self, what: &str) -> Result<T, NpyError> {
        Err(NpyError::BadHeader(format!("{what} at byte {}", self.pos)))
    }
    fn skip_ws(&mut self) {
        while self.pos < self.s.len() && self.s[self.pos].is_ascii_whitespace() {
            self.pos += 1;
        }
    }
    fn peek(&mut self) -> Option<u8> {
        self.skip_ws();
        self.s.get(self.pos).copied()
    }
    fn expect(&mut self, c: u8) -> Result<(), NpyError> {
        if self.peek() == Some(c) {
            self.pos += 1;
            Ok(())
        } else {
            self.err(&format!("expected '{}'", c as char))
        }
    }
    fn string(&mut self) -> Result<String, NpyError> {
        let quote = match self.peek() {
            Some(q @ (b'\'' | b'"')) => q,
            _ => return self.err("expected a quoted string"),
        };
        self.pos += 1;
        let start = self.pos;
        while self.pos < self.s.len() && self.s[self.pos] != quote {
            if self.s[self.pos] == b'\\' {
                return self.err("escape sequences are not supported in header strings");
            }
            self.pos += 1;
        }
        if self.pos >= self.s.len() {
            return self.err("unterminated string");
        }
        let text = core::str::from_utf8(&self.s[start..self.pos])
            .map_err(|_| NpyError::BadHeader("header string is not UTF-8".into()))?;
        self.pos += 1;
        Ok(text.to_string())
    }
    fn integer(&mut self) -> Result<usize, NpyError> {
        self.skip_ws();
        let start = self.pos;
        while self.pos < self.s.len() && self.s[self.pos].is_ascii_digit() {
            self.pos += 1;
        }
        if start == self.pos {
            return self.err("expected a non-negative integer");
        }
        let digits = core::str::from_utf8(&self.s[start..self.pos]).unwrap_or("");
        let n = digits
            .parse::<usize>()
            .map_err(|_| NpyError::BadHeader(format!("dimension {digits} is too large")))?;
        // Python 2 longs carry an `L` suffix.
        if self.s.get(self.pos) == Some(&b'L') {
            self.pos += 1;
        }
        Ok(n)
    }
    fn value(&mut self) -> Result<Value, NpyError> {
        match self.peek() {
            Some(b'\'' | b'"') => Ok(Value::Str(self.string()?)),
            Some(b'(') => {
                self.pos += 1;
                let mut dims = Vec::new();
                loop {
                    if self.peek() == Some(b')') {
                        self.pos += 1;
                        break;
                    }
                    dims.push(self.integer()?);
                    match self.peek() {
                        Some(b',') => self.pos += 1,
                        Some(b')') => {}
                        _ => return self.err("expected ',' or ')' in the shape"),
                    }
                }
                Ok(Value::Tuple(dims))
            }
            _ => {
                for (word, b) in [("True", true), ("False", false)] {
                    if self.s[self.pos..].starts_with(word.as_bytes()) {
                        self.pos += word.len();
                        return Ok(Value::Bool(b));
                    }
                }
                self.err("expected a string, a tuple, True or False")
            }
        }
    }
    fn dict(&mut self) -> Result<Vec<(String, Value)>, NpyError> {
        self.expect(b'{')?;
        let mut entries = Vec::new();
        loop {
            if self.peek() == Some(b'}') {
                self.pos += 1;
                break;
            }
            let key = self.string()?;
            self.expect(b':')?;
            let value = self.value()?;
            entries.push((key, value));
            match self.peek() {
                Some(b',') => self.pos += 1,
                Some(b'}') => {}
                _ => return self.err("expected ',' or '}'"),
            }
        }
        if self.peek().is_some() {
            return self.err("unexpected text after the dictionary");
        }
        Ok(entries)
    }
}

/// Byte order of the stored elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Order {
    Little,
    Big,
}

fn parse_descr(descr: &str) -> Result<(DType, Order), NpyError> {
    let unsupported = || NpyError::UnsupportedDtype(descr.to_string());
    if descr == "bfloat16" {
        return Ok((DType::Bf16, Order::Little));
    }
    let (order, code) = match descr.as_bytes().first() {
        Some(b'<') => (Order::Little, &descr[1..]),
        Some(b'>') => (Order::Big, &descr[1..]),
        Some(b'=') if cfg!(target_endian = "little") => (Order::Little, &descr[1..]),
        Some(b'=') => (Order::Big, &descr[1..]),
        Some(b'|') => (Order::Little, &descr[1..]),
        _ => (Order::Little, descr),
    };
    match code {
        "f4" => Ok((DType::F32, order)),
        "f2" | "e" => Ok((DType::F16, order)),
        // ml_dtypes' bfloat16 is a legacy user dtype: np.save writes its descr as `<V2`.
        "V2" => Ok((DType::Bf16, order)),
        _ => Err(unsupported()),
    }
}

/// What a `.npy` header promises: where the data starts, its length, dtype and shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NpyHeader {
    /// Offset of the first data byte (the header's whole length).
    pub data_start: usize,
    /// Bytes of data the shape and dtype need.
    pub data_len: usize,
    /// Element type.
    pub dtype: DType,
    /// Dimensions.
    pub shape: Vec<usize>,
    big_endian: bool,
}

impl NpyHeader {
    /// The length of the whole file the header describes, `None` on overflow.
    pub fn file_len(&self) -> Option<usize> {
        self.data_start.checked_add(self.data_len)
    }
}

/// The bytes before the header dictionary (magic, version, length): 10 or 12 of them.
pub const PREFIX_MAX: usize = 12;

/// The total header length (`data_start`) from the first [`PREFIX_MAX`] bytes (or fewer).
pub fn header_len(prefix: &[u8]) -> Result<usize, NpyError> {
    if !prefix.starts_with(MAGIC) {
        return Err(NpyError::NotNpy);
    }
    let version = prefix
        .get(6..8)
        .ok_or(NpyError::Truncated { what: "version" })?;
    let (major, minor) = (version[0], version[1]);
    let (header_len, header_start): (usize, usize) = match major {
        1 => {
            let b = prefix.get(8..10).ok_or(NpyError::Truncated {
                what: "header length",
            })?;
            (u16::from_le_bytes([b[0], b[1]]) as usize, 10)
        }
        2 | 3 => {
            let b = prefix.get(8..12).ok_or(NpyError::Truncated {
                what: "header length",
            })?;
            (u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize, 12)
        }
        _ => return Err(NpyError::UnsupportedVersion { major, minor }),
    };
    header_start
        .checked_add(header_len)
        .ok_or(NpyError::Truncated { what: "header" })
}

/// The raw fields of the header at the start of `bytes`: where the data starts, the descr
/// string and the shape (C order checked).
fn header_fields(bytes: &[u8]) -> Result<(usize, String, Vec<usize>), NpyError> {
    let data_start = header_len(bytes)?;
    let header_start = if bytes.get(6) == Some(&1) { 10 } else { 12 };
    let header = bytes
        .get(header_start..data_start)
        .ok_or(NpyError::Truncated { what: "header" })?;
    // Versions 1 and 2 are latin-1, version 3 UTF-8; every key and value we accept is ASCII.
    let mut parser = HeaderParser { s: header, pos: 0 };
    let entries = parser.dict()?;
    let get = |key: &str| entries.iter().find(|(k, _)| k == key).map(|(_, v)| v);
    let descr = match get("descr") {
        Some(Value::Str(s)) => s.clone(),
        Some(_) => {
            return Err(NpyError::BadHeader(
                "'descr' is not a plain type string (structured arrays are not supported)".into(),
            ))
        }
        None => return Err(NpyError::BadHeader("missing 'descr'".into())),
    };
    match get("fortran_order") {
        Some(Value::Bool(false)) => {}
        Some(Value::Bool(true)) => return Err(NpyError::FortranOrder),
        _ => return Err(NpyError::BadHeader("missing or bad 'fortran_order'".into())),
    }
    let shape = match get("shape") {
        Some(Value::Tuple(dims)) => dims.clone(),
        _ => return Err(NpyError::BadHeader("missing or bad 'shape'".into())),
    };
    Ok((data_start, descr, shape))
}

/// Parses an integer `.npy` file (the `--seqused-k` lengths, a `--block-table`): int32
/// (`<i4`, `>i4`), or int64 (`<i8`, `>i8`, NumPy's default integer) when every value fits
/// in int32. Returns the shape and the values.
pub fn read_npy_i32(bytes: &[u8]) -> Result<(Vec<usize>, Vec<i32>), NpyError> {
    let (data_start, descr, shape) = header_fields(bytes)?;
    let code = descr.trim_start_matches(['<', '|', '=']);
    let (big, code) = match code.strip_prefix('>') {
        Some(rest) => (true, rest),
        None => (false, code),
    };
    let width = match code {
        "i4" => 4,
        "i8" => 8,
        _ => return Err(NpyError::UnsupportedIndexDtype(descr.to_string())),
    };
    let elements = shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| NpyError::BadHeader("shape overflows".into()))?;
    let data = &bytes[data_start.min(bytes.len())..];
    let expected = elements
        .checked_mul(width)
        .ok_or_else(|| NpyError::BadHeader("shape overflows".into()))?;
    if data.len() != expected {
        return Err(NpyError::DataLength {
            expected,
            found: data.len(),
        });
    }
    let values = data
        .chunks_exact(width)
        .map(|c| {
            let v = match (width, big) {
                (4, false) => i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64,
                (4, true) => i32::from_be_bytes([c[0], c[1], c[2], c[3]]) as i64,
                (_, false) => i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]),
                (_, true) => i64::from_be_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]),
            };
            i32::try_from(v)
                .map_err(|_| NpyError::BadHeader(format!("value {v} does not fit in int32")))
        })
        .collect::<Result<Vec<i32>, _>>()?;
    Ok((shape, values))
}

/// Parses the header at the start of `bytes` (which must hold at least the whole header; the
/// data may be absent), so that a file's size can be checked before its data is read.
pub fn read_header(bytes: &[u8]) -> Result<NpyHeader, NpyError> {
    let (data_start, descr, shape) = header_fields(bytes)?;
    let (dtype, order) = parse_descr(&descr)?;
    let elements = shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| NpyError::BadHeader("shape overflows".into()))?;
    let data_len = elements
        .checked_mul(dtype.size())
        .ok_or_else(|| NpyError::BadHeader("shape overflows".into()))?;
    Ok(NpyHeader {
        data_start,
        data_len,
        dtype,
        shape,
        big_endian: order == Order::Big,
    })
}

/// The bytes of an int32 `.npy` file (`<i4`) of `shape` holding `values`.
pub fn write_npy_i32(shape: &[usize], values: &[i32]) -> Vec<u8> {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape = match dims.len() {
        1 => format!("({},)", dims[0]),
        _ => format!("({})", dims.join(", ")),
    };
    let mut header = format!("{{'descr': '<i4', 'fortran_order': False, 'shape': {shape}, }}");
    // Magic (6) + version (2) + length (2) + header + newline, padded to 64 bytes.
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut out = Vec::with_capacity(10 + header.len() + 4 * values.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&[1, 0]);
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    for v in values {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

/// Parses a whole `.npy` file.
pub fn read_npy(bytes: &[u8]) -> Result<HostTensor, NpyError> {
    let h = read_header(bytes)?;
    let data = &bytes[h.data_start..];
    if data.len() != h.data_len {
        return Err(NpyError::DataLength {
            expected: h.data_len,
            found: data.len(),
        });
    }
    HostTensor::from_bytes(h.dtype, h.shape, data, h.big_endian)
        .map_err(|e| NpyError::BadHeader(e.to_string()))
}

/// The descr string this writer uses for a dtype.
fn descr(data: &Data) -> &'static str {
    match data {
        Data::F32(_) => "<f4",
        Data::F16(_) => "<f2",
        Data::Bf16(_) => "<V2",
    }
}

/// Serialises a tensor as a version 1.0 `.npy` file (2.0 if the header needs it), C order.
pub fn write_npy(tensor: &HostTensor) -> Vec<u8> {
    let dims: Vec<String> = tensor.shape.iter().map(|d| d.to_string()).collect();
    let shape = match dims.len() {
        1 => format!("({},)", dims[0]),
        _ => format!("({})", dims.join(", ")),
    };
    let mut header = format!(
        "{{'descr': '{}', 'fortran_order': False, 'shape': {shape}, }}",
        descr(&tensor.data)
    );
    // Pad with spaces so that the data starts on a 64-byte boundary; end with a newline.
    let v1 = header.len() + 1 + 10 <= u16::MAX as usize;
    let prefix = if v1 { 10 } else { 12 };
    let total = (prefix + header.len() + 1).div_ceil(64) * 64;
    while prefix + header.len() + 1 < total {
        header.push(' ');
    }
    header.push('\n');
    let mut out = Vec::with_capacity(total + tensor.byte_len());
    out.extend_from_slice(MAGIC);
    if v1 {
        out.extend_from_slice(&[1, 0]);
        out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    } else {
        out.extend_from_slice(&[2, 0]);
        out.extend_from_slice(&(header.len() as u32).to_le_bytes());
    }
    out.extend_from_slice(header.as_bytes());
    tensor.append_le_bytes(&mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header_file(version: u8, header: &str, data: &[u8]) -> Vec<u8> {
        let mut out = MAGIC.to_vec();
        out.extend_from_slice(&[version, 0]);
        if version == 1 {
            out.extend_from_slice(&(header.len() as u16).to_le_bytes());
        } else {
            out.extend_from_slice(&(header.len() as u32).to_le_bytes());
        }
        out.extend_from_slice(header.as_bytes());
        out.extend_from_slice(data);
        out
    }

    #[test]
    fn round_trip_every_dtype() {
        let values = [1.5f32, -2.25, 0.1, 3.0e4, -7.0, 0.0];
        for dtype in [DType::F32, DType::F16, DType::Bf16] {
            let t = HostTensor::from_f32(dtype, vec![1, 3, 2], &values).expect("host dtype");
            let bytes = write_npy(&t);
            assert_eq!(
                (bytes.len() - t.byte_len()) % 64,
                0,
                "data is 64-byte aligned"
            );
            let back = read_npy(&bytes).unwrap();
            assert_eq!(back, t);
        }
    }

    #[test]
    fn reads_versions_2_and_3_and_big_endian() {
        let data: Vec<u8> = [1.0f32, -2.0]
            .iter()
            .flat_map(|x| x.to_be_bytes())
            .collect();
        for v in [2u8, 3] {
            let f = header_file(
                v,
                "{\"descr\": \">f4\", \"fortran_order\": False, \"shape\": (2L,)}\n",
                &data,
            );
            let t = read_npy(&f).unwrap();
            assert_eq!(t.shape, vec![2]);
            assert_eq!(t.data, Data::F32(vec![1.0, -2.0]));
        }
    }

    #[test]
    fn int32_index_files_round_trip_and_int64_narrows() {
        let bytes = write_npy_i32(&[2, 3], &[0, -1, 7, 2_000_000_000, 5, 6]);
        assert_eq!(
            read_npy_i32(&bytes).unwrap(),
            (vec![2, 3], vec![0, -1, 7, 2_000_000_000, 5, 6])
        );
        let one = write_npy_i32(&[3], &[4, 5, 6]);
        assert_eq!(read_npy_i32(&one).unwrap(), (vec![3], vec![4, 5, 6]));
        // An int64 file narrows when its values fit, and is refused when one does not.
        let mut wide = one.clone();
        let at = wide.windows(3).position(|w| w == b"<i4").unwrap();
        wide[at + 2] = b'8';
        wide.truncate(wide.len() - 12);
        for v in [4i64, 5, 1 << 40] {
            wide.extend_from_slice(&v.to_le_bytes());
        }
        assert!(matches!(read_npy_i32(&wide), Err(NpyError::BadHeader(_))));
        // A float file is not an index file.
        let f = write_npy(&HostTensor {
            shape: vec![1],
            data: Data::F32(vec![1.0]),
        });
        let e = read_npy_i32(&f).unwrap_err();
        assert!(matches!(e, NpyError::UnsupportedIndexDtype(_)), "{e:?}");
        // The advice is to convert to int32, never to float32 (the float tensors' advice).
        let msg = e.to_string();
        assert!(
            msg.contains("<f4") && msg.contains(".astype(np.int32)"),
            "{msg}"
        );
        assert!(!msg.contains("np.float32"), "{msg}");
    }

    #[test]
    fn bfloat16_descr_variants() {
        let data = [0x80u8, 0x3f]; // bf16 1.0, little endian
        for d in ["<V2", "|V2", "bfloat16"] {
            let h = format!("{{'descr': '{d}', 'fortran_order': False, 'shape': (1,), }}");
            let t = read_npy(&header_file(1, &h, &data)).unwrap();
            assert_eq!(t.to_f32(), vec![1.0]);
            assert_eq!(t.dtype(), DType::Bf16);
        }
    }

    #[test]
    fn rejects_bad_files() {
        assert_eq!(read_npy(b"hello"), Err(NpyError::NotNpy));
        assert!(matches!(read_npy(MAGIC), Err(NpyError::Truncated { .. })));
        let h = "{'descr': '<f8', 'fortran_order': False, 'shape': (1,), }";
        assert!(matches!(
            read_npy(&header_file(1, h, &[0; 8])),
            Err(NpyError::UnsupportedDtype(_))
        ));
        let h = "{'descr': '<f4', 'fortran_order': True, 'shape': (1,), }";
        assert_eq!(
            read_npy(&header_file(1, h, &[0; 4])),
            Err(NpyError::FortranOrder)
        );
        let h = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 2), }";
        assert_eq!(
            read_npy(&header_file(1, h, &[0; 12])),
            Err(NpyError::DataLength {
                expected: 16,
                found: 12
            })
        );
        let h = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, x), }";
        assert!(matches!(
            read_npy(&header_file(1, h, &[0; 8])),
            Err(NpyError::BadHeader(_))
        ));
        let mut f = header_file(1, "{}", &[]);
        f[6] = 9;
        assert!(matches!(
            read_npy(&f),
            Err(NpyError::UnsupportedVersion { major: 9, .. })
        ));
    }
}
