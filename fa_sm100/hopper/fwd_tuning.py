"""The SM90 forward's tuning table: each default of ``select_sm90_fwd_config`` as one row (where
it applies -> what it sets -> the measurement or the rule behind it), and the lookup over it.

Contract of the lookup (``lookup``; the shared rules are ``fa_sm100.tuning_table``'s):

- It reads the problem (``FwdProblem``: shapes, mask, lengths and (batch, head) pairs when
  known, the fields the caller set) and nothing else: no tensor contents, no device query, no
  allocation.
- It starts from the problem's plain ``Sm90FwdConfig`` (every switch at its field default)
  with the caller's fields in place, and applies the rows of ``FWD_TUNING`` in order. A row's
  predicate sees the config the rows before it left (as a ``Draft``: the config is built once,
  at the end), so a later row overrides an earlier one.
- A row never changes a field the caller set; its other fields still apply.
- Rows do not judge validity: ``Sm90FwdConfig.validate`` refuses what does not fit, and
  ``select_sm90_fwd_config`` calls it on the lookup's result.

This module sits below ``config.py`` (which builds the config from it), so it names the config
class only through ``lookup``'s argument; its predicates read the draft's fields, properties and
methods. The schedule rows read the tiles and stages the rows above them and the caller chose.

A row is justified by a measurement (``measured``: paired timing, bf16, 16k tokens per call,
over the alternative, on the GPU it names; CHANGELOG.md has the history) or by a rule (``rule``:
what compiles, fits or is correct), or both. docs/tuning.md shows the table; regenerate it with
``python -m fa_sm100.hopper.fwd_tuning --write``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import cached_property
from typing import Optional

from fa_sm100.softmax_math import RESCALE_THRESHOLD_16BIT
from fa_sm100.tuning_table import DocBlock, TuningRow, apply_rows, draft
from layouts.smem import SMEM_BUDGET

# Where rows apply (each named by the row that reads it)
THREE_WG_MAX_HEAD_DIM = 64  # "three consumer warpgroups"
SHORT_CAUSAL_SEQLEN_K = 1024  # "short causal: two consumer warpgroups"
PINGPONG_MAX_HEAD_DIM = 64  # "no ping-pong"
RESCALE_THRESHOLD_MIN_HEAD_DIM_V = 128  # "rescale threshold"
MULTICAST_MIN_SEQLEN_K = {64: 8192, 128: 8192, 256: 2048}  # "K/V multicast"
# "persistent CTAs, non-causal": the longest seqlen_k per head dim (None: any)
PERSISTENT_MAX_SEQLEN_K = {64: 8192, 96: None, 128: None, 192: 2048, 256: 1024}
TILE_BOUNDARY_MAX_SEQLEN_K = 8192  # "fast tile boundaries"
# "persistent multicast pairs": the one cluster size validate() allows under persistent
# multicast (config.KV_CLUSTER; Note [Persistent multicast])
PERSISTENT_MULTICAST_CLUSTER = 2
SM90_SMEM_BUDGET = SMEM_BUDGET["sm_90a"]  # what validate() holds a config's SMEM to


@dataclass(frozen=True)
class FwdProblem:
    """What the defaults may read: the problem, and the fields the caller set (``asked``, in
    call order)."""

    head_dim: int
    head_dim_v: int
    dtype: str
    causal: bool
    local: bool  # a window, or varlen (each sequence's band is a window)
    softcap: bool
    varlen: bool
    write_lse: bool
    seqlen_q: Optional[int]  # None: unknown (varlen: the longest)
    seqlen_k: Optional[int]
    batch_heads: Optional[int]  # (batch, head) pairs; None: unknown
    asked: tuple = ()  # (field, value) pairs

    @cached_property
    def overrides(self) -> dict:
        return dict(self.asked)

    def config_fields(self) -> dict:
        """The ``Sm90FwdConfig`` fields the problem fixes."""
        return dict(head_dim=self.head_dim, head_dim_v=self.head_dim_v, dtype=self.dtype,
                    causal=self.causal, local=self.local, softcap=self.softcap,
                    varlen=self.varlen, write_lse=self.write_lse)


def _persistent_smem(c, o_in_q_buffer: bool) -> bool:
    """Whether persistent CTAs with O in Q's buffer (or in its own) fit in SMEM with the tiles
    and stages chosen, one Q stage and the dynamic schedule's tile pipeline (whose barriers
    make it the larger of the two schedules)."""
    probe = c.replace(persistent=True, dynamic_schedule=True, o_in_q_buffer=o_in_q_buffer,
                      q_stage=1)
    return probe.smem_bytes() <= SM90_SMEM_BUDGET


def persistent_fits(c) -> bool:
    """Whether persistent CTAs fit in SMEM, with O in its own buffer or in Q's."""
    return _persistent_smem(c, o_in_q_buffer=False) or _persistent_smem(c, o_in_q_buffer=True)


