"""Autograd and torch.compile for attention (fa_sm100.autograd, flash_attn_func).

CPU (everywhere): the custom ops pass ``torch.library.opcheck`` (schema, fake tensors,
autograd registration); ``FlashAttnFunction`` on CPU tensors (a PyTorch model of the
kernel's arithmetic: float32 sums, P and dS rounded to the input dtype) gives O and gradients
within the STYLE.md rule of float64 autograd for MHA/GQA, causal and windowed problems; an
unsupported backward head dim, or a GPU without a backward kernel (an SM100 one, faked),
raises ValueError before the forward; equal configs share one op token;
``torch.compile(fullgraph=True)`` of forward + backward (aot_eager backend) runs without a
graph break and matches eager bitwise.
GPU (sm_90): ``flash_attn_func(...).backward()`` (O and gradients) against float64 autograd, and the same
training step under ``torch.compile(fullgraph=True)`` (inductor): its gradients are within the
STYLE.md rule of float64 autograd, and close to eager's.
"""

import pytest
import torch

from fa_sm100.autograd import flash_attn_autograd
from fa_sm100.testing import (attention_reference, attention_reference_grads,
                              check_against_reference, check_training_step, grad_atol)


def _inputs(b, sq, sk, hq, hk, d, dtype, device="cpu", seed=0, dv=None):
    dv = d if dv is None else dv
    g = torch.Generator(device=device).manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, device=device, dtype=dtype)
    return mk(b, sq, hq, d), mk(b, sk, hk, d), mk(b, sk, hk, dv), mk(b, sq, hq, dv)


def _check_grads(fn, b, sq, sk, hq, hk, d, causal, window, dtype, device, dv=None, softcap=0.0):
    q, k, v, dout = _inputs(b, sq, sk, hq, hk, d, dtype, device, dv=dv)
    if softcap:
        q = q * 4  # scores of a few softcaps: the cap bends them
    return check_training_step(fn, q, k, v, dout, causal, window, softcap)


CPU_CASES = [  # (b, sq, sk, hq, hk, d, causal, window, dv, softcap)
    (1, 40, 40, 2, 2, 64, False, (None, None), 64, 0.0),
    (2, 33, 50, 4, 2, 64, True, (None, None), 64, 0.0),
    (1, 48, 48, 4, 1, 32, False, (8, 4), 32, 0.0),
    (1, 24, 30, 4, 2, 192, True, (None, None), 128, 0.0),  # head_dim != head_dim_v, GQA
    (2, 33, 50, 4, 2, 64, True, (None, None), 64, 2.0),  # softcap: tanh's derivative in dS
    (1, 48, 48, 4, 1, 32, False, (8, 4), 32, 5.0),
]


@pytest.mark.parametrize("case", CPU_CASES)
def test_autograd_function_cpu_math_matches_float64(case):
    b, sq, sk, hq, hk, d, causal, window, dv, softcap = case
    fn = lambda q, k, v: flash_attn_autograd(q, k, v, causal=causal, window_size=window,  # noqa: E731
                                             softcap=softcap)
    _check_grads(fn, b, sq, sk, hq, hk, d, causal, window, torch.bfloat16, "cpu", dv=dv,
                 softcap=softcap)


def test_lse_is_returned_and_not_differentiable():
    q, k, v, _ = _inputs(1, 16, 16, 2, 2, 32, torch.float32)
    q.requires_grad_()
    out, lse = flash_attn_autograd(q, k, v, return_lse=True)
    _, ref_lse = attention_reference(q.detach(), k, v)
    assert not lse.requires_grad
    assert torch.allclose(lse.double(), ref_lse, atol=1e-5)


def test_unsupported_backward_head_dim_raises_before_the_forward():
    from fa_sm100.autograd import check_backward_supported

    x = lambda d: torch.empty(1, 8, 2, d)  # noqa: E731
    for d, dv in ((80, 80), (192, 192), (256, 128), (128, 64)):
        with pytest.raises(ValueError, match="no backward kernel"):
            check_backward_supported(x(d), x(d), x(dv))
    for d, dv in ((64, 64), (96, 96), (128, 128), (192, 128), (256, 256)):
        check_backward_supported(x(d), x(d), x(dv))  # the forward's head dims: no exception


