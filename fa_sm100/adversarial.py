"""The adversarial numerics cases: one list, checked by every layer.

Every layer that computes attention takes its hard inputs from here, so a case added once is
checked everywhere from then on:

=========================  ================================================================
layer                      what runs the list
=========================  ================================================================
float64 reference          ``fa_sm100.testing.attention_reference`` defines the answer
numerics emulation (CPU)   ``tests/test_adversarial.py``: every case, every SM100 switch set
PTX emulator (CPU)         ``tests/test_adversarial.py``: the ``small`` cases, bit for bit
                           against the emulation and under the error rule
backward emulation (CPU)   ``tests/test_sm100_bwd_emulation.py``: every gradient case
backward PTX emulator      ``tests/test_sm100_bwd_emulated.py``: the small gradient cases,
                           bit for bit against the backward's emulation, under the rule
Hopper GPU tests           ``tests/test_sm90_fwd_gpu.py``: every case, forward and gradients
=========================  ================================================================

The rule every layer applies (``check_adversarial``) is the project's (docs/verification.md):
the error against float64 is at most twice the error of plain attention computed in the input
dtype, plus an absolute slack scaled to ``v``; the output of a row is a convex combination of
the visible rows of ``v``, so it must also lie within their range (a stale, unnormalized O
breaks that long before it breaks the first rule on large scores, where the plain 16-bit
computation is itself far off).

Kinds of input (``AdversarialCase.kind``, with ``param``):

- ``scale``: q and k drawn with standard deviation ``param`` (scores of standard deviation
  ``param**2``): 1e-3 is flat attention, 12 puts adjacent scores hundreds of log2 units apart.
- ``jump_late`` / ``jump_early``: the even query rows score ``param`` log2 units higher on the
  keys of one half of the sequence. The kernels visit key blocks from the last to the first,
  so with ``jump_late`` the high half (the first keys) comes second and the row max jumps by
  ``param`` between two blocks (exp2 of the old max minus the new one is 0 in float32 beyond
  about 149); with ``jump_early`` it comes first and every later P underflows to 0. The odd
  rows see no jump, so a warp's 32 rows mix both kinds of step.
- ``shift_down``: the even query rows score ``param`` log2 units lower on every key. Softmax
  is unchanged and LSE is ``param`` lower, so a key a kernel loads past the sequence's end
  (zeros, score 0) and leaves unmasked gets P = 2^param: beyond 128 that is inf in float32
  and its gradient terms turn to NaN (inf x 0). Seqlen_k off a block boundary puts such keys
  in the last block.
- ``ties``: every key equal (uniform attention, every score tied with the max).
- ``zero_q``: q = 0, every score exactly 0.
- ``large_v``: ``v`` scaled by ``param``.

Packed batches and KV caches add one more input: NaN and infinities in the keys past each
sequence's used ones (``poison_unused_keys``).

Causal cases with ``seqlen_q > seqlen_k`` have rows that see no key (O = 0, LSE = -inf); causal
cases whose work tile spans several key blocks have rows whose first visited blocks are fully
masked and a later one is not (the masked prefix). Cases with a ``window`` (bounds as
``flash_attn_func`` takes them, negative ones included) add both band edges to that, and
bands that leave rows with no key; cases with a ``softcap`` cap the scores first, so their
max jumps are at most 2 softcap log2(e) whatever the kind's parameter.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from fa_sm100 import softmax_math

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
KINDS = ("scale", "jump_late", "jump_early", "shift_down", "ties", "zero_q", "large_v")
# The absolute slack of the error rule: 1e-3 of max |v| (outputs are convex combinations of
# rows of v), or one unit roundoff of the output dtype at the largest output, whichever is
# larger (the final rounding of O alone can cost that much where plain happens to round well).
ATOL_REL_V = 1e-3
ATOL_LSE = 1e-3
# The PTX emulator runs a problem of up to this size in seconds (one work tile of 2-CTA rows).
PTX_MAX_SEQLEN_Q = 256
PTX_MAX_SEQLEN_K = 384


@dataclass(frozen=True)
class AdversarialCase:
    """One hard input: shapes, dtype, masking, and the kind of scores (module docstring)."""

    name: str
    kind: str
    param: float = 1.0
    seqlen_q: int = 128
    seqlen_k: int = 256
    batch: int = 1
    heads: int = 1
    kv_heads: int = 1
    head_dim: int = 64
    dtype: str = "bf16"
    causal: bool = False
    seed: int = 0
    window: tuple = (None, None)  # (left, right), None unbounded (fa_sm100.bands)
    softcap: float = 0.0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"case {self.name}: kind {self.kind!r} is not one of {KINDS}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"case {self.name}: dtype {self.dtype!r} is not one of "
                             f"{sorted(_DTYPES)}")
        if self.heads % self.kv_heads:
            raise ValueError(f"case {self.name}: heads {self.heads} not a multiple of kv_heads "
                             f"{self.kv_heads}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def small(self) -> bool:
        """Small enough for the PTX emulator (head dim 64, one work tile of rows)."""
        return (self.head_dim == 64 and self.seqlen_q <= PTX_MAX_SEQLEN_Q
                and self.seqlen_k <= PTX_MAX_SEQLEN_K and self.batch * self.heads <= 2)

    @property
    def softmax_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    def problem(self) -> dict:
        """The masking and capping options, as ``check_adversarial`` takes them."""
        return {"causal": self.causal, "window": self.window, "softcap": self.softcap}

    def inputs(self, device="cpu"):
        """Deterministic (q, k, v), BSHD, in the case's dtype on ``device``."""
        return make_inputs(self, device)

    def repro(self) -> str:
        """A one-line Python expression that rebuilds this case."""
        fields = ", ".join(f"{f}={getattr(self, f)!r}" for f in self.__dataclass_fields__)
        return f"AdversarialCase({fields})"


