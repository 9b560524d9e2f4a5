"""The defaults of the Hopper (SM90) attention backward: ``select_bwd_config`` turns a problem
into one validated ``BwdConfig`` (bwd_config.py).

Contract: selection reads the problem's shape and the caller's overrides only (no tensor
contents, no device query, no allocation). It is a lookup over the tuning table
(``BWD_TUNING`` in bwd_tuning.py: where each default applies, what it sets, the measurement or
rule behind it; docs/tuning.md shows it) followed by ``BwdConfig.validate``, which raises
``ValueError`` naming the rule a config breaks. An override replaces any field, and the table
never changes a field the caller set.
"""

from __future__ import annotations

from typing import Optional

from fa_sm100.config import default_head_dim_v, normalize_dtype
from fa_sm100.hopper.bwd_config import VARLEN_FIXED, BwdConfig
from fa_sm100.hopper.bwd_tuning import (BWD_TUNING, CAUSAL_MULTICAST_MIN_SEQLEN,
                                        DEFAULT_PERSISTENT_CTAS, DEFAULT_PRE_CTAS,
                                        DP_WAIT_AFTER_80, DYNAMIC_TILES_HEAD_DIMS,
                                        EARLY_DQ_POST_HEAD_DIMS, NONE_MEANS_DEFAULT, OWN_STATS,
                                        PERSISTENT_HEAD_DIMS, PERSISTENT_MAX_SEQLEN,
                                        PRE_CTAS_HEAD_DIMS, SHORT_CAUSAL_SEQLEN,
                                        STAGGER_HEAD_DIMS, BwdProblem, lookup)

__all__ = [
    "select_bwd_config", "BWD_TUNING",
    # where the rows apply (defined in bwd_tuning.py, imported from here by callers and tests)
    "CAUSAL_MULTICAST_MIN_SEQLEN", "DEFAULT_PERSISTENT_CTAS", "DEFAULT_PRE_CTAS",
    "DP_WAIT_AFTER_80", "DYNAMIC_TILES_HEAD_DIMS", "EARLY_DQ_POST_HEAD_DIMS", "OWN_STATS",
    "PERSISTENT_HEAD_DIMS", "PERSISTENT_MAX_SEQLEN", "PRE_CTAS_HEAD_DIMS", "SHORT_CAUSAL_SEQLEN",
    "STAGGER_HEAD_DIMS",
]

# Note [Varlen backward]: the switches a varlen backward fixes, as if the caller had set them
# (an explicit override still wins, and validate() then refuses it); deterministic is the
# problem's own field
VARLEN_SWITCHES = {k: v for k, v in VARLEN_FIXED.items() if k != "deterministic"}


def select_bwd_config(head_dim: int = 128, dtype="bfloat16", causal: bool = False,
                      window_left: Optional[int] = None, window_right: Optional[int] = None,
                      qhead_per_kvhead: int = 1, deterministic: bool = False,
                      head_dim_v: Optional[int] = None, seqlen_q: Optional[int] = None,
                      seqlen_k: Optional[int] = None, softcap: bool = False,
                      varlen: bool = False, **overrides) -> BwdConfig:
    """The validated default config of a problem; ``overrides`` replace any field.

    ``head_dim_v`` defaults to ``fa_sm100.config.default_head_dim_v(head_dim)`` (128 for 192).
    ``seqlen_q`` / ``seqlen_k`` (optional; with varlen the longest sequences) let the rows that
    depend on lengths apply: short causal bands, Q/dO multicast, persistent CTAs. ``varlen``
    fixes the switches that read other tiles' lengths (``VARLEN_FIXED``). ``early_dv=None`` and
    ``early_dq_post=None`` mean the default."""
    asked = {**VARLEN_SWITCHES, **overrides} if varlen else overrides
    asked = {k: v for k, v in asked.items() if not (v is None and k in NONE_MEANS_DEFAULT)}
    problem = BwdProblem(
        head_dim=head_dim,
        head_dim_v=default_head_dim_v(head_dim) if head_dim_v is None else head_dim_v,
        dtype=normalize_dtype(dtype), causal=causal, window_left=window_left,
        window_right=window_right, qhead_per_kvhead=qhead_per_kvhead,
        deterministic=deterministic, seqlen_q=seqlen_q, seqlen_k=seqlen_k, softcap=softcap,
        varlen=varlen, asked=tuple(asked.items()))
    return lookup(problem, BWD_TUNING).validate()
