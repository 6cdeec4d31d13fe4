//! The CUDA entry points: without a GPU every device call is `FA_ERR_NO_DEVICE`; on a GPU
//! (ignored here) `fa_forward_cuda` runs on a caller's stream on cudarc allocations and
//! matches the f64 reference.

mod common;

use common::*;
use core::ffi::c_void;
use core::ptr::{null, null_mut};
use flash_attention_rs::*;

fn gpu_present() -> bool {
    fa_cuda::Device::open(0).is_ok()
}

#[test]
fn without_a_gpu_device_creation_is_no_device() {
    if gpu_present() {
        eprintln!("a GPU is present: the no-device answer cannot be observed here");
        return;
    }
    let mut handle: *mut FaCudaDevice = std::ptr::dangling_mut();
    // SAFETY: `handle` is a writable local.
    let code = unsafe { fa_cuda_device_create(0, &mut handle) };
    assert_eq!(code, FA_ERR_NO_DEVICE, "{}", last_error());
    assert!(handle.is_null(), "a failure leaves a null handle");
    assert!(!last_error().is_empty());
    // SAFETY: as above; null context = the current one, which cannot exist here.
    let code = unsafe { fa_cuda_device_create_from_context(null_mut(), &mut handle) };
    assert_eq!(code, FA_ERR_NO_DEVICE, "{}", last_error());
    // SAFETY: null is accepted and ignored.
    unsafe { fa_cuda_device_destroy(null_mut()) };
}

