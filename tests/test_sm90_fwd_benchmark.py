"""CPU tests of scripts/benchmark.py (issue 8 item 1): argument checks, the FLOP count, the
printed table with its ratio column, the PNG (one panel per head dim and causality), the
correctness check of each provider's first output in a cell (a right output passes, wrong ones
are named and not timed) and the exit status (non-zero when a provider is wrong or ours fails).
The rows here are synthetic inputs to the formatting code; measured numbers live in
docs/hopper.md."""

import pytest
import torch

from fa_sm100.testing import attention_reference
from script_loader import load_script


def load():
    return load_script("benchmark")


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


def test_table_adds_the_paired_ratio_when_rows_carry_it():
    bench = load()
    rs = rows()
    for r in rs:
        if r["provider"] == "ours":
            r["ratio_paired"] = 1.0344 if r["seqlen"] == 1024 else None
            r["ratio_paired_ci"] = (0.9981, 1.0512) if r["seqlen"] == 1024 else None
    lines = bench.table(rs, ["ours", "fa4", "cudnn"]).splitlines()
    assert lines[0].endswith("| ours / best peer | paired |")
    assert lines[2].endswith("| 1.11x | 1.034x [0.998, 1.051] |")
    assert lines[3].endswith("| n/a |")  # a cell without a paired ratio
    assert "paired" not in bench.table(rows(), ["ours", "fa4"]).splitlines()[0]


def test_png_has_one_panel_per_hdim_and_causality(tmp_path):
    pytest.importorskip("matplotlib", reason="the PNG needs matplotlib (pip install .[bench])")
    bench = load()
    path = tmp_path / "bench.png"
    bench.plot(rows(), ["ours", "fa4", "cudnn"], str(path), "test device")
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def _cell(seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, 96, 2, 32, generator=g).to(torch.bfloat16) for _ in range(3))


def _kernel_like(q, k, v, causal):
    """What a correct kernel returns: float32 attention rounded to the input dtype."""
    out, _ = attention_reference(q, k, v, causal=causal, dtype=torch.float32)
    return out.to(q.dtype)


@pytest.mark.parametrize("causal", [False, True])
def test_output_check_accepts_a_right_output(causal):
    bench = load()
    q, k, v = _cell()
    assert bench.check_output(_kernel_like(q, k, v, causal), q, k, v, causal, torch) is None


def test_output_check_names_wrong_outputs():
    bench = load()
    q, k, v = _cell()
    # the non-causal result for a causal cell
    assert "max error" in bench.check_output(_kernel_like(q, k, v, False), q, k, v, True, torch)
    # one wrong row: the last (checked rows include the first and the last)
    out = _kernel_like(q, k, v, True)
    out[:, -1] += 0.25
    assert "max error" in bench.check_output(out, q, k, v, True, torch)
    out = _kernel_like(q, k, v, True)
    out[0, 0, 0, 0] = float("nan")
    assert "NaN" in bench.check_output(out, q, k, v, True, torch)
    assert "shape" in bench.check_output(out[..., :16], q, k, v, True, torch)


def test_run_cell_checks_first_outputs_and_times_only_right_providers():
    bench = load()
    q, k, v = _cell(1)
    prepared = []

    def provider(make_out):
        def prepare(q, k, v, causal):
            prepared.append(make_out)
            return lambda: make_out(q, k, v, causal)
        return prepare

    def broken(q, k, v, causal):
        raise RuntimeError("no kernel for this cell")

    providers = {"good": provider(_kernel_like),
                 "zeros": provider(lambda q, k, v, causal: torch.zeros_like(q)),
                 "broken": broken}
    measured = []

    def measure(run):
        measured.append(run)
        run()
        return 1.0

    times, errors = bench.run_cell(providers, q, k, v, True, 3, measure, torch)
    assert times == {"good": [1.0, 1.0, 1.0], "zeros": [], "broken": []}
    assert errors["zeros"].startswith("wrong output") and "good" not in errors
    assert errors["broken"] == "RuntimeError: no kernel for this cell"
    assert prepared.count(_kernel_like) == 1  # prepared once per cell, outside the timing
    assert len(measured) == 1 + 3  # one discarded warm-up, then the rounds


def test_exit_status_fails_on_wrong_output_or_failing_ours():
    bench = load()
    ok = [{"provider": "ours", "error": None}, {"provider": "fa4", "error": None},
          {"provider": "flash", "error": "unavailable: ImportError"},
          {"provider": "cudnn", "error": "RuntimeError: no kernel"}]
    assert bench.exit_status(ok) == 0  # peers that cannot run a cell do not fail the run
    assert bench.exit_status(ok + [{"provider": "fa4", "error": "wrong output: x"}]) == 1
    assert bench.exit_status(ok + [{"provider": "ours:nopp", "error": "ValueError: y"}]) == 1


def test_variants_write_no_lse_unless_asked(monkeypatch):
    """``--ours-variant`` configs compute what ``ours`` computes: no LSE (nobody reads it in
    the benchmark) unless the variant sets ``write_lse``; their other fields apply."""
    bench = load()
    seen = []
    monkeypatch.setattr(bench, "prepare_ours",
                        lambda q, k, v, causal, config=None: seen.append(config))
    q, k, v = (torch.empty(1, 64, 2, 128, dtype=torch.bfloat16) for _ in range(3))
    label, prepare = bench.make_variant("nopp:pingpong=false", torch)
    prepare(q, k, v, False)
    _, prepare_lse = bench.make_variant("lse:write_lse=true", torch)
    prepare_lse(q, k, v, True)
    assert label == "ours:nopp"
    assert not seen[0].write_lse and not seen[0].pingpong and not seen[0].causal
    assert seen[1].write_lse and seen[1].causal


