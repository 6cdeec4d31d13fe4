"""Exact FlashAttention from Rust, for NumPy arrays and PyTorch tensors.

``attention(q, k, v)`` computes ``softmax(q @ k^T * scale) @ v`` per head, exactly (no
approximation beyond floating point), on the CPU (the SIMD kernel, with the GIL released) or on
a CUDA GPU (the tensors' own device memory, queued on PyTorch's current stream, no host round
trip). The work is done by the Rust library (directly through pyo3 on the CPU, through its C
ABI for KV caches and CUDA); this module only gathers each tensor's address, shape, strides,
dtype and device, allocates the output with the caller's framework, and returns it.

Autograd: torch tensors that require grad (or a ``torch.compile`` trace) go through the
``torch.library`` custom operators of ``flash_attention_rs._autograd`` (forward with LSE, the
Rust backward: fa-cpu's on the CPU, fa-cuda's on CUDA on the current stream), so ``attention``
trains on either device and compiles without a graph break; NumPy arrays are forward-only.

Layout: BSHD ``(batch, seqlen, heads, head_dim)``. A BHSD tensor is passed as its BSHD view,
``x.transpose(1, 2)`` (torch) or ``x.swapaxes(1, 2)`` (NumPy): strides travel, nothing is
copied. Only the last dimension must be contiguous. GQA/MQA follow from the head counts.
Variable-length batches: packed ``(total_tokens, heads, head_dim)`` tensors with
``cu_seqlens_q``/``cu_seqlens_k`` prefix sums. KV-cache decode: ``k``/``v`` are a padded cache
``(batch, capacity, heads_kv, head_dim)`` with per-sequence used lengths ``seqused_k``, or a
paged cache ``(num_blocks, block_size, heads_kv, head_dim)`` addressed through an int32
``block_table`` ``(batch, max_blocks)``. ``append_kv`` (or ``attention(..., k_new=, v_new=)``,
as FlashAttention's ``flash_attn_with_kvcache``) writes new tokens into such a cache in place.
``block_walk`` builds a paged cache's block walk on the host, which a CUDA decode step passes
to every layer's ``attention(..., block_walk=)`` so that the kernel reads the blocks in address
order.

Errors carry the library's message: ``ValueError`` for shapes, dtypes, strides and options it
refuses, ``RuntimeError`` where CUDA is not usable or a device call fails, ``TypeError`` for
objects that are neither NumPy arrays nor torch tensors. Arguments are never coerced: an
option of the wrong type (a float or bool where an integer is due, a string where a number or
a bool is due) is a ``TypeError`` naming it; an argument of the right type but the wrong form
(``window`` not a pair) or a value the library refuses is a ``ValueError``.
"""

from __future__ import annotations

import numbers
import operator
import sys
import threading

import numpy as np

from . import _native

__all__ = ["attention", "append_kv", "block_walk", "version", "cuda_device"]

if "torch" in sys.modules:
    # torch is already in use: register the autograd operators now (not first inside a
    # torch.compile trace).
    from . import _autograd  # noqa: F401

#: NumPy dtype names the library takes (``bfloat16`` is ml_dtypes' NumPy dtype).
_NUMPY_DTYPES = ("float32", "float16", "bfloat16")

_devices = {}
_devices_lock = threading.Lock()


def version():
    """The Rust library's version string."""
    return _native.version()


def cuda_device(ordinal=0):
    """The library's handle on CUDA device ``ordinal`` (its primary context, which PyTorch
    uses), opened once per process. ``RuntimeError`` with the library's message where CUDA is
    not usable (no driver, no NVRTC, no such device)."""
    with _devices_lock:
        device = _devices.get(ordinal)
        if device is None:
            device = _native.CudaDevice(ordinal)
            _devices[ordinal] = device
        return device


def _torch_module():
    # Never imported here: a torch tensor can only exist once its caller imported torch.
    return sys.modules.get("torch")


def _autograd_for(x):
    """The autograd module (``_autograd``, imported on first use) when ``x`` is a torch
    tensor, else None."""
    torch = _torch_module()
    if torch is None or not isinstance(x, torch.Tensor):
        return None
    from . import _autograd as module

    return module


def _is_torch(x):
    torch = _torch_module()
    return torch is not None and isinstance(x, torch.Tensor)


