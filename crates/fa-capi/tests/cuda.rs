//! The CUDA entry points: without a GPU every device call is `FA_ERR_NO_DEVICE`; on a GPU
//! (ignored here) `fa_forward_cuda`, `fa_forward_cache_cuda` and `fa_append_kv_cuda` run on a
//! caller's stream on cudarc allocations and match the f64 reference, and a paged cache's
//! block walk (`fa_block_walk`, `FaKvCache::block_walk`) reaches the decode kernel.

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

// ----- The block walk (API version 4): FaKvCache::block_walk through fa_forward_cache_cuda -----

/// bf16 NaN: what O is poisoned with before a call, so that an element it forgets to write,
/// or a refused call that writes, is caught.
const BF16_POISON: u16 = 0x7fc0;

/// The block walk of a paged decode case over the lengths `used`, built on the host by
/// `fa_block_walk` from `table` (the case's own block table, or a deliberately wrong one).
fn host_walk(case: &fa_reference::DecodeCase, used: &[i32], table: &[i32]) -> Vec<i32> {
    let fa_reference::CacheLayout::Paged {
        block_size,
        blocks_per_seq,
        num_blocks,
    } = case.layout
    else {
        panic!("a block walk goes with a paged case");
    };
    let mut walk = vec![-7i32; case.batch * 2 * blocks_per_seq];
    // SAFETY: host slices of the stated lengths.
    let code = unsafe {
        fa_block_walk(
            used.as_ptr(),
            table.as_ptr(),
            case.batch as i64,
            blocks_per_seq as i64,
            block_size as i64,
            num_blocks as i64,
            walk.as_mut_ptr(),
            walk.len(),
        )
    };
    assert_eq!(code, FA_OK, "{}", last_error());
    walk
}

/// What one walked call gave: its code and message, whether a refused call left the poisoned
/// outputs as they were, and (on success) the report against the f64 reference.
struct WalkRun {
    code: i32,
    message: String,
    untouched: bool,
    report: Option<fa_reference::ErrorReport>,
}

/// Runs `fa_forward_cache_cuda` on a decode case whose cache is on the device (`k`, `v`),
/// the case's own tables uploaded here, with `walk` as `FaKvCache::block_walk` (a device
/// address, or null), outputs poisoned first; `edit` changes the cache descriptor last.
fn run_walked(
    gpu: &Gpu,
    case: &fa_reference::DecodeCase,
    [k, v]: [&cudarc::driver::CudaSlice<u16>; 2],
    walk: *const i32,
    splits: u32,
    edit: impl FnOnce(&mut FaKvCache),
) -> WalkRun {
    let problem = case.desc().validate(256).expect("valid");
    let q = gpu.up(&case.q);
    let o_len = problem.min_buffer_lens().o;
    let o = gpu
        .stream
        .clone_htod(&vec![BF16_POISON; o_len])
        .expect("upload");
    let lse = gpu
        .stream
        .clone_htod(&vec![f32::NAN; problem.lse_len()])
        .expect("upload");
    let used: Vec<i32> = case.seqused_k.iter().map(|&x| x as i32).collect();
    let [used_dev, table_dev] = gpu.tables(case, &used);
    let (mut p, mut cache, rows) = cache_descriptors(
        case,
        gpu.addr(&used_dev).cast(),
        gpu.addr(&table_dev).cast(),
    );
    p.window_left = case.mask.left.map_or(-1, |l| l as i64);
    p.window_right = case.mask.right.map_or(-1, |r| r as i64);
    cache.num_splits = splits;
    cache.block_walk = walk;
    edit(&mut cache);
    let [tq, tk, tv, to] = cache_tensors(
        case,
        FA_DTYPE_BF16,
        [gpu.addr(&q), gpu.addr(k), gpu.addr(v), gpu.addr(&o)],
        rows,
    );
    // SAFETY: allocations of this context sized for the problem (the walk for its cache),
    // alive until the stream is synchronised below; the library allocates the workspace.
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
            null_mut(),
            0,
            gpu.raw_stream(),
            null(),
        )
    };
    let message = last_error();
    if code != FA_OK {
        gpu.stream.synchronize().expect("synchronise");
        let o_bits = gpu.stream.clone_dtoh(&o).expect("download");
        let lse_host = gpu.stream.clone_dtoh(&lse).expect("download");
        return WalkRun {
            code,
            message,
            untouched: o_bits.iter().all(|&x| x == BF16_POISON)
                && lse_host.iter().all(|x| x.is_nan()),
            report: None,
        };
    }
    let report = gpu.report(&problem, [&case.q, &case.k, &case.v], &o, &lse);
    WalkRun {
        code,
        message,
        untouched: false,
        report: Some(report),
    }
}

