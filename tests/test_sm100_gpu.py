"""Hardware tests of the SM100 forward (issue 4, item 7): skipped off SM100, with the reason.

Contract, on an sm_100 GPU: for every feature (bf16/fp16, causal and not, MHA/GQA/MQA, head
dims 64/96/128/(192,128), tails, seqlen_q != seqlen_k, softmax_scale, sliding windows with
run-time bounds, softcap) the
output's max error against a float64 reference is at most twice the error of the same
attention computed in the input precision (plus a small absolute slack), the LSE matches the
reference's, and flipping any single switch of FmhaConfig gives the same result within that
tolerance. The backward through autograd (``sm100_bwd``, windows and softcap included) gives
(dq, dk, dv) under the same rule against float64 autograd.
None of this has run on Blackwell hardware here (no SM100 GPU was reachable).
"""

import math

import pytest
import torch

from fa_sm100.config import select_config
from fa_sm100.testing import attention_reference, check_against_reference

pytestmark = pytest.mark.gpu


def _inputs(b, sq, sk, h, hk, d, dv, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda s, hh, dd: torch.randn(b, s, hh, dd, device="cuda", dtype=dtype, generator=g)  # noqa: E731
    return mk(sq, h, d), mk(sk, hk, d), mk(sk, hk, dv)


def _check(out, lse, q, k, v, scale, causal):
    ref, ref_lse = attention_reference(q, k, v, softmax_scale=scale, causal=causal)
    plain, _ = attention_reference(q, k, v, softmax_scale=scale, causal=causal, dtype=q.dtype,
                                   upcast=False)
    check_against_reference(out, ref, plain, atol=1e-3, what="O")
    if lse is not None:
        finite = torch.isfinite(ref_lse)
        assert torch.equal(finite, torch.isfinite(lse)), "LSE: -inf rows differ"
        assert torch.allclose(lse[finite].double(), ref_lse[finite], atol=2e-3, rtol=1e-3)


FEATURES = [
    # (batch, seqlen_q, seqlen_k, heads, kv heads, d, dv, dtype, causal, scale)
    (2, 1024, 1024, 4, 4, 128, 128, torch.bfloat16, False, None),
    (2, 1024, 1024, 4, 4, 128, 128, torch.float16, True, None),
    (1, 1000, 777, 8, 2, 128, 128, torch.bfloat16, True, 0.1),  # tails, GQA, sq > sk causal
    (1, 300, 2049, 8, 1, 64, 64, torch.bfloat16, True, None),  # MQA, sq < sk causal
    (2, 513, 513, 4, 4, 96, 96, torch.float16, False, None),
    (1, 777, 1500, 4, 4, 192, 128, torch.bfloat16, False, 0.05),
    (1, 1, 129, 2, 2, 128, 128, torch.bfloat16, False, None),  # a single query row
]

WINDOWS = [
    # (seqlen_q, seqlen_k, causal, (left, right))
    (1024, 1024, True, (256, 0)),
    (700, 1500, False, (128, 64)),
    (1500, 700, False, (None, 100)),
]


@pytest.mark.parametrize("case", FEATURES, ids=[f"f{i}" for i in range(len(FEATURES))])
def test_forward_matches_float64_reference(sm100_device, case):
    from fa_sm100.sm100.interface import sm100_fwd

    b, sq, sk, h, hk, d, dv, dtype, causal, scale = case
    q, k, v = _inputs(b, sq, sk, h, hk, d, dv, dtype)
    out, lse = sm100_fwd(q, k, v, softmax_scale=scale, causal=causal, return_lse=True)
    torch.cuda.synchronize()
    _check(out, lse, q, k, v, scale if scale is not None else 1.0 / math.sqrt(d), causal)


@pytest.mark.parametrize("case", WINDOWS, ids=[f"w{i}" for i in range(len(WINDOWS))])
def test_sliding_window_matches_float64_reference(sm100_device, case):
    from fa_sm100.sm100.interface import sm100_fwd

    sq, sk, causal, window = case
    q, k, v = _inputs(2, sq, sk, 4, 2, 128, 128, torch.bfloat16, seed=2)
    out, lse = sm100_fwd(q, k, v, causal=causal, window_size=window, return_lse=True)
    torch.cuda.synchronize()
    ref, ref_lse = attention_reference(q, k, v, causal=causal, window=window)
    plain, _ = attention_reference(q, k, v, causal=causal, window=window, dtype=q.dtype,
                                   upcast=False)
    check_against_reference(out, ref, plain, atol=1e-3, what="O")
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert torch.allclose(lse[finite].double(), ref_lse[finite], atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("softcap,causal,window", [(30.0, True, (None, None)),
                                                   (5.0, False, (64, 16)),
                                                   (10.0, False, (-3, 40))])
def test_softcap_matches_float64_reference(sm100_device, softcap, causal, window):
    """Logit softcapping (docs/softcap.md), with windows and a band shifted past the
    diagonal: O under the rule, LSE against float32 plain attention with a slack of 1e-5 of its
    largest magnitude."""
    from fa_sm100.sm100.interface import sm100_fwd

    q, k, v = _inputs(2, 1500, 1700, 4, 2, 128, 128, torch.bfloat16, seed=5)
    q = q * 3  # scores of a few caps
    out, lse = sm100_fwd(q, k, v, causal=causal, window_size=window, return_lse=True,
                         softcap=softcap)
    torch.cuda.synchronize()
    kw = dict(causal=causal, window=window, softcap=softcap)
    ref, ref_lse = attention_reference(q, k, v, **kw)
    plain, _ = attention_reference(q, k, v, dtype=q.dtype, upcast=False, **kw)
    check_against_reference(out, ref, plain, atol=1e-3, what="O")
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    _, plain32 = attention_reference(q, k, v, dtype=torch.float32, **kw)
    check_against_reference(lse[finite], ref_lse[finite], plain32[finite],
                            atol=1e-5 * float(ref_lse[finite].abs().max()), what="LSE")


def test_new_windows_and_caps_reuse_the_compiled_kernel(sm100_device):
    """Window bounds and the cap are launch arguments (fa_sm100.bands, docs/softcap.md)."""
    from fa_sm100 import kernel_cache
    from fa_sm100.sm100.interface import sm100_fwd

    q, k, v = _inputs(1, 700, 900, 2, 2, 128, 128, torch.bfloat16, seed=6)
    sm100_fwd(q, k, v, window_size=(64, 0), softcap=5.0, return_lse=True)
    before = len(kernel_cache.records())
    # both sides bounded in every call: "which sides are bounded" is compile-time
    for window, softcap in (((65, 3), 5.0), ((1, 200), 30.0), ((-2, 300), 0.5)):
        out, _ = sm100_fwd(q, k, v, window_size=window, softcap=softcap, return_lse=True)
        torch.cuda.synchronize()
        ref, _ = attention_reference(q, k, v, window=window, softcap=softcap)
        plain, _ = attention_reference(q, k, v, window=window, softcap=softcap, dtype=q.dtype,
                                       upcast=False)
        check_against_reference(out, ref, plain, atol=1e-3, what=f"O {window} {softcap}")
    assert len(kernel_cache.records()) == before


SWITCHES = [
    {"q_stage": 1},
    {"use_2cta": False},
    {"split_p": False},
    {"ex2_emu_fraction": 0.0},
    {"ex2_emu_fraction": 1.0},
    {"rescale_threshold": 0.0},
    {"kv_stage": 2},
    {"persistent": False},
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("switch", SWITCHES, ids=[",".join(f"{k}={v}" for k, v in s.items())
                                                  for s in SWITCHES])
def test_each_switch_gives_the_same_result(sm100_device, switch, causal):
    from fa_sm100.sm100.interface import sm100_fwd

    q, k, v = _inputs(2, 1100, 1300, 4, 2, 128, 128, torch.bfloat16, seed=1)
    base = select_config(128, 128, "bfloat16", 1100, 1300, causal, qhead_per_kvhead=2)
    flipped = base.replace(**switch)
    if "q_stage" in switch:
        flipped = flipped.replace(use_2cta=False, kv_stage=3)
    if "use_2cta" in switch:
        flipped = flipped.replace(kv_stage=3)
    out_a = sm100_fwd(q, k, v, causal=causal, config=base)
    out_b = sm100_fwd(q, k, v, causal=causal, config=flipped.validate())
    torch.cuda.synchronize()
    _check(out_b, None, q, k, v, 1.0 / math.sqrt(128), causal)
    assert (out_a.float() - out_b.float()).abs().max().item() < 2e-2


BWD_CASES = [
    # (batch, seqlen_q, seqlen_k, heads, kv heads, head_dim, dtype, causal)
    (2, 1000, 1000, 4, 4, 128, torch.bfloat16, True),
    (1, 333, 517, 8, 2, 64, torch.float16, False),
    (2, 700, 300, 6, 1, 96, torch.bfloat16, True),
    (1, 128, 4096, 4, 4, 128, torch.bfloat16, False),
]


@pytest.mark.parametrize("case", BWD_CASES)
def test_backward_matches_float64_autograd(sm100_device, case):
    """``flash_attn_func`` with autograd on SM100 (``sm100_bwd``): O and (dq, dk, dv) under
    the float64 rule (``check_training_step``); tails, GQA / MQA, seqlen_q != seqlen_k."""
    import fa_sm100
    from fa_sm100.testing import check_training_step

    b, sq, sk, h, hk, d, dtype, causal = case
    q, k, v = _inputs(b, sq, sk, h, hk, d, d, dtype)
    dout = torch.randn(b, sq, h, d, device="cuda", dtype=dtype)
    check_training_step(lambda q, k, v: fa_sm100.flash_attn_func(q, k, v, causal=causal),
                        q, k, v, dout, causal=causal, what=str(case))


BWD_WINDOW_CASES = [
    # (batch, seqlen_q, seqlen_k, heads, kv heads, head_dim, causal, window, softcap)
    (2, 1000, 1200, 4, 2, 128, True, (256, None), 0.0),
    (1, 900, 700, 4, 4, 64, False, (100, 50), 0.0),
    (1, 600, 500, 2, 2, 96, False, (-30, 60), 0.0),  # rows that see no key
    (2, 700, 700, 4, 1, 128, True, (None, None), 30.0),
    (1, 500, 800, 4, 2, 64, False, (200, 0), 5.0),
]


@pytest.mark.parametrize("case", BWD_WINDOW_CASES)
def test_backward_with_window_or_softcap_matches_float64_autograd(sm100_device, case):
    """``flash_attn_func`` with a sliding window and / or softcap and autograd on SM100: O and
    (dq, dk, dv) under the float64 rule, rows without keys included."""
    import fa_sm100
    from fa_sm100.testing import check_training_step

    b, sq, sk, h, hk, d, causal, window, softcap = case
    q, k, v = _inputs(b, sq, sk, h, hk, d, d, torch.bfloat16)
    if softcap:
        q = q * 4  # scores of a few caps: the cap bends them
    dout = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
    check_training_step(lambda q, k, v: fa_sm100.flash_attn_func(
        q, k, v, causal=causal, window_size=window, softcap=softcap), q, k, v, dout,
        causal=causal, window=window, softcap=softcap, what=str(case))
