"""The SM100 forward kernel's arithmetic, step by step, in torch on the CPU.

Rows of a work tile see the same K/V blocks in the same order, and each row's arithmetic
depends on nothing but that order, so the emulation vectorizes over batch, heads and work tiles
and walks the K/V blocks:

- Work tiles. One CTA (pair, with 2-CTA MMA) processes ``m_block * q_stage * cta_group``
  consecutive query rows (Q stages and CTAs of the pair) against one sequence of K/V blocks.
  The block range [n_min, n_max) is the union over those rows of the visible keys (causal /
  sliding window, bottom-right aligned as in ``fa_sm100.testing``); blocks are visited in
  reverse order n_max-1 .. n_min, at least one per tile. Rows that see nothing in the first
  block(s) of their work tile start from a -inf max, exactly as in the kernel.
- S = Q K^T with the MMA model of ``mma_f32`` (per K = 16 instruction: exact products plus
  the float32 accumulator, rounded once). With ``softcap`` c the scores become t =
  tanh(s * softcap_k) by the kernels' tanh (``softmax_math.softcap_tanh_model`` with the SFU
  model for its exp2), and scale_log2 = c * log2(e) from here on. Keys outside the row's
  visible range are -inf.
- Row max and correction: ``m_new = max(m, block max)``, ``growth = (m_new - m) *
  scale_log2``; ``softmax_math.rescale_needed`` decides whether the row moves to ``m_new`` with
  the factor ``exp2((m - m_new) * scale_log2)`` (SFU; 0 for a row that had seen no key) or
  keeps its stale max with the factor 1. The row sum takes the factor; O takes it through the
  correction warps' vote (Note [Correction vote] in softmax_math): from a tile's second block
  on, each warp of 32 rows multiplies its rows of O only when one of them has
  ``softmax_math.correction_needed``, before the block's PV MMAs accumulate into it. The
  first block's PV MMA overwrites O.
- P: ``x = fma(s, scale_log2, -(m * scale_log2))``; exp2 by the polynomial for the columns of
  ``softmax_math.ex2_emulated_mask`` and by the SFU model for the others (``emulation.ex2``);
  the block's row sum adds the float32 values in the kernel's order (``row_sum_sequential``)
  and ``row_sum = fma(row_sum, scale, block_sum)``; P is rounded to the input dtype (round to
  nearest even, as cvt.rn) before P V.
- O += P V: one MMA instruction per 16 columns of P, in ascending column order within each
  part of ``softmax_math.p_split_columns``. Split P changes when the MMAs of the last part
  issue, not what they add, so its outputs are bit-identical to no split.
- Epilogue: O * (1 / row_sum) rounded to the input dtype; LSE = (m * scale_log2 +
  log2(row_sum)) * ln 2 in float32. Rows with row_sum == 0 give O = 0, LSE = -inf.

What the ISA leaves open is modelled the way the PTX emulator (``fa_sm100.ptxemu``) models it:
an MMA instruction rounds once; MUFU.EX2/LG2/RCP are correctly rounded (measured on an H200:
EX2 within 2 ulp of that, RCP within 1). Under that shared model the emulation and the
kernel's own PTX on the PTX emulator agree bit for bit (``tests/test_emulation_ptx.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from fa_sm100 import softmax_math as sm
from fa_sm100.config import FmhaConfig, normalize_dtype, select_config
from fa_sm100.emulation.ex2 import ex2_mixed, ex2_sfu
from fa_sm100.validation import check_softcap

MMA_K = 16  # columns of P (rows of V) one f16-kind tcgen05 MMA instruction consumes
ROW_SUM_CHUNK = 32  # columns per tcgen05.ld chunk: the unit of the kernel's row-sum chain
WARP_ROWS = 32  # rows (TMEM lanes) of one correction warp: the unit of the rescale vote

_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
# Switches that reach the emulation. kv_stage and persistent only schedule work (how many K/V
# tiles are in flight, which CTA takes which tile); a row's arithmetic does not depend on them,
# so kv_stage is re-derived for the problem instead of being checked against its SMEM budget.
SWITCH_FIELDS = ("q_stage", "use_2cta", "split_p", "split_p_col", "ex2_emu_fraction",
                 "rescale_threshold", "persistent")


@dataclass
class EmulationStats:
    """How often the correction fired. Counted over valid rows, for every K/V tile after the
    first one in which the row already had a finite max (a real choice between stale and new)."""

    threshold: float
    row_tiles: int = 0  # (row, tile) decisions
    max_grew: int = 0  # the tile raised the row max at all
    rescaled: int = 0  # growth > threshold: O and row sum rescaled
    rows: int = 0
    rows_rescaled: int = 0  # rows that rescaled at least once
    max_p: float = 0.0  # largest P before the final 1/row_sum (<= 2^threshold)
    per_row_rescales: Optional[torch.Tensor] = field(default=None, repr=False)

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "per_row_rescales"}
        d["rescale_rate"] = self.rescaled / self.row_tiles if self.row_tiles else 0.0
        d["grow_rate"] = self.max_grew / self.row_tiles if self.row_tiles else 0.0
        return d


def check_inputs(q, k, v):
    """Raise ValueError unless q, k, v are BSHD bf16 / fp16 tensors of one problem."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be BSHD (batch, seqlen, heads, head_dim), got shape "
                             f"{tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    normalize_dtype(q.dtype)  # raises for anything but bf16 / fp16
    b, sq, hq, d = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(f"batch sizes differ: q {b}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree in seqlen and heads")
    if k.shape[3] != d:
        raise ValueError(f"head_dim of q ({d}) and k ({k.shape[3]}) differ")
    if sq < 1 or k.shape[1] < 1:
        raise ValueError(f"seqlens must be >= 1, got seqlen_q={sq}, seqlen_k={k.shape[1]}")
    if hq % k.shape[2]:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({k.shape[2]})")


