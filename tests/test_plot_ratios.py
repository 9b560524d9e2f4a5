"""``scripts/plot_ratios.py``: ours over the best peer with 95% intervals from grid JSON,
forward rows (one per provider) and backward rows (one per cell) alike."""

import json

import pytest
from plain_text import word_lines
from script_loader import load_script

from fa_sm100.benchmarking import RatioPoint, ratio_points

FWD_ROWS = [  # scripts/benchmark.py's forward rows: one per provider and cell
    {"provider": "ours", "hdim": 64, "causal": False, "seqlen": 2048, "ratio_paired": 1.02,
     "ratio_paired_ci": [1.01, 1.04]},
    {"provider": "fa4", "hdim": 64, "causal": False, "seqlen": 2048, "ratio_paired": None},
    {"provider": "ours", "hdim": 64, "causal": True, "seqlen": 1024, "ratio_paired": 0.99},
]
BWD_ROWS = [  # fa_sm100.hopper.bwd_bench's rows: one per cell
    {"head_dim": 128, "causal": True, "seqlen": 16384, "ratio_paired": 0.994,
     "ratio_paired_ci": [0.981, 0.999], "ours_tflops": 600.0},
    {"head_dim": 128, "causal": False, "seqlen": 1024, "ours_error": "wrong output: dq"},
]


def test_ratio_points_read_forward_and_backward_rows():
    assert ratio_points(FWD_ROWS) == [RatioPoint(64, False, 2048, 1.02, (1.01, 1.04)),
                                      RatioPoint(64, True, 1024, 0.99, None)]
    # a cell whose check failed has no paired ratio: left out, not plotted as 0
    assert ratio_points(BWD_ROWS) == [RatioPoint(128, True, 16384, 0.994, (0.981, 0.999))]
    # the same cell twice, with and without an interval: sorted by cell, nothing compared
    # against None
    twice = BWD_ROWS[:1] + [{**BWD_ROWS[0], "ratio_paired_ci": None}]
    assert [p.interval for p in ratio_points(twice)] == [(0.981, 0.999), None]


def test_the_script_prints_each_cell_with_its_verdict_and_draws_the_runs(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="the PNG needs matplotlib (pip install .[bench])")
    fwd, bwd = tmp_path / "fwd.json", tmp_path / "bwd.json"
    fwd.write_text(json.dumps({"rows": FWD_ROWS}))
    bwd.write_text(json.dumps(BWD_ROWS))  # a bare list of rows is read too
    png = tmp_path / "r.png"
    script = load_script("plot_ratios")
    assert script.main([str(fwd), str(bwd), "--label", "a", "--label", "b",
                        "--png", str(png)]) == 0
    out = word_lines(capsys.readouterr().out)  # each cell: ratio, interval, verdict
    assert "hdim 64 non-causal 2048: 1.020x [1.010, 1.040] above" in out
    assert "hdim 64 causal 1024: 0.990x [n/a] too few rounds" in out
    assert "hdim 128 causal 16384: 0.994x [0.981, 0.999] below" in out
    assert out[0] == "== a" and "== b" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_grid_without_paired_ratios_or_a_label_count_that_does_not_match_is_refused(
        tmp_path, capsys):
    script = load_script("plot_ratios")
    empty = tmp_path / "e.json"
    empty.write_text(json.dumps({"rows": [{"provider": "fa4", "hdim": 64, "causal": False,
                                           "seqlen": 1024}]}))
    assert script.main([str(empty)]) == 2
    assert "no cell with a paired ratio" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        script.main([str(empty), "--label", "x", "--label", "y"])
    assert e.value.code == 2
    assert "2 --label for 1 grids" in capsys.readouterr().err
