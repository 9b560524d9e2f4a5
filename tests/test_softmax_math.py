"""Contract of fa_sm100/softmax_math.py, the constants the SM100 kernel and the emulation share.

- The stored exp2 coefficients are the minimax fit that ``fit_ex2_polynomial`` recomputes, and
  they are locally optimal (perturbing any free coefficient raises the max error).
- The float32 polynomial path (as the emulation models the kernel's FMA sequence) stays within
  the stated relative error over every fraction on the 2^-23 grid, is exact at integers,
  monotone, and +0 at and below the clamp.
- The element selection is a compile-time pattern by column pairs with the documented count and
  even spacing; bad arguments raise ValueError.
- The rescale rule and the split-P column ranges behave as documented.
- The SM100 kernel's modules read these names and keep no copy of the numbers.
"""

import math

import pytest
import torch

from fa_sm100 import softmax_math as sm
from fa_sm100.emulation.ex2 import binade_inputs, ex2_poly, measure_ex2, range_inputs


def _max_rel_error(coeffs, grid=20001):
    f = torch.linspace(0.0, 1.0, grid, dtype=torch.float64)
    q = torch.zeros_like(f)
    for c in reversed(coeffs):
        q = q * f + c
    return float(((q - torch.exp2(f)) / torch.exp2(f)).abs().max())


def test_stored_coefficients_are_the_refit_rounded_to_float32():
    fitted, err = sm.fit_ex2_polynomial(sm.EX2_POLY_DEGREE)
    assert len(sm.EX2_POLY_COEFFS) == sm.EX2_POLY_DEGREE + 1 == 4
    assert sm.EX2_POLY_COEFFS[0] == 1.0  # q(0) == 1: integer inputs are exact
    for stored, refit in zip(sm.EX2_POLY_COEFFS_BITS, fitted):
        assert abs(stored - sm.f32_bits(refit)) <= 2, (hex(stored), refit)
    assert 8.0e-5 < err <= sm.EX2_POLY_REL_ERROR_BOUND


def test_coefficients_are_locally_minimax():
    base = _max_rel_error(sm.EX2_POLY_COEFFS)
    assert base <= sm.EX2_POLY_REL_ERROR_BOUND
    for i in range(1, len(sm.EX2_POLY_COEFFS)):
        for delta in (1e-5, -1e-5):
            c = list(sm.EX2_POLY_COEFFS)
            c[i] += delta
            assert _max_rel_error(c) > base, f"coefficient c{i} moved by {delta} did not hurt"


def test_lower_degree_fit_is_worse():
    _, err2 = sm.fit_ex2_polynomial(2)
    _, err3 = sm.fit_ex2_polynomial(3)
    assert err2 > 10 * err3


def test_float32_path_accuracy_on_every_fraction():
    acc = measure_ex2("poly", binade_inputs(0), "(-2, -1]")
    assert acc.count == 1 << 23
    assert acc.max_rel_error <= sm.EX2_POLY_REL_ERROR_BOUND + 2.0**-22
    assert acc.max_ulp <= 1500  # 8.6e-5 relative is at most ~1440 ulps near 2.0
    assert abs(sum(acc.ulp_histogram.values()) - 1.0) < 1e-9


def test_float32_path_same_error_across_the_input_range():
    wide = measure_ex2("poly", range_inputs(-126.0, sm.RESCALE_THRESHOLD_16BIT, 1 << 18), "range")
    assert wide.max_rel_error <= sm.EX2_POLY_REL_ERROR_BOUND + 2.0**-22


def test_exact_at_integers_and_zero_below_the_clamp():
    n = torch.arange(-126, 128, dtype=torch.float32)
    assert torch.equal(ex2_poly(n), torch.exp2(n.double()).float())
    low = torch.tensor([-127.0, -127.5, -200.0, -1e30, float("-inf")])
    out = ex2_poly(low)
    assert torch.equal(out, torch.zeros_like(out))
    assert not torch.signbit(out).any()


def test_float32_path_is_monotone():
    for lo in (-2.0, -9.5, 3.0):
        x = torch.unique(range_inputs(lo, lo + 2.0, 1 << 20))
        y = ex2_poly(x)
        assert bool((y[1:] >= y[:-1]).all()), f"not monotone on [{lo}, {lo + 2}]"


