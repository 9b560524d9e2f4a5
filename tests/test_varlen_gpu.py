"""Variable-length batches on an SM90 GPU (``flash_attn_varlen_func``, ``sm90_fwd_varlen``):
each packed sequence against the float64 reference of that sequence alone, under the
project's rule (docs/testing.md). Batches hold a zero-length sequence, sequences shorter
than one tile and longer than several, queries and keys of different lengths, and keys used
only in part (``seqused_k``, the unused ones poisoned with NaN and inf:
``fa_sm100.adversarial.poison_unused_keys``); outputs are poisoned with NaN first, so an unwritten row fails
and a row written past its sequence's end (into the next one) shows as a wrong row there.
Skips off SM90 with the reason (the ``sm90_device`` fixture); the SM100 cases (the same checks
on ``sm100_fwd_varlen``) skip off SM100.
"""

import pytest
import torch

from fa_sm100.adversarial import poison_unused_keys
from fa_sm100.testing import attention_reference, check_against_reference
from fa_sm100.validation import normalize_window

pytestmark = pytest.mark.gpu

LSE_RTOL = 1e-5
# query and key lengths per sequence: self-attention, then cross lengths (a sequence with no
# keys, one with keys and no queries)
LENGTHS = {
    "self": ([300, 0, 1, 77, 128, 1000, 2049], None),
    "cross": ([5, 130, 0, 600, 64, 1], [700, 0, 9, 128, 2000, 333]),
}
HEAD_DIMS = [(64, 64), (128, 128), (192, 128), (256, 256)]
MODES = [  # (causal, window, softcap)
    (False, (None, None), 0.0),
    (True, (None, None), 0.0),
    (False, (64, 16), 0.0),
    (True, (128, None), 0.0),
    (True, (None, None), 30.0),
]


def mode_id(mode) -> str:
    causal, (left, right), softcap = mode
    return f"c{int(causal)}w{left}_{right}s{softcap:g}"


def _pack(lengths, heads, d, dtype, g, extra=0):
    total = sum(lengths) + extra
    x = torch.randn(total, heads, d, device="cuda", dtype=dtype, generator=g)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32,
                      device="cuda")
    return x, cu


def run_and_check(lens_q, lens_k, head_dims, dtype, causal, window, softcap, heads=(4, 2),
                  used=None, seed=0, forward=None):
    """One varlen call (``forward``: the SM90 one by default); every sequence's rows against
    its own float64 reference."""
    from fa_sm100.hopper.interface import sm90_fwd_varlen

    forward = forward or sm90_fwd_varlen

    d, dv = head_dims
    hq, hk = heads
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, cu_q = _pack(lens_q, hq, d, dtype, g)
    k, cu_k = _pack(lens_k, hk, d, dtype, g)
    v = torch.randn(k.shape[0], hk, dv, device="cuda", dtype=dtype, generator=g)
    out = torch.full((q.shape[0], hq, dv), float("nan"), device="cuda", dtype=dtype)
    lse = torch.full((hq, q.shape[0]), float("nan"), device="cuda", dtype=torch.float32)
    seqused = None
    if used is not None:  # the unused keys hold NaN and inf: they must not reach O
        seqused = torch.tensor(used, dtype=torch.int32, device="cuda")
        poison_unused_keys(k, v, cu_k, seqused)
    forward(q, k, v, cu_q, cu_k, max(lens_q), max(used or lens_k), seqused, None, causal,
            window, softcap, True, out=out, lse=lse)
    torch.cuda.synchronize()
    win = normalize_window(window)
    for i, (sq, sk) in enumerate(zip(lens_q, used or lens_k)):
        what = f"sequence {i} ({sq} x {sk})"
        rows = slice(int(cu_q[i]), int(cu_q[i]) + sq)
        if sq == 0:
            continue
        keys = slice(int(cu_k[i]), int(cu_k[i]) + sk)
        o, l = out[rows].unsqueeze(0), lse[:, rows].unsqueeze(0)
        if sk == 0:  # no keys: O = 0, LSE = -inf
            assert not o.isnan().any() and not o.any() and torch.isneginf(l).all(), what
            continue
        qi, ki, vi = q[rows].unsqueeze(0), k[keys].unsqueeze(0), v[keys].unsqueeze(0)
        ref, ref_lse = attention_reference(qi, ki, vi, causal=causal, window=win,
                                           softcap=softcap)
        plain, _ = attention_reference(qi, ki, vi, causal=causal, window=win, dtype=dtype,
                                       upcast=False, softcap=softcap)
        check_against_reference(o, ref, plain, atol=1e-3, what=f"O {what}")
        empty = torch.isneginf(ref_lse)
        assert torch.equal(torch.isneginf(l), empty), f"LSE -inf rows {what}"
        if (~empty).any():
            _, plain32 = attention_reference(qi, ki, vi, causal=causal, window=win,
                                             dtype=torch.float32, softcap=softcap)
            scale = max(1.0, float(ref_lse[~empty].abs().max()))
            check_against_reference(l[~empty], ref_lse[~empty], plain32[~empty],
                                    atol=LSE_RTOL * scale, what=f"LSE {what}")
    assert not out.isnan().any() and not lse.isnan().any(), "a row was not written"


