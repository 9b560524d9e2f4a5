"""Input checks shared by every entry point: ValueError before any compile or launch.

Checks run in an order that needs no GPU: types, ranks, dtypes, shapes, head dims, options;
the device check comes last, so CPU tests reach every rule. The forward entry points use
``validate_attention_inputs``; the SM90 backward (``hopper.bwd_interface``) and autograd share
the option checks (``check_softmax_scale``, ``normalize_window``) and ``require_sm90``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
# Union of the head-dim pairs any of our kernels supports; each backend narrows it.
ALL_HEAD_DIMS = ((64, 64), (96, 96), (128, 128), (192, 128), (256, 256))


@dataclass(frozen=True)
class AttentionProblem:
    """The static and dynamic sizes of one validated forward call (BSHD tensors)."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int
    heads_kv: int
    head_dim: int
    head_dim_v: int
    dtype: torch.dtype
    softmax_scale: float
    causal: bool
    window: tuple
    softcap: float = 0.0  # 0: off (check_softcap)

    @property
    def qhead_per_kvhead(self) -> int:
        return self.heads // self.heads_kv


def _check_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise ValueError(
            f"{name} must be 4-D (batch, seqlen, heads, head_dim), got shape {tuple(t.shape)}"
        )
    if t.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name} has dtype {t.dtype}: supported dtypes are bfloat16 and float16")


def normalize_window(window_size) -> tuple:
    """Validate ``window_size = (left, right)``: each side None or -1 (unbounded: FA4's and
    flash-attn 2's conventions) or any other int, the band's bound on that side
    (``fa_sm100.bands``; a negative bound shifts the band past the diagonal, as FA4 defines
    it). Returns the pair as a tuple with None for an unbounded side. ``causal`` is a separate
    option; the kernels and the reference combine the two (causal is a right edge of 0).
    """
    if window_size is None:
        return (None, None)
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise ValueError(f"window_size must be a pair (left, right), got {window_size!r}")
    left, right = window_size
    for side, w in (("left", left), ("right", right)):
        if w is not None and (isinstance(w, bool) or not isinstance(w, int)):
            raise ValueError(f"window_size {side}={w!r}: must be None or -1 (unbounded) or an "
                             f"int (the band's bound on that side)")
    return (None if left == -1 else left, None if right == -1 else right)


def validate_attention_inputs(q, k, v, softmax_scale=None, causal=False, window_size=(None, None),
                              head_dims=ALL_HEAD_DIMS, require_cuda=True,
                              softcap=0.0) -> AttentionProblem:
    """Check q, k, v (BSHD) and the options; return the problem sizes or raise ValueError."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t)
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    b, sq, hq, d = q.shape
    bk, sk, hk, dk = k.shape
    bv, sv, hv, dv = v.shape
    if not b == bk == bv:
        raise ValueError(f"batch sizes differ: q {b}, k {bk}, v {bv}")
    if sk != sv:
        raise ValueError(f"k and v must have the same seqlen, got {sk} and {sv}")
    if hk != hv:
        raise ValueError(f"k and v must have the same number of heads, got {hk} and {hv}")
    if dk != d:
        raise ValueError(f"q and k must have the same head_dim, got {d} and {dk}")
    if hk < 1 or hq % hk:
        raise ValueError(
            f"query heads ({hq}) must be a multiple of key/value heads ({hk}) for MHA/GQA/MQA"
        )
    if min(b, sq, sk, hq) < 1:
        raise ValueError(
            f"empty problem: batch={b}, seqlen_q={sq}, seqlen_k={sk}, heads={hq} must all be >= 1"
        )
    if (d, dv) not in head_dims:
        raise ValueError(
            f"head dims (qk={d}, v={dv}) are not supported: use one of {tuple(head_dims)}"
        )
    softmax_scale = check_softmax_scale(softmax_scale, d)
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be a bool, got {causal!r}")
    window = normalize_window(window_size)
    softcap = check_softcap(softcap)
    if require_cuda:
        devices = {t.device for t in (q, k, v)}
        if len(devices) != 1:
            raise ValueError(f"q, k, v must be on one device, got {sorted(map(str, devices))}")
        if q.device.type != "cuda":
            raise ValueError(f"q, k, v must be CUDA tensors, got device {q.device}")
    return AttentionProblem(b, sq, sk, hq, hk, d, dv, q.dtype, softmax_scale, causal, window,
                            softcap)


def check_softmax_scale(softmax_scale, head_dim: int) -> float:
    """The softmax scale as a float: ``1 / sqrt(head_dim)`` for None, else a finite number > 0."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise ValueError(f"softmax_scale must be a float or None, got {softmax_scale!r}")
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale={softmax_scale}: must be finite and > 0")
    return float(softmax_scale)


