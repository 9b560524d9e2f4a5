"""The CPU emulation of the SM100 forward algorithm (issue 5).

Contract: for every case of the CI matrix (bf16/fp16, causal or not, MHA/GQA/MQA, head dims
64, 96, 128, (192, 128), seqlens 1 .. 4096 with seqlen_q != seqlen_k, every switch) the
emulation's O and LSE errors against the float64 reference are at most twice those of plain
attention in the input dtype, plus a small atol. Edge rows: fully masked rows give exactly
O = 0 and LSE = -inf; scores of magnitude 1e4 do not overflow; identical keys give the mean of
V. The emulation reads the kernel's algorithm from softmax_math and the config: reverse tile
order, work tiles of q_stage x cta_group x m_block rows, stale max under the threshold, the ex2
selection, split P that leaves the sums unchanged.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fa_sm100 import softmax_math as sm
from fa_sm100.config import FmhaConfig
from fa_sm100.emulation.cases import CI_CASES, Case, make_inputs, run_case
from fa_sm100.emulation.ex2 import ex2_mixed, ex2_poly, ex2_sfu
from fa_sm100.emulation.forward import emulate_sm100_fwd, kv_tile_ranges
from fa_sm100.testing import attention_reference, max_abs_error
from script_loader import load_script


@pytest.mark.parametrize("case", CI_CASES, ids=[c.name for c in CI_CASES])
def test_case_meets_the_error_rule(case):
    res = run_case(case, raise_on_fail=True)
    assert res.ok and math.isfinite(res.err)


def _run(case, **cfg):
    q, k, v = make_inputs(case)
    config = FmhaConfig(**cfg) if cfg else None
    return q, k, v, emulate_sm100_fwd(q, k, v, causal=case.causal, window_size=case.window,
                                      config=config, return_stats=True)


def test_fully_masked_rows_are_zero_with_lse_minus_inf():
    case = Case("masked", 700, 200, heads=2, kv_heads=1, head_dim=64, head_dim_v=64, causal=True)
    _, _, _, (out, lse, _) = _run(case)
    masked = 700 - 200  # rows i < seqlen_q - seqlen_k see no key (bottom-right causal)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(out[:, :masked], torch.zeros_like(out[:, :masked]))
    assert bool((lse[:, :, :masked] == float("-inf")).all())
    assert bool(torch.isfinite(lse[:, :, masked:]).all())
    assert bool((out[:, masked:].abs().amax(dim=-1) > 0).all())


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_scores_of_magnitude_1e4_do_not_overflow(dtype):
    case = Case("large", 256, 384, heads=2, kv_heads=2, dtype=dtype, inputs="large")
    q, k, v, (out, lse, _) = _run(case)
    ref, ref_lse = attention_reference(q, k, v)
    smax = (torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) / math.sqrt(128)).abs().max()
    assert smax > 5e3  # the case really has huge scores
    assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(lse).all())
    # Rounding P and O to the dtype (unit roundoff u) bounds the error by u * sum(P |V|) +
    # u |O| <= 2 u max|V|: the scores themselves (float32) must add nothing visible. The LSE
    # (~1e4) holds to a relative 1e-5 (float32 accumulation of S).
    u = torch.finfo(q.dtype).eps / 2
    assert max_abs_error(out, ref) <= 2 * u * float(v.abs().max())
    assert float(((lse.double() - ref_lse) / ref_lse.abs()).abs().max()) < 1e-5


def test_identical_keys_give_the_mean_of_v():
    case = Case("same", 300, 500, heads=2, kv_heads=1, inputs="identical_keys")
    q, k, v, (out, lse, stats) = _run(case)
    mean_v = v.double().mean(dim=1, keepdim=True).repeat_interleave(2, dim=2).expand_as(out)
    assert max_abs_error(out, mean_v) <= 2 * max_abs_error(mean_v.to(q.dtype), mean_v) + 1e-3
    assert stats.max_grew == 0 and stats.rescaled == 0


def test_split_p_changes_timing_not_sums():
    case = Case("split", 600, 700, causal=True)
    outs = [_run(case, split_p=sp, split_p_col=col)[3][:2]
            for sp, col in ((True, 96), (True, 32), (False, 96))]
    for out, lse in outs[1:]:
        assert torch.equal(out, outs[0][0]) and torch.equal(lse, outs[0][1])


def test_ex2_selection_is_applied_per_column():
    x = torch.linspace(-20.0, 0.0, 4 * 128).view(4, 128)
    cols = torch.tensor(sm.ex2_emulated_mask(128, 0.25))
    y = ex2_mixed(x, cols)
    assert torch.equal(y[:, cols], ex2_poly(x[:, cols].contiguous()))
    assert torch.equal(y[:, ~cols], ex2_sfu(x[:, ~cols].contiguous()))
    assert not torch.equal(ex2_poly(x), ex2_sfu(x))  # the two paths do differ


def test_ex2_fraction_reaches_the_output():
    case = Case("emu", 256, 512, causal=True, dtype="fp16")
    outs = {f: _run(case, ex2_emu_fraction=f)[3][0] for f in (0.0, 0.125, 1.0)}
    assert not torch.equal(outs[0.0], outs[1.0])
    assert not torch.equal(outs[0.0], outs[0.125])


def test_stale_max_bounds_p_and_keeps_accuracy():
    case = Case("stale", 256, 2048, inputs="rising_order", slope=0.03)
    q, k, v, (out8, _, st8) = _run(case, rescale_threshold=8.0)
    _, _, _, (out0, _, st0) = _run(case, rescale_threshold=0.0)
    # 3.84 log2 units of growth per tile: every tile raises the max, every third one crosses 8
    assert st8.max_grew == st8.row_tiles == st0.rescaled > 0
    assert 3 * st8.rescaled == st8.row_tiles
    assert 1.0 < st8.max_p <= sm.max_p_value(8.0)
    # threshold 0 tracks the max: P <= 1 up to the rounding of m * scale_log2 inside the FMA
    assert st0.max_p <= 1.0 + 1e-4
    ref, _ = attention_reference(q, k, v)
    plain, _ = attention_reference(q, k, v, dtype=q.dtype, upcast=False)
    assert max_abs_error(out8, ref) <= 2 * max_abs_error(plain, ref) + 1e-3


def test_reverse_tile_order():
    # Scores rising with the key index: the kernel visits the highest block first, so the max
    # never grows afterwards; scores rising in visiting order make it grow on every block.
    rising_keys = Case("rk", 128, 1024, inputs="rising_keys", slope=0.1)
    rising_order = Case("ro", 128, 1024, inputs="rising_order", slope=0.1)
    st_keys = _run(rising_keys, rescale_threshold=0.0)[3][2]
    st_order = _run(rising_order, rescale_threshold=8.0)[3][2]
    assert st_keys.row_tiles == st_order.row_tiles == 128 * 7
    assert st_keys.max_grew == 0
    assert st_order.rescaled == st_order.row_tiles


def test_work_tiles_follow_q_stage_and_cta_group():
    two = FmhaConfig(q_stage=2, use_2cta=True)
    one = FmhaConfig(q_stage=1, use_2cta=False, kv_stage=3)
    # 512-row work tiles: the last row of the tile decides the causal range
    assert kv_tile_ranges(1000, 1000, two, True, (None, None)) == [(0, 512, 0, 4), (512, 1000, 0, 8)]
    assert kv_tile_ranges(1000, 1000, one, True, (None, None))[:2] == [(0, 128, 0, 1), (128, 256, 0, 2)]
    assert kv_tile_ranges(300, 1000, one, False, (None, None))[0] == (0, 128, 0, 8)
    # fully masked tile (seqlen_q > seqlen_k, causal): still one block, as in the kernel
    assert kv_tile_ranges(1000, 100, one, True, (None, None))[0] == (0, 128, 0, 1)
    # sliding window: blocks below the window are skipped
    assert kv_tile_ranges(1000, 1000, one, True, (100, 0))[7] == (896, 1000, 6, 8)


def test_q_stage_and_2cta_change_blocks_visited_not_results():
    # Larger work tiles make some rows visit leading blocks in which all their keys are masked.
    # Such a block leaves max -inf, sum 0 and O 0, and the next block rescales by exp2(-inf) = 0,
    # so the results must be bit-identical: any NaN or stale -inf handling would show here.
    case = Case("stages", 600, 600, causal=True, heads=2, kv_heads=1, dtype="fp16")
    two = FmhaConfig(q_stage=2, use_2cta=True)
    one = FmhaConfig(q_stage=1, use_2cta=False, kv_stage=3)

    def row_blocks(cfg):
        ranges = kv_tile_ranges(600, 600, cfg, True, (None, None))
        return sum((r1 - r0) * (n1 - n0) for r0, r1, n0, n1 in ranges)

    assert row_blocks(two) > row_blocks(one)
    a = _run(case, q_stage=2, use_2cta=True)[3]
    b = _run(case, q_stage=1, use_2cta=False, kv_stage=3)[3]
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("bad", ["float32", "heads", "hdim", "rank", "scale"])
def test_bad_input_raises_value_error(bad):
    q = torch.randn(1, 8, 4, 128, dtype=torch.bfloat16)
    k = torch.randn(1, 8, 2, 128, dtype=torch.bfloat16)
    v = torch.randn(1, 8, 2, 128, dtype=torch.bfloat16)
    kw = {}
    if bad == "float32":
        q, k, v = q.float(), k.float(), v.float()
    elif bad == "heads":
        k, v = k[:, :, :1].expand(1, 8, 3, 128), v[:, :, :1].expand(1, 8, 3, 128)
    elif bad == "hdim":
        q, k, v = q[..., :80], k[..., :80], v[..., :80]
    elif bad == "rank":
        q = q[0]
    elif bad == "scale":
        kw["softmax_scale"] = float("nan")
    with pytest.raises(ValueError):
        emulate_sm100_fwd(q, k, v, **kw)


def test_constants_come_from_softmax_math(monkeypatch):
    # One source of truth: the emulation reads softmax_math at call time, so changing a constant
    # there changes the emulation (nothing is copied).
    case = Case("src", 200, 300, causal=True)
    base = _run(case)[3][0]
    x = torch.linspace(-3.0, 0.0, 64)
    before = ex2_poly(x)
    monkeypatch.setattr(sm, "EX2_POLY_COEFFS", (1.0, 1.0, 0.0, 0.0))  # 1 + f: a crude 2^f
    assert not torch.equal(ex2_poly(x), before)
    assert not torch.equal(_run(case)[3][0], base)
    monkeypatch.undo()
    monkeypatch.setattr(sm, "ex2_emulated_mask", lambda n, f: (True,) * n)
    assert torch.equal(_run(case)[3][0], _run(case, ex2_emu_fraction=1.0)[3][0])
    monkeypatch.undo()
    monkeypatch.setattr(sm, "rescale_needed", lambda growth, threshold: growth > 0.0)
    assert torch.equal(_run(case)[3][0], _run(case, rescale_threshold=0.0)[3][0])


def test_script_writes_the_reports(tmp_path):
    import json

    mod = load_script("emulate")
    out = tmp_path / "emu.json"
    rc = mod.main(["--case", "sq17_fp16_causal_gqa_d64", "--no-threshold", "--no-ex2",
                   "--json", str(out)])
    data = json.loads(out.read_text())
    assert rc == 0
    assert set(data) == {"constants", "cases", "ex2", "threshold", "seconds"}
    assert data["cases"][0]["name"] == "sq17_fp16_causal_gqa_d64" and data["cases"][0]["ok"]
    assert data["constants"]["ex2_poly_coeffs"] == list(sm.EX2_POLY_COEFFS)


@settings(max_examples=20, deadline=None, derandomize=True)
@given(sq=st.integers(1, 300), sk=st.integers(1, 300),
       heads=st.sampled_from([(1, 1), (2, 1), (2, 2), (4, 2)]),
       dims=st.sampled_from([(64, 64), (96, 96), (128, 128), (192, 128)]),
       dtype=st.sampled_from(["bf16", "fp16"]), causal=st.booleans(),
       fraction=st.sampled_from([0.0, 0.125, 0.5, 1.0]), threshold=st.sampled_from([0.0, 8.0]),
       seed=st.integers(0, 2**16))
def test_random_problems_meet_the_rule(sq, sk, heads, dims, dtype, causal, fraction, threshold,
                                       seed):
    case = Case("hyp", sq, sk, heads=heads[0], kv_heads=heads[1], head_dim=dims[0],
                head_dim_v=dims[1], dtype=dtype, causal=causal, seed=seed,
                switches=(f"ex2_emu_fraction={fraction}", f"rescale_threshold={threshold}"))
    run_case(case, raise_on_fail=True)
