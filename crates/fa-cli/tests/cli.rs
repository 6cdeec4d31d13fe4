//! End-to-end tests of the `fa` binary: files in, files out, messages for bad input.

use fa_cli::files::{read_tensor, write_tensors, FileFormat};
use fa_cli::tensor::{random_normal, DType, Data, HostTensor};
use fa_reference::Rng;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn fa(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_fa"))
        .args(args)
        .output()
        .expect("the fa binary runs")
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

struct Inputs {
    q: HostTensor,
    k: HostTensor,
    v: HostTensor,
}

fn inputs(rng: &mut Rng, dtype: DType, q: [usize; 4], kv: [usize; 4]) -> Inputs {
    Inputs {
        q: random_normal(rng, dtype, q.to_vec()).expect("host dtype"),
        k: random_normal(rng, dtype, kv.to_vec()).expect("host dtype"),
        v: random_normal(rng, dtype, kv.to_vec()).expect("host dtype"),
    }
}

fn save(dir: &Path, name: &str, t: &HostTensor) -> PathBuf {
    let path = dir.join(name);
    let format = FileFormat::from_extension(&path).unwrap();
    write_tensors(&path, format, &[(name.split('.').next().unwrap(), t)]).unwrap();
    path
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Saves Q, K, V as `q.npy`, `k.npy`, `v.npy` in `dir`.
fn save_npy(dir: &Path, inp: &Inputs) -> [PathBuf; 3] {
    [
        save(dir, "q.npy", &inp.q),
        save(dir, "k.npy", &inp.k),
        save(dir, "v.npy", &inp.v),
    ]
}

/// `fa run --q q --k k --v v -o out` plus `extra`.
fn fa_run(qkv: &[PathBuf; 3], out: &Path, extra: &[&str]) -> Output {
    let mut args = vec![
        "run",
        "--q",
        s(&qkv[0]),
        "--k",
        s(&qkv[1]),
        "--v",
        s(&qkv[2]),
        "-o",
        s(out),
    ];
    args.extend_from_slice(extra);
    fa(&args)
}

use softmax_core::{Out, Qkv};

/// fa-cpu's forward on the same data, output in the input dtype, with the LSE.
fn cpu_forward(inp: &Inputs, desc: &softmax_core::ProblemDesc) -> (Data, Vec<f32>) {
    let p = desc.validate(256).unwrap();
    let mut out = HostTensor::zeros(inp.q.dtype(), vec![p.min_buffer_lens().o])
        .expect("host dtype")
        .data;
    let mut lse = vec![0.0f32; p.lse_len()];
    let opts = fa_cpu::ForwardOptions::default();
    let r = match (&inp.q.data, &inp.k.data, &inp.v.data, &mut out) {
        (Data::F32(q), Data::F32(k), Data::F32(v), Data::F32(o)) => {
            fa_cpu::forward(&p, Qkv::new(q, k, v), Out::with_lse(o, &mut lse), &opts)
        }
        (Data::Bf16(q), Data::Bf16(k), Data::Bf16(v), Data::Bf16(o)) => {
            fa_cpu::forward(&p, Qkv::new(q, k, v), Out::with_lse(o, &mut lse), &opts)
        }
        (Data::F16(q), Data::F16(k), Data::F16(v), Data::F16(o)) => {
            fa_cpu::forward(&p, Qkv::new(q, k, v), Out::with_lse(o, &mut lse), &opts)
        }
        _ => unreachable!(),
    };
    r.unwrap();
    (out, lse)
}

#[test]
fn run_npy_equals_fa_cpu_forward_with_gqa_and_causal() {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng::new(1);
    // 6 query heads over 2 KV heads (GQA 3), seqlen_q ≠ seqlen_k, odd head dim.
    let inp = inputs(&mut rng, DType::F32, [2, 37, 6, 40], [2, 53, 2, 40]);
    let qkv = save_npy(dir.path(), &inp);
    let out = dir.path().join("out.npy");
    let lse = dir.path().join("lse.npy");
    let extra = [
        "--lse",
        s(&lse),
        "--causal",
        "--backend",
        "cpu",
        "--check-rows",
        "8",
    ];
    let o = fa_run(&qkv, &out, &extra);
    assert!(o.status.success(), "{:?}", text(&o));
    let (got, format) = read_tensor(&out, "out").unwrap();
    assert_eq!(format, FileFormat::Npy);
    assert_eq!(got.shape, vec![2, 37, 6, 40]);
    let (got_lse, _) = read_tensor(&lse, "lse").unwrap();
    assert_eq!(got_lse.shape, vec![2, 6, 37]);

    let desc = softmax_core::ProblemDesc::new(2, 37, 53, 6, 2, 40).causal();
    let (want, want_lse) = cpu_forward(&inp, &desc);
    assert_eq!(got.data, want, "fa run writes exactly what fa-cpu computes");
    assert_eq!(got_lse.data, Data::F32(want_lse));

    // And it is the right answer: the f64 oracle on the same inputs.
    let p = desc.validate(256).unwrap();
    let (qf, kf, vf) = (inp.q.to_f32(), inp.k.to_f32(), inp.v.to_f32());
    let oracle = fa_reference::attention_f64(&p, &qf, &kf, &vf);
    let report = fa_reference::compare(&p, &got.to_f32(), Some(&got_lse.to_f32()), &oracle);
    assert!(report.within(1e-5, 1e-4), "{report:?}");
}

#[test]
fn run_bf16_npy_and_window_softcap_scale() {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng::new(2);
    let inp = inputs(&mut rng, DType::Bf16, [1, 70, 4, 64], [1, 70, 4, 64]);
    let qkv = save_npy(dir.path(), &inp);
    let out = dir.path().join("out.npy");
    let extra = [
        "--window",
        "8,-1",
        "--softcap",
        "20",
        "--scale",
        "0.2",
        "--threads",
        "1",
    ];
    let o = fa_run(&qkv, &out, &extra);
    assert!(o.status.success(), "{:?}", text(&o));
    let (got, _) = read_tensor(&out, "out").unwrap();
    assert_eq!(got.dtype(), DType::Bf16, "output in the input's dtype");
    let desc = softmax_core::ProblemDesc::new(1, 70, 70, 4, 4, 64)
        .window(Some(8), None)
        .softcap(20.0)
        .scale(0.2);
    let (want, _) = cpu_forward(&inp, &desc);
    assert_eq!(got.data, want);
}

#[test]
fn run_safetensors_single_file_in_and_out() {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng::new(3);
    let inp = inputs(&mut rng, DType::F16, [1, 33, 4, 32], [1, 33, 1, 32]);
    let qkv = dir.path().join("qkv.safetensors");
    write_tensors(
        &qkv,
        FileFormat::Safetensors,
        &[("q", &inp.q), ("k", &inp.k), ("v", &inp.v)],
    )
    .unwrap();
    let out = dir.path().join("out.safetensors");
    let three = [qkv.clone(), qkv.clone(), qkv];
    let o = fa_run(&three, &out, &["--lse", s(&out), "--causal"]);
    assert!(o.status.success(), "{:?}", text(&o));
    let (got, format) = read_tensor(&out, "out").unwrap();
    assert_eq!(format, FileFormat::Safetensors);
    assert_eq!(got.dtype(), DType::F16);
    let (lse, _) = read_tensor(&out, "lse").unwrap();
    assert_eq!(lse.shape, vec![1, 4, 33]);
    // MQA: 4 query heads share the one KV head.
    let desc = softmax_core::ProblemDesc::new(1, 33, 33, 4, 1, 32).causal();
    let (want, want_lse) = cpu_forward(&inp, &desc);
    assert_eq!(got.data, want);
    assert_eq!(lse.data, Data::F32(want_lse));
}

#[test]
fn bad_files_and_shapes_have_clear_messages() {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng::new(4);
    let inp = inputs(&mut rng, DType::F32, [1, 8, 4, 16], [1, 8, 2, 16]);
    let [q, k, v] = save_npy(dir.path(), &inp);
    let out = dir.path().join("out.npy");
    let run = |q: &Path, k: &Path, v: &Path| {
        let qkv = [q.to_path_buf(), k.to_path_buf(), v.to_path_buf()];
        let o = fa_run(&qkv, &out, &[]);
        assert_eq!(o.status.code(), Some(2), "{:?}", text(&o));
        assert!(!out.exists(), "no output written on error");
        text(&o).1
    };

    let garbage = dir.path().join("garbage.npy");
    std::fs::write(&garbage, b"this is not an array").unwrap();
    let err = run(&garbage, &k, &v);
    assert!(
        err.contains("garbage.npy") && err.contains("not a .npy file"),
        "{err}"
    );

    let truncated = dir.path().join("truncated.npy");
    let bytes = std::fs::read(&q).unwrap();
    std::fs::write(&truncated, &bytes[..bytes.len() - 3]).unwrap();
    let err = run(&truncated, &k, &v);
    assert!(err.contains("data section holds"), "{err}");

    let missing = dir.path().join("missing.npy");
    let err = run(&missing, &k, &v);
    assert!(err.contains("missing.npy"), "{err}");

    // v with 4 heads while k has 2.
    let v4 = save(
        dir.path(),
        "v4.npy",
        &random_normal(&mut rng, DType::F32, vec![1, 8, 4, 16]).expect("host dtype"),
    );
    let err = run(&q, &k, &v4);
    assert!(
        err.contains("shape mismatch") && err.contains("k has 2 heads but v has 4"),
        "{err}"
    );

    // 4 query heads over 3 KV heads: softmax-core's typed error surfaces with its text.
    let k3 = save(
        dir.path(),
        "k3.npy",
        &random_normal(&mut rng, DType::F32, vec![1, 8, 3, 16]).expect("host dtype"),
    );
    let v3 = save(
        dir.path(),
        "v3.npy",
        &random_normal(&mut rng, DType::F32, vec![1, 8, 3, 16]).expect("host dtype"),
    );
    let err = run(&q, &k3, &v3);
    assert!(
        err.contains("heads_q = 4 is not a multiple of heads_kv = 3"),
        "{err}"
    );

    // Mixed dtypes.
    let kb = save(
        dir.path(),
        "kb.npy",
        &random_normal(&mut rng, DType::Bf16, vec![1, 8, 2, 16]).expect("host dtype"),
    );
    let err = run(&q, &kb, &v);
    assert!(err.contains("share one dtype"), "{err}");

    // Rank 2.
    let flat = save(
        dir.path(),
        "flat.npy",
        &random_normal(&mut rng, DType::F32, vec![8, 64]).expect("host dtype"),
    );
    let err = run(&flat, &k, &v);
    assert!(
        err.contains("expected [batch, seqlen, heads, head_dim]"),
        "{err}"
    );

    // A safetensors file without the tensor.
    let st = dir.path().join("two.safetensors");
    write_tensors(
        &st,
        FileFormat::Safetensors,
        &[("a", &inp.k), ("b", &inp.v)],
    )
    .unwrap();
    let err = run(&q, &st, &v);
    assert!(
        err.contains("no tensor named 'k' (the file holds: a, b)"),
        "{err}"
    );
}

#[test]
fn cuda_backend_without_device_is_an_error_not_a_panic() {
    let o = fa(&["demo", "--backend", "cuda", "--seqlen", "16"]);
    let (_, err) = text(&o);
    // Either a device is there and it runs, or the error says why.
    if !o.status.success() {
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(err.starts_with("error: backend"), "{err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

#[test]
fn plan_prints_the_lesson_numbers() {
    let o = fa(&["plan"]);
    assert!(o.status.success());
    let (out, _) = text(&o);
    for needle in [
        "GQA-8",
        "40 GiB",
        "42,949,672,960",
        "320 GiB",
        "5 GiB",
        "128 GiB",
        "3 TiB",
    ] {
        assert!(out.contains(needle), "missing {needle} in\n{out}");
    }
    // Free parameters: 32 layers × 8 KV heads × 128 × 8192 tokens × 2 bytes × 2 = 1 GiB.
    let o = fa(&[
        "plan",
        "--layers",
        "32",
        "--heads",
        "32",
        "--heads-kv",
        "8",
        "--head-dim",
        "128",
        "--tokens",
        "8192",
    ]);
    let (out, _) = text(&o);
    assert!(out.contains("GQA-8") && out.contains(" 1 GiB"), "{out}");
    let o = fa(&["plan", "--preset", "gpt-9"]);
    assert_eq!(o.status.code(), Some(2));
}

/// The number before `unit` in the first line of `out` containing `key` (after it).
fn number_after(out: &str, key: &str, unit: &str) -> f64 {
    let line = out
        .lines()
        .find(|l| l.contains(key))
        .unwrap_or_else(|| panic!("no line with {key} in\n{out}"));
    let rest = &line[line.find(key).unwrap() + key.len()..];
    let field = rest
        .split(unit)
        .next()
        .unwrap()
        .split_whitespace()
        .last()
        .unwrap_or_else(|| panic!("nothing before {unit} in {line}"));
    field
        .parse()
        .unwrap_or_else(|_| panic!("'{field}' is not a number in {line}"))
}

#[test]
fn plan_decode_prints_the_bound_and_a_cpu_measurement() {
    // 2 layers × batch 2 × 256 tokens × 2 KV heads × 32 × 2 bytes × 2 (K and V) = 256 KiB.
    let shape = [
        "plan",
        "--decode",
        "--layers",
        "2",
        "--heads",
        "4",
        "--heads-kv",
        "2",
        "--head-dim",
        "32",
        "--tokens",
        "256",
        "--batch",
        "2",
        "--threads",
        "1",
        "--bandwidth",
        "100",
    ];
    let mut args = shape.to_vec();
    args.extend(["--backend", "cpu", "--measure"]);
    let o = fa(&args);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    assert!(
        out.contains("KV cache per sequence:") && out.contains("128 KiB"),
        "{out}"
    );
    assert!(
        out.contains("KV cache, batch 2:") && out.contains("262,144"),
        "{out}"
    );
    // The bound at the given 100 GB/s: 262,144 bytes / 1e11 B/s = 2.621 µs.
    assert!(out.contains("given (--bandwidth)"), "{out}");
    assert!(
        (number_after(&out, "given (--bandwidth)", "µs") - 2.621).abs() < 1e-3,
        "{out}"
    );
    assert!(
        number_after(&out, "H200 HBM3e, specification", "µs") > 0.0,
        "{out}"
    );
    let host = number_after(&out, "this host's copy, measured now (threads: 1)", "µs");
    assert!(host > 0.0, "{out}");
    let layer = out
        .lines()
        .find(|l| l.contains("measured on cpu"))
        .unwrap_or_else(|| panic!("no measured line in\n{out}"));
    assert!(
        layer.contains(", bf16") && layer.contains("x 2 layers"),
        "{layer}"
    );
    let gbps = number_after(&out, "measured on cpu", "GB/s");
    assert!(gbps > 0.0, "{out}");
    let fraction = number_after(&out, "fraction of the bound:", "(");
    assert!(fraction > 0.0 && fraction.is_finite(), "{out}");
    assert!(
        out.contains("note: GPU figure absent: --backend cpu"),
        "{out}"
    );

    // Auto without --measure: a CUDA device is timed; without one, the note says so.
    let o = fa(&shape);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    assert!(
        out.contains("measured on cuda")
            || (out.contains("note: GPU figure absent: no CUDA device opened")
                && out.contains("no measured figure: --measure")),
        "{out}"
    );

    // Sizes past 128 bits are errors, not panics; so is measuring a cache past the memory;
    // --bandwidth must be positive.
    let o = fa(&[
        "plan",
        "--decode",
        "--tokens",
        "18446744073709551615",
        "--batch",
        "4294967296",
        "--layers",
        "18446744073709551615",
    ]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("too large: the KV cache") && !err.contains("panicked"),
        "{err}"
    );
    let o = fa(&[
        "plan",
        "--decode",
        "--backend",
        "cpu",
        "--measure",
        "--tokens",
        "4294967296",
        "--batch",
        "65536",
    ]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("too large") && !err.contains("panicked"),
        "{err}"
    );
    let o = fa(&["plan", "--decode", "--bandwidth", "0"]);
    assert_eq!(o.status.code(), Some(2));
    let o = fa(&["plan", "--measure"]);
    assert_eq!(o.status.code(), Some(2), "--measure requires --decode");
}

#[test]
fn bench_json_lines_have_the_documented_keys() {
    let o = fa(&[
        "bench",
        "--seqlen",
        "64,96",
        "--heads",
        "2",
        "--head-dim",
        "32",
        "--iters",
        "2",
        "--warmup",
        "0",
        "--json",
        "--causal",
        "--dtype",
        "bf16",
        "--threads",
        "1",
    ]);
    assert!(o.status.success(), "{:?}", text(&o));
    let (out, _) = text(&o);
    let lines: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2);
    for (l, n) in lines.iter().zip([64u64, 96]) {
        for key in [
            "backend",
            "dtype",
            "batch",
            "heads",
            "seqlen_q",
            "seqlen_k",
            "head_dim",
            "causal",
            "threads",
            "time_ms_median",
            "gflops",
            "peak_rss_bytes",
        ] {
            assert!(l.get(key).is_some(), "missing {key} in {l}");
        }
        assert_eq!(l["seqlen_q"], n);
        assert_eq!(l["dtype"], "bf16");
        assert_eq!(l["threads"], 1);
        assert_eq!(l["causal"], true);
        assert!(l["gflops"].as_f64().unwrap() > 0.0);
    }
}

#[test]
fn verify_and_demo_pass_on_small_problems() {
    let o = fa(&["verify", "--random", "3", "--seed", "5", "--backend", "cpu"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    assert!(out.contains("pass") && !out.contains("FAIL"), "{out}");
    // Masks print as --window takes them (the decode rows printed window(Some(100),Some(0))).
    assert!(out.contains("window(100,0)"), "{out}");
    assert!(!out.contains("Some(") && !out.contains("None"), "{out}");
    let o = fa(&[
        "demo",
        "--seqlen",
        "300",
        "--heads",
        "4",
        "--heads-kv",
        "2",
        "--head-dim",
        "64",
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    assert!(
        out.contains("pass") && out.contains("naive attention"),
        "{out}"
    );
}

#[test]
fn exp2_error_subcommand_still_exists() {
    let o = fa(&["exp2-error", "--help"]);
    assert!(o.status.success());
}

#[test]
fn bench_peers_prints_ratios_for_matching_shapes() {
    let dir = tempfile::tempdir().unwrap();
    let peers = dir.path().join("peers.json");
    // torch_sdpa.py --json writes an array; keys it adds beyond ours are ignored.
    std::fs::write(
        &peers,
        r#"[
 {"hdim": 32, "seqlen": 64, "batch": 1, "heads": 2, "causal": false,
  "flash_fwd_tflops": 1.5, "cudnn_fwd_tflops": 2.5, "efficient_fwd_tflops": 1.0},
 {"hdim": 32, "seqlen": 64, "batch": 1, "heads": 2, "causal": true,
  "flash_fwd_tflops": 9.0, "cudnn_error": "no kernel"}
]"#,
    )
    .unwrap();
    let args = |json: bool| {
        let mut v = vec![
            "bench",
            "--backend",
            "cpu",
            "--seqlen",
            "64,96",
            "--heads",
            "2",
            "--head-dim",
            "32",
            "--iters",
            "1",
            "--warmup",
            "0",
            "--threads",
            "1",
            "--peers",
            s(&peers),
        ];
        if json {
            v.push("--json");
        }
        fa(&v)
    };
    let o = args(true);
    assert!(o.status.success(), "{:?}", text(&o));
    let (out, _) = text(&o);
    let lines: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2);
    let tflops = lines[0]["gflops"].as_f64().unwrap() / 1e3;
    assert_eq!(lines[0]["peer_flash_tflops"], 1.5);
    assert_eq!(lines[0]["peer_cudnn_tflops"], 2.5);
    let vs_flash = lines[0]["vs_flash"].as_f64().unwrap();
    assert!((vs_flash - tflops / 1.5).abs() <= 1e-12 * vs_flash.abs().max(1.0));
    // seqlen 96 has no peer row: the ratio fields are there, empty.
    assert!(lines[1]["peer_flash_tflops"].is_null(), "{}", lines[1]);
    assert!(lines[1]["vs_cudnn"].is_null(), "{}", lines[1]);

    let o = args(false);
    assert!(o.status.success(), "{:?}", text(&o));
    let (out, _) = text(&o);
    let summary: Vec<&str> = out
        .lines()
        .skip_while(|l| !l.starts_with("summary"))
        .skip(1)
        .collect();
    assert_eq!(summary.len(), 2, "{out}");
    let cols: Vec<&str> = summary[0].split_whitespace().collect();
    // hdim seqlen batch heads causal median_ms TFLOP/s flash cudnn /flash /cudnn tiles
    assert_eq!(&cols[..5], ["32", "64", "1", "2", "false"], "{out}");
    assert_eq!(&cols[7..9], ["1.5", "2.5"], "{out}");
    assert_eq!(cols[11], "default");
    let cols: Vec<&str> = summary[1].split_whitespace().collect();
    assert_eq!(&cols[7..11], ["-", "-", "-", "-"], "{out}");

    // A missing peers file only warns (the GPU session runs on when PyTorch failed).
    let o = fa(&[
        "bench",
        "--backend",
        "cpu",
        "--seqlen",
        "64",
        "--heads",
        "1",
        "--head-dim",
        "16",
        "--iters",
        "1",
        "--warmup",
        "0",
        "--peers",
        "/nonexistent/peers.json",
    ]);
    assert!(o.status.success(), "{:?}", text(&o));
    assert!(text(&o).1.contains("no peer numbers"), "{:?}", text(&o));
}

// ---- issue 16: robustness regressions -------------------------------------------------------

/// `fa` with a wall-clock limit: killed (and the test failed by the caller's asserts) when it
/// runs past `secs`, so that a regression to an unbounded read or a hang cannot stall the suite.
fn fa_limited(args: &[&str], secs: u64) -> (Option<i32>, String, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_fa"))
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("the fa binary runs");
    let start = std::time::Instant::now();
    while child.try_wait().expect("wait").is_none() {
        if start.elapsed().as_secs() >= secs {
            let _ = child.kill();
            let o = child.wait_with_output().expect("output");
            return (None, text(&o).0, text(&o).1);
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let o = child.wait_with_output().expect("output");
    let (out, err) = text(&o);
    (o.status.code(), out, err)
}

/// Item 1: an output that is (or resolves to) an input is refused before anything is written.
/// Fails on 69660dd: `-o q.npy` exits 0 and q.npy holds O.
#[test]
fn output_that_is_an_input_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng::new(16);
    let inp = inputs(&mut rng, DType::F32, [1, 8, 2, 16], [1, 8, 2, 16]);
    let qkv = save_npy(dir.path(), &inp);
    let before: Vec<Vec<u8>> = qkv.iter().map(|p| std::fs::read(p).unwrap()).collect();
    std::fs::create_dir(dir.path().join("sub")).unwrap();
    let dotdot = dir.path().join("sub").join("..").join("k.npy");
    let hard = dir.path().join("hard.npy");
    std::fs::hard_link(&qkv[2], &hard).unwrap();
    let mut cases: Vec<(PathBuf, Vec<&str>)> = vec![
        (qkv[0].clone(), vec![]),
        (dir.path().join("o.npy"), vec!["--lse", s(&qkv[0])]),
        (dotdot.clone(), vec![]),
        (hard.clone(), vec![]),
    ];
    #[cfg(unix)]
    {
        let link = dir.path().join("link.npy");
        std::os::unix::fs::symlink(&qkv[1], &link).unwrap();
        cases.push((link, vec![]));
    }
    for (out, extra) in &cases {
        let o = fa_run(&qkv, out, extra);
        let (_, err) = text(&o);
        assert_eq!(o.status.code(), Some(2), "{out:?} {extra:?}: {err}");
        assert!(err.contains("same file as the input"), "{err}");
        for (p, b) in qkv.iter().zip(&before) {
            assert_eq!(&std::fs::read(p).unwrap(), b, "{p:?} unchanged");
        }
    }
    // -o and --lse naming one .npy file through `..`: refused, nothing written.
    let out = dir.path().join("out.npy");
    let lse = dir.path().join("sub").join("..").join("out.npy");
    let o = fa_run(&qkv, &out, &["--lse", s(&lse)]);
    assert_eq!(o.status.code(), Some(2), "{:?}", text(&o));
    assert!(text(&o).1.contains("same file"), "{:?}", text(&o));
    assert!(!out.exists());
}

/// Item 2: writes are all or nothing. Fails on 69660dd: out.npy is replaced before the LSE's
/// write fails.
#[test]
fn failed_write_leaves_existing_output_unchanged() {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng::new(17);
    let inp = inputs(&mut rng, DType::F32, [1, 8, 2, 16], [1, 8, 2, 16]);
    let qkv = save_npy(dir.path(), &inp);
    let out = dir.path().join("out.npy");
    std::fs::write(&out, b"the user's previous output").unwrap();
    let lse = dir.path().join("nodir").join("l.npy");
    let o = fa_run(&qkv, &out, &["--lse", s(&lse)]);
    let (_, err) = text(&o);
    assert_ne!(o.status.code(), Some(0), "{err}");
    assert!(err.contains("does not exist"), "{err}");
    assert_eq!(std::fs::read(&out).unwrap(), b"the user's previous output");
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains("fa-tmp"))
        .collect();
    assert!(
        leftovers.is_empty(),
        "temporary files removed: {leftovers:?}"
    );
    // And a run that succeeds replaces it with O.
    let o = fa_run(&qkv, &out, &[]);
    assert!(o.status.success(), "{:?}", text(&o));
    assert_eq!(read_tensor(&out, "out").unwrap().0.shape, vec![1, 8, 2, 16]);
}

/// Item 3: inputs that are not regular files, or whose size is not their header's, are errors
/// read from the header alone. Fails on 69660dd: `--q /dev/zero` reads until memory runs out
/// (killed here after 30 s).
#[test]
fn inputs_not_regular_or_not_their_headers_size_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng::new(18);
    let inp = inputs(&mut rng, DType::F32, [1, 8, 2, 16], [1, 8, 2, 16]);
    let [q, k, v] = save_npy(dir.path(), &inp);
    let out = dir.path().join("out.npy");
    let run = |q: &Path| {
        let args = [
            "run",
            "--q",
            s(q),
            "--k",
            s(&k),
            "--v",
            s(&v),
            "-o",
            s(&out),
        ];
        fa_limited(&args, 30)
    };
    if Path::new("/dev/zero").exists() {
        let (code, _, err) = run(Path::new("/dev/zero"));
        assert_eq!(code, Some(2), "{err}");
        assert!(err.contains("not a regular file"), "{err}");
    }
    let (code, _, err) = run(dir.path());
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("not a regular file"), "{err}");
    // Longer than the header promises.
    let mut bytes = std::fs::read(&q).unwrap();
    bytes.extend_from_slice(&[0; 64]);
    let long = dir.path().join("long.npy");
    std::fs::write(&long, &bytes).unwrap();
    let (code, _, err) = run(&long);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("data section holds"), "{err}");
    // A safetensors header promising far more data than the file holds.
    let st = dir.path().join("q.safetensors");
    write_tensors(&st, FileFormat::Safetensors, &[("q", &inp.q)]).unwrap();
    let mut bytes = std::fs::read(&st).unwrap();
    bytes.truncate(bytes.len() - 100);
    std::fs::write(&st, &bytes).unwrap();
    let (code, _, err) = run(&st);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("header promises"), "{err}");
    // A safetensors header length beyond the file.
    let bad = dir.path().join("bad.safetensors");
    let mut bytes = u64::MAX.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}");
    std::fs::write(&bad, &bytes).unwrap();
    let (code, _, err) = run(&bad);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("exceeds the file"), "{err}");
    // A header length shorter than the bytes that follow the length (found by the fuzz target
    // safetensors_reader on its first run: the reader subtracted past zero and panicked).
    let short = dir.path().join("short.safetensors");
    let mut bytes = 0u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(&[0xff, 0x25]);
    std::fs::write(&short, &bytes).unwrap();
    let (code, _, err) = run(&short);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("nor a valid .safetensors file"), "{err}");
    assert!(!out.exists());
}

