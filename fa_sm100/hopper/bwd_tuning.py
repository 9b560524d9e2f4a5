"""The SM90 backward's tuning table: each default of ``select_bwd_config`` as one row (where it
applies -> what it sets -> the measurement or the rule behind it), and the lookup over it.

Contract of the lookup (``lookup``):

- It reads the problem (``BwdProblem``: shapes, mask, lengths when known, the fields the caller
  set) and nothing else: no tensor contents, no device query, no allocation.
- It starts from the problem's plain ``BwdConfig`` with ``START`` and the caller's fields in
  place, and applies the rows of ``BWD_TUNING`` in order. A row's predicate sees the config
  the rows before it left, so a later row overrides an earlier one.
- A row never changes a field the caller set; its other fields still apply. A row whose
  fields belong together names them in ``unless_asked``: any of them set by the caller skips
  the whole row. A row marked ``if_persistent_valid`` is kept only where the result passes the
  persistent CTAs' rules (``BwdConfig._validate_persistent``).
- Rows do not judge validity: ``BwdConfig.validate`` refuses what does not fit, and
  ``select_bwd_config`` calls it on the lookup's result.

A row is justified by a measurement (``measured``: paired timing over the alternative, on the
GPU it names), by a rule (``rule``: what compiles, fits or is correct), or both. docs/tuning.md
shows the table; regenerate it with ``python -m fa_sm100.hopper.bwd_tuning --write``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import cached_property
from typing import Optional

from fa_sm100 import tuning_table
from fa_sm100.hopper.bwd_config import (TILE_M_80_HEAD_DIMS, TILE_M_128_HEAD_DIMS, TILE_M_ATOM,
                                        TILE_M_DQ_TRANSPOSED, TILE_M_SWAPPED_HDIM64,
                                        TILE_N_128_MAX_HEAD_DIM, TILE_N_TRANSPOSED, BwdConfig)
from fa_sm100.hopper.config import WGMMA_M
from fa_sm100.machines import HOPPER_SMS

# Where rows apply (each named by the row that reads it)
SHORT_CAUSAL_SEQLEN = 4096  # "short band": causal, both lengths up to this
CAUSAL_MULTICAST_MIN_SEQLEN = {64: 4096, 128: 4096}  # "Q/dO multicast": causal, both from this
STAGGER_HEAD_DIMS = (128,)  # "staggered sweeps"
BULK_DKV_MIN_GROUP = 2  # "GQA dK/dV by bulk reduces": every GQA / MQA group
EARLY_DQ_POST_HEAD_DIMS = (128,)  # "dQ postprocess in the tail"
PRE_CTAS_HEAD_DIMS = (128,)  # "preprocess beside the main kernel"
DEFAULT_PRE_CTAS = 32
# "persistent CTAs", "dynamic tiles": one CTA per SM of an H100 SXM / H200 (the interface
# lowers it on a smaller device: fit_persistent_ctas), both lengths up to PERSISTENT_MAX_SEQLEN
DEFAULT_PERSISTENT_CTAS = HOPPER_SMS
PERSISTENT_MAX_SEQLEN = 2048
PERSISTENT_HEAD_DIMS = (64, 128)
DYNAMIC_TILES_HEAD_DIMS = (64,)
# "own statistics": the three switches of Note [dP wait placement], set together
DP_WAIT_AFTER_80 = 26
OWN_STATS = dict(stats_shuffle=False, lse_early=True, dp_wait_after=DP_WAIT_AFTER_80)

# The lookup starts with early dV off (its field default is on, for configs built by hand): the
# row "early dV" turns it on after the rows that place dV elsewhere have read it.
START = dict(early_dv=False)
# Overrides for which None means "the default" (select_bwd_config's keyword API)
NONE_MEANS_DEFAULT = ("early_dv", "early_dq_post")


@dataclass(frozen=True)
class BwdProblem:
    """What the defaults may read: the problem, and the fields the caller set (``asked``, in
    call order; with varlen, the switches it fixes come first)."""

    head_dim: int
    head_dim_v: int
    dtype: str
    causal: bool
    window_left: Optional[int]
    window_right: Optional[int]
    qhead_per_kvhead: int
    deterministic: bool
    seqlen_q: Optional[int]  # None: unknown
    seqlen_k: Optional[int]
    softcap: bool
    varlen: bool
    asked: tuple = ()  # (field, value) pairs

    @cached_property
    def overrides(self) -> dict:
        return dict(self.asked)

    @property
    def windowed(self) -> bool:
        return self.window_left is not None or self.window_right is not None

    def both_lengths_at_most(self, n: int) -> bool:
        return (self.seqlen_q is not None and self.seqlen_k is not None
                and max(self.seqlen_q, self.seqlen_k) <= n)

    def both_lengths_at_least(self, n: int) -> bool:
        return (self.seqlen_q is not None and self.seqlen_k is not None
                and min(self.seqlen_q, self.seqlen_k) >= n)

    def config_fields(self) -> dict:
        """The ``BwdConfig`` fields the problem fixes (the switches keep their field defaults)."""
        return dict(head_dim=self.head_dim, head_dim_v=self.head_dim_v, dtype=self.dtype,
                    causal=self.causal, window_left=self.window_left,
                    window_right=self.window_right, qhead_per_kvhead=self.qhead_per_kvhead,
                    deterministic=self.deterministic, softcap=self.softcap, varlen=self.varlen)


@dataclass(frozen=True)
class TuningRow(tuning_table.TuningRow):
    """A backward row (``fa_sm100.tuning_table.TuningRow``); ``if_persistent_valid`` keeps it
    only where the result passes the persistent CTAs' rules."""

    if_persistent_valid: bool = False

    def conditions(self) -> str:
        return ", kept where the persistent rules pass" if self.if_persistent_valid else ""