@pytest.mark.parametrize("fraction", [0.0, 0.01, 0.1, 0.125, 0.25, 1 / 3, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("n_cols", [128, 64, 2])
def test_mask_count_pairs_and_spacing(n_cols, fraction):
    mask = sm.ex2_emulated_mask(n_cols, fraction)
    pairs = sm.ex2_emulated_pairs(n_cols, fraction)
    assert len(mask) == n_cols and all(isinstance(m, bool) for m in mask)
    assert all(mask[c] == mask[c + 1] for c in range(0, n_cols, 2))
    expected = math.floor(fraction * (n_cols // 2) + 0.5)
    assert len(pairs) == expected == sum(mask) // 2
    assert [c // 2 for c in range(0, n_cols, 2) if mask[c]] == list(pairs)
    if len(pairs) > 1:
        gaps = [b - a for a, b in zip(pairs, pairs[1:])]
        assert max(gaps) - min(gaps) <= 1, gaps  # evenly spread along the row


def test_mask_default_pattern_and_extremes():
    assert sm.ex2_emulated_pairs(128, 0.125) == (3, 11, 19, 27, 35, 43, 51, 59)
    assert sum(sm.ex2_emulated_mask(128, 0.125)) == 16
    assert not any(sm.ex2_emulated_mask(128, 0.0))
    assert all(sm.ex2_emulated_mask(128, 1.0))
    counts = [len(sm.ex2_emulated_pairs(128, f / 64)) for f in range(65)]
    assert counts == sorted(counts) and counts[-1] == 64


@pytest.mark.parametrize("n_cols,fraction", [(127, 0.1), (0, 0.1), (-4, 0.5), (128, -0.1),
                                             (128, 1.5), (128, float("nan"))])
def test_mask_rejects_bad_arguments(n_cols, fraction):
    with pytest.raises(ValueError):
        sm.ex2_emulated_mask(n_cols, fraction)


def test_rescale_rule():
    assert not sm.rescale_needed(8.0, 8.0)  # "grew by more than" the threshold
    assert sm.rescale_needed(8.0001, 8.0)
    assert not sm.rescale_needed(0.0, 0.0)  # no growth: factor 1 either way
    assert sm.rescale_needed(1e-6, 0.0)
    assert sm.rescale_needed(float("inf"), 8.0)  # first finite max after -inf
    assert not sm.rescale_needed(float("nan"), 8.0)  # -inf -> -inf
    g = torch.tensor([0.0, 7.9, 8.0, 8.1, float("inf")])
    assert sm.rescale_needed(g, 8.0).tolist() == [False, False, False, True, True]
    assert sm.rescale_threshold_log2(8) == 8.0
    with pytest.raises(ValueError):
        sm.rescale_threshold_log2(-1.0)
    assert sm.max_p_value(sm.RESCALE_THRESHOLD_16BIT) == 256.0
    # 2^threshold must be finite in the 16-bit P type
    assert sm.check_rescale_threshold(15, "float16") == 15.0
    assert sm.check_rescale_threshold(127, "bfloat16") == 127.0
    for threshold, dtype in ((15.5, "float16"), (128.0, "bfloat16")):
        with pytest.raises(ValueError, match=f"{dtype} holds at most"):
            sm.check_rescale_threshold(threshold, dtype)
    # P_MAX_LOG2 is the exponent of the largest power of two each type holds: 2^t is finite
    # there, 2^(t + 1) is not
    for dtype, t in sm.P_MAX_LOG2.items():
        largest = torch.finfo(getattr(torch, dtype)).max
        assert 2.0 ** t <= largest < 2.0 ** (t + 1), dtype


def test_rescale_events_follow_the_rule_tile_by_tile():
    """``fa_sm100.testing.rescale_events`` (the SM90 GPU tests' coverage check) on one row whose
    KV tiles' maxes are known: tiles 4, 3, ..., 0 in the kernel's order reach 0, 3, 12, 12.5,
    30 log2 units."""
    from fa_sm100.testing import rescale_events

    keys = [x for m in (30.0, 12.5, 12.0, 3.0, 0.0) for x in (m, m - 5.0)]  # 2 keys per tile
    k = (torch.tensor(keys, dtype=torch.float64) / sm.LOG2_E).reshape(1, 10, 1, 1)
    q = torch.ones(1, 1, 1, 1, dtype=torch.float64)
    events = lambda threshold: rescale_events(q, k, 2, False, threshold, softmax_scale=1.0)
    assert events(8.0) == (2, 2)  # 3 kept, 12 moved, 12.5 kept, 30 moved
    assert events(0.0) == (4, 0)
    assert events(20.0) == (1, 3)  # the stale 0 holds until 30


@pytest.mark.parametrize("n_block", [80, 112, 128])
def test_growing_row_max_inputs_hold_both_kinds_of_step(n_block):
    """The inputs of the SM90 rescale-threshold GPU test give, at each n_block of the SM90
    defaults, many steps that move the max past the threshold and many that keep it; rows
    0, 16, 32, ... get no bonus."""
    from fa_sm100.testing import growing_row_max_inputs, rescale_events

    gen = torch.Generator()
    gen.manual_seed(5)
    for shape in ((2, 1000, 1000, 4, 2), (1, 1500, 1000, 2, 1)):
        q, k, _ = growing_row_max_inputs(shape, (64, 64), torch.bfloat16, gen)
        assert torch.all(q[:, ::16, :, 0] == 0) and torch.all(q[:, 15::16, :, 0] == 4)
        for causal in (False, True):
            moved, kept = rescale_events(q, k, n_block, causal, 8.0)
            assert moved > 100 and kept > 100, (shape, causal, moved, kept)


def test_scale_and_split_columns():
    assert sm.softmax_scale_log2(1.0) == pytest.approx(1.4426950408889634)
    assert sm.LN_2 * sm.LOG2_E == pytest.approx(1.0)
    assert sm.p_split_columns(128, True, 96) == ((0, 96), (96, 128))
    assert sm.p_split_columns(128, False, 96) == ((0, 128),)
    with pytest.raises(ValueError):
        sm.p_split_columns(128, True, 128)
