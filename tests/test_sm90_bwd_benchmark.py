"""The backward benchmark's correctness check and reporting, on the CPU (the timing itself
needs an SM90 GPU and runs on the lent one: ``scripts/benchmark.py --mode bwd``)."""

import math

import pytest
import torch

from fa_sm100.hopper import bwd_bench
from plain_text import word_lines
from script_loader import load_script


def _cell(seed=0, b=2, s=48, h=4, hk=2, d=32):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, n, d, generator=gen).bfloat16() for n in (h, hk, hk, h)]


def _grads64(q, k, v, dout, causal):
    """All of (dq, dk, dv), BSHD, by float64 autograd of torch's own attention."""
    g = q.shape[2] // k.shape[2]
    qt, kt, vt = (t.double().transpose(1, 2).requires_grad_() for t in (q, k, v))
    o = torch.nn.functional.scaled_dot_product_attention(
        qt, kt.repeat_interleave(g, 1), vt.repeat_interleave(g, 1), is_causal=causal)
    grads = torch.autograd.grad(o, (qt, kt, vt), dout.double().transpose(1, 2))
    return tuple(x.transpose(1, 2) for x in grads)


@pytest.mark.parametrize("causal", [False, True])
def test_check_accepts_right_gradients_and_names_wrong_ones(causal):
    q, k, v, dout = _cell(int(causal))
    ref = bwd_bench.reference_grads(q, k, v, dout, causal, torch.float32)
    plain = bwd_bench.reference_grads(q, k, v, dout, causal, torch.bfloat16)
    good = tuple(x.bfloat16() for x in _grads64(q, k, v, dout, causal))
    assert bwd_bench.check_grads(good, ref, plain) is None
    assert "max error" in bwd_bench.check_grads(
        tuple(x.bfloat16() for x in _grads64(q, k, v, dout, not causal)), ref, plain)
    dk = good[1].clone()
    dk[0, :, -1] += 0.5  # the last KV head is checked
    assert "dk (kv head 1)" in bwd_bench.check_grads((good[0], dk, good[2]), ref, plain)
    dq = good[0].clone()
    dq[0, 3, 0, 0] = math.nan
    assert "NaN" in bwd_bench.check_grads((dq, good[1], good[2]), ref, plain)
    assert "shape" in bwd_bench.check_grads((good[0][..., :16], good[1], good[2]), ref, plain)


def test_checked_heads_cover_first_and_last_group():
    assert bwd_bench.checked_heads(16, 16) == [(0, [0]), (15, [15])]
    assert bwd_bench.checked_heads(8, 2) == [(0, [0, 1, 2, 3]), (1, [4, 5, 6, 7])]
    assert bwd_bench.checked_heads(4, 1) == [(0, [0, 1, 2, 3])]


def test_format_row_and_exit_status_report_failures():
    row = {"head_dim": 128, "seqlen": 4096, "batch": 4, "heads": 16, "heads_kv": 16,
           "causal": True, "ours_ms": 1.0, "ours_tflops": 500.0, "ours:x_error": "ValueError: y",
           "fa4_ms": 1.0, "fa4_tflops": 550.0, "cudnn_error": "RuntimeError: no kernel",
           "ratio_vs_best_peer": 500 / 550}
    text = bwd_bench.format_row(row)
    line = word_lines(text)[0]  # the cell's line: one "|" field per provider, then the ratio
    assert {"ours 500.0", "ours:x n/a"} <= set(line.split(" | ")) and "| ratio 0.91x" in line
    assert "cudnn: RuntimeError: no kernel" in text and "ours:x: ValueError: y" in text
    assert "paired" not in text
    paired = bwd_bench.format_row({**row, "ratio_paired": 0.9321})
    assert "ratio 0.91x | paired 0.932x [n/a] TFLOP/s" in paired  # no interval: too few rounds
    paired = bwd_bench.format_row({**row, "ratio_paired": 0.9321,
                                   "ratio_paired_ci": (0.9012, 0.9555),
                                   "ours:x_rounds_ms": [1.0] * 6})
    assert "ratio 0.91x | paired 0.932x [0.901, 0.956] TFLOP/s" in paired
    assert "ours:x_rounds" not in paired  # a key of every round is not a provider
    assert bwd_bench.exit_status([row]) == 1  # a variant of ours failed
    ok = {k: v for k, v in row.items() if k != "ours:x_error"}
    assert bwd_bench.exit_status([ok]) == 0  # a peer that cannot run does not fail the run
    assert bwd_bench.exit_status([{**ok, "fa4_error": "wrong output: max error"}]) == 1


