"""The varlen backward on an SM90 GPU (``flash_attn_varlen_func`` with autograd,
``sm90_bwd_varlen``): each packed sequence's dQ, dK, dV against the float64 gradients of that
sequence alone, under the project's rule (docs/testing.md: within 2x the error of the same
computation done plainly in the input precision, + 1e-3 of the reference's largest magnitude).
Batches hold a zero-length sequence, sequences shorter than one tile and longer than several,
queries and keys of different lengths (a sequence with keys and no queries, one with queries
and no keys), GQA groups, keys used only in part (``seqused_k``: the unused keys' gradients are
0), windows and softcap. A row of dq, dk or dv written for the wrong sequence shows as a wrong
row of its neighbour. Skips off SM90 with the reason.
"""

import pytest
import torch

from test_varlen_gpu import HEAD_DIMS, LENGTHS, MODES, mode_id

from fa_sm100.adversarial import poison_unused_keys
from fa_sm100.testing import attention_reference_grads, check_against_reference, grad_atol
from fa_sm100.validation import normalize_window

pytestmark = pytest.mark.gpu


def _packed(lengths, heads, d, dtype, g):
    x = torch.randn(sum(lengths), heads, d, device="cuda", dtype=dtype, generator=g)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32,
                      device="cuda")
    return x, cu


def run_and_check(lens_q, lens_k, head_dims, dtype, causal, window, softcap, heads=(4, 2),
                  used=None, seed=0, compiled=False):
    from fa_sm100 import flash_attn_varlen_func

    d, dv = head_dims
    hq, hk = heads
    lens_k = lens_k or lens_q
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, cu_q = _packed(lens_q, hq, d, dtype, g)
    k, cu_k = _packed(lens_k, hk, d, dtype, g)
    v = torch.randn(k.shape[0], hk, dv, device="cuda", dtype=dtype, generator=g)
    dout = torch.randn(q.shape[0], hq, dv, device="cuda", dtype=dtype, generator=g)
    seqused = None if used is None else torch.tensor(used, dtype=torch.int32, device="cuda")
    if seqused is not None:  # NaN and inf in the unused keys must reach no gradient
        poison_unused_keys(k, v, cu_k, seqused)
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def call(q, k, v):
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                      causal=causal, window_size=window, softcap=softcap,
                                      seqused_k=seqused)

    out = (torch.compile(call, fullgraph=True) if compiled else call)(q, k, v)
    dq, dk, dv_ = torch.autograd.grad(out, (q, k, v), dout)
    win = normalize_window(window)
    keys_used = used or lens_k
    for i, (sq, sk) in enumerate(zip(lens_q, keys_used)):
        what = f"sequence {i} ({sq} x {sk})"
        rows = slice(int(cu_q[i]), int(cu_q[i]) + sq)
        keys = slice(int(cu_k[i]), int(cu_k[i]) + sk)
        unused = slice(int(cu_k[i]) + sk, int(cu_k[i + 1]))
        assert not dk[unused].any() and not dv_[unused].any(), f"{what}: unused keys' grads"
        if sq == 0 or sk == 0:  # nothing to differentiate: zero gradients
            assert not dq[rows].any() and not dk[keys].any() and not dv_[keys].any(), what
            continue
        args = (q[rows].unsqueeze(0), k[keys].unsqueeze(0), v[keys].unsqueeze(0),
                dout[rows].unsqueeze(0))
        _, _, ref = attention_reference_grads(*args, causal=causal, window=win, softcap=softcap)
        _, _, plain = attention_reference_grads(*args, causal=causal, window=win,
                                                softcap=softcap, dtype=dtype, upcast=False)
        for name, got, r, p in zip(("dq", "dk", "dv"),
                                   (dq[rows], dk[keys], dv_[keys]), ref, plain):
            check_against_reference(got.unsqueeze(0), r, p, atol=grad_atol(r),
                                    what=f"{what} {name}")


@pytest.mark.parametrize("head_dims", HEAD_DIMS,
                         ids=lambda h: f"d{h[0]}_{h[1]}")
@pytest.mark.parametrize("lengths", list(LENGTHS), ids=str)
@pytest.mark.parametrize("mode", MODES, ids=mode_id)
def test_varlen_backward(sm90_device, head_dims, lengths, mode):
    lens_q, lens_k = LENGTHS[lengths]
    run_and_check(lens_q, lens_k, head_dims, torch.bfloat16, *mode)


@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (3, 1), (8, 1)],  # 8:1: bulk dK / dV reduces
                         ids=lambda h: f"h{h[0]}kv{h[1]}")
def test_varlen_backward_fp16_gqa_and_used_keys(sm90_device, heads):
    lens_q, lens_k = [100, 1, 300, 0, 64], [400, 50, 300, 9, 64]
    run_and_check(lens_q, lens_k, (128, 128), torch.float16, True, (None, None), 0.0,
                  heads=heads, used=[250, 50, 0, 9, 33])


def test_varlen_backward_under_torch_compile(sm90_device):
    run_and_check([200, 0, 513, 64], None, (128, 128), torch.bfloat16, True, (None, None), 0.0,
                  compiled=True)
