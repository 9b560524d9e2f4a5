"""The warm call path on an SM90 GPU: plans give the same answers as first calls, and CUDA
graphs capture a warm call and a whole training step.

- A warm ``flash_attn_func`` call (its plan found by the metadata key) gives bitwise the output
  of the first call on the same data, and a plan made for one set of tensors serves another set
  of the same metadata with new data (the rule of the float64 reference).
- A warm forward is captured in a ``torch.cuda.CUDAGraph``; replayed on new contents of the
  static inputs it gives the eager output bitwise.
- Warm backwards share their stream's kept workspace (Note [Kept workspace] in
  bwd_interface.py): calls queued back to back on one stream, without a synchronize, and calls
  on two streams at once each give their own gradients within the float64 rule.
- A training step (forward + ``backward``) is captured with
  ``torch.cuda.make_graphed_callables``; its replays give gradients within the float64 rule,
  on data the capture never saw. (docs/host_path.md shows the pattern.)
"""

import pytest
import torch

from fa_sm100.testing import (attention_reference, attention_reference_grads,
                              check_against_reference, grad_atol)

pytestmark = pytest.mark.gpu

SHAPES = [  # (batch, seqlen, heads, heads_kv, hdim, causal)
    (2, 1024, 4, 4, 128, True),
    (1, 300, 4, 2, 64, False),
    (2, 512, 8, 8, 256, True),
]


def _qkv(b, s, h, hk, d, seed, requires_grad=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda heads: torch.randn(b, s, heads, d, device="cuda", dtype=torch.bfloat16,  # noqa: E731
                                   generator=g).requires_grad_(requires_grad)
    return mk(h), mk(hk), mk(hk)


def _check_out(out, q, k, v, causal):
    ref, _ = attention_reference(q, k, v, causal=causal)
    plain, _ = attention_reference(q, k, v, causal=causal, dtype=q.dtype, upcast=False)
    check_against_reference(out.float().cpu(), ref.cpu(), plain.float().cpu())


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_warm_calls_match_the_first_and_serve_new_data(sm90_device, shape):
    from fa_sm100 import flash_attn_func

    b, s, h, hk, d, causal = shape
    q, k, v = _qkv(b, s, h, hk, d, seed=1)
    first = flash_attn_func(q, k, v, causal=causal)
    again = flash_attn_func(q, k, v, causal=causal)
    assert torch.equal(first, again)
    q2, k2, v2 = _qkv(b, s, h, hk, d, seed=2)  # same metadata, other data: the same plan
    _check_out(flash_attn_func(q2, k2, v2, causal=causal), q2, k2, v2, causal)
    out, lse = flash_attn_func(q2, k2, v2, causal=causal, return_lse=True)
    _, lse_ref = attention_reference(q2, k2, v2, causal=causal)
    assert torch.allclose(lse.cpu().double(), lse_ref.cpu(), atol=1e-3)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_a_warm_forward_is_captured_and_replayed(sm90_device, shape):
    from fa_sm100 import flash_attn_func

    b, s, h, hk, d, causal = shape
    q, k, v = _qkv(b, s, h, hk, d, seed=3)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm on the capture's stream, as torch asks
        for _ in range(2):
            flash_attn_func(q, k, v, causal=causal)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = flash_attn_func(q, k, v, causal=causal)
    for seed in (4, 5):
        new = _qkv(b, s, h, hk, d, seed=seed)
        for static, fresh in zip((q, k, v), new):
            static.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        eager = flash_attn_func(*new, causal=causal)
        assert torch.equal(static_out, eager), f"replay {seed} differs from eager"


@pytest.mark.parametrize("shape", SHAPES[:2], ids=lambda s: "-".join(map(str, s)))
def test_a_training_step_is_captured_with_make_graphed_callables(sm90_device, shape):
    from fa_sm100 import flash_attn_func

    b, s, h, hk, d, causal = shape
    sample = _qkv(b, s, h, hk, d, seed=6, requires_grad=True)
    attention = torch.cuda.make_graphed_callables(
        lambda q, k, v: flash_attn_func(q, k, v, causal=causal), sample)
    for seed in (7, 8):
        q, k, v = _qkv(b, s, h, hk, d, seed=seed, requires_grad=True)
        dout = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
        out = attention(q, k, v)
        out.backward(dout)
        _check_out(out.detach(), q.detach(), k.detach(), v.detach(), causal)
        qd, kd, vd = (t.detach() for t in (q, k, v))
        _, _, ref = attention_reference_grads(qd, kd, vd, dout, causal, (None, None))
        _, _, plain = attention_reference_grads(qd, kd, vd, dout, causal, (None, None),
                                                torch.bfloat16, upcast=False)
        for name, x, r, p in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), ref, plain):
            check_against_reference(x.float().cpu(), r.cpu(), p.float().cpu(),
                                    atol=grad_atol(r), what=name)


def _check_grads(grads, q, k, v, dout, causal):
    _, _, ref = attention_reference_grads(q, k, v, dout, causal, (None, None))
    _, _, plain = attention_reference_grads(q, k, v, dout, causal, (None, None), torch.bfloat16,
                                            upcast=False)
    for name, x, r, p in zip(("dq", "dk", "dv"), grads, ref, plain):
        check_against_reference(x.float().cpu(), r.cpu(), p.float().cpu(), atol=grad_atol(r),
                                what=name)


@pytest.mark.parametrize("shape", SHAPES[:2], ids=lambda s: "-".join(map(str, s)))
def test_queued_backwards_on_one_or_two_streams_keep_their_own_gradients(sm90_device, shape):
    from fa_sm100.hopper.bwd_interface import sm90_bwd
    from fa_sm100 import flash_attn_func

    b, s, h, hk, d, causal = shape
    problems = []
    for seed in (9, 10, 11, 12):
        q, k, v = _qkv(b, s, h, hk, d, seed=seed)
        dout = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
        out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
        problems.append((dout, q, k, v, out, lse))
    sm90_bwd(*problems[0], causal=causal)  # the plan and its kept workspace exist
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    grads = [sm90_bwd(*problems[0], causal=causal), sm90_bwd(*problems[1], causal=causal)]
    with torch.cuda.stream(side):
        grads += [sm90_bwd(*p, causal=causal) for p in problems[2:]]
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    for g, (dout, q, k, v, _, _) in zip(grads, problems):
        _check_grads(g, q, k, v, dout, causal)
