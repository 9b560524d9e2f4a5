"""Contracts of scripts/timeline.py over the protocol model's timing mode (CPU, MODEL OUTPUT).

- The adapter keeps the model's numbers: each chart row's busy time equals the busy time the
  timing mode reports for that role of CTA 0 (the MMA row: the tensor core; LOAD: CTA 0's TMA
  engine), and no role is busy and waiting at the same instant.
- ``--compare`` draws four panels (default, q_stage=1, split_p off, rescale every step) as a
  PNG of non-trivial size, prints each panel's text chart and the comparison table, every
  one labelled MODEL OUTPUT; bad ``--set`` values fail before any simulation.
- Flipping a switch changes the model's prediction the way the model's mechanism says:
  q_stage=1 leaves SOFTMAX1 idle, rescale every step keeps CORRECTION busier, split P off
  makes the MMA warp wait longer for P; for each, the throughput moves in the direction the
  design expects, and the test asserts the direction the model gives (not a number).
- The tile timer's linear fit reproduces a direct simulation at a longer tile.
"""

import pytest

from fa_sm100.config import config_from_overrides
from fa_sm100.research import model_backend, timeline_cli
from fa_sm100.research.timeline import MODEL_LABEL, ROW_LABELS

N_BLOCKS, WORK_TILES = 4, 2


def _timeline(items, title="t"):
    cfg = config_from_overrides(items)
    return model_backend.model_timeline(cfg, title, items, N_BLOCKS, WORK_TILES)


def _merged(spans):
    total, cur = 0.0, None
    for a, b in sorted(spans):
        if cur is None or a > cur[1]:
            total += 0.0 if cur is None else cur[1] - cur[0]
            cur = [a, b]
        else:
            cur[1] = max(cur[1], b)
    return total + (0.0 if cur is None else cur[1] - cur[0])


def test_adapter_keeps_the_models_busy_time_and_never_double_books():
    cfg = config_from_overrides([])
    raw = model_backend.simulate_raw(cfg, N_BLOCKS, WORK_TILES)
    tl = model_backend.convert(raw, "default")
    ns = 1.0 / raw.costs.clock_ghz
    expect = {
        "mma": [(iv.start, iv.end) for iv in raw.intervals if iv.actor == "umma" and iv.kind == "busy"],
        "load": [(iv.start, iv.end) for iv in raw.intervals  # CTA 0's TMA engine
                 if iv.actor.split("@")[0] == "tma" and iv.kind == "busy" and iv.label.endswith("(load@0)")],
    }
    for role in ("softmax0", "softmax1", "correction", "epilogue"):
        expect[role] = [(iv.start, iv.end) for iv in raw.intervals
                        if iv.actor == f"{role}@0" and iv.kind == "busy"]
    for role, spans in expect.items():
        assert spans, f"the timing mode reports no busy time for {role}"
        assert tl.total(role, "busy") == pytest.approx(_merged(spans) * ns, rel=1e-9), role
    assert tl.span == (0.0, pytest.approx(raw.total_clk * ns))
    rows = tl.rows()
    for role, ivs in rows.items():
        busy = [(iv.start, iv.end) for iv in ivs if iv.state == "busy"]
        for w in (iv for iv in ivs if iv.state == "wait"):
            assert all(w.end <= a or w.start >= b for a, b in busy), f"{role} busy and waiting at once"
        assert tl.busy_fraction(role) + tl.wait_fraction(role) <= 1.0 + 1e-9


def test_compare_cli_draws_four_labelled_panels(tmp_path, capsys):
    out = tmp_path / "cmp.png"
    assert timeline_cli.main(["--compare", "--out", str(out), "--n-blocks", str(N_BLOCKS)]) == 0
    text = capsys.readouterr().out
    assert out.exists() and out.stat().st_size > 20_000
    for title, _ in timeline_cli.COMPARE_GROUPS:
        assert f"{title}: predicted" in text
    assert text.count(MODEL_LABEL) >= 5  # four panels and the table
    # each panel's text chart has a row per role: the label, then its bar between "|"
    charted = [line.split("|")[0].strip() for line in text.splitlines() if line.count("|") == 2]
    for label in ROW_LABELS:
        assert charted.count(label) == 1 + len(timeline_cli.COMPARE_GROUPS), label  # + default
    assert "wrote" in text and "4 panels" in text


