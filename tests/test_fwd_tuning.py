"""The SM90 forward's tuning table (``FWD_TUNING`` in fa_sm100/hopper/fwd_tuning.py).

Contracts checked here: docs/tuning.md shows the table as it is; every row is data that a
reader can trust (a known field set, a justification, no dead row); the lookup keeps its
promise that the caller's fields win; the constants the table repeats from config.py agree
with it; and the draft the predicates read answers as the config would. What the defaults
are, problem by problem, is the golden snapshot's job (tests/test_fwd_defaults_golden.py).
"""

import dataclasses
import itertools

import pytest

from fa_sm100.hopper import bwd_tuning, config, fwd_tuning
from fa_sm100.hopper.config import Sm90FwdConfig, select_sm90_fwd_config
from fa_sm100.hopper.fwd_tuning import FWD_TUNING, FwdProblem, lookup
from fa_sm100.tuning_table import draft

INIT_FIELDS = {f.name for f in dataclasses.fields(Sm90FwdConfig) if f.init}


@pytest.mark.parametrize("table", [fwd_tuning, bwd_tuning], ids=["forward", "backward"])
def test_docs_page_shows_the_current_table(table):
    """docs/tuning.md's block of each table equals the table rendered from its rows (the
    ``--check`` of ``python -m fa_sm100.hopper.{fwd,bwd}_tuning``)."""
    text = table.DOC.read_text()
    assert table.render_doc(text) == text, (
        f"docs/tuning.md is out of date: python -m {table.__name__} --write")
    assert table.main(["--check"]) == 0


def _problem(head_dim=128, causal=False, local=False, seqlen=None, batch_heads=None,
             **asked) -> FwdProblem:
    return FwdProblem(head_dim=head_dim, head_dim_v=128 if head_dim == 192 else head_dim,
                      dtype="bfloat16", causal=causal, local=local, softcap=False, varlen=False,
                      write_lse=True, seqlen_q=seqlen, seqlen_k=seqlen, batch_heads=batch_heads,
                      asked=tuple(asked.items()))


@pytest.mark.parametrize("table", ["forward", "backward"])
def test_rows_are_well_formed(table):
    """Unique names; each row sets switch fields of its config (never a problem field), names
    only its own fields in ``unless_asked``, is justified by a measurement or a rule, and has
    text that fits one markdown table cell."""
    from test_bwd_tuning import INIT_FIELDS as BWD_INIT_FIELDS
    from test_bwd_tuning import _problem as bwd_problem

    rows, init_fields, problem = {
        "forward": (FWD_TUNING, INIT_FIELDS, _problem()),
        "backward": (bwd_tuning.BWD_TUNING, BWD_INIT_FIELDS, bwd_problem())}[table]
    problem_fields = set(problem.config_fields())
    names = [row.name for row in rows]
    assert len(names) == len(set(names))
    for row in rows:
        assert row.sets and set(row.sets) <= init_fields - problem_fields, row.name
        assert set(row.unless_asked) <= set(row.sets), row.name
        assert row.measured or row.rule, row.name
        for text in (row.name, row.where, row.measured, row.rule):
            assert "|" not in text and "\n" not in text, row.name


def test_constants_agree_with_the_config():
    """The table repeats two of config.py's values (it sits below config.py): the cluster size
    of persistent multicast and the SMEM budget validate() holds a config to."""
    assert fwd_tuning.PERSISTENT_MULTICAST_CLUSTER == config.KV_CLUSTER
    assert fwd_tuning.SM90_SMEM_BUDGET == config.SM90_SMEM_BUDGET


# problems over which every row must apply at least once (no row is dead data)
PROBLEMS = [
    _problem(hd, causal, local, s, bh, **extra)
    for hd, causal, local, s, bh, extra in itertools.product(
        (64, 96, 128, 192, 256), (False, True), (False, True), (None, 640, 1024, 8192, 8320),
        (None, 16), ({}, {"kv_stage": 3}))
]


def test_every_row_applies_somewhere():
    """Each row's predicate holds, with a field left to set, for some problem of a small grid
    (a row that never applies would be a claim the code does not make)."""
    applied = []
    for problem in PROBLEMS:
        lookup(problem, Sm90FwdConfig, applied=applied)
    assert {row.name for row in FWD_TUNING} - set(applied) == set()


@pytest.mark.parametrize("field,value", [
    ("num_consumer_wg", 2), ("m_block", 128), ("n_block", 64), ("pingpong", True),
    ("rescale_o_before_pv", False), ("rescale_threshold", 0.0), ("multicast_odd_m", True),
    ("skip_empty_wg", True), ("kv_multicast", False), ("persistent", False),
    ("dynamic_schedule", False), ("o_in_q_buffer", True), ("wg_epilogue", False), ("q_stage", 1),
    ("regs_consumer", 232),
])
def test_the_caller_fields_win(field, value):
    """An override reaches the config unchanged wherever the config is valid: no row rewrites
    a field the caller set."""
    kept = 0
    for hd, causal, s in itertools.product((64, 96, 128, 192, 256), (False, True),
                                           (1024, 8192)):
        try:
            cfg = select_sm90_fwd_config(head_dim=hd, causal=causal, seqlen_q=s, seqlen_k=s,
                                         batch_heads=16, **{field: value})
        except ValueError:
            continue
        assert getattr(cfg, field) == value, (hd, causal, s)
        kept += 1
    assert kept > 0


@pytest.mark.parametrize("problem", [_problem(64, seqlen=1000), _problem(256, causal=True),
                                     _problem(128, seqlen=8192, batch_heads=7)])
def test_a_draft_reads_as_its_config(problem):
    """The predicates read a draft of the config: its fields (given or defaults), properties
    and methods answer as the built config's, and ``replace`` gives a draft."""
    cfg = lookup(problem, Sm90FwdConfig)
    fields = dataclasses.asdict(cfg)
    partial = {name: value for name, value in fields.items()
               if value != getattr(Sm90FwdConfig, name)}
    seen = draft(Sm90FwdConfig, partial)
    assert seen.build() == cfg
    for name in fields:
        assert getattr(seen, name) == getattr(cfg, name), name
    assert (seen.own_o_buffer, seen.cluster, seen.smem_bytes(), seen.num_m_blocks(1000),
            seen.has_empty_wg(1000), seen.multicast_fits(1000, 2)) == (
        cfg.own_o_buffer, cfg.cluster, cfg.smem_bytes(), cfg.num_m_blocks(1000),
        cfg.has_empty_wg(1000), cfg.multicast_fits(1000, 2))
    changed = seen.replace(persistent=True, o_in_q_buffer=False)
    assert changed.own_o_buffer and changed.smem_bytes() == cfg.replace(
        persistent=True, o_in_q_buffer=False).smem_bytes()
    assert seen.persistent == cfg.persistent  # the draft replaced is not changed