/// A paged cache's walk built by `fa_block_walk` and passed through `fa_forward_cache_cuda`
/// gives the reference's result, as the table-order call does; a wrong walk (every used
/// block moved to its neighbour in the pool) gives a wrong one wherever the plan walks —
/// so the walk does reach the kernel — and changes nothing where it does not (blocks of 5
/// keys looked up per row, a left window).
#[test]
#[ignore = "needs a CUDA GPU"]
fn cache_forward_with_a_block_walk_matches_the_reference() {
    use fa_reference::{CacheLayout, DecodeCase, Rng, Rounding};
    use softmax_core::Mask;

    let gpu = Gpu::open();
    let mut rng = Rng::new(24);
    // Lengths 0, 1, partial and whole blocks, up to a few thousand keys.
    let used = [
        0u32,
        1,
        77,
        300,
        129,
        64,
        2048,
        1000 + rng.below(1000) as u32,
    ];
    let window = Mask {
        left: Some(40),
        right: Some(0),
    };
    // (block size, mask, splits, queries, whether the plan walks at head dim 128)
    let cases = [
        (8, Mask::CAUSAL, 0, 1, true),
        (16, Mask::NONE, 0, 1, true),
        (16, Mask::CAUSAL, 3, 2, true),
        (32, Mask::CAUSAL, 0, 1, true),
        (64, Mask::NONE, 16, 1, true),
        (256, Mask::CAUSAL, 0, 3, true),
        (5, Mask::CAUSAL, 0, 1, false),
        (16, window, 0, 1, false),
    ];
    for (block_size, mask, splits, seqlen_q, walks) in cases {
        let layout = DecodeCase::paged_layout(&used, block_size);
        let case = DecodeCase::new(&mut rng, &used, seqlen_q, 8, 2, 128, layout, Rounding::Bf16)
            .with_mask(mask);
        let CacheLayout::Paged { num_blocks, .. } = case.layout else {
            unreachable!()
        };
        let label = format!("block size {block_size}, {mask:?}, splits {splits}, sq {seqlen_q}");
        let (k, v) = (gpu.up(&case.k), gpu.up(&case.v));
        let used_i: Vec<i32> = used.iter().map(|&u| u as i32).collect();
        let walk = gpu.up_i32(&host_walk(&case, &used_i, &case.block_table));
        let wrong_table: Vec<i32> = case
            .block_table
            .iter()
            .map(|&e| {
                if e >= 0 {
                    (e + 1) % num_blocks as i32
                } else {
                    e
                }
            })
            .collect();
        let wrong = gpu.up_i32(&host_walk(&case, &used_i, &wrong_table));
        let bound = |run: &WalkRun, what: &str| {
            assert_eq!(run.code, FA_OK, "{label} {what}: {}", run.message);
            let report = run.report.as_ref().expect("a report");
            assert!(report.within(1e-2, 1e-2), "{label} {what}: {report:?}");
            report.rel_l2
        };
        let ordered = run_walked(&gpu, &case, [&k, &v], null(), splits, |_| {});
        let ordered = bound(&ordered, "table order");
        let walked = run_walked(
            &gpu,
            &case,
            [&k, &v],
            gpu.addr(&walk).cast(),
            splits,
            |_| {},
        );
        let walked = bound(&walked, "walked");
        eprintln!("{label}: rel_l2 table order {ordered:.2e}, walked {walked:.2e}");
        let run = run_walked(
            &gpu,
            &case,
            [&k, &v],
            gpu.addr(&wrong).cast(),
            splits,
            |_| {},
        );
        if walks {
            assert_eq!(run.code, FA_OK, "{label} wrong walk: {}", run.message);
            let report = run.report.expect("a report");
            assert!(
                report.rel_l2 > 0.1,
                "{label}: a wrong walk gave the right answer, so the walk was not read: \
                 {report:?}"
            );
        } else {
            bound(&run, "wrong walk, not walked by the plan");
        }
    }
}