#[test]
fn bad_handles_and_out_pointers_are_refused() {
    // SAFETY: a null out-pointer is refused before anything is written.
    let code = unsafe { fa_cuda_device_create(0, null_mut()) };
    assert_eq!(code, FA_ERR_INVALID_ARGUMENT);
    let mut handle = null_mut();
    // SAFETY: `handle` is a writable local.
    let code = unsafe { fa_cuda_device_create(-1, &mut handle) };
    assert_eq!(code, FA_ERR_INVALID_ARGUMENT);
    let p = dense(1, 4, 4, 2, 2, 64);
    let t = bshd(16 as *mut c_void, FA_DTYPE_BF16, 4, 2, 64);
    // SAFETY: a null device is refused before anything else is read.
    let code =
        unsafe { fa_forward_cuda(null(), &p, &t, &t, &t, &t, null_mut(), null_mut(), null()) };
    assert_eq!(code, FA_ERR_INVALID_ARGUMENT);
    assert!(last_error().contains("device"), "{}", last_error());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn forward_on_a_caller_stream_matches_the_reference() {
    use cudarc::driver::{CudaContext, DevicePtr};
    use fa_reference::{compare, Case, Rng, Rounding};
    use half::bf16;

    let ctx = CudaContext::new(0).expect("device 0");
    let stream = ctx.new_stream().expect("a caller stream");
    let mut handle = null_mut();
    // SAFETY: the primary context is current on this thread (CudaContext::new binds it).
    let code = unsafe { fa_cuda_device_create_from_context(null_mut(), &mut handle) };
    assert_eq!(code, FA_OK, "{}", last_error());

    let mut rng = Rng::new(21);
    for causal in [false, true] {
        let mut case = Case::dense(&mut rng, 2, 100, 130, 8, 2, 64).round(Rounding::Bf16);
        if causal {
            case = case.causal();
        }
        let problem = case.desc().validate(256).expect("valid");
        let up = |x: &[f32]| {
            let bits: Vec<u16> = x.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
            stream.clone_htod(&bits).expect("upload")
        };
        let (q, k, v) = (up(&case.q), up(&case.k), up(&case.v));
        let o = stream
            .alloc_zeros::<u16>(problem.min_buffer_lens().o)
            .expect("alloc");
        let lse = stream.alloc_zeros::<f32>(problem.lse_len()).expect("alloc");
        let mut p = dense(2, 100, 130, 8, 2, 64);
        p.causal = causal as u32;
        let addr =
            |s: &cudarc::driver::CudaSlice<u16>| s.device_ptr(&stream).0 as usize as *mut c_void;
        let tq = bshd(addr(&q), FA_DTYPE_BF16, 100, 8, 64);
        let tk = bshd(addr(&k), FA_DTYPE_BF16, 130, 2, 64);
        let tv = bshd(addr(&v), FA_DTYPE_BF16, 130, 2, 64);
        let to = bshd(addr(&o), FA_DTYPE_BF16, 100, 8, 64);
        let lse_ptr = lse.device_ptr(&stream).0 as usize as *mut f32;
        // SAFETY: allocations of this context sized for the problem, alive until the
        // stream is synchronised below; `stream` is a stream of the same context.
        let code = unsafe {
            fa_forward_cuda(
                handle,
                &p,
                &tq,
                &tk,
                &tv,
                &to,
                lse_ptr,
                stream.cu_stream() as *mut c_void,
                null(),
            )
        };
        assert_eq!(code, FA_OK, "{}", last_error());
        stream.synchronize().expect("synchronise");
        let o_host: Vec<bf16> = stream
            .clone_dtoh(&o)
            .expect("download")
            .into_iter()
            .map(bf16::from_bits)
            .collect();
        let lse_host = stream.clone_dtoh(&lse).expect("download");
        let oracle = fa_reference::attention_f64(&problem, &case.q, &case.k, &case.v);
        let report = compare(&problem, &o_host, Some(&lse_host), &oracle);
        assert!(report.within(1e-2, 1e-3), "causal={causal}: {report:?}");
    }
    // SAFETY: the handle came from fa_cuda_device_create_from_context; work is finished.
    unsafe { fa_cuda_device_destroy(handle) };
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cache_forward_with_device_tables_matches_the_reference() {
    use cudarc::driver::{CudaContext, CudaSlice, DevicePtr};
    use fa_reference::{compare, CacheLayout, DecodeCase, Rng, Rounding};
    use half::bf16;

    let ctx = CudaContext::new(0).expect("device 0");
    let stream = ctx.new_stream().expect("a caller stream");
    let mut handle = null_mut();
    // SAFETY: the primary context is current on this thread (CudaContext::new binds it).
    let code = unsafe { fa_cuda_device_create_from_context(null_mut(), &mut handle) };
    assert_eq!(code, FA_OK, "{}", last_error());

    let mut rng = Rng::new(22);
    let used = [0u32, 1, 77, 300, 129];
    let (sq, hq, hk, d) = (2, 8, 2, 128);
    for (layout, splits, caller_workspace) in [
        (CacheLayout::Padded { capacity: 301 }, 0, false),
        (DecodeCase::paged_layout(&used, 16), 0, true),
        (DecodeCase::paged_layout(&used, 64), 3, false),
    ] {
        let case = DecodeCase::new(&mut rng, &used, sq, hq, hk, d, layout, Rounding::Bf16).causal();
        let problem = case.desc().validate(256).expect("valid");
        let up = |x: &[f32]| {
            let bits: Vec<u16> = x.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
            stream.clone_htod(&bits).expect("upload")
        };
        let (q, k, v) = (up(&case.q), up(&case.k), up(&case.v));
        let o = stream
            .alloc_zeros::<u16>(problem.min_buffer_lens().o)
            .expect("alloc");
        let lse = stream.alloc_zeros::<f32>(problem.lse_len()).expect("alloc");
        let used_dev = stream.clone_htod(&used.map(|x| x as i32)).expect("upload");
        let table_dev = (!case.block_table.is_empty())
            .then(|| stream.clone_htod(&case.block_table).expect("upload"));
        let addr = |s: &CudaSlice<u16>| s.device_ptr(&stream).0 as usize as *mut c_void;
        let mut p = dense(5, sq as i64, 0, hq as i64, hk as i64, d as i64);
        p.causal = 1;
        let mut cache = FaKvCache {
            seqused_k: used_dev.device_ptr(&stream).0 as usize as *const i32,
            num_splits: splits,
            ..FaKvCache::default()
        };
        let rows = match layout {
            CacheLayout::Padded { capacity } => {
                p.seqlen_k = capacity as i64;
                capacity
            }
            CacheLayout::Paged {
                block_size,
                blocks_per_seq,
                num_blocks,
            } => {
                let t = table_dev.as_ref().expect("a table");
                cache.block_table = t.device_ptr(&stream).0 as usize as *const i32;
                cache.blocks_per_seq = blocks_per_seq as i64;
                cache.block_size = block_size as i64;
                cache.num_blocks = num_blocks as i64;
                block_size
            }
        };
        let tq = bshd(addr(&q), FA_DTYPE_BF16, sq, hq, d);
        let tk = bshd(addr(&k), FA_DTYPE_BF16, rows, hk, d);
        let tv = bshd(addr(&v), FA_DTYPE_BF16, rows, hk, d);
        let to = bshd(addr(&o), FA_DTYPE_BF16, sq, hq, d);
        let mut ws_bytes = 0usize;
        // SAFETY: descriptors of live locals; nothing on the device is read.
        let code = unsafe {
            fa_forward_cache_cuda_workspace_bytes(
                handle,
                &p,
                &cache,
                &tq,
                &tk,
                &tv,
                &to,
                null(),
                &mut ws_bytes,
            )
        };
        assert_eq!(code, FA_OK, "{}", last_error());
        if splits > 1 {
            assert!(ws_bytes > 0, "forced splits need a workspace");
        }
        let ws = caller_workspace.then(|| {
            stream
                .alloc_zeros::<u8>(ws_bytes.max(16))
                .expect("workspace")
        });
        let ws_ptr = ws.as_ref().map_or(null_mut(), |w| {
            w.device_ptr(&stream).0 as usize as *mut c_void
        });
        let lse_ptr = lse.device_ptr(&stream).0 as usize as *mut f32;
        // SAFETY: allocations of this context sized for the problem and the workspace, alive
        // until the stream is synchronised below; `stream` is a stream of the same context.
        let code = unsafe {
            fa_forward_cache_cuda(
                handle,
                &p,
                &cache,
                &tq,
                &tk,
                &tv,
                &to,
                lse_ptr,
                ws_ptr,
                ws_bytes.max(16),
                stream.cu_stream() as *mut c_void,
                null(),
            )
        };
        assert_eq!(code, FA_OK, "{}", last_error());
        stream.synchronize().expect("synchronise");
        let o_host: Vec<bf16> = stream
            .clone_dtoh(&o)
            .expect("download")
            .into_iter()
            .map(bf16::from_bits)
            .collect();
        let lse_host = stream.clone_dtoh(&lse).expect("download");
        let oracle = fa_reference::attention_f64(&problem, &case.q, &case.k, &case.v);
        let report = compare(&problem, &o_host, Some(&lse_host), &oracle);
        assert!(
            report.within(1e-2, 1e-2),
            "{layout:?} splits {splits}: {report:?}"
        );
    }
    // SAFETY: the handle came from fa_cuda_device_create_from_context; work is finished.
    unsafe { fa_cuda_device_destroy(handle) };
}
