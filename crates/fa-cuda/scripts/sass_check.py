#!/usr/bin/env python3
"""Offline SASS check of a kernel variant (no GPU): NVRTC compile -> cubin -> nvdisasm.

    python3 crates/fa-cuda/scripts/sass_check.py --nvdisasm PATH/nvdisasm \
        [--arch sm_90a] [--main sm90/flash_fwd.cu] [--expect HGMMA ...] -D HDP=128 -D ...

Loads libnvrtc from LD_LIBRARY_PATH (`source .ci/install-nvrtc.sh`), hands it every header
under src/kernels/ (common/ and the family's own), prints ptxas' report and counts SASS
opcodes: the expected ones (default HGMMA) must be present, LDL/STL (local memory) absent.
Get nvdisasm from the `nvidia-cuda-nvdisasm` wheel (pip download, unzip). Exit status 1 on
a failed check.
"""
import argparse, ctypes, ctypes.util, glob, os, re, subprocess, sys, tempfile

here = os.path.dirname(os.path.abspath(__file__))
kernels = os.path.join(here, "..", "src", "kernels")

ap = argparse.ArgumentParser()
ap.add_argument("--arch", default="sm_90a")
ap.add_argument("--main", default="sm90/flash_fwd.cu")
ap.add_argument("--nvdisasm", default="nvdisasm")
ap.add_argument("--expect", action="append", default=None)
ap.add_argument("--kernels-dir", default=None, help="the kernels/ tree to read (default: this crate's)")
ap.add_argument("--sass-out", default=None, help="write the SASS listing here")
ap.add_argument("-D", dest="defines", action="append", default=[])
args = ap.parse_args()
expect = args.expect or ["HGMMA"]
kernels = args.kernels_dir or kernels

lib = None
for d in os.environ.get("LD_LIBRARY_PATH", "").split(":"):
    for name in ("libnvrtc.so", "libnvrtc.so.13"):
        p = os.path.join(d, name)
        if d and os.path.exists(p):
            lib = ctypes.CDLL(p)
            break
    if lib:
        break
if lib is None:
    sys.exit("libnvrtc not found on LD_LIBRARY_PATH: source .ci/install-nvrtc.sh")

headers = sorted(glob.glob(os.path.join(kernels, "*", "*.cuh")))
names = [os.path.relpath(h, kernels) for h in headers]
texts = [open(h).read() for h in headers]
src = open(os.path.join(kernels, args.main)).read()

prog = ctypes.c_void_p()
arr = lambda xs: (ctypes.c_char_p * len(xs))(*[x.encode() for x in xs])
rc = lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), args.main.encode(), len(headers), arr(texts), arr(names))
assert rc == 0, rc
opts = [f"-D{d}" for d in args.defines] + [f"--gpu-architecture={args.arch}", "--std=c++17", "--ptxas-options=-v", "--fmad=true", "-default-device"]
rc = lib.nvrtcCompileProgram(prog, len(opts), arr(opts))
n = ctypes.c_size_t()
lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
log = ctypes.create_string_buffer(n.value)
lib.nvrtcGetProgramLog(prog, log)
print(log.value.decode(errors="replace").strip())
if rc != 0:
    sys.exit(f"compile failed ({rc})")
lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
cubin = ctypes.create_string_buffer(n.value)
lib.nvrtcGetCUBIN(prog, cubin)
with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
    f.write(cubin.raw)
sass = subprocess.run([args.nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
os.unlink(f.name)
if args.sass_out:
    open(args.sass_out, "w").write(sass)
ops = {}
for line in sass.splitlines():
    m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
    if m:
        ops[m.group(1)] = ops.get(m.group(1), 0) + 1
ok = True
for op in expect:
    c = sum(v for k, v in ops.items() if k.startswith(op))
    print(f"{op}: {c}")
    ok &= c > 0
local = sum(v for k, v in ops.items() if k in ("LDL", "STL"))
print(f"LDL/STL: {local}; instructions: {sum(ops.values())}; top: " +
      ", ".join(f"{k} {v}" for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:12]))
ok &= local == 0
sys.exit(0 if ok else 1)