def test_a_head_dim_ours_lacks_is_reported_not_failed():
    """A cell ours does not cover (hdim 256) says why in ``ours_skipped`` and does not make the
    run fail; the peers' numbers are still shown."""
    row = {"head_dim": 256, "seqlen": 1024, "batch": 16, "heads": 8, "heads_kv": 8,
           "causal": False, "ours_skipped": "head_dim 256 is not supported by sm90_bwd",
           "fa4_ms": 1.0, "fa4_tflops": 300.0}
    assert bwd_bench.exit_status([row]) == 0
    text = bwd_bench.format_row(row)
    assert "ours n/a" in text and "ours: head_dim 256 is not supported" in text


def test_run_cell_drops_a_provider_whose_warm_up_fails():
    """The shared method: a provider that passes its check but raises when first timed (the
    discarded warm-up) is dropped with its reason; the next one takes the warm-up and all
    rounds."""
    from fa_sm100.benchmarking import run_cell

    def measure(run):
        if run() == "flaky":
            raise RuntimeError("out of memory in do_bench")
        return 2.0

    prepares = {"flaky": lambda: (lambda: "flaky"), "good": lambda: (lambda: "good")}
    times, errors = run_cell(prepares, lambda out: None, 3, measure)
    assert times == {"flaky": [], "good": [2.0, 2.0, 2.0]}
    assert errors == {"flaky": "RuntimeError: out of memory in do_bench"}


def test_benchmark_bwd_flags_reach_every_cell(monkeypatch, tmp_path):
    """``scripts/benchmark.py --mode bwd``: the grid, --dtype, the variants and the timing
    flags reach ``bench_cell`` for every cell (--dtype once did not, and the run stopped with
    a TypeError on the GPU); the JSON holds the rows. ``bench_cell`` is replaced: no GPU."""
    import json

    cli = load_script("benchmark")
    calls = []

    def fake_cell(b, h, hk, s, d, causal, **kw):
        calls.append((b, h, hk, s, d, causal, kw))
        return {"batch": b, "heads": h, "heads_kv": hk, "seqlen": s, "head_dim": d,
                "causal": causal, "ours_tflops": 1.0, "fa4_tflops": 1.0}

    monkeypatch.setattr(bwd_bench, "bench_cell", fake_cell)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake")
    out = tmp_path / "bwd.json"
    args = cli.parse_args(["--mode", "bwd", "--hdim", "128", "256", "--seqlen", "1024", "4096",
                           "--dtype", "fp16", "--ours-variant", "v:dq_accum=red",
                           "--repeat", "2", "--json", str(out)])
    assert bwd_bench.run_from_benchmark_args(args) == 0
    assert [(d, s, c) for _, _, _, s, d, c, _ in calls] == [
        (d, s, c) for d in (128, 256) for s in (1024, 4096) for c in (False, True)]
    for b, h, hk, s, d, _, kw in calls:
        assert b * s == 16384 and h * d == 2048 and hk == h
        assert kw["dtype"] is torch.float16 and kw["repeat"] == 2
        assert kw["variants"] == [("v", {"dq_accum": "red"})]
    assert len(json.loads(out.read_text())["rows"]) == 8


def test_benchmark_bwd_writes_csv_and_png(monkeypatch, tmp_path):
    """``--csv`` and ``--png`` in ``--mode bwd`` (once silently ignored there): one CSV row per
    (cell, provider) with a time, and a PNG. ``bench_cell`` is replaced: no GPU."""
    import csv

    pytest.importorskip("matplotlib", reason="the PNG needs matplotlib (pip install .[bench])")
    cli = load_script("benchmark")

    def fake_cell(b, h, hk, s, d, causal, **kw):
        row = {"batch": b, "heads": h, "heads_kv": hk, "seqlen": s, "head_dim": d,
               "causal": causal, "ours_ms": 2.0, "ours_tflops": 100.0 + s / 1024,
               "ours:v_ms": 1.0, "ours:v_tflops": 200.0, "fa4_ms": 4.0, "fa4_tflops": 50.0}
        if s == 4096:  # cuDNN timed in one length only
            row.update(cudnn_ms=8.0, cudnn_tflops=25.0)
        return row

    monkeypatch.setattr(bwd_bench, "bench_cell", fake_cell)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake")
    out_csv, out_png = tmp_path / "bwd.csv", tmp_path / "bwd.png"
    args = cli.parse_args(["--mode", "bwd", "--hdim", "128", "--seqlen", "1024", "4096",
                           "--causal", "false", "--ours-variant", "v:dq_accum=red",
                           "--csv", str(out_csv), "--png", str(out_png)])
    assert bwd_bench.run_from_benchmark_args(args) == 0
    with open(out_csv) as f:
        got = [(r["provider"], r["seqlen"], r["tflops"], r["device"]) for r in csv.DictReader(f)]
    assert got == [("ours", "1024", "101.0", "fake"), ("ours:v", "1024", "200.0", "fake"),
                   ("fa4", "1024", "50.0", "fake"),
                   ("ours", "4096", "104.0", "fake"), ("ours:v", "4096", "200.0", "fake"),
                   ("fa4", "4096", "50.0", "fake"), ("cudnn", "4096", "25.0", "fake")]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_backward_flops_are_two_and_a_half_forwards_with_v_head_dim():
    """2.5 x the forward's two GEMMs, which count hdim for Q K^T and hdim_v for P V: (192, 128)
    is 2.5 x 2 x (192 + 128) per (query, key) pair; halved for causal."""
    pairs = 2 * 16 * 1024 * 1024
    assert bwd_bench.bwd_flops(2, 16, 1024, 1024, 128, 128, False) == 2.5 * 4 * pairs * 128
    assert bwd_bench.bwd_flops(2, 16, 1024, 1024, 192, 128, False) == 2.5 * 2 * pairs * 320
    assert bwd_bench.bwd_flops(2, 16, 1024, 1024, 192, 128, True) == 2.5 * pairs * 320