@pytest.mark.parametrize("head_dims", HEAD_DIMS,
                         ids=lambda h: f"d{h[0]}x{h[1]}")
@pytest.mark.parametrize("lengths", list(LENGTHS), ids=str)
@pytest.mark.parametrize("mode", MODES, ids=mode_id)
def test_varlen_forward(sm90_device, head_dims, lengths, mode):
    lens_q, lens_k = LENGTHS[lengths]
    run_and_check(lens_q, lens_k or lens_q, head_dims, torch.bfloat16, *mode)


@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (3, 1)], ids=lambda h: f"h{h[0]}kv{h[1]}")
def test_varlen_fp16_gqa_and_used_keys(sm90_device, heads):
    """fp16, GQA / MQA, and a key cache longer than what each sequence uses."""
    lens_q = [1, 200, 0, 513]
    lens_k = [300, 256, 10, 1024]
    used = [300, 17, 0, 1000]
    run_and_check(lens_q, lens_k, (128, 128), torch.float16, True, (None, None), 0.0,
                  heads=heads, used=used, seed=1)
    run_and_check(lens_q, lens_k, (64, 64), torch.float16, False, (None, None), 0.0,
                  heads=heads, used=used, seed=2)


def test_varlen_public_api_and_errors(sm90_device):
    """``flash_attn_varlen_func`` returns what flash-attn 2's does; bad inputs raise before
    anything runs; an empty pack returns zeros."""
    import fa_sm100

    g = torch.Generator(device="cuda").manual_seed(3)
    q, cu = _pack([100, 28], 2, 64, torch.bfloat16, g)
    out = fa_sm100.flash_attn_varlen_func(q, q, q, cu, cu, 100, 100, causal=True)
    assert out.shape == q.shape
    out2, lse, probs = fa_sm100.flash_attn_varlen_func(q, q, q, cu, cu, 100, 100, causal=True,
                                                       return_attn_probs=True)
    assert torch.equal(out, out2) and lse.shape == (2, 128) and probs is None
    with pytest.raises(ValueError, match="int32"):
        fa_sm100.flash_attn_varlen_func(q, q, q, cu.long(), cu, 100, 100)
    with pytest.raises(ValueError, match="3-D"):
        fa_sm100.flash_attn_varlen_func(q[None], q, q, cu, cu, 100, 100)
    with pytest.raises(ValueError, match="sequences"):
        fa_sm100.flash_attn_varlen_func(q, q, q, cu, cu[:2], 100, 100)
    empty = q[:0]
    zero_cu = torch.zeros(3, dtype=torch.int32, device="cuda")
    o, l = fa_sm100.flash_attn_varlen_func(empty, q, q, zero_cu, cu, 0, 100, return_lse=True)
    assert o.shape == (0, 2, 64) and l.shape == (2, 0)
    leaf = q.clone().requires_grad_()  # gradients flow (tests/test_varlen_bwd_gpu.py)
    fa_sm100.flash_attn_varlen_func(leaf, q, q, cu, cu, 100, 100).sum().backward()
    assert leaf.grad is not None and torch.isfinite(leaf.grad).all()


@pytest.mark.parametrize("head_dims", [(64, 64), (128, 128), (192, 128)],
                         ids=lambda h: f"d{h[0]}x{h[1]}")
@pytest.mark.parametrize("mode", MODES, ids=mode_id)
def test_varlen_forward_sm100(sm100_device, head_dims, mode):
    """The SM100 kernel's varlen forward (written; it skips off SM100: no SM100 GPU has run
    it, its CPU layers are tests/test_sm100_varlen_emulated.py and the compile contract)."""
    from fa_sm100.sm100.interface import sm100_fwd_varlen

    for lengths in LENGTHS.values():
        lens_q, lens_k = lengths
        run_and_check(lens_q, lens_k or lens_q, head_dims, torch.bfloat16, *mode,
                      forward=sm100_fwd_varlen)
    run_and_check([1, 200, 0, 513], [300, 256, 10, 1024], head_dims, torch.float16, True,
                  (None, None), 0.0, heads=(6, 2), used=[300, 17, 0, 1000], seed=1,
                  forward=sm100_fwd_varlen)
