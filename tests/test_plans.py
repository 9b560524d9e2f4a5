"""Contract: the TMEM plan names every column once (aliases inside hosts, no overlaps,
<= 512 columns, power-of-two allocation) and the SMEM plan keeps each config in budget."""

import pytest

from fa_sm100.config import FmhaConfig, select_config
from layouts.smem import SMEM_BUDGET, SmemPlan, align_up
from layouts.tmem import TmemPlan, TmemRegion


@pytest.mark.parametrize("hd,hv", [(64, 64), (96, 96), (128, 128), (192, 128)])
@pytest.mark.parametrize("q_stage", [1, 2])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_tmem_plan_of_every_config_follows_the_design(hd, hv, q_stage, dtype):
    """Per Q stage i: S_i of n_block columns, P_i the 16-bit probabilities (two per 32-bit
    column) at the upper end of S_i, where the softmax overwrites scores it has already read,
    and O_i of head_dim_v columns past both S regions; S_i and O_i sit where they would with
    two Q stages (no offset moves with q_stage), and the plan fits the 512 allocated columns."""
    cfg = select_config(hd, hv, dtype=dtype, q_stage=q_stage)
    plan = TmemPlan.for_config(cfg)
    two = TmemPlan.for_config(cfg.replace(q_stage=2))
    assert plan.names == tuple(n for i in range(q_stage) for n in (f"S{i}", f"P{i}")) + tuple(
        f"O{i}" for i in range(q_stage))
    for i in range(q_stage):
        s, p, o = plan[f"S{i}"], plan[f"P{i}"], plan[f"O{i}"]
        assert s.cols == cfg.n_block and o.cols == hv
        assert p.host == s.name and p.stop == s.stop and p.cols == cfg.n_block * 2 // 4
        assert o.start >= two["S1"].stop
        assert (s.start, o.start) == (two[f"S{i}"].start, two[f"O{i}"].start)
    assert plan.cols_used <= plan.alloc_cols == 512


def test_alias_outside_host_is_rejected():
    with pytest.raises(ValueError, match="does not lie inside its host"):
        TmemPlan((TmemRegion("S0", 0, 128), TmemRegion("P0", 100, 64, host="S0"))).check()


def test_overlapping_regions_are_rejected():
    with pytest.raises(ValueError, match="overlap"):
        TmemPlan((TmemRegion("S0", 0, 128), TmemRegion("O0", 120, 128))).check()


def test_region_past_allocation_is_rejected():
    with pytest.raises(ValueError, match="past the 256 allocated"):
        TmemPlan((TmemRegion("S0", 0, 300),), alloc_cols=256).check()


def test_allocation_must_be_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        TmemPlan((TmemRegion("S0", 0, 128),), alloc_cols=384).check()


def test_duplicate_region_is_rejected():
    with pytest.raises(ValueError, match="declared twice"):
        TmemPlan((TmemRegion("S0", 0, 64), TmemRegion("S0", 64, 64))).check()


def test_unknown_region_lookup_names_the_regions():
    with pytest.raises(KeyError, match="regions"):
        FmhaConfig().validate() and TmemPlan.for_config(FmhaConfig())["S9"]


@pytest.mark.parametrize("hd,hv", [(64, 64), (96, 96), (128, 128), (192, 128)])
@pytest.mark.parametrize("two_cta", [True, False])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_smem_budget_per_head_dim_and_cta_mode(hd, hv, two_cta, dtype):
    cfg = select_config(hd, hv, dtype=dtype, use_2cta=two_cta)
    plan = SmemPlan.for_config(cfg).check()
    assert plan.total <= SMEM_BUDGET["sm_100a"]
    for part in (plan.q_bytes, plan.kv_stage_bytes, plan.o_bytes, plan.misc_bytes):
        assert part % 1024 == 0
    # maximal: one more stage would not fit
    assert plan.total + plan.kv_stage_bytes > SMEM_BUDGET["sm_100a"] or cfg.kv_stage == 32
    e = 2
    assert plan.q_bytes == align_up(cfg.q_stage * 128 * hd * e)
    assert plan.kv_stage_bytes == align_up(max(128 // cfg.cta_group * hd, 128 * hv // cfg.cta_group) * e)
    assert plan.o_bytes == align_up(cfg.q_stage * 128 * hv * e)


def test_over_budget_message_says_what_to_lower():
    with pytest.raises(ValueError, match="lower kv_stage"):
        SmemPlan.for_config(FmhaConfig(kv_stage=8)).check()