def check_softcap(softcap) -> float:
    """Logit softcapping's cap as a float: 0 is off, else a finite number > 0 (scores s become
    ``softcap * tanh(s / softcap)``, as Gemma 2 and flash-attn define it)."""
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise ValueError(f"softcap must be a float (0.0: off), got {softcap!r}")
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"softcap={softcap}: must be finite and >= 0 (0.0: off)")
    return float(softcap)


def require_sm90(device: torch.device, what: str) -> None:
    """Raise ValueError unless ``device`` is a CUDA device of compute capability 9.0."""
    if device.type != "cuda":
        raise ValueError(f"{what} needs CUDA tensors on an sm_90 GPU, got device {device}")
    from fa_sm100.devices import capability

    major, minor = capability(device)
    if (major, minor) != (9, 0):
        raise ValueError(f"{what} runs on sm_90 (Hopper) GPUs only; {device} is "
                         f"sm_{major}{minor}")


def require_sm100(device: torch.device, what: str) -> None:
    """Raise ValueError unless ``device`` is a CUDA device of compute capability 10.x."""
    if device.type != "cuda":
        raise ValueError(f"{what} needs CUDA tensors on an sm_100 GPU, got device {device}")
    from fa_sm100.devices import capability

    major, minor = capability(device)
    if major != 10:
        raise ValueError(f"{what} runs on sm_100 (Blackwell) GPUs only; {device} is "
                         f"sm_{major}{minor}")


def tma_strides_ok(t: torch.Tensor) -> bool:
    """True when TMA can read ``t``'s layout: unit last stride, 16-byte aligned other strides
    (the base address is a per-call matter: ``tma_ready``)."""
    elem = t.element_size()
    return t.stride(-1) == 1 and all((s * elem) % 16 == 0 for s in t.stride()[:-1])