def make_inputs(case: AdversarialCase, device="cpu"):
    gen = torch.Generator().manual_seed(case.seed)
    b, sq, sk, hq, hk, d = (case.batch, case.seqlen_q, case.seqlen_k, case.heads,
                            case.kv_heads, case.head_dim)
    q = torch.randn(b, sq, hq, d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, sk, hk, d, generator=gen, dtype=torch.float64)
    v = torch.randn(b, sk, hk, d, generator=gen, dtype=torch.float64)
    if case.kind == "scale":
        q, k = q * case.param, k * case.param
    elif case.kind in ("jump_late", "jump_early"):
        # Raw score bonus = q0 * k0 = param / scale_log2 on the chosen half, for even rows.
        scale_log2 = softmax_math.softmax_scale_log2(case.softmax_scale)
        q0 = 4.0
        rows = (torch.arange(sq) % 2 == 0).to(torch.float64)
        keys = torch.arange(sk)
        half = keys < sk // 2 if case.kind == "jump_late" else keys >= sk // 2
        q[..., 0] = q0 * rows.view(1, sq, 1)
        k[..., 0] = (half.to(torch.float64) * case.param / (q0 * scale_log2)).view(1, sk, 1)
    elif case.kind == "shift_down":
        # Raw score -param / scale_log2 added by q0 * k0 on every key, for even rows.
        scale_log2 = softmax_math.softmax_scale_log2(case.softmax_scale)
        q0 = 4.0
        q[..., 0] = q0 * (torch.arange(sq) % 2 == 0).to(torch.float64).view(1, sq, 1)
        k[..., 0] = -case.param / (q0 * scale_log2)
    elif case.kind == "ties":
        k = k[:, :1].expand(b, sk, hk, d).clone()
    elif case.kind == "zero_q":
        q = torch.zeros_like(q)
    elif case.kind == "large_v":
        v = v * case.param
    dt = case.torch_dtype
    return tuple(t.to(dt).to(device).contiguous() for t in (q, k, v))


def _c(name, kind, param=1.0, **kw) -> AdversarialCase:
    return AdversarialCase(name=name, kind=kind, param=param, **kw)


