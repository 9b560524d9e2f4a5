"""The pipeline table: names, derived arrival counts, and the checks it runs when built."""

import dataclasses

import pytest

from fa_sm100.config import FmhaConfig, WarpRoles
from pipelines import record
from pipelines.named_barriers import NamedBarrier, check_named_barriers, num_threads
from pipelines.mbarrier import build_pipelines
from pipelines.spec import (PIPELINE_NAMES, PIPELINES, Side, barrier_count, barrier_offsets,
                            get_spec)

CFG2 = FmhaConfig()
CFG1 = FmhaConfig(use_2cta=False, kv_stage=3)


def test_pipeline_names_are_the_contract():
    assert PIPELINE_NAMES == ("q", "kv", "s_p_o", "p_lastsplit", "o_acc", "sm_stats", "o_epi")


@pytest.mark.parametrize("cfg,pair", [(CFG2, 2), (CFG1, 1)], ids=["2cta", "1cta"])
def test_arrival_counts_follow_the_roles(cfg, pair):
    a = {s.name: (s.arrivals("full", cfg), s.arrivals("empty", cfg)) for s in PIPELINES}
    # TMA: one expect-tx arrival; UMMA release: one tcgen05.commit.
    assert a["q"] == a["kv"] == (1, 1)
    # MMA waits on the leader: both CTAs' softmax (128 threads) + correction (128 threads).
    assert a["s_p_o"] == (1, 256 * pair)
    assert a["p_lastsplit"] == (128 * pair, 1)
    assert a["o_acc"] == (1, 128 * pair)
    # Local thread pipelines; the epilogue releases with one elected thread of its one warp.
    assert a["sm_stats"] == (128, 128)
    assert a["o_epi"] == (128, 1)


def test_counts_change_with_the_warp_roles():
    """Counts are derived, not typed: a correction role of different size changes them."""
    spec = get_spec("o_acc")
    roles = WarpRoles()
    assert spec.arrivals("empty", CFG2, roles) == 4 * 32 * 2
    fake = dataclasses.replace(spec, consumer=Side(("correction", "epilogue"), "thread"))
    assert fake.arrivals("empty", CFG2, roles) == 5 * 32 * 2


def test_tx_bytes_cover_both_ctas():
    q, kv = get_spec("q"), get_spec("kv")
    assert q.tx_bytes(CFG2) == 2 * 128 * 128 * 2
    assert q.tx_bytes(CFG1) == 128 * 128 * 2
    assert kv.tx_bytes(CFG2, "K") == kv.tx_bytes(CFG1, "K") == 128 * 128 * 2
    hd192 = FmhaConfig(head_dim=192, head_dim_v=128, kv_stage=2)
    assert kv.tx_bytes(hd192, "K") == 128 * 192 * 2 and kv.tx_bytes(hd192, "V") == 128 * 128 * 2
    assert get_spec("sm_stats").tx_bytes(CFG2) == 0


def test_p_lastsplit_only_with_split_p():
    """Without split P its full and empty barrier of each Q stage go, and nothing else."""
    cfg = FmhaConfig(split_p=False)
    assert "p_lastsplit" not in barrier_offsets(cfg)
    assert barrier_count(cfg) == barrier_count(CFG2) - 2 * CFG2.q_stage


BAD_ROWS = [
    (dict(kind="threads_threads"), "does not match its arrivals"),
    (dict(producer=Side(("softmax",), "umma")), "only the MMA warp arrives by tcgen05.commit"),
    (dict(producer=Side(("mma",), "expect_tx")), "only the load warp arrives with expect-tx"),
    (dict(consumer=Side(("nobody",), "thread")), "unknown consumer role"),
    (dict(stages="kv_stage"), "one stage per Q stage"),
]


@pytest.mark.parametrize("change,message", BAD_ROWS)
def test_bad_rows_are_rejected_when_built(change, message):
    bad = dataclasses.replace(get_spec("p_lastsplit"), **change)
    with pytest.raises(ValueError, match=message):
        bad.check(FmhaConfig(kv_stage=3))


