"""The SM90 backward's tuning table (``BWD_TUNING`` in fa_sm100/hopper/bwd_tuning.py).

Contracts checked here: docs/tuning.md shows the table as it is; every row is data that a
reader can trust (a known field set, a justification, no dead row); and the lookup keeps its
promise that the caller's fields win. What the defaults are, problem by problem, is the golden
snapshot's job (tests/test_bwd_defaults_golden.py).
"""

import dataclasses
import itertools

import pytest

from fa_sm100.hopper.bwd_config import BwdConfig
from fa_sm100.hopper.bwd_defaults import select_bwd_config
from fa_sm100.hopper.bwd_tuning import BWD_TUNING, BwdProblem, lookup

INIT_FIELDS = {f.name for f in dataclasses.fields(BwdConfig) if f.init}


def _problem(head_dim=128, causal=False, window=(None, None), qhead_per_kvhead=1,
             deterministic=False, softcap=False, seqlen=None, **asked) -> BwdProblem:
    return BwdProblem(head_dim=head_dim, head_dim_v=128 if head_dim == 192 else head_dim,
                      dtype="bfloat16", causal=causal, window_left=window[0],
                      window_right=window[1], qhead_per_kvhead=qhead_per_kvhead,
                      deterministic=deterministic, seqlen_q=seqlen, seqlen_k=seqlen,
                      softcap=softcap, varlen=False, asked=tuple(asked.items()))


# problems over which every row must apply at least once (no row is dead data)
PROBLEMS = [
    _problem(hd, causal, window, qh, det, cap, s, **extra)
    for hd, causal, window, qh, det, cap, s, extra in itertools.product(
        (64, 96, 128, 192, 256), (False, True), ((None, None), (512, 0)), (1, 4, 8),
        (False, True), (False, True), (None, 1024, 8192, 16384),
        ({}, {"tile_n": 64}, {"lse_early": True}, {"early_dq_post": True}))
]


def test_every_row_applies_somewhere():
    """Each row's predicate holds, with a field left to set, for some problem of a small grid
    (a row that never applies would be a claim the code does not make)."""
    applied = []
    for problem in PROBLEMS:
        lookup(problem, applied=applied)
    assert {row.name for row in BWD_TUNING} - set(applied) == set()


@pytest.mark.parametrize("field,value", [
    ("tile_m", 64), ("sdp_swap_ab", False), ("early_dv", False), ("dv_before_barrier", False),
    ("stagger_m", True), ("dq_first_store", False), ("qdo_multicast", False),
    ("persistent_ctas", 0), ("pre_ctas", 0), ("stats_shuffle", True), ("lse_early", True),
    ("dp_wait_after", 10), ("regs_mma", 232), ("longest_first", False),
])
def test_the_caller_fields_win(field, value):
    """An override reaches the config unchanged wherever the config is valid: no row rewrites
    a field the caller set."""
    kept = 0
    for hd, causal, s in itertools.product((64, 96, 128, 192, 256), (False, True),
                                           (1024, 8192)):
        try:
            cfg = select_bwd_config(head_dim=hd, causal=causal, seqlen_q=s, seqlen_k=s,
                                    **{field: value})
        except ValueError:
            continue
        assert getattr(cfg, field) == value, (hd, causal, s)
        kept += 1
    assert kept > 0