# The list. ``small`` cases (head dim 64, <= 256 x 384) also run on the PTX emulator.
CASES: tuple[AdversarialCase, ...] = (
    # large and tiny scales (the repro: std 12 at hdim 128, seqlen 512)
    _c("scale_tiny", "scale", 1e-3),
    _c("scale_4", "scale", 4.0),
    _c("scale_12", "scale", 12.0),
    _c("scale_12_fp16", "scale", 12.0, dtype="fp16"),
    _c("scale_12_d128_s512", "scale", 12.0, seqlen_q=512, seqlen_k=512, batch=2, heads=4,
       head_dim=128),
    _c("scale_12_d128_s512_causal", "scale", 12.0, seqlen_q=512, seqlen_k=512, heads=2,
       head_dim=128, causal=True),
    _c("scale_1e3", "scale", 1e3),
    # max jumps between blocks, both block orders
    _c("jump_late_100", "jump_late", 100.0),
    _c("jump_late_150", "jump_late", 150.0),
    _c("jump_late_200", "jump_late", 200.0),
    _c("jump_late_1000", "jump_late", 1000.0),
    _c("jump_late_1000_fp16", "jump_late", 1000.0, dtype="fp16"),
    _c("jump_early_150", "jump_early", 150.0),
    _c("jump_early_1000", "jump_early", 1000.0),
    _c("jump_late_1000_d128_s1024", "jump_late", 1000.0, seqlen_q=512, seqlen_k=1024,
       heads=2, head_dim=128),
    _c("jump_late_200_d128_causal", "jump_late", 200.0, seqlen_q=1024, seqlen_k=1024,
       heads=2, head_dim=128, causal=True),
    # masked prefixes: the first visited blocks of a tile are masked for most rows
    _c("masked_prefix_causal", "scale", 1.0, seqlen_q=384, seqlen_k=384, causal=True),
    _c("masked_prefix_jump_causal", "jump_late", 1000.0, seqlen_q=384, seqlen_k=384,
       causal=True),
    # causal with seqlen_q > seqlen_k: the first rows see no key at all
    _c("causal_sq_gt_sk", "scale", 1.0, seqlen_q=256, seqlen_k=200, causal=True),
    _c("causal_sq_gt_sk_jump_fp16", "jump_late", 200.0, seqlen_q=256, seqlen_k=160,
       causal=True, dtype="fp16"),
    # every score of a row far below 0, keys ending inside a block: a key past the end that
    # is loaded (as zeros) and not masked has score 0, P = 2^param
    _c("shift_down_200_tail", "shift_down", 200.0, seqlen_q=128, seqlen_k=200),
    _c("shift_down_300_tail_causal_gqa", "shift_down", 300.0, seqlen_q=200, seqlen_k=330,
       heads=2, kv_heads=1, causal=True),
    _c("shift_down_200_d128_s1000", "shift_down", 200.0, seqlen_q=1000, seqlen_k=1000,
       heads=2, head_dim=128),
    # ties and constant rows
    _c("ties", "ties", 1.0),
    _c("zero_q", "zero_q", 1.0, dtype="fp16"),
    _c("ties_causal_gqa", "ties", 1.0, seqlen_q=200, seqlen_k=200, heads=2, kv_heads=1,
       causal=True),
    # v of large magnitude
    _c("large_v_bf16", "large_v", 1e4),
    _c("large_v_fp16", "large_v", 1e3, dtype="fp16"),
    # sliding windows: max jumps inside a band, a band left of the diagonal (the first rows
    # see no key), a band narrower than one key (no row sees one)
    _c("window_jump_late_1000", "jump_late", 1000.0, seqlen_q=256, seqlen_k=384,
       window=(200, 30)),
    _c("window_causal_jump_late_200_d128", "jump_late", 200.0, seqlen_q=1024, seqlen_k=1024,
       heads=2, head_dim=128, causal=True, window=(300, None)),
    _c("window_left_of_diagonal", "scale", 4.0, seqlen_q=200, seqlen_k=200, window=(40, -7)),
    _c("window_empty_band_fp16", "scale", 1.0, seqlen_q=100, seqlen_k=150, window=(-30, 20),
       dtype="fp16"),
    # a left bound only, with more than twice as many queries as keys: the unbounded right side
    # is clamped to seqlen_q (a clamp to seqlen_k hides every key from the first rows)
    _c("window_left_only_sq_gt_2sk", "jump_late", 100.0, seqlen_q=256, seqlen_k=96,
       window=(32, None)),
    # softcapping: large scores bent into (-softcap, softcap)
    _c("softcap_scale_12", "scale", 12.0, softcap=30.0),
    _c("softcap_jump_late_1000", "jump_late", 1000.0, softcap=50.0),
    _c("softcap_scale_4_d128_causal_window", "scale", 4.0, seqlen_q=512, seqlen_k=512,
       heads=2, head_dim=128, causal=True, window=(100, None), softcap=20.0),
    _c("softcap_ties_fp16", "ties", 1.0, softcap=5.0, dtype="fp16"),
)

BY_NAME = {c.name: c for c in CASES}
if len(BY_NAME) != len(CASES):
    raise RuntimeError("adversarial case names must be unique")


# Packed (varlen) batches and KV caches: the rows of k and v past a sequence's used keys (its
# ``seqused_k``, or a cache's unfilled capacity) may hold anything, NaN and infinities
# included (a cache allocated with torch.empty). A kernel that loads them and relies on the
# mask alone still multiplies P = 0 by V = inf or NaN in P V. Every varlen layer (PTX
# emulator, GPU tests of both forwards, the KV-cache calls) poisons those rows with
# ``poison_unused_keys`` and checks that nothing changes.
UNUSED_KEY_POISON = {"k": float("nan"), "v": float("inf")}


