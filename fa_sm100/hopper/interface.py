"""``sm90_fwd``: validate, pick the config, compile once per config, launch on the torch stream.

``prepare_sm90_fwd`` does everything but the launch and returns the launch as a callable (what
``scripts/benchmark.py`` times).
"""

from __future__ import annotations

import threading
from typing import Optional

import torch

from fa_sm100.config import normalize_dtype
from fa_sm100.hopper import probes
from fa_sm100.hopper.config import (SM90_ARCH, SM90_HEAD_DIMS, Sm90FwdConfig,
                                    select_sm90_fwd_config)
from fa_sm100.validation import require_sm90, tma_ready, validate_attention_inputs

_compile_cache: dict = {}
_compile_lock = threading.Lock()
_tile_counters: dict = {}


def tile_counter(device: torch.device) -> torch.Tensor:
    """The dynamic schedule's work-tile counter for launches on ``device``'s current stream.

    One int32 per (device, stream), zero when made; each launch leaves it at zero again (Note
    [Dynamic tile schedule] in ``fwd_kernel.py``), so launches that follow each other in one
    stream share it, and launches on different streams, which may overlap, do not.
    """
    stream = torch.cuda.current_stream(device)
    key = (stream.device, stream.cuda_stream)
    counter = _tile_counters.get(key)
    if counter is None:
        counter = _tile_counters[key] = torch.zeros(1, dtype=torch.int32, device=stream.device)
    return counter


def sm90_config_for(problem, config: Optional[Sm90FwdConfig], need_lse: bool = False) -> Sm90FwdConfig:
    """The config for a validated problem: the default one, or ``config`` checked against it.

    ``need_lse``: the caller reads LSE (``return_lse``, an ``lse`` buffer, or the backward of
    autograd, which always asks for it); a config with ``write_lse=False`` would leave that
    buffer unwritten, so it is a ValueError. The default config writes LSE only then, as the
    SM100 path (``config_for_problem``) and FA4 do: a call without it skips the log and the
    stores.
    """
    dtype = normalize_dtype(problem.dtype)
    if config is None:
        return select_sm90_fwd_config(problem.head_dim, problem.head_dim_v, dtype, problem.causal,
                                      write_lse=need_lse, seqlen_k=problem.seqlen_k,
                                      seqlen_q=problem.seqlen_q,
                                      batch_heads=problem.batch * problem.heads)
    if not isinstance(config, Sm90FwdConfig):
        raise ValueError(f"config must be an Sm90FwdConfig on SM90, got {type(config).__name__}")
    config = config.validate()
    want = {"head_dim": problem.head_dim, "head_dim_v": problem.head_dim_v, "dtype": dtype,
            "causal": problem.causal}
    for field, value in want.items():
        if getattr(config, field) != value:
            raise ValueError(f"config.{field}={getattr(config, field)!r} does not match the inputs "
                             f"({field}={value!r})")
    if need_lse and not config.write_lse:
        raise ValueError("config.write_lse=False, but LSE is needed (return_lse=True, an lse "
                         "buffer, or gradients): use a config with write_lse=True")
    batch_heads = problem.batch * problem.heads
    if config.kv_multicast and not config.multicast_fits(problem.seqlen_q, batch_heads):
        odd = (" (an odd count pairs across heads only with kv_cluster=2, multicast_odd_m=True "
               "and an even number of (batch, head) pairs)")
        raise ValueError(f"config.kv_multicast=True groups the CTAs of neighbouring m blocks of "
                         f"a head in clusters of {config.kv_cluster}, but "
                         f"seqlen_q={problem.seqlen_q} gives "
                         f"{config.num_m_blocks(problem.seqlen_q)} blocks of {config.m_block} "
                         f"rows and there are {batch_heads} (batch, head) pairs{odd}: use "
                         f"kv_multicast=False")
    return config


