"""The SM100 backward's recorded protocol, checked by the protocol model (issue 53, item 3).

Contract: the programs recorded while the backward kernel itself is traced cover its load and
MMA warps, each compute warpgroup (a part of the compute role: its own steps and 128-thread
arrivals) and the dQ warpgroup; the model (pipelines.check.check_config: random schedules
and an exhaustive search at one and two steps) finds no deadlock, over-arrival, phase
overrun, dangling arrival or race in the default config, a causal GQA one, a windowed one
and one with a single Q stage. The SMEM buffers, TMA bytes and TMEM regions it checks come
from the backward's pipeline table and TMEM plan. Each planted fault is reported, so the
check can fail.
"""

import os

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_100a")

from fa_sm100.config import WARP_SIZE  # noqa: E402
from fa_sm100.sm100.bwd_config import Sm100BwdConfig  # noqa: E402
from layouts.tmem import TmemPlan  # noqa: E402
from pipelines import record  # noqa: E402
from pipelines.program import flatten, inject, split_region, table_buffers  # noqa: E402
from pipelines.spec import BWD_PIPELINES, get_spec  # noqa: E402

CONFIGS = {
    "default": [],
    "causal_gqa": ["causal=true", "qhead_per_kvhead=4"],
    "windowed": ["local=true"],
    "q_stage1": ["q_stage=1"],
}
ROLES = {"load", "mma", "compute0", "compute1", "dq"}


# -- fast: the model's inputs come from the backward's table and plan ------------------------
@pytest.mark.parametrize("pair", [False, True], ids=["1cta", "2cta"])
def test_backward_buffers_and_tma_bytes_come_from_its_table(pair):
    """Each TMA buffer lands its tile (``tma_tiles``: one CTA's); a phase of a barrier the MMA
    warp waits on counts both CTAs' bytes under 2-CTA (the leader's), one the compute warps
    wait on (bwd_lse) its own CTA's. The 2-CTA buffers sQt / sdOt / sKt exist only there."""
    cfg = Sm100BwdConfig(use_2cta=pair, q_stage=1).validate()
    tiles, loaded = cfg.tma_tiles(), cfg.smem_buffers()
    for spec in BWD_PIPELINES:
        if spec.producer.arrive != "expect_tx":
            assert all(spec.buffer_tx(cfg, b) is None for b in spec.smem)  # sdS: no TMA
            continue
        ctas = 2 if pair and spec.name != "bwd_lse" else 1
        assert spec.tx_ctas(cfg) == ctas
        bufs = [b for b in spec.smem if b in loaded]
        for buf in bufs:
            assert spec.buffer_tx(cfg, buf) == ctas * tiles[buf[1:]]  # sK holds the K tile, ...
        assert sum(spec.buffer_tx(cfg, b) for b in bufs) == spec.tx_bytes(cfg)
        assert {b for b in spec.smem if b not in loaded} == (
            set() if pair else {"sKt", "sQt", "sdOt"} & set(spec.smem))
    # the forward's rows land one copy per acquire: the acquire's bytes
    assert get_spec("q").buffer_tx(cfg, "sQ") is None
    assert TmemPlan.of(cfg) == TmemPlan.for_backward(cfg)


def test_backward_buffer_names_are_not_the_forward_ones():
    buffers = table_buffers([p.name for p in BWD_PIPELINES])
    assert buffers == {"sK", "sV", "sKt", "sQ", "sdO", "sQt", "sdOt", "sLSE2", "sDelta", "sdS"}
    assert split_region("sLSE2", 1, buffers) == ("sLSE2", 1)  # its digit is no stage
    assert split_region("sK", None, buffers) == ("sK", 0)  # K and V are separate buffers
    assert split_region("sKV", None, buffers) == ("sKV", None)


def test_a_part_is_an_actor_with_the_role_prefix():
    with record.recording(dry=True) as rec:
        with record.role("compute"):
            record.emit("named_sync", "TMEM_ALLOC", threads=416)
            for h in range(2):
                with record.part(f"compute{h}", 4):
                    record.access(f"P{h}", "w")
    assert set(rec.programs) == {"compute0", "compute1"}
    first, sync, acc = rec.programs["compute1"]
    assert (first.op, first.note, first.threads) == ("part", "compute", 4 * WARP_SIZE)
    assert sync.op == "named_sync" and acc.region == "P1"
    ops = flatten(rec.programs["compute1"], {}, {p.name: 1 for p in BWD_PIPELINES})
    assert [o.kind for o in ops] == ["named_sync", "access"]


# -- the kernel's recording (a cross-compile each) -----------------------------------------
def recording(name):
    from fa_sm100.sm100.bwd_inspect_entry import make_config
    from pipelines.kernel_source import kernel_recording

    cfg = make_config(CONFIGS[name])
    return cfg, kernel_recording(cfg).programs


def model_rows(cfg, programs, steps=(1, 2, 3, 4), exhaustive_states=30_000):
    from pipelines.check import check_config

    return check_config(cfg, programs, steps, (1,), seeds=3, exhaustive_states=exhaustive_states)


@pytest.mark.compile
@pytest.mark.parametrize("name", list(CONFIGS))
def test_model_finds_no_protocol_error_in_the_backward(name):
    cfg, programs = recording(name)
    assert set(programs) == ROLES
    rows = model_rows(cfg, programs)
    assert [f for r in rows for f in r["findings"]] == []
    # the searches at one and two steps are exhaustive (finished within their budget)
    assert [r["n_blocks"] for r in rows if r["exhaustive"] and not r["exhaustive_truncated"]] == [1, 2]


