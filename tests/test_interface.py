"""CPU tests of the public forward's input validation (issue 6 item 2).

Contract: every bad input raises ValueError naming the problem before anything is compiled or
launched (and before the GPU is queried), so these run on any machine. Valid CPU inputs get as
far as the device check, which is the last rule.
"""

import math

import pytest
import torch

from fa_sm100.interface import flash_attn_func
from fa_sm100.validation import tma_ready, validate_attention_inputs


def qkv(b=2, sq=33, sk=40, hq=4, hk=2, d=128, dv=None, dtype=torch.bfloat16):
    dv = d if dv is None else dv
    return (torch.randn(b, sq, hq, d, dtype=dtype), torch.randn(b, sk, hk, d, dtype=dtype),
            torch.randn(b, sk, hk, dv, dtype=dtype))


def test_valid_cpu_inputs_stop_at_the_device_check():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="CUDA tensors"):
        flash_attn_func(q, k, v)
    prob = validate_attention_inputs(q, k, v, causal=True, require_cuda=False)
    assert (prob.batch, prob.seqlen_q, prob.seqlen_k, prob.heads, prob.heads_kv) == (2, 33, 40, 4, 2)
    assert prob.qhead_per_kvhead == 2
    assert prob.softmax_scale == pytest.approx(1 / math.sqrt(128))


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: (torch.randn(2, 3, 4), *qkv()[1:]), "4-D"),
        (lambda: (qkv()[0].float(), *qkv()[1:]), "dtype"),
        (lambda: (qkv()[0], qkv()[1].half(), qkv()[2]), "share one dtype"),
        (lambda: (qkv(b=3)[0], *qkv()[1:]), "batch sizes differ"),
        (lambda: (qkv()[0], qkv(sk=41)[1], qkv()[2]), "same seqlen"),
        (lambda: (qkv()[0], qkv(hk=3)[1], qkv(hk=3)[2]), "multiple of key/value heads"),
        (lambda: (qkv()[0], qkv(hk=4)[1], qkv()[2]), "same number of heads"),
        (lambda: qkv(d=80), "head dims"),
        (lambda: qkv(d=128, dv=64), "head dims"),
        (lambda: (qkv()[0], qkv(d=64)[1], qkv()[2]), "same head_dim"),
        (lambda: qkv(sq=0), "empty problem"),
        (lambda: ("not a tensor", *qkv()[1:]), "torch.Tensor"),
    ],
    ids=["rank", "float32", "mixed-dtype", "batch", "seqlen-kv", "gqa-ratio", "kv-heads",
         "hdim-80", "hdim-pair", "qk-hdim", "empty", "type"],
)
def test_bad_tensors_raise_value_error(make, match):
    q, k, v = make()
    with pytest.raises(ValueError, match=match):
        flash_attn_func(q, k, v)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"softmax_scale": -1.0}, "softmax_scale"),
        ({"softmax_scale": float("nan")}, "softmax_scale"),
        ({"softmax_scale": "0.1"}, "softmax_scale"),
        ({"causal": 1}, "causal must be a bool"),
        ({"window_size": (None,)}, "pair"),
        ({"window_size": ("64", None)}, "left"),
        ({"window_size": (None, 3.0)}, "right"),
        ({"dropout_p": 0.1}, "dropout_p"),
        ({"softcap": -1.0}, "softcap"),
        ({"softcap": float("inf")}, "softcap"),
        ({"softcap": True}, "softcap"),
        ({"alibi_slopes": torch.ones(4)}, "alibi"),
        ({"return_attn_probs": 1}, "return_attn_probs"),
        ({"window_size": (None, 2.5)}, "right"),
        ({"window_size": (True, None)}, "left"),  # a bool is not a window size
        ({"softmax_scale": True}, "softmax_scale"),
        ({"deterministic": "yes"}, "deterministic"),
        ({"return_lse": None}, "return_lse"),
    ],
)
def test_bad_options_raise_value_error(kwargs, match):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=match):
        flash_attn_func(q, k, v, **kwargs)