/// Item 3: absurd sizes are a typed "too large" error before any allocation, and --threads
/// beyond the machine is a usage error. Fails on 69660dd: demo and bench abort (exit 134) with
/// "memory allocation of … bytes failed"; --threads 100000 is accepted.
#[test]
fn absurd_sizes_and_threads_are_clear_errors() {
    for args in [
        &["demo", "--backend", "cpu", "--seqlen", "100000000"][..],
        &[
            "bench",
            "--backend",
            "cpu",
            "--seqlen",
            "100000000",
            "--iters",
            "1",
            "--warmup",
            "0",
        ][..],
        &[
            "bench",
            "--backend",
            "cpu",
            "--seqlen",
            "4611686018427387904",
            "--batch",
            "64",
        ][..],
    ] {
        let (code, _, err) = fa_limited(args, 60);
        assert_eq!(code, Some(2), "{args:?}: {err}");
        assert!(err.contains("too large"), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    let (code, _, err) = fa_limited(
        &[
            "demo",
            "--backend",
            "cpu",
            "--seqlen",
            "16",
            "--threads",
            "100000",
        ],
        60,
    );
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("available parallelism"), "{err}");
    let (code, _, err) = fa_limited(&["demo", "--seqlen", "16", "--threads", "0"], 60);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("at least 1"), "{err}");
}

