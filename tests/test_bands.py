"""The band arithmetic of ``fa_sm100.bands`` against the element-wise rule it summarises.

The kernels trace these functions with DSL integers; here they run on Python integers over
exhaustive small problems (tiles of 2-5 rows and keys, bounds from "excludes every key" to
"excludes none", negative bounds included), and every claim of their docstrings is checked
against ``fa_sm100.testing.attention_mask``, the mask the float64 reference uses.
"""

import itertools

import pytest
import torch

from fa_sm100.bands import (effective_bounds, kernel_window, kv_block_range, kv_mask_phases,
                            kv_masked_blocks, q_block_range)
from fa_sm100.testing import attention_mask
from fa_sm100.validation import normalize_window

SEQLENS = [(1, 1), (3, 7), (7, 3), (6, 6), (9, 13)]
BOUNDS = [None, -12, -4, -2, 0, 1, 3, 8, 20]


def visible(sq, sk, causal, window, virtual_rows=0):
    """(sq + virtual_rows, sk) bool: rows past seqlen_q follow the same rule (a tile's rows
    past seqlen_q are computed, never stored)."""
    left, right = effective_bounds(causal, *window)
    i = torch.arange(sq + virtual_rows).unsqueeze(1) + (sk - sq)
    j = torch.arange(sk).unsqueeze(0)
    mask = torch.ones(sq + virtual_rows, sk, dtype=torch.bool)
    if right is not None:
        mask &= j <= i + right
    if left is not None:
        mask &= j >= i - left
    return mask


def problems():
    for (sq, sk), causal, left, right in itertools.product(SEQLENS, (False, True), BOUNDS,
                                                            BOUNDS):
        yield sq, sk, causal, (left, right)


def test_visible_is_the_reference_mask():
    for sq, sk, causal, window in problems():
        ref = attention_mask(sq, sk, causal, window)
        mine = visible(sq, sk, causal, window)
        assert torch.equal(mine, torch.ones_like(mine) if ref is None else ref)


def test_kernel_window_keeps_every_rows_keys():
    for sq, sk, causal, window in problems():
        left, right = kernel_window(causal, window, sq, sk)
        assert abs(left) <= sq + sk + 1 and abs(right) <= sq + sk + 1  # far from overflow
        assert torch.equal(visible(sq, sk, False, (left, right)), visible(sq, sk, causal, window))


