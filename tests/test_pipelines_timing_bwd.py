"""Timing mode of the SM100 backward (pipelines/timing_bwd.py): MODEL OUTPUT, not measured.

Contracts: the replay of the backward's recorded protocol respects every pipeline of
``BWD_PIPELINES`` (no consumer access starts before its producer's hand-off arrived); no actor
runs two things at once; the step time is at least every actor's busy time per step, and the
critical path accounts for all of it; the tensor core's busy time is the five MMAs' FLOPs and
the TMA engine's the table's bytes; a second Q / dO stage never makes a walk slower (and is
faster once the dQ hand-off is short); a causal problem of several waves takes less time than
the non-causal one; the walk lengths are those of the band rule; the linear walk time matches
a simulation. The recording is a cross-compile (``compile`` marker, as
tests/test_protocol_bwd.py); the walk-length and input checks need none.
"""

import dataclasses
import os

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_100a")

from fa_sm100.sm100.bwd_config import Sm100BwdConfig  # noqa: E402
from pipelines import timing_bwd  # noqa: E402
from pipelines.timing import CostTable  # noqa: E402
from pipelines.timing_bwd import flops_per_step, simulate_bwd, walk_steps  # noqa: E402

STEPS = 5
CONFIGS = {
    "default": [],
    "q_stage1": ["q_stage=1"],
    "hdim64_causal_gqa": ["head_dim=64", "causal=true", "qhead_per_kvhead=4"],
}


def config(items):
    from fa_sm100.sm100.bwd_inspect_entry import make_config

    return make_config(items)


def busy(tl, actor, label):
    """``actor``'s busy intervals whose label starts with ``label``, in time order."""
    return sorted((iv for iv in tl.intervals
                   if iv.actor == actor and iv.kind == "busy" and iv.label.startswith(label)),
                  key=lambda iv: iv.start)


# -- no recording needed --------------------------------------------------------------------
def _visits(m, n, cfg, sq, sk, left, right):
    """Brute force: does some row of query block m see some key of key block n (bands.py)?"""
    off = sk - sq
    for i in range(m * cfg.m_block, min((m + 1) * cfg.m_block, sq)):
        lo = i + off - (sk if left is None else left)
        hi = i + off + (sq if right is None else right)
        if max(lo, n * cfg.n_block) <= min(hi, (n + 1) * cfg.n_block - 1, sk - 1):
            return True
    return False