def resolve_config(q, k, v, causal=False, window_size=(None, None),
                   config: Optional[FmhaConfig] = None, softcap: float = 0.0) -> FmhaConfig:
    """The config the kernel would run: problem fields from the tensors and arguments, switch
    fields from ``config`` (or the defaults ``select_config`` picks for this problem)."""
    check_inputs(q, k, v)
    left, right = window_size if window_size is not None else (None, None)
    problem = dict(head_dim=q.shape[3], head_dim_v=v.shape[3], dtype=q.dtype,
                   seqlen_q=q.shape[1], seqlen_k=k.shape[1], causal=bool(causal),
                   qhead_per_kvhead=q.shape[2] // k.shape[2], window_left=left, window_right=right,
                   softcap=softcap > 0)
    if config is None:
        return select_config(**problem)
    if not isinstance(config, FmhaConfig):
        raise ValueError(f"config must be an FmhaConfig, got {type(config).__name__}")
    switches = {f: getattr(config, f) for f in SWITCH_FIELDS}
    return select_config(**problem, num_sms=config.num_sms, **switches)


def kv_tile_ranges(seqlen_q, seqlen_k, cfg: FmhaConfig, causal, window_size):
    """Per work tile: (first row, stop row, n_min, n_max); K/V tiles visited n_max-1 .. n_min."""
    left, right = window_size if window_size is not None else (None, None)
    if causal:
        right = 0 if right is None else min(right, 0)
    rows = cfg.m_block * cfg.q_stage * cfg.cta_group
    nb = cfg.n_block
    n_tiles_k = -(-seqlen_k // nb)
    out = []
    for r0 in range(0, seqlen_q, rows):
        r1 = min(r0 + rows, seqlen_q)
        hi_key = seqlen_k - 1 if right is None else min(seqlen_k - 1, r1 - 1 + seqlen_k - seqlen_q + right)
        lo_key = 0 if left is None else max(0, r0 + seqlen_k - seqlen_q - left)
        n_max = hi_key // nb + 1 if hi_key >= 0 else 0
        n_min = min(lo_key // nb, n_tiles_k - 1)
        # A tile visits at least one block even when all its rows are masked (the kernel keeps
        # one protocol for every tile); such rows end with row sum 0.
        out.append((r0, r1, n_min, max(n_max, n_min + 1)))
    return out


def visible_keys(rows, keys, seqlen_q, seqlen_k, causal, window_size):
    """Bool (rows, keys) broadcast: key visible to row (same rule as testing.attention_mask)."""
    left, right = window_size if window_size is not None else (None, None)
    if causal:
        right = 0 if right is None else min(right, 0)
    aligned = rows + (seqlen_k - seqlen_q)
    vis = keys < seqlen_k
    if right is not None:
        vis = vis & (keys <= aligned + right)
    if left is not None:
        vis = vis & (keys >= aligned - left)
    return vis


def kernel_log2_factors(softmax_scale: float, softcap: float = 0.0):
    """(scale_log2, softcap_k) as the kernels' host code makes them, in float32: scale_log2 =
    fp32(scale) * fp32(log2 e); with a cap c, softcap_k = fp32(scale) / fp32(c) (a float32
    0-dim tensor, the factor inside tanh) and scale_log2 = fp32(c) * fp32(log2 e); without
    one softcap_k is None."""
    f32 = torch.float32
    log2_e = torch.tensor(sm.LOG2_E, dtype=f32)
    if not softcap:
        return float(torch.tensor(softmax_scale, dtype=f32) * log2_e), None
    c32 = torch.tensor(softcap, dtype=f32)
    return float(c32 * log2_e), torch.tensor(softmax_scale, dtype=f32) / c32


def _round_f32(x64: torch.Tensor) -> torch.Tensor:
    return x64.to(torch.float32)


def mma_f32(a: torch.Tensor, b: torch.Tensor, acc: Optional[torch.Tensor] = None,
            k_ranges=None) -> torch.Tensor:
    """``acc + a @ b`` as a sequence of f16-kind MMA instructions with a float32 accumulator.

    ``a`` (..., M, K) and ``b`` (..., K, N) hold 16-bit values (any float dtype). Each
    instruction takes K = 16: its 16 products are exact, they are summed with the accumulator
    in float64 and the result is rounded once to float32 (the hardware's internal order and
    width are not specified; the PTX emulator uses the same model). ``k_ranges`` lists
    [start, stop) ranges of K in issue order (split P); default: all of K, ascending.
    Returns float32.
    """
    k = a.shape[-1]
    if k % MMA_K:
        raise ValueError(f"MMA K extent {k} is not a multiple of {MMA_K}")
    order = [k0 for lo, hi in (k_ranges or ((0, k),)) for k0 in range(lo, hi, MMA_K)]
    # All instructions' partial sums at once: (..., C, M, N) in float64, exact products.
    a64 = a.to(torch.float64).unflatten(-1, (k // MMA_K, MMA_K)).movedim(-2, -3)
    b64 = b.to(torch.float64).unflatten(-2, (k // MMA_K, MMA_K))
    parts = torch.matmul(a64, b64)  # (..., C, M, N)
    out = torch.empty(parts.shape[:-3] + parts.shape[-2:], dtype=torch.float32)
    for i, k0 in enumerate(order):
        part = parts[..., k0 // MMA_K, :, :]
        if acc is not None or i > 0:
            part.add_(out if i > 0 else acc)  # in float64: the float32 accumulator converts exactly
        out.copy_(part)  # the one rounding of this instruction
    return out


def row_sum_sequential(p: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """The kernel's float32 row sum of its exp2 values, in the kernel's order.

    ``TensorSSA.reduce(ADD, 0.0)`` over the row fragment compiles (PTX of the sm_100a kernel)
    to one ordered chain per 32-column TMEM load chunk, ``((0 + p[32j]) + p[32j+1]) + ...``,
    and then a chain over the chunk sums, ``((0 + c0) + c1) + ...``; ``start`` is where the
    chunk chain starts (the kernel starts at 0 and adds the rescaled old sum afterwards).
    """
    total = start
    for c0 in range(0, p.shape[-1], ROW_SUM_CHUNK):
        chunk = torch.zeros_like(start)
        for c in range(c0, min(c0 + ROW_SUM_CHUNK, p.shape[-1])):
            chunk = chunk + p[..., c]
        total = total + chunk
    return total


def emulate_sm100_fwd(q, k, v, softmax_scale=None, causal=False, window_size=(None, None),
                      config: Optional[FmhaConfig] = None, return_stats=False, softcap=0.0):
    """Run the SM100 forward algorithm on CPU tensors (BSHD, bf16 or fp16).

    Returns ``(out, lse)`` (out in the input dtype, lse float32 (batch, heads, seqlen_q) in
    natural-log units), plus an ``EmulationStats`` when ``return_stats``.
    """
    softcap = check_softcap(softcap)
    cfg = resolve_config(q, k, v, causal, window_size, config, softcap)
    dtype = _TORCH_DTYPES[cfg.dtype]
    b, sq, hq, d = q.shape
    sk, hk, dv = k.shape[1], k.shape[2], v.shape[3]
    g = hq // hk
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"softmax_scale={softmax_scale!r}: must be a finite positive number")
    scale_log2, softcap_k = kernel_log2_factors(scale, softcap)
    threshold = float(cfg.rescale_threshold)
    nb = cfg.n_block
    ranges = kv_tile_ranges(sq, sk, cfg, causal, window_size)
    rows = cfg.m_block * cfg.q_stage * cfg.cta_group
    t_count = len(ranges)
    sq_pad = t_count * rows
    n_tiles_k = -(-sk // nb)

    # Work-tile views: Q (B, Hk, G, T, R, D); K, V tiles (B, Hk, N, nb, D).
    qf = torch.zeros(b, sq_pad, hq, d, dtype=torch.float32)
    qf[:, :sq] = q.to(torch.float32)
    qw = qf.view(b, t_count, rows, hk, g, d).permute(0, 3, 4, 1, 2, 5)
    kf = torch.zeros(b, n_tiles_k * nb, hk, d, dtype=torch.float32)
    kf[:, :sk] = k.to(torch.float32)
    vf = torch.zeros(b, n_tiles_k * nb, hk, dv, dtype=torch.float32)
    vf[:, :sk] = v.to(torch.float32)
    # float64 copies (exact): the MMA model sums each instruction's products in float64
    qw = qw.to(torch.float64)
    kt = kf.view(b, n_tiles_k, nb, hk, d).permute(0, 3, 1, 2, 4).to(torch.float64)
    vt = vf.view(b, n_tiles_k, nb, hk, dv).permute(0, 3, 1, 2, 4).to(torch.float64)

    n_min = torch.tensor([r[2] for r in ranges])
    n_max = torch.tensor([r[3] for r in ranges])
    steps = int((n_max - n_min).max()) if t_count else 0
    row_idx = torch.arange(sq_pad).view(t_count, rows, 1)
    row_valid = (row_idx < sq).view(1, 1, 1, t_count, rows)
    emu_cols = torch.tensor(sm.ex2_emulated_mask(nb, cfg.ex2_emu_fraction))
    splits = sm.p_split_columns(nb, cfg.split_p, cfg.split_p_col)

    state_shape = (b, hk, g, t_count, rows)
    m = torch.full(state_shape, float("-inf"))
    row_sum = torch.zeros(state_shape)
    o = torch.zeros(*state_shape, dv)
    stats = EmulationStats(threshold=threshold)
    per_row = torch.zeros(state_shape, dtype=torch.int64)

    for j in range(steps):
        tile_all = n_max - 1 - j  # (T,) the K/V tile each work tile visits at step j
        act = torch.nonzero(tile_all >= n_min).flatten()  # work tiles with a block left
        if act.numel() == t_count:
            act = slice(None)  # every work tile: views instead of gathers
        tile = tile_all[act]
        keys = (tile * nb).view(-1, 1, 1) + torch.arange(nb).view(1, 1, nb)
        rows_a = row_idx[act]  # (A, R, 1)
        vis = visible_keys(rows_a, keys, sq, sk, causal, window_size)  # (A, R, nb)
        valid = (rows_a < sq).view(1, 1, 1, -1, rows)
        s = mma_f32(qw[:, :, :, act], kt[:, :, tile].unsqueeze(2).transpose(-1, -2))
        if softcap_k is not None:
            s = sm.softcap_tanh_model(s * softcap_k, exp2=ex2_sfu)
        s = s.masked_fill(~vis, float("-inf"))  # (B, Hk, G, A, R, nb)
        m_a, sum_a, o_a = m[:, :, :, act], row_sum[:, :, :, act], o[:, :, :, act]

        tile_max = s.amax(dim=-1)
        m_new = torch.maximum(m_a, tile_max)
        # float32 subtract, float32 multiply; -inf - -inf is NaN, which never rescales
        growth = (m_new - m_a) * scale_log2
        rescale = sm.rescale_needed(growth, threshold)
        acc_scale = torch.where(rescale, ex2_sfu((m_a - m_new) * scale_log2),
                                torch.ones_like(growth))
        m_next = torch.where(rescale, m_new, m_a)
        decided = valid & torch.isfinite(m_a)
        stats.row_tiles += int(decided.sum())
        stats.max_grew += int((decided & (tile_max > m_a)).sum())
        stats.rescaled += int((decided & rescale).sum())
        per_row[:, :, :, act] += (decided & rescale).to(torch.int64)
        m_safe = torch.where(torch.isinf(m_next), torch.zeros_like(m_next), m_next)

        # x = fma(s, scale_log2, -(m * scale_log2)): exact product in float64, one rounding.
        bias = -(m_safe * scale_log2)
        x = _round_f32(s.to(torch.float64) * scale_log2 + bias.to(torch.float64).unsqueeze(-1))
        p = ex2_mixed(x, emu_cols)
        # row_sum * scale + block sum: one FMA in the compiled kernel (fma.rn.f32)
        blk_sum = row_sum_sequential(p, torch.zeros_like(sum_a))
        row_sum[:, :, :, act] = _round_f32(sum_a.to(torch.float64) * acc_scale.to(torch.float64)
                                           + blk_sum.to(torch.float64))
        p_lo = p.to(dtype)
        stats.max_p = max(stats.max_p, float(torch.where(valid.unsqueeze(-1), p,
                                                         torch.zeros_like(p)).max()))

        # The correction rescales O before this block's PV MMAs accumulate into it, warp by
        # warp: a warp's 32 rows are multiplied (each by its factor) when the vote finds one
        # that needs it. The first block's PV MMA overwrites O.
        o_scaled = None
        if j > 0:
            warp_votes = sm.correction_needed(acc_scale).unflatten(-1, (-1, WARP_ROWS))
            warp_rescales = warp_votes.any(-1, keepdim=True).expand_as(warp_votes).flatten(-2)
            o_scaled = torch.where(warp_rescales.unsqueeze(-1), o_a * acc_scale.unsqueeze(-1),
                                   o_a)
        o[:, :, :, act] = mma_f32(p_lo, vt[:, :, tile].unsqueeze(2), o_scaled, splits)
        m[:, :, :, act] = m_next

    empty = (row_sum == 0) | torch.isnan(row_sum)
    inv = 1.0 / torch.where(empty, torch.ones_like(row_sum), row_sum)
    out = (o * inv.unsqueeze(-1)).to(dtype)
    m_final = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    log2_sum = torch.log2(torch.where(empty, torch.ones_like(row_sum), row_sum).to(torch.float64))
    lse = m_final * scale_log2 + log2_sum.to(torch.float32)  # MUFU.LG2 modelled rounded once
    lse = torch.where(empty, torch.full_like(lse, float("-inf")), lse * sm.LN_2)

    out = out.permute(0, 3, 4, 1, 2, 5).reshape(b, sq_pad, hq, dv)[:, :sq]
    lse = lse.reshape(b, hq, sq_pad)[:, :, :sq]
    if not return_stats:
        return out, lse
    stats.rows = b * hq * sq
    stats.rows_rescaled = int(((per_row > 0) & row_valid).sum())
    stats.per_row_rescales = per_row.reshape(b, hq, sq_pad)[:, :, :sq]
    return out, lse, stats


def emulate_sm100_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k=None,
                         softmax_scale=None, causal=False, window_size=(None, None),
                         config: Optional[FmhaConfig] = None, softcap=0.0):
    """The SM100 forward's algorithm on packed CPU tensors (fa_sm100.varlen): q (total_q, h,
    d), k / v (total_k, h_kv, d / dv), int32 offsets. The varlen kernel runs each sequence's
    tiles as a batch-1 problem of that sequence's lengths, so this emulates each sequence
    alone with ``config``'s switches; a sequence without keys gives O = 0 and LSE = -inf.
    Returns (out (total_q, h, dv), lse (h, total_q) float32)."""
    total_q, hq, _ = q.shape
    out = torch.zeros(total_q, hq, v.shape[2], dtype=q.dtype)
    lse = torch.full((hq, total_q), float("-inf"), dtype=torch.float32)
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(cu_q) - 1):
        q0, q1, k0 = cu_q[i], cu_q[i + 1], cu_k[i]
        sk = int(seqused_k[i]) if seqused_k is not None else cu_k[i + 1] - k0
        if q1 == q0 or sk == 0:
            continue
        o_i, lse_i = emulate_sm100_fwd(q[q0:q1].unsqueeze(0), k[k0:k0 + sk].unsqueeze(0),
                                       v[k0:k0 + sk].unsqueeze(0), softmax_scale, causal,
                                       window_size, config, softcap=softcap)
        out[q0:q1], lse[:, q0:q1] = o_i[0], lse_i[0]
    return out, lse