def test_supported_variants_pass_validation():
    """MHA, GQA, MQA, every head-dim pair, fp16, seqlen 1, windows: all valid inputs."""
    for hk in (4, 2, 1):
        validate_attention_inputs(*qkv(hk=hk), require_cuda=False)
    for d, dv in ((64, 64), (96, 96), (128, 128), (192, 128), (256, 256)):
        validate_attention_inputs(*qkv(d=d, dv=dv), require_cuda=False)
    validate_attention_inputs(*qkv(sq=1, sk=1, dtype=torch.float16), require_cuda=False)
    prob = validate_attention_inputs(*qkv(), window_size=(16, 0), require_cuda=False)
    assert prob.window == (16, 0)


def test_tma_ready_copies_only_when_tma_cannot_read():
    q = torch.randn(2, 8, 4, 64, dtype=torch.bfloat16)
    assert tma_ready(q) is q
    strided = torch.randn(2, 8, 4, 128, dtype=torch.bfloat16)[..., :64]  # unit last stride, 16B rows
    assert tma_ready(strided) is strided
    last_not_unit = q.transpose(2, 3)
    fixed = tma_ready(last_not_unit)
    assert fixed.stride(-1) == 1 and torch.equal(fixed, last_not_unit)
    misaligned = torch.randn(2 * 8 * 4 * 64 + 1, dtype=torch.bfloat16)[1:].view(2, 8, 4, 64)
    fixed = tma_ready(misaligned)
    assert fixed.data_ptr() % 16 == 0 and torch.equal(fixed, misaligned)


@pytest.mark.parametrize("window, want", [
    ((-1, -1), (None, None)), ((None, None), (None, None)), ((256, -1), (256, None)),
    ((-1, 0), (None, 0)), ([8, 4], (8, 4)), (None, (None, None)), ((-2, 10), (-2, 10)),
    ((40, -5), (40, -5))])
def test_window_conventions_of_flash_attn(window, want):
    """-1 and None both mean unbounded on that side (flash-attn 2 passes -1, FA4 None); other
    negative bounds are FA4's bands shifted past the diagonal."""
    prob = validate_attention_inputs(*qkv(), window_size=window, require_cuda=False)
    assert prob.window == want


# flash-attn 2's flash_attn_func, its positional parameters in order: a pinned external API
FLASH_ATTN_2 = ("q", "k", "v", "dropout_p", "softmax_scale", "causal", "window_size", "softcap",
                "alibi_slopes", "deterministic", "return_attn_probs")


def test_signature_is_flash_attn_2s_so_models_swap_the_import():
    import inspect

    params = list(inspect.signature(flash_attn_func).parameters.values())
    positional = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert tuple(positional) == FLASH_ATTN_2
    defaults = {p.name: p.default for p in params}
    # an unbounded window, no softcap, no dropout: what a model passing nothing means
    assert validate_attention_inputs(*qkv(), window_size=defaults["window_size"],
                                     require_cuda=False).window == (None, None)
    assert defaults["dropout_p"] == 0 and defaults["softcap"] == 0


def test_fa4_keywords_with_the_same_meaning_are_accepted():
    """Every keyword FA4's flash_attn_func shares with ours by name keeps its meaning; a call
    written for FA4 with those keywords passes validation (and stops at the device check)."""
    import inspect

    fa4 = pytest.importorskip("flash_attn.cute")
    ours = set(inspect.signature(flash_attn_func).parameters)
    shared = {"softmax_scale", "causal", "window_size", "softcap", "deterministic", "return_lse"}
    assert shared <= set(inspect.signature(fa4.flash_attn_func).parameters)
    assert shared <= ours
    q, k, v = qkv()
    with pytest.raises(ValueError, match="CUDA tensors"):
        flash_attn_func(q, k, v, softmax_scale=0.1, causal=True, window_size=(None, None),
                        softcap=0.0, deterministic=False, return_lse=True)


def test_flash_attn_2_positional_call_passes_validation():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="CUDA tensors"):  # accepted up to the device
        flash_attn_func(q, k, v, 0.0, 0.1, True, (-1, -1))
    with pytest.raises(ValueError, match="dropout_p"):  # 4th positional is dropout, as there
        flash_attn_func(q, k, v, 0.1)