def test_variants_that_build_the_default_kernels_are_named_before_any_gpu_work(capsys,
                                                                                monkeypatch):
    """``--ours-variant`` of a switch the kernels do not read in a cell (``effective()``) is
    an A/A check of noise there; the benchmark names such cells per variant, in both modes,
    before it touches the GPU, and only those: a switch that changes the kernel is not named.
    A bad field stops the run there (status 2)."""
    bench = load()
    bwd = bench.parse_args(["--mode", "bwd", "--hdim", "128", "--seqlen", "1024", "16384",
                            "--causal", "true", "--ours-variant", "sf:stats_first=true",
                            "--ours-variant", "edv:early_dv=true"])
    # 1k causal runs 64-row blocks with stats_first on already; 16k's 80-row blocks ignore it
    assert bench.same_kernel_cells(bwd) == {"sf": [[128, True, 1024], [128, True, 16384]]}
    fwd = bench.parse_args(["--hdim", "64", "--seqlen", "8192",
                            "--ours-variant", "pr:peer_release=false"])
    # non-causal hdim 64 8k multicasts, so peer_release counts there; causal has no multicast
    assert bench.same_kernel_cells(fwd) == {"pr": [[64, True, 8192]]}

    def no_gpu(*a, **k):
        raise AssertionError("the GPU run started")

    monkeypatch.setattr(bench, "run_grid", no_gpu)
    bad = ["--hdim", "64", "--seqlen", "8192", "--ours-variant", "x:no_such_field=1"]
    assert bench.main(bad) == 2
    assert "no_such_field" in capsys.readouterr().err
    # a field that names the problem stops the run too (every run of a cell solves the same
    # problem: fa_sm100.config.parse_variant)
    assert bench.main(["--hdim", "64", "--seqlen", "8192", "--ours-variant",
                       "c:causal=true"]) == 2
    assert "causal names the problem" in capsys.readouterr().err
    # a switch valid in some cells only is left to the run there (it reports that provider's
    # error in the cell) instead of stopping it
    mixed = bench.parse_args(["--hdim", "64", "--seqlen", "8192", "--ours-variant",
                              "mc:kv_multicast=true"])
    # (multicast is the default non-causal, so there it is an A/A; causal it is invalid)
    assert bench.same_kernel_cells(mixed) == {"mc": [[64, False, 8192]]}
    bench.print_same_kernel_notes(bench.same_kernel_cells(fwd), 2)
    assert capsys.readouterr().out.splitlines() == [
        "benchmark: note: variant pr builds the same kernels as the default in 1 of 2 cells "
        "(A/A: its ratio there measures noise): hdim 64 causal 8192"]


def test_the_same_kernel_notes_come_before_the_run_and_go_into_the_json(capsys, monkeypatch,
                                                                         tmp_path):
    bench = load()
    events = []

    def fake_grid(args):
        events.append("run" if "benchmark: note: variant pr" in capsys.readouterr().out
                      else "run before the note")
        return [], "fake GPU", {}

    monkeypatch.setattr(bench, "run_grid", fake_grid)
    out = tmp_path / "grid.json"
    argv = ["--hdim", "64", "--seqlen", "8192", "--providers", "ours",
            "--ours-variant", "pr:peer_release=false", "--json", str(out)]
    assert bench.main(argv) == 0
    assert events == ["run"]
    import json

    assert json.loads(out.read_text())["same_kernel_as_default"] == {"pr": [[64, True, 8192]]}


def test_the_forward_grid_counts_verdicts_and_writes_the_interval_as_two_csv_columns(
        monkeypatch, tmp_path, capsys):
    """``main``: the verdict count after the table, and a CSV whose interval is two numeric
    columns (the JSON keeps the rounds' times and the interval). ``run_grid`` is replaced:
    no GPU."""
    import csv
    import json

    bench = load()
    fake = rows()
    for r in fake:
        if r["provider"] == "ours":
            r["ratio_paired"] = 1.02
            r["ratio_paired_ci"] = (1.01, 1.03) if r["seqlen"] == 1024 else (0.99, 1.04)
            r["rounds_ms"] = [1.0] * 6
    monkeypatch.setattr(bench, "run_grid", lambda args: (fake, "fake device", {}))
    out_csv, out_json = tmp_path / "f.csv", tmp_path / "f.json"
    bench.main(["--hdim", "64", "128", "--seqlen", "1024", "4096", "--providers", "ours", "fa4",
                "cudnn", "--csv", str(out_csv), "--json", str(out_json)])
    assert ("paired 95% intervals: 4 cells above 1.00, 4 cells at parity (1.00 inside)"
            in capsys.readouterr().out.splitlines())
    with open(out_csv) as f:
        got = list(csv.DictReader(f))
    assert "ratio_paired_ci" not in got[0] and "rounds_ms" not in got[0]
    ours = [r for r in got if r["provider"] == "ours" and r["seqlen"] == "1024"][0]
    assert (ours["ratio_paired_lo"], ours["ratio_paired_hi"], ours["device"]) == (
        "1.01", "1.03", "fake device")
    assert [r["ratio_paired_lo"] for r in got if r["provider"] == "fa4"][0] == ""
    saved = json.loads(out_json.read_text())["rows"]
    assert [r.get("rounds_ms") for r in saved if r["provider"] == "ours"][0] == [1.0] * 6
