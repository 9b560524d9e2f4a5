"""The defaults of the Hopper (SM90) attention backward: ``select_bwd_config`` picks a
``BwdConfig`` (bwd_config.py) for a problem, switch by switch where paired timing measured
it faster, and the constants here say where each default applies and what it measured.
"""

from __future__ import annotations

from typing import Optional

from fa_sm100.config import default_head_dim_v, normalize_dtype
from fa_sm100.hopper.bwd_config import (TILE_M_80_HEAD_DIMS, TILE_M_128_HEAD_DIMS, TILE_M_ATOM,
                                        TILE_M_DQ_TRANSPOSED, TILE_M_SWAPPED_HDIM64,
                                        TILE_N_128_MAX_HEAD_DIM, VARLEN_FIXED, BwdConfig)
from fa_sm100.hopper.config import WGMMA_M
from fa_sm100.machines import HOPPER_SMS

# Causal problems up to this sequence length take 64-row blocks at hdim 128 instead of 80
# (``select_bwd_config``): 80-row blocks straddle the diagonal of 128-key blocks, which costs
# 7.6% more MMA work at 1k, 5.7% at 2k and 4.5% at 4k (0.6% at 16k), more than their faster
# loop gains. 4k (H100, paired, with the CTAs longest first: +2.9% to +3.5%;
# 8k and 16k within +-1.7%).
SHORT_CAUSAL_SEQLEN = 4096
# Windowed problems take the same 64-row tile at hdim 128 as short causal ones, whatever
# their window: each key block sees a band of query blocks, whose edges 80-row blocks
# straddle, and one choice for every window keeps one kernel per "has a window" (the bounds
# are launch arguments, fa_sm100.bands). H200, paired over the 80-row blocks
# (scripts/ab_bench.py --window, 12 rounds, 4k / 16k): (512, 0) +6.5% / +6.0%, (256, 256)
# +7.3% / +6.0%, (0, 384) +6.8% / +7.0%, (1024, 0) +4.8% / +4.7%, causal (512, None) 4k
# +5.8%; at 16k (2048, 0) +2.5%, (4096, 0) +1.0%, (4096, 4096) +1.6%; the cost where bands
# are wide: (8192, 0) -0.2%, a band open on one side, (512, None) non-causal, -0.6%.
# Causal problems multicast Q/dO by default (Note [Q/dO multicast]) from this many queries and
# keys on, at these head dims: H100, paired over the CTAs one by one, hdim 64 +2.5% / +1.6%
# (4k), +3.2% / +3.3% (8k), +4.3% / +4.2% (16k), 2k -0.1%; hdim 128 +0.3% / +1.4% / +1.2%
# (4k), -0.2% / +2.3% (8k), +2.7% / +2.8% (16k).
CAUSAL_MULTICAST_MIN_SEQLEN = {64: 4096, 128: 4096}
# Non-causal problems without a window stagger the key blocks' sweeps over the query blocks,
# with first dQ stores, at these head dims (Note [staggered query blocks]): H100, paired over
# the zero fill and the sweep in step, hdim 128 +0.9% / +1.1% (1k), +2.4% / +1.6% (2k),
# +1.5% / +2.0% (4k), +1.8% (8k), +1.2% (16k), a third run -0.8% (1k) / -0.4% (2k); hdim 64
# -1.9% (1k), -0.6% (16k), then +1.0% to +1.2% (1k-4k); staggered without first stores -2.5%
# to +1.0% at hdim 64, 128, 256.
STAGGER_HEAD_DIMS = (128,)
# Note [dQ postprocess in the tail] (early_dq_post) by default at these head dims. H100,
# paired over off (scripts/ab_bench.py, 10-12 rounds): hdim 128 non-causal +0.6%
# (1k), +1.4% (2k), +0.6% (4k), causal +0.7% (4k), +1.0% (16k); the time per call in the
# CUDA profiler's timeline (8 calls) 3.5% (1k), 2.7% (2k), 1.5% (causal 4k) shorter. hdim 64:
# +0.5% (1k), +0.4% (4k) non-causal, -2.2% / 0.0% causal (1k / 4k; in the timeline 2.7%
# longer at causal 1k: the main kernel's last wave lost more to the concurrent postprocess
# than the postprocess gained). Others unmeasured.
EARLY_DQ_POST_HEAD_DIMS = (128,)
# Note [Preprocess beside the main kernel] (pre_ctas) by default at these head dims, with this
# many CTAs. H100, paired over off (scripts/ab_bench.py, 6 and 8 rounds): hdim 128
# with 32 CTAs non-causal +3.2% / +0.3% (1k), +1.9% / +1.3% (2k), +2.4% / +1.9% (4k), +2.3%
# (8k), -0.6% (16k); causal +1.3% / +2.2% (1k), +1.1% / -0.1% (2k), +1.2% / +0.5% (4k),
# +0.1% (8k), +5.0% (16k); 24 and 48 CTAs alike (means +1.4%, +1.1%). hdim 64 with 32: -0.6%
# to +2.0% (1k-4k, mean +0.7%): off there.
PRE_CTAS_HEAD_DIMS = (128,)
DEFAULT_PRE_CTAS = 32
# Note [persistent CTAs] (bwd_tiles.py): one CTA per SM of an H100 SXM / H200 (the interface
# lowers it on a smaller device), taken by default up to this sequence length at these head
# dims, where paired timing on an H200 measured it faster (select_bwd_config's docstring)
DEFAULT_PERSISTENT_CTAS = HOPPER_SMS
PERSISTENT_MAX_SEQLEN = 2048
PERSISTENT_HEAD_DIMS = (64, 128)
# Note [dynamic tiles] (bwd_tiles.py): taken by default for causal problems (no window) up to
# PERSISTENT_MAX_SEQLEN at these head dims (select_bwd_config's docstring), and for every
# windowed problem at those head dims, at any length (one kernel per "has a window"): each
# tile is a sweep of a band of query blocks, as a short causal one. H200, paired over one CTA
# per tile (scripts/ab_bench.py --window, 10-12 rounds, 4k / 16k): (256, 256) +4.2% / +3.2%,
# (512, 0) +4.1% / +4.1%, (1024, 0) +2.1% / +2.0%; the cost where bands are wide: (2048, 0)
# -0.3% / -0.5%.
DYNAMIC_TILES_HEAD_DIMS = (64,)
# Note [dP wait placement] (bwd_kernel.py): blocks of 80 rows (hdim 128) load their own
# statistics (``stats_shuffle=False``), LSE2 while S^T runs (``lse_early``), and issue this
# many exp2s before the dP^T wait may come (``dp_wait_after``). H200, paired over
# the shuffled statistics: +1.4% to +1.9% in every cell with 80-row blocks from 4k on
# (non-causal 4k-16k, causal 8k-16k). Only where they compile without spills
# (``_own_stats_fit``: beside the preprocess, non-causal or causal MHA with multicast):
# elsewhere ptxas spills 8-76 bytes and the shuffled loop stays, among them the persistent
# CTAs of non-causal 1k / 2k (whose +0.8% / +1.7% were measured with a spilling kernel).
# 128-row blocks (hdim 64) measured 2-7% slower that way: shuffled. ``OWN_STATS``: the three
# switches so set.
DP_WAIT_AFTER_80 = 26
OWN_STATS = dict(stats_shuffle=False, lse_early=True, dp_wait_after=DP_WAIT_AFTER_80)


