//! The CUDA entry points: without a GPU every device call is `FA_ERR_NO_DEVICE`; on a GPU
//! (ignored here) `fa_forward_cuda`, `fa_forward_cache_cuda` and `fa_append_kv_cuda` run on a
//! caller's stream on cudarc allocations and match the f64 reference.

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
    let p = FaProblem::dense(1, 4, 4, 2, 2, 64);
    let t = bshd(16 as *mut c_void, FA_DTYPE_BF16, 4, 2, 64);
    // SAFETY: a null device is refused before anything else is read.
    let code =
        unsafe { fa_forward_cuda(null(), &p, &t, &t, &t, &t, null_mut(), null_mut(), null()) };
    assert_eq!(code, FA_ERR_INVALID_ARGUMENT);
    assert!(last_error().contains("device"), "{}", last_error());
}

/// A caller's stream on device 0 and the library's handle on its primary context (bound to
/// this thread), with bf16 transfers; the handle is destroyed on drop.
struct Gpu {
    stream: std::sync::Arc<cudarc::driver::CudaStream>,
    handle: *mut FaCudaDevice,
}

impl Gpu {
    fn open() -> Gpu {
        let ctx = cudarc::driver::CudaContext::new(0).expect("device 0");
        let stream = ctx.new_stream().expect("a caller stream");
        let mut handle = null_mut();
        // SAFETY: the primary context is current on this thread (CudaContext::new binds it).
        let code = unsafe { fa_cuda_device_create_from_context(null_mut(), &mut handle) };
        assert_eq!(code, FA_OK, "{}", last_error());
        Gpu { stream, handle }
    }

