"""The protocol the model checks comes from the SM100 kernel's own code.

Tracing the kernel (a cross-compile for sm_100a, no GPU) inside ``record.recording()`` logs
every pipeline operation, loop, branch and access of every role. These tests pin that:
the recorded protocol is complete and clean in the model; it performs the same pipeline
operations as the DESIGN.md protocol (pipelines/design.py) -- same count per role, pipeline,
operation, stage and arrival kind; and a fault planted in the recorded protocol is rejected,
so a change to the kernel's protocol changes what the model checks.
"""

from collections import Counter

import pytest

from fa_sm100.config import FmhaConfig

pytest.importorskip("cutlass")

CONFIGS = [FmhaConfig(), FmhaConfig(use_2cta=False, kv_stage=3, q_stage=1, split_p=False)]
ROLES = {"load", "mma", "softmax0", "softmax1", "correction", "epilogue"}


@pytest.fixture(scope="module", params=CONFIGS, ids=["2cta-q2-split", "1cta-q1-nosplit"])
def recorded(request):
    from pipelines.kernel_source import kernel_recording

    cfg = request.param
    return cfg, kernel_recording(cfg).programs


def _profile(cfg, programs, bindings):
    from pipelines.model import ProtocolModel

    model = ProtocolModel(cfg, programs, bindings)
    return {a.name: Counter((o.kind, o.pipe, o.stage, o.arrive, o.dst) for o in a.ops
                            if o.kind != "access") for a in model.actors}


def test_kernel_protocol_is_recorded_and_clean(recorded):
    from pipelines.model import ProtocolModel

    cfg, programs = recorded
    assert set(programs) == ROLES
    for n in (1, 2, 3):
        for t in (1, 2):
            rep = ProtocolModel(cfg, programs, {"n_blocks": n, "work_tiles": t}).run_random(seed=n + t)
            assert rep.ok, [f.message for f in rep.findings]


def test_kernel_performs_the_design_protocol(recorded):
    from pipelines.design import design_recording

    cfg, programs = recorded
    bindings = {"n_blocks": 3, "work_tiles": 2}
    kernel = _profile(cfg, programs, bindings)
    design = _profile(cfg, design_recording(cfg).programs, bindings)
    assert kernel == design


def test_fault_in_the_kernel_protocol_is_rejected(recorded):
    from pipelines.model import ProtocolModel
    from pipelines.program import inject

    cfg, programs = recorded
    bindings = {"n_blocks": 3, "work_tiles": 2}
    for kind, pipe, found in (("drop-release", "s_p_o", "deadlock"), ("skip-wait", "kv", "race"),
                              ("extra-arrive", "o_acc", "over-arrival")):
        rep = ProtocolModel(cfg, inject(programs, kind, pipe), bindings).run_random(0)
        assert found in {f.kind for f in rep.findings}, (kind, pipe)


def test_every_cta_runs_the_mma_warp_into_the_tmem_barrier(recorded):
    """The MMA role records its ``is_leader`` structure as the branch ``is_leader_cta``, so
    the model has the non-leader CTA's MMA warp too; its ``bar.sync`` on TMEM_ALLOC is counted
    against the thread count the kernel declares. Moving that sync into the leader branch (CTA 1's
    MMA warp never arrives) deadlocks CTA 1."""
    from pipelines.model import ProtocolModel
    from pipelines.named_barriers import NamedBarrier, num_threads
    from pipelines.program import Branch

    cfg, programs = recorded
    bindings = {"n_blocks": 2, "work_tiles": 1}
    model = ProtocolModel(cfg, programs, bindings)
    assert {f"mma@{c}" for c in range(cfg.cta_group)} <= set(model.names)
    syncs = [o for a in model.actors for o in a.ops if o.kind == "named_sync"]
    assert syncs and {o.threads for o in syncs} == {num_threads(NamedBarrier.TMEM_ALLOC, cfg.warp_roles())}
    prog = programs["mma"]
    (sync,) = [n for n in prog if getattr(n, "op", None) == "named_sync"]
    (leader,) = [n for n in prog if isinstance(n, Branch)]
    assert leader.cond == "is_leader_cta" and prog.index(sync) < prog.index(leader)
    if cfg.cta_group == 2:
        rest = [n for n in prog if n is not sync and n is not leader]
        moved = {**programs, "mma": rest + [Branch(leader.cond, [sync] + leader.then, leader.orelse)]}
        rep = ProtocolModel(cfg, moved, bindings).run_random(0)
        assert "deadlock" in {f.kind for f in rep.findings}
        assert "(384 of 416 threads arrived)" in rep.findings[0].message


def test_cli_checks_the_kernel_protocol(recorded):
    """``python -m pipelines.check`` (default --source kernel) runs the model on the kernel's
    recording; the same config with an injected fault is rejected."""
    from pipelines import check

    cfg, _ = recorded
    fixed = {k: getattr(cfg, k) for k in check.GRID}
    clean = check.run(fixed, None, "kernel", n_blocks=(1, 3), work_tiles=(2,), exhaustive_states=0)
    assert clean["ok"] and clean["source"] == "kernel" and clean["configs_checked"] == 1
    bad = check.run(fixed, ("skip-wait", "o_acc"), "kernel", n_blocks=(2,), work_tiles=(1,),
                    exhaustive_states=0)
    assert not bad["ok"] and "race" in bad["findings_by_kind"]
