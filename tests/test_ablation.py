"""Contracts of the switch ablation (fa_sm100/research/ablation.py, scripts/ablation.py).

- The matrix holds every combination of the switches exactly once, default first, each a
  validated config that carries its switch values (kv_stage re-derived from SMEM).
- Whole-problem time follows the scheduler: persistent clusters stride over the tiles (one
  exposed tile each, then steady increments); non-persistent tiles run alone in waves; the
  causal problem has the LPT tile list of the kernel's scheduler.
- Calibration: the default config reproduces the published FA4 B200 figure; the causal
  published point is reported with the same factor. The model's rows are MODEL OUTPUT.
- Flipping a switch moves the model's prediction the way the model says it should.
- Without an SM100 GPU the script reports the model; the measuring path refuses to run.
"""

import dataclasses
import json
import math

import pytest
from plain_text import word_lines

from fa_sm100.research import ablation as ab
from fa_sm100.research import ablation_cli


def test_matrix_has_every_combination_once_default_first():
    problem = ab.Problem()
    combos = ab.ablation_matrix(problem)
    expected = math.prod(len(v) for _, v in ab.SWITCHES)
    assert len(combos) == expected == 64
    seen = {tuple(c.values[n] for n in ab.SWITCH_NAMES) for c in combos}
    assert len(seen) == expected
    assert combos[0].flipped == ()
    for c in combos:
        for name in ab.SWITCH_NAMES:
            assert getattr(c.cfg, name) == c.values[name], (name, c.overrides)
        assert c.cfg.head_dim == problem.head_dim and c.cfg.causal == problem.causal
        # kv_stage fills the SMEM budget of this combination
        from layouts.smem import SmemPlan

        assert c.cfg.kv_stage == SmemPlan.max_kv_stage(c.cfg)


def test_only_subset_keeps_other_switches_at_default():
    combos = ablation_cli.combos_for(ab.Problem(), ["split_p", "q_stage"])
    assert len(combos) == 4
    for c in combos:
        assert set(c.flipped) <= {"split_p", "q_stage"}
    with pytest.raises(ValueError, match="not a switch"):
        ablation_cli.combos_for(ab.Problem(), ["warp_count"])