/// Item 3 and 5: `fa verify` draws its cases lazily (the first rows appear at once even for
/// --random 3000000) and prints one seed. Fails on 69660dd: every case is built before the
/// first row (nothing printed within the limit) and two different seeds are printed.
#[test]
fn verify_streams_its_cases_and_prints_one_seed() {
    let (code, out, err) = fa_limited(
        &[
            "verify",
            "--backend",
            "cpu",
            "--dtype",
            "f32",
            "--random",
            "3000000",
        ],
        20,
    );
    assert_eq!(code, None, "still running when stopped: {out}{err}");
    let rows = out.lines().filter(|l| l.contains("pass")).count();
    assert!(rows >= 1, "rows printed as the cases run: {out}\n{err}");
    assert_eq!(
        (out + &err).matches("seed").count(),
        1,
        "one seed, the one --seed reproduces"
    );
}

/// Item 4: --check-rows fails the exit code when a row does not match, NaN rows included.
/// Fails on 69660dd: `--softcap 1e-39` exits 0 with "rel_l2 NaN". The library may reject the
/// setting (exit 2) or compute it exactly (then the check passes and O has no NaN).
#[test]
fn check_rows_mismatch_is_a_failure() {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng::new(19);
    let inp = inputs(&mut rng, DType::F32, [1, 16, 2, 16], [1, 16, 2, 16]);
    let qkv = save_npy(dir.path(), &inp);
    let out = dir.path().join("out.npy");
    for extra in [
        &["--softcap", "1e-39", "--check-rows", "8"][..],
        &["--scale", "1e38", "--check-rows", "8"][..],
    ] {
        let o = fa_run(&qkv, &out, extra);
        let (_, err) = text(&o);
        assert!(!err.contains("panicked"), "{err}");
        if o.status.success() {
            assert!(err.contains(": pass"), "{extra:?}: {err}");
            let (o_t, _) = read_tensor(&out, "out").unwrap();
            assert!(o_t.to_f32().iter().all(|x| !x.is_nan()), "{extra:?}");
        } else {
            assert!(matches!(o.status.code(), Some(1 | 2)), "{err}");
            assert!(err.contains("FAIL") || err.starts_with("error:"), "{err}");
        }
    }
}

