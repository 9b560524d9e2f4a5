"""The SM100 backward kernel's arithmetic (``fa_sm100/sm100/bwd_*.py``), step by step, in torch
on the CPU.

``emulate_sm100_bwd(dout, q, k, v, ...)`` returns what ``sm100_bwd`` computes: the main
kernel's dK and dV, its float32 dQ accumulator and the postprocess's dq. It follows the
kernel's work tiles and their order, and models each rounding the compiled code makes:

- Rows (the preprocess): LSE2 = LSE log2(e) rounded to float32 (+inf where LSE = -inf: a
  row that sees no key) and Delta = rowsum(O dO) in float32, both padded to a whole query block with
  LSE2 = +inf and Delta = 0 (``preprocess_rows_from``). Their summation order is not modelled
  (the preprocess kernel's Delta sums in another order): the main kernel's arithmetic starts
  from the rows it is given. Without ``out`` and ``lse``, the rows come from the float64
  reference forward (``preprocess_rows``), as the PTX emulator's runs of the kernel make them.
- Work tiles. One CTA per (key block of 128 keys, KV head, batch). It walks the query blocks
  [m_lo, m_hi) of ``bands.q_block_range`` (with ``bands.kernel_window``'s bounds: every block
  without a mask, from the first that sees the key block with a causal mask, the band with a
  window), for each query head of its KV head's group: step j is head ``j // blocks`` of the
  group and query block ``m_lo + j % blocks`` (``bwd_load.step_head_block``). A key block
  with an empty range runs no step and writes zero dK and dV. The emulation vectorizes over the
  CTAs and walks the steps.
- S^T = K Q^T and dP^T = V dO^T with the MMA model of ``forward.mma_f32``: one instruction
  per 16 of the head dim, ascending, its 16 products exact and summed with the float32
  accumulator, rounded once. An MMA with its accumulate bit off is modelled as 0 plus the
  first instruction's sum (so a sum of zeros is +0, as in the PTX emulator).
- P = exp2(x - LSE2) with x = S^T scale_log2 (log2 units; scale_log2 = fp32(scale) fp32(log2
  e), ``forward.kernel_log2_factors``), exp2 by the SFU model (``ex2.ex2_sfu``: correctly
  rounded, subnormal results flushed, as ``ex2.approx.ftz``). With a cap c: t =
  tanh(S^T softcap_k) by ``softmax_math.softcap_tanh_model`` (its exp2 by the SFU model), x
  = t c log2(e). P is then 0 where the row does not see the key (causal, window, keys past
  seqlen_k: ``forward.visible_keys``), after the exp2 (a key past seqlen_k has score 0, and
  its unmasked P = exp2(-LSE2) is inf for rows whose every score lies far below 0: the
  adversarial ``shift_down`` cases). A padding row has LSE2 = +inf, so P = 0 there.
- dS = P (dP - Delta) in float32 (a subtract, then a multiply); with a cap, P (1 - t^2)
  first, in float32, and dS = that (dP - Delta). P and dS are rounded to the input dtype
  (round to nearest even) for their MMAs.
- dV += P^T dO and dK += dS^T Q: one instruction per 16 query columns, ascending, into float32
  accumulators that live across the whole group walk (the first step overwrites them).
  dQ_j = dS K, one instruction per 16 keys, ascending, fresh every step.
- dQ into the float32 accumulator (batch, heads, padded rows, head dim): each step's dQ_j is
  added to its query block's rows, one float32 add per element; the adds into a row are taken
  in key-block order. That is the deterministic kernel's order (Note [Deterministic dQ]) and
  the order of the PTX emulator, which runs CTAs one after another, key block fastest; on
  hardware the default kernel's atomic adds land in any order, which changes the sums'
  rounding only. dq = fp32(scale) times the accumulator, rounded to the input dtype (the
  postprocess).
- dK = fp32(scale) times its accumulator and dV = its accumulator, rounded to the input dtype.

What the ISA leaves open is modelled as the PTX emulator (``fa_sm100.ptxemu``) models it: an
MMA instruction rounds once; MUFU.EX2 is correctly rounded (measured on an H200: within 2 ulp
of that, docs/numerics.md). One choice belongs to ptxas, not the ISA: the kernel writes the
exp2 argument as a multiply and a subtract (``x * scale_log2 - LSE2``) and, with a cap, 1 -
t^2 as a multiply and a subtract, with no rounding modifier, which PTX lets the code
generator contract into one fused multiply-add; ptxas does so for sm_100a (FFMA in the SASS,
``tests/test_sm100_bwd_emulated.py``), so on hardware each is rounded once. ``fma_contracted``
(default True) models that; False rounds the product first, as the PTX reads and as the PTX
emulator executes it, which is what makes the bit-for-bit comparison with the kernel's PTX
possible.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fa_sm100 import softmax_math as sm
from fa_sm100.bands import kernel_window, q_block_range
from fa_sm100.emulation.ex2 import ex2_sfu
from fa_sm100.emulation.forward import check_inputs, kernel_log2_factors, mma_f32, visible_keys
from fa_sm100.sm100.bwd_config import select_sm100_bwd_config
from fa_sm100.testing import attention_reference
from fa_sm100.validation import check_softcap, check_softmax_scale, normalize_window
from layouts.smem import align_up

_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
WALKS = ("band", "all")


@dataclass
class EmulatedBackward:
    dq: torch.Tensor  # (batch, seqlen_q, heads, head_dim), the input dtype
    dk: torch.Tensor  # (batch, seqlen_k, kv heads, head_dim)
    dv: torch.Tensor  # (batch, seqlen_k, kv heads, head_dim_v)
    dq_acc: torch.Tensor  # (batch, heads, seqlen_q padded to m_block, head_dim) float32
    # (key block, KV head, batch) -> the steps its CTA runs (query blocks x group heads)
    steps: dict


def preprocess_rows_from(out, lse, dout, m_block: int):
    """(LSE2, Delta), (batch, heads, seqlen_q padded to ``m_block``) float32, from the
    forward's ``out`` (BSHD, rounded to dout's dtype) and ``lse`` (batch, heads, seqlen_q),
    as the preprocess makes them: LSE2 = lse log2(e) in lse's precision, rounded to float32
    (+inf where lse = -inf, and on the padding rows); Delta = rowsum(O dO) of the float32
    products (0 on the padding rows)."""
    b, sq, h, _ = dout.shape
    rows = align_up(sq, m_block)
    lse2 = torch.full((b, h, rows), math.inf, dtype=torch.float32)
    lse2[:, :, :sq] = torch.where(torch.isinf(lse), torch.full_like(lse, math.inf),
                                  lse * sm.LOG2_E).to(torch.float32)
    delta = torch.zeros(b, h, rows, dtype=torch.float32)
    o16 = out.to(dout.dtype).to(torch.float32)
    delta[:, :, :sq] = (o16 * dout.to(torch.float32)).sum(-1).permute(0, 2, 1)
    return lse2, delta


def preprocess_rows(q, k, v, dout, softmax_scale: float, causal: bool, m_block: int,
                    window=(None, None), softcap: float = 0.0):
    """``preprocess_rows_from`` the float64 reference forward (``testing.attention_reference``:
    O rounded to the input dtype, LSE in float64): the rows the PTX emulator's runs of the
    backward take (``ptxemu.sm100_bwd_run``)."""
    out, lse = attention_reference(q, k, v, softmax_scale, causal=causal, window=window,
                                   softcap=softcap)
    return preprocess_rows_from(out, lse, dout, m_block)


def _round_f32(x64: torch.Tensor) -> torch.Tensor:
    return x64.to(torch.float32)


def _mul_add(a, b, c, contracted: bool):
    """a * b + c in float32: one rounding (an FFMA) when ``contracted``, else the product's
    and the sum's (a multiply, then an add or a subtract of -c: the same rounding)."""
    prod = a.to(torch.float64) * b  # exact: a product of two float32 values
    if not contracted:
        prod = _round_f32(prod).to(torch.float64)
    return _round_f32(prod + c)


