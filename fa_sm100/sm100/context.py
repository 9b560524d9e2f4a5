"""Small bundles of what the warp roles share, so no role takes twenty positional arguments.

These are plain Python containers of traced values; they exist only while the kernel is traced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import cutlass.cute as cute
from cutlass import Float32, Int32


@dataclass(frozen=True)
class Problem:
    """Run-time sizes of the attention problem and the softmax scale in log2 units."""

    seqlen_q: Int32
    seqlen_k: Int32
    num_heads: Int32
    batch: Int32
    num_m_blocks: Int32
    scale_log2: Float32  # softmax_scale * log2(e)
    # (left, right) run-time bounds of a windowed config (fa_sm100.bands.kernel_window), else
    # None; masking.band says which side the kernel reads
    window: Optional[tuple] = None
    # a softcapped config's tanh argument factor (softmax_scale / softcap), else None
    softcap_k: Optional[Float32] = None
    # varlen (fa_sm100.varlen): (cu_seqlens_q, cu_seqlens_k[, seqused_k[, page table]]); a
    # work tile's Problem (scheduler.tile_problem) has its sequence's lengths and first rows.
    # The page table of a paged cache (cfg.page_size) is flat, (batch x pages per sequence,)
    varlen: Optional[tuple] = None
    q_off: object = 0
    k_off: object = 0


@dataclass(frozen=True)
class Smem:
    """SMEM tensors: sQ (q_stage), sK / sV (the shared K/V ring), sO (q_stage) and the row
    statistics the softmax hands to the correction (``sStats[stage, kind, row]``)."""

    sQ: cute.Tensor
    sK: cute.Tensor
    sV: cute.Tensor
    sO: cute.Tensor
    sStats: cute.Tensor


@dataclass(frozen=True)
class Tmem:
    """TMEM views, one per Q stage, each placed at its TmemPlan offset (never a literal)."""

    tS: tuple  # S_i: (MMA, MMA_M, MMA_N) fp32 accumulator of Q_i K^T
    tO: tuple  # O_i: (MMA, MMA_M, MMA_N) fp32 accumulator of P_i V
    tP: tuple  # P_i: (MMA, MMA_M, MMA_K) 16-bit A operand of P_i V (alias inside S_i)
    p_minus_s: int  # columns from S_i to P_i (the same for every stage)
    base: object = None  # the allocated TMEM address (column 0 of the plan)


@dataclass(frozen=True)
class Gmem:
    """Global tensors in the kernel's mode order: Q/K (s, d, h, b), V (d, s, h, b),
    O (s, d, h, b), LSE (s, h, b) or None."""

    mQ: cute.Tensor
    mK: cute.Tensor
    mV: cute.Tensor
    mO: cute.Tensor
    mLSE: Optional[cute.Tensor]


# Slots of per-row statistics in sStats. Each sm_stats hand-off is its own pipeline phase, so
# the final hand-off reuses the per-step slot.
STAT_SCALE = 0  # per step: O rescale factor (1.0 = no rescale needed)
STAT_SUM = 0  # final hand-off: row sum
STAT_MAX = 1  # final hand-off: row max (log2 units, already multiplied by the softmax scale)
NUM_STATS = 2


# ------------------------------------------------------------------------------- backward

@dataclass(frozen=True)
class BwdProblem:
    """Run-time sizes of one backward work tile: the CTA's key block ``n_block`` of KV head
    ``head_kv`` of ``batch``, and the query blocks it visits, ``m_min <= m < m_max`` of each
    of the group's ``group`` query heads, ``iters`` steps in all (step i: query head
    ``head_kv * group + i // (m_max - m_min)``, block ``m_min + i % (m_max - m_min)``): with
    a causal mask or a window, only the query blocks whose band reaches the key block."""

    seqlen_q: Int32
    seqlen_k: Int32
    n_block: Int32
    head_kv: Int32
    batch: Int32
    m_min: Int32
    m_max: Int32
    iters: Int32
    scale_log2: Float32  # softmax_scale * log2(e); a softcapped config's softcap * log2(e)
    softmax_scale: Float32
    # (left, right) run-time bounds of a windowed config (fa_sm100.bands.kernel_window), else
    # None (causal alone is the constant right bound 0)
    window: Optional[tuple] = None
    # a softcapped config's tanh argument factor (softmax_scale / softcap), else None
    softcap_k: Optional[Float32] = None


@dataclass(frozen=True)
class BwdSmem:
    """SMEM tensors of the backward: sK, sV (the work tile), sQ / sdO (K-major B operands,
    q_stage stages) and sQt / sdOt / sKt (the same bytes as MN-major B operands; under 2-CTA
    buffers of their own), sdS, and the float32 rows sLSE2 / sDelta (m_block, q_stage)."""

    sK: cute.Tensor
    sV: cute.Tensor
    sQ: cute.Tensor
    sQt: cute.Tensor
    sdO: cute.Tensor
    sdOt: cute.Tensor
    sKt: cute.Tensor
    sdS: cute.Tensor
    sLSE2: cute.Tensor
    sDelta: cute.Tensor


@dataclass(frozen=True)
class BwdTmem:
    """TMEM views of the backward, each at its TmemPlan.for_backward offset: the S^T, dP^T,
    dV, dK, dQ accumulators; tP / tdS, one A-operand view per compute warpgroup h whose
    k-block k (4h <= k < 4h + 4) is the 16 queries of columns [16k, 16k + 16) of P^T / dS^T;
    ``plan``: the column plan."""

    tS: cute.Tensor
    tdP: cute.Tensor
    tdV: cute.Tensor
    tdK: cute.Tensor
    tdQ: cute.Tensor
    tP: tuple
    tdS: tuple
    plan: object
    # 2-CTA: dQ as 128 lanes x head_dim / 2 columns (TmemPlan.for_backward); else None
    tdQ_lanes: Optional[cute.Tensor] = None