/// Item 5: the smaller ones.
/// Fails on 69660dd: plan overflows (panics in this debug build), `fa plan` into a closed pipe
/// panics, `--check-rows 0` prints "pass", `--check-rows` beyond the rows is not clamped,
/// `--seqlen 0` prints "infx", `--window -5,3` is accepted.
#[test]
fn smaller_robustness_cases() {
    let o = fa(&[
        "plan",
        "--tokens",
        "18446744073709551615",
        "--batch",
        "4294967296",
    ]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("too large"), "{err}");

    // A closed pipe: the reader is gone before fa writes anything.
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let o = Command::new(env!("CARGO_BIN_EXE_fa"))
        .arg("plan")
        .stdout(writer)
        .stderr(std::process::Stdio::piped())
        .output()
        .unwrap();
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert!(err.is_empty(), "quiet: {err}");

    let demo = |extra: &[&str]| {
        let mut args = vec![
            "demo",
            "--backend",
            "cpu",
            "--seqlen",
            "32",
            "--heads",
            "2",
            "--head-dim",
            "16",
        ];
        args.extend_from_slice(extra);
        fa(&args)
    };
    let o = demo(&["--check-rows", "0"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}{err}");
    assert!(
        out.contains("not checked") && !out.contains("pass"),
        "{out}"
    );
    let o = demo(&["--check-rows", "1000000"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}{err}");
    assert!(
        out.contains("64 sampled rows (clamped from 1000000"),
        "{out}"
    );
    let o = fa(&["demo", "--backend", "cpu", "--seqlen", "0"]);
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{out}{err}");
    assert!(
        err.contains("--seqlen must be at least 1") && !out.contains("inf"),
        "{err}"
    );

    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng::new(20);
    let inp = inputs(&mut rng, DType::F32, [1, 8, 2, 16], [1, 8, 2, 16]);
    let qkv = save_npy(dir.path(), &inp);
    let out = dir.path().join("out.npy");
    let o = fa_run(&qkv, &out, &["--window", "-5,3"]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("-1 for unbounded"), "{err}");
    assert!(!out.exists());
    let o = fa_run(&qkv, &out, &["--window", "-1,3", "--check-rows", "100"]);
    let (_, err) = text(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("16 rows (clamped from 100") && err.contains("pass"),
        "{err}"
    );
}

/// Saves a decode case's tensors (f32) and tables; returns [q, k, v], seqused_k, block_table.
fn save_decode(dir: &Path, case: &fa_reference::DecodeCase) -> ([PathBuf; 3], PathBuf, PathBuf) {
    use fa_reference::CacheLayout;
    let (outer, rows) = match case.layout {
        CacheLayout::Padded { capacity } => (case.batch, capacity),
        CacheLayout::Paged {
            block_size,
            num_blocks,
            ..
        } => (num_blocks, block_size),
    };
    let tensor = |shape: Vec<usize>, data: &[f32]| HostTensor {
        shape,
        data: Data::F32(data.to_vec()),
    };
    let q = tensor(
        vec![case.batch, case.seqlen_q, case.heads_q, case.head_dim],
        &case.q,
    );
    let kv_shape = vec![outer, rows, case.heads_kv, case.head_dim];
    let qkv = [
        save(dir, "q.npy", &q),
        save(dir, "k.npy", &tensor(kv_shape.clone(), &case.k)),
        save(dir, "v.npy", &tensor(kv_shape, &case.v)),
    ];
    let lens: Vec<i32> = case.seqused_k.iter().map(|&l| l as i32).collect();
    let lens_path = dir.join("lens.npy");
    std::fs::write(&lens_path, fa_cli::npy::write_npy_i32(&[case.batch], &lens)).unwrap();
    let table_path = dir.join("table.npy");
    if let CacheLayout::Paged { blocks_per_seq, .. } = case.layout {
        let bytes = fa_cli::npy::write_npy_i32(&[case.batch, blocks_per_seq], &case.block_table);
        std::fs::write(&table_path, bytes).unwrap();
    }
    (qkv, lens_path, table_path)
}

#[test]
fn run_decode_over_padded_and_paged_caches_matches_the_oracle() {
    use fa_reference::{CacheLayout, DecodeCase, Rounding};
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng::new(15);
    let used = [300u32, 0, 1, 77];
    for layout in [
        CacheLayout::Padded { capacity: 301 },
        DecodeCase::paged_layout(&used, 16),
        DecodeCase::paged_layout(&used, 3),
    ] {
        let case = DecodeCase::new(&mut rng, &used, 2, 8, 2, 64, layout, Rounding::F32).causal();
        let (qkv, lens, table) = save_decode(dir.path(), &case);
        let out = dir.path().join("out.npy");
        let lse = dir.path().join("lse.npy");
        let paged = matches!(layout, CacheLayout::Paged { .. });
        for splits in ["1", "3"] {
            let mut extra = vec![
                "--seqused-k",
                s(&lens),
                "--causal",
                "--backend",
                "cpu",
                "--splits",
                splits,
                "--check-rows",
                "16",
                "--lse",
                s(&lse),
            ];
            if paged {
                extra.extend_from_slice(&["--block-table", s(&table)]);
            }
            let o = fa_run(&qkv, &out, &extra);
            assert!(o.status.success(), "{layout:?}: {:?}", text(&o));
            let (got, _) = read_tensor(&out, "out").unwrap();
            let (got_lse, _) = read_tensor(&lse, "lse").unwrap();
            assert_eq!(got.shape, vec![4, 2, 8, 64]);
            let p = case.desc().validate(256).unwrap();
            let oracle = fa_reference::attention_f64(&p, &case.q, &case.k, &case.v);
            let report = fa_reference::compare(&p, &got.to_f32(), Some(&got_lse.to_f32()), &oracle);
            assert!(
                report.within(1e-5, 1e-4),
                "{layout:?} splits {splits}: {report:?}"
            );
        }
    }
}

#[test]
fn run_decode_bad_tables_are_clear_errors() {
    use fa_reference::{DecodeCase, Rounding};
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng::new(16);
    let used = [20u32, 5];
    let layout = DecodeCase::paged_layout(&used, 16);
    let mut case = DecodeCase::new(&mut rng, &used, 1, 4, 2, 32, layout, Rounding::F32);
    case.block_table[0] = 1000;
    let (qkv, lens, table) = save_decode(dir.path(), &case);
    let out = dir.path().join("out.npy");
    let o = fa_run(
        &qkv,
        &out,
        &["--seqused-k", s(&lens), "--block-table", s(&table)],
    );
    let (_, err) = text(&o);
    assert!(!o.status.success() && err.contains("block"), "{err}");
    assert!(!out.exists(), "no output on error");
    // A block table without lengths, lengths for the wrong batch.
    let o = fa_run(&qkv, &out, &["--block-table", s(&table)]);
    assert!(!o.status.success());
    let short = dir.path().join("short.npy");
    std::fs::write(&short, fa_cli::npy::write_npy_i32(&[1], &[3])).unwrap();
    let o = fa_run(
        &qkv,
        &out,
        &["--seqused-k", s(&short), "--block-table", s(&table)],
    );
    let (_, err) = text(&o);
    assert!(!o.status.success() && err.contains("seqused-k"), "{err}");
    assert!(!out.exists(), "no output on error");
}

#[test]
fn bench_decode_json_lines_have_the_documented_keys() {
    let o = fa(&[
        "bench",
        "--decode",
        "--backend",
        "cpu",
        "--batch",
        "1",
        "--cache-len",
        "300",
        "--heads",
        "4",
        "--heads-kv",
        "1",
        "--head-dim",
        "32",
        "--page-size",
        "0,7",
        "--iters",
        "2",
        "--json",
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    let lines: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect();
    assert_eq!(lines.len(), 2);
    for (line, page) in lines.iter().zip([0, 7]) {
        for key in [
            "time_ms_median",
            "kv_gbps",
            "copy_gbps",
            "fraction_of_copy",
            "read_gbps",
            "fraction_of_read",
            "kv_splits",
        ] {
            assert!(line.get(key).is_some(), "{key} missing: {line}");
        }
        assert_eq!(line["page_size"], page);
        assert!(line["kv_gbps"].as_f64().unwrap() > 0.0);
    }
    // --decode does not mix with the forward sweep's flags.
    let o = fa(&["bench", "--decode", "--paper"]);
    assert!(!o.status.success());
}

/// Whether this process runs as root (`id -u` is 0): device nodes can then be made.
fn running_as_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

/// Issue 50, item 1: an output that exists and is not a regular file (a FIFO, a device) is
/// written through, never replaced by a regular file; a missing directory is named as such.
/// Fails on 4cfb28b: the FIFO and the device node are renamed over (replaced by regular files)
/// and the reader never sees a byte.
#[test]
fn outputs_that_are_fifos_or_devices_are_written_through() {
    use std::os::unix::fs::FileTypeExt;
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng::new(50);
    let inp = inputs(&mut rng, DType::F32, [1, 8, 2, 16], [1, 8, 2, 16]);
    let qkv = save_npy(dir.path(), &inp);

    // A FIFO: a reader thread drains it while fa writes O through it.
    let fifo = dir.path().join("o.fifo");
    let made = Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .expect("mkfifo runs");
    assert!(made.success(), "mkfifo {fifo:?}");
    let (tx, rx) = std::sync::mpsc::channel();
    let reader_path = fifo.clone();
    // If fa never opens the FIFO (the old code renamed a file over it), this thread stays
    // blocked in open(); the receive below times out and the test fails without hanging.
    std::thread::spawn(move || {
        let mut bytes = Vec::new();
        let r = std::fs::File::open(&reader_path)
            .and_then(|mut f| std::io::Read::read_to_end(&mut f, &mut bytes));
        let _ = tx.send(r.map(|_| bytes));
    });
    let o = fa_run(&qkv, &fifo, &["--backend", "cpu"]);
    assert!(o.status.success(), "{:?}", text(&o));
    let kind = std::fs::metadata(&fifo).unwrap().file_type();
    assert!(kind.is_fifo(), "the FIFO is still a FIFO: {kind:?}");
    let bytes = rx
        .recv_timeout(std::time::Duration::from_secs(30))
        .expect("the reader got the output through the FIFO")
        .unwrap();
    let got = fa_cli::npy::read_npy(&bytes).expect("a valid .npy came through the FIFO");
    assert_eq!(got.shape, vec![1, 8, 2, 16]);
    let desc = softmax_core::ProblemDesc::new(1, 8, 8, 2, 2, 16);
    assert_eq!(got.data, cpu_forward(&inp, &desc).0, "O itself");

    // A missing directory is named as such, with or without a file name after it (on
    // 4cfb28b `-o missing_dir/` said "Not a directory (os error 20)").
    let missing = dir.path().join("missing_dir").join("out.npy");
    let o = fa_run(&qkv, &missing, &[]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("missing_dir does not exist") && !err.contains("Not a directory"),
        "{err}"
    );
    let missing = format!("{}/", dir.path().join("missing_dir").display());
    let o = fa_run(&qkv, Path::new(&missing), &[]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("names a directory (which does not exist)")
            && !err.contains("Not a directory"),
        "{err}"
    );
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains("fa-tmp"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    // A path through a regular file: that file is not a directory.
    let through = qkv[0].join("out.npy");
    let o = fa_run(&qkv, &through, &[]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("q.npy is not a directory"), "{err}");

    // A character device (a null device of our own, never the system's /dev/null).
    if !running_as_root() {
        println!(
            "outputs_that_are_fifos_or_devices_are_written_through: the device-node part did \
             not run: making a device node (mknod) needs root, and this test does not run as root"
        );
        return;
    }
    let null = dir.path().join("null");
    let made = Command::new("mknod")
        .arg(&null)
        .args(["c", "1", "3"])
        .status()
        .expect("mknod runs");
    assert!(made.success(), "mknod {null:?} c 1 3 as root");
    // Every output on the device: O, the LSE and the three gradients, one after the other.
    let d_o = save(dir.path(), "dout.npy", &inp.q);
    let o = fa_run(
        &qkv,
        &null,
        &[
            "--backend",
            "cpu",
            "--lse",
            s(&null),
            "--dout",
            s(&d_o),
            "--dq",
            s(&null),
            "--dk",
            s(&null),
            "--dv",
            s(&null),
        ],
    );
    assert!(o.status.success(), "{:?}", text(&o));
    let kind = std::fs::metadata(&null).unwrap().file_type();
    assert!(kind.is_char_device(), "still a device node: {kind:?}");
    // Inputs are still refused as outputs, device or not.
    let o = fa_run(&qkv, &qkv[0], &["--lse", s(&null)]);
    assert_eq!(o.status.code(), Some(2), "{:?}", text(&o));
    assert!(
        text(&o).1.contains("same file as the input"),
        "{:?}",
        text(&o)
    );
}

/// Issue 50, items 2 and 3: negative numbers reach validation and get its message (clap took
/// them for flags: "unexpected argument"), softcap 0 is no softcap, scale 0 and thread counts
/// below 1 are refused, `fa plan --threads 0` included. Fails on 4cfb28b.
#[test]
fn negative_and_zero_arguments_get_the_validation_message() {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng::new(51);
    let inp = inputs(&mut rng, DType::F32, [1, 8, 2, 16], [1, 8, 2, 16]);
    let qkv = save_npy(dir.path(), &inp);
    let out = dir.path().join("out.npy");
    for (extra, words) in [
        (
            &["--softcap", "-3"][..],
            "softcap = -3 must be finite and positive",
        ),
        (
            &["--softcap", "inf"][..],
            "softcap = inf must be finite and positive",
        ),
        (&["--scale", "0"][..], "softmax_scale = 0 is not accepted"),
        (
            &["--threads", "-1"][..],
            "threads = -1: a thread count is at least 1",
        ),
        (&["--threads", "0"][..], "at least 1"),
        (
            &["--window", "-5,0"][..],
            "window left = -5: use -1 for unbounded",
        ),
        (&["--window", "3,-2"][..], "window right = -2"),
    ] {
        let o = fa_run(&qkv, &out, extra);
        let (_, err) = text(&o);
        assert_eq!(o.status.code(), Some(2), "{extra:?}: {err}");
        assert!(err.contains(words), "{extra:?}: {err}");
        assert!(!err.contains("unexpected argument"), "{extra:?}: {err}");
        assert!(!out.exists(), "{extra:?}: nothing written");
    }
    // A negative scale is a scale: it runs, and equals fa-cpu with that scale.
    let o = fa_run(&qkv, &out, &["--scale", "-1", "--backend", "cpu"]);
    assert!(o.status.success(), "{:?}", text(&o));
    let desc = softmax_core::ProblemDesc::new(1, 8, 8, 2, 2, 16).scale(-1.0);
    assert_eq!(
        read_tensor(&out, "out").unwrap().0.data,
        cpu_forward(&inp, &desc).0
    );
    // Softcap 0 is no softcap.
    let o = fa_run(&qkv, &out, &["--softcap", "0", "--backend", "cpu"]);
    assert!(o.status.success(), "{:?}", text(&o));
    let desc = softmax_core::ProblemDesc::new(1, 8, 8, 2, 2, 16);
    assert_eq!(
        read_tensor(&out, "out").unwrap().0.data,
        cpu_forward(&inp, &desc).0
    );

    for threads in ["0", "-2"] {
        let o = fa(&["plan", "--threads", threads]);
        let (out, err) = text(&o);
        assert_eq!(
            o.status.code(),
            Some(2),
            "plan --threads {threads}: {out}{err}"
        );
        assert!(err.contains("at least 1"), "{err}");
        assert!(!err.contains("unexpected argument"), "{err}");
    }
    let o = fa(&["plan", "--threads", "3"]);
    assert!(o.status.success(), "{:?}", text(&o));
}

/// Issue 50, item 4: a problem with no queries runs as through the C ABI: an empty output and
/// LSE are written. Fails on 4cfb28b: "batch stride = 0 makes elements overlap".
#[test]
fn empty_query_problems_write_empty_outputs() {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng::new(52);
    let inp = inputs(&mut rng, DType::F32, [2, 0, 4, 16], [2, 7, 2, 16]);
    let qkv = save_npy(dir.path(), &inp);
    let out = dir.path().join("out.npy");
    let lse = dir.path().join("lse.npy");
    let o = fa_run(
        &qkv,
        &out,
        &[
            "--lse",
            s(&lse),
            "--causal",
            "--backend",
            "cpu",
            "--check-rows",
            "4",
        ],
    );
    assert!(o.status.success(), "{:?}", text(&o));
    let (got, _) = read_tensor(&out, "out").unwrap();
    assert_eq!(got.shape, vec![2, 0, 4, 16]);
    assert_eq!(got.to_f32().len(), 0);
    assert_eq!(read_tensor(&lse, "lse").unwrap().0.shape, vec![2, 4, 0]);
}

/// Issue 50, item 5: a float32 `--seqused-k` / `--block-table` file is told to become int32.
/// Fails on 4cfb28b: the advice was `.astype(np.float32)`.
#[test]
fn float_index_files_are_told_to_become_int32() {
    use fa_reference::{DecodeCase, Rounding};
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng::new(53);
    let used = [20u32, 5];
    let layout = DecodeCase::paged_layout(&used, 16);
    let case = DecodeCase::new(&mut rng, &used, 1, 4, 2, 32, layout, Rounding::F32);
    let (qkv, lens, _) = save_decode(dir.path(), &case);
    let float_lens = save(
        dir.path(),
        "flens.npy",
        &HostTensor {
            shape: vec![2],
            data: Data::F32(vec![20.0, 5.0]),
        },
    );
    let float_table = save(
        dir.path(),
        "ftable.npy",
        &HostTensor {
            shape: vec![2, 2],
            data: Data::F32(vec![0.0, 1.0, 2.0, 3.0]),
        },
    );
    let out = dir.path().join("out.npy");
    for args in [
        vec!["--seqused-k", s(&float_lens)],
        vec!["--seqused-k", s(&lens), "--block-table", s(&float_table)],
    ] {
        let o = fa_run(&qkv, &out, &args);
        let (_, err) = text(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(".astype(np.int32)"), "{args:?}: {err}");
        assert!(!err.contains("np.float32"), "{args:?}: {err}");
    }
}

/// Whether this CPU has AMX tiles (so that `--simd amx` would run).
fn cpu_has_amx() -> bool {
    std::fs::read_to_string("/proc/cpuinfo").is_ok_and(|c| c.contains("amx_tile"))
}

/// Issue 50, items 6 and 7: `fa bench` validates everything before it prints anything (a bad
/// --head-dim, --heads or --simd is an error with no table header on stdout), and `--iters 0`
/// is an error. Fails on 4cfb28b: the header is printed before the error, and --iters 0 runs.
#[test]
fn bench_errors_come_before_any_table() {
    let base = [
        "bench",
        "--backend",
        "cpu",
        "--seqlen",
        "64",
        "--warmup",
        "0",
    ];
    let mut cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--head-dim", "300"], "head_dim = 300"),
        (vec!["--head-dim", "64,300"], "head_dim = 300"),
        (vec!["--heads", "0"], "heads_q must be at least 1"),
        (vec!["--heads", "8", "--heads-kv", "3"], "not a multiple"),
        (vec!["--backward", "--head-dim", "300"], "head_dim = 300"),
        (
            vec!["--iters", "0", "--heads", "1", "--head-dim", "16"],
            "--iters must be at least 1",
        ),
    ];
    if cpu_has_amx() {
        println!(
            "bench_errors_come_before_any_table: the --simd part did not run: this CPU has AMX, \
             so --simd amx is not an error here (and every level below it is present)"
        );
    } else {
        cases.push((
            vec!["--simd", "amx"],
            "--simd: this CPU does not have avx512f+amx",
        ));
        cases.push((
            vec!["--simd", "amx", "--backward"],
            "--simd: this CPU does not have",
        ));
    }
    for (extra, words) in &cases {
        let mut args = base.to_vec();
        args.extend_from_slice(extra);
        if !extra.contains(&"--iters") {
            args.extend_from_slice(&["--iters", "1"]);
        }
        let (code, out, err) = fa_limited(&args, 60);
        assert_eq!(code, Some(2), "{extra:?}: {out}{err}");
        assert!(err.contains(words), "{extra:?}: {err}");
        assert!(
            out.is_empty(),
            "{extra:?}: nothing on stdout before the error: {out}"
        );
    }
    // The decode bench too.
    let mut decode = vec![
        "bench",
        "--decode",
        "--backend",
        "cpu",
        "--cache-len",
        "64",
        "--batch",
        "1",
        "--iters",
        "1",
    ];
    decode.extend_from_slice(&["--head-dim", "128,300"]);
    let (code, out, err) = fa_limited(&decode, 60);
    assert_eq!(code, Some(2), "{out}{err}");
    assert!(err.contains("head_dim = 300"), "{err}");
    assert!(out.is_empty(), "{out}");
    // And a good shape still prints its table.
    let mut args = base.to_vec();
    args.extend_from_slice(&["--heads", "1", "--head-dim", "16", "--iters", "1"]);
    let (code, out, err) = fa_limited(&args, 60);
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(
        out.contains("median ms") && out.lines().count() == 3,
        "{out}"
    );
}