def _multicast(p: FwdProblem, c) -> bool:
    """Non-causal, no window, from MULTICAST_MIN_SEQLEN_K keys, with a seqlen_q whose m blocks
    fit clusters (``multicast_fits``), unless the caller asked for persistent CTAs."""
    shortest = MULTICAST_MIN_SEQLEN_K.get(p.head_dim)
    return (not (p.causal or p.local) and shortest is not None and p.seqlen_k is not None
            and p.seqlen_k >= shortest and p.seqlen_q is not None
            and c.multicast_fits(p.seqlen_q, p.batch_heads)
            and not p.overrides.get("persistent"))


def _persistent_length(p: FwdProblem) -> bool:
    """Non-causal problems up to PERSISTENT_MAX_SEQLEN_K keys of their head dim."""
    if p.head_dim not in PERSISTENT_MAX_SEQLEN_K:
        return False
    longest = PERSISTENT_MAX_SEQLEN_K[p.head_dim]
    return longest is None or (p.seqlen_k is not None and p.seqlen_k <= longest)


def _tile_boundary(p: FwdProblem, c) -> bool:
    return (c.own_o_buffer and p.seqlen_k is not None and p.seqlen_k <= TILE_BOUNDARY_MAX_SEQLEN_K
            and c.replace(wg_epilogue=True, q_stage=2).smem_bytes() <= SM90_SMEM_BUDGET)


def _by_head_dim(limits: dict) -> str:
    return ", ".join(f"{'any' if n is None else n} at hdim {d}" for d, n in limits.items())