def test_flops_and_tile_lists_follow_the_problem():
    nc, c = ab.Problem(), ab.Problem(causal=True)
    assert c.flops() == nc.flops() / 2
    cfg = ab.config_for(nc)
    blocks = ab.tile_blocks(cfg, nc)
    rows = cfg.m_block * cfg.q_stage * cfg.cta_group
    assert len(blocks) == nc.batch * nc.heads * (nc.seqlen_q // rows)
    assert set(blocks) == {nc.seqlen_k // cfg.n_block}
    cb = ab.tile_blocks(ab.config_for(c), c)
    assert len(cb) == len(blocks)
    assert cb == sorted(cb, reverse=True), "causal tiles come longest first (LPT)"
    assert sum(cb) < sum(blocks)


def _linear_timer(alone_extra: float):
    def t(cfg, n, steady):
        return 100.0 * n + (0.0 if steady else alone_extra)
    return t


def test_persistent_pays_one_exposed_tile_per_cluster_non_persistent_pays_every_tile():
    problem = ab.Problem()
    cfg = ab.config_for(problem)
    timer = _linear_timer(alone_extra=500.0)
    n = max(ab.tile_blocks(cfg, problem))
    tiles = len(ab.tile_blocks(cfg, problem))
    clusters = cfg.num_sms // cfg.cta_group
    per_cluster = -(-tiles // clusters)
    assert ab.problem_time(cfg, problem, timer) == pytest.approx(100.0 * n * per_cluster + 500.0)
    nonp = cfg.replace(persistent=False)
    assert ab.problem_time(nonp, problem, timer) == pytest.approx((100.0 * n + 500.0) * per_cluster)


def test_device_mode_is_model_without_sm100_and_measure_refuses():
    mode, why = ab.device_mode()
    try:
        import torch

        sm100 = torch.cuda.is_available() and torch.cuda.get_device_capability(0)[0] == 10
    except ImportError:
        sm100 = False
    if sm100:
        pytest.skip("this machine has an SM100 GPU: the measuring path is live here")
    assert mode == "model" and why
    with pytest.raises(RuntimeError, match="cannot measure the SM100 kernel here"):
        ab.measure(ab.config_for(ab.Problem()), ab.Problem())


def test_cli_rejects_bad_input_before_any_work(capsys):
    assert ablation_cli.main(["--only", "bogus"]) == 2
    assert "not a switch" in capsys.readouterr().err
    assert ablation_cli.main(["--plot", "x.pdf"]) == 2
    assert ".png" in capsys.readouterr().err


# ------------------------------------------------------------------ with the timing model
@pytest.fixture(scope="module")
def calibrated():
    from fa_sm100.research import model_backend

    return ab.calibrate(model_backend.timer_factory())


def test_calibration_reproduces_the_published_default_point(calibrated):
    cal, timer = calibrated
    point = ab.CALIBRATION_POINT
    assert point.tflops == 1535.0
    assert point.problem == ab.Problem(batch=4, heads=16, seqlen_q=8192, seqlen_k=8192,
                                       head_dim=128, causal=False)
    cfg = ab.config_for(point.problem)
    got = ab.tflops(point.problem, ab.problem_time(cfg, point.problem, timer))
    assert got == pytest.approx(1535.0, rel=2e-3)
    assert cal.calibrated_tflops == pytest.approx(got)
    assert cal.scale > 0 and cal.model_tflops > 0 and cal.iterations >= 1
    assert f"{cal.scale:.4f}" in cal.describe() and "1535" in cal.describe()


def test_full_matrix_is_model_output_for_every_combination(calibrated):
    cal, timer = calibrated
    res = ab.run_model(ab.Problem(), timer, cal)
    assert len(res.rows) == 64
    assert len({tuple(r.combo.values.items()) for r in res.rows}) == 64
    assert all(r.source == "model" and 0 < r.tflops < float("inf") for r in res.rows)
    assert res.default.tflops == pytest.approx(1535.0, rel=2e-3)
    text = ab.format_result(res)
    assert "MODEL OUTPUT" in text and cal.describe() in text
    # every other published point is reported with the same calibration
    names = [p.name for p, _ in res.published]
    assert names == [p.name for p in ab.PUBLISHED_B200]
    causal_point, causal_pred = res.published[1]
    assert causal_point.tflops == 1418.0 and causal_point.problem.causal
    c = ab.config_for(causal_point.problem)
    assert causal_pred == pytest.approx(ab.tflops(causal_point.problem,
                                                  ab.problem_time(c, causal_point.problem, timer)))
    # the causal point's line carries its published figure beside the prediction
    line = next(l for l in word_lines(text) if l.startswith(causal_point.name))
    assert f"published {causal_point.tflops:.0f} TFLOP/s model {causal_pred:.0f} TFLOP/s" in line
    # the causal point also as FA4 runs it (non-persistent), with the same calibration
    (fa4_point, switches, fa4_pred), = res.published_as_fa4
    assert fa4_point is causal_point and switches == ("persistent=false",)
    c_np = ab.config_for(causal_point.problem, switches)
    assert not c_np.persistent
    assert fa4_pred == pytest.approx(ab.tflops(causal_point.problem,
                                               ab.problem_time(c_np, causal_point.problem, timer)))
    assert "with persistent=false" in text
    # each switch, flipped alone, is never faster than the default in the model, and the
    # model has a mechanism for each (q_stage overlap, 2-CTA K/V sharing, split-P hand-off,
    # MUFU/FMA balance, rescale work, persistent fill), so each is strictly slower
    for name, vals in ab.SWITCHES:
        flipped = res.row(**{name: vals[1]})
        assert flipped.tflops < res.default.tflops, name
    # the more switches are off, the slower: the all-off corner is the slowest row
    worst = min(res.rows, key=lambda r: r.tflops)
    assert len(worst.combo.flipped) >= 4


def test_cli_json_subset(tmp_path, capsys):
    out = tmp_path / "ab.json"
    png = tmp_path / "ab.png"
    assert ablation_cli.main(["--model", "--only", "split_p", "--json", str(out), "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "mode: model" in text and "MODEL OUTPUT" in text
    data = json.loads(out.read_text())
    assert data["label"] == "model" and len(data["rows"]) == 2
    assert data["calibration"]["published_tflops"] == 1535.0
    assert data["rows"][0]["tflops"] == pytest.approx(1535.0, rel=2e-3)
    assert {p["name"] for p in data["published"]} == {p.name for p in ab.PUBLISHED_B200}
    assert len(data["published"]) == len(ab.PUBLISHED_B200) + 1  # causal also as FA4 runs it
    assert png.stat().st_size > 10_000


def test_measure_on_sm100(sm100_device):
    problem = dataclasses.replace(ab.Problem(), batch=1, heads=2, seqlen_q=1024, seqlen_k=1024)
    ns = ab.measure(ab.config_for(problem), problem, warmup=1, iters=3)
    assert 0 < ns < 1e9


def test_sweep_parses_validates_and_orders_kv_stages(calibrated):
    cal, timer = calibrated
    problem = ab.Problem()
    name, combos = ab.parse_sweep("kv_stage=2,3,6", problem)
    assert name == "kv_stage" and [c.cfg.kv_stage for c in combos] == [2, 3, 6]
    assert all(c.cfg.q_stage == 2 and c.cfg.use_2cta for c in combos)  # others at default
    res = ab.run_model(problem, timer, cal, combos)
    t = [r.tflops for r in res.rows]
    # more K/V stages never slow the model down, and 2 stages expose the TMA latency
    assert t[0] < t[2] and t[0] <= t[1] <= t[2]
    best = max(res.rows, key=lambda r: r.tflops)
    text = ab.format_sweep(res, name)
    assert f"best in this sweep: kv_stage={best.combo.cfg.kv_stage} " in text and "MODEL OUTPUT" in text
    for bad, msg in (("kv_stage=2", "at least two"), ("warps=1,2", "no field"),
                     ("kv_stage=1,2", "2-CTA needs at least 2"), ("kv_stage", "field=v1")):
        with pytest.raises(ValueError, match=msg):
            ab.parse_sweep(bad, problem)


def test_cost_overrides_change_what_the_model_says_about_ex2_emulation():
    """With the MUFU four times faster, moving exp2 to the FMA pipe buys less (or nothing):
    the model's ex2 gain comes from the MUFU bottleneck. Bad --cost items raise ValueError."""
    from fa_sm100.research import model_backend

    problem = ab.Problem()
    on, off = ab.config_for(problem), ab.config_for(problem, ["ex2_emu_fraction=0"])

    def gain(costs):
        timer = model_backend.TileTimer(costs)
        return ab.problem_time(off, problem, timer) / ab.problem_time(on, problem, timer)

    slow_mufu = gain(model_backend.cost_table())
    fast_mufu = gain(model_backend.cost_table(["mufu_ex2_per_clk=64"]))
    assert slow_mufu > 1.0, "with the default MUFU rate, ex2 emulation is a gain in the model"
    assert fast_mufu < slow_mufu
    for bad, msg in (("mufu=3", "expected field=value"), ("fma_per_clk=x", "not a number"),
                     ("fma_per_clk=0", "> 0"), ("num_sms=132", "config field")):
        with pytest.raises(ValueError, match=msg):
            model_backend.cost_table([bad])
