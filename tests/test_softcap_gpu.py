"""Logit softcapping on an SM90 GPU: the forward (``sm90_fwd``, ``flash_attn_func``) and the
backward through autograd, against float64 under the project's rule (docs/testing.md):
err(kernel) <= 2 x err(the same capped attention done plainly in the input precision) + a
small slack; LSE, a float32 quantity in the kernel, against plain float32 with a slack of
``LSE_RTOL`` of its largest magnitude.

Caps from 1 (every score bent) to 50 (only the large ones), with causal, windows and a band
that leaves rows without keys, GQA, tails and seqlen_q != seqlen_k; outputs poisoned with NaN
first. Skips off SM90 with the reason (the ``sm90_device`` fixture).
"""

import zlib

import pytest
import torch

from fa_sm100.testing import (attention_reference, attention_reference_grads,
                              check_against_reference, grad_atol)
from fa_sm100.validation import normalize_window

pytestmark = pytest.mark.gpu

LSE_RTOL = 1e-5
# (softcap, causal, window)
PROBLEMS = [(1.0, False, (None, None)), (30.0, True, (None, None)), (5.0, False, (64, 0)),
            (50.0, True, (200, None)), (10.0, False, (20, -5))]
SHAPES = [(2, 1000, 1000, 4, 4), (1, 333, 2049, 4, 1), (3, 700, 300, 6, 2)]


def _inputs(shape, head_dims, dtype, seed, score_std=3.0):
    b, sq, sk, hq, hk = shape
    d, dv = head_dims
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype, generator=g) * score_std
    return (q.to(dtype), torch.randn(b, sk, hk, d, device="cuda", dtype=dtype, generator=g),
            torch.randn(b, sk, hk, dv, device="cuda", dtype=dtype, generator=g))


def check_forward(q, k, v, softcap, causal, window, out, lse, what):
    torch.cuda.synchronize()
    window = normalize_window(window)
    kw = dict(causal=causal, window=window, softcap=softcap)
    ref, ref_lse = attention_reference(q, k, v, **kw)
    plain, _ = attention_reference(q, k, v, dtype=q.dtype, upcast=False, **kw)
    check_against_reference(out, ref, plain, atol=1e-3, what=f"O {what}")
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty), f"LSE -inf rows {what}"
    if (~empty).any():
        _, plain32 = attention_reference(q, k, v, dtype=torch.float32, **kw)
        scale = max(1.0, float(ref_lse[~empty].abs().max()))
        check_against_reference(lse[~empty], ref_lse[~empty], plain32[~empty],
                                atol=LSE_RTOL * scale, what=f"LSE {what}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dims", [(64, 64), (96, 96), (128, 128), (192, 128), (256, 256)],
                         ids=lambda p: f"d{p[0]}_{p[1]}")
def test_softcapped_forward_matches_float64(sm90_device, head_dims, dtype):
    from fa_sm100.hopper.interface import sm90_fwd

    for shape in SHAPES:
        for softcap, causal, window in PROBLEMS:
            q, k, v = _inputs(shape, head_dims, dtype,
                              zlib.crc32(f"{shape}{head_dims}{dtype}{softcap}{window}".encode()))
            b, sq, hq, _ = q.shape
            out = torch.full((b, sq, hq, v.shape[3]), float("nan"), device="cuda", dtype=dtype)
            lse = torch.full((b, hq, sq), float("nan"), device="cuda", dtype=torch.float32)
            sm90_fwd(q, k, v, None, causal, window, True, out=out, lse=lse, softcap=softcap)
            check_forward(q, k, v, softcap, causal, window, out, lse,
                          f"{shape} {head_dims} {dtype} softcap={softcap} causal={causal} "
                          f"window={window}")


def test_a_new_cap_reuses_the_compiled_kernel(sm90_device):
    """The cap is a launch argument: caps of any size share one kernel per config."""
    from fa_sm100 import kernel_cache
    from fa_sm100.interface import flash_attn_func

    q, k, v = _inputs((1, 500, 600, 2, 2), (128, 128), torch.bfloat16, 4)
    flash_attn_func(q, k, v, softcap=30.0, return_lse=True)
    before = len(kernel_cache.records())
    for softcap in (1.0, 7.5, 100.0):
        out, lse = flash_attn_func(q, k, v, softcap=softcap, return_lse=True)
        check_forward(q, k, v, softcap, False, (None, None), out, lse, f"softcap={softcap}")
    assert len(kernel_cache.records()) == before


@pytest.mark.parametrize("softcap,causal,window", [(30.0, True, (-1, -1)), (2.0, False, (-1, -1)),
                                                   (20.0, True, (150, -1)), (5.0, False, (40, -3))])
@pytest.mark.parametrize("head_dims", [(64, 64), (96, 96), (128, 128), (192, 128), (256, 256)],
                         ids=lambda p: f"d{p[0]}_{p[1]}")
def test_softcapped_training_step_matches_float64(sm90_device, head_dims, softcap, causal,
                                                  window):
    """flash_attn_func with softcap through autograd: O and dq, dk, dv against float64
    autograd of the capped reference (GQA, seqlen_q != seqlen_k)."""
    from fa_sm100.interface import flash_attn_func

    q, k, v = _inputs((2, 700, 900, 4, 2), head_dims, torch.bfloat16, 8)
    dout = torch.randn(q.shape[:3] + (head_dims[1],), device="cuda", dtype=torch.bfloat16)
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    out = flash_attn_func(qg, kg, vg, causal=causal, window_size=window, softcap=softcap)
    out.backward(dout)
    window = normalize_window(window)
    out64, _, ref = attention_reference_grads(q, k, v, dout, causal, window, torch.float64,
                                              softcap=softcap)
    plain_out, _, plain = attention_reference_grads(q, k, v, dout, causal, window,
                                                    torch.bfloat16, upcast=False,
                                                    softcap=softcap)
    check_against_reference(out.detach(), out64, plain_out, atol=1e-3, what="O")
    for name, x, r, p in zip(("dq", "dk", "dv"), (qg.grad, kg.grad, vg.grad), ref, plain):
        check_against_reference(x, r, p, atol=grad_atol(r),
                                what=f"{name} softcap={softcap} {window}")


def test_softcapped_backward_is_deterministic_on_request(sm90_device):
    from fa_sm100.hopper.bwd_interface import sm90_bwd
    from fa_sm100.interface import flash_attn_func

    q, k, v = _inputs((2, 600, 600, 4, 1), (128, 128), torch.bfloat16, 12)
    out, lse = flash_attn_func(q, k, v, causal=True, softcap=30.0, return_lse=True)
    dout = torch.randn_like(out)
    runs = [sm90_bwd(dout, q, k, v, out, lse, causal=True, deterministic=True, softcap=30.0)
            for _ in range(3)]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)