def _fresh_mma(a, b):
    """An MMA with the accumulate bit off: 0 + the first instruction's sum (module docstring)."""
    return mma_f32(a, b, torch.zeros(a.shape[:-1] + b.shape[-1:], dtype=torch.float32))


def key_block_walks(seqlen_q, seqlen_k, causal, window_size, m_block, n_block, walk="band"):
    """Per key block: the query blocks [m_lo, m_hi) its CTA visits (the kernel's
    ``Sm100Backward._problem``: ``bands.q_block_range`` of ``bands.kernel_window``'s bounds,
    an empty range as m_hi = m_lo); ``walk="all"`` visits every query block instead."""
    left, right = kernel_window(causal, window_size, seqlen_q, seqlen_k)
    m_blocks = -(-seqlen_q // m_block)
    out = []
    for n in range(-(-seqlen_k // n_block)):
        if walk == "all":
            out.append((0, m_blocks))
            continue
        lo, hi = q_block_range(n * n_block, n_block, m_block, seqlen_q, seqlen_k, left, right)
        out.append((lo, max(hi, lo)))
    return out


def emulate_sm100_bwd(dout, q, k, v, out=None, lse=None, softmax_scale=None, causal=False,
                      window_size=(None, None), softcap=0.0, fma_contracted=True,
                      walk="band") -> EmulatedBackward:
    """Run the SM100 backward's algorithm (module docstring) on CPU tensors: ``dout``, q, k, v
    BSHD (bf16 or fp16), ``out`` / ``lse`` the forward's (both or neither: without them, the
    float64 reference forward's). ``window_size`` (left, right), None unbounded;
    ``fma_contracted``: the exp2 argument (and 1 - t^2) rounded once, as the SASS, or twice,
    as the PTX; ``walk``: "band" (the kernel's) or "all" query blocks for every key block.
    Head dims as the kernel: 64, 96, 128 (others raise ValueError)."""
    check_inputs(q, k, v)
    b, sq, hq, d = q.shape
    sk, hk, dv = k.shape[1], k.shape[2], v.shape[3]
    if not isinstance(dout, torch.Tensor) or dout.shape != (b, sq, hq, dv) \
            or dout.dtype != q.dtype:
        raise ValueError(f"dout must be a {q.dtype} tensor of shape {(b, sq, hq, dv)}")
    if (out is None) != (lse is None):
        raise ValueError("give both out and lse (the forward's), or neither")
    if out is not None and (out.shape != dout.shape or lse.shape != (b, hq, sq)):
        raise ValueError(f"out must have dout's shape {tuple(dout.shape)} and lse the shape "
                         f"{(b, hq, sq)}, got {tuple(out.shape)} and {tuple(lse.shape)}")
    if walk not in WALKS:
        raise ValueError(f"walk={walk!r}: one of {WALKS}")
    scale = check_softmax_scale(softmax_scale, d)
    softcap = check_softcap(softcap)
    window = normalize_window(window_size)
    g = hq // hk
    cfg = select_sm100_bwd_config(d, dv, _DTYPE_NAMES[q.dtype], bool(causal), g,
                                  local=window != (None, None), softcap=softcap > 0)
    mb, nb = cfg.m_block, cfg.n_block
    if out is None:
        lse2, delta = preprocess_rows(q, k, v, dout, scale, causal, mb, window, softcap)
    else:
        lse2, delta = preprocess_rows_from(out, lse, dout, mb)
    scale_log2, softcap_k = kernel_log2_factors(scale, softcap)
    dtype = q.dtype
    m_blocks, n_blocks = -(-sq // mb), -(-sk // nb)
    sq_pad, sk_pad = m_blocks * mb, n_blocks * nb
    f64 = torch.float64

    def blocks(t, rows_pad, heads, block):  # BSHD -> (B, H_kv, group, blocks, block, D)
        padded = torch.zeros(t.shape[0], rows_pad, t.shape[2], t.shape[3], dtype=f64)
        padded[:, :t.shape[1]] = t.to(f64)  # TMA fills rows past the sequence with zeros
        return padded.view(b, rows_pad // block, block, hk, heads // hk, -1).permute(
            0, 3, 4, 1, 2, 5)

    qb, dob = blocks(q, sq_pad, hq, mb), blocks(dout, sq_pad, hq, mb)
    kb, vb = blocks(k, sk_pad, hk, nb)[:, :, 0], blocks(v, sk_pad, hk, nb)[:, :, 0]
    lse2_b, delta_b = (t.view(b, hk, g, m_blocks, mb) for t in (lse2, delta))

    walks = key_block_walks(sq, sk, causal, window, mb, nb, walk)
    m_lo = torch.tensor([w[0] for w in walks])
    n_q = torch.tensor([w[1] - w[0] for w in walks])
    steps = n_q * g
    dk_acc = torch.zeros(b, hk, n_blocks, nb, d, dtype=torch.float32)
    dv_acc = torch.zeros(b, hk, n_blocks, nb, dv, dtype=torch.float32)
    # each (key block, query block)'s dQ_j, added into the accumulator in key-block order below
    dq_parts = torch.zeros(n_blocks, b, hk, g, m_blocks, mb, d, dtype=torch.float32)
    lane = torch.arange(nb)
    for j in range(int(steps.max())):
        act = torch.nonzero(steps > j).flatten()  # the CTAs with a step j
        head = j // n_q[act]
        m = m_lo[act] + j % n_q[act]
        q_j, do_j = qb[:, :, head, m], dob[:, :, head, m]  # (B, Hk, A, m_block, D)
        k_j, v_j = kb[:, :, act], vb[:, :, act]  # (B, Hk, A, n_block, D)
        keys = (act * nb).view(-1, 1, 1) + lane.view(1, nb, 1)  # S^T: keys are rows
        rows = (m * mb).view(-1, 1, 1) + torch.arange(mb).view(1, 1, mb)
        seen = visible_keys(rows, keys, sq, sk, causal, window)  # (A, n_block, m_block)
        s_t = _fresh_mma(k_j, q_j.transpose(-1, -2))  # (B, Hk, A, keys, queries)
        t = None
        if softcap:
            t = sm.softcap_tanh_model(s_t * softcap_k, exp2=ex2_sfu)
        minus_lse2 = -lse2_b[:, :, head, m].unsqueeze(-2).to(f64)
        x = _mul_add(t if softcap else s_t, scale_log2, minus_lse2, fma_contracted)
        p = torch.where(seen, ex2_sfu(x), torch.zeros_like(x))
        p16 = p.to(dtype)
        if softcap:  # P (1 - t^2) where S^T was (Note [softcap in the SM100 backward])
            p = p * _mul_add(-t, t, 1.0, fma_contracted)
        dp_t = _fresh_mma(v_j, do_j.transpose(-1, -2))
        ds16 = (p * (dp_t - delta_b[:, :, head, m].unsqueeze(-2))).to(dtype)
        dv_acc[:, :, act] = mma_f32(p16, do_j, dv_acc[:, :, act])
        dk_acc[:, :, act] = mma_f32(ds16, q_j, dk_acc[:, :, act])
        dq_parts[act, :, :, head, m] = _fresh_mma(ds16.transpose(-1, -2), k_j).movedim(2, 0)

    acc = torch.zeros(dq_parts.shape[1:], dtype=torch.float32)
    for n in range(n_blocks):  # a block that does not reach a row adds +0 there: no change
        acc = acc + dq_parts[n]
    acc = acc.reshape(b, hq, sq_pad, d)
    scale32 = torch.tensor(scale, dtype=torch.float32)
    dq = (acc[:, :, :sq] * scale32).to(dtype).permute(0, 2, 1, 3).contiguous()
    dk, dv_out = (t.to(dtype).reshape(b, hk, sk_pad, -1)[:, :, :sk].permute(0, 2, 1, 3)
                  .contiguous() for t in (dk_acc * scale32, dv_acc))
    return EmulatedBackward(
        dq=dq, dk=dk, dv=dv_out, dq_acc=acc,
        steps={(n, h, bi): int(steps[n]) for n in range(n_blocks) for h in range(hk)
               for bi in range(b)})