def _torch_dtype_name(dtype):
    name = str(dtype)  # "torch.bfloat16"
    return name[len("torch.") :] if name.startswith("torch.") else name


def _describe(x, name):
    """``((address, shape, element strides, dtype name), device)`` of an array or tensor;
    device is ``None`` for host memory, else the CUDA ordinal."""
    if _is_torch(x):
        if x.device.type == "cuda":
            device = x.device.index if x.device.index is not None else 0
        elif x.device.type == "cpu":
            device = None
        else:
            raise ValueError(f"{name} is on device {x.device}: only cpu and cuda are supported")
        return (x.data_ptr(), tuple(x.shape), tuple(x.stride()), _torch_dtype_name(x.dtype)), device
    if isinstance(x, np.ndarray):
        if not x.dtype.isnative:
            # Its name is still "float32": the library would read the bytes swapped.
            raise ValueError(
                f"{name} has dtype {x.dtype.str}: byte order not native (x.astype(x.dtype.newbyteorder('=')))"
            )
        itemsize = x.dtype.itemsize
        strides = []
        for s in x.strides:
            if s % itemsize:
                raise ValueError(
                    f"{name} has byte strides {x.strides}: not multiples of its element size {itemsize}"
                )
            strides.append(s // itemsize)
        address = x.__array_interface__["data"][0]
        return (address, tuple(x.shape), tuple(strides), x.dtype.name), None
    raise TypeError(f"{name} must be a NumPy array or a torch.Tensor, not {type(x).__name__}")


def _sinks_host(sinks):
    """Attention sinks as a contiguous float32 NumPy array (the library checks the length
    against the heads and the values: finite); CUDA tensors are left to the caller's check."""
    if _is_torch(sinks):
        if sinks.device.type != "cpu":
            raise NotImplementedError(
                "attention sinks run on the CPU only for now (the CUDA kernels take none yet)"
            )
        sinks = sinks.detach().to(_torch_module().float32).numpy()
    out = np.ascontiguousarray(np.asarray(sinks, dtype=np.float32))
    if out.ndim != 1:
        raise ValueError(f"sinks has shape {out.shape}: expected (heads_q,)")
    return out


def _integer(x, name):
    """``x`` as a Python int: integers only (NumPy's too), never a bool or a float
    (``TypeError`` naming ``name``)."""
    if isinstance(x, (bool, np.bool_)) or (_is_torch(x) and x.dtype == _torch_module().bool):
        raise TypeError(f"{name} is {x!r}: expected an integer, not a bool")
    try:
        return operator.index(x)
    except TypeError:
        raise TypeError(f"{name} is {x!r} ({type(x).__name__}): expected an integer") from None


def _flag(x, name):
    """``x`` as a bool: ``True``/``False`` (or NumPy's) only, so that a string such as
    ``"False"`` is not read as true (``TypeError`` naming ``name``)."""
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    raise TypeError(f"{name} is {x!r} ({type(x).__name__}): expected True or False")


def _real(x, name):
    """``x`` as a Python float, or None: real numbers only (NumPy's and one-element tensors too),
    never a bool or a string (``TypeError`` naming ``name``). The value is the library's to
    judge."""
    if x is None:
        return None
    one_number = _is_torch(x) and x.numel() == 1 and not (x.is_complex() or x.dtype == _torch_module().bool)
    if isinstance(x, (bool, np.bool_)) or not (isinstance(x, numbers.Real) or one_number):
        raise TypeError(f"{name} is {x!r} ({type(x).__name__}): expected a real number or None")
    return float(x)


def _window(window):
    """``window`` as a pair of Python ints, passed on as given: the library judges the values
    (-1: unbounded side, >= 0: a bound, other negatives refused). Anything but a tuple or list
    of exactly two entries is a ``ValueError``; a side that is not an integer (a bool, a
    float) a ``TypeError``."""
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(
            f"window is {window!r}: expected a pair (left, right) of integers, -1 for an "
            f"unbounded side"
        )
    return tuple(_integer(side, "a side of window") for side in window)


def _where(device):
    return "host memory" if device is None else f"cuda:{device}"


def _empty(like, shape, dtype=None):
    """An uninitialised array of ``shape`` in ``like``'s framework and device (``like``'s
    dtype unless given); when ``shape`` is ``like``'s, ``like``'s memory layout too."""
    if _is_torch(like):
        torch = _torch_module()
        dtype = like.dtype if dtype is None else dtype
        if tuple(like.shape) == tuple(shape) and dtype == like.dtype:
            return torch.empty_like(like)
        return torch.empty(shape, dtype=dtype, device=like.device)
    dtype = like.dtype if dtype is None else dtype
    if like.shape == tuple(shape) and dtype == like.dtype:
        return np.empty_like(like)
    return np.empty(shape, dtype=dtype)


def _host_prefix_sums(cu, name):
    """Host prefix sums as a list of Python ints (``TypeError`` for non-integers, bools
    included)."""
    if _is_torch(cu):
        if cu.device.type != "cpu":
            raise ValueError(f"{name} is on {cu.device} but the tensors are in host memory")
        cu = cu.tolist()
    elif isinstance(cu, np.ndarray):
        cu = cu.tolist()
    if not hasattr(cu, "__iter__"):
        raise TypeError(f"{name} must be a 1-D sequence of integers")
    return [_integer(x, f"an entry of {name}") for x in cu]


def _host_int32(x, name):
    """A host integer table as a dense int32 NumPy array (lists, NumPy arrays, CPU tensors);
    ``ValueError`` for device tensors, non-integer dtypes and values outside int32."""
    if _is_torch(x):
        if x.device.type != "cpu":
            raise ValueError(f"{name} is on {x.device} but the tensors are in host memory")
        x = x.numpy()
    a = np.asarray(x)
    if a.size == 0 and a.dtype.kind == "f":
        a = a.astype(np.int32)  # an empty list
    if a.dtype.kind not in "iu":
        raise ValueError(f"{name} has dtype {a.dtype}: it must hold integers (int32)")
    if a.dtype != np.int32:
        info = np.iinfo(np.int32)
        if a.size and (a.min() < info.min or a.max() > info.max):
            raise ValueError(f"{name} has values outside int32")
        a = a.astype(np.int32)
    return np.ascontiguousarray(a)


def _device_int32(x, name, device):
    """A device table: an int32 torch tensor on ``cuda:device``, made dense on the device
    (never read back to the host)."""
    torch = _torch_module()
    if not _is_torch(x) or x.device.type != "cuda" or (x.device.index or 0) != device:
        where = x.device if _is_torch(x) else type(x).__name__
        raise ValueError(
            f"{name} is {where} but the tensors are on cuda:{device}: on CUDA it must be an "
            f"int32 tensor on the same device (the library does not read it back to the host)"
        )
    if x.dtype != torch.int32:
        raise ValueError(f"{name} has dtype {x.dtype}: it must be torch.int32")
    return x.contiguous()


def _lengths_plus(seqused_k, n):
    """``seqused_k + n`` where it lives: a new int32 CUDA tensor (queued on the current
    stream, never read by the host), else a host int32 array."""
    if _is_torch(seqused_k) and seqused_k.device.type == "cuda":
        return (seqused_k + operator.index(n)).to(_torch_module().int32)
    return (_host_int32(seqused_k, "seqused_k").astype(np.int64) + operator.index(n)).astype(np.int32)


def _walk_input(x, name):
    """A host table of ``block_walk`` as a dense int32 NumPy array (a CUDA tensor is refused:
    the walk is built on the host, from the host copy of the step's tables)."""
    if _is_torch(x) and x.device.type != "cpu":
        raise ValueError(
            f"{name} is on {x.device}: block_walk builds the walk on the host, from the host "
            f"copy of the step's tables (e.g. {name}.cpu())"
        )
    return _host_int32(x, name)


def block_walk(seqused_k, block_table, block_size, num_blocks):
    """The block walk of a paged KV cache, for ``attention(..., block_walk=)`` on CUDA.

    The walk lists, per sequence, the blocks holding its first ``seqused_k[b]`` keys sorted by
    physical block index, so that the CUDA decode kernel reads them in address order instead
    of scattered over the pool (1-3 % faster on paged caches; same result to rounding). It is
    an int32 NumPy array ``(batch, 2, max_blocks)``: ``walk[b, 0, j]`` is the ``j``-th smallest
    used block of sequence ``b``, ``walk[b, 1, j]`` its logical index (its column in
    ``block_table``); entries past the sequence's used blocks are 0.

    Args:
        seqused_k: the keys each sequence uses, integers ``(batch,)``: a list, NumPy array or
            CPU tensor (the lengths the attention calls will read, i.e. after the step's
            append).
        block_table: the paged cache's block indices, integers ``(batch, max_blocks)``, host
            memory as ``seqused_k``; entries past a sequence's used blocks are not read.
        block_size: keys per block (``k_cache.shape[1]``).
        num_blocks: blocks in the cache (``k_cache.shape[0]``).

    The tables are checked as the CPU cache call checks them: a negative length or one past
    ``max_blocks * block_size``, a used block index outside ``0..num_blocks``, a batch of 0
    or a bad shape raise ``ValueError``. CUDA tensors are refused (``ValueError``): the walk
    is built on the host. A decode step builds it once and uploads it once, then passes it to
    every layer::

        walk = torch.from_numpy(fa.block_walk(seqused_k_host, block_table_host,
                                              k_cache.shape[1], k_cache.shape[0])).cuda()
        out = fa.attention(q, k_cache, v_cache, seqused_k=seqused_k, block_table=block_table,
                           block_walk=walk, causal=True)
    """
    used = _walk_input(seqused_k, "seqused_k")
    table = _walk_input(block_table, "block_table")
    if table.ndim != 2:
        raise ValueError(
            f"block_table has shape {tuple(table.shape)}: expected 2 dimensions (batch, max_blocks)"
        )
    walk = np.empty((table.shape[0], 2, table.shape[1]), dtype=np.int32)
    _native.block_walk(
        _describe(used, "seqused_k")[0],
        _describe(table, "block_table")[0],
        _integer(block_size, "block_size"),
        _integer(num_blocks, "num_blocks"),
        _describe(walk, "walk")[0],
    )
    return walk


def append_kv(k_cache, v_cache, k_new, v_new, seqused_k, *, block_table=None):
    """Writes new keys and values into a KV cache in place (no copy of the cache).

    Token ``i`` of sequence ``b`` in ``k_new``/``v_new`` ``(batch, seqlen_new, heads_kv,
    head_dim)`` goes to position ``seqused_k[b] + i`` of that sequence's cache: row
    ``seqused_k[b] + i`` of the padded cache ``(batch, capacity, heads_kv, head_dim)``, or with
    ``block_table`` ``(batch, max_blocks)`` row ``t % block_size`` of block
    ``block_table[b, t // block_size]`` of the paged cache ``(num_blocks, block_size, heads_kv,
    head_dim)``. ``seqused_k`` is not changed: pass ``seqused_k + seqlen_new`` to the
    ``attention`` call that follows (or use ``attention(..., k_new=, v_new=)``, which does).

    The tables follow ``attention``'s rules: host integers (checked: a sequence without room,
    a block index outside the cache raise ``ValueError`` with the cache untouched) or int32
    CUDA tensors on the cache's device (never read by the host; the kernel skips positions
    past the capacity and block indices outside the cache). On CUDA (bfloat16 or float16,
    ``k_new``/``v_new`` contiguous) the copy is queued on ``torch.cuda.current_stream()``.
    Returns ``None``.
    """
    tensors = ((k_new, "k_new"), (v_new, "v_new"), (k_cache, "k_cache"), (v_cache, "v_cache"))
    if len({_is_torch(x) for x, _ in tensors}) > 1:
        raise TypeError("k_cache, v_cache, k_new and v_new must all be NumPy arrays or all torch tensors")
    descs = []
    devices = []
    for x, name in tensors:
        desc, device = _describe(x, name)
        descs.append(desc)
        devices.append(device)
    if len(set(devices)) > 1:
        raise ValueError(
            "the cache and the new tokens are in different places: "
            + ", ".join(_where(d) for d in devices)
        )
    for x, name in tensors[2:]:
        if isinstance(x, np.ndarray) and not x.flags.writeable:
            raise ValueError(f"{name} is a read-only array")
    device = devices[0]
    if device is None:
        used = _host_int32(seqused_k, "seqused_k")
        table = None if block_table is None else _host_int32(block_table, "block_table")
        _native.append_kv(
            *descs,
            _describe(used, "seqused_k")[0],
            None if table is None else _describe(table, "block_table")[0],
        )
    else:
        used = _device_int32(seqused_k, "seqused_k", device)
        table = None if block_table is None else _device_int32(block_table, "block_table", device)
        stream = _torch_module().cuda.current_stream(device).cuda_stream
        _native.append_kv(
            *descs,
            _describe(used, "seqused_k")[0],
            None if table is None else _describe(table, "block_table")[0],
            device=cuda_device(device),
            stream=stream,
        )
    del used, table


def attention(
    q,
    k,
    v,
    *,
    causal=False,
    window=(-1, -1),
    softcap=None,
    scale=None,
    return_lse=False,
    backend="auto",
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    seqused_k=None,
    block_table=None,
    block_walk=None,
    num_splits=None,
    k_new=None,
    v_new=None,
    out=None,
    sinks=None,
):
    """Exact attention ``softmax(q k^T * scale) v``; returns ``out`` (and the log-sum-exp).

    Args:
        q: ``(batch, seqlen_q, heads_q, head_dim)``, or ``(total_q, heads_q, head_dim)`` with
            ``cu_seqlens_q``. NumPy array or torch tensor, float32, bfloat16 or float16 (on
            CUDA: bfloat16 or float16). Any strides with a contiguous last dimension.
        k: ``(batch, seqlen_k, heads_kv, head_dim)`` (or packed); ``heads_q`` a multiple of
            ``heads_kv`` (GQA/MQA).
        v: like ``k``, with its own ``head_dim_v``.
        causal: mask keys after the diagonal, bottom-right aligned (query ``i`` sees keys
            ``j <= i + seqlen_k - seqlen_q``), as FlashAttention >= 2.1 and KV-cache decode.
        window: ``(left, right)`` local window: a tuple or list of two integers, each -1
            (unbounded) or ``>= 0`` (keys before / after the aligned diagonal). Other
            negatives raise ``ValueError`` (the library's check); so does anything but a pair,
            and a side that is not an integer (a bool, a float) raises ``TypeError``.
        softcap: ``cap * tanh(s / cap)`` on the scaled scores; None or 0: off
            (FlashAttention's convention). Negative, NaN or infinite caps raise ``ValueError``.
        scale: the softmax scale (None: ``1/sqrt(head_dim)``); 0, NaN and infinities raise
            ``ValueError``.
        return_lse: also return the natural-log log-sum-exp, float32
            ``(batch, heads_q, seqlen_q)`` (varlen: ``(heads_q, total_q)``).
        backend: ``"auto"`` (where the tensors are), ``"cpu"`` or ``"cuda"``.
        cu_seqlens_q, cu_seqlens_k: int prefix sums of ``batch + 1`` entries from 0 to the
            packed token counts. Host sequences (list, NumPy, CPU tensor) are checked by the
            library; an int32 CUDA tensor stays on the device (no host read), which the
            library must then trust: it needs ``max_seqlen_q``/``max_seqlen_k``.
        max_seqlen_q, max_seqlen_k: longest sequences; needed with device prefix sums only.
        seqused_k: KV-cache decode: the keys each sequence uses, integers ``(batch,)``.
            ``k``/``v`` are then a cache and ``q`` holds each sequence's new queries
            ``(batch, seqlen_q, heads_q, head_dim)`` (1 for plain decode, a few for
            speculative decoding); sequence ``b`` attends to its first ``seqused_k[b]`` keys,
            and ``causal``/``window`` align bottom-right against that length (query ``i`` sees
            keys ``j <= i + seqused_k[b] - seqlen_q``). Without ``block_table``, ``k``/``v``
            are the padded cache ``(batch, capacity, heads_kv, head_dim)``. With host tensors:
            a list, NumPy integer array or CPU tensor, checked by the library (a length past
            the capacity raises ``ValueError``). With CUDA tensors: an int32 CUDA tensor on the
            same device, never read by the host; the call is planned for the capacity and the
            kernel clamps each length to it (invalid lengths give wrong rows, no fault).
        block_table: a paged cache: int ``(batch, max_blocks)`` block indices (same rules as
            ``seqused_k`` for host/CUDA); ``k``/``v`` are then
            ``(num_blocks, block_size, heads_kv, head_dim)`` and key ``t`` of sequence ``b`` is
            row ``t % block_size`` of block ``block_table[b, t // block_size]``. Entries past a
            sequence's used blocks are not read (``-1`` is fine there). On the host a used
            entry outside ``0..num_blocks`` raises ``ValueError``; on CUDA it is clamped.
        block_walk: CUDA, paged cache only: the cache's block walk, an int32 CUDA tensor
            ``(batch, 2, max_blocks)`` on the inputs' device, as ``block_walk()`` builds it
            on the host (then ``torch.from_numpy(...).cuda()``) from the same ``seqused_k``
            and ``block_table`` (the lengths this call reads: with ``k_new``, after the
            append). The kernel then reads each sequence's blocks in address order where its
            plan allows (blocks of at least 8 keys, no left window), in table order elsewhere;
            the result is the same to rounding. Build it once per decode step and pass it to
            every layer's call. Never read by the host; a walk of other tables gives wrong
            rows (no fault). None: table order. With host tensors (the CPU reads the table
            in order) or a padded cache it raises ``ValueError``.
        num_splits: KV-cache decode: force this many key splits (merged by their
            log-sum-exp; results agree with one split to rounding). None: the library's
            choice from the problem and the machine.
        k_new, v_new: KV-cache decode: new keys and values ``(batch, seqlen_new, heads_kv,
            head_dim)`` written into the cache ``k``/``v`` in place first (``append_kv``), at
            positions ``seqused_k[b]`` onwards; the attention then sees
            ``seqused_k[b] + seqlen_new`` keys, as FlashAttention's ``flash_attn_with_kvcache``
            with ``k``/``v``. ``seqused_k`` itself is not changed (add ``seqlen_new`` for the
            next step).
        out: where to write (shape of ``q`` with ``head_dim_v``; same framework and device;
            on the CPU its dtype may also be float32). Allocated when None.
        sinks: learnable attention sinks (gpt-oss): one logit per query head, ``(heads_q,)``
            (a sequence, NumPy array or CPU tensor; read as float32), each joining every row
            of its head in the softmax denominator with no value. The LSE includes it; a row
            that sees no key gives 0 and LSE = its sink. NaN or infinite logits raise
            ``ValueError``. CPU only for now (CUDA tensors raise ``NotImplementedError``), and
            without autograd (inputs that require grad raise ``NotImplementedError``: the
            sinks' gradient is ``_native.backward(..., sinks=, d_sinks=)`` for now).

    Returns:
        ``out``, or ``(out, lse)`` with ``return_lse``. On CUDA the work is queued on
        ``torch.cuda.current_stream()`` and the call returns without waiting, like any
        PyTorch operation.

    Autograd (torch tensors): when an input requires grad and grad mode is on, ``out`` is
    a new contiguous tensor in the autograd graph, and ``backward()`` runs the Rust backward
    (CPU tensors: fa-cpu's; CUDA tensors: fa-cuda's on ``torch.cuda.current_stream()``;
    gradients in the inputs' dtype; GQA's dK/dV summed over each group; causal, window,
    softcap, scale and varlen differentiated as computed). The LSE carries no gradient. With
    grad, KV-cache arguments and ``out=`` raise ``ValueError``. Inside a
    ``torch.compile`` trace the same operators run (no graph break).
    """
    if backend not in ("auto", "cpu", "cuda"):
        raise ValueError(f"backend is {backend!r}: expected 'auto', 'cpu' or 'cuda'")
    # The options' types, before anything (an append) is written.
    kwargs = dict(
        causal=_flag(causal, "causal"),
        window=_window(window),
        softcap=_real(softcap, "softcap"),
        scale=_real(scale, "scale"),
    )
    return_lse = _flag(return_lse, "return_lse")
    sinks_host = None if sinks is None else _sinks_host(sinks)
    if sinks_host is not None and _is_torch(q) and q.device.type == "cuda":
        # Refused before anything (an append) is written.
        raise NotImplementedError(
            "attention sinks run on the CPU only for now (the CUDA kernels take none yet)"
        )
    autograd = _autograd_for(q)
    if autograd is not None and not autograd.inside():
        grad = autograd.needs_grad(q, k, v) or bool(getattr(sinks, "requires_grad", False))
        if grad or (autograd.HAS_CUSTOM_OP and autograd.compiling()):
            if sinks is not None:
                raise NotImplementedError(
                    "flash_attention_rs has no autograd for attention sinks yet: call it under "
                    "torch.no_grad() / torch.inference_mode()"
                )
            cache_args = (seqused_k, block_table, block_walk, num_splits, k_new, v_new)
            if grad and any(x is not None for x in cache_args):
                raise ValueError(
                    "flash_attention_rs has no backward through a KV cache (seqused_k, "
                    "block_table, block_walk, num_splits, k_new/v_new): inputs require grad; "
                    "call it under torch.no_grad() / torch.inference_mode() for decoding"
                )
            if grad and out is not None:
                raise ValueError(
                    "out= writes into a tensor outside the autograd graph: pass out=None when "
                    "inputs require grad (the output is then a new tensor)"
                )
            if (cu_seqlens_q is None) != (cu_seqlens_k is None):
                raise ValueError("give both cu_seqlens_q and cu_seqlens_k, or neither")
            if out is None and all(x is None for x in cache_args):
                return autograd.attention(
                    q, k, v, kwargs["causal"], kwargs["window"], kwargs["softcap"],
                    kwargs["scale"], return_lse, backend, cu_seqlens_q, cu_seqlens_k,
                    max_seqlen_q, max_seqlen_k,
                )
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError("give both cu_seqlens_q and cu_seqlens_k, or neither")
    varlen = cu_seqlens_q is not None
    cached = seqused_k is not None
    if block_table is not None and not cached:
        raise ValueError("block_table needs seqused_k (the keys each sequence uses)")
    if num_splits is not None and not cached:
        raise ValueError("num_splits applies to KV-cache calls (seqused_k) only")
    splits = 0
    if num_splits is not None:
        splits = _integer(num_splits, "num_splits")
        if not 1 <= splits <= 2**31:
            raise ValueError(
                f"num_splits is {splits}: from 1 to 2**31 (None: the library's choice)"
            )
    if block_walk is not None:
        # Checked before an append (k_new) writes anything.
        if block_table is None:
            raise ValueError(
                "block_walk needs block_table (and seqused_k): a padded cache has no blocks to walk"
            )
        if not (_is_torch(k) and k.device.type == "cuda"):
            raise ValueError(
                "block_walk is for CUDA tensors: the CPU reads the block table in order and "
                "takes no walk (pass block_walk=None)"
            )
        _device_int32(block_walk, "block_walk", k.device.index or 0)
        table_shape = tuple(getattr(block_table, "shape", ()))
        if len(table_shape) == 2 and tuple(block_walk.shape) != (table_shape[0], 2, table_shape[1]):
            raise ValueError(
                f"block_walk has shape {tuple(block_walk.shape)}: expected "
                f"{(table_shape[0], 2, table_shape[1])} (batch, 2, max_blocks) for block_table "
                f"{table_shape}"
            )
    if cached and varlen:
        raise ValueError("seqused_k (a KV cache) takes a fixed-length batch of queries: no cu_seqlens")
    if (k_new is None) != (v_new is None):
        raise ValueError("give both k_new and v_new, or neither")
    if k_new is not None:
        if not cached:
            raise ValueError("k_new/v_new append to a KV cache: they need seqused_k")
        append_kv(k, v, k_new, v_new, seqused_k, block_table=block_table)
        seqused_k = _lengths_plus(seqused_k, k_new.shape[1])
    if cached and len(q.shape) != 4:
        raise ValueError(
            f"q has shape {tuple(q.shape)}: with seqused_k it is (batch, seqlen_q, heads_q, head_dim)"
        )

    descs = []
    devices = []
    for x, name in ((q, "q"), (k, "k"), (v, "v")):
        desc, device = _describe(x, name)
        descs.append(desc)
        devices.append(device)
    if len({_is_torch(x) for x in (q, k, v)}) > 1:
        raise TypeError("q, k and v must all be NumPy arrays or all torch tensors")
    if len(set(devices)) > 1:
        raise ValueError(
            "q, k and v are in different places: " + ", ".join(_where(d) for d in devices)
        )
    device = devices[0]
    if sinks_host is not None:
        if device is not None:
            raise NotImplementedError(
                "attention sinks run on the CPU only for now (the CUDA kernels take none yet)"
            )
        kwargs["sinks"] = _describe(sinks_host, "sinks")[0]
    if backend == "cpu" and device is not None:
        raise ValueError(f"backend='cpu' needs tensors in host memory; these are on cuda:{device}")
    if backend == "cuda" and device is None:
        # Where CUDA is not usable at all, say so with the library's words (RuntimeError).
        cuda_device(0)
        raise ValueError("backend='cuda' needs CUDA tensors; these are in host memory")

    if out is None:
        o_shape = tuple(q.shape[:-1]) + (v.shape[-1],)
        out = _empty(q, o_shape)
    else:
        if _is_torch(out) != _is_torch(q):
            raise TypeError("out must be of the same framework as q (NumPy array or torch tensor)")
        if isinstance(out, np.ndarray) and not out.flags.writeable:
            raise ValueError("out is a read-only array")
    o_desc, o_device = _describe(out, "out")
    if o_device != device:
        raise ValueError(f"out is in {_where(o_device)} but the inputs are in {_where(device)}")

    lse = None
    lse_desc = None
    if return_lse:
        heads_q = q.shape[-2]
        if varlen:
            lse_shape = (heads_q, q.shape[0])
        else:
            lse_shape = (q.shape[0], heads_q, q.shape[1]) if len(q.shape) == 4 else ()
        if lse_shape:
            if _is_torch(q):
                lse = _empty(q, lse_shape, _torch_module().float32)
            else:
                lse = np.empty(lse_shape, dtype=np.float32)
            lse_desc, _ = _describe(lse, "lse")

    keep_alive = []
    if varlen:
        cu_on_device = _is_torch(cu_seqlens_q) and cu_seqlens_q.device.type == "cuda"
        if cu_on_device and device is not None:
            torch = _torch_module()
            if not (_is_torch(cu_seqlens_k) and cu_seqlens_k.device == cu_seqlens_q.device):
                raise ValueError("cu_seqlens_q and cu_seqlens_k must both be on the same CUDA device")
            if cu_seqlens_q.device.index != device:
                raise ValueError(
                    f"cu_seqlens are on {cu_seqlens_q.device} but the tensors are on cuda:{device}"
                )
            if max_seqlen_q is None or max_seqlen_k is None:
                raise ValueError(
                    "cu_seqlens on the GPU need max_seqlen_q and max_seqlen_k "
                    "(finding them would read the prefix sums back to the host)"
                )
            if cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape != cu_seqlens_k.shape:
                raise ValueError("cu_seqlens_q and cu_seqlens_k must be 1-D of the same length")
            for cu, name in ((cu_seqlens_q, "cu_seqlens_q"), (cu_seqlens_k, "cu_seqlens_k")):
                # The int32 conversion below would truncate floats (as the host path refuses).
                if cu.dtype.is_floating_point or cu.dtype.is_complex or cu.dtype == torch.bool:
                    raise TypeError(f"{name} has dtype {cu.dtype}: expected integers (int32)")
            # int32 and dense, on the current stream; the temporaries live until this call
            # returns, and PyTorch's allocator orders their reuse after the queued kernel.
            cu_q = cu_seqlens_q.to(torch.int32).contiguous()
            cu_k = cu_seqlens_k.to(torch.int32).contiguous()
            keep_alive += [cu_q, cu_k]
            kwargs["device_cu_seqlens"] = (
                cu_q.data_ptr(),
                cu_k.data_ptr(),
                cu_q.numel() - 1,
                _integer(max_seqlen_q, "max_seqlen_q"),
                _integer(max_seqlen_k, "max_seqlen_k"),
            )
        else:
            kwargs["cu_seqlens"] = (
                _host_prefix_sums(cu_seqlens_q, "cu_seqlens_q"),
                _host_prefix_sums(cu_seqlens_k, "cu_seqlens_k"),
            )

    if cached:
        if device is None:
            used = _host_int32(seqused_k, "seqused_k")
            table = None if block_table is None else _host_int32(block_table, "block_table")
        else:
            used = _device_int32(seqused_k, "seqused_k", device)
            table = None if block_table is None else _device_int32(block_table, "block_table", device)
        walk = None if block_walk is None else _device_int32(block_walk, "block_walk", device)
        # Dense int32 copies (when they had to be made) live until the call returns; on CUDA
        # PyTorch's allocator orders their reuse after the queued kernels.
        keep_alive += [used, table, walk]
        kwargs["cache"] = (
            _describe(used, "seqused_k")[0],
            None if table is None else _describe(table, "block_table")[0],
            splits,
            None if walk is None else _describe(walk, "block_walk")[0],
        )

    if device is None:
        _native.forward(*descs, o_desc, lse_desc, **kwargs)
    else:
        torch = _torch_module()
        stream = torch.cuda.current_stream(device).cuda_stream
        _native.forward(*descs, o_desc, lse_desc, device=cuda_device(device), stream=stream, **kwargs)
    del keep_alive, sinks_host
    return (out, lse) if return_lse else out
