//! `fa_backward_cuda` and `fa_backward_cuda_workspace_bytes`: without a GPU, a missing device
//! handle or out-pointer gets its code; on a GPU (ignored here) the gradients of
//! `fa_forward_cuda`'s output on a caller's stream (dense and packed with host or device
//! prefix sums, GQA/MQA, causal, window, softcap; caller and library workspaces; bf16 and
//! f16) match the f64 reference backward, and bad calls get their code with the gradients
//! untouched.

mod common;

use common::*;
use core::ffi::c_void;
use core::ptr::{null, null_mut};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use fa_reference::{attention_backward_f64, compare_grads, Case, Rng, Rounding};
use flash_attention_rs::*;
use softmax_core::{Grads, Mask};
use std::sync::Arc;

/// The 16 bits of a gradient no correct call writes (bf16 and f16 7.0 differ; both are
/// checked by value through [`Dt::f32`]).
const SENTINEL: f32 = 7.0;

#[test]
fn a_missing_handle_or_out_pointer_is_refused_without_a_gpu() {
    let p = FaProblem::dense(1, 4, 4, 2, 2, 64);
    let t = bshd(16 as *mut c_void, FA_DTYPE_BF16, 4, 2, 64);
    let lse = 16 as *const f32;
    // SAFETY: a null device is refused before anything else is read.
    let code = unsafe {
        fa_backward_cuda(
            null(),
            &p,
            &t,
            &t,
            &t,
            &t,
            lse,
            &t,
            &t,
            &t,
            &t,
            null_mut(),
            0,
            null_mut(),
            null(),
        )
    };
    assert_eq!(code, FA_ERR_INVALID_ARGUMENT);
    assert!(last_error().contains("device"), "{}", last_error());
    let mut bytes = 0usize;
    // SAFETY: as above.
    let code =
        unsafe { fa_backward_cuda_workspace_bytes(null(), &p, &t, &t, &t, &t, null(), &mut bytes) };
    assert_eq!(code, FA_ERR_INVALID_ARGUMENT);
    // SAFETY: a null out-pointer is refused first.
    let code =
        unsafe { fa_backward_cuda_workspace_bytes(null(), &p, &t, &t, &t, &t, null(), null_mut()) };
    assert_eq!(code, FA_ERR_INVALID_ARGUMENT);
    assert!(last_error().contains("bytes"), "{}", last_error());
    assert!(fa_api_version() >= 7);
}

/// The two device dtypes.
#[derive(Clone, Copy, Debug)]
enum Dt {
    Bf16,
    F16,
}

impl Dt {
    fn code(self) -> u32 {
        match self {
            Dt::Bf16 => FA_DTYPE_BF16,
            Dt::F16 => FA_DTYPE_F16,
        }
    }
    fn rounding(self) -> Rounding {
        match self {
            Dt::Bf16 => Rounding::Bf16,
            Dt::F16 => Rounding::F16,
        }
    }
    fn bits(self, x: f32) -> u16 {
        match self {
            Dt::Bf16 => half::bf16::from_f32(x).to_bits(),
            Dt::F16 => half::f16::from_f32(x).to_bits(),
        }
    }
    fn f32(self, b: u16) -> f32 {
        match self {
            Dt::Bf16 => half::bf16::from_bits(b).to_f32(),
            Dt::F16 => half::f16::from_bits(b).to_f32(),
        }
    }
}

/// The C problem of a reference case (dense or packed with host prefix sums at `cu`).
fn c_problem(case: &Case, cu: &(Vec<i32>, Vec<i32>)) -> FaProblem {
    let (b, sq, sk) = case.dense;
    let mut p = FaProblem::dense(
        b as i64,
        sq as i64,
        sk as i64,
        case.heads_q as i64,
        case.heads_kv as i64,
        case.head_dim as i64,
    );
    if !case.cu_seqlens_q.is_empty() {
        p.seqlens = FA_SEQLENS_VARLEN_HOST;
        p.batch = case.cu_seqlens_q.len() as i64 - 1;
        p.cu_seqlens_q = cu.0.as_ptr();
        p.cu_seqlens_k = cu.1.as_ptr();
    }
    p.head_dim_v = case.head_dim_v as i64;
    p.window_left = case.mask.left.map_or(-1, |x| x as i64);
    p.window_right = case.mask.right.map_or(-1, |x| x as i64);
    p.softcap = case.softcap.unwrap_or(0.0);
    p.softmax_scale = case.softmax_scale.unwrap_or(0.0);
    p
}

