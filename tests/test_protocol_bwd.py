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
def test_backward_buffers_and_tma_bytes_come_from_its_table():
    cfg = Sm100BwdConfig()
    tiles = cfg.tma_tiles()
    for spec in BWD_PIPELINES:
        if spec.producer.arrive != "expect_tx":
            assert all(spec.buffer_tx(cfg, b) is None for b in spec.smem)  # sdS: no TMA
            continue
        for buf in spec.smem:
            assert spec.buffer_tx(cfg, buf) == tiles[buf[1:]]  # sK holds the K tile, ...
        assert sum(spec.buffer_tx(cfg, b) for b in spec.smem) == spec.tx_bytes(cfg)
    # the forward's rows land one copy per acquire: the acquire's bytes
    assert get_spec("q").buffer_tx(cfg, "sQ") is None
    assert TmemPlan.of(cfg) == TmemPlan.for_backward(cfg)


def test_backward_buffer_names_are_not_the_forward_ones():
    buffers = table_buffers([p.name for p in BWD_PIPELINES])
    assert buffers == {"sK", "sV", "sQ", "sdO", "sLSE2", "sDelta", "sdS"}
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
