//! TMA tensor maps of the sm90 family's warp-specialized kernel, encoded on the host with
//! `cuTensorMapEncodeTiled` for each launch (they hold the tensors' addresses) and passed by
//! value as `const __grid_constant__` kernel parameters.

use crate::error::CudaError;
use cudarc::driver::sys::{
    self, CUtensorMapDataType, CUtensorMapFloatOOBfill, CUtensorMapInterleave,
    CUtensorMapL2promotion, CUtensorMapSwizzle,
};
use cudarc::driver::DeviceRepr;
use softmax_core::DType;

/// A `CUtensorMap` as the kernel declares it (`struct alignas(64) TensorMap { u64 opaque[16]; }`).
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug)]
pub(crate) struct TensorMap([u64; 16]);

// SAFETY: 128 bytes of plain data, laid out as the kernel's `TensorMap` parameter.
unsafe impl DeviceRepr for TensorMap {}

/// One BSHD tensor as the kernel's TMA sees it: 4-D (column, token, head, batch).
#[derive(Clone, Copy, Debug)]
pub(crate) struct TileSource {
    /// Device address of element (0, 0, 0, 0).
    pub address: u64,
    /// Columns (the head dim); columns past it are zero-filled in the tile.
    pub head_dim: usize,
    /// Tokens per sequence; rows past it are zero-filled.
    pub tokens: usize,
    /// Heads.
    pub heads: usize,
    /// Sequences.
    pub batch: usize,
    /// Element strides (batch, token, head), as the kernel parameters hold them.
    pub strides: [i64; 3],
}

/// Encodes the tensor map of `src` for tiles of 64 columns × `box_rows` rows with the 128-byte
/// swizzle (the layout the kernel's wgmma descriptors read). The inputs were validated before
/// (strides multiples of 8 elements, so 16 bytes; addresses 16-byte aligned); what the driver
/// still refuses comes back as a typed error.
pub(crate) fn tile_map(
    src: &TileSource,
    dtype: DType,
    box_rows: u32,
) -> Result<TensorMap, CudaError> {
    let data_type = match dtype {
        DType::F16 => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        _ => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
    };
    let [batch_stride, token_stride, head_stride] = src.strides;
    // A dimension of size 1 is only ever read at index 0: its stride is irrelevant, but the
    // driver wants a positive multiple of 16 bytes.
    let bytes = |stride: i64, size: usize| -> u64 {
        let b = (stride.max(0) as u64) * 2;
        if size <= 1 || b == 0 {
            16
        } else {
            b
        }
    };
    let dims: [u64; 4] = [
        src.head_dim as u64,
        src.tokens.max(1) as u64,
        src.heads.max(1) as u64,
        src.batch.max(1) as u64,
    ];
    let strides: [u64; 3] = [
        bytes(token_stride, src.tokens),
        bytes(head_stride, src.heads),
        bytes(batch_stride, src.batch),
    ];
    let boxes: [u32; 4] = [64, box_rows, 1, 1];
    let element_strides: [u32; 4] = [1; 4];
    let mut map = sys::CUtensorMap { opaque: [0; 16] };
    // SAFETY: every pointer is to a live local array of the length the rank (4) implies; the
    // call only encodes a descriptor on the host (the address is not dereferenced).
    let result = unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map,
            data_type,
            4,
            src.address as *mut core::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            element_strides.as_ptr(),
            CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if result != sys::CUresult::CUDA_SUCCESS {
        return Err(CudaError::Driver {
            what: "cuTensorMapEncodeTiled",
            error: format!("{result:?}"),
        });
    }
    Ok(TensorMap(map.opaque))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_map_has_the_kernels_parameter_layout() {
        assert_eq!(core::mem::size_of::<TensorMap>(), 128);
        assert_eq!(core::mem::align_of::<TensorMap>(), 64);
    }
}