/// What `fa_forward_cache_cuda` refuses about a walk, outputs untouched: one with a padded
/// cache, a misaligned one; and a descriptor of API version 3 (its size ends before the walk)
/// is read without one.
#[test]
#[ignore = "needs a CUDA GPU"]
fn cache_forward_refuses_a_walk_it_cannot_take() {
    use fa_reference::{CacheLayout, DecodeCase, Rng, Rounding};

    let gpu = Gpu::open();
    let mut rng = Rng::new(25);
    let used = [3u32, 100, 64];
    let padded = DecodeCase::new(
        &mut rng,
        &used,
        1,
        8,
        2,
        128,
        CacheLayout::Padded { capacity: 101 },
        Rounding::Bf16,
    );
    let (k, v) = (gpu.up(&padded.k), gpu.up(&padded.v));
    let any = gpu.up_i32(&[0; 64]);
    let run = run_walked(&gpu, &padded, [&k, &v], gpu.addr(&any).cast(), 0, |_| {});
    assert_refused_run(&run, "a padded cache has no blocks to walk");

    let layout = DecodeCase::paged_layout(&used, 16);
    let case = DecodeCase::new(&mut rng, &used, 1, 8, 2, 128, layout, Rounding::Bf16).causal();
    let (k, v) = (gpu.up(&case.k), gpu.up(&case.v));
    let used_i: Vec<i32> = used.iter().map(|&u| u as i32).collect();
    let walk = gpu.up_i32(&host_walk(&case, &used_i, &case.block_table));
    let odd = (gpu.addr(&walk) as usize + 2) as *const i32;
    let run = run_walked(&gpu, &case, [&k, &v], odd, 0, |_| {});
    assert_refused_run(&run, "block_walk");
    // Version 3: `size` ends before `block_walk`, so even a misaligned walk is never read.
    let run = run_walked(&gpu, &case, [&k, &v], odd, 0, |c| {
        c.size = core::mem::offset_of!(FaKvCache, block_walk) as u32;
        c.version = 3;
    });
    assert_eq!(run.code, FA_OK, "{}", run.message);
    let report = run.report.expect("a report");
    assert!(report.within(1e-2, 1e-2), "version 3: {report:?}");
}

#[track_caller]
fn assert_refused_run(run: &WalkRun, words: &str) {
    assert_eq!(run.code, FA_ERR_INVALID_ARGUMENT, "{}", run.message);
    assert!(
        run.message.contains(words),
        "{:?} lacks {words:?}",
        run.message
    );
    assert!(run.untouched, "outputs written on error ({})", run.message);
}

/// A decode step as a runtime runs it: new tokens appended with a descriptor that already
/// carries the step's walk (the append never reads it: here a misaligned address), then the
/// walk built from the new lengths, uploaded once and passed to the attention call, which
/// matches the reference over the appended cache.
#[test]
#[ignore = "needs a CUDA GPU"]
fn append_then_a_walked_cache_call_matches_the_reference() {
    use fa_reference::{DecodeCase, Rng, Rounding};

    let gpu = Gpu::open();
    let mut rng = Rng::new(26);
    let new = 1;
    // The case's lengths count the new token; the append starts at `after − new`. Sequence
    // 2 opens a new block of 16 with its token, so a walk of the old lengths would miss it.
    let after = [1u32, 78, 33, 301, 130];
    let before: Vec<i32> = after.iter().map(|&u| (u - new as u32) as i32).collect();
    for block_size in [16, 64] {
        let layout = DecodeCase::paged_layout(&after, block_size);
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
        let (p, mut cache, rows) = cache_descriptors(
            &case,
            gpu.addr(&used_dev).cast(),
            gpu.addr(&table_dev).cast(),
        );
        let after_i: Vec<i32> = after.iter().map(|&u| u as i32).collect();
        let walk = gpu.up_i32(&host_walk(&case, &after_i, &case.block_table));
        cache.block_walk = (gpu.addr(&walk) as usize + 2) as *const i32;
        let t = append_tensors(
            &case,
            FA_DTYPE_BF16,
            [gpu.addr(&kn), gpu.addr(&vn), gpu.addr(&k), gpu.addr(&v)],
            new,
            rows,
        );
        // SAFETY: allocations of this context sized for the cache and the new tokens, alive
        // until the stream is synchronised; the walk is not read by the append.
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
            "block size {block_size}: the append"
        );
        (case.k, case.v) = (k_want, v_want);
        let run = run_walked(&gpu, &case, [&k, &v], gpu.addr(&walk).cast(), 0, |_| {});
        assert_eq!(run.code, FA_OK, "{}", run.message);
        let report = run.report.expect("a report");
        assert!(
            report.within(1e-2, 1e-2),
            "block size {block_size}: {report:?}"
        );
    }
}
