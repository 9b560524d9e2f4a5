"""The protocol model: the DESIGN.md protocol is clean, and each kind of defect is reported.

Contract: the model simulates mbarriers exactly and reports deadlocks (with each blocked
operation), over-arrivals, waits that can never complete, phase overruns and unordered
TMEM/SMEM accesses (vector clocks). Every test below either checks the clean protocol or
plants one defect and checks that exactly that kind is named.
"""

import dataclasses

import pytest

from fa_sm100.config import FmhaConfig
from pipelines import record
from pipelines.design import design_recording
from pipelines.model import ProtocolModel
from pipelines.named_barriers import NamedBarrier, named_sync
from pipelines.program import Branch, Loop, flatten, flip_initial_phase, inject
from pipelines.mbarrier import build_pipelines

CFG2 = FmhaConfig()
CFG1 = FmhaConfig(use_2cta=False, kv_stage=3)
SMALL = [CFG2, CFG1, FmhaConfig(q_stage=1, kv_stage=2, split_p=False),
         FmhaConfig(use_2cta=False, kv_stage=1, q_stage=2)]


def kinds(report):
    return {f.kind for f in report.findings}


@pytest.mark.parametrize("cfg", SMALL, ids=["2cta", "1cta", "q1-nosplit", "1cta-kv1"])
def test_design_protocol_is_clean(cfg):
    rec = design_recording(cfg)
    for n in (1, 2, 4):
        for t in (1, 3):
            for seed in range(2):
                rep = ProtocolModel(cfg, rec.programs, {"n_blocks": n, "work_tiles": t}).run_random(seed)
                assert rep.ok, (n, t, [f.message for f in rep.findings])
                assert rep.steps > 0


def test_exhaustive_search_is_clean_and_complete_at_small_trips():
    cfg = FmhaConfig(use_2cta=False, q_stage=1, kv_stage=2)
    rec = design_recording(cfg)
    rep = ProtocolModel(cfg, rec.programs, {"n_blocks": 2, "work_tiles": 2}).explore(max_states=20000)
    assert rep.ok and not rep.truncated
    assert rep.states > 100  # it did branch over interleavings


def _programs(cfg, roles):
    """Record hand-written role bodies (callables taking the pipelines) in dry mode."""
    with record.recording(dry=True) as rec:
        pipes = build_pipelines(cfg)
        for name, body in roles.items():
            with record.role(name):
                body(pipes)
    return rec.programs


def _stats_producer(p):
    st = p.sm_stats.make_producer_state(0)  # stage 0; phase 1 first (the stage starts empty)
    with record.loop("n_blocks"):
        p.sm_stats.producer_acquire(st)
        record.access("stats0", "w")
        p.sm_stats.producer_commit(st)
        st.advance()


def _stats_consumer(p):
    st = p.sm_stats.make_consumer_state(0)
    with record.loop("n_blocks"):
        p.sm_stats.consumer_wait(st)
        record.access("stats0", "r")
        p.sm_stats.consumer_release(st)
        st.advance()


def test_thread_pipeline_clean_then_each_defect():
    cfg = CFG1
    ok = _programs(cfg, {"softmax0": _stats_producer, "correction": _stats_consumer})
    assert ProtocolModel(cfg, ok, {"n_blocks": 4}).explore().ok

    def no_wait(p):
        with record.loop("n_blocks"):
            record.access("stats0", "r")
            p.sm_stats.consumer_release(0)

    race = _programs(cfg, {"softmax0": _stats_producer, "correction": no_wait})
    rep = ProtocolModel(cfg, race, {"n_blocks": 2}).run_random(0)
    assert "race" in kinds(rep)
    assert any("stats[0]" in f.message for f in rep.findings if f.kind == "race")

    def no_release(p):
        st = p.sm_stats.make_consumer_state(0)
        with record.loop("n_blocks"):
            p.sm_stats.consumer_wait(st)
            record.access("stats0", "r")
            st.advance()

    dead = _programs(cfg, {"softmax0": _stats_producer, "correction": no_release})
    rep = ProtocolModel(cfg, dead, {"n_blocks": 3}).run_random(0)
    assert {"deadlock", "never-completing-wait"} <= kinds(rep)
    assert any("softmax0@0" in f.message and "sm_stats.empty[0]" in f.message
               for f in rep.findings if f.kind == "deadlock")