def short_band(p: BwdProblem) -> bool:
    """hdim 128 problems whose key blocks see few query blocks: any window (its size is a launch
    argument: one kernel per "has a window"), or causal with both lengths known and short."""
    return p.head_dim in TILE_M_80_HEAD_DIMS and (
        p.windowed or (p.causal and p.both_lengths_at_most(SHORT_CAUSAL_SEQLEN)))


def _causal_multicast_band(p: BwdProblem, c: BwdConfig) -> bool:
    """Causal problems multicast only where a cluster's skipped query blocks are few (Note
    [Q/dO multicast]): both lengths from CAUSAL_MULTICAST_MIN_SEQLEN, at the head dims in it."""
    if not p.causal:
        return True
    shortest = CAUSAL_MULTICAST_MIN_SEQLEN.get(p.head_dim)
    return shortest is not None and p.both_lengths_at_least(shortest)


def _multicast(p: BwdProblem, c: BwdConfig) -> bool:
    whole = p.seqlen_k is not None and c.pairs_key_blocks(p.seqlen_k)  # Note [Q/dO multicast]
    band = _causal_multicast_band(p, c)
    return whole and band and not (c.is_local or c.deterministic or c.dynamic_tiles)


def _pre_ctas_not_asked_on(p: BwdProblem) -> bool:
    return p.overrides.get("pre_ctas", 0) == 0


def _own_stats_fit(cfg: BwdConfig) -> bool:
    """Whether an 80-row config compiles without spills with its own statistics and the placed
    dP wait (Note [dP wait placement]; sm_90a): beside the preprocess (``pre_ctas`` > 0),
    non-causal, or causal MHA with Q/dO multicast. Elsewhere ptxas spills (persistent CTAs,
    causal without multicast or with GQA): those keep the shuffled loop."""
    return cfg.pre_ctas > 0 and (not cfg.causal
                                 or (cfg.qdo_multicast and cfg.qhead_per_kvhead == 1))


def _own_stats_asked(p: BwdProblem) -> bool:
    """Any of the three switches asked for, unless it is ``stats_shuffle`` asked on."""
    asked = p.overrides
    if "stats_shuffle" in asked:
        return not asked["stats_shuffle"]
    return any(name in asked for name in OWN_STATS)


def _dims(dims) -> str:
    return "head_dim " + " / ".join(str(d) for d in dims)


