"""Timing mode: a cost-table model of a B200-class SM (not a measurement).

Contracts: the UMMA unit's busy time is exactly the tile's FLOPs over the table's tensor-core
throughput; no configuration beats the table's peak; every role gets busy/wait intervals;
more K/V blocks take longer; the calibration hook reproduces a target TFLOP/s.
"""

import pytest

from fa_sm100.config import FmhaConfig
from pipelines.timing import COST_SOURCES, CostTable, simulate_timing

CFG = FmhaConfig()


def test_umma_busy_time_is_the_tile_flops():
    n, tiles = 4, 2
    tl = simulate_timing(CFG, n, tiles)
    busy = sum(iv.end - iv.start for iv in tl.intervals if iv.actor == "umma")
    c = CostTable()
    per_sm_flops = 2 * CFG.m_block * CFG.q_stage * n * CFG.n_block * (CFG.head_dim + CFG.head_dim_v)
    assert busy == pytest.approx(tiles * per_sm_flops / c.umma_flop_per_clk)


@pytest.mark.parametrize("cfg", [CFG, FmhaConfig(use_2cta=False, kv_stage=3),
                                 FmhaConfig(q_stage=1, split_p=False, kv_stage=2)])
def test_prediction_is_bounded_by_the_peak(cfg):
    c = CostTable()
    tl = simulate_timing(cfg, 8, 2, c)
    peak = c.umma_flop_per_clk * c.num_sms * c.clock_ghz * 1e9 / 1e12
    assert 0 < tl.tflops <= peak * 1.001
    actors = {iv.actor for iv in tl.intervals}
    assert {"umma", "tma@0", "softmax0@0", "correction@0", "epilogue@0"} <= actors
    assert any(iv.kind == "wait" for iv in tl.intervals)
    assert all(iv.end >= iv.start for iv in tl.intervals)
    assert len(tl.tile_end_clk) == 2 and tl.tile_end_clk[0] < tl.tile_end_clk[1] <= tl.total_clk


def test_more_blocks_take_longer_and_slower_units_cost_time():
    a = simulate_timing(CFG, 2, 2).steady_tile_clk
    b = simulate_timing(CFG, 6, 2).steady_tile_clk
    assert b > a
    slow = simulate_timing(CFG, 6, 2, CostTable().scaled(umma=2.0)).steady_tile_clk
    assert slow > 1.5 * b


def test_rescale_threshold_moves_work_to_the_correction_warps():
    def busy(cfg):
        return simulate_timing(cfg, 8, 1).busy_fraction()["correction@0"]

    assert busy(FmhaConfig(rescale_threshold=0.0)) > 2 * busy(CFG)


def test_calibration_hits_the_target():
    c = CostTable().calibrate(1535.0, CFG, n_blocks=8, work_tiles=2)
    assert simulate_timing(CFG, 8, 2, c).tflops == pytest.approx(1535.0, rel=2e-3)
    assert c.scale_umma > 1.0
    with pytest.raises(ValueError):
        CostTable().calibrate(-1.0)


def test_every_cost_has_a_source():
    import dataclasses

    fields = {f.name for f in dataclasses.fields(CostTable)}
    documented = set(COST_SOURCES) | {"rescale_fraction_threshold0", "rescale_fraction_thresholded",
                                      "scale_umma", "scale_threads", "scale_tma"}
    assert fields <= documented
    with pytest.raises(ValueError):
        simulate_timing(CFG, 0)


def test_timeline_json_and_cli(tmp_path):
    import json

    from pipelines.timing import main

    out = tmp_path / "tl.json"
    assert main(["--set", "use_2cta=false", "--n-blocks", "4", "--work-tiles", "2", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["config"]["use_2cta"] is False and data["n_blocks"] == 4
    assert data["intervals"] and {"actor", "kind", "start", "end", "label"} <= set(data["intervals"][0])
    assert main(["--set", "kv_stage=0"]) == 2


def test_causal_masking_costs_softmax_time():
    def busy(cfg):
        return simulate_timing(cfg, 4, 1).busy_fraction()["softmax0@0"] * simulate_timing(cfg, 4, 1).total_clk

    assert busy(FmhaConfig(causal=True)) > busy(CFG)