def test_reference_defect_tma_style_commit_deadlocks():
    """The reference implementation's producer_commit on a thread-arrive pipeline used the
    TMA-load arrive (one elected arrival + expect-tx). Replayed in the model on p_lastsplit,
    that protocol never completes its phase; ours (a thread arrive) is clean."""
    cfg = CFG2
    rec = design_recording(cfg)

    def as_reference(nodes):
        out = []
        for n in nodes:
            if isinstance(n, Loop):
                out.append(Loop(n.trips, as_reference(n.body)))
            elif isinstance(n, Branch):
                out.append(Branch(n.cond, as_reference(n.then), as_reference(n.orelse)))
            elif n.op == "commit" and n.pipeline == "p_lastsplit":
                assert n.arrive == "thread"  # what our class records
                out.append(dataclasses.replace(n, arrive="expect_tx", dst="local", tx=128 * 64 * 2))
            else:
                out.append(n)
        return out

    bindings = {"n_blocks": 2, "work_tiles": 1}
    assert ProtocolModel(cfg, rec.programs, bindings).run_random(0).ok
    bad = {r: as_reference(p) for r, p in rec.programs.items()}
    rep = ProtocolModel(cfg, bad, bindings).run_random(0)
    assert "deadlock" in kinds(rep)
    assert any("p_lastsplit.full" in f.message for f in rep.findings)


def test_extra_arrival_is_an_over_arrival():
    cfg = CFG1
    progs = _programs(cfg, {"softmax0": _stats_producer, "correction": _stats_consumer})
    bad = inject(progs, "extra-arrive", "sm_stats")
    rep = ProtocolModel(cfg, bad, {"n_blocks": 2}).run_random(0)
    assert "over-arrival" in kinds(rep)
    assert any("already completed" in f.message for f in rep.findings)


def test_second_commit_runs_the_barrier_a_phase_ahead():
    """Two commits per acquire: the full barrier completes two phases before the consumer's
    first wait, which then sees the wrong parity."""
    cfg = CFG1

    def double_commit(p):
        st = p.sm_stats.make_producer_state(0)
        with record.loop("n_blocks"):
            p.sm_stats.producer_acquire(st)
            p.sm_stats.producer_commit(st)
            p.sm_stats.producer_commit(st)
            st.advance()

    progs = _programs(cfg, {"softmax0": double_commit, "correction": _stats_consumer})
    rep = ProtocolModel(cfg, progs, {"n_blocks": 2}).explore()
    assert "phase-overrun" in kinds(rep)


def test_dangling_arrival_at_exit():
    cfg = CFG1

    def half(p):  # the producer arrives, nobody consumes, the consumer side never arrives
        p.sm_stats.producer_acquire(0, 1)
        p.sm_stats.producer_commit(0)

    rep = ProtocolModel(cfg, _programs(cfg, {"softmax0": half, "correction": lambda p: None}), {}).run_random(0)
    assert rep.ok  # a completed phase nobody waits for is fine

    def partial(p):  # 4 warps' worth of arrivals where 128 threads are expected
        p.sm_stats.producer_acquire(0, 1)
        record.emit("commit", "sm_stats", 0, arrive="warp", dst="local")

    rep = ProtocolModel(cfg, _programs(cfg, {"softmax0": partial}), {}).run_random(0)
    assert kinds(rep) == {"dangling-arrival"}


def test_phase_overrun_found_by_exhaustive_search():
    """A producer that never acquires can run two phases ahead of a slow consumer: the
    consumer's parity wait then sees the wrong phase."""
    cfg = CFG1

    def no_acquire(p):
        with record.loop("n_blocks"):
            p.sm_stats.producer_commit(0)

    progs = _programs(cfg, {"softmax0": no_acquire, "correction": _stats_consumer})
    rep = ProtocolModel(cfg, progs, {"n_blocks": 3}).explore()
    assert "phase-overrun" in kinds(rep)
    # the adversarial schedule finds it too (what the CLI runs for 2-CTA protocols)
    assert "phase-overrun" in kinds(ProtocolModel(cfg, progs, {"n_blocks": 3}).run_random(0, waits_last=True))


def test_tmem_alias_race_between_umma_and_threads():
    """P0 lies inside S0 (columns 64..127): an S MMA and a softmax P store race unless ordered."""
    cfg = CFG1

    def mma(p):
        record.access("S0", "w", unit="umma")
        p.s_p_o.producer_commit(0)

    def softmax_early(p):
        record.access("P0", "w", cols=(0, 16))  # before waiting for S
        p.s_p_o.consumer_wait(0, 0)

    def softmax_ok(p):
        p.s_p_o.consumer_wait(0, 0)
        record.access("S0", "r")
        record.access("P0", "w")

    bad = ProtocolModel(cfg, _programs(cfg, {"mma": mma, "softmax0": softmax_early}), {}).run_random(0)
    assert [f.kind for f in bad.findings] == ["race"]
    assert "P0" in bad.findings[0].message
    good = ProtocolModel(cfg, _programs(cfg, {"mma": mma, "softmax0": softmax_ok}), {}).explore()
    assert good.ok


def _tmem_alloc_programs(roles_to_sync=("mma", "softmax0", "softmax1", "correction"), threads=0):
    """The MMA warp writes stats0 then syncs on TMEM_ALLOC; the other roles sync, then read."""

    def sync():
        if threads:  # a bar.sync that declares ``threads`` threads
            record.emit("named_sync", NamedBarrier.TMEM_ALLOC.name, threads=threads)
        else:
            named_sync(NamedBarrier.TMEM_ALLOC)

    def writer(p):
        record.access("stats0", "w")
        sync()

    def member(p):
        sync()
        record.access("stats0", "r")

    bodies = {r: (writer if r == "mma" else member) for r in roles_to_sync}
    return _programs(CFG1, {**{r: (lambda p: None) for r in ("mma", "softmax0", "softmax1", "correction")},
                            **bodies})