FWD_TUNING = (
    TuningRow(
        "three consumer warpgroups", f"head_dim <= {THREE_WG_MAX_HEAD_DIM}",
        lambda p, c: p.head_dim <= THREE_WG_MAX_HEAD_DIM, dict(num_consumer_wg=3),
        measured="two warpgroups with n_block 128 / 192 / 224: 0.861x / 0.886x / 0.893x of "
                 "three at hdim 64 non-causal 8k (H100); four: 0.909x / 0.897x at 8k / 16k "
                 "(H200)",
        rule="hdim 64's accumulators leave room for a third consumer's registers"),
    TuningRow(
        "short causal: two consumer warpgroups", f"three consumers, causal, seqlen_k <= "
                                                 f"{SHORT_CAUSAL_SEQLEN_K}",
        lambda p, c: (c.num_consumer_wg == 3 and p.causal and p.seqlen_k is not None
                      and p.seqlen_k <= SHORT_CAUSAL_SEQLEN_K),
        dict(num_consumer_wg=2),
        measured="hdim 64 causal 1k: 303 TFLOP/s with 128-row tiles, 274 with 192 (H200); 192 "
                 "rows with the empty-warpgroup skip or the dynamic schedule: -5.5%, 0.878x "
                 "(H100)",
        rule="192-row tiles waste most of the diagonal tile"),
    TuningRow(
        "192-row tiles", "three consumer warpgroups",
        lambda p, c: c.num_consumer_wg == 3,
        dict(m_block=192, regs_consumer=160, regs_producer=32),
        rule="each consumer warpgroup owns 64 rows; 128 x (32 + 3 x 160) registers fill the "
             "pool a CTA of 512 threads launches with (the field defaults are two consumers': "
             "128 rows, 240 / 24; validate)"),
    TuningRow(
        "112-key tiles", "128 < head_dim <= 192 ((192, 128))",
        lambda p, c: 128 < p.head_dim <= 192, dict(n_block=112),
        rule="the widest KV tile that the registers and SMEM allow (hopper.md)"),
    TuningRow(
        "80-key tiles", "head_dim > 192 (256)",
        lambda p, c: p.head_dim > 192, dict(n_block=80),
        measured="n_block 64 at hdim 256 causal: -1.4% / -1.9% (H100)",
        rule="O alone takes 128 registers per thread: the widest KV tile that fits beside it"),
    TuningRow(
        "no ping-pong", f"head_dim > {PINGPONG_MAX_HEAD_DIM}",
        lambda p, c: p.head_dim > PINGPONG_MAX_HEAD_DIM, dict(pingpong=False),
        measured="off over on at hdim 128: +0.7% to +2.2% non-causal (1k-16k), +2.4% causal "
                 "(4k, 16k); at hdim 64 off: 0.997x-1.000x (non-causal 8k / 16k), 0.998x "
                 "(causal 1k); at hdim 256 causal on: -0.7% / +0.2% (H100). hdim 96 unmeasured"),
    TuningRow(
        "O rescale before PV", "head_dim_v > 128",
        lambda p, c: p.head_dim_v > 128, dict(rescale_o_before_pv=True),
        measured="off at hdim 256 causal 4k / 8k: -3.4% / -4.1%; on at hdim 64 and 128: -0.7% "
                 "to -2.0% (H100)"),
    TuningRow(
        "rescale threshold", f"head_dim_v >= {RESCALE_THRESHOLD_MIN_HEAD_DIM_V}",
        lambda p, c: p.head_dim_v >= RESCALE_THRESHOLD_MIN_HEAD_DIM_V,
        dict(rescale_threshold=RESCALE_THRESHOLD_16BIT),
        measured="8 over 0: hdim 128 +0.3% to +2.9%, hdim 256 -0.6% (non-causal 1k) to +4.9% "
                 "(non-causal 16k); hdim 64 -1.3% to +1.3%, mean -0.1% (H100). (192, 128) "
                 "follows hdim 128 and hdim 96 hdim 64, unmeasured",
        rule="hdim 64's O rescale is 32 FMULs: the vote and branch cost about half of it "
             "(Note [Rescale threshold])"),
    TuningRow(
        "odd m blocks: off for an even count", "seqlen_q known, an even number of m blocks",
        lambda p, c: p.seqlen_q is not None and c.num_m_blocks(p.seqlen_q) % 2 == 0,
        dict(multicast_odd_m=False),
        measured="on, where the count is odd: hdim 64 non-causal 8k +0.4% (H200)",
        rule="an even count has no last m block to pair, and the branch made hdim 256's main "
             "loop 4 instructions longer per KV tile (Note [Odd m blocks])"),
    TuningRow(
        "empty warpgroups: off where none", "seqlen_q known, the last m block without an "
                                            "empty consumer warpgroup",
        lambda p, c: p.seqlen_q is not None and not c.has_empty_wg(p.seqlen_q),
        dict(skip_empty_wg=False),
        measured="on, where one is empty: hdim 64 non-causal +10.1% (1k) to +1.1% (8k), causal "
                 "+5.2% (2k), +1.6% (4k); the branch alone: -0.8% to -2.7% at hdim 128 "
                 "non-causal 4k / 16k (H100)",
        rule="off, the warpgroup whose rows all lie past seqlen_q runs the tile in full; on, "
             "it keeps only the pipeline and ping-pong protocol (Note [Empty warpgroups])"),
    TuningRow(
        "K/V multicast", "non-causal, no window, seqlen_k from "
                         + _by_head_dim(MULTICAST_MIN_SEQLEN_K) + ", seqlen_q known with m "
                         "blocks that fit clusters, persistent not asked on",
        _multicast, dict(kv_multicast=True),
        measured="as persistent pairs over one multicast tile per CTA: hdim 64 16k +2.6% / "
                 "+1.0%; hdim 128 16k +2.9% / +2.7%, 8k +2.6% over persistent + dynamic; hdim "
                 "256 +0.8% to +3.0% (2k-16k). Not at hdim 128 2k / 4k (-0.8% to +0.2%), hdim "
                 "64 4k (-1.5% / -0.3%), hdim 256 1k (+0.1%) (H100)",
        rule="the CTAs of a cluster load the same K/V tiles: no mask or window, whole clusters "
             "of m blocks (Notes [K/V multicast], [Odd m blocks]; multicast_fits, validate)"),
    TuningRow(
        "persistent multicast pairs", f"multicast in clusters of {PERSISTENT_MULTICAST_CLUSTER} "
                                      "where persistent CTAs fit in SMEM",
        lambda p, c: (c.kv_multicast and c.kv_cluster == PERSISTENT_MULTICAST_CLUSTER
                      and persistent_fits(c)),
        dict(persistent=True),
        measured="over one tile per CTA: hdim 128 non-causal 16k +2.9%, hdim 256 4k +3.0%, "
                 "hdim 64 16k +2.6% (H100)",
        rule="the persistent grid runs every CTA at once, which clusters of 4 may not (Note "
             "[Persistent multicast]; validate)"),
    TuningRow(
        "persistent CTAs: causal and windows", "causal, a window or varlen, no multicast, "
                                               "where persistent CTAs fit in SMEM",
        lambda p, c: (p.causal or p.local) and not c.kv_multicast and persistent_fits(c),
        dict(persistent=True),
        measured="with the dynamic schedule over one tile per CTA, causal: hdim 128 1.002x to "
                 "1.197x (1k-16k); hdim 64 1.028x to 1.074x (2k-16k); hdim 256 1.005x to "
                 "1.042x (1k-16k) (H100)",
        rule="band tiles differ in length at the sequence's start and end"),
    TuningRow(
        "persistent CTAs: non-causal", "non-causal, no multicast, seqlen_k up to "
                                       + _by_head_dim(PERSISTENT_MAX_SEQLEN_K)
                                       + ", where persistent CTAs fit in SMEM",
        lambda p, c: (not (p.causal or p.local or c.kv_multicast) and _persistent_length(p)
                      and persistent_fits(c)),
        dict(persistent=True),
        measured="with the dynamic schedule over one tile per CTA: hdim 128 1.002x to 1.033x "
                 "(2k-16k); hdim 64 1.001x to 1.016x (2k-4k), +1.5% / +2.1% / -0.9% (8k, three "
                 "runs, with fast tile boundaries), 0.988x-0.991x (16k); hdim 256 1.022x (1k), "
                 "0.994x-1.003x (2k-16k) (H100)",
        rule="persistent CTAs hide each tile's start and end behind its neighbours, for the "
             "persistent loop's descriptor arithmetic (493 instead of 457 instructions per KV "
             "step at hdim 128)"),
    TuningRow(
        "dynamic schedule", "persistent without multicast",
        lambda p, c: c.persistent and not c.kv_multicast, dict(dynamic_schedule=True),
        measured="hdim 128 causal 4k over one tile per CTA: 1.033x dynamic, 0.819x static; "
                 "every gridDim.x-th tile, causal: 0.79x-0.98x (H100)",
        rule="a multicast cluster's CTAs walk their tiles together: the static schedule (Note "
             "[Dynamic tile schedule]; validate)"),
    TuningRow(
        "O in Q's buffer", "persistent where O's own buffer does not fit (hdim 256)",
        lambda p, c: c.persistent and not _persistent_smem(c, o_in_q_buffer=False),
        dict(o_in_q_buffer=True),
        measured="where O's own buffer fits, O in Q's: 0.938x (hdim 128 causal 1k), 0.994x "
                 "(4k) (H100)",
        rule="Note [O in Q's buffer]: the next tile's Q waits for O's store"),
    TuningRow(
        "fast tile boundaries", "persistent with O's own buffer, seqlen_k <= "
                                f"{TILE_BOUNDARY_MAX_SEQLEN_K}, where two Q stages fit",
        _tile_boundary, dict(wg_epilogue=True, q_stage=2),
        measured="both over neither: hdim 64 causal +6.2% (1k) to +0.1% (8k), -0.5% (16k), "
                 "non-causal +1.0% to +3.2% (1k-4k); hdim 128 causal +4.3% (1k) to +0.3% "
                 "(16k), non-causal +1.6% to +4.0% (1k-4k); alone each gained less (H100). "
                 "hdim 96 unmeasured",
        rule="Notes [Warpgroup epilogues], [Two Q stages]; (192, 128) has no room for two Q "
             "stages"),
)


def lookup(problem: FwdProblem, config_cls: type, rows=FWD_TUNING,
           applied: Optional[list] = None):
    """The problem's ``config_cls`` (``Sm90FwdConfig``) after ``rows`` (the module's contract),
    built once and not validated. The names of the rows that applied are appended to
    ``applied``."""
    asked = problem.overrides
    chosen = apply_rows(problem, rows, {**problem.config_fields(), **asked}, asked,
                        make=lambda fields: draft(config_cls, fields), applied=applied)
    return chosen.build()


DOC_BLOCK = DocBlock(name="fwd_tuning", module="fa_sm100.hopper.fwd_tuning", table="FWD_TUNING",
                     rows=FWD_TUNING, title="the SM90 forward's tuning table")
DOC = DOC_BLOCK.path
render_doc = DOC_BLOCK.render
main = DOC_BLOCK.main

if __name__ == "__main__":
    sys.exit(main())