def test_varlen_inputs_are_checked_before_anything_runs():
    """``flash_attn_varlen_func``'s checks, on CPU tensors (the device rule comes last): each
    bad input raises ValueError naming it."""
    import fa_sm100

    q = torch.zeros(10, 2, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    call = fa_sm100.flash_attn_varlen_func
    cases = [
        (dict(q=q[None]), "3-D"),
        (dict(cu_seqlens_q=cu.long()), "int32"),
        (dict(cu_seqlens_k=cu[:2]), "sequences"),
        (dict(cu_seqlens_q=torch.tensor([0], dtype=torch.int32),
              cu_seqlens_k=torch.tensor([0], dtype=torch.int32)), "at least two offsets"),
        (dict(max_seqlen_q=-1), "max_seqlen_q"),
        (dict(max_seqlen_k=4.0), "max_seqlen_k"),
        (dict(seqused_k=torch.tensor([1, 2, 3], dtype=torch.int32)), "sequences"),
        (dict(cu_seqlens_q=torch.tensor([0, 4, 5, 10], dtype=torch.int32)[::2]), "contiguous"),
        (dict(v=torch.zeros(9, 2, 64, dtype=torch.bfloat16)), "same number of tokens"),
        (dict(softcap=-1.0), "softcap"),
        (dict(dropout_p=0.1), "dropout_p"),
        ({}, "CUDA"),
    ]
    for change, message in cases:
        args = dict(q=q, k=q, v=q, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=6,
                    max_seqlen_k=6)
        args.update(change)
        with pytest.raises(ValueError, match=message):
            call(**args)
    # with gradients the same checks run first (before any forward), then CPU tensors take
    # the PyTorch model, whose gradients flow
    with pytest.raises(ValueError, match="int32"):
        call(q.clone().requires_grad_(), q, q, cu.long(), cu, 6, 6)
    leaf = q.clone().requires_grad_()
    call(leaf, q, q, cu, cu, 6, 6).sum().backward()
    assert leaf.grad is not None and leaf.grad.shape == q.shape


@pytest.mark.parametrize("cu_q,cu_k,used,max_q,message", [
    ([1, 5, 9], [0, 4, 9], None, 8, r"cu_seqlens_q\[0\] must be 0"),
    ([0, 5, 8], [0, 4, 9], None, 8, r"cu_seqlens_q\[-1\] must be the packed rows \(9\)"),
    ([0, 6, 5, 9], [0, 4, 4, 9], None, 8, "must not decrease: sequence 1 runs from 6 to 5"),
    ([0, 5, 9], [0, 4, 9], None, 4, "sequence 0 has 5 rows in cu_seqlens_q, more than "
                                    "max_seqlen_q=4"),
    ([0, 5, 9], [0, 4, 9], [4, 6], 8, r"seqused_k\[1\] must lie in \[0, 5\]"),
    ([0, 5, 9], [0, 4, 9], [-1, 2], 8, r"seqused_k\[0\] must lie in \[0, 4\]"),
])
def test_checked_values_raise_before_anything_runs(monkeypatch, cu_q, cu_k, used, max_q,
                                                   message):
    """With FA_SM100_CHECK_VALUES=1 ``flash_attn_varlen_func`` reads the offsets: a first
    offset not 0, a last not the packed rows, a decreasing one, a sequence longer than its
    max_seqlen and seqused_k outside [0, the keys] each raise ValueError naming it; a good
    pack passes and is computed (on CPU tensors with gradients: the PyTorch model)."""
    from fa_sm100 import flash_attn_varlen_func

    monkeypatch.setenv("FA_SM100_CHECK_VALUES", "1")
    q, k = (torch.randn(9, 2, 64, dtype=torch.bfloat16) for _ in range(2))
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    seqused = None if used is None else i32(used)
    with pytest.raises(ValueError, match=message):
        flash_attn_varlen_func(q, k, k, i32(cu_q), i32(cu_k), max_q, 8, seqused_k=seqused)
    q.requires_grad_()  # on CPU tensors the gradients' PyTorch model computes it
    out = flash_attn_varlen_func(q, k, k, i32([0, 5, 9]), i32([0, 4, 9]), 5, 5,
                                 seqused_k=i32([4, 3]))
    assert out.shape == q.shape and torch.isfinite(out).all()