def poison_unused_keys(k, v, cu_seqlens_k, seqused_k):
    """Fill the rows of packed ``k`` / ``v`` past each sequence's used keys (rows
    ``cu_seqlens_k[i] + seqused_k[i]`` to ``cu_seqlens_k[i + 1]``) with ``UNUSED_KEY_POISON``,
    in place; returns the number of rows poisoned."""
    cu, used = cu_seqlens_k.tolist(), seqused_k.tolist()
    rows = 0
    for i, n in enumerate(used):
        unused = slice(cu[i] + n, cu[i + 1])
        k[unused] = UNUSED_KEY_POISON["k"]
        v[unused] = UNUSED_KEY_POISON["v"]
        rows += max(0, cu[i + 1] - cu[i] - n)
    return rows


def small_cases() -> tuple[AdversarialCase, ...]:
    return tuple(c for c in CASES if c.small)


def max_score_log2(case: AdversarialCase) -> float:
    """The largest |score| of the case's inputs in log2 units (scaled, float64)."""
    from fa_sm100.testing import attention_scores

    q, k, _ = case.inputs()
    s = attention_scores(q, k, case.softmax_scale, case.causal, case.window,
                         softcap=case.softcap)
    finite = s[torch.isfinite(s)]
    return float(finite.abs().max()) * softmax_math.LOG2_E if finite.numel() else 0.0


def gradient_cases() -> tuple[AdversarialCase, ...]:
    """The cases whose gradients the float64 rule holds: scores within ``P_EXACT_MAX_LOG2``.

    Beyond it the float32 rounding of a backward's exp2 argument (S * scale_log2 - LSE2, up
    to 2^-24 of |S| in log2 units) perturbs P by more than a 16-bit rounding, and dS, which
    multiplies K and Q of the same large magnitude, carries it into dq and dk: on ``scale_1e3``
    (scores of 1e6) the exact dq is 0 and FlashAttention-4's SM90 backward and ours both give
    a max error of 20.4 (H200). That is the conditioning of float32, not a kernel's fault, and
    no 16-bit plain baseline shows it; those forwards are still checked."""
    return tuple(c for c in CASES if max_score_log2(c) <= P_EXACT_MAX_LOG2)


def random_case(seed: int) -> AdversarialCase:
    """A seeded random case for fuzzing (the GPU test's ``--fuzz N``): shapes, GQA, masks,
    dtype, kind and its parameter, all from ``seed`` (so ``random_case(s)`` is its repro)."""
    rng = random.Random(seed)
    kind = rng.choice(KINDS)
    param = {
        "scale": 10 ** rng.uniform(-3, 1.2),
        "jump_late": rng.choice((60.0, 100.0, 149.0, 150.0, 151.0, 200.0, 500.0, 1000.0)),
        "jump_early": rng.choice((100.0, 150.0, 1000.0)),
        "large_v": 10 ** rng.uniform(1, 3),
    }.get(kind, 1.0)
    kv_heads = rng.choice((1, 2))
    return AdversarialCase(
        name=f"fuzz_{seed}", kind=kind, param=param,
        seqlen_q=rng.randint(1, 1100), seqlen_k=rng.randint(1, 1100),
        batch=rng.choice((1, 2)), heads=kv_heads * rng.choice((1, 2, 3)), kv_heads=kv_heads,
        head_dim=rng.choice((64, 96, 128, 256)), dtype=rng.choice(("bf16", "fp16")),
        causal=rng.random() < 0.5, seed=seed)