def test_named_barrier_waits_for_its_thread_count():
    """bar.sync TMEM_ALLOC opens once 416 threads (MMA 1 + softmax 8 + correction 4 warps)
    of the CTA arrived -- counted as the hardware counts, not by which roles exist."""
    ok = ProtocolModel(CFG1, _tmem_alloc_programs(), {}).explore()
    assert ok.ok
    rep = ProtocolModel(CFG1, _tmem_alloc_programs(("mma", "softmax0", "softmax1")), {}).run_random(0)
    assert kinds(rep) == {"deadlock"}
    assert "named barrier TMEM_ALLOC (288 of 416 threads arrived)" in rep.findings[0].message
    # a bar.sync declaring 384 threads opens without the MMA warp: its write then races
    short = ProtocolModel(CFG1, _tmem_alloc_programs(threads=384), {}).explore()
    assert "race" in kinds(short) and "over-arrival" in kinds(short)


def test_non_leader_mma_warp_must_join_the_named_barrier():
    """Under 2-CTA the MMA warp of CTA 1 issues no MMA but takes part in TMEM_ALLOC (the
    bar.sync counts its 32 threads): a program whose sync is only in the leader branch
    deadlocks CTA 1's TMEM users."""
    cfg = CFG2
    rec = design_recording(cfg)
    bindings = {"n_blocks": 2, "work_tiles": 1}
    model = ProtocolModel(cfg, rec.programs, bindings)
    assert "mma@1" in model.names and model.run_random(0).ok
    prog = rec.programs["mma"]
    (sync,) = [n for n in prog if getattr(n, "op", None) == "named_sync"]
    (leader,) = [n for n in prog if isinstance(n, Branch)]
    assert leader.cond == "is_leader_cta" and prog.index(sync) < prog.index(leader)
    rest = [n for n in prog if n is not sync and n is not leader]
    leader_only = {**rec.programs, "mma": rest + [Branch(leader.cond, [sync] + leader.then, leader.orelse)]}
    rep = ProtocolModel(cfg, leader_only, bindings).run_random(0)
    assert "deadlock" in kinds(rep)
    assert "softmax0@1 op #0 (named_sync TMEM_ALLOC) waits at the named barrier TMEM_ALLOC " \
           "(384 of 416 threads arrived)" in rep.findings[0].message


@pytest.mark.parametrize("pipe", ["q", "kv", "s_p_o", "p_lastsplit", "o_acc", "sm_stats", "o_epi"])
def test_wrong_initial_phase_is_rejected(pipe):
    """Every wait of the design protocol passes the parity of the round it waits for (tracked
    through its PipelineState); starting a pipeline's states with the other phase is a
    ``wrong-phase`` finding naming the first wait."""
    cfg = CFG2
    rec = design_recording(cfg)
    bindings = {"n_blocks": 3, "work_tiles": 2}
    model = ProtocolModel(cfg, rec.programs, bindings)
    waits = [o for a in model.actors for o in a.ops if o.kind in ("wait", "acquire")]
    assert waits and all(o.phase is not None for o in waits)  # every parity is known
    rep = ProtocolModel(cfg, flip_initial_phase(rec.programs, pipe), bindings).run_random(0)
    assert kinds(rep) == {"wrong-phase"}
    assert f"{pipe}." in rep.findings[0].message and "round 0" in rep.findings[0].message


def test_literal_phase_in_a_run_time_loop_is_rejected():
    """A compile-time parity inside a run-time loop is right for at most every other round."""
    cfg = CFG1

    def fixed_parity(p):
        with record.loop("n_blocks"):
            p.sm_stats.consumer_wait(0, 0)
            p.sm_stats.consumer_release(0)

    progs = _programs(cfg, {"softmax0": _stats_producer, "correction": fixed_parity})
    assert ProtocolModel(cfg, progs, {"n_blocks": 1}).run_random(0).ok
    rep = ProtocolModel(cfg, progs, {"n_blocks": 2}).run_random(0)
    assert kinds(rep) == {"wrong-phase"} and "round 1" in rep.findings[0].message


def test_flatten_resolves_ring_stages_and_rounds():
    with record.recording(dry=True) as rec:
        pipes = build_pipelines(CFG1)
        with record.role("load"):
            st = pipes.kv.make_producer_state()
            with record.loop("n"):
                pipes.kv.producer_acquire(st)
                st.advance()
    ops = flatten(rec.programs["load"], {"n": 7}, {"kv": 3})
    assert [(o.stage, o.round) for o in ops] == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1), (0, 2)]
    with pytest.raises(ValueError, match="no value for"):
        flatten(rec.programs["load"], {}, {"kv": 3})