@pytest.mark.parametrize("rows,cols", [(2, 2), (3, 2), (2, 5), (4, 3)])
def test_kv_block_range_is_the_blocks_with_visible_keys(rows, cols):
    for sq, sk, causal, window in problems():
        left, right = kernel_window(causal, window, sq, sk)
        n_blocks = -(-sk // cols)
        for m in range(-(-sq // rows)):
            # rows past seqlen_q see what the kernel's bounds give them
            vis = visible(sq, sk, False, (left, right), rows)[m * rows:(m + 1) * rows]
            seen = [bool(vis[:, n * cols:(n + 1) * cols].any()) for n in range(n_blocks)]
            lo, hi = kv_block_range(m * rows, rows, cols, sq, sk, left, right)
            visited = [lo <= n < hi for n in range(n_blocks)]
            if any(seen):  # else nothing is visible: whatever is visited is masked
                assert visited == seen, (sq, sk, causal, window, m)


@pytest.mark.parametrize("rows,cols", [(2, 2), (3, 2), (2, 5), (4, 3)])
def test_forward_mask_phases_mask_every_block_that_needs_it(rows, cols):
    """Every visited block holding a hidden (row, key < seqlen_k) pair lies in a masked phase
    (the first block, the right-edge run or the left-edge run), and every block of the
    unmasked middle is fully visible."""
    for sq, sk, causal, window in problems():
        left, right = kernel_window(causal, window, sq, sk)
        for m in range(-(-sq // rows)):
            # rows past seqlen_q see what the kernel's bounds give them
            vis = visible(sq, sk, False, (left, right), rows)[m * rows:(m + 1) * rows]
            lo, hi = kv_block_range(m * rows, rows, cols, sq, sk, left, right)
            if hi <= lo:
                continue
            right_from, left_to = kv_masked_blocks(m * rows, rows, cols, sq, sk, left, right)
            n_right, n_left = kv_mask_phases(lo, hi - lo, right_from, left_to)
            order = list(range(hi - 1, lo - 1, -1))  # the visiting order, last block first
            masked = set(order[:1 + n_right]) | set(order[len(order) - n_left:])
            for n in order:
                block = vis[:, n * cols:min((n + 1) * cols, sk)]
                full = bool(block.all()) and (n + 1) * cols <= sk
                assert full or n in masked, (sq, sk, causal, window, m, n)
            # the right-edge run is exactly the blocks past right_from, the left run before left_to
            assert all(n >= right_from for n in order[1:1 + n_right])
            assert all(n < left_to for n in order[len(order) - n_left:])


@pytest.mark.parametrize("rows,cols", [(2, 2), (3, 2), (2, 5)])
def test_q_block_range_is_the_query_blocks_that_see_a_key_block(rows, cols):
    for sq, sk, causal, window in problems():
        left, right = kernel_window(causal, window, sq, sk)
        vis = visible(sq, sk, causal, window)
        for n in range(-(-sk // cols)):
            seen = [bool(vis[m * rows:(m + 1) * rows, n * cols:(n + 1) * cols].any())
                    for m in range(-(-sq // rows))]
            lo, hi = q_block_range(n * cols, cols, rows, sq, sk, left, right)
            visited = [lo <= m < hi for m in range(len(seen))]
            if any(seen):
                assert visited == seen, (sq, sk, causal, window, n)


def test_window_conventions():
    """None and -1 are unbounded (flash-attn 2 passes -1); any other int is a bound, negative
    ones included (FA4's shifted bands); anything else is a ValueError."""
    assert normalize_window(None) == (None, None)
    assert normalize_window((-1, -1)) == (None, None)
    assert normalize_window((128, -1)) == (128, None)
    assert normalize_window([-1, 0]) == (None, 0)
    assert normalize_window((-3, 5)) == (-3, 5)
    for bad in ((1.5, 0), (True, 0), (0,), "left", (0, 0, 0)):
        with pytest.raises(ValueError):
            normalize_window(bad)


WINDOWS = [(w, 0) for w in (0, 1, 128, 1000, 4096, 100000)] + [
    (w, None) for w in (1, 512, 8192)] + [(None, w) for w in (0, 7, 4096)] + [
    (256, 256), (4096, 4096), (-3, 40), (40, -3), (0, 384)]


@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_one_kernel_per_has_a_window(head_dim):
    """The defaults compile one kernel for every window of a problem: the window's size and
    which of its sides are bounded are launch arguments (SM90 backward and SM100 forward; the
    SM90 forward has one ``local`` flag)."""
    from fa_sm100.config import select_config
    from fa_sm100.hopper.bwd_defaults import select_bwd_config

    for causal, (sq, sk), group, deterministic in itertools.product(
            (False, True), ((1024, 1024), (4096, 4096), (16384, 16384), (300, 1000)), (1, 4),
            (False, True)):
        problem = dict(head_dim=head_dim, causal=causal, seqlen_q=sq, seqlen_k=sk,
                       qhead_per_kvhead=group)
        bwd = {select_bwd_config(**problem, deterministic=deterministic, window_left=left,
                                 window_right=right).kernel_config() for left, right in WINDOWS}
        assert len(bwd) == 1, (problem, deterministic)
        if head_dim in (64, 128) and not deterministic:  # the SM100 head dims
            fwd = {select_config(**problem, window_left=left, window_right=right).kernel_config()
                   for left, right in WINDOWS}
            assert len(fwd) == 1, problem