/// One backward call's buffers on the device: inputs, O and LSE from `fa_forward_cuda`, dO
/// drawn, gradients poisoned with [`SENTINEL`].
struct Setup {
    stream: Arc<CudaStream>,
    handle: *mut FaCudaDevice,
    dt: Dt,
    case: Case,
    cu: (Vec<i32>, Vec<i32>),
    problem: FaProblem,
    /// Q, K, V, O, dO, dQ, dK, dV.
    bufs: Vec<CudaSlice<u16>>,
    lse: CudaSlice<f32>,
    d_o: Vec<f32>,
    /// Device prefix sums (packed cases).
    dev_cu: Option<(CudaSlice<i32>, CudaSlice<i32>)>,
}

impl Setup {
    fn new(case: Case, dt: Dt, rng: &mut Rng) -> Setup {
        let ctx = cudarc::driver::CudaContext::new(0).expect("device 0");
        let stream = ctx.new_stream().expect("a caller stream");
        let mut handle = null_mut();
        // SAFETY: the primary context is current on this thread (CudaContext::new binds it).
        let code = unsafe { fa_cuda_device_create_from_context(null_mut(), &mut handle) };
        assert_eq!(code, FA_OK, "{}", last_error());
        let case = case.round(dt.rounding());
        let p = case.desc().validate(256).expect("valid case");
        let lens = p.min_buffer_lens();
        let d_o: Vec<f32> = (0..lens.o)
            .map(|_| dt.rounding().apply(rng.normal() as f32))
            .collect();
        let up = |x: &[f32]| {
            let bits: Vec<u16> = x.iter().map(|&v| dt.bits(v)).collect();
            stream.clone_htod(&bits).expect("upload")
        };
        let poison = |n: usize| up(&vec![SENTINEL; n]);
        let bufs = vec![
            up(&case.q),
            up(&case.k),
            up(&case.v),
            poison(lens.o),
            up(&d_o),
            poison(lens.q),
            poison(lens.k),
            poison(lens.v),
        ];
        let lse = stream.alloc_zeros::<f32>(p.lse_len()).expect("alloc");
        let cu: (Vec<i32>, Vec<i32>) = (
            case.cu_seqlens_q.iter().map(|&x| x as i32).collect(),
            case.cu_seqlens_k.iter().map(|&x| x as i32).collect(),
        );
        let dev_cu = (!cu.0.is_empty()).then(|| {
            (
                stream.clone_htod(&cu.0).expect("upload"),
                stream.clone_htod(&cu.1).expect("upload"),
            )
        });
        let mut s = Setup {
            stream,
            handle,
            dt,
            problem: FaProblem::dense(0, 0, 0, 1, 1, 8),
            cu,
            case,
            bufs,
            lse,
            d_o,
            dev_cu,
        };
        s.problem = c_problem(&s.case, &s.cu);
        let t = s.descs();
        // SAFETY: allocations of this context sized for the problem, alive until the
        // stream is synchronised; the stream is of the same context.
        let code = unsafe {
            fa_forward_cuda(
                s.handle,
                &s.problem,
                &t[0],
                &t[1],
                &t[2],
                &t[3],
                s.addr(&s.lse).cast(),
                s.stream.cu_stream() as *mut c_void,
                null(),
            )
        };
        assert_eq!(code, FA_OK, "forward: {}", last_error());
        s
    }

    fn addr<T>(&self, x: &CudaSlice<T>) -> *mut c_void {
        x.device_ptr(&self.stream).0 as usize as *mut c_void
    }

    /// Contiguous descriptors of the eight tensors.
    fn descs(&self) -> [FaTensor; 8] {
        let c = &self.case;
        let packed = !c.cu_seqlens_q.is_empty();
        let (_, sq, sk) = c.dense;
        let shape = |which: usize| match which % 4 {
            0 => (sq, c.heads_q, c.head_dim),
            1 => (sk, c.heads_kv, c.head_dim),
            2 => (sk, c.heads_kv, c.head_dim_v),
            _ => (sq, c.heads_q, c.head_dim_v),
        };
        // Q K V O dO dQ dK dV → layouts Q K V O O Q K V.
        let layout = [0, 1, 2, 3, 3, 0, 1, 2];
        core::array::from_fn(|i| {
            let (seqlen, heads, dim) = shape(layout[i]);
            let mut t = bshd(self.addr(&self.bufs[i]), self.dt.code(), seqlen, heads, dim);
            if packed {
                t.stride_batch = 0;
            }
            t
        })
    }

