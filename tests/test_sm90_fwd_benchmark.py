"""CPU tests of scripts/benchmark.py (issue 8 item 1): argument checks, the FLOP count, the
printed table with its ratio column, and the PNG (one panel per head dim and causality).
The rows here are synthetic inputs to the formatting code; measured numbers live in
docs/hopper.md."""

import importlib.util
import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def load():
    spec = importlib.util.spec_from_file_location(
        "benchmark_cli", os.path.join(HERE, "..", "scripts", "benchmark.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_grid_arguments_are_checked():
    bench = load()
    args = bench.parse_args(["--hdim", "64", "128", "--seqlen", "1024", "4096"])
    assert args.hdim == [64, 128] and args.seqlen == [1024, 4096] and args.causal == [False, True]
    with pytest.raises(SystemExit):
        bench.parse_args(["--seqlen", "3000"])  # does not divide 16384 tokens
    with pytest.raises(SystemExit):
        bench.parse_args(["--hdim", "96", "--hidden", "2048"])  # 2048 % 96 != 0


def test_flops_count_two_gemms_and_halve_for_causal():
    bench = load()
    assert bench.flops(2, 16, 1024, 1024, 128, 128, False) == 4 * 2 * 16 * 1024 * 1024 * 128
    assert bench.flops(2, 16, 1024, 1024, 128, 128, True) == 2 * 2 * 16 * 1024 * 1024 * 128


def rows():
    out = []
    for d in (64, 128):
        for c in (False, True):
            for s, scale in ((1024, 1.0), (4096, 1.2)):
                for p, base in (("ours", 500), ("fa4", 400), ("cudnn", 450), ("ours:x", 300)):
                    out.append({"provider": p, "hdim": d, "causal": c, "seqlen": s,
                                "tflops": base * scale, "ms": 1.0, "error": None})
    out.append({"provider": "flash", "hdim": 64, "causal": False, "seqlen": 1024,
                "tflops": None, "ms": None, "error": "unavailable"})
    return out


def test_table_reports_ours_over_the_best_peer():
    bench = load()
    text = bench.table(rows(), ["ours", "fa4", "cudnn", "flash", "ours:x"])
    lines = text.splitlines()
    assert lines[0].startswith("| hdim | causal | seqlen | ours | fa4 | cudnn | flash | ours:x")
    assert len(lines) == 2 + 8
    # best peer is cudnn (450 x scale); variants of ours are not peers; n/a for missing cells
    assert lines[2] == "| 64 | no | 1024 | 500 | 400 | 450 | n/a | 300 | 1.11x |"


def test_png_has_one_panel_per_hdim_and_causality(tmp_path):
    pytest.importorskip("matplotlib", reason="the PNG needs matplotlib (pip install .[bench])")
    bench = load()
    path = tmp_path / "bench.png"
    bench.plot(rows(), ["ours", "fa4", "cudnn"], str(path), "test device")
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