    /// `x` rounded to bf16, on the device.
    fn up(&self, x: &[f32]) -> cudarc::driver::CudaSlice<u16> {
        let bits: Vec<u16> = x
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_bits())
            .collect();
        self.stream.clone_htod(&bits).expect("upload")
    }

    fn up_i32(&self, x: &[i32]) -> cudarc::driver::CudaSlice<i32> {
        self.stream.clone_htod(x).expect("upload")
    }

    /// A decode case's tables on the device: the used lengths `used`, and the block table (one
    /// unused entry for a padded cache).
    fn tables(
        &self,
        case: &fa_reference::DecodeCase,
        used: &[i32],
    ) -> [cudarc::driver::CudaSlice<i32>; 2] {
        let table: &[i32] = if case.block_table.is_empty() {
            &[0]
        } else {
            &case.block_table
        };
        [self.up_i32(used), self.up_i32(table)]
    }

    /// O (bf16) and the LSE of `problem`, zeroed on the device.
    fn outputs(
        &self,
        problem: &softmax_core::Problem,
    ) -> (
        cudarc::driver::CudaSlice<u16>,
        cudarc::driver::CudaSlice<f32>,
    ) {
        let o = self.stream.alloc_zeros::<u16>(problem.min_buffer_lens().o);
        let lse = self.stream.alloc_zeros::<f32>(problem.lse_len());
        (o.expect("alloc"), lse.expect("alloc"))
    }

    fn down(&self, x: &cudarc::driver::CudaSlice<u16>) -> Vec<half::bf16> {
        let bits = self.stream.clone_dtoh(x).expect("download");
        bits.into_iter().map(half::bf16::from_bits).collect()
    }

    fn addr<T>(&self, x: &cudarc::driver::CudaSlice<T>) -> *mut c_void {
        use cudarc::driver::DevicePtr;
        x.device_ptr(&self.stream).0 as usize as *mut c_void
    }

    fn raw_stream(&self) -> *mut c_void {
        self.stream.cu_stream() as *mut c_void
    }

    /// Waits for the stream, then compares O and the LSE on the device with the f64
    /// reference of `problem` over the host inputs.
    fn report(
        &self,
        problem: &softmax_core::Problem,
        [q, k, v]: [&[f32]; 3],
        o: &cudarc::driver::CudaSlice<u16>,
        lse: &cudarc::driver::CudaSlice<f32>,
    ) -> fa_reference::ErrorReport {
        self.stream.synchronize().expect("synchronise");
        let lse_host = self.stream.clone_dtoh(lse).expect("download");
        let oracle = fa_reference::attention_f64(problem, q, k, v);
        fa_reference::compare(problem, &self.down(o), Some(&lse_host), &oracle)
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        // The work is finished (or abandoned by a failed assertion) before the handle goes.
        let _ = self.stream.synchronize();
        // SAFETY: the handle came from fa_cuda_device_create_from_context, destroyed once.
        unsafe { fa_cuda_device_destroy(self.handle) };
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn forward_on_a_caller_stream_matches_the_reference() {
    use fa_reference::{Case, Rng, Rounding};

    let gpu = Gpu::open();
    let mut rng = Rng::new(21);
    for causal in [false, true] {
        let mut case = Case::dense(&mut rng, 2, 100, 130, 8, 2, 64).round(Rounding::Bf16);
        if causal {
            case = case.causal();
        }
        let problem = case.desc().validate(256).expect("valid");
        let (q, k, v) = (gpu.up(&case.q), gpu.up(&case.k), gpu.up(&case.v));
        let (o, lse) = gpu.outputs(&problem);
        let mut p = FaProblem::dense(2, 100, 130, 8, 2, 64);
        p.causal = causal as u32;
        let tq = bshd(gpu.addr(&q), FA_DTYPE_BF16, 100, 8, 64);
        let tk = bshd(gpu.addr(&k), FA_DTYPE_BF16, 130, 2, 64);
        let tv = bshd(gpu.addr(&v), FA_DTYPE_BF16, 130, 2, 64);
        let to = bshd(gpu.addr(&o), FA_DTYPE_BF16, 100, 8, 64);
        // SAFETY: allocations of this context sized for the problem, alive until the
        // stream is synchronised below; the stream is of the same context.
        let code = unsafe {
            fa_forward_cuda(
                gpu.handle,
                &p,
                &tq,
                &tk,
                &tv,
                &to,
                gpu.addr(&lse).cast(),
                gpu.raw_stream(),
                null(),
            )
        };
        assert_eq!(code, FA_OK, "{}", last_error());
        let report = gpu.report(&problem, [&case.q, &case.k, &case.v], &o, &lse);
        assert!(report.within(1e-2, 1e-3), "causal={causal}: {report:?}");
    }
}

/// Runs `fa_forward_cache_cuda` on a decode case whose cache is on the device (`k`, `v`),
/// tables uploaded here, and compares with the f64 reference over `case`'s host cache.
fn check_cache_forward(
    gpu: &Gpu,
    case: &fa_reference::DecodeCase,
    k: &cudarc::driver::CudaSlice<u16>,
    v: &cudarc::driver::CudaSlice<u16>,
    splits: u32,
    caller_workspace: bool,
) {
    let problem = case.desc().validate(256).expect("valid");
    let q = gpu.up(&case.q);
    let (o, lse) = gpu.outputs(&problem);
    let used: Vec<i32> = case.seqused_k.iter().map(|&x| x as i32).collect();
    let [used_dev, table_dev] = gpu.tables(case, &used);
    let (p, mut cache, rows) = cache_descriptors(
        case,
        gpu.addr(&used_dev).cast(),
        gpu.addr(&table_dev).cast(),
    );
    cache.num_splits = splits;
    let [tq, tk, tv, to] = cache_tensors(
        case,
        FA_DTYPE_BF16,
        [gpu.addr(&q), gpu.addr(k), gpu.addr(v), gpu.addr(&o)],
        rows,
    );
    let mut ws_bytes = 0usize;
    // SAFETY: descriptors of live locals; nothing on the device is read.
    let code = unsafe {
        fa_forward_cache_cuda_workspace_bytes(
            gpu.handle,
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
        gpu.stream
            .alloc_zeros::<u8>(ws_bytes.max(16))
            .expect("workspace")
    });
    let ws_ptr = ws.as_ref().map_or(null_mut(), |w| gpu.addr(w));
    // SAFETY: allocations of this context sized for the problem and the workspace, alive
    // until the stream is synchronised below; the stream is of the same context.
    let code = unsafe {
        fa_forward_cache_cuda(
            gpu.handle,
            &p,
            &cache,
            &tq,
            &tk,
            &tv,
            &to,
            gpu.addr(&lse).cast(),
            ws_ptr,
            ws_bytes.max(16),
            gpu.raw_stream(),
            null(),
        )
    };
    assert_eq!(code, FA_OK, "{}", last_error());
    let report = gpu.report(&problem, [&case.q, &case.k, &case.v], &o, &lse);
    assert!(
        report.within(1e-2, 1e-2),
        "{:?} splits {splits}: {report:?}",
        case.layout
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cache_forward_with_device_tables_matches_the_reference() {
    use fa_reference::{CacheLayout, DecodeCase, Rng, Rounding};

    let gpu = Gpu::open();
    let mut rng = Rng::new(22);
    let used = [0u32, 1, 77, 300, 129];
    for (layout, splits, caller_workspace) in [
        (CacheLayout::Padded { capacity: 301 }, 0, false),
        (DecodeCase::paged_layout(&used, 16), 0, true),
        (DecodeCase::paged_layout(&used, 64), 3, false),
    ] {
        let case = DecodeCase::new(&mut rng, &used, 2, 8, 2, 128, layout, Rounding::Bf16).causal();
        let (k, v) = (gpu.up(&case.k), gpu.up(&case.v));
        check_cache_forward(&gpu, &case, &k, &v, splits, caller_workspace);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn append_with_device_tables_then_the_cache_call_matches_the_reference() {
    use fa_reference::{CacheLayout, DecodeCase, Rng, Rounding};

    let gpu = Gpu::open();
    let mut rng = Rng::new(23);
    let new = 2;
    // The case's lengths count the new tokens; the append starts at `after − new`.
    let after = [2u32, 3, 78, 301, 130];
    let before: Vec<i32> = after.iter().map(|&u| (u - new as u32) as i32).collect();
    for layout in [
        CacheLayout::Padded { capacity: 305 },
        DecodeCase::paged_layout(&after, 16),
        DecodeCase::paged_layout(&after, 1),
    ] {
        let mut case =
            DecodeCase::new(&mut rng, &after, new, 8, 2, 128, layout, Rounding::Bf16).causal();
        let hk = case.heads_kv;
        let bf = |x: f64| half::bf16::from_f64(x).to_f32();
        let k_new: Vec<f32> = (0..5 * new * hk * 128).map(|_| bf(rng.normal())).collect();
        let v_new: Vec<f32> = (0..5 * new * hk * 128).map(|_| bf(rng.normal())).collect();
        let (k_want, v_want) = appended(&case, new, &k_new, &v_new);
        let (k, v, kn, vn) = (
            gpu.up(&case.k),
            gpu.up(&case.v),
            gpu.up(&k_new),
            gpu.up(&v_new),
        );
        let [used_dev, table_dev] = gpu.tables(&case, &before);
        let (p, cache, rows) = cache_descriptors(
            &case,
            gpu.addr(&used_dev).cast(),
            gpu.addr(&table_dev).cast(),
        );
        let t = append_tensors(
            &case,
            FA_DTYPE_BF16,
            [gpu.addr(&kn), gpu.addr(&vn), gpu.addr(&k), gpu.addr(&v)],
            new,
            rows,
        );
        // SAFETY: allocations of this context sized for the cache and the new tokens, alive
        // until the stream is synchronised; the stream is of the same context.
        let code = unsafe {
            fa_append_kv_cuda(
                gpu.handle,
                &p,
                &cache,
                &t[0],
                &t[1],
                &t[2],
                &t[3],
                gpu.raw_stream(),
            )
        };
        assert_eq!(code, FA_OK, "{}", last_error());
        gpu.stream.synchronize().expect("synchronise");
        let want = |x: &[f32]| {
            x.iter()
                .map(|&v| half::bf16::from_f32(v))
                .collect::<Vec<_>>()
        };
        assert!(
            gpu.down(&k) == want(&k_want) && gpu.down(&v) == want(&v_want),
            "{layout:?}: the append"
        );
        (case.k, case.v) = (k_want, v_want);
        check_cache_forward(&gpu, &case, &k, &v, 0, false);
    }
}
