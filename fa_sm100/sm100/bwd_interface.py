"""``sm100_bwd``: gradients of attention on an SM100 (Blackwell) GPU.

Three kernels per call: the preprocess (Delta = rowsum(O dO), LSE2 = LSE log2(e), padded;
zeroes the dQ accumulator and the deterministic mode's semaphores: the Hopper one, plain
CUDA-core code), the SM100 main kernel
(``bwd_kernel.Sm100Backward``: writes dK, dV and adds into the float32 dQ accumulator) and
the postprocess (dq = softmax_scale x the accumulator, in the input dtype). The main kernel
sums dK / dV over a GQA group in TMEM, so there is no dK / dV postprocess.

Never run on hardware in this project (no SM100 GPU was available): the main kernel is held
by its compile contract and the PTX emulator (tests/test_sm100_bwd_*.py); the hardware test
(tests/test_sm100_gpu.py) skips off SM100.
"""

from __future__ import annotations

import torch

from fa_sm100 import kernel_cache
from fa_sm100.bands import kernel_window
from fa_sm100.sm100.bwd_config import select_sm100_bwd_config
from fa_sm100.validation import require_sm100
from layouts.smem import align_up

ARCH = "sm_100a"


def _compiled(kind: str, key, build, make_fake_args):
    def compile_it():
        import cutlass.cute as cute

        return cute.compile(build(), *make_fake_args(),
                            options=f"--gpu-arch {ARCH} --enable-tvm-ffi")

    return kernel_cache.kernel(f"sm100_bwd_{kind}", key, compile_it)


def sm100_bwd(dout, q, k, v, out, lse, softmax_scale=None, causal: bool = False,
              window_size=(None, None), deterministic: bool = False, softcap: float = 0.0):
    """(dq, dk, dv) of ``flash_attn_func``'s attention on an SM100 GPU, sliding windows and
    softcap included (their bounds and cap are launch arguments: one compiled kernel per
    "windowed or not" and "capped or not"). ``deterministic``: the dQ adds take turns in
    key-block order (Note [Deterministic dQ] in bwd_dq.py), so dq is bitwise reproducible.
    ValueError before any launch for what it does not do: head dims other than 64 / 96 / 128."""
    from fa_sm100.hopper.bwd_interface import (fake_post_arguments, fake_pre_arguments,
                                               validate_bwd_inputs)
    from fa_sm100.hopper.bwd_prepost import BwdPostprocess, BwdPreprocess
    from fa_sm100.sm100.bwd_inspect_entry import fake_arguments
    from fa_sm100.sm100.bwd_kernel import Sm100Backward
    from layouts.cute_layouts import cutlass_dtype

    scale, window, softcap = validate_bwd_inputs(dout, q, k, v, out, lse, softmax_scale, causal,
                                                 window_size, deterministic, softcap,
                                                 kernel="sm100_bwd")
    b, sq, hq, d = q.shape
    dtype = "bfloat16" if q.dtype == torch.bfloat16 else "float16"
    local = window != (None, None)
    cfg = select_sm100_bwd_config(d, v.shape[3], dtype, causal, hq // k.shape[2],
                                  deterministic, local=local, softcap=softcap > 0)
    left, right = kernel_window(causal, window, sq, k.shape[1]) if local else (0, 0)
    require_sm100(q.device, "sm100_bwd")
    dt = cutlass_dtype(dtype)
    q, k, v, out, dout = (t.contiguous() for t in (q, k, v, out, dout))
    rows = align_up(sq, cfg.m_block)
    f32 = dict(dtype=torch.float32, device=q.device)
    lse2, delta = torch.empty(b, hq, rows, **f32), torch.empty(b, hq, rows, **f32)
    dq_acc = torch.empty(b, hq, rows, d, **f32)
    # the dQ semaphores (Note [Deterministic dQ] in bwd_dq.py): one per query block, zeroed
    # by the preprocess; otherwise one unused slot for the preprocess to zero
    sem = torch.empty(b, hq, rows // cfg.m_block if deterministic else 1, dtype=torch.int32,
                      device=q.device)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    pre = _compiled("pre", (v.shape[3], d, dtype), lambda: BwdPreprocess(v.shape[3], d, False),
                    lambda: fake_pre_arguments(dt, v.shape[3]))
    main = _compiled("main", (cfg, hq), lambda: Sm100Backward(cfg),
                     lambda: fake_arguments(cfg, hq, env_stream=True))
    post = _compiled("post", (d, dtype), lambda: BwdPostprocess(d, 1, False),
                     lambda: fake_post_arguments(dt, d, d))
    pre(out, dout, lse.contiguous(), lse2, delta, dq_acc.view(b, hq, rows // cfg.m_block, -1),
        sem, None, None)
    main(q, k, v, dout, lse2, delta, dq_acc, dk, dv, sem if deterministic else None, scale,
         softcap, left, right)
    post(dq_acc, dq, scale, None, None, None)
    return dq, dk, dv