def test_cli_rejects_bad_input_before_simulating(tmp_path, capsys):
    assert timeline_cli.main(["--set", "q_stage=3", "--out", str(tmp_path / "x.png")]) == 2
    assert "q_stage=3" in capsys.readouterr().err
    assert timeline_cli.main(["--set", "nonsense=1", "--out", str(tmp_path / "x.png")]) == 2
    assert timeline_cli.main(["--n-blocks", "0", "--out", str(tmp_path / "x.png")]) == 2
    assert timeline_cli.main(["--cost", "mufu_ex2_per_clk=fast", "--out", str(tmp_path / "x.png")]) == 2
    assert "not a number" in capsys.readouterr().err
    assert timeline_cli.main(["--out", str(tmp_path / "x.svg")]) == 2
    assert ".png" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists() and not (tmp_path / "x.svg").exists()


def test_compare_panels_change_one_switch():
    panels = dict(timeline_cli.build_panels([], [], compare=True))
    for title, items in panels.items():
        cfg = config_from_overrides(items)
        assert cfg.use_2cta, f"{title}: the comparison keeps 2-CTA as in the default"
    assert config_from_overrides(panels["q_stage=1"]).q_stage == 1


def test_switches_move_the_prediction_through_their_mechanism():
    base = _timeline([], "default")
    q1 = _timeline(["q_stage=1", "use_2cta=true"], "q_stage=1")
    nosplit = _timeline(["split_p=false"], "split_p off")
    rescale = _timeline(["rescale_threshold=0"], "rescale every step")
    # q_stage=1: the second softmax warpgroup has nothing to do, and the tensor core idles
    # while the only softmax works: fewer rows per microsecond.
    assert q1.total("softmax1", "busy") == 0.0 and base.total("softmax1", "busy") > 0.0
    assert q1.busy_fraction("mma") < base.busy_fraction("mma")
    assert q1.rows_per_us < base.rows_per_us
    # rescale every step: the correction warps rescale O on every block.
    assert rescale.busy_fraction("correction") > 2 * base.busy_fraction("correction")
    assert rescale.rows_per_us < base.rows_per_us
    # split P off: the PV MMA waits for all of P, so the MMA warp waits longer on s_p_o (the
    # first-part hand-off), and there is no p_lastsplit hand-off at all.
    waits_base = dict(base.top_waits("mma", k=10))
    waits_nosplit = dict(nosplit.top_waits("mma", k=10))
    assert "p_lastsplit" not in waits_nosplit
    assert waits_nosplit["s_p_o"] > waits_base["s_p_o"]
    assert nosplit.rows_per_us < base.rows_per_us


def test_linear_tile_timer_matches_a_direct_simulation():
    cfg = config_from_overrides([])
    timer = model_backend.tile_timer()
    n = 16
    alone = timer.total_ns(cfg, n, 1)
    steady = timer.total_ns(cfg, n, 2) - alone
    assert timer(cfg, n, False) == pytest.approx(alone, rel=0.01)
    assert timer(cfg, n, True) == pytest.approx(steady, rel=0.01)
    assert timer(cfg, n, True) < timer(cfg, n, False), "a persistent tile hides part of its fill"
    with pytest.raises(ValueError):
        timer(cfg, 0, True)


@pytest.mark.compile
def test_kernel_source_timeline_runs_the_kernels_own_protocol():
    """``--source kernel``: the SM100 kernel is cross-compiled with recording on and the timing
    mode replays the recorded programs; every role of the default config gets work, and the
    chart says which protocol it timed."""
    import os

    os.environ.setdefault("CUTE_DSL_ARCH", "sm_100a")
    cfg = config_from_overrides([])
    tl = model_backend.model_timeline(cfg, "kernel", (), N_BLOCKS, WORK_TILES, source="kernel")
    for role in ("load", "mma", "softmax0", "softmax1", "correction", "epilogue"):
        assert tl.total(role, "busy") > 0.0, role
    assert any("recorded from the SM100 kernel" in n for n in tl.notes)
    assert tl.time_per_tile > 0.0
    with pytest.raises(ValueError, match="--source"):
        model_backend.role_programs(cfg, "guess")


def test_a_stalled_protocol_gives_an_error_not_a_fast_timeline():
    """A replayed protocol that deadlocks (kv releases dropped: the load warp can never refill
    the ring) finishes no tile; the adapter refuses it instead of charting a short run."""
    from pipelines.design import design_recording
    from pipelines.program import inject

    cfg = config_from_overrides([])
    bad = inject(design_recording(cfg).programs, "drop-release", "kv")
    with pytest.raises(RuntimeError, match="stalled"):
        model_backend._simulate(cfg, 8, 2, None, bad)