    /// The workspace size the library asks for.
    fn workspace_bytes(&self) -> usize {
        let t = self.descs();
        let mut bytes = usize::MAX;
        // SAFETY: live descriptors and a writable local.
        let code = unsafe {
            fa_backward_cuda_workspace_bytes(
                self.handle,
                &self.problem,
                &t[0],
                &t[1],
                &t[2],
                &t[3],
                null(),
                &mut bytes,
            )
        };
        assert_eq!(code, FA_OK, "{}", last_error());
        bytes
    }

    /// Runs `fa_backward_cuda` with `edit` applied to the problem, the descriptors, the LSE
    /// and the workspace (address, bytes) first, then waits for the stream.
    fn run(
        &self,
        device_seqlens: bool,
        edit: impl FnOnce(&mut FaProblem, &mut [FaTensor; 8], &mut *const f32, &mut (u64, usize)),
    ) -> i32 {
        let mut problem = self.problem;
        if let (true, Some((q, k))) = (device_seqlens, &self.dev_cu) {
            problem.seqlens = FA_SEQLENS_VARLEN_DEVICE;
            problem.cu_seqlens_q = self.addr(q).cast();
            problem.cu_seqlens_k = self.addr(k).cast();
            // The packed tensors' tokens: the last prefix sums (a varlen case's `dense` sizes
            // are not its totals).
            problem.total_q = self.cu.0.last().copied().unwrap_or(0) as i64;
            problem.total_k = self.cu.1.last().copied().unwrap_or(0) as i64;
            let longest = |cu: &[i32]| cu.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0);
            problem.max_seqlen_q = longest(&self.cu.0) as i64;
            problem.max_seqlen_k = longest(&self.cu.1) as i64;
        }
        let mut t = self.descs();
        let mut lse = self.addr(&self.lse) as *const f32;
        let mut ws = (0u64, 0usize);
        edit(&mut problem, &mut t, &mut lse, &mut ws);
        // SAFETY: device allocations of this context sized for the problem (the edits make
        // them bad only in ways the library must refuse), alive until the stream is
        // synchronised below.
        let code = unsafe {
            fa_backward_cuda(
                self.handle,
                &problem,
                &t[0],
                &t[1],
                &t[2],
                &t[3],
                lse,
                &t[4],
                &t[5],
                &t[6],
                &t[7],
                ws.0 as usize as *mut c_void,
                ws.1,
                self.stream.cu_stream() as *mut c_void,
                null(),
            )
        };
        self.stream.synchronize().expect("synchronise");
        code
    }

    fn grads(&self) -> Grads<Vec<f32>> {
        let down = |x: &CudaSlice<u16>| -> Vec<f32> {
            let bits = self.stream.clone_dtoh(x).expect("download");
            bits.into_iter().map(|b| self.dt.f32(b)).collect()
        };
        Grads::new(
            down(&self.bufs[5]),
            down(&self.bufs[6]),
            down(&self.bufs[7]),
        )
    }

    fn untouched(&self) -> bool {
        let g = self.grads();
        g.dq.iter()
            .chain(&g.dk)
            .chain(&g.dv)
            .all(|&x| x == SENTINEL)
    }

    /// Normwise errors of the gradients against the f64 reference on the same inputs.
    fn errors(&self) -> Grads<f64> {
        let p = self.case.desc().validate(256).expect("valid");
        let reference =
            attention_backward_f64(&p, &self.case.q, &self.case.k, &self.case.v, &self.d_o);
        let g = self.grads();
        compare_grads(&p, Grads::new(&g.dq[..], &g.dk[..], &g.dv[..]), &reference)
    }
}

impl Drop for Setup {
    fn drop(&mut self) {
        let _ = self.stream.synchronize();
        // SAFETY: the handle came from fa_cuda_device_create_from_context, destroyed once.
        unsafe { fa_cuda_device_destroy(self.handle) };
    }
}

