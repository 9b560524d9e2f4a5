"""The numerics emulation of the SM100 backward (``fa_sm100.emulation.backward``) on the CPU.

Contract: ``emulate_sm100_bwd``'s (dq, dk, dv) meet the project's float64 rule for gradients
(``adversarial.check_adversarial_grads``: against float64 autograd, at most twice the error of
the better plain 16-bit baseline plus ``testing.grad_atol``, no NaN) on a matrix of MHA, GQA
and MQA, causal with seqlen_q above and below seqlen_k, query and key tails, head dims 64 / 96
/ 128, bf16 and fp16, sliding windows and softcap, on a training step whose O and LSE come from
the forward's emulation, and on every gradient case of the adversarial list (the
``shift_down`` cases among them, whose rows make an unmasked key past seqlen_k overflow).
Invariants of the algorithm: rows that see no key get exactly zero dq, keys that no row sees
zero dk and dv; a GQA group's dq accumulator is the per-head MHA one bit for bit and its dK /
dV the sum of the per-head results within their roundings; and walking only the band's query
blocks (``bands.q_block_range``) gives the same bits as walking all of them, with fewer steps.

Bit identity with the kernel's own PTX is checked in tests/test_sm100_bwd_emulated.py (slow).
"""

import pytest
import torch

from fa_sm100 import adversarial
from fa_sm100.emulation import emulate_sm100_bwd, emulate_sm100_fwd
from fa_sm100.emulation.backward import preprocess_rows
from fa_sm100.testing import attention_mask

NO_WINDOW = (None, None)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

CASES = {
    # name: (batch, seqlen_q, seqlen_k, heads, kv heads, head_dim, dtype, causal, window, cap)
    "one_block": (1, 128, 128, 1, 1, 64, "bf16", False, NO_WINDOW, 0.0),
    "tails_gqa": (1, 200, 300, 2, 1, 64, "bf16", False, NO_WINDOW, 0.0),
    "causal_sq_gt_sk": (1, 300, 130, 2, 2, 64, "bf16", True, NO_WINDOW, 0.0),
    "causal_sq_lt_sk_mqa_batch2": (2, 130, 257, 4, 1, 64, "bf16", True, NO_WINDOW, 0.0),
    "hdim96_causal_fp16": (1, 129, 140, 3, 3, 96, "fp16", True, NO_WINDOW, 0.0),
    "hdim128_tails_gqa": (1, 200, 170, 4, 2, 128, "bf16", False, NO_WINDOW, 0.0),
    "hdim128_causal_long": (1, 700, 900, 2, 1, 128, "bf16", True, NO_WINDOW, 0.0),
    "window_causal_sq_gt_sk_gqa": (1, 300, 200, 2, 1, 64, "bf16", True, (60, None), 0.0),
    "window_two_sided_sq_lt_sk": (1, 200, 390, 1, 1, 64, "bf16", False, (50, 20), 0.0),
    "window_rows_without_keys": (1, 256, 160, 2, 2, 64, "bf16", False, (-20, 40), 0.0),
    "window_wide_gqa_fp16": (1, 384, 384, 4, 1, 64, "fp16", False, (200, 150), 0.0),
    "softcap_5_gqa": (1, 200, 300, 2, 1, 64, "bf16", False, NO_WINDOW, 5.0),
    "softcap_30_causal_hdim128": (1, 256, 256, 1, 1, 128, "bf16", True, NO_WINDOW, 30.0),
    "softcap_30_window_hdim96_fp16": (1, 200, 260, 2, 2, 96, "fp16", True, (70, None), 30.0),
}


