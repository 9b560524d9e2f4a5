"""The clock and power record of the shared timing method (``fa_sm100.benchmarking``): what
``nvidia-smi`` prints is parsed, a sampler without nvidia-smi records nothing instead of
failing, and ``run_cell`` samples the timed rounds only. CPU only: a small script stands in for
nvidia-smi."""

import sys
import textwrap
import time

from plain_text import words

from fa_sm100.benchmarking import (ClockSampler, clock_summary, parse_clock_samples, run_cell,
                                   summarize_conditions)


def test_parse_clock_samples_keeps_number_pairs_only():
    text = "1830, 691.41\n[N/A], 690.0\n1845, 694.48\n\n1815, [N/A]\n1800"
    assert parse_clock_samples(text) == [(1830.0, 691.41), (1845.0, 694.48)]
    assert parse_clock_samples("") == []


def test_sampler_reads_a_stand_in_nvidia_smi(tmp_path):
    """The sampler starts the command with the query, reads its lines until ``__exit__`` stops
    it, and reports the medians (the upper middle of an even count, as ``median``)."""
    fake = tmp_path / "fake-smi"
    args_seen = tmp_path / "args.txt"
    fake.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import sys, time
        open({str(args_seen)!r}, "w").write(" ".join(sys.argv[1:]))
        for line in ("1830, 691.4", "[N/A], [N/A]", "1845, 693.0", "1800, 688.0"):
            print(line, flush=True)
        time.sleep(60)
        """))
    fake.chmod(0o755)
    sampler = ClockSampler(device_index=3, interval_ms=50, command=str(fake))
    with sampler:
        deadline = time.time() + 20
        while time.time() < deadline:  # wait until the stand-in has printed its lines
            if args_seen.exists():
                time.sleep(0.5)
                break
            time.sleep(0.05)
    assert sampler.result() == (1830.0, 691.4)
    assert args_seen.read_text() == ("--query-gpu=clocks.sm,power.draw "
                                     "--format=csv,noheader,nounits -i=3 -lms=50")


def test_sampler_without_nvidia_smi_records_nothing():
    sampler = ClockSampler(command="no-such-nvidia-smi-on-this-path")
    assert sampler.argv is None
    with sampler:
        pass
    assert sampler.result() is None


def test_run_cell_samples_the_timed_rounds_not_the_warm_up():
    """One monitor per timed round (3 providers x 2 rounds), none around the discarded
    warm-up or for a provider whose check failed; each result lands under its provider."""
    entered = []

    class Monitor:
        def __enter__(self):
            entered.append(self)
            return self

        def __exit__(self, *exc):
            return False

        def result(self):
            return (1000.0 + len(entered), 600.0)

    prepares = {name: (lambda name=name: (lambda: name)) for name in ("a", "b", "wrong")}
    conditions = {}
    times, errors = run_cell(prepares, lambda out: "bad" if out == "wrong" else None, 2,
                             lambda run: 1.0 if run() else 0.0, monitor=Monitor,
                             conditions=conditions)
    assert times == {"a": [1.0, 1.0], "b": [1.0, 1.0], "wrong": []}
    assert "wrong" in errors and len(entered) == 4
    assert sorted(conditions) == ["a", "b"]
    assert sorted(c[0] for cs in conditions.values() for c in cs) == [1001.0, 1002.0, 1003.0,
                                                                        1004.0]


def test_summaries_skip_rounds_without_samples():
    assert summarize_conditions([None, (1800.0, 690.0), (1700.0, 680.0)]) == (1800.0, 690.0)
    assert summarize_conditions([None, None]) is None
    line = clock_summary([("ours", (1830.0, 691.0)), ("fa4", None), ("ours", (1810.0, 689.0)),
                          ("fa4", (1845.0, 650.0))])
    assert line.endswith("ours 1830 MHz 691 W, fa4 1845 MHz 650 W")
    assert clock_summary([("ours", None)]) == ""


def test_bwd_rows_keep_clocks_out_of_the_provider_names(capsys):
    """The backward's rows hold ``<provider>_mhz`` / ``_watts``: its line still names the
    providers only, and ``print_clocks`` reads them back."""
    from fa_sm100.hopper import bwd_bench

    row = {"head_dim": 128, "seqlen": 4096, "batch": 4, "heads": 16, "heads_kv": 16,
           "causal": False, "ours_ms": 1.0, "ours_tflops": 500.0, "ours_mhz": 1700.0,
           "ours_watts": 690.0, "ours:t80_ms": 1.0, "ours:t80_tflops": 490.0,
           "ours:t80_mhz": 1690.0, "ours:t80_watts": 689.0, "fa4_tflops": 510.0}
    text = bwd_bench.format_row(row)
    assert "ours:t80 490.0" in words(text) and "_mhz" not in text and "ours:t80_" not in text
    bwd_bench.print_clocks([row, {**row, "ours_mhz": 1720.0}])
    assert capsys.readouterr().out.strip().endswith(
        "ours 1720 MHz 690 W, ours:t80 1690 MHz 689 W")
    bwd_bench.print_clocks([{"ours_tflops": 1.0}])  # nothing sampled: nothing printed
    assert capsys.readouterr().out == ""


def test_feature_benchmarks_save_their_command_and_draw_one_panel_per_mode(tmp_path):
    """``save_results`` / ``plot_mode_bars`` (scripts/window_bench.py, softcap_bench.py): the
    JSON holds the command that made it, and the figure has one panel per mode present, with
    a bar for each provider that has a number (a provider with none is left out)."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    from fa_sm100.benchmarking import plot_mode_bars, save_results

    rows = [{"mode": m, "seqlen": s, "tflops": {"ours": 100.0 + s / 1024, "fa4": 90.0}}
            for m in ("bwd", "fwd") for s in (4096, 16384)]
    save_results(tmp_path / "r.json", "scripts/x.py", ["--cells", "4096:128"], "GPU", rows)
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["command"] == "python scripts/x.py --cells 4096:128" and saved["rows"] == rows
    drawn = []
    real_subplots = plt.subplots

    def spy(*a, **kw):
        fig, axes = real_subplots(*a, **kw)
        drawn.append(axes)
        return fig, axes

    plt.subplots = spy
    try:
        plot_mode_bars(rows, ("ours", "ours:launch", "fa4"), str(tmp_path / "f.png"), "t",
                       lambda r: str(r["seqlen"]), lambda mode, cells: mode)
    finally:
        plt.subplots = real_subplots
    (axes,) = drawn
    assert [ax.get_title() for ax in axes.flat] == ["fwd", "bwd"]  # forward first
    assert [t.get_text() for t in axes.flat[0].get_legend().get_texts()] == ["ours", "fa4"]
    assert len(axes.flat[0].patches) == 4  # 2 cells x 2 providers with numbers
    assert (tmp_path / "f.png").stat().st_size > 10_000


def test_fill_ratio_row_takes_medians_and_pairs_ours_with_fa4():
    from fa_sm100.benchmarking import fill_ratio_row

    times = {"ours": [1.0, 2.0, 1.5], "ours:launch": [0.9, 1.8, 1.4], "fa4": [2.0, 2.0, 3.0]}
    row = fill_ratio_row({"ms": {}, "tflops": {}}, times, lambda ms: 10.0 / ms)
    assert row["ms"] == {"ours": 1.5, "ours:launch": 1.4, "fa4": 2.0}
    assert row["tflops"]["ours"] == 10.0 / 1.5
    assert row["ratio"] == 2.0  # per round 2.0, 1.0, 2.0: the median
    alone = fill_ratio_row({"ms": {}, "tflops": {}}, {"ours": [1.0]}, lambda ms: ms)
    assert alone["ratio"] is None and alone["interval"] is None and alone["ratio_launch"] is None