def fake_arguments(cfg: Sm90FwdConfig):
    """Fake (b, s, h, d) tensors with dynamic sizes and 16-byte aligned dynamic strides, the
    softmax scale, the CTA count and a stream: the compile-time signature of the kernel."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    from fa_sm100.config import cutlass_dtype

    dt = cutlass_dtype(cfg.dtype)
    b, sq, sk, h, hk = (cute.sym_int(symbol=s) for s in ("b", "sq", "sk", "h", "hk"))

    def bshd(s, heads, d):
        strides = tuple(cute.sym_int64(divisibility=8) for _ in range(3))
        return make_fake_tensor(dt, (b, s, heads, d), (*strides, 1), assumed_align=16)

    q, k = bshd(sq, h, cfg.head_dim), bshd(sk, hk, cfg.head_dim)
    v, o = bshd(sk, hk, cfg.head_dim_v), bshd(sq, h, cfg.head_dim_v)
    lse = None
    if cfg.write_lse:
        lse = make_fake_tensor(cutlass.Float32, (b, h, sq),
                               (cute.sym_int64(), cute.sym_int64(), 1), assumed_align=4)
    counter = None
    if cfg.dynamic_schedule:
        counter = make_fake_tensor(cutlass.Int32, (1,), (1,), assumed_align=4)
    # softmax scale, CTA count of a persistent grid (the SM count), stream
    return (q, k, v, o, lse, counter, cutlass.Float32(1.0), cutlass.Int32(132),
            make_fake_stream(use_tvm_ffi_env_stream=True))


def compile_sm90_fwd(cfg: Sm90FwdConfig, arch: str = SM90_ARCH):
    """Compile (once per config, and per active forward probe: Note [cost probes]) for
    launching from torch through TVM FFI."""
    key = (cfg, arch, probes.compile_tag(probes.FWD_KERNEL_PROBES))
    with _compile_lock:
        if key not in _compile_cache:
            import cutlass.cute as cute

            from fa_sm100.hopper.common import dsl_runtime_arch
            from fa_sm100.hopper.fwd_kernel import Sm90FwdKernel

            with dsl_runtime_arch(arch):
                _compile_cache[key] = cute.compile(
                    Sm90FwdKernel(cfg), *fake_arguments(cfg),
                    options=f"--gpu-arch {arch} --enable-tvm-ffi")
        return _compile_cache[key]


def prepare_sm90_fwd(q, k, v, softmax_scale=None, causal=False, window_size=(None, None),
                     return_lse=False, config: Optional[Sm90FwdConfig] = None, *, out=None,
                     lse=None):
    """Everything ``sm90_fwd`` does before the launch: validate, pick and compile the config,
    allocate ``out`` / ``lse``, query the SM count. Returns a no-argument callable that
    launches the kernel on these tensors and returns ``out`` or ``(out, lse)``.

    Each call of the callable recomputes attention of the current contents of q, k, v (their
    shapes, strides and storage must stay as they were). Benchmarks time the callable, so the
    per-call work is the launch alone.
    """
    problem = validate_attention_inputs(q, k, v, softmax_scale, causal, window_size,
                                        head_dims=SM90_HEAD_DIMS)
    if problem.window != (None, None):
        raise ValueError(f"window_size={problem.window}: sliding windows are not supported by the "
                         "SM90 forward (use causal=True for a causal mask)")
    cfg = sm90_config_for(problem, config, need_lse=return_lse or lse is not None)
    require_sm90(q.device, "sm90_fwd")
    b, sq, h, dv = problem.batch, problem.seqlen_q, problem.heads, problem.head_dim_v
    if out is None:
        out = torch.empty((b, sq, h, dv), dtype=q.dtype, device=q.device)
    elif out.shape != (b, sq, h, dv) or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be a {q.dtype} tensor of shape {(b, sq, h, dv)} with unit last stride")
    if lse is None:
        lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
    elif lse.shape != (b, h, sq) or lse.dtype != torch.float32 or lse.stride(-1) != 1:
        raise ValueError(f"lse must be a float32 tensor of shape {(b, h, sq)} with unit last stride")
    q, k, v = (tma_ready(t) for t in (q, k, v))
    o_buf = tma_ready(out)
    compiled = compile_sm90_fwd(cfg)
    num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    lse_arg = lse if cfg.write_lse else None
    counter = tile_counter(q.device) if cfg.dynamic_schedule else None
    scale = problem.softmax_scale

    def launch():
        compiled(q, k, v, o_buf, lse_arg, counter, scale, num_sms)
        if o_buf is not out:
            out.copy_(o_buf)
        return (out, lse) if return_lse else out

    return launch


def sm90_fwd(q, k, v, softmax_scale=None, causal=False, window_size=(None, None), return_lse=False,
             config: Optional[Sm90FwdConfig] = None, *, out=None, lse=None):
    """Attention forward on an SM90 GPU. BSHD tensors; returns ``out`` or ``(out, lse)``.

    ``out`` / ``lse`` may be given (e.g. poisoned buffers in tests): they are written in place.
    LSE is (batch, heads, seqlen_q) float32 in natural-log units, -inf for rows with no key.
    """
    return prepare_sm90_fwd(q, k, v, softmax_scale, causal, window_size, return_lse, config,
                            out=out, lse=lse)()