# each fault: (kind, pipeline) -> a finding kind the model must report
FAULTS = {
    ("skip-wait", "bwd_s_dp"): "race",  # P/dS computed from S^T before the MMA wrote it
    ("drop-commit", "bwd_ds"): "deadlock",  # the MMA warp waits for dS forever
    ("short-tx", "bwd_q"): "over-arrival",  # Q and dO land more bytes than expected
    ("drop-release", "bwd_q"): "deadlock",  # the load warp waits for a free Q stage
    ("skip-wait", "bwd_lse"): "race",  # LSE2 read before its bulk copy landed
    ("extra-arrive", "bwd_dq"): "over-arrival",
    ("skip-wait", "bwd_dkv"): "race",  # dV read out while the MMA still accumulates
}


@pytest.mark.compile
@pytest.mark.parametrize("kind,pipe", list(FAULTS), ids=[f"{k}:{p}" for k, p in FAULTS])
def test_model_reports_a_fault_planted_in_the_backward(kind, pipe):
    cfg, programs = recording("default")
    rows = model_rows(cfg, inject(programs, kind, pipe), steps=(1, 2, 3), exhaustive_states=3000)
    found = [f for r in rows for f in r["findings"]]
    assert FAULTS[(kind, pipe)] in {f["kind"] for f in found}, found[:3]


# -- 2-CTA (Note [Backward 2-CTA] in fa_sm100/sm100/bwd_config.py) -------------------------
PAIR_CONFIGS = {
    "pair": ["use_2cta=true"],
    "pair_causal_gqa_window": ["use_2cta=true", "causal=true", "qhead_per_kvhead=4",
                               "local=true", "head_dim=64"],
}


def pair_recording(name):
    from fa_sm100.sm100.bwd_inspect_entry import make_config
    from pipelines.kernel_source import kernel_recording

    cfg = make_config(PAIR_CONFIGS[name])
    return cfg, kernel_recording(cfg).programs


def pair_rows(cfg, programs, steps=(1, 2, 3, 4), seeds=8):
    """Random schedules only: the model's exhaustive search is 1-CTA (pipelines.check)."""
    from pipelines.check import check_config

    return check_config(cfg, programs, steps, (1,), seeds=seeds, exhaustive_states=0)


@pytest.mark.compile
@pytest.mark.parametrize("name", list(PAIR_CONFIGS))
def test_model_finds_no_protocol_error_in_the_2cta_backward(name):
    """Actors are every role of both CTAs of the pair (the peer's MMA warp by the recorded
    is_leader_cta branch); the leader's barriers of bwd_kv / bwd_q count both CTAs' TMA bytes,
    bwd_lse each CTA's own; compute warpgroup h of either CTA writes its dS into CTA h's sdS
    at its own CTA's keys; no finding in random schedules of one to four steps."""
    from pipelines.check import trip_bindings
    from pipelines.model import ProtocolModel

    cfg, programs = pair_recording(name)
    assert set(programs) == ROLES
    model = ProtocolModel(cfg, programs, trip_bindings(cfg, 1, 1))
    assert {a.name for a in model.actors} == {f"{r}@{c}" for r in ROLES for c in (0, 1)}
    writes = {(a.name, op.cta, op.cols) for a in model.actors for op in a.ops
              if op.kind == "access" and op.region == "sdS" and op.unit == "threads"}
    assert writes == {(f"compute{h}@{c}", h, (c * cfg.n_block, (c + 1) * cfg.n_block))
                      for h in (0, 1) for c in (0, 1)}
    rows = pair_rows(cfg, programs)
    assert [f for r in rows for f in r["findings"]] == []
    assert all(r["schedules"] > 0 and not r["random_truncated"] for r in rows)


def _sdS_writes(programs, **change):
    """``programs`` with every compute warpgroup's sdS write changed (an exchange fault)."""
    import dataclasses

    from pipelines.record import Branch, Loop

    def tx(seq):
        out = []
        for n in seq:
            if isinstance(n, Loop):
                out.append(Loop(n.trips, tx(n.body)))
            elif isinstance(n, Branch):
                out.append(Branch(n.cond, tx(n.then), tx(n.orelse)))
            elif n.op == "access" and n.region == "sdS" and n.unit == "threads":
                out.append(dataclasses.replace(n, **change))
            else:
                out.append(n)
        return out

    return {role: tx(nodes) for role, nodes in programs.items()}


# each fault -> a finding kind the model must report in the 2-CTA recording
PAIR_FAULTS = {
    "skip-wait:bwd_s_dp": "race",  # P/dS from S^T before the pair's MMA wrote it
    "drop-commit:bwd_ds": "deadlock",  # the leader's MMA warp waits for both CTAs' dS
    "short-tx:bwd_q": "over-arrival",  # the pair's Q / dO bytes overrun the leader's phase
    "skip-wait:bwd_lse": "race",  # each CTA's own rows, on its own barrier
    "exchange-into-own-cta": "race",  # both warpgroups' dS into their own CTA's rows
    "exchange-at-pair-keys-0": "race",  # both CTAs' dS at the first CTA's keys
}


@pytest.mark.compile
@pytest.mark.parametrize("fault", list(PAIR_FAULTS))
def test_model_reports_a_fault_planted_in_the_2cta_backward(fault):
    cfg, programs = pair_recording("pair")
    if fault == "exchange-into-own-cta":
        programs = _sdS_writes(programs, cta=None)
    elif fault == "exchange-at-pair-keys-0":
        programs = _sdS_writes(programs, cols_per_cta=0)
    else:
        kind, pipe = fault.split(":")
        programs = inject(programs, kind, pipe)
    rows = pair_rows(cfg, programs, steps=(1, 2, 3), seeds=3)
    found = [f for r in rows for f in r["findings"]]
    assert PAIR_FAULTS[fault] in {f["kind"] for f in found}, found[:3]
