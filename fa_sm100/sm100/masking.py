"""Which keys a work tile visits and which scores of a row are masked.

Alignment is bottom-right, the flash-attn convention (``fa_sm100.bands``): query row ``i``
(0-based, of ``seqlen_q``) sits at key position ``i' = i + seqlen_k - seqlen_q``. Causal keeps
keys ``j <= i'``; a sliding window ``(left, right)`` (None = unbounded; causal caps right at
0; a negative bound shifts the band past the diagonal) keeps ``i' - left <= j <= i' + right``.
Key tails
(``j >= seqlen_k``) are masked too; query tails need no mask because TMA loads rows past
``seqlen_q`` as zeros and the TMA store drops them.

A tile visits blocks ``n_min .. n_max - 1`` from the right-most down (the design's reverse
load order), so the one block that can hold a key tail comes first. It always visits at least
one block, even when every row of it is fully masked (e.g. causal with ``seqlen_q >
seqlen_k``): the protocol stays the same for every tile, and such rows end with row sum 0,
which the correction turns into O = 0 and LSE = -inf.

Whether there is a window is compile-time (``FmhaConfig.is_local``); the bounds themselves
are run-time launch arguments (``Problem.window``, from ``fa_sm100.bands.kernel_window``, an
unbounded side one that covers every key), so a new window reuses the compiled kernel.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from fa_sm100.bands import traced_bounds
from fa_sm100.sm100.scheduler import rows_per_tile


def band(cfg, prob):
    """(left, right) key offsets around the aligned diagonal (``bands.traced_bounds``)."""
    return traced_bounds(cfg, prob.window)


@cute.jit
def n_block_range(cfg, prob, m_block: Int32):
    """(n_min, n_max): the work tile ``m_block`` visits K/V blocks n_min .. n_max - 1."""
    n = cfg.n_block
    seqlen_q, seqlen_k = prob.seqlen_q, prob.seqlen_k
    left, right = band(cfg, prob)
    n_total = (seqlen_k + n - 1) // n
    if cutlass.const_expr(cfg.varlen):  # a sequence without keys still visits block 0, masked
        n_total = cutlass.max(n_total, 1)
    n_max = n_total
    n_min = Int32(0)
    if cutlass.const_expr(right is not None):
        row_end = cutlass.min((m_block + 1) * rows_per_tile(cfg), seqlen_q)
        # Keys visible to the last row of the tile: j < row_end + seqlen_k - seqlen_q + right.
        key_end = cutlass.max(row_end + seqlen_k - seqlen_q + right, 1)
        n_max = cutlass.min(n_max, (key_end + n - 1) // n)
    if cutlass.const_expr(left is not None):
        # First key visible to the first row of the tile.
        key_start = cutlass.max(m_block * rows_per_tile(cfg) + seqlen_k - seqlen_q - left, 0)
        n_min = cutlass.min(key_start // n, n_total - 1)
        n_max = cutlass.max(n_max, n_min + 1)
    return n_min, n_max


@cute.jit
def col_limits(cfg, prob, row: Int32, n_blk: Int32):
    """(lo, hi): columns ``c`` of block ``n_blk`` that row ``row`` sees are lo <= c < hi."""
    seqlen_q, seqlen_k = prob.seqlen_q, prob.seqlen_k
    left, right = band(cfg, prob)
    base = n_blk * cfg.n_block
    diag = row + seqlen_k - seqlen_q - base  # the aligned diagonal, as a column of this block
    hi = seqlen_k - base
    if cutlass.const_expr(right is not None):
        hi = cutlass.min(hi, diag + right + 1)
    lo = Int32(0)
    if cutlass.const_expr(left is not None):
        lo = diag - left
    return lo, hi


@cute.jit
def _mask_from(tSrS: cute.Tensor, tScS: cute.Tensor, hi: Int32):
    """Scores in columns >= hi -> -inf."""
    for i in cutlass.range(cute.size(tSrS), unroll_full=True):
        tSrS[i] = tSrS[i] if tScS[i][1] < hi else -Float32.inf


@cute.jit
def _mask_below(tSrS: cute.Tensor, tScS: cute.Tensor, lo: Int32):
    """Scores in columns < lo -> -inf."""
    for i in cutlass.range(cute.size(tSrS), unroll_full=True):
        tSrS[i] = tSrS[i] if tScS[i][1] >= lo else -Float32.inf


@cute.jit
def apply_mask(cfg, tSrS: cute.Tensor, tScS: cute.Tensor, lo: Int32, hi: Int32):
    """Set scores whose column (from the identity tensor ``tScS``) is outside [lo, hi) to -inf.

    One bound per pass, each only when it cuts into the block: the column of each register is
    a constant of the unrolled loop, so a pass is one compare per score against a run-time
    limit of the row (a combined two-sided test costs registers the 192-register softmax
    warpgroup does not have)."""
    if cutlass.const_expr(cfg.is_local):
        if lo > 0:
            _mask_below(tSrS, tScS, lo)
    if hi < cfg.n_block:
        _mask_from(tSrS, tScS, hi)
