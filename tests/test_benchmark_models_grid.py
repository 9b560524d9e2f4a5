"""CPU tests of ``scripts/benchmark.py --grid models`` (issue 54): the cells models run.

Contract: the grid parses and keeps the default grid as it was; it holds GQA 4:1 and 8:1 at
hdim 128, GQA at hdim 64, MQA and (192, 128) causal and not, with labels that tell its cells
apart; every cell is a problem our public path accepts (its input checks, the forward's and
the backward's config selection) without a GPU. A run, forward or backward, times every cell,
records an SDPA peer that does not take a cell's shape as absent (with the reason, untimed,
no error, the run's status 0) and a peer that fails on a shape it does take as an error, and
writes the cells into the JSON, CSV, table and figures (``plot_ratios`` too). The GPU work
is replaced by fakes here; the timing itself runs on the lent H200.
"""

import json

import pytest
import torch

from fa_sm100.bench_cells import MODEL_CELLS, BenchCell
from fa_sm100.testing import attention_reference
from script_loader import load_script


def load():
    return load_script("benchmark")


def test_the_models_grid_parses_and_the_default_grid_is_unchanged():
    bench = load()
    assert bench.grid_cells(bench.parse_args(["--grid", "models"])) == list(MODEL_CELLS)
    default = bench.grid_cells(bench.parse_args([]))
    assert len(default) == 3 * 2 * 5
    assert all(c.batch * c.seqlen == 16384 and c.heads * c.head_dim == 2048
               and c.heads_kv == c.heads for c in default)
    with pytest.raises(SystemExit):  # its A/A notes are made for the default grid's cells
        bench.parse_args(["--grid", "models", "--ours-variant", "x:pingpong=false"])