fn gpu_cases() -> Vec<(&'static str, Case)> {
    let mut rng = Rng::fresh();
    let window = Mask {
        left: Some(20),
        right: Some(5),
    };
    vec![
        (
            "dense GQA causal d64",
            Case::dense(&mut rng, 2, 100, 130, 8, 2, 64).causal(),
        ),
        (
            "dense MQA window softcap d128",
            Case::dense(&mut rng, 1, 77, 90, 4, 1, 128)
                .with_mask(window)
                .with_softcap(3.0),
        ),
        (
            "dense scale d96",
            Case::dense(&mut rng, 2, 33, 65, 2, 2, 96).with_scale(0.3),
        ),
        (
            "varlen GQA causal d64",
            Case::varlen(&mut rng, &[5, 1, 70, 33], &[9, 3, 70, 50], 4, 2, 64).causal(),
        ),
    ]
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gradients_on_a_caller_stream_match_the_f64_reference() {
    let mut rng = Rng::fresh();
    let mut ran = 0;
    for (what, case) in gpu_cases() {
        for dt in [Dt::Bf16, Dt::F16] {
            let packed = !case.cu_seqlens_q.is_empty();
            for (device_seqlens, caller_ws) in [(false, false), (packed, true)] {
                let s = Setup::new(case.clone(), dt, &mut rng);
                let bytes = s.workspace_bytes();
                // A caller workspace, rounded up to the 256 bytes asked for.
                let ws = s.stream.alloc_zeros::<u8>(bytes + 256).expect("alloc");
                let base = s.addr(&ws) as u64;
                let start = base.next_multiple_of(256);
                let code = s.run(device_seqlens, |_, _, _, w| {
                    if caller_ws {
                        *w = (start, bytes);
                    }
                });
                let label =
                    format!("{what} {dt:?} device_seqlens={device_seqlens} caller_ws={caller_ws}");
                assert_eq!(code, FA_OK, "{label}: {}", last_error());
                let e = s.errors();
                for (name, x) in [("dq", e.dq), ("dk", e.dk), ("dv", e.dv)] {
                    assert!(x <= 2e-2, "{label}: {name} rel_l2 {x:e}");
                }
                eprintln!(
                    "{label}: rel_l2 dq {:.2e} dk {:.2e} dv {:.2e}",
                    e.dq, e.dk, e.dv
                );
                drop(ws);
                ran += 1;
            }
        }
    }
    eprintln!("{ran} CUDA backward calls matched the f64 reference");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn bad_calls_get_their_code_and_leave_the_gradients_untouched() {
    let mut rng = Rng::new(9);
    let case = Case::dense(&mut rng, 2, 40, 50, 4, 2, 64).causal();
    let s = Setup::new(case, Dt::Bf16, &mut rng);
    let bytes = s.workspace_bytes();
    let ws = s.stream.alloc_zeros::<u8>(bytes + 512).expect("alloc");
    let start = (s.addr(&ws) as u64).next_multiple_of(256);
    let invalid = FA_ERR_INVALID_ARGUMENT;
    type Edit =
        Box<dyn FnOnce(&mut FaProblem, &mut [FaTensor; 8], &mut *const f32, &mut (u64, usize))>;
    let edits: Vec<(Edit, i32, &str)> = vec![
        (
            Box::new(|_, _, l, _| *l = null()),
            invalid,
            "lse is a null pointer",
        ),
        (
            Box::new(|_, t, _, _| t[6].data = null_mut()),
            invalid,
            "dk is a null pointer",
        ),
        (
            Box::new(|_, t, _, _| t[5].data = (t[5].data as usize + 8) as *mut c_void),
            invalid,
            "16-byte aligned",
        ),
        (
            Box::new(|_, t, _, _| t[4].stride_seq += 8),
            invalid,
            "d_o laid out as o",
        ),
        (
            Box::new(|_, t, _, _| t[5].stride_head = 72),
            invalid,
            "dq laid out as q",
        ),
        (
            Box::new(|_, t, _, _| t[7].data = t[2].data),
            invalid,
            "overlap",
        ),
        (
            Box::new(|_, t, _, _| t[4].dtype = FA_DTYPE_F16),
            FA_ERR_UNSUPPORTED,
            "one dtype",
        ),
        (
            Box::new(|_, t, _, _| t.iter_mut().for_each(|x| x.dtype = FA_DTYPE_F32)),
            FA_ERR_UNSUPPORTED,
            "bf16 or f16",
        ),
        (
            Box::new(move |_, _, _, w| *w = (start, bytes - 1)),
            invalid,
            "workspace_bytes",
        ),
        (
            Box::new(move |_, _, _, w| *w = (start + 16, bytes)),
            invalid,
            "256-byte aligned",
        ),
        (
            // dK's allocation as the workspace (refused for overlap, or for alignment where
            // the allocator's start is not 256-aligned).
            Box::new(move |_, t, _, w| *w = (t[6].data as u64, bytes)),
            invalid,
            "",
        ),
        (Box::new(|p, _, _, _| p.heads_kv = 3), invalid, ""),
    ];
    for (edit, code, needle) in edits {
        let got = s.run(false, edit);
        let message = last_error();
        assert_eq!(got, code, "{needle}: {message}");
        assert!(message.contains(needle), "{needle:?} not in {message:?}");
        assert!(
            s.untouched(),
            "gradients written by a refused call ({needle})"
        );
    }
    // A good call after the refusals writes them.
    assert_eq!(s.run(false, |_, _, _, _| {}), FA_OK, "{}", last_error());
    assert!(!s.untouched());
    drop(ws);
}