@pytest.mark.parametrize("cap,dims,match", [((10, 0), (192, 128), "no SM100 backward")])
def test_gradients_on_a_gpu_without_backward_raise_before_the_forward(monkeypatch, cap, dims,
                                                                      match):
    """A faked GPU (FakeTensorMode CUDA tensors and a patched capability) whose backward has
    no kernel: an SM100 one at head dims (192, 128) (the SM100 backward's TMEM plan does not
    fit them): asking for gradients raises ValueError before the forward runs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fa_sm100 import autograd
    from fa_sm100.interface import flash_attn_func

    def forward_ran(*args, **kwargs):
        raise AssertionError("the forward ran although its backward cannot")

    monkeypatch.setattr(autograd.FlashAttnFunction, "apply", forward_ran)
    monkeypatch.setattr(autograd.EagerAttention, "apply", forward_ran)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    with FakeTensorMode():
        q, k = (torch.empty(1, 8, 2, dims[0], dtype=torch.bfloat16, device="cuda",
                            requires_grad=True) for _ in range(2))
        v = torch.empty(1, 8, 2, dims[1], dtype=torch.bfloat16, device="cuda",
                        requires_grad=True)
        with pytest.raises(ValueError, match=match):
            flash_attn_func(q, k, v)


def test_equal_configs_share_one_token():
    """The op token table is keyed by the frozen config's value: building the same config
    again (as a training loop might per step) does not grow it."""
    from fa_sm100 import autograd
    from fa_sm100.hopper.config import select_sm90_fwd_config

    first = autograd._config_token(select_sm90_fwd_config(128, causal=True))
    size = len(autograd._CONFIGS)
    for _ in range(3):
        assert autograd._config_token(select_sm90_fwd_config(128, causal=True)) == first
    assert len(autograd._CONFIGS) == size
    other = autograd._config_token(select_sm90_fwd_config(64))
    assert other != first and autograd._CONFIGS[other] == select_sm90_fwd_config(64)
    assert autograd._config_token(None) == -1


def test_custom_ops_pass_opcheck():
    q, k, v, dout = _inputs(1, 24, 40, 4, 2, 32, torch.float32)
    for softcap in (0.0, 5.0):
        torch.library.opcheck(torch.ops.fa_sm100.attn_fwd.default,
                              (q, k, v, 0.2, True, None, None, softcap, -1))
        out, lse = torch.ops.fa_sm100.attn_fwd(q, k, v, 0.2, True, None, None, softcap, -1)
        torch.library.opcheck(torch.ops.fa_sm100.attn_bwd.default,
                              (dout, q, k, v, out, lse, 0.2, True, None, None, softcap, False))


def _train_step(fn, q, k, v, dout):
    """Forward through ``fn`` (maybe compiled), backward in autograd; returns the grads."""
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out = fn(qg, kg, vg)
    (out.float() * dout.float()).sum().backward()
    return qg.grad, kg.grad, vg.grad


def test_torch_compile_fullgraph_cpu_matches_eager():
    q, k, v, dout = _inputs(1, 32, 32, 2, 2, 32, torch.float32)
    attn = lambda q, k, v: flash_attn_autograd(q, k, v, causal=True) * 2.0
    compiled = torch.compile(attn, fullgraph=True, backend="aot_eager")
    got = _train_step(compiled, q, k, v, dout)
    want = _train_step(attn, q, k, v, dout)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


# ---- varlen: the CPU model per sequence, the ops, the compiled graph ------------------------

def _packed_batch(lens_q, lens_k, hq, hk, d, dtype=torch.bfloat16, seed=3):
    g = torch.Generator().manual_seed(seed)
    cu = lambda lens: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(),  # noqa: E731
                                   dtype=torch.int32)
    q = torch.randn(sum(lens_q), hq, d, generator=g).to(dtype)
    k, v = (torch.randn(sum(lens_k), hk, d, generator=g).to(dtype) for _ in range(2))
    dout = torch.randn(sum(lens_q), hq, d, generator=g).to(dtype)
    return q, k, v, dout, cu(lens_q), cu(lens_k)


@pytest.mark.parametrize("causal,window,softcap", [(False, (None, None), 0.0),
                                                   (True, (None, None), 0.0),
                                                   (False, (6, 2), 0.0), (True, (None, None), 3.0)])
def test_varlen_gradients_are_each_sequences_own(causal, window, softcap):
    """``flash_attn_varlen_func`` with gradients on CPU tensors (the model of the kernels'
    arithmetic, per sequence): each sequence's dq, dk, dv meet the float64 rule against that
    sequence alone, a sequence without queries or keys gets zero gradients, and keys past
    ``seqused_k`` get none."""
    from fa_sm100 import flash_attn_varlen_func

    lens_q, lens_k, used = [5, 0, 17, 33, 4], [9, 3, 17, 20, 0], [9, 3, 11, 20, 0]
    q, k, v, dout, cu_q, cu_k = _packed_batch(lens_q, lens_k, 4, 2, 64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flash_attn_varlen_func(*leaves, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                 window_size=window, softcap=softcap,
                                 seqused_k=torch.tensor(used, dtype=torch.int32))
    dq, dk, dv = torch.autograd.grad(out, leaves, dout)
    for i, (sq, sk) in enumerate(zip(lens_q, used)):
        rows = slice(int(cu_q[i]), int(cu_q[i]) + sq)
        keys = slice(int(cu_k[i]), int(cu_k[i]) + sk)
        unused = slice(int(cu_k[i]) + sk, int(cu_k[i + 1]))
        assert not dk[unused].any() and not dv[unused].any()
        if sq == 0 or sk == 0:
            assert not dq[rows].any() and not dk[keys].any() and not dv[keys].any()
            continue
        args = [t[s].unsqueeze(0) for t, s in ((q, rows), (k, keys), (v, keys), (dout, rows))]
        _, _, ref = attention_reference_grads(*args, causal=causal, window=window,
                                              softcap=softcap)
        _, _, plain = attention_reference_grads(*args, causal=causal, window=window,
                                                softcap=softcap, dtype=torch.bfloat16,
                                                upcast=False)
        for got, r, p in zip((dq[rows], dk[keys], dv[keys]), ref, plain):
            check_against_reference(got.unsqueeze(0), r, p, atol=grad_atol(r))


def test_varlen_ops_pass_opcheck_and_compile_to_the_eager_graph():
    from fa_sm100 import flash_attn_varlen_func

    q, k, v, dout, cu_q, cu_k = _packed_batch([7, 0, 12], [7, 5, 9], 4, 2, 64)
    for used in (None, torch.tensor([7, 2, 9], dtype=torch.int32)):
        fwd_args = (q, k, v, cu_q, cu_k, used, 12, 9, 0.2, True, None, None, 0.0, -1)
        torch.library.opcheck(torch.ops.fa_sm100.varlen_fwd.default, fwd_args)
        out, lse = torch.ops.fa_sm100.varlen_fwd(*fwd_args)
        torch.library.opcheck(torch.ops.fa_sm100.varlen_bwd.default,
                              (dout, q, k, v, out, lse, cu_q, cu_k, used, 12, 9, 0.2, True,
                               None, None, 0.0))
    attn = lambda q, k, v: flash_attn_varlen_func(q, k, v, cu_q, cu_k, 12, 9,  # noqa: E731
                                                  causal=True) * 2.0
    compiled = torch.compile(attn, fullgraph=True, backend="aot_eager")
    for g, w in zip(_train_step(compiled, q, k, v, dout), _train_step(attn, q, k, v, dout)):
        assert torch.equal(g, w)


def test_the_varlen_backward_refuses_what_it_cannot_do_before_running():
    """Deterministic varlen gradients and a config that reads lengths beyond its tile raise
    ValueError with the reason; the defaults of a varlen problem never take such a switch."""
    from fa_sm100.hopper.bwd_config import VARLEN_FIXED
    from fa_sm100.hopper.bwd_defaults import select_bwd_config

    with pytest.raises(ValueError, match="deterministic"):
        select_bwd_config(head_dim=128, deterministic=True, varlen=True)
    with pytest.raises(ValueError, match="persistent_ctas"):
        select_bwd_config(head_dim=64, varlen=True, persistent_ctas=132)
    for d in (64, 96, 128, 192, 256):
        for causal in (False, True):
            for window in ((None, None), (100, 0)):
                for group, seqlen in ((1, 1024), (4, 8192)):
                    cfg = select_bwd_config(head_dim=d, causal=causal, window_left=window[0],
                                            window_right=window[1], qhead_per_kvhead=group,
                                            seqlen_q=seqlen, seqlen_k=seqlen, varlen=True)
                    assert cfg.varlen
                    assert {k: getattr(cfg, k) for k in VARLEN_FIXED} == VARLEN_FIXED


# ---- GPU (sm_90) -------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("causal,hk,d,dv", [(False, 4, 128, 128), (True, 2, 128, 128),
                                            (True, 2, 256, 256), (False, 1, 192, 128)])
def test_flash_attn_func_backward_on_sm90(sm90_device, causal, hk, d, dv):
    from fa_sm100.interface import flash_attn_func

    fn = lambda q, k, v: flash_attn_func(q, k, v, causal=causal)
    _check_grads(fn, 2, 300, 300, 4, hk, d, causal, (None, None), torch.bfloat16, "cuda", dv=dv)


@pytest.mark.gpu
def test_flash_attn_func_torch_compile_fullgraph_on_sm90(sm90_device):
    from fa_sm100.interface import flash_attn_func

    q, k, v, dout = _inputs(2, 256, 256, 4, 2, 128, torch.bfloat16, "cuda")
    attn = lambda q, k, v: flash_attn_func(q, k, v, causal=True) * 2.0
    compiled = torch.compile(attn, fullgraph=True)
    got = _train_step(compiled, q, k, v, dout)
    want = _train_step(attn, q, k, v, dout)
    # The loss is sum(2 * attention * dout): the reference gradients are those of attention
    # for the output gradient 2 * dout (exact in bf16).
    _, _, ref = attention_reference_grads(q, k, v, 2 * dout, True)
    _, _, plain = attention_reference_grads(q, k, v, 2 * dout, True, dtype=torch.bfloat16,
                                           upcast=False)
    for name, g, w, r, p in zip(("dq", "dk", "dv"), got, want, ref, plain):
        assert g.shape == w.shape == r.shape
        check_against_reference(g, r, p, atol=grad_atol(r), what=f"compiled {name}")
        # Compiled and eager run the same kernels; dQ is added in float32 in an order that
        # may vary run to run, so the two agree closely but not bitwise.
        assert float((g.float() - w.float()).abs().max()) <= 1e-2 * float(w.float().abs().max())