def _inputs(b, sq, sk, h, hk, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    dt = DTYPES[dtype]
    q, k, v, dout = (torch.randn(b, s, n, d, generator=g).to(dt)
                     for s, n in ((sq, h), (sk, hk), (sk, hk), (sq, h)))
    return q, k, v, dout


def _case(name):
    b, sq, sk, h, hk, d, dtype, causal, window, cap = CASES[name]
    return _inputs(b, sq, sk, h, hk, d, dtype), dict(causal=causal, window_size=window,
                                                      softcap=cap)


def _rule(name, res, q, k, v, dout, causal, window_size, softcap):
    adversarial.check_adversarial_grads(name, (res.dq, res.dk, res.dv), q, k, v, dout,
                                        causal=causal, window=window_size, softcap=softcap)


@pytest.mark.parametrize("name", list(CASES))
def test_emulation_meets_the_float64_rule(name):
    (q, k, v, dout), opts = _case(name)
    _rule(name, emulate_sm100_bwd(dout, q, k, v, **opts), q, k, v, dout, **opts)


@pytest.mark.parametrize("name", ["causal_sq_lt_sk_mqa_batch2", "softcap_30_window_hdim96_fp16"])
def test_emulated_training_step_meets_the_rule(name):
    """The backward from the forward emulation's own O and LSE (Delta from the 16-bit O the
    forward wrote, LSE2 from its float32 LSE), as a training step runs them."""
    (q, k, v, dout), opts = _case(name)
    out, lse = emulate_sm100_fwd(q, k, v, causal=opts["causal"],
                                 window_size=opts["window_size"], softcap=opts["softcap"])
    _rule(name, emulate_sm100_bwd(dout, q, k, v, out, lse, **opts), q, k, v, dout, **opts)


GRADIENT_CASES = [c.name for c in adversarial.gradient_cases()]


def _adversarial(name):
    case = adversarial.BY_NAME[name]
    q, k, v = case.inputs()
    dout = torch.randn(q.shape[:3] + (v.shape[3],),
                       generator=torch.Generator().manual_seed(0)).to(q.dtype)
    return case, (q, k, v, dout), dict(causal=case.causal, window_size=case.window,
                                       softcap=case.softcap)


@pytest.mark.parametrize("name", GRADIENT_CASES)
def test_emulation_on_the_adversarial_gradient_cases(name):
    case, (q, k, v, dout), opts = _adversarial(name)
    _rule(name, emulate_sm100_bwd(dout, q, k, v, **opts), q, k, v, dout, **opts)


def test_the_shift_down_cases_reach_the_key_tail_hazard():
    """The ``shift_down`` gradient cases really test the mask of keys past seqlen_k: their
    last key block holds such keys (zeros: score 0), and some row's LSE2 is so low that an
    unmasked one would have P = exp2(0 - LSE2) = inf in float32."""
    names = [n for n in GRADIENT_CASES if adversarial.BY_NAME[n].kind == "shift_down"]
    assert len(names) >= 2
    for name in names:
        case, (q, k, v, dout), opts = _adversarial(name)
        assert case.seqlen_k % 128, f"{name}: no key past seqlen_k in the last block"
        lse2, _ = preprocess_rows(q, k, v, dout, case.softmax_scale, case.causal, 128,
                                  case.window, case.softcap)
        assert torch.isinf(torch.exp2(-lse2[:, :, :case.seqlen_q])).any(), name


@pytest.mark.parametrize("name", ["window_rows_without_keys", "causal_sq_gt_sk"])
def test_rows_without_keys_get_zero_gradients(name):
    (q, k, v, dout), opts = _case(name)
    res = emulate_sm100_bwd(dout, q, k, v, **opts)
    sq, sk = q.shape[1], k.shape[1]
    visible = attention_mask(sq, sk, opts["causal"], opts["window_size"])
    no_key, unseen = ~visible.any(dim=1), ~visible.any(dim=0)
    assert no_key.any()
    assert torch.count_nonzero(res.dq[:, no_key]) == 0
    assert torch.count_nonzero(res.dq_acc[:, :, :sq][:, :, no_key]) == 0
    assert torch.count_nonzero(res.dq[:, ~no_key]) > 0
    if unseen.any():
        assert torch.count_nonzero(res.dk[:, unseen]) == 0
        assert torch.count_nonzero(res.dv[:, unseen]) == 0


@pytest.mark.parametrize("causal,window", [(True, NO_WINDOW), (False, (40, 10))])
def test_gqa_group_is_the_sum_of_its_heads(causal, window):
    """GQA (4 query heads on one KV head) against MHA with the KV head repeated: dq's
    accumulator takes the same adds in the same order, bit for bit; dK / dV sum the group's
    heads in one float32 accumulator and round once, the MHA heads round each, so they agree
    within those 16-bit roundings (u per head, relative) and the float32 roundings of the
    accumulation order (one per MMA instruction)."""
    q, k, v, dout = _inputs(1, 200, 300, 4, 1, 64, "bf16", seed=3)
    opts = dict(causal=causal, window_size=window)
    gqa = emulate_sm100_bwd(dout, q, k, v, **opts)
    mha = emulate_sm100_bwd(dout, q, k.repeat_interleave(4, dim=2),
                            v.repeat_interleave(4, dim=2), **opts)
    assert torch.equal(gqa.dq_acc.view(torch.int32), mha.dq_acc.view(torch.int32))
    u16, u32 = 2.0**-8, 2.0**-24
    instructions = sum(gqa.steps.values()) * 128 // 16
    for name, group, heads in (("dk", gqa.dk, mha.dk), ("dv", gqa.dv, mha.dv)):
        per_head = heads.to(torch.float64)
        total = per_head.sum(2, keepdim=True)
        bound = (u16 * (group.to(torch.float64).abs() + per_head.abs().sum(2, keepdim=True))
                 + instructions * u32 * float(per_head.abs().sum(2).max()))
        diff = (group.to(torch.float64) - total).abs()
        assert bool((diff <= bound).all()), f"{name}: {float((diff - bound).max()):.3e} over"
        assert float(diff.max()) > 0  # the roundings do differ: the group is summed in TMEM


@pytest.mark.parametrize("name", ["causal_sq_gt_sk", "window_two_sided_sq_lt_sk",
                                  "window_rows_without_keys", "softcap_30_window_hdim96_fp16"])
def test_the_band_walk_skips_only_blocks_that_add_nothing(name):
    """A key block's CTA walks the query blocks of ``bands.q_block_range``; walking every
    query block instead adds P = 0 and dS = 0 from the others, and the results are the same
    to the bit (an exact zero changes no float32 sum), in fewer steps."""
    (q, k, v, dout), opts = _case(name)
    band = emulate_sm100_bwd(dout, q, k, v, **opts)
    every = emulate_sm100_bwd(dout, q, k, v, walk="all", **opts)
    assert sum(band.steps.values()) < sum(every.steps.values())
    for a, b, bits in ((band.dq_acc, every.dq_acc, torch.int32), (band.dk, every.dk, torch.int16),
                       (band.dv, every.dv, torch.int16)):
        assert torch.equal(a.view(bits), b.view(bits))