@pytest.mark.parametrize("causal", [False, True])
def test_fallback_forward_takes_v_head_dim_and_matches_attention(causal):
    """``_torch_forward`` (O and LSE for our backward when FA4 is absent, and for
    ``--breakdown``): O has V's head dim ((192, 128) used to fail on O's shape), GQA heads
    share their KV head, and O and LSE match float64 attention."""
    from fa_sm100.testing import attention_reference, check_against_reference

    gen = torch.Generator().manual_seed(int(causal))
    b, s, h, hk = 2, 40, 4, 2
    q = torch.randn(b, s, h, 192, generator=gen).bfloat16()
    k = torch.randn(b, s, hk, 192, generator=gen).bfloat16()
    v = torch.randn(b, s, hk, 128, generator=gen).bfloat16()
    out, lse = bwd_bench._torch_forward(q, k, v, causal)
    assert out.shape == (b, s, h, 128) and out.dtype == torch.bfloat16 and lse.shape == (b, h, s)
    ref, ref_lse = attention_reference(q, k, v, causal=causal)  # float64
    plain, _ = attention_reference(q, k, v, causal=causal, dtype=torch.bfloat16)
    check_against_reference(out, ref, plain, what="O")
    _, lse32 = attention_reference(q, k, v, causal=causal, dtype=torch.float32)
    check_against_reference(lse, ref_lse, lse32, what="LSE")


def test_benchmark_bwd_counts_the_cells_whose_interval_clears_one(monkeypatch, capsys):
    """The grid's last lines say how many cells' paired 95% intervals lie above 1.00, hold it,
    or lie below (``verdict_summary``). ``bench_cell`` is replaced: no GPU."""
    cli = load_script("benchmark")
    intervals = {(1024, False): (1.01, 1.03), (1024, True): (0.99, 1.02),
                 (4096, False): (0.97, 0.99), (4096, True): None}

    def fake_cell(b, h, hk, s, d, causal, **kw):
        return {"batch": b, "heads": h, "heads_kv": hk, "seqlen": s, "head_dim": d,
                "causal": causal, "ours_tflops": 1.0, "fa4_tflops": 1.0, "ratio_paired": 1.0,
                "ratio_paired_ci": intervals[s, causal]}

    monkeypatch.setattr(bwd_bench, "bench_cell", fake_cell)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake")
    args = cli.parse_args(["--mode", "bwd", "--hdim", "128", "--seqlen", "1024", "4096"])
    assert bwd_bench.run_from_benchmark_args(args) == 0
    assert ("paired 95% intervals: 1 cell above 1.00, 1 cell at parity (1.00 inside), "
            "1 cell below 1.00, 1 cell with too few rounds for an interval"
            in capsys.readouterr().out.splitlines())


def test_every_cell_of_the_grids_draws_its_own_inputs():
    """``cell_seed``: the forward and backward grids seed each cell's inputs (so a failed
    check can be rerun on the same data), and no two cells of the default grid, nor of head
    dims 32-256 and lengths 128-128k, share a seed."""
    from fa_sm100.benchmarking import cell_seed

    cells = [(d, 1 << p, c) for d in (32, 64, 96, 128, 192, 256) for p in range(7, 18)
             for c in (False, True)]
    assert len({cell_seed(*cell) for cell in cells}) == len(cells)


def test_a_variant_name_the_rows_could_not_tell_apart_stops_before_any_gpu_work(capsys):
    """``ours:x_rounds_ms`` would read as variant x's round times (``row_provider``)."""
    cli = load_script("benchmark")
    assert cli.main(["--mode", "bwd", "--hdim", "128", "--seqlen", "1024",
                     "--ours-variant", "x_rounds:dq_accum=red"]) == 2
    assert "may not end in '_rounds'" in capsys.readouterr().err
    assert bwd_bench.row_provider("ours:x_y_rounds_ms") == "ours:x_y"
    assert bwd_bench.row_provider("ours:a_b_tflops") == "ours:a_b"
    assert bwd_bench.row_provider("seqlen") is None