@pytest.mark.parametrize("cfg", [CFG2, CFG1], ids=["2cta", "1cta"])
def test_build_in_dry_mode_gives_every_pipeline_its_rows_class_and_counts(cfg):
    """Each built pipeline is the DSL class its row's kind names ("tma_umma" ->
    TmaUmmaPipeline), with the row's stages and derived arrival counts."""
    with record.recording(dry=True):
        pipes = build_pipelines(cfg)
    assert set(pipes.names()) == {s.name for s in PIPELINES if s.name in barrier_offsets(cfg)}
    for name in pipes.names():
        spec, pipe = get_spec(name), pipes[name]
        want = "".join(part.capitalize() for part in spec.kind.split("_")) + "Pipeline"
        assert type(pipe).__name__ == want, name
        assert pipe.stages == spec.num_stages(cfg), name
    assert pipes.kv.stages == cfg.kv_stage
    assert pipes.s_p_o.empty_count == get_spec("s_p_o").arrivals("empty", cfg)
    with pytest.raises(KeyError):
        pipes["nope"]


def test_thread_commit_records_a_thread_arrive_to_the_leader():
    """The recorded protocol of producer_commit on the threads -> UMMA pipeline: a thread
    arrive on the leader CTA (never expect-tx)."""
    with record.recording(dry=True) as rec:
        pipes = build_pipelines(CFG2)
        with record.role("softmax0"):
            pipes.p_lastsplit.producer_acquire(0, 1)
            pipes.p_lastsplit.producer_commit(0)
            pipes.kv.producer_acquire(pipes.kv.make_producer_state())
    acq, commit, kv_state, kv_acq = rec.programs["softmax0"]
    assert (commit.op, commit.arrive, commit.dst, commit.tx, commit.stage_hint) == ("commit", "thread", "leader", 0, 0)
    assert acq.arrive is None
    assert (kv_acq.arrive, kv_acq.tx, kv_acq.stage_hint) == ("expect_tx", 128 * 128 * 2, None)
    # the phases: a compile-time parity is recorded as is; a PipelineState's through its
    # creation (initial index 0, phase 1: every stage starts empty), and the op names the state
    assert acq.phase == 1
    assert (kv_state.op, kv_state.pipeline, kv_state.stage_hint, kv_state.phase, kv_state.stages) == (
        "state_new", "kv", 0, 1, CFG2.kv_stage)
    assert kv_acq.state == kv_state.state and kv_acq.phase is None


def test_pipeline_state_advances_are_recorded_and_replayed():
    """flatten replays a state's creation, advances and clones, so each wait carries the parity
    the state passes; a fixed-stage state flips its phase on its own stage."""
    from pipelines.program import flatten

    with record.recording(dry=True) as rec:
        pipes = build_pipelines(CFG2)
        with record.role("mma"):
            kv = pipes.kv.make_consumer_state()
            spo = pipes.s_p_o.make_producer_state(1)
            with record.loop("n"):
                pipes.kv.consumer_wait(kv)
                held = kv.clone()
                kv.advance()
                pipes.kv.consumer_release(held)
                pipes.s_p_o.producer_acquire(spo)
                spo.advance()
    n = CFG2.kv_stage
    ops = flatten(rec.programs["mma"], {"n": 2 * n + 1}, {"kv": n, "s_p_o": 2})
    waits = [(o.stage, o.round, o.phase, o.state_index) for o in ops if o.kind == "wait"]
    assert waits == [(k % n, k // n, k // n % 2, k % n) for k in range(2 * n + 1)]
    releases = [(o.stage, o.state_index) for o in ops if o.kind == "release"]
    assert releases == [(k % n, k % n) for k in range(2 * n + 1)]
    spo_acq = [(o.stage, o.round, o.phase) for o in ops if o.kind == "acquire"]
    assert spo_acq == [(1, k, k % 2) for k in range(2 * n + 1)]


def test_pipeline_state_wraps_and_flips_phase():
    from pipelines.mbarrier import PipelineState

    st = PipelineState(3, 0, 0)
    seen = []
    for _ in range(7):
        seen.append((st.index, st.phase))
        st.advance()
    assert seen == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1), (0, 0)]
    one = PipelineState(1, 0, 1)
    one.advance()
    assert (one.index, one.phase) == (0, 0)


def test_named_barriers_start_at_one_and_count_threads():
    check_named_barriers()
    assert min(int(b) for b in NamedBarrier) == 1
    assert num_threads(NamedBarrier.TMEM_ALLOC) == (1 + 4 + 4 + 4) * 32