def select_bwd_config(head_dim: int = 128, dtype="bfloat16", causal: bool = False,
                      window_left: Optional[int] = None, window_right: Optional[int] = None,
                      qhead_per_kvhead: int = 1, deterministic: bool = False,
                      head_dim_v: Optional[int] = None, seqlen_q: Optional[int] = None,
                      seqlen_k: Optional[int] = None, softcap: bool = False,
                      varlen: bool = False, **overrides) -> BwdConfig:
    """Defaults for a problem; ``overrides`` replace any field. ``head_dim_v`` defaults to
    ``fa_sm100.config.default_head_dim_v(head_dim)`` (128 for 192). ``seqlen_q`` /
    ``seqlen_k`` (optional) pick the block height of short causal problems (a window's band
    needs none).

    Measured on an H200 (docs/hopper_backward.md, bf16, 16k tokens, TFLOP/s):
    - GQA/MQA dK/dV through per-query-head buffers ("buffers") is as fast as or faster than
      atomics and deterministic, so it is the default.
    - early dV helps non-causal problems and costs a few percent on causal ones.
    - hdim 64: swapped S/dP with 128 query rows per iteration, 317 -> 391 (4k) and 370 -> 437
      (16k) non-causal, 254 -> 319 and 353 -> 414 causal.
    - hdim 128: swapped S/dP with 80 query rows and dQ transposed, dV before the dS barrier:
      against the previous defaults (64 rows; swapped only for causal/windowed problems),
      +1.2% to +5.3% in 9 of the 10 cells of the grid, -0.2% in one (16k: 560 -> 580
      non-causal, 538 -> 567 causal). hdim 96 is unmeasured: unswapped.
    - hdim 128 windowed, any window: the same tile and stats as short causal problems (next
      two items); H200, paired over 80-row blocks: +4.7% to +7.3% for bands of 384-1024
      keys, +1.0% to +2.5% for 2048-4096, -0.2% / -0.6% where bands are wider or open.
    - hdim 128 causal up to ``SHORT_CAUSAL_SEQLEN``: 64-row blocks, dV before the dS barrier
      (FA4's causal tile): +1.5% to +3.4% at 1k in four runs, +0.3% to +4.3% at 2k in three; at
      4k -2% to +0.7% before the CTAs started longest first, +2.9% to +3.5% (three paired runs,
      H100) after; at 8k +0.1% to +1.7% / -0.1%, at 16k +1.4% / -0.1% (not taken).
    - short causal hdim 128: LSE2/Delta read before the S/dP GEMMs (``stats_first``), paired
      timing +5.2% at 2k, +1.6% at 1k.
    - hdim 128 with 80-row blocks: each thread loads its own LSE2/Delta, LSE2 while S^T runs,
      and the dP^T wait after 26 exp2s (``stats_shuffle=False``, ``lse_early``,
      ``dp_wait_after``, Note [dP wait placement]); H200, paired over the shuffled
      statistics: non-causal +1.4% (4k) to +1.7% (16k), causal +1.6% (8k), +1.9% (16k). Only
      where they compile without spills (``_own_stats_fit``); elsewhere (persistent CTAs,
      causal without multicast or with GQA) the shuffled loop stays.
    - swapped with dV before the dS barrier: dV issued before the dS fence
      (``dv_before_fence``), paired timing +1.3% to +3.3% at hdim 128, +0.5% to +1.4% at 64.
    - blocks of more than 64 rows (hdim 64: 128, hdim 128: 80): dV issued before the dS
      barrier instead of before the dS math; hdim 64 non-causal 438 -> 472 (4k) and
      477 -> 514 (16k), causal within noise (399 -> 405, 493 -> 482).
    - causal without a window: the last two waves of CTAs start longest first
      (``longest_first``); H100, paired: hdim 128 +2.4% (1k), +3.0% (2k), +5.2% (4k), +3.6%
      (8k), +0.4% (16k); hdim 64 -0.4% (1k), +0.8% to +2.2% (2k-8k), +0.4% (16k).
    - non-causal without a window, not deterministic, with an even number of key blocks
      (``seqlen_k`` given): CTA pairs multicast Q and dO (``qdo_multicast``); H100, paired:
      hdim 128 +2.6% (2k), +2.4% (8k), +4.0% (16k); hdim 64 +2.1% (2k), +3.2% (8k), +6.5%
      (16k). The other head dims follow unmeasured. Causal (both lengths from
      ``CAUSAL_MULTICAST_MIN_SEQLEN``, hdim 64 and 128 only): hdim 64 +1.6% to +2.5% (4k),
      +3.3% (8k), +4.2% (16k); hdim 128 +0.3% to +1.4% (4k), +1.0% (8k), +2.8% (16k).
    - causal, "bulk" dQ: the first CTA at each query block stores its dQ tile and the
      preprocess writes no zeros (``dq_first_store``, Note [dQ first store]); H100, paired
      over the zero fill: hdim 128 +4.5% (1k), +1.5% (2k), -1.0% (4k, wide rounds), +2.0%
      (8k); hdim 64 +4.4% (1k), +2.2% (2k), +2.1% (4k), +2.7% (8k), +0.3% (16k). Non-causal
      hdim 128 1k-4k: -5% to -9% (the key blocks of a pair reach every query block together
      and wait for each other's stores), so off there unless the sweeps are staggered.
    - non-causal hdim 128 without a window, not deterministic: each cluster of key blocks
      starts its sweep over the query blocks at its own offset (``stagger_m``, Note
      [staggered query blocks]), with first dQ stores; H100, paired over the defaults before:
      +0.9% to +1.1% (1k), +1.6% to +2.4% (2k), +1.5% to +2.0% (4k), +1.8% (8k), +1.2% (16k).
    - head dims above 128: 64 key rows per CTA split by head-dim columns (Note [dK/dV by
      columns]). hdim 256: dQ by vector reductions with 2-stage Q/dO, 260-422, against the
      SMEM dQ tile with 1-stage Q/dO, 216-313 (``_wide_head_defaults``). (192, 128) is
      unmeasured: "bulk", 2-stage.
    - non-causal hdim 64 and 128 up to ``PERSISTENT_MAX_SEQLEN``, where its rules allow:
      ``DEFAULT_PERSISTENT_CTAS`` persistent CTAs (Note [persistent CTAs]) with the
      preprocess ahead of the main kernel (``pre_ctas=0``); H200, paired over the defaults
      before, 8-12 rounds: hdim 128 +3.1% / +3.1% (1k), +0.8% / +1.5% (2k), +0.5% / -1.5%
      (4k), -0.6% (8k), -1.0% / +1.1% (16k); hdim 64 +3.4% (1k), +1.1% (2k), 0.0% (4k).
    - causal hdim 64 without a window up to ``PERSISTENT_MAX_SEQLEN``: persistent CTAs that
      fetch their tiles (``dynamic_tiles``, Note [dynamic tiles]); H200, paired over one CTA
      per tile, 10-20 rounds: +2.9% to +4.8% (1k), +2.1% to +2.9% (2k); -1.0% at 4k. (hdim
      128 causal measured -0.5% (1k), -2.5% (2k) with a kernel that spilled: refused now.)
      Also windowed hdim 64, any window, at any length: +2.0% to +4.2% for bands up to 1024
      keys, -0.3% / -0.5% at 2048.
    """
    head_dim_v = default_head_dim_v(head_dim) if head_dim_v is None else head_dim_v
    windowed = window_left is not None or window_right is not None
    if varlen:  # Note [Varlen backward]: one CTA per tile (seqlen_q / _k: the longest)
        overrides = {**VARLEN_FIXED, "deterministic": deterministic, **overrides,
                     "varlen": True}  # validate() refuses a deterministic one
    # tile_n 64 (the wide head dims' default, or asked for): Note [dK/dV by columns]
    default_tile_n = 2 * WGMMA_M if head_dim <= TILE_N_128_MAX_HEAD_DIM else WGMMA_M
    wide = overrides.get("tile_n", default_tile_n) == WGMMA_M
    if wide:
        for name, value in _wide_head_defaults(head_dim).items():
            overrides.setdefault(name, value)
    gqa_reduce = overrides.pop("gqa_reduce", "buffers")
    # swapped where its wider query blocks fit (Notes [tile_m 128], [dQ transposed])
    swap = overrides.pop("sdp_swap_ab", head_dim in TILE_M_128_HEAD_DIMS + TILE_M_80_HEAD_DIMS)
    # short causal or windowed hdim 128: FA4's causal tile, 64 rows with dV before the dS
    # barrier. No choice reads the window's size or which sides it bounds: the kernel takes
    # them at launch (one kernel per "has a window").
    short_band = head_dim in TILE_M_80_HEAD_DIMS and (
        windowed or (causal and seqlen_q is not None and seqlen_k is not None
                     and max(seqlen_q, seqlen_k) <= SHORT_CAUSAL_SEQLEN))
    # softcapped: query blocks of 64 rows (BwdConfig.validate)
    tile_m = overrides.pop("tile_m", TILE_M_ATOM if softcap
                           else _default_tile_m(head_dim, swap, short_band))
    # which of the statistics' switches (Note [dP wait placement]) were asked for: the rest
    # are decided at the end, on the finished config
    stats_asked = {name: overrides[name] for name in OWN_STATS if name in overrides}
    # blocks of 80 / 128 rows and short bands at hdim 128: dV right before the dS barrier
    # (unless early dV is asked for)
    early_dv = overrides.pop("early_dv", None)
    dv_mid = overrides.pop("dv_before_barrier",
                           (tile_m > TILE_M_ATOM or short_band) and not early_dv)
    if early_dv is None:
        # softcapped: t stays live beside P while dS is formed, and early dV's P operand
        # beside both spills at hdim 128 (140 bytes, sm_90a)
        early_dv = not (causal or windowed or dv_mid or wide or softcap)
    # Note [staggered query blocks]: measured at hdim 128 only (with first stores)
    stagger = overrides.pop("stagger_m", not (causal or windowed or deterministic)
                            and head_dim in STAGGER_HEAD_DIMS)
    cfg = BwdConfig(
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        dtype=normalize_dtype(dtype),
        causal=causal,
        window_left=window_left,
        window_right=window_right,
        qhead_per_kvhead=qhead_per_kvhead,
        softcap=softcap,
        deterministic=deterministic,
        gqa_reduce=gqa_reduce,
        early_dv=early_dv,
        dv_before_barrier=dv_mid,
        sdp_swap_ab=swap,
        tile_m=tile_m,
        overlap_dk=overrides.pop("overlap_dk", False),
        # short bands at hdim 128 (swapped 64-row blocks): the stats before the GEMMs
        stats_first=overrides.pop("stats_first", short_band),
        # deterministic with a window: one dQ handoff for the whole tile. H200,
        # paired (window (512, 0), 10 rounds, 4k / 16k): +1.4% / +1.8% at hdim 64, +0.3% /
        # +0.3% at hdim 128 over one per warpgroup; without a window one per warpgroup stays
        # (one handoff: causal -1.2% to -3.8%, non-causal 0.997-1.008)
        dq_handoff_per_wg=overrides.pop("dq_handoff_per_wg",
                                        not (deterministic and windowed)),
        # causal without a window: key block n's work falls with n (Note [longest first])
        longest_first=overrides.pop("longest_first", causal and not windowed),
        # the key blocks of a pair reach a query block at different times: causal, or
        # staggered (Notes [dQ first store], [staggered query blocks])
        dq_first_store=overrides.pop("dq_first_store", causal or stagger),
        stagger_m=stagger,
    )
    early_post = overrides.pop("early_dq_post", None)
    cfg = cfg.replace(**overrides)
    if early_post is None:  # Note [dQ postprocess in the tail]: measured at hdim 128 only
        early_post = (head_dim in EARLY_DQ_POST_HEAD_DIMS and cfg.dq_accum == "bulk"
                      and cfg.pdl)
    cfg = cfg.replace(early_dq_post=early_post)
    # persistent CTAs asked for: the preprocess ahead (Note [persistent CTAs])
    if ("pre_ctas" not in overrides and cfg.head_dim in PRE_CTAS_HEAD_DIMS
            and not cfg.persistent_ctas):
        if cfg.dq_accum == "bulk" and cfg.stats_smem:  # Note [Preprocess beside the main kernel]
            cfg = cfg.replace(pre_ctas=DEFAULT_PRE_CTAS)
    if "qdo_multicast" not in overrides:  # Note [Q/dO multicast]: the clusters must line up
        whole = seqlen_k is not None and cfg.pairs_key_blocks(seqlen_k)
        # causal: only long enough that a cluster's skipped query blocks are few (Note [Q/dO
        # multicast]), and only at the head dims measured
        shortest = CAUSAL_MULTICAST_MIN_SEQLEN.get(head_dim)
        band_ok = not cfg.causal or (shortest is not None and seqlen_q is not None
                                     and min(seqlen_q, seqlen_k) >= shortest)
        cfg = cfg.replace(qdo_multicast=whole and band_ok
                          and not (cfg.is_local or cfg.deterministic or cfg.dynamic_tiles))
    short = (seqlen_q is not None and seqlen_k is not None
             and max(seqlen_q, seqlen_k) <= PERSISTENT_MAX_SEQLEN)
    if ("persistent_ctas" not in overrides and overrides.get("pre_ctas", 0) == 0 and short
            and head_dim in PERSISTENT_HEAD_DIMS):  # Note [persistent CTAs], where it may run
        persistent = cfg.replace(persistent_ctas=DEFAULT_PERSISTENT_CTAS, pre_ctas=0)
        try:
            cfg = persistent._validate_persistent()
        except ValueError:
            pass
    short_tiles = (short and cfg.causal) or cfg.is_local
    if ("persistent_ctas" not in overrides and "dynamic_tiles" not in overrides
            and overrides.get("pre_ctas", 0) == 0 and short_tiles
            and head_dim in DYNAMIC_TILES_HEAD_DIMS):  # Note [dynamic tiles]
        dynamic = cfg.replace(persistent_ctas=DEFAULT_PERSISTENT_CTAS, dynamic_tiles=True,
                              pre_ctas=0)
        try:
            cfg = dynamic._validate_persistent()
        except ValueError:
            pass
    if (cfg.persistent_ctas and cfg.dynamic_tiles and cfg.early_dq_post
            and cfg.is_local and not {"regs_producer", "regs_mma"} & set(overrides)):
        # the producer warps walk fetched tiles with the window's run-time bounds and wait
        # for the tail's dQ counts: at 24 registers ptxas spills one value there (hdim 96,
        # sm_90a compile contract), at 32 none, and the MMA warpgroups fit in 232
        cfg = cfg.replace(regs_producer=32, regs_mma=232)
    if cfg.tile_m == TILE_M_DQ_TRANSPOSED:
        # 80-row blocks: their own statistics and the placed dP^T wait where they compile
        # without spills, or where any of their switches was asked for, unless it was
        # stats_shuffle=True (the shuffled loop); the switches asked for stay as asked
        if "stats_shuffle" in stats_asked:
            own = not stats_asked["stats_shuffle"]
        else:
            own = bool(stats_asked) or _own_stats_fit(cfg)
        if own:
            cfg = cfg.replace(**{k: v for k, v in OWN_STATS.items() if k not in stats_asked})
    return cfg.validate()


