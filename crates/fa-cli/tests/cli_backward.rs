//! `fa run --dout … --dq … --dk … --dv …` end to end: gradients written as files, checked
//! against the f64 reference backward; bad backward arguments are clear errors.

use fa_cli::files::{read_tensor, write_tensors, FileFormat};
use fa_cli::tensor::{random_normal, DType, HostTensor};
use fa_reference::{attention_backward_f64, compare_grads, Rng};
use softmax_core::{Grads, ProblemDesc};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn fa(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_fa"))
        .args(args)
        .output()
        .expect("the fa binary runs")
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

/// Runs `fa run` with gradients for a GQA causal problem at `dtype` and checks them.
fn gradients_match_the_reference(dtype: DType, grad_dtype: Option<&str>, bound: f64) {
    gradients_on("cpu", dtype, grad_dtype, bound);
}

/// As [`gradients_match_the_reference`] on `backend`.
fn gradients_on(backend: &str, dtype: DType, grad_dtype: Option<&str>, bound: f64) {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng::new(17);
    // 6 query heads over 2 KV heads, seqlen_q ≠ seqlen_k, odd head dim.
    let (qs, kvs) = (vec![2, 37, 6, 40], vec![2, 53, 2, 40]);
    let q = random_normal(&mut rng, dtype, qs.clone()).unwrap();
    let k = random_normal(&mut rng, dtype, kvs.clone()).unwrap();
    let v = random_normal(&mut rng, dtype, kvs.clone()).unwrap();
    let d_o = random_normal(&mut rng, dtype, qs.clone()).unwrap();
    let paths = [
        save(dir.path(), "q.npy", &q),
        save(dir.path(), "k.npy", &k),
        save(dir.path(), "v.npy", &v),
        save(dir.path(), "dout.npy", &d_o),
    ];
    let (out, dq, dk, dv) = (
        dir.path().join("out.npy"),
        dir.path().join("dq.npy"),
        dir.path().join("dk.npy"),
        dir.path().join("dv.npy"),
    );
    let mut args = vec![
        "run",
        "--q",
        s(&paths[0]),
        "--k",
        s(&paths[1]),
        "--v",
        s(&paths[2]),
        "-o",
        s(&out),
        "--causal",
        "--backend",
        backend,
        "--dout",
        s(&paths[3]),
        "--dq",
        s(&dq),
        "--dk",
        s(&dk),
        "--dv",
        s(&dv),
    ];
    if let Some(g) = grad_dtype {
        args.extend(["--grad-dtype", g]);
    }
    let o = fa(&args);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    // The forward ran first, so its line comes first (issue 50, item 9; on 4cfb28b the
    // backward line came first).
    let forward = err
        .find(&format!(" on {backend}"))
        .expect("the forward's line");
    let backward = err.find("fa run: backward").expect("the backward's line");
    assert!(forward < backward, "forward line first: {err}");
    let want_dtype = if grad_dtype.is_some() {
        DType::F32
    } else {
        dtype
    };
    let read = |p: &Path, name, shape: &Vec<usize>| {
        let (t, _) = read_tensor(p, name).unwrap();
        assert_eq!(&t.shape, shape, "{name}");
        assert_eq!(t.dtype(), want_dtype, "{name}");
        t.to_f32()
    };
    let got = Grads::new(
        read(&dq, "dq", &qs),
        read(&dk, "dk", &kvs),
        read(&dv, "dv", &kvs),
    );
    let p = ProblemDesc::new(2, 37, 53, 6, 2, 40)
        .causal()
        .validate(256)
        .unwrap();
    let reference =
        attention_backward_f64(&p, &q.to_f32(), &k.to_f32(), &v.to_f32(), &d_o.to_f32());
    let e = compare_grads(
        &p,
        Grads::new(&got.dq[..], &got.dk[..], &got.dv[..]),
        &reference,
    );
    for (name, x) in [("dQ", e.dq), ("dK", e.dk), ("dV", e.dv)] {
        assert!(x <= bound, "{dtype} {name}: {x:e} > {bound:e}");
    }
}

#[test]
fn run_writes_gradients_within_the_bounds() {
    gradients_match_the_reference(DType::F32, None, 1e-5);
    gradients_match_the_reference(DType::Bf16, None, 2e-2);
    gradients_match_the_reference(DType::Bf16, Some("f32"), 2e-2);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn run_writes_cuda_gradients_within_the_bounds() {
    gradients_on("cuda", DType::Bf16, None, 2e-2);
    gradients_on("cuda", DType::F16, None, 2e-2);
}

#[test]
fn bad_backward_arguments_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng::new(18);
    let q = random_normal(&mut rng, DType::F32, vec![1, 8, 2, 16]).unwrap();
    let short = random_normal(&mut rng, DType::F32, vec![1, 7, 2, 16]).unwrap();
    let qp = save(dir.path(), "q.npy", &q);
    let bad = save(dir.path(), "dout.npy", &short);
    let (out, dq, dk) = (
        dir.path().join("o.npy"),
        dir.path().join("dq.npy"),
        dir.path().join("dk.npy"),
    );
    let base = [
        "run",
        "--q",
        s(&qp),
        "--k",
        s(&qp),
        "--v",
        s(&qp),
        "-o",
        s(&out),
    ];
    let run = |extra: &[&str]| {
        let mut a = base.to_vec();
        a.extend_from_slice(extra);
        let o = fa(&a);
        assert!(!o.status.success(), "{extra:?} should fail");
        String::from_utf8_lossy(&o.stderr).into_owned()
    };
    let e = run(&[
        "--dout",
        s(&bad),
        "--dq",
        s(&dq),
        "--dk",
        s(&dk),
        "--dv",
        s(&dk),
    ]);
    assert!(e.contains("same file"), "{e}");
    let dv = dir.path().join("dv.npy");
    let e = run(&[
        "--dout",
        s(&bad),
        "--dq",
        s(&dq),
        "--dk",
        s(&dk),
        "--dv",
        s(&dv),
    ]);
    assert!(e.contains("--dout must have the output's shape"), "{e}");
    assert!(!dq.exists() && !out.exists(), "nothing written on error");
    let e = run(&["--dout", s(&bad), "--dq", s(&dq)]);
    assert!(e.contains("--dk") || e.contains("required"), "{e}");
    let e = run(&[
        "--dout",
        s(&bad),
        "--dq",
        s(&qp),
        "--dk",
        s(&dk),
        "--dv",
        s(&dv),
    ]);
    assert!(e.contains("refusing to overwrite an input"), "{e}");
}
