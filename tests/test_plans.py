"""Contract: the TMEM plan names every column once (aliases inside hosts, no overlaps,
<= 512 columns, power-of-two allocation) and the SMEM plan keeps each config in budget."""

import pytest

from fa_sm100.config import FmhaConfig, select_config
from layouts.smem import SMEM_BUDGET, SmemPlan, align_up
from layouts.tmem import TmemPlan, TmemRegion


def test_default_tmem_plan_is_the_design():
    plan = TmemPlan.for_config(FmhaConfig())
    spans = {r.name: (r.start, r.stop) for r in plan.regions}
    assert spans == {"S0": (0, 128), "P0": (64, 128), "S1": (128, 256), "P1": (192, 256),
                     "O0": (256, 384), "O1": (384, 512)}
    assert plan.alloc_cols == 512 and plan.cols_used == 512


def test_one_q_stage_keeps_the_fixed_offsets():
    plan = TmemPlan.for_config(FmhaConfig(q_stage=1))
    assert plan.names == ("S0", "P0", "O0")
    assert plan.offset("O0") == 256


@pytest.mark.parametrize("hd,hv", [(64, 64), (96, 96), (192, 128)])
def test_tmem_plan_for_other_head_dims(hd, hv):
    plan = TmemPlan.for_config(select_config(hd, hv))
    assert plan["O1"].cols == hv and plan["O1"].stop <= 512


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


def test_default_smem_numbers():
    plan = SmemPlan.for_config(FmhaConfig())
    assert (plan.q_bytes, plan.kv_stage_bytes, plan.o_bytes) == (65536, 16384, 65536)
    assert plan.total <= 232448


def test_over_budget_message_says_what_to_lower():
    with pytest.raises(ValueError, match="lower kv_stage"):
        SmemPlan.for_config(FmhaConfig(kv_stage=8)).check()