def _own_stats_fit(cfg: BwdConfig) -> bool:
    """Whether an 80-row config compiles without spills with its own statistics and the
    placed dP wait (Note [dP wait placement]; sm_90a): beside the preprocess
    (``pre_ctas`` > 0), non-causal, or causal MHA with Q/dO multicast. Elsewhere ptxas spills:
    persistent CTAs 76 bytes, causal without multicast 8 (deterministic, windowed too), causal
    GQA 16-24; those keep the shuffled loop."""
    return cfg.pre_ctas > 0 and (not cfg.causal
                                 or (cfg.qdo_multicast and cfg.qhead_per_kvhead == 1))


def _default_tile_m(head_dim: int, swap: bool, short_band: bool = False) -> int:
    """Query rows per block: 128 for swapped hdim 64 (Note [tile_m 128]), 80 for swapped
    hdim 128 (Note [dQ transposed]) unless its band is short (``short_band``: short causal,
    a window), else 64."""
    if swap and head_dim in TILE_M_128_HEAD_DIMS:
        return TILE_M_SWAPPED_HDIM64
    if swap and head_dim in TILE_M_80_HEAD_DIMS and not short_band:
        return TILE_M_DQ_TRANSPOSED
    return TILE_M_ATOM


def _wide_head_defaults(head_dim: int) -> dict:
    """Fields of the head dims above 128 (Note [dK/dV by columns] in bwd_kernel.py): tile_n 64,
    unswapped S/dP. hdim 256: 2-stage Q and dO (64 KiB each) and the 64 KiB SMEM dQ tile do
    not fit together; "red" with both 2-stage measured 1.20-1.41x faster than "bulk" with
    both 1-stage (H200, each of the benchmark grid's 10 cells)."""
    fields = {"tile_n": WGMMA_M, "sdp_swap_ab": False}
    if head_dim == 256:
        fields["dq_accum"] = "red"
    return fields
