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
