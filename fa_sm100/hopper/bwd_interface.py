"""Host side of the SM90 backward: validation, buffers, compile cache, the three launches.

``sm90_bwd(dout, q, k, v, out, lse, ...)`` returns (dq, dk, dv) for BSHD inputs:

1. preprocess: Delta = rowsum(O * dO), LSE in log2 units (padded rows: Delta 0, LSE +inf);
2. main kernel (``Sm90FlashBackward``): dK, dV per key block, dQ added into float32;
3. postprocess: dQ (and GQA dK/dV) float32 -> input dtype, BSHD, GQA heads summed.

Everything that can be wrong with the inputs raises ValueError before anything is compiled
or launched. Compiled kernels are cached per (config, kind); shapes other than the head dims
are run-time values, so one compile serves every batch, sequence length and head count.
"""

from typing import Optional

import torch

from fa_sm100.config import normalize_dtype
from fa_sm100.hopper.bwd_config import SM90_BWD_HEAD_DIMS, BwdConfig, select_bwd_config
from fa_sm100.hopper.config import SM90_ARCH
from fa_sm100.validation import (SUPPORTED_DTYPES, check_softmax_scale, normalize_window,
                                 require_sm90)

_compile_cache: dict = {}


def validate_bwd_inputs(dout, q, k, v, out, lse, softmax_scale=None, causal=False,
                        window_size=(None, None), deterministic=False):
    """Raise ValueError naming the first problem with the backward's inputs; otherwise return
    ``(softmax_scale, (window_left, window_right))`` with the default scale filled in.

    The rules that need no GPU come first (types, shapes, dtypes, head dims, options); the
    device rule comes last: CUDA tensors on an sm_90 GPU. So CPU tensors reach every other
    rule, and nothing is compiled for a device that cannot run the kernel.
    """
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out), ("dout", dout)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, seqlen, heads, head_dim), got {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name} has dtype {t.dtype}: use torch.bfloat16 or torch.float16")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head_dim) dimension")
    if not isinstance(lse, torch.Tensor):
        raise ValueError(f"lse must be a torch.Tensor, got {type(lse).__name__}")
    if len({t.dtype for t in (q, k, v, out, dout)}) != 1:
        raise ValueError("q, k, v, out and dout must share one dtype")
    if len({t.device for t in (q, k, v, out, dout, lse)}) != 1:
        raise ValueError("all tensors must be on the same device")
    b, sq, hq, d = q.shape
    bk, sk, hk, dk = k.shape
    if k.shape != v.shape[:3] + (v.shape[3],) or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same batch, seqlen, heads")
    if bk != b:
        raise ValueError(f"batch of k ({bk}) differs from batch of q ({b})")
    if dk != d or v.shape[3] != d:
        raise ValueError(f"head dims q={d}, k={dk}, v={v.shape[3]}: the SM90 backward needs them equal")
    if d not in SM90_BWD_HEAD_DIMS:
        raise ValueError(f"head_dim={d} is not supported by the SM90 backward: use one of {SM90_BWD_HEAD_DIMS}")
    if hq % hk:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({hk})")
    if out.shape != q.shape or dout.shape != q.shape:
        raise ValueError(f"out {tuple(out.shape)} and dout {tuple(dout.shape)} must match q {tuple(q.shape)}")
    if lse.shape != (b, hq, sq) or lse.dtype != torch.float32:
        raise ValueError(f"lse must be float32 of shape {(b, hq, sq)}, got {lse.dtype} {tuple(lse.shape)}")
    if sq < 1 or sk < 1:
        raise ValueError("sequence lengths must be >= 1")
    softmax_scale = check_softmax_scale(softmax_scale, d)
    for name, flag in (("causal", causal), ("deterministic", deterministic)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be a bool, got {flag!r}")
    window = normalize_window(window_size)
    require_sm90(q.device, "sm90_bwd")
    return softmax_scale, window


def _to_cute(t: torch.Tensor, align: int = 16, static_last: bool = True):
    """A compact tensor whose modes are run-time values, except the last one when
    ``static_last`` (the head dim of Q/K/V/O-shaped tensors); row vectors such as LSE
    (batch, heads, seqlen) must pass ``static_last=False``: their last mode is a length."""
    from cutlass.cute.runtime import from_dlpack

    ct = from_dlpack(t.detach(), assumed_align=align)
    order = tuple(t.dim_order())
    for mode in range(t.dim() - (1 if static_last else 0)):
        ct = ct.mark_compact_shape_dynamic(mode=mode, stride_order=order)
    return ct


def _compiled(kind: str, key, build, *args):
    """Compile once per (kind, key) for the sm_90 device ``sm90_bwd`` runs on."""
    import cutlass.cute as cute

    from fa_sm100.hopper.common import dsl_runtime_arch

    cache_key = (kind, key)
    if cache_key not in _compile_cache:
        with dsl_runtime_arch(SM90_ARCH):
            _compile_cache[cache_key] = cute.compile(build(), *args,
                                                     options=f"--gpu-arch {SM90_ARCH}")
    return _compile_cache[cache_key]


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def sm90_bwd(dout, q, k, v, out, lse, softmax_scale: Optional[float] = None, causal: bool = False,
             window_size=(None, None), deterministic: bool = False,
             config: Optional[BwdConfig] = None):
    """Gradients (dq, dk, dv) of attention on an SM90 GPU; see the module docstring."""
    softmax_scale, (left, right) = validate_bwd_inputs(dout, q, k, v, out, lse, softmax_scale,
                                                       causal, window_size, deterministic)
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    group = hq // hk
    dtype = normalize_dtype(q.dtype)
    if config is None:
        config = select_bwd_config(head_dim=d, dtype=dtype, causal=causal,
                                   window_left=left, window_right=right,
                                   qhead_per_kvhead=group, deterministic=deterministic)
    else:
        if not isinstance(config, BwdConfig):
            raise ValueError(f"config must be a BwdConfig, got {type(config).__name__}")
        config = config.replace(head_dim=d, head_dim_v=d, dtype=dtype,
                                causal=causal, window_left=left, window_right=right,
                                qhead_per_kvhead=group, deterministic=deterministic).validate()

    import cuda.bindings.driver as cuda
    import cutlass

    from fa_sm100.hopper.bwd_kernel import Sm90FlashBackward
    from fa_sm100.hopper.bwd_prepost import BwdPostprocess, BwdPreprocess

    q, k, v, out, dout = (t.contiguous() for t in (q, k, v, out, dout))
    lse = lse.contiguous()
    dev = q.device
    sq_pad = _round_up(sq, config.tile_m)
    sk_pad = _round_up(sk, config.tile_n)
    n_m_blocks = sq_pad // config.tile_m
    lse2 = torch.empty(b, hq, sq_pad, device=dev, dtype=torch.float32)
    delta = torch.empty(b, hq, sq_pad, device=dev, dtype=torch.float32)
    dq_acc = torch.zeros(b, hq, sq_pad, config.dq_row_pitch, device=dev, dtype=torch.float32)
    dq_sem = torch.zeros(b, hq, n_m_blocks if config.deterministic else 1, device=dev, dtype=torch.int32)
    dq = torch.empty_like(q)
    if config.uses_gqa_buffers:
        h_acc = hq if config.gqa_reduce == "buffers" else hk
        alloc = torch.empty if config.gqa_reduce == "buffers" else torch.zeros
        dk_acc = alloc(b, h_acc, sk_pad, d, device=dev, dtype=torch.float32)
        dv_acc = alloc(b, h_acc, sk_pad, d, device=dev, dtype=torch.float32)
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        dk_arg, dv_arg = dk_acc, dv_acc
    else:
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        dk_arg, dv_arg = dk, dv
    stream = cuda.CUstream(torch.cuda.current_stream(dev).cuda_stream)

    pre_args = [_to_cute(t) for t in (out, dout)] + [
        _to_cute(lse, 4, False), _to_cute(lse2, 16, False), _to_cute(delta, 16, False)]
    pre = _compiled("pre", (d, q.dtype), lambda: BwdPreprocess(d), *pre_args, stream)
    pre(*pre_args, stream)

    main_args = [_to_cute(t) for t in (q, k, v, dout)]
    main_args += [_to_cute(lse2, 16, False), _to_cute(delta, 16, False)]
    main_args += [_to_cute(t) for t in (dq_acc, dk_arg, dv_arg)]
    main_args += [_to_cute(dq_sem, 4, False), cutlass.Float32(softmax_scale)]
    main = _compiled("main", config, lambda: Sm90FlashBackward(config), *main_args, stream)
    main(*main_args, stream)

    post_dq_args = [_to_cute(dq_acc), _to_cute(dq)]
    # the accumulator's row pitch is a static shape: part of the compile key
    post = _compiled("post", (d, 1, q.dtype, dq_acc.shape[-1]), lambda: BwdPostprocess(d, 1),
                     *post_dq_args, stream)
    post(*post_dq_args, stream)
    if config.uses_gqa_buffers:
        g = group if config.gqa_reduce == "buffers" else 1
        for acc, res in ((dk_acc, dk), (dv_acc, dv)):
            args = [_to_cute(acc), _to_cute(res)]
            fn = _compiled("post", (d, g, q.dtype, acc.shape[-1]), lambda: BwdPostprocess(d, g),
                           *args, stream)
            fn(*args, stream)
    return dq, dk, dv


def fake_arguments(config: BwdConfig):
    """Fake arguments of the main kernel with the run-time/static split ``sm90_bwd`` uses:
    batch, sequence lengths, head counts (and so strides) are run-time values, head dims
    static. For cross-compiling on a CPU (``inspect_bwd``, the compile contract)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    from fa_sm100.config import cutlass_dtype

    dt = cutlass_dtype(config.dtype)
    d = config.head_dim
    b, sq, sk, h, hk = (cute.sym_int() for _ in range(5))
    sq_pad, sk_pad, h_acc, n_m = (cute.sym_int() for _ in range(4))
    rowmajor = lambda dtype, shape, align=16: make_fake_compact_tensor(
        dtype, shape, stride_order=tuple(range(len(shape) - 1, -1, -1)), assumed_align=align)
    q, do = rowmajor(dt, (b, sq, h, d)), rowmajor(dt, (b, sq, h, d))
    k, v = rowmajor(dt, (b, sk, hk, d)), rowmajor(dt, (b, sk, hk, d))
    lse2, delta = rowmajor(cutlass.Float32, (b, h, sq_pad)), rowmajor(cutlass.Float32, (b, h, sq_pad))
    dq_acc = rowmajor(cutlass.Float32, (b, h, sq_pad, config.dq_row_pitch))
    if config.uses_gqa_buffers:
        dk = rowmajor(cutlass.Float32, (b, h_acc, sk_pad, d))
        dv = rowmajor(cutlass.Float32, (b, h_acc, sk_pad, d))
    else:
        dk, dv = rowmajor(dt, (b, sk, h, d)), rowmajor(dt, (b, sk, h, d))
    sem = rowmajor(cutlass.Int32, (b, h, n_m), 4)
    return (q, k, v, do, lse2, delta, dq_acc, dk, dv, sem, cutlass.Float32(0.125),
            make_fake_stream())
