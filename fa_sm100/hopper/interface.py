"""``sm90_fwd``: validate, pick the config, compile once per config, launch on the torch stream."""

from __future__ import annotations

import contextlib
import threading
from typing import Optional

import torch

from fa_sm100.hopper.config import SM90_HEAD_DIMS, Sm90FwdConfig, select_sm90_fwd_config
from fa_sm100.validation import tma_ready, validate_attention_inputs

_TORCH_DTYPE_NAME = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
_compile_cache: dict = {}
_compile_lock = threading.Lock()


def sm90_config_for(problem, config: Optional[Sm90FwdConfig]) -> Sm90FwdConfig:
    """The config for a validated problem: the default one, or ``config`` checked against it."""
    dtype = _TORCH_DTYPE_NAME[problem.dtype]
    if config is None:
        return select_sm90_fwd_config(problem.head_dim, problem.head_dim_v, dtype, problem.causal,
                                      seqlen_k=problem.seqlen_k)
    if not isinstance(config, Sm90FwdConfig):
        raise ValueError(f"config must be an Sm90FwdConfig on SM90, got {type(config).__name__}")
    config = config.validate()
    want = {"head_dim": problem.head_dim, "head_dim_v": problem.head_dim_v, "dtype": dtype,
            "causal": problem.causal}
    for field, value in want.items():
        if getattr(config, field) != value:
            raise ValueError(f"config.{field}={getattr(config, field)!r} does not match the inputs "
                             f"({field}={value!r})")
    return config


def fake_arguments(cfg: Sm90FwdConfig):
    """Fake (b, s, h, d) tensors with dynamic sizes and 16-byte aligned dynamic strides, the
    softmax scale, the CTA count and a stream: the compile-time signature of the kernel."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    from fa_sm100.hopper.fwd_kernel import cutlass_dtype

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
    # softmax scale, CTA count of a persistent grid (the SM count), stream
    return (q, k, v, o, lse, cutlass.Float32(1.0), cutlass.Int32(132),
            make_fake_stream(use_tvm_ffi_env_stream=True))


@contextlib.contextmanager
def _runtime_arch(arch: str):
    """Tell the DSL that the machine runs ``arch`` while compiling for launch.

    The DSL builds a launchable function only when its runtime arch (CUTE_DSL_ARCH, read once
    at import; the test suite defaults it to sm_100a for cross-compiles) equals the compile
    target. sm90_fwd only compiles after the device was found to be sm_90, so this is true;
    the previous value is restored for other users of the process.
    """
    from cutlass.cutlass_dsl import CuTeDSL

    env = CuTeDSL._get_dsl().envar
    previous = env.arch
    env.arch = arch
    try:
        yield
    finally:
        env.arch = previous


def compile_sm90_fwd(cfg: Sm90FwdConfig, arch: str = "sm_90a"):
    """Compile (once per config) for launching from torch through TVM FFI."""
    key = (cfg, arch)
    with _compile_lock:
        if key not in _compile_cache:
            import cutlass.cute as cute

            from fa_sm100.hopper.fwd_kernel import Sm90FwdKernel

            with _runtime_arch(arch):
                _compile_cache[key] = cute.compile(
                    Sm90FwdKernel(cfg), *fake_arguments(cfg),
                    options=f"--gpu-arch {arch} --enable-tvm-ffi")
        return _compile_cache[key]


def sm90_fwd(q, k, v, softmax_scale=None, causal=False, window_size=(None, None), return_lse=False,
             config: Optional[Sm90FwdConfig] = None, *, out=None, lse=None):
    """Attention forward on an SM90 GPU. BSHD tensors; returns ``out`` or ``(out, lse)``.

    ``out`` / ``lse`` may be given (e.g. poisoned buffers in tests): they are written in place.
    LSE is (batch, heads, seqlen_q) float32 in natural-log units, -inf for rows with no key.
    """
    problem = validate_attention_inputs(q, k, v, softmax_scale, causal, window_size,
                                        head_dims=SM90_HEAD_DIMS)
    if problem.window != (None, None):
        raise ValueError(f"window_size={problem.window}: sliding windows are not supported by the "
                         "SM90 forward (use causal=True for a causal mask)")
    cfg = sm90_config_for(problem, config)
    cap = torch.cuda.get_device_capability(q.device)
    if cap != (9, 0):
        raise ValueError(f"sm90_fwd needs an sm_90 GPU, {q.device} is sm_{cap[0]}{cap[1]}")
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
    compiled(q, k, v, o_buf, lse if cfg.write_lse else None, problem.softmax_scale, num_sms)
    if o_buf is not out:
        out.copy_(o_buf)
    return (out, lse) if return_lse else out
