"""Which keys a query row sees, and which tiles of the band a work tile visits.

Alignment is bottom-right, the flash-attn convention: query row ``i`` of ``seqlen_q`` sits at
key position ``i' = i + seqlen_k - seqlen_q``, and sees key ``j`` iff

    i' - left <= j <= i' + right        and        0 <= j < seqlen_k

``causal`` is a right bound of 0 (``min(right, 0)`` with a window). A bound may be negative:
the band then lies past the diagonal on that side (left = -2: keys from i' + 2 on), as FA4
defines it; a row whose band holds no key has O = 0 and LSE = -inf.

The kernels take the bounds as run-time integers (``kernel_window``): only "has a window or
not" is compile-time (and causal, a mask of its own), so changing the window, a side's size
or which sides are bounded, does not compile a new kernel. An unbounded
side becomes a bound that covers every key, and any bound is clamped to the range where it
still changes something, so the kernels' tile arithmetic stays far from 32-bit overflow.

The tile functions take DSL integers while a kernel is traced (``imax`` / ``imin`` =
``cutlass.max`` / ``cutlass.min``) and Python integers in the tests, which check them against
the element-wise rule above.
"""

from __future__ import annotations

from typing import Optional


def effective_bounds(causal: bool, left: Optional[int], right: Optional[int]):
    """(left, right) of the rule above, None for an unbounded side: causal caps right at 0."""
    if causal:
        right = 0 if right is None else min(right, 0)
    return left, right


def traced_bounds(cfg, window) -> tuple:
    """(left, right) a kernel masks and walks with, while it is traced: with a window
    (``cfg.is_local``) both run-time arguments of ``window`` (``kernel_window``'s: an unbounded
    side covers every key, causal's cap is applied), else None for both sides, or causal's
    constant right bound 0. The SM90 backward and the SM100 forward read their bounds through
    it."""
    if cfg.is_local:
        return window[0], window[1]
    return None, 0 if cfg.causal else None


def kernel_window(causal: bool, window: tuple, seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
    """The (left, right) integers a windowed kernel launch takes.

    left >= seqlen_k and right >= seqlen_q exclude no key of any row; left <= -seqlen_q - 1 and
    right <= -seqlen_k - 1 exclude every key of every row. So an unbounded side becomes the
    first, and any bound is clamped into [that empty value, that full value]: the visible keys
    of every row stay the same.
    """
    left, right = effective_bounds(causal, *window)
    left = seqlen_k if left is None else max(-seqlen_q - 1, min(left, seqlen_k))
    right = seqlen_q if right is None else max(-seqlen_k - 1, min(right, seqlen_q))
    return left, right


def kv_block_range(m_start, rows: int, n_block: int, seqlen_q, seqlen_k, left, right,
                   imax=max, imin=min):
    """(n_lo, n_hi): the key blocks [n_lo, n_hi) that query rows [m_start, m_start + rows)
    see, n_hi <= n_lo when they see none. Rows past seqlen_q may widen the range (they are
    never stored). Exact when some row sees a key; rows that see none (a band past the keys,
    or narrower than one key: left + right < 0) may still have blocks visited, whose scores
    are then all masked."""
    diag = m_start + seqlen_k - seqlen_q  # aligned position of the first row
    n_lo = imax(diag - left, 0) // n_block
    key_end = imax(diag + rows + right, 0)  # one past the last row's last visible key
    n_hi = imin((key_end + n_block - 1) // n_block, (seqlen_k + n_block - 1) // n_block)
    return n_lo, n_hi


def kv_masked_blocks(m_start, rows: int, n_block: int, seqlen_q, seqlen_k, left, right,
                     imax=max):
    """(right_from, left_to): key blocks >= right_from hold a key right of some row's band
    (past the first row's right edge), blocks < left_to one left of some row's band (before
    the last row's left edge). Blocks in [left_to, right_from) need no band mask."""
    diag = m_start + seqlen_k - seqlen_q
    right_from = imax(diag + right + 1, 0) // n_block
    left_to = (imax(diag + rows - 1 - left, 0) + n_block - 1) // n_block
    return right_from, left_to


def q_block_range(n_start, cols: int, m_block: int, seqlen_q, seqlen_k, left, right,
                  imax=max, imin=min):
    """(m_lo, m_hi): the query blocks [m_lo, m_hi) some row of which sees a key of columns
    [n_start, n_start + cols): the backward's sweep of one key block. Exact when some row
    sees one of those keys, as ``kv_block_range``."""
    off = seqlen_k - seqlen_q
    # row i sees column j iff j - off - right <= i <= j - off + left
    m_lo = imax(n_start - off - right, 0) // m_block
    last_col = imin(n_start + cols, seqlen_k) - 1
    row_end = imax(last_col - off + left + 1, 0)  # one past the last row that sees it
    m_hi = imin((row_end + m_block - 1) // m_block, (seqlen_q + m_block - 1) // m_block)
    return m_lo, m_hi


def kv_mask_phases(n_lo, n_blocks, right_from, left_to, imax=max, imin=min):
    """(n_right, n_left) of a forward work tile that visits blocks n_lo + n_blocks - 1 .. n_lo
    (``n_blocks`` > 0), last first: after the first block (always masked: it may hold the key
    tail) come ``n_right`` blocks masked for the right edge, then the unmasked ones, then
    ``n_left`` masked for the left edge. A masked block applies both edges, so a block that
    crosses both is counted once."""
    n_right = imax(n_lo + n_blocks - 1 - imax(right_from, n_lo), 0)
    n_left = imax(imin(left_to - n_lo, n_blocks - 1 - n_right), 0)
    return n_right, n_left