def test_the_models_grid_holds_the_shapes_models_run_under_distinct_labels():
    groups = {(c.heads // c.heads_kv, c.head_dim) for c in MODEL_CELLS}
    assert {(4, 128), (8, 128), (4, 64)} <= groups
    assert any(c.heads_kv == 1 and c.heads > 1 for c in MODEL_CELLS)  # MQA
    wide = {c.causal for c in MODEL_CELLS if (c.head_dim, c.head_dim_v) == (192, 128)}
    assert wide == {False, True}
    labels = [c.label for c in MODEL_CELLS]
    assert len(set(labels)) == len(labels)  # the table and the figures key on them
    assert BenchCell(2, 8192, 32, 8, 128, True).label == "32q/8kv d128 8k causal b2"
    assert BenchCell(4, 4096, 16, 16, 192, False).label == "16h d192/128 4k full b4"


@pytest.mark.parametrize("cell", MODEL_CELLS, ids=lambda c: c.label)
def test_every_cell_is_a_problem_the_public_path_takes(cell):
    """What ``flash_attn_func`` and its backward decide before any GPU work: the input
    checks, the forward's default config (``sm90_config_for``, as a call picks it, with and
    without the LSE autograd needs), and the backward's head dims and config."""
    from fa_sm100.autograd import check_backward_supported
    from fa_sm100.hopper.bwd_defaults import select_bwd_config
    from fa_sm100.hopper.config import SM90_HEAD_DIMS
    from fa_sm100.hopper.interface import sm90_config_for
    from fa_sm100.validation import validate_attention_inputs

    q, k, v = (torch.empty(shape, dtype=torch.bfloat16, device="meta") for shape in cell.shapes)
    problem = validate_attention_inputs(q, k, v, causal=cell.causal, head_dims=SM90_HEAD_DIMS,
                                        require_cuda=False)
    assert (problem.heads, problem.qhead_per_kvhead) == (cell.heads, cell.heads // cell.heads_kv)
    for need_lse in (False, True):
        assert sm90_config_for(problem, None, need_lse).write_lse == need_lse
    check_backward_supported(q, k, v)
    cfg = select_bwd_config(head_dim=cell.head_dim, head_dim_v=cell.head_dim_v,
                            causal=cell.causal, qhead_per_kvhead=cell.heads // cell.heads_kv,
                            seqlen_q=cell.seqlen, seqlen_k=cell.seqlen)
    assert cfg.validate() == cfg


# Small stand-ins for the grid's cells (a CPU run of the real ones would take minutes): GQA
# 4:1, and (192, 128) head dims, which the fake SDPA below does not take.
SMALL_CELLS = (BenchCell(2, 96, 4, 1, 32, True), BenchCell(1, 64, 2, 2, 192, False))


def _fake_refusal(name, cell, dtype, torch):
    return "head_dim_v != head_dim" if cell.head_dim_v != cell.head_dim else None


@pytest.fixture
def fake_gpu(monkeypatch):
    """The benchmark module with the small cells, CPU inputs, right-answer providers that
    record what they were prepared for, 1 ms per measurement and the fake SDPA refusal."""
    bench = load()
    monkeypatch.setattr(bench, "MODEL_CELLS", SMALL_CELLS)
    monkeypatch.setattr(bench, "sdpa_refusal", _fake_refusal)
    monkeypatch.setattr(bench, "time_ms", lambda fn, warmup, rep, torch: 1.0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake device")

    def inputs(cell, dtype, torch):
        g = torch.Generator().manual_seed(cell.seqlen)
        return tuple(torch.randn(shape, generator=g).to(dtype) for shape in cell.shapes)

    prepared = []

    def provider(name, torch):
        def prepare(q, k, v, causal):
            prepared.append((name, q.shape[-1]))
            out, _ = attention_reference(q, k, v, causal=causal, dtype=torch.float32)
            return lambda: out.to(q.dtype)
        return prepare

    monkeypatch.setattr(bench, "cell_inputs", inputs)
    monkeypatch.setattr(bench, "make_provider", provider)
    monkeypatch.setattr(bench, "prepare_ours_launch", provider("ours:launch", torch))
    bench.prepared = prepared
    return bench


def test_a_forward_run_records_sdpa_peers_absent_where_they_do_not_take_the_shape(
        fake_gpu, tmp_path, capsys):
    bench = fake_gpu
    out_json, out_csv = tmp_path / "m.json", tmp_path / "m.csv"
    status = bench.main(["--grid", "models", "--providers", "ours", "fa4", "cudnn", "--repeat",
                         "4", "--json", str(out_json), "--csv", str(out_csv)])
    assert status == 0  # an absent peer is no failure
    saved = json.loads(out_json.read_text())
    assert (saved["grid"], saved["mode"], saved["device"]) == ("models", "fwd", "fake device")
    assert "command" in saved  # the command that made it
    rows = {(r["cell"], r["provider"]): r for r in saved["rows"]}
    gqa, wide = (c.label for c in SMALL_CELLS)
    assert rows[(wide, "cudnn")]["absent"] == "head_dim_v != head_dim"
    assert rows[(wide, "cudnn")]["error"] is None and rows[(wide, "cudnn")]["tflops"] is None
    assert ("cudnn", 192) not in bench.prepared  # never prepared where absent
    assert "absent" not in rows[(gqa, "cudnn")] and rows[(gqa, "cudnn")]["tflops"]
    ours = rows[(gqa, "ours")]
    assert ours["heads_kv"] == 1 and ours["heads"] == 4
    # TFLOP/s count the query heads: 2 GEMMs of 4 x 2 x 96 x 96 x 32, halved for causal, in 1 ms
    assert ours["tflops"] == pytest.approx(2 * 2 * 4 * 96 * 96 * 64 / 2 / 1e-3 / 1e12)
    assert len(ours["rounds_ms"]) == 4 and rows[(wide, "ours")]["ratio_paired"] == 1.0
    text = capsys.readouterr().out
    assert "| cell | ours | fa4 | cudnn | ours:launch | ours / best peer | paired |" in text
    assert f"| {wide} | " in text and f"cudnn {wide}: absent (head_dim_v != head_dim)" in text
    assert "cell" in out_csv.read_text().splitlines()[0]
    assert "absent" in out_csv.read_text().splitlines()[0]


def test_a_backward_run_times_every_cell_and_marks_a_refused_cudnn_absent(
        fake_gpu, monkeypatch, tmp_path):
    """``--mode bwd``: ``bwd_bench.bench_cell`` (replaced) gets every cell's problem; where
    SDPA does not take the cell, cuDNN's failed call becomes ``cudnn_absent``; elsewhere an
    error of cuDNN stays one."""
    from fa_sm100.hopper import bwd_bench

    bench = fake_gpu
    calls = []

    def fake_cell(b, h, hk, s, d, causal, **kw):
        calls.append((b, h, hk, s, d, causal, kw["timing"], kw["repeat"]))
        return {"batch": b, "heads": h, "heads_kv": hk, "seqlen": s, "head_dim": d,
                "causal": causal, "ours_tflops": 2.0, "fa4_tflops": 1.0, "ratio_paired": 2.0,
                "cudnn_error": "RuntimeError: No available kernel. Aborting execution."}

    monkeypatch.setattr(bwd_bench, "bench_cell", fake_cell)
    out_json, out_csv, png = tmp_path / "b.json", tmp_path / "b.csv", tmp_path / "b.png"
    assert bench.main(["--grid", "models", "--mode", "bwd", "--repeat", "4",
                       "--json", str(out_json), "--csv", str(out_csv), "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert calls == [(c.batch, c.heads, c.heads_kv, c.seqlen, c.head_dim, c.causal, "both", 4)
                     for c in SMALL_CELLS]
    saved = json.loads(out_json.read_text())
    assert (saved["grid"], saved["mode"], saved["device"]) == ("models", "bwd", "fake device")
    gqa, wide = saved["rows"]
    assert gqa["cell"] == SMALL_CELLS[0].label and "cudnn_absent" not in gqa
    assert gqa["cudnn_error"].startswith("RuntimeError")  # a shape SDPA takes: an error
    assert wide["cudnn_absent"] == "head_dim_v != head_dim" and "cudnn_error" not in wide
    header = out_csv.read_text().splitlines()[0].split(",")
    assert header[:2] == ["cell", "provider"]


def test_the_table_and_plot_ratios_key_on_the_cell_labels(tmp_path, capsys):
    """Two cells alike in head dim, causality and seqlen (GQA 32/8 and 64/8 at 8k) stay two
    lines of the table and two points of ``plot_ratios``."""
    pytest.importorskip("matplotlib", reason="the PNG needs matplotlib (pip install .[bench])")
    bench = load()
    rows = []
    for cell, ratio in zip(MODEL_CELLS[:2], (1.02, 0.97)):
        for p, tf in (("ours", 600.0 * ratio), ("fa4", 600.0), ("cudnn", None)):
            rows.append({"provider": p, **bench.cell_keys(cell, True), "tflops": tf,
                         "ratio_paired": ratio if p == "ours" else None,
                         "ratio_paired_ci": [ratio - 0.01, ratio + 0.01] if p == "ours" else None})
    lines = bench.table(rows, ["ours", "fa4", "cudnn"]).splitlines()
    assert lines[2].startswith(f"| {MODEL_CELLS[0].label} | 612 | 600 | n/a | 1.02x |")
    assert lines[3].startswith(f"| {MODEL_CELLS[1].label} | 582 | 600 | n/a | 0.97x |")
    grid = tmp_path / "models.json"
    grid.write_text(json.dumps({"rows": rows}))
    png = tmp_path / "r.png"
    assert load_script("plot_ratios").main([str(grid), "--png", str(png)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert f"{MODEL_CELLS[0].label}: 1.020x [1.010, 1.030] above" in out
    assert f"{MODEL_CELLS[1].label}: 0.970x [0.960, 0.980] below" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bars = tmp_path / "bars.png"
    bench.plot_cells(rows, ["ours", "fa4", "cudnn"], str(bars), "fake device")
    assert bars.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