def tma_ready(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when TMA can read it (``tma_strides_ok`` and a 16-byte aligned base),
    otherwise a contiguous copy."""
    ok = tma_strides_ok(t) and t.data_ptr() % 16 == 0
    return t if ok else t.clone(memory_format=torch.contiguous_format)


@dataclass(frozen=True)
class VarlenProblem:
    """A validated variable-length call: packed (total, heads, head_dim) tensors, ``batch``
    sequences, the longest lengths as given, and the forward's options."""

    batch: int
    total_q: int
    total_k: int
    heads: int
    heads_kv: int
    head_dim: int
    head_dim_v: int
    dtype: torch.dtype
    max_seqlen_q: int
    max_seqlen_k: int
    softmax_scale: float
    causal: bool
    window: tuple
    softcap: float = 0.0


# Set to 1, ``flash_attn_varlen_func`` reads the offsets' values on every call
# (``check_varlen_values``: one wait for the GPU) and raises ValueError before any launch.
CHECK_VALUES_ENV = "FA_SM100_CHECK_VALUES"


def checking_values() -> bool:
    """Whether ``CHECK_VALUES_ENV`` asks for the value checks of packed batches."""
    import os

    return os.environ.get(CHECK_VALUES_ENV, "0") not in ("", "0")


def check_varlen_values(cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int,
                        max_seqlen_q: int, max_seqlen_k: int, seqused_k=None) -> None:
    """What ``validate_varlen_inputs`` leaves unread, read: each offsets vector starts at 0,
    never decreases and ends at the packed tensor's rows; no sequence is longer than its
    ``max_seqlen``; ``seqused_k`` lies in [0, the sequence's keys]. Raise ValueError naming
    the first sequence that breaks a rule. Copies the offsets to the host: it waits for the
    GPU (``CHECK_VALUES_ENV``)."""
    for name, cu, total, longest in (("cu_seqlens_q", cu_seqlens_q, total_q, max_seqlen_q),
                                     ("cu_seqlens_k", cu_seqlens_k, total_k, max_seqlen_k)):
        offsets = cu.tolist()
        if offsets[0] != 0:
            raise ValueError(f"{name}[0] must be 0, got {offsets[0]}")
        if offsets[-1] != total:
            raise ValueError(f"{name}[-1] must be the packed rows ({total}), got {offsets[-1]}")
        for i, (a, b) in enumerate(zip(offsets, offsets[1:])):
            if b < a:
                raise ValueError(f"{name} must not decrease: sequence {i} runs from {a} to {b}")
            if b - a > longest:
                name_max = "max_seqlen_q" if name.endswith("q") else "max_seqlen_k"
                raise ValueError(f"sequence {i} has {b - a} rows in {name}, more than "
                                 f"{name_max}={longest}")
    if seqused_k is not None:
        keys = cu_seqlens_k.tolist()
        for i, used in enumerate(seqused_k.tolist()):
            if not 0 <= used <= keys[i + 1] - keys[i]:
                raise ValueError(f"seqused_k[{i}] must lie in [0, {keys[i + 1] - keys[i]}] "
                                 f"(the sequence's keys), got {used}")


def validate_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           seqused_k=None, softmax_scale=None, causal=False,
                           window_size=(None, None), softcap=0.0,
                           head_dims=ALL_HEAD_DIMS, require_cuda=True) -> VarlenProblem:
    """Check packed q (total_q, h, d), k / v (total_k, h_kv, d / dv), the int32 offsets
    ``cu_seqlens_q`` / ``cu_seqlens_k`` (batch + 1,), ``seqused_k`` (batch,) or None, the
    longest lengths and the options; raise ValueError naming the first problem. What lies in
    the offsets' values (non-decreasing from 0, each sequence no longer than its maximum) is
    not read here: reading it would wait for the GPU."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D (total_tokens, heads, head_dim) for varlen, "
                             f"got shape {tuple(t.shape)}")
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"k and v must have the same number of tokens, got {k.shape[0]} and "
                         f"{v.shape[0]}")
    for name, n in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{name} must be an int >= 0, got {n!r}")
    batch = None
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k),
                    ("seqused_k", seqused_k)):
        if t is None and name == "seqused_k":
            continue
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1:
            raise ValueError(f"{name} must be a 1-D torch.int32 tensor, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} "
                             f"{tuple(getattr(t, 'shape', ()))}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
        sequences = t.shape[0] - (name != "seqused_k")
        if batch is None:
            batch = sequences
        elif sequences != batch:
            raise ValueError(f"{name} gives {sequences} sequences, cu_seqlens_q gives {batch} "
                             f"(cu_seqlens: batch + 1 offsets; seqused_k: batch lengths)")
    if batch < 1:
        raise ValueError("cu_seqlens_q must hold at least two offsets (one sequence)")
    # the packed tensors as a batch of one: every other rule is the padded API's
    one = [t.unsqueeze(0) for t in (q, k, v)]
    if q.shape[0] == 0 or k.shape[0] == 0:  # empty packs are legal; check the rest on one row
        one = [t.new_empty((1, 1, *t.shape[1:])) for t in (q, k, v)]
    p = validate_attention_inputs(*one, softmax_scale, causal, window_size, head_dims,
                                  require_cuda=require_cuda, softcap=softcap)
    return VarlenProblem(batch, q.shape[0], k.shape[0], p.heads, p.heads_kv, p.head_dim,
                         p.head_dim_v, p.dtype, max_seqlen_q, max_seqlen_k, p.softmax_scale,
                         p.causal, p.window, p.softcap)