BWD_TUNING = (
    TuningRow(
        "dK/dV by columns", f"head_dim > {TILE_N_128_MAX_HEAD_DIM}",
        lambda p, c: p.head_dim > TILE_N_128_MAX_HEAD_DIM, dict(tile_n=WGMMA_M),
        rule="64 key rows of dK and dV per warpgroup fit the registers up to hdim 128; above, "
             "the CTA owns 64 keys split by head-dim columns (Note [dK/dV by columns])"),
    TuningRow(
        "(192, 128): dK/dV transposed", "head_dim 192",
        lambda p, c: p.head_dim == 192,
        dict(tile_n=TILE_N_TRANSPOSED, dkv_swap_ab=True),
        measured="launch-only, (192, 128), 16 heads, H200, over tile_n 64 by columns: 1.20x "
                 "(4k non-causal, batch 4), 1.23x (4k causal), 1.21x (16k non-causal, batch "
                 "1), 1.22x (16k causal, with 'bulk' dQ; 'red' 1.13x)",
        rule="96 keys fit the registers transposed (120 accumulator registers per thread), "
             "not as 64 key rows per warpgroup (Note [dK/dV transposed])",
        unless_asked=("tile_n", "dkv_swap_ab")),
    TuningRow(
        "swapped S/dP", _dims(TILE_M_128_HEAD_DIMS + TILE_M_80_HEAD_DIMS),
        lambda p, c: p.head_dim in TILE_M_128_HEAD_DIMS + TILE_M_80_HEAD_DIMS,
        dict(sdp_swap_ab=True),
        measured="hdim 64 with 128-row blocks: 317 -> 391 TFLOP/s (4k), 370 -> 437 (16k) "
                 "non-causal, 254 -> 319, 353 -> 414 causal; hdim 128: see 80-row blocks (H200). "
                 "hdim 96 unmeasured"),
    TuningRow(
        "columns: unswapped", "tile_n 64",
        lambda p, c: c.tile_n == WGMMA_M, dict(sdp_swap_ab=False),
        rule="dV reads both warpgroups' P, from SMEM after the dS barrier (validate)"),
    TuningRow(
        "hdim 256: dQ by reductions", "head_dim 256 with tile_n 64",
        lambda p, c: p.head_dim == 256 and c.tile_n == WGMMA_M, dict(dq_accum="red"),
        measured="'red' with 2-stage Q / dO over 'bulk' with 1-stage: 1.20x-1.41x in each of "
                 "the grid's 10 cells (H200)",
        rule="2-stage Q and dO (64 KiB each) and the 64 KiB SMEM dQ tile do not fit together"),
    TuningRow(
        "GQA dK/dV buffers", "every problem (read by GQA / MQA)",
        lambda p, c: True, dict(gqa_reduce="buffers"),
        measured="buffers over atomics, hdim 128 GQA 4:1: +1.6% / +4.2% at 16k, a tie at 4k; "
                 "launch-only, causal, the models grid's GQA/MQA cells: 4935 / 5122 us (32q/8kv "
                 "8k), 9925 / 10202 (64q/8kv 8k), 1685 / 1855 (32q/8kv 2k), 1369 / 1417 "
                 "(16q/4kv hdim 64 8k), 1469 / 1495 (MQA 32q/1kv 4k) (H200)",
        rule="bitwise reproducible, so deterministic GQA needs no other setting"),
    TuningRow(
        "GQA dK/dV by bulk reduces", "GQA / MQA, not deterministic, whole rows per warpgroup "
                                     "that fit",
        lambda p, c: (p.qhead_per_kvhead >= BULK_DKV_MIN_GROUP and not p.deterministic
                      and not c.dkv_split_cols and c.bulk_dkv_fits()),
        dict(gqa_reduce="bulk"),
        measured="bulk over buffers, launch-only, causal, paired (H200): 1.004x / 1.014x (32q/8kv "
                 "hdim 128, 8k / 2k), 1.018x (64q/8kv 8k), 1.008x (16q/4kv hdim 64 8k), 1.016x "
                 "((192, 128) 16q/4kv 4k), 1.033x (MQA 32q/1kv 4k)",
        rule="one float32 dK / dV per KV head instead of per query head: the workspace shrinks "
             "by the group (Note [dK/dV by bulk reduces])"),
    TuningRow(
        "128-row blocks", "swapped " + _dims(TILE_M_128_HEAD_DIMS),
        lambda p, c: c.sdp_swap_ab and p.head_dim in TILE_M_128_HEAD_DIMS,
        dict(tile_m=TILE_M_SWAPPED_HDIM64),
        measured="with the swap: see swapped S/dP",
        rule="beside the larger dK/dV accumulators of hdim 96 / 128 ptxas spills (Note "
             "[tile_m 128]; validate)"),
    TuningRow(
        "80-row blocks", "swapped " + _dims(TILE_M_80_HEAD_DIMS),
        lambda p, c: c.sdp_swap_ab and p.head_dim in TILE_M_80_HEAD_DIMS,
        dict(tile_m=TILE_M_DQ_TRANSPOSED),
        measured="with dQ transposed and dV before the dS barrier, over the 64-row defaults "
                 "before: +1.2% to +5.3% in 9 of the grid's 10 cells, -0.2% in one (H200)",
        rule="dQ^T takes the head dim as M (Note [dQ transposed])"),
    TuningRow(
        "short band", _dims(TILE_M_80_HEAD_DIMS) + " with a window, or causal with both "
                                                   f"lengths <= {SHORT_CAUSAL_SEQLEN}",
        lambda p, c: short_band(p), dict(tile_m=TILE_M_ATOM, stats_first=True),
        measured="64 over 80 rows, causal: +1.5% to +3.4% (1k), +0.3% to +4.3% (2k), +2.9% to "
                 "+3.5% (4k, with longest first, H100); windows: +4.7% to +7.3% for bands of "
                 "384-1024 keys, +1.0% to +2.5% for 2048-4096, -0.2% / -0.6% for wider or open "
                 "bands (H200). stats_first: +5.2% (2k), +1.6% (1k)",
        rule="80-row blocks straddle the diagonal or the band's edges (7.6% more MMA work at "
             "1k causal, 4.5% at 4k); one tile for every window keeps one kernel per window "
             "kind"),
    TuningRow(
        "softcap: 64-row blocks", "softcap",
        lambda p, c: p.softcap, dict(tile_m=TILE_M_ATOM),
        rule="80 / 128-row blocks form P^T in ways the capped scores do not follow (Note "
             "[softcap in the backward]; validate)"),
    TuningRow(
        "dV before the dS barrier", "blocks of 80 / 128 rows or a short band, early_dv off",
        lambda p, c: (c.tile_m > TILE_M_ATOM or short_band(p)) and not c.early_dv,
        dict(dv_before_barrier=True),
        measured="hdim 64 non-causal: 438 -> 472 TFLOP/s (4k), 477 -> 514 (16k); causal within "
                 "noise (H200)",
        rule="not with early_dv, which issues dV earlier still (validate)"),
    TuningRow(
        "early dV", "non-causal, no window, no softcap, tile_n 128 not transposed, dV not "
                    "before the barrier (hdim 96)",
        lambda p, c: not (p.causal or p.windowed or c.dv_before_barrier
                          or c.tile_n == WGMMA_M or p.softcap or c.dkv_swap_ab),
        dict(early_dv=True),
        measured="64-row blocks: non-causal +1% to +7% in 3 of 4 cells, causal -3% to -4% "
                 "(H200); (192, 128) transposed, non-causal, late over early: 1.00x (4k), "
                 "1.02x (16k)",
        rule="tile_n 64 refuses it (dV reads both halves of P); softcapped, t stays live "
             "beside P and ptxas spills (140 bytes at hdim 128)"),
    TuningRow(
        "staggered sweeps", f"non-causal {_dims(STAGGER_HEAD_DIMS)}, no window, not "
                            "deterministic",
        lambda p, c: (not (p.causal or p.windowed or p.deterministic)
                      and p.head_dim in STAGGER_HEAD_DIMS),
        dict(stagger_m=True),
        measured="with first dQ stores, over sweeps in step with the zero fill: +0.9% to +2.4% "
                 "(1k-4k; a third run -0.8% at 1k), +1.8% (8k), +1.2% (16k) (H100); hdim 64 "
                 "-1.9% to +1.2%",
        rule="every key block must visit every query block, and deterministic turns go in "
             "key-block order (Note [staggered query blocks]; validate)"),
    TuningRow(
        "one dQ handoff", "deterministic with a window",
        lambda p, c: p.deterministic and p.windowed, dict(dq_handoff_per_wg=False),
        measured="window (512, 0), 4k / 16k: +1.4% / +1.8% at hdim 64, +0.3% / +0.3% at hdim "
                 "128 over one per warpgroup; without a window one handoff costs causal -1.2% "
                 "to -3.8% (H200)"),
    TuningRow(
        "longest first", "causal without a window",
        lambda p, c: p.causal and not p.windowed, dict(longest_first=True),
        measured="hdim 128: +2.4% (1k) to +5.2% (4k), +0.4% (16k); hdim 64: -0.4% (1k), +0.8% "
                 "to +2.2% (2k-8k) (H100)",
        rule="key block n's work falls with n (Note [longest first])"),
    TuningRow(
        "dQ first stores", "causal, or staggered sweeps",
        lambda p, c: p.causal or c.stagger_m, dict(dq_first_store=True),
        measured="over the zero fill, causal: hdim 128 +4.5% (1k), +1.5% (2k), -1.0% (4k), "
                 "+2.0% (8k); hdim 64 +0.3% to +4.4% (1k-16k) (H100). Non-causal unstaggered "
                 "hdim 128: -5% to -9% (1k-4k)",
        rule="pays only where the key blocks reach a query block at different times (Note "
             "[dQ first store])"),
    TuningRow(
        "dQ postprocess in the tail", f"{_dims(EARLY_DQ_POST_HEAD_DIMS)} with 'bulk' dQ and pdl",
        lambda p, c: (p.head_dim in EARLY_DQ_POST_HEAD_DIMS and c.dq_accum == "bulk"
                      and c.pdl),
        dict(early_dq_post=True),
        measured="hdim 128: +0.6% to +1.4% (non-causal 1k-4k, causal 4k-16k) (H100); hdim 64 "
                 "causal 1k -2.2%. Others unmeasured",
        rule="needs 'bulk' dQ and pdl (validate)"),
    TuningRow(
        "preprocess beside the main kernel", f"{_dims(PRE_CTAS_HEAD_DIMS)}, 'bulk' dQ, "
                                             "stats_smem, no persistent CTAs",
        lambda p, c: (p.head_dim in PRE_CTAS_HEAD_DIMS and not c.persistent_ctas
                      and c.dq_accum == "bulk" and c.stats_smem),
        dict(pre_ctas=DEFAULT_PRE_CTAS),
        measured="32 CTAs: -0.6% to +5.0%, mean about +1.3% over 10 cells; 24 and 48 alike "
                 "(H100). hdim 64: mean +0.7%",
        rule="needs 'bulk' dQ and stats_smem (validate)"),
    TuningRow(
        "Q/dO multicast", "seqlen_k known with whole clusters of key blocks; no window, not "
                          "deterministic, no fetched tiles; causal only with both lengths at "
                          "least " + ", ".join(f"{n} at head_dim {d}" for d, n in
                                               CAUSAL_MULTICAST_MIN_SEQLEN.items()),
        _multicast, dict(qdo_multicast=True),
        measured="non-causal: hdim 128 +2.6% (2k) to +4.0% (16k), hdim 64 +2.1% to +6.5%; "
                 "causal from 4k: hdim 64 +1.6% to +4.2%, hdim 128 -0.2% to +2.8%; hdim 64 "
                 "causal 2k -0.1% (H100). Other head dims unmeasured",
        rule="a cluster must not span two (batch, head) pairs; windows and deterministic turns "
             "are refused (Note [Q/dO multicast]; validate)"),
    TuningRow(
        "persistent CTAs", f"{_dims(PERSISTENT_HEAD_DIMS)}, both lengths <= "
                           f"{PERSISTENT_MAX_SEQLEN}, pre_ctas not asked above 0, where the "
                           "persistent rules allow",
        lambda p, c: (_pre_ctas_not_asked_on(p) and p.both_lengths_at_most(PERSISTENT_MAX_SEQLEN)
                      and p.head_dim in PERSISTENT_HEAD_DIMS),
        dict(persistent_ctas=DEFAULT_PERSISTENT_CTAS, pre_ctas=0),
        measured="hdim 128 non-causal: +3.1% (1k), +0.8% to +1.5% (2k), -1.5% to +0.5% (4k); "
                 "hdim 64: +3.4% (1k), +1.1% (2k), 0.0% (4k) (H200)",
        rule="no mask or window, MHA, not deterministic, staging that fits (Note [persistent "
             "CTAs])",
        unless_asked=("persistent_ctas",), if_persistent_valid=True),
    TuningRow(
        "dynamic tiles", f"{_dims(DYNAMIC_TILES_HEAD_DIMS)}: causal with both lengths <= "
                         f"{PERSISTENT_MAX_SEQLEN}, or any window; pre_ctas not asked above 0, "
                         "where the persistent rules allow",
        lambda p, c: (_pre_ctas_not_asked_on(p) and p.head_dim in DYNAMIC_TILES_HEAD_DIMS
                      and ((p.both_lengths_at_most(PERSISTENT_MAX_SEQLEN) and p.causal)
                           or p.windowed)),
        dict(persistent_ctas=DEFAULT_PERSISTENT_CTAS, dynamic_tiles=True, pre_ctas=0),
        measured="over one CTA per tile, causal: +2.9% to +4.8% (1k), +2.1% to +2.9% (2k), "
                 "-1.0% (4k); windows, any length: +2.0% to +4.2% for bands up to 1024 keys, "
                 "-0.3% / -0.5% at 2048 (H200)",
        rule="up to hdim 96: at hdim 128 the fetched walk spills (Note [dynamic tiles])",
        unless_asked=("persistent_ctas", "dynamic_tiles"), if_persistent_valid=True),
    TuningRow(
        "registers of windowed fetched walks", "dynamic tiles with a window and the early dQ "
                                               "postprocess",
        lambda p, c: (bool(c.persistent_ctas) and c.dynamic_tiles and c.early_dq_post
                      and p.windowed),
        dict(regs_producer=32, regs_mma=232),
        rule="the producer warps walk fetched tiles with the window's run-time bounds and wait "
             "for the tail's dQ counts: at 24 registers ptxas spills one value (hdim 96, "
             "sm_90a compile contract), at 32 none; the MMA warpgroups fit in 232",
        unless_asked=("regs_producer", "regs_mma")),
    TuningRow(
        "own statistics", "80-row blocks that compile without spills that way "
                          "(_own_stats_fit)",
        lambda p, c: c.tile_m == TILE_M_DQ_TRANSPOSED and _own_stats_fit(c), OWN_STATS,
        measured="over the shuffled statistics: +1.4% to +1.9% in every 80-row cell from 4k "
                 "(non-causal 4k-16k, causal 8k-16k) (H200); 128-row blocks 2-7% slower",
        rule="elsewhere ptxas spills 8-76 bytes: persistent CTAs, causal without multicast, "
             "causal GQA (Note [dP wait placement])",
        unless_asked=tuple(OWN_STATS)),
    TuningRow(
        "own statistics, asked", "80-row blocks where any of the three is asked, unless "
                                 "stats_shuffle=True",
        lambda p, c: c.tile_m == TILE_M_DQ_TRANSPOSED and _own_stats_asked(p), OWN_STATS,
        rule="the three switches are one loop: asking for one asks for the others"),
)


def _kept(row: TuningRow, cfg: BwdConfig) -> bool:
    if row.if_persistent_valid:
        try:
            cfg._validate_persistent()
        except ValueError:
            return False
    return True


def lookup(problem: BwdProblem, rows=BWD_TUNING, applied: Optional[list] = None) -> BwdConfig:
    """The problem's config after ``rows`` (the module's contract), not validated. The names
    of the rows that applied are appended to ``applied``."""
    asked = problem.overrides
    return tuning_table.apply_rows(problem, rows, {**problem.config_fields(), **START, **asked},
                                   asked, make=lambda fields: BwdConfig(**fields), keep=_kept,
                                   applied=applied)


DOC_BLOCK = tuning_table.DocBlock(name="bwd_tuning", module="fa_sm100.hopper.bwd_tuning",
                                  table="BWD_TUNING", rows=BWD_TUNING,
                                  title="the SM90 backward's tuning table")
DOC = DOC_BLOCK.path
render_doc = DOC_BLOCK.render
main = DOC_BLOCK.main

if __name__ == "__main__":
    sys.exit(main())