@pytest.mark.parametrize("sq,sk", [(384, 384), (256, 700), (700, 256)])
@pytest.mark.parametrize("mask", ["none", "causal", "window"])
def test_walk_steps_are_the_blocks_whose_band_reaches_the_key_block(sq, sk, mask):
    cfg = Sm100BwdConfig(causal=mask == "causal", local=mask == "window", qhead_per_kvhead=2)
    window = (200, 30) if mask == "window" else (None, None)
    left, right = window if mask == "window" else (None, 0 if mask == "causal" else None)
    steps = walk_steps(cfg, sq, sk, window)
    assert len(steps) == -(-sk // cfg.n_block)
    for n, s in enumerate(steps):
        seen = sum(_visits(m, n, cfg, sq, sk, left, right) for m in range(-(-sq // cfg.m_block)))
        assert s == seen * cfg.qhead_per_kvhead, (n, s, seen)
    with pytest.raises(ValueError, match="local"):
        walk_steps(Sm100BwdConfig(), sq, sk, (64, 0))


@pytest.mark.parametrize("sq,sk", [(384, 384), (256, 700), (700, 256)])
@pytest.mark.parametrize("mask", ["none", "causal", "window"])
def test_a_pair_walks_the_blocks_whose_band_reaches_either_of_its_key_blocks(sq, sk, mask):
    """2-CTA (Note [Backward 2-CTA]): both CTAs of pair p walk the query blocks that see a key
    of blocks 2p or 2p + 1; an odd count of key blocks leaves the last pair's second CTA."""
    cfg = Sm100BwdConfig(causal=mask == "causal", local=mask == "window", qhead_per_kvhead=2,
                         use_2cta=True)
    window = (200, 30) if mask == "window" else (None, None)
    left, right = window if mask == "window" else (None, 0 if mask == "causal" else None)
    steps = walk_steps(cfg, sq, sk, window)
    blocks = -(-sk // cfg.n_block)
    assert len(steps) == blocks + blocks % 2
    for n, s in enumerate(steps):
        pair = (n // 2 * 2, n // 2 * 2 + 1)
        seen = sum(any(_visits(m, b, cfg, sq, sk, left, right) for b in pair if b < blocks)
                   for m in range(-(-sq // cfg.m_block)))
        assert s == seen * cfg.qhead_per_kvhead, (n, s, seen)


def test_the_forward_config_and_an_empty_walk_are_refused():
    from fa_sm100.config import FmhaConfig

    with pytest.raises(ValueError, match="Sm100BwdConfig"):
        simulate_bwd(FmhaConfig(), 4, programs={})
    with pytest.raises(ValueError, match="steps=0"):
        simulate_bwd(Sm100BwdConfig(), 0, programs={})


# -- on the kernel's recorded protocol ------------------------------------------------------
@pytest.mark.compile
@pytest.mark.parametrize("name", list(CONFIGS))
def test_no_access_starts_before_its_pipelines_hand_off(name):
    """Every row of BWD_PIPELINES, read off the intervals: the consumer's first access after
    a hand-off starts at or after the producer's last access before it ends (a TMA copy
    arrives one TMA latency after its bytes are sent; a UMMA commit when the MMA ends)."""
    cfg = config(CONFIGS[name])
    tl = simulate_bwd(cfg, STEPS)
    lat = tl.costs.tma_latency_clk
    mma = {r: busy(tl, "umma", label) for r, (label, _) in timing_bwd.BWD_MMAS.items()}
    tma = {b: busy(tl, "tma@0", b + " ") for b in ("sK", "sV", "sQ", "sdO", "sLSE2", "sDelta")}
    halves = ("compute0@0", "compute1@0")
    s_read = {h: busy(tl, h, "S^T -> regs") for h in halves}
    ds_tmem = {h: busy(tl, h, "dS^T -> TMEM") for h in halves}
    ds_smem = {h: busy(tl, h, "dS -> SMEM") for h in halves}
    dq = busy(tl, "dq@0", "dQ -> red")
    for region, ivs in mma.items():
        assert len(ivs) == STEPS, region
    assert len(dq) == STEPS and all(len(v) == STEPS for v in (*s_read.values(), *ds_smem.values()))
    # bwd_kv: K and V land before the first MMAs that read them
    assert mma["S"][0].start >= tma["sK"][0].end + lat
    assert mma["dP"][0].start >= tma["sV"][0].end + lat
    for j in range(STEPS):
        # bwd_q full: Q_j, dO_j landed; bwd_lse full: LSE2_j, Delta_j landed
        assert mma["S"][j].start >= tma["sQ"][j].end + lat
        assert mma["dP"][j].start >= tma["sdO"][j].end + lat
        for h in halves:
            assert s_read[h][j].start >= max(tma["sLSE2"][j].end, tma["sDelta"][j].end) + lat
            # bwd_s_dp full: S^T_j and dP^T_j computed (one commit after both)
            assert s_read[h][j].start >= mma["dP"][j].end
        # bwd_ds full: both warpgroups stored P^T, dS^T and dS
        ds_done = max(ds_smem[h][j].end for h in halves)
        assert mma["dV"][j].start >= ds_done
        # bwd_dq full: dQ_j in TMEM
        assert dq[j].start >= mma["dQ"][j].end
        if j + 1 < STEPS:
            # bwd_s_dp empty: S^T_{j+1} overwrites what the compute warps read
            assert mma["S"][j + 1].start >= ds_done
            # bwd_dq empty: dP^T_{j+1} overwrites dQ_j (an alias) once it was read out
            assert mma["dP"][j + 1].start >= dq[j].end
            # bwd_ds empty: dS_{j+1} overwrites sdS once the dQ_j MMA read it
            for h in halves:
                assert ds_tmem[h][j + 1].start >= mma["dQ"][j].end
        if j + cfg.q_stage < STEPS:
            # bwd_q empty: the stage is refilled after dK_j, its last reader
            assert tma["sQ"][j + cfg.q_stage].start >= mma["dK"][j].end
    # bwd_dkv full: the epilogue reads the final dV and dK
    assert busy(tl, "compute0@0", "dV -> global")[0].start >= mma["dV"][-1].end
    assert busy(tl, "compute1@0", "dK -> global")[0].start >= mma["dK"][-1].end


@pytest.mark.compile
@pytest.mark.parametrize("name", list(CONFIGS))
def test_one_thing_at_a_time_and_the_step_bounds_every_role(name):
    cfg = config(CONFIGS[name])
    tl = simulate_bwd(cfg, STEPS)
    for actor, ivs in tl.by_actor().items():
        ivs = sorted(ivs, key=lambda iv: iv.start)
        for a, b in zip(ivs, ivs[1:]):
            assert b.start >= a.end - 1e-9, f"{actor} runs {a.label!r} and {b.label!r} at once"
    per_step = tl.busy_per_step()
    assert {"umma", "tma@0", "compute0@0", "compute1@0", "dq@0"} <= set(per_step)
    for actor, clk in per_step.items():
        assert 0 < clk <= tl.step_clk + 1e-9, actor
    crit = tl.critical_per_step()
    assert sum(crit.values()) == pytest.approx(tl.step_clk)
    assert crit["latency"] >= -1e-9
    assert tl.bound_by == max((a for a in crit if a != "latency"), key=crit.get)
    path = [tl.intervals[k] for k in tl.critical]
    assert all(iv.kind == "busy" for iv in path)
    assert all(b.start >= a.end - 1e-9 for a, b in zip(path, path[1:])), "a chain of causes"
    assert path[-1].end == tl.step_end_clk[-1]
    # the chain reaches back to the first operations of the run, and between two of its links
    # there is never more than a latency (TMA landing, barrier wake-up, a few issues)
    c = tl.costs
    assert path[0].start <= c.issue_clk
    most = c.tma_latency_clk + c.wait_latency_clk + 4 * c.issue_clk
    assert all(b.start - a.end <= most for a, b in zip(path, path[1:]))
    assert tl.step_end_clk == sorted(tl.step_end_clk) and tl.total_clk >= tl.step_end_clk[-1]


@pytest.mark.compile
@pytest.mark.parametrize("items", [[], ["head_dim=64"]])
def test_tensor_core_and_tma_work_is_the_configs(items):
    cfg = config(items)
    c = CostTable()
    tl = simulate_bwd(cfg, STEPS, c)
    core = sum(iv.end - iv.start for iv in tl.intervals if iv.actor == "umma")
    assert core == pytest.approx(STEPS * flops_per_step(cfg) / c.umma_flop_per_clk)
    d = cfg.head_dim
    assert flops_per_step(cfg) == 2 * cfg.m_block * cfg.n_block * 5 * d  # S, dP, dV, dK, dQ
    t = cfg.tma_tiles()
    nbytes = t["K"] + t["V"] + STEPS * (t["Q"] + t["dO"] + t["LSE2"] + t["Delta"])
    sent = sum(iv.end - iv.start for iv in tl.intervals if iv.actor == "tma@0")
    assert sent == pytest.approx(nbytes / c.tma_bytes_per_clk)


@pytest.mark.compile
@pytest.mark.parametrize("items", [[], ["head_dim=64"]])
def test_a_second_q_stage_never_makes_a_walk_slower(items):
    fast_dq = dataclasses.replace(CostTable(), red_bytes_per_clk=1024.0)
    for costs in (CostTable(), fast_dq):
        for steps in (3, 6):
            two = simulate_bwd(config(items + ["q_stage=2"]), steps, costs).total_clk
            one = simulate_bwd(config(items + ["q_stage=1"]), steps, costs).total_clk
            assert two <= one, (costs.red_bytes_per_clk, steps)
    # with a short dQ hand-off, one stage exposes the next Q / dO load
    two = simulate_bwd(config(items + ["q_stage=2"]), 6, fast_dq)
    one = simulate_bwd(config(items + ["q_stage=1"]), 6, fast_dq)
    assert two.step_clk < one.step_clk
    assert dict(one.top_waits("mma@0")).get("bwd_q", 0.0) > dict(two.top_waits("mma@0")).get("bwd_q", 0.0)


@pytest.mark.compile
def test_a_causal_problem_takes_less_time_than_the_full_one():
    full, causal = config([]), config(["causal=true"])
    for seqlen, batch in ((4096, 2), (2048, 8)):  # several waves of CTAs over 148 SMs
        a = timing_bwd.problem_time(full, seqlen, seqlen, batch, 16)
        b = timing_bwd.problem_time(causal, seqlen, seqlen, batch, 16)
        assert a.ctas == b.ctas and a.ctas > CostTable().num_sms
        assert b.steps < a.steps and b.total_clk < a.total_clk
    # one wave: the longest causal walk (key block 0) sees every query block
    a = timing_bwd.problem_time(full, 1024, 1024, 1, 16)
    b = timing_bwd.problem_time(causal, 1024, 1024, 1, 16)
    assert b.total_clk <= a.total_clk * (1 + 1e-9)


@pytest.mark.compile
def test_the_linear_walk_time_matches_a_simulation():
    cfg = config([])
    clk = timing_bwd.walk_clk(cfg)
    assert clk(0) == 0.0
    assert clk(3) == simulate_bwd(cfg, 3).total_clk
    assert clk(30) == pytest.approx(simulate_bwd(cfg, 30).total_clk, rel=1e-3)


@pytest.mark.compile
def test_a_stalled_or_unpriced_protocol_is_an_error():
    from pipelines.kernel_source import kernel_recording
    from pipelines.program import inject
    from pipelines.record import Event

    cfg = config([])
    programs = kernel_recording(cfg).programs
    with pytest.raises(RuntimeError, match="stalled"):
        simulate_bwd(cfg, cfg.q_stage + 2, programs=inject(programs, "drop-release", "bwd_q"))
    odd = dict(programs, dq=programs["dq"] + [Event("access", region="sK", mode="r", unit="threads")])
    with pytest.raises(ValueError, match="no price"):
        simulate_bwd(cfg, 1, programs=odd)


@pytest.mark.compile
def test_cli_prints_the_bound_and_writes_json(tmp_path, capsys):
    import json

    out = tmp_path / "bwd.json"
    assert timing_bwd.main(["--steps", "4", "--seqlen", "1024", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "modelled (not measured)" in text and "bound by" in text and "problem seqlen 1024" in text
    data = json.loads(out.read_text())
    assert data["steps"] == 4 and data["config"]["head_dim"] == 128
    assert data["bound_by"] in data["critical_per_step_clk"]
    assert {"actor", "kind", "start", "end", "label"} <= set(data["intervals"][0])
    assert timing_bwd.main(["--set", "q_stage=3"]) == 2
    assert timing_bwd.main(["--set", "qhead_per_kvhead=4", "--heads", "6"]) == 2


@pytest.mark.compile
def test_the_2cta_model_halves_each_ctas_dq_adds_and_prices_the_exchange():
    """2-CTA (Note [Backward 2-CTA]): both CTAs' roles run, one thing at a time; the pair's one
    tensor-core queue does each SM's share of the five MMAs, the 1-CTA FLOPs; each CTA's TMA
    engine lands its own tiles (K, V and K^T's half once, its Q / dO rows, Q^T / dO^T's half
    and all LSE2 / Delta rows per step); each CTA's dQ warps hand half of a 1-CTA step's dQ to
    L2; the warpgroup whose query rows the peer owns (1 in CTA 0, 0 in CTA 1) stores its dS over
    the SM-to-SM network, the other into its own SMEM."""
    one, pair = config([]), config(["use_2cta=true"])
    c = CostTable()
    tl, base = simulate_bwd(pair, STEPS, c), simulate_bwd(one, STEPS, c)
    for actor, ivs in tl.by_actor().items():
        ivs = sorted(ivs, key=lambda iv: iv.start)
        assert all(b.start >= a.end - 1e-9 for a, b in zip(ivs, ivs[1:])), actor
    assert {f"{r}@{k}" for r in ("compute0", "compute1", "dq", "tma") for k in (0, 1)} <= set(
        tl.busy_per_step())
    core = sum(iv.end - iv.start for iv in tl.intervals if iv.actor == "umma")
    assert core == pytest.approx(STEPS * flops_per_step(pair) / c.umma_flop_per_clk)
    t = pair.tma_tiles()
    per_step = t["Q"] + t["dO"] + t["Qt"] + t["dOt"] + t["LSE2"] + t["Delta"]
    for k in (0, 1):
        sent = sum(iv.end - iv.start for iv in tl.intervals if iv.actor == f"tma@{k}")
        assert sent == pytest.approx((t["K"] + t["V"] + t["Kt"] + STEPS * per_step)
                                     / c.tma_bytes_per_clk)
    # the last step's adds meet the dK / dV epilogue's stores on the SM's path to L2
    half = [iv.end - iv.start for iv in busy(tl, "dq@1", "dQ -> red")][:-1]
    full = [iv.end - iv.start for iv in busy(base, "dq@0", "dQ -> red")][:-1]
    assert len(half) == STEPS - 1 and half == pytest.approx([f / 2 for f in full])
    for actor, where in (("compute0@0", "dS -> SMEM"), ("compute1@0", "dS -> peer SMEM"),
                         ("compute0@1", "dS -> peer SMEM"), ("compute1@1", "dS -> SMEM")):
        assert len(busy(tl, actor, where)) == STEPS, actor


@pytest.mark.compile
@pytest.mark.parametrize("d", [96, 128])
def test_2cta_gains_where_the_dq_hand_off_bounds_the_step(d):
    """The decision behind ``use_2cta`` (docs/sm100_backward.md, "Where 2-CTA pays"): its
    gain is halving each CTA's dQ adds. With the default table, where the dQ warps bound the
    1-CTA step at these head dims, the pair's step is shorter; with a dQ hand-off that bounds
    nothing (red_bytes_per_clk 1024) the dS exchange and the pair's dQ MMA waiting for both
    CTAs make it longer."""
    one, pair = config([f"head_dim={d}"]), config([f"head_dim={d}", "use_2cta=true"])
    c = CostTable()
    assert simulate_bwd(one, 16, c).bound_by == "dq@0"
    assert simulate_bwd(pair, 16, c).step_clk < simulate_bwd(one, 16, c).step_clk
    fast_dq = dataclasses.replace(c, red_bytes_per_clk=1024.0)
    assert simulate_bwd(pair, 16, fast_dq).step_clk > simulate_bwd(one, 16, fast_dq).step_clk