# Beyond this many log2 units a row max's own exp2 argument, fma(s, scale_log2, -(m *
# scale_log2)) with s = m, is the float32 rounding of m * scale_log2 (up to 2^-24 of it) and
# no longer rounds P to exactly 1 in the 16-bit type: O then carries one rounding of P
# (the dtype's unit roundoff, relative) that the plain baselines, whose P of the max is exactly
# 1, do not. FlashAttention-4's forward computes P the same way.
P_EXACT_MAX_LOG2 = 2.0**13
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def check_adversarial(case_name: str, out, lse, q, k, v, causal=False, window=(None, None),
                      softmax_scale=None, softcap=0.0):
    """Apply the rule of the module docstring to a kernel's (out, lse) on these inputs; raises
    AssertionError naming the case and what failed. Returns (err, plain_err) of O.

    The plain baseline is the more accurate of the all-16-bit computation and the
    mixed-precision one (``testing.attention_mixed``): on large scores the first is off by
    whole units while a correct kernel is not, and a rule measured against it would let a
    stale O through."""
    from fa_sm100.testing import (attention_mask, attention_mixed, attention_reference,
                                  attention_scores, check_against_reference, max_abs_error)

    q, k, v = (t.detach().cpu() for t in (q, k, v))
    out = out.detach().cpu()
    ref, ref_lse = attention_reference(q, k, v, softmax_scale, causal=causal, window=window,
                                       softcap=softcap)
    baselines = (attention_reference(q, k, v, softmax_scale, causal=causal, window=window,
                                     dtype=q.dtype, upcast=False, softcap=softcap),
                 attention_mixed(q, k, v, softmax_scale, causal=causal, window=window,
                                 softcap=softcap))
    plain = min((b[0] for b in baselines), key=lambda o: max_abs_error(o, ref))
    plain_lse = min((b[1].float() for b in baselines), key=lambda l: max_abs_error(l, ref_lse))
    vmax = max(float(v.abs().max()), 1.0)
    # the output's own final rounding: one unit roundoff at its largest magnitude
    atol = max(ATOL_REL_V * vmax, UNIT_ROUNDOFF[q.dtype] * float(ref.abs().max()))
    s = attention_scores(q, k, softmax_scale, causal, window, softcap=softcap)
    finite = torch.isfinite(s)
    if finite.any() and float(s[finite].abs().max()) * softmax_math.LOG2_E > P_EXACT_MAX_LOG2:
        atol += UNIT_ROUNDOFF[q.dtype] * vmax
    err = check_against_reference(out, ref, plain, atol=atol, what=f"{case_name} O")
    if lse is not None:
        check_against_reference(lse.detach().cpu(), ref_lse, plain_lse, atol=ATOL_LSE,
                                what=f"{case_name} LSE")
    # Convex hull: each output lies within [min, max] of v over the row's visible keys.
    mask = attention_mask(q.shape[1], k.shape[1], causal, window)
    g = q.shape[2] // k.shape[2]
    vf = v.to(torch.float64).repeat_interleave(g, dim=2).permute(0, 2, 1, 3)  # (b, h, sk, d)
    vis = (torch.ones(q.shape[1], k.shape[1], dtype=torch.bool) if mask is None else mask)
    big = torch.tensor(float("inf"), dtype=torch.float64)
    lo = torch.where(vis[None, None, :, :, None], vf[:, :, None], big).amin(3)
    hi = torch.where(vis[None, None, :, :, None], vf[:, :, None], -big).amax(3)
    o = out.to(torch.float64).permute(0, 2, 1, 3)  # (b, h, sq, d)
    empty = ~vis.any(1)  # rows that see no key: O must be 0
    lo = torch.where(empty[None, None, :, None], torch.zeros_like(lo), lo)
    hi = torch.where(empty[None, None, :, None], torch.zeros_like(hi), hi)
    slack = atol + 1e-2 * torch.maximum(lo.abs(), hi.abs())
    outside = (o < lo - slack) | (o > hi + slack)
    if bool(outside.any()):
        idx = tuple(int(i) for i in torch.nonzero(outside)[0])
        raise AssertionError(
            f"{case_name} O: {int(outside.sum())} outputs outside the range of the visible "
            f"rows of v, first at (batch, head, row, col) {idx}: {float(o[idx]):.4g} not in "
            f"[{float(lo[idx]):.4g}, {float(hi[idx]):.4g}]")
    return err


def check_adversarial_grads(case_name: str, grads, q, k, v, dout, causal=False,
                            window=(None, None), softmax_scale=None, softcap=0.0):
    """The float64 rule for (dq, dk, dv) of ``flash_attn_func`` on these inputs with output
    gradient ``dout``: each within twice the error of the better plain baseline (autograd of
    the all-16-bit attention, or ``testing.attention_mixed_grads``) plus
    ``testing.grad_atol``."""
    from fa_sm100.testing import (attention_mixed_grads, attention_reference_grads,
                                  check_against_reference, grad_atol, max_abs_error)

    q, k, v, dout = (t.detach().cpu() for t in (q, k, v, dout))
    ref = attention_reference_grads(q, k, v, dout, causal=causal, window=window,
                                    softcap=softcap)[2]
    plain16 = attention_reference_grads(q, k, v, dout, causal=causal, window=window,
                                        dtype=q.dtype, upcast=False, softcap=softcap)[2]
    mixed = attention_mixed_grads(q, k, v, dout, softmax_scale, causal=causal, window=window,
                                  softcap=softcap)
    errs = []
    for name, g, r, a, b in zip(("dq", "dk", "dv"), grads, ref, plain16, mixed):
        plain = min((a, b), key=lambda x: max_abs_error(x, r))
        errs.append(check_against_reference(g.detach().cpu(), r, plain, atol=grad_atol(r),
                                            what=f"{case_name} {name}"))
    return errs
