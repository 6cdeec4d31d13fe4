"""What the PyTorch test modules share: torch itself (the importing module is skipped, loudly,
when it is not installed), the devices to run on, the CUDA skip mark, the normwise bounds per
device and dtype, and the dtypes each device takes."""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: PyTorch tests NOT run")

HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU: PyTorch CUDA tests NOT run")

#: Normwise bounds: the CPU path (float32 1e-5, bf16/f16 2e-2) and CUDA (bf16/f16 1e-2).
BOUND = {
    ("cpu", torch.float32): 1e-5,
    ("cpu", torch.bfloat16): 2e-2,
    ("cpu", torch.float16): 2e-2,
    ("cuda", torch.bfloat16): 1e-2,
    ("cuda", torch.float16): 1e-2,
}


def dtypes_for(device):
    return [torch.bfloat16, torch.float16] + ([torch.float32] if device == "cpu" else [])
