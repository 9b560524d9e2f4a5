"""Contracts of ``scripts/timeline.py --emu-trace`` (CPU; the emulator itself is not run).

- A trace in ``ptxemu.emulator.write_trace``'s format (synthetic here) is drawn as one more
  panel, right below the model's panel of the same config, with the six role rows and an x axis
  labelled as the PTX emulator's execution order (no clock); the model panels are unchanged.
- The stdout summary's per-role instruction counts, barrier waits and first/last steps equal
  those in the file; events of warps with no chart role are counted apart.
- A missing file or a file not in the trace format fails with exit status 2 and a message
  naming the file, before any simulation.
"""

import json
from collections import Counter

import pytest

from fa_sm100.research import emu_trace, timeline_cli
from fa_sm100.research.emu_trace import EMU_AXIS_LABEL, is_barrier_wait, load_emu_trace
from fa_sm100.research.timeline import ROLE_NAMES, ROW_LABELS

ROLE_WARPS = {"softmax0": 0, "softmax1": 4, "correction": 8, "mma": 12, "epilogue": 13, "load": 14,
              "empty": 15}
# (role, op) in execution order; the role's warp comes from ROLE_WARPS.
PROGRAM = (
    [("load", "mov.u32"), ("load", "cp.async.bulk.tensor.2d.shared::cluster.global"),
     ("mma", "mbarrier.try_wait.parity.shared::cta.b64"), ("empty", "ret")]
    + [("mma", "tcgen05.mma.cta_group::2.kind::f16"), ("softmax0", "mbarrier.try_wait.parity.b64")] * 5
    + [("softmax0", "ex2.approx.ftz.f32"), ("softmax1", "bar.sync"), ("softmax1", "ex2.approx.f32"),
       ("correction", "tcgen05.ld.sync.aligned.32x32b.x16.b32"), ("correction", "bar.arrive"),
       ("epilogue", "cp.async.bulk.tensor.2d.global.shared::cta"), ("load", "mbarrier.arrive.b64")]
)


def _write_trace(path, program=PROGRAM):
    events = [{"cluster": 0, "warp": f"cta0.warp{ROLE_WARPS[role]}", "step": i, "line": 100 + i,
               "op": op, "lanes": 32, "role": role} for i, (role, op) in enumerate(program)]
    path.write_text(json.dumps({"kernel": "sm100_fwd_test", "time": "logical (execution order)",
                                "events": events}))
    return events


def _summary_rows(out):
    """{LABEL: (instructions, barrier waits, first, last)} from the printed summary."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(EMU_AXIS_LABEL))
    rows = {}
    for line in lines[start + 2:start + 2 + len(ROW_LABELS)]:
        label, n, waits, first, last = line.split()
        rows[label] = (int(n), int(waits), first, last)
    return rows


def test_emu_trace_panel_and_summary_match_the_file(tmp_path, capsys, monkeypatch):
    trace = tmp_path / "t.json"
    events = _write_trace(trace)
    drawn = {}
    real_draw = emu_trace.draw_emu_panel

    def spy(ax, bars, tr, colors):
        title = real_draw(ax, bars, tr, colors)
        drawn.update(title=ax.get_title(loc="left"), xlabel=ax.get_xlabel(), xlim=ax.get_xlim(),
                     rows=tuple(t.get_text() for t in ax.get_yticklabels()),
                     bars=len(ax.collections), returned=title)
        return title

    monkeypatch.setattr(emu_trace, "draw_emu_panel", spy)
    out = tmp_path / "tl.png"
    assert timeline_cli.main(["--emu-trace", str(trace), "--out", str(out), "--n-blocks", "2",
                              "--work-tiles", "1", "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert out.exists() and out.stat().st_size > 10_000

    assert drawn["title"] == drawn["returned"] and EMU_AXIS_LABEL in drawn["title"]
    assert "sm100_fwd_test" in drawn["title"] and f"{len(events)} warp instructions" in drawn["title"]
    assert EMU_AXIS_LABEL in drawn["xlabel"]
    assert drawn["xlim"] == (0.0, float(len(events)))
    assert drawn["rows"] == ROW_LABELS
    assert drawn["bars"] == 2 * len(ROW_LABELS), "one run and one barrier-wait layer per role"

    rows = _summary_rows(printed)
    label = dict(zip(ROLE_NAMES, ROW_LABELS))
    counts = Counter(e["role"] for e in events)
    for role in ROLE_NAMES:
        mine = [e for e in events if e["role"] == role]
        n, waits, first, last = rows[label[role]]
        assert n == counts[role] == len(mine)
        assert waits == sum(is_barrier_wait(e["op"]) for e in mine)
        assert (int(first), int(last)) == (mine[0]["step"], mine[-1]["step"])
    assert rows["MMA"][1] == 1 and rows["SOFTMAX0"][1] == 5 and rows["SOFTMAX1"][1] == 1
    assert rows["CORRECTION"][1] == 0 and rows["LOAD"][1] == 0, "arrives are not waits"
    assert f"+ {counts['empty']} instructions of warps with no chart role" in printed


def test_emu_panel_sits_below_the_base_panel(tmp_path):
    from fa_sm100.research.plotting import plot_timelines
    from fa_sm100.research.timeline import Interval, Timeline

    def tl(title):
        ivs = tuple(Interval(r, 0.0, 100.0, "busy") for r in ROLE_NAMES)
        return Timeline(title, ivs, time_per_tile=100.0, span=(0.0, 100.0))

    trace = tmp_path / "t.json"
    _write_trace(trace)
    tr = load_emu_trace(str(trace))
    info = plot_timelines([tl("base"), tl("q_stage=1")], str(tmp_path / "p.png"), emu_trace=tr)
    assert [t.split(":")[0] for t in info.panel_titles] == ["base", "q_stage=1"]
    assert EMU_AXIS_LABEL in info.emu_title and EMU_AXIS_LABEL in info.suptitle
    plain = plot_timelines([tl("base")], str(tmp_path / "q.png"))
    assert plain.emu_title == ""
    summary = {s.role: s for s in tr.summary()}
    assert summary["epilogue"].first_step == summary["epilogue"].last_step == len(PROGRAM) - 2


@pytest.mark.parametrize("content, match", [
    (None, "no such file"),
    ("not json {", "not a JSON trace"),
    (json.dumps([1, 2]), "emulate_sm100.py --trace"),
    (json.dumps({"kernel": "k", "events": []}), "emulate_sm100.py --trace"),
    (json.dumps({"kernel": "k", "time": "logical (execution order)", "events": []}), "no events"),
    (json.dumps({"kernel": "k", "time": "t", "events": [{"cluster": 0, "warp": "cta0.warp0",
                                                          "step": 0, "line": 1, "op": "ret",
                                                          "lanes": 32}]}), "lacks \\['role'\\]"),
    (json.dumps({"kernel": "k", "time": "t", "events": [{"cluster": 0, "warp": "cta0.warp0",
                                                          "step": "x", "line": 1, "op": "ret",
                                                          "lanes": 32, "role": "mma"}]}), "bad step"),
])
def test_bad_trace_fails_before_simulating(tmp_path, capsys, monkeypatch, content, match):
    from fa_sm100.research import model_backend

    path = tmp_path / "t.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=match):
        load_emu_trace(str(path))

    def no_sim(*a, **k):
        raise AssertionError("simulated before validating --emu-trace")

    monkeypatch.setattr(model_backend, "model_timeline", no_sim)
    out = tmp_path / "x.png"
    assert timeline_cli.main(["--emu-trace", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "timeline.py: error: --emu-trace" in err and str(path) in err
    assert not out.exists()
