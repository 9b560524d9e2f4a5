"""Contracts of scripts/timeline.py --kernel sm100_bwd (CPU, MODEL OUTPUT of the backward's
timing mode).

- The chart keeps the model's numbers: each row's busy time is the busy time the timing mode
  reports for that actor (MMA: the tensor core, LOAD: the TMA engine), the time per step and
  the bounding role are the model's; no row is busy and waiting at once.
- The CLI draws one labelled panel per config as a PNG with the backward's five rows, prints
  each panel's text chart with the step time and the bound; options the backward has no use
  for, and bad configs, fail before anything is recorded or simulated.
- A timeline's intervals belong to its kernel's rows; the table and the figure refuse to mix
  kernels.
"""

import os

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_100a")

from fa_sm100.research import model_backend, timeline_cli  # noqa: E402
from fa_sm100.research.timeline import (BWD_ROLE_ROWS, MODEL_LABEL, ROLE_ROWS, Interval,  # noqa: E402
                                        Timeline, compare_table, render_text)

STEPS = 4


def _bwd_timeline(title="b"):
    ivs = [Interval(role, 0.0, 400.0, "busy", "x") for role, _ in BWD_ROLE_ROWS]
    ivs.append(Interval("dq", 400.0, 1000.0, "wait", "bwd_dq"))
    return Timeline(title, tuple(ivs), 1000.0, (0.0, 1000.0), tile_rows=512,
                    role_rows=BWD_ROLE_ROWS, step_time=250.0, bound_by="dq")


def test_backward_rows_render_with_the_step_and_its_bound():
    tl = _bwd_timeline()
    text = render_text(tl, width=20)
    assert MODEL_LABEL in text and "0.250 us per step, bound by DQ" in text
    rows = {line.split("|")[0].strip(): line.split("|")[1]
            for line in text.splitlines() if line.count("|") == 2}
    assert [r for r in rows if r] == [label for _, label in BWD_ROLE_ROWS]
    assert rows["DQ"] == "#" * 8 + "-" * 12
    with pytest.raises(ValueError, match="not rows of its kernel"):
        Timeline("x", (Interval("softmax0", 0.0, 1.0, "busy"),), 1.0, (0.0, 1.0),
                 role_rows=BWD_ROLE_ROWS)
    fwd = Timeline("f", (Interval("mma", 0.0, 1.0, "busy"),), 1.0, (0.0, 1.0), role_rows=ROLE_ROWS)
    with pytest.raises(ValueError, match="different kernels"):
        compare_table([tl, fwd])
    assert compare_table([tl]).splitlines()[0].split("busy %:")[1].split()[:5] == [
        "LOAD", "MMA", "CMP0", "CMP1", "DQ"]


def test_backward_cli_refuses_what_it_cannot_draw(tmp_path, capsys):
    png = str(tmp_path / "b.png")
    for extra, why in ((["--source", "design"], "--source design"),
                       (["--work-tiles", "2"], "--work-tiles"),
                       (["--emu-trace", str(tmp_path / "t.json")], "--emu-trace"),
                       (["--set", "q_stage=3"], "q_stage=3"),
                       (["--set", "split_p=false"], "split_p")):
        assert timeline_cli.main(["--kernel", "sm100_bwd", *extra, "--out", png]) == 2, extra
        assert why in capsys.readouterr().err
    assert not os.path.exists(png)


@pytest.mark.compile
def test_chart_keeps_the_backward_models_numbers():
    from fa_sm100.sm100.bwd_inspect_entry import make_config
    from pipelines.timing_bwd import simulate_bwd

    cfg = make_config(["causal=true"])
    raw = simulate_bwd(cfg, STEPS)
    tl = model_backend.bwd_model_timeline(cfg, "causal", ("causal=true",), STEPS)
    ns = 1.0 / raw.costs.clock_ghz
    actors = {"mma": "umma", "load": "tma@0", "compute0": "compute0@0", "compute1": "compute1@0",
              "dq": "dq@0"}
    for role, actor in actors.items():
        model_busy = sum(iv.end - iv.start for iv in raw.intervals
                         if iv.actor == actor and iv.kind == "busy")
        assert model_busy > 0 and tl.total(role, "busy") == pytest.approx(model_busy * ns), role
    assert tl.step_time == pytest.approx(raw.step_clk * ns)
    assert tl.bound_by == model_backend.chart_role(raw.bound_by) in dict(BWD_ROLE_ROWS)
    assert tl.span == (0.0, pytest.approx(raw.total_clk * ns))
    for role, ivs in tl.rows().items():
        spans = [(iv.start, iv.end) for iv in ivs if iv.state == "busy"]
        for w in (iv for iv in ivs if iv.state == "wait"):
            assert all(w.end <= a or w.start >= b for a, b in spans), f"{role} busy and waiting"
    assert any("critical path per step" in n for n in tl.notes)


@pytest.mark.compile
def test_backward_cli_draws_labelled_panels(tmp_path, capsys):
    out = tmp_path / "bwd.png"
    args = ["--kernel", "sm100_bwd", "--set", "qhead_per_kvhead=2", "--group", "q_stage=1",
            "--n-blocks", str(STEPS), "--out", str(out)]
    assert timeline_cli.main(args) == 0
    text = capsys.readouterr().out
    assert out.exists() and out.stat().st_size > 20_000
    assert text.count(MODEL_LABEL) >= 3  # two panels and the table
    assert text.count("us per step, bound by") == 2
    for _, label in BWD_ROLE_ROWS:
        assert f"  {label:10} |" in text
    assert "SOFTMAX0" not in text and "wrote" in text and "2 panels" in text
