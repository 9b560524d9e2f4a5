"""Softmax role (warps 0-3 for Q stage 0, warps 4-7 for Q stage 1).

One thread owns one query row: TMEM lane ``t`` of S_i holds row ``t`` of this CTA's 128 rows,
so the row max and row sum need no shuffles.

Consumes  S_i (TMEM, ``s_p_o`` full, committed by the MMA warp after S_i = Q_i K_j^T).
Produces  P_i (TMEM, 16-bit, at the P_i alias inside S_i), released in two parts;
          the per-step O rescale factor and, at the end of a tile, the row sum and row max
          (SMEM ``sStats``, ``sm_stats`` pipeline) for the correction warps.

Per work tile, for each K/V block j from the right-most down to 0:

    wait s_p_o(i)                       S_i of block j is in TMEM
    S -> registers; mask (key tail, causal diagonal, sliding window)
    new row max under the rescale threshold; the rescale factor -> sStats; commit sm_stats
    x = S * scale_log2 - max_log2 (FFMA2); P = exp2(x): MUFU.EX2, or the degree-3 polynomial
        on the FMA pipe for the columns ``softmax_math.ex2_emulated_mask`` selects
    P -> TMEM in 32-key chunks; release s_p_o after the first ``split_p_col`` keys and
        commit p_lastsplit after the rest (see Note [Split-P arrival])
    row sum = row sum * rescale + sum(P)

Note [Split-P arrival]
    The PV MMA of block j reads P_i in k-blocks of 16 keys. With ``split_p`` on, the softmax
    arrives twice: on ``s_p_o`` (consumer release) once keys [0, split_p_col) of P_i are in
    TMEM, and on ``p_lastsplit`` (producer commit) once keys [split_p_col, n_block) are. The
    MMA warp issues the k-blocks below split_p_col after the first arrival and waits on
    ``p_lastsplit`` before the rest, so the first 3/4 of O += P V overlaps the last exp2s.
    With ``split_p`` off there is one arrival (``s_p_o``) after all of P.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import tcgen05

from fa_sm100 import softmax_math
from fa_sm100.dsl_math import softcap_tanh
from fa_sm100.sm100 import masking
from fa_sm100.sm100.context import STAT_MAX, STAT_SCALE, STAT_SUM
from fa_sm100.sm100.ex2 import exp2_poly_pair
from fa_sm100.sm100.mma import p_columns
from fa_sm100.sm100.scheduler import rows_per_tile, tile_problem
from pipelines import record

P_CHUNK_KEYS = 32  # keys per tcgen05.st of P (16 columns of packed 16-bit pairs)


@dataclass(frozen=True)
class SoftmaxViews:
    """TMEM copy atoms and partitions of one softmax warpgroup (built once per role)."""

    thr_load: object
    tStS: cute.Tensor  # (((32,32),1),1,n/32) S of this thread's row
    tScS: cute.Tensor  # (row, col) coordinates of those registers
    thr_store: object
    tStP: cute.Tensor  # (((16,32),1),1,n/32) P of this thread's row (16-bit pairs)
    p_chunk_shape: object  # registers of one P chunk (P_CHUNK_KEYS keys)


def make_softmax_views(cfg, tidx, tS, p_minus_s) -> SoftmaxViews:
    m, n = cfg.m_block, cfg.n_block
    acc = tS[(None, None), 0, 0]  # (m_block, n_block) fp32
    load_atom = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(32)), Float32)
    thr_load = tcgen05.make_tmem_copy(load_atom, acc).get_slice(tidx)
    p_cols = n * cfg.dtype_bytes // 4  # 16-bit P: two keys per 32-bit column
    tP = cute.make_tensor(
        acc.iterator + p_minus_s, cute.composition(acc.layout, cute.make_layout((m, p_cols))))
    store_atom = cute.make_copy_atom(
        tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(P_CHUNK_KEYS // 2)), Float32)
    thr_store = tcgen05.make_tmem_copy(store_atom, tP).get_slice(tidx)
    return SoftmaxViews(
        thr_load=thr_load,
        tStS=thr_load.partition_S(acc),
        tScS=thr_load.partition_D(cute.make_identity_tensor((m, n))),
        thr_store=thr_store,
        tStP=thr_store.partition_D(tP),
        p_chunk_shape=thr_store.partition_S(
            cute.make_identity_tensor((m, p_cols)))[None, None, 0].shape,
    )


@cute.jit
def _row_stats_update(cfg, tSrS: cute.Tensor, row_max: Float32, scale_log2: Float32):
    """New row max under the rescale rule, and the factor O and the row sum are multiplied by.

    The first block of a tile needs no special case: the row max starts at -inf, so the growth
    is +inf, the max moves and the factor is exp2(-inf) = 0 (the sum starts at 0, and the
    correction does not rescale at a tile's first block: Note [Correction vote]). A block
    whose scores are all masked leaves a -inf max in place (growth NaN compares false)."""
    blk_max = tSrS.load().reduce(cute.ReductionOp.MAX, -Float32.inf, 0)
    cand = cute.arch.fmax(row_max, blk_max)
    grow = (cand - row_max) * scale_log2
    new_max = row_max
    acc_scale = Float32(1.0)
    if softmax_math.rescale_needed(grow, Float32(cfg.rescale_threshold)):
        new_max = cand
        acc_scale = cute.math.exp2((row_max - cand) * scale_log2, fastmath=True)
    return new_max, acc_scale


@cute.jit
def _exp2_chunk(tSrS: cute.Tensor, first: cutlass.Constexpr, emulated: cutlass.Constexpr):
    """exp2 in place on keys [first, first + P_CHUNK_KEYS): MUFU.EX2 or the FMA polynomial."""
    for k in cutlass.range_constexpr(first, first + P_CHUNK_KEYS, 2):
        if cutlass.const_expr(emulated[k]):
            tSrS[k], tSrS[k + 1] = exp2_poly_pair(tSrS[k], tSrS[k + 1])
        else:
            tSrS[k] = cute.math.exp2(tSrS[k], fastmath=True)
            tSrS[k + 1] = cute.math.exp2(tSrS[k + 1], fastmath=True)


@cute.jit
def softmax_step(cfg, stage: cutlass.Constexpr, v: SoftmaxViews, tidx: Int32, n_blk: Int32,
                 row: Int32, row_max: Float32, row_sum: Float32, s_phase: Int32,
                 stats_phase: Int32, split_phase: Int32, pipes, smem, prob):
    """One K/V block of one Q stage (see the module docstring); returns the updated state."""
    tS_name = f"S{stage}"
    pipes.s_p_o.consumer_wait(stage, s_phase, stage_hint=stage)
    record.access(tS_name, "r")
    tSrS = cute.make_rmem_tensor(v.tScS.shape, Float32)
    cute.copy(v.thr_load, v.tStS, tSrS)
    # tcgen05.wait::ld: S is in registers before it is used, and before P overwrites its columns.
    cute.arch.fence_view_async_tmem_load()
    if cutlass.const_expr(cfg.softcap):  # before the mask: tanh(-inf) would be -1
        for i in cutlass.range(cute.size(tSrS), unroll_full=True):
            tSrS[i] = softcap_tanh(tSrS[i] * prob.softcap_k)
    lo, hi = masking.col_limits(cfg, prob, row, n_blk)
    masking.apply_mask(cfg, tSrS, v.tScS, lo, hi)

    new_max, acc_scale = _row_stats_update(cfg, tSrS, row_max, prob.scale_log2)
    pipes.sm_stats.producer_acquire(stage, stats_phase, stage_hint=stage)
    record.access(f"stats{stage}", "w")
    smem.sStats[tidx, STAT_SCALE, stage] = acc_scale
    pipes.sm_stats.producer_commit(stage, stage_hint=stage, note="rescale factor")

    # x = S * scale_log2 - max * scale_log2 (a fully masked row keeps offset 0: exp2(-inf) = 0)
    max_log2 = new_max * prob.scale_log2
    if new_max == -Float32.inf:
        max_log2 = Float32(0.0)
    neg_max = -max_log2
    for k in cutlass.range(0, cute.size(tSrS), 2, unroll_full=True):
        tSrS[k], tSrS[k + 1] = cute.arch.fma_packed_f32x2(
            (tSrS[k], tSrS[k + 1]), (prob.scale_log2, prob.scale_log2), (neg_max, neg_max)
        )

    emulated = softmax_math.ex2_emulated_mask(cfg.n_block, cfg.ex2_emu_fraction)
    dtype = smem.sQ.element_type
    n_chunks = cfg.n_block // P_CHUNK_KEYS
    tSrS_chunks = cute.logical_divide(
        cute.make_tensor(tSrS.iterator, cute.make_layout(cfg.n_block)),
        cute.make_layout(P_CHUNK_KEYS))  # (32, n/32)
    first_cols, total_cols = p_columns(cfg)
    P_name = f"P{stage}"
    record.access(P_name, "w", cols=(0, first_cols))
    blk_sum = Float32(0.0)
    for j in cutlass.range_constexpr(n_chunks):
        if cutlass.const_expr(cfg.split_p and j * P_CHUNK_KEYS == cfg.split_p_col):
            pipes.p_lastsplit.producer_acquire(stage, split_phase, stage_hint=stage)
            record.access(P_name, "w", cols=(first_cols, total_cols))
        _exp2_chunk(tSrS, j * P_CHUNK_KEYS, emulated)
        # Chunk by chunk: sum, convert, store, so a chunk's fp32 values die right away (the
        # role has 192 registers and a row of S alone takes n_block of them).
        p32 = tSrS_chunks[None, j].load()
        blk_sum = blk_sum + p32.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        tSrP32 = cute.make_rmem_tensor(v.p_chunk_shape, Float32)  # 16 columns of 16-bit pairs
        tSrP = cute.make_tensor(cute.recast_ptr(tSrP32.iterator, dtype=dtype),
                                cute.make_layout(P_CHUNK_KEYS))
        tSrP.store(p32.to(dtype))  # packed cvt
        cute.copy(v.thr_store, tSrP32, v.tStP[None, None, j])
        if cutlass.const_expr(cfg.split_p and (j + 1) * P_CHUNK_KEYS == cfg.split_p_col):
            cute.arch.fence_view_async_tmem_store()
            pipes.s_p_o.consumer_release(stage, stage_hint=stage, note="P first split")
    cute.arch.fence_view_async_tmem_store()
    if cutlass.const_expr(cfg.split_p):
        pipes.p_lastsplit.producer_commit(stage, stage_hint=stage, note="P last split")
    else:
        pipes.s_p_o.consumer_release(stage, stage_hint=stage, note="P full")

    new_sum = row_sum * acc_scale + blk_sum
    return new_max, new_sum, s_phase ^ 1, stats_phase ^ 1, split_phase ^ 1


@cute.jit
def softmax(cfg, stage: cutlass.Constexpr, tmem, smem, pipes, prob, sched, cta_v: Int32):
    """The softmax warpgroup of Q stage ``stage``: every K/V block of every work tile."""
    tidx = cute.arch.thread_idx()[0] % (4 * 32)
    v = make_softmax_views(cfg, tidx, tmem.tS[stage], tmem.p_minus_s)
    s_phase = Int32(0)
    stats_phase = Int32(1)
    split_phase = Int32(1)
    tile = sched.initial()
    num_tiles = sched.num_tiles
    with record.loop("work_tiles"):
        while tile < num_tiles:
            wt = sched.decode(tile)
            tile_prob = tile_problem(prob, wt)
            n_min, n_max = masking.n_block_range(cfg, tile_prob, wt.m_block)
            row = (wt.m_block * rows_per_tile(cfg) + (stage * cfg.cta_group + cta_v) * cfg.m_block
                   + tidx)
            row_max = Float32(-Float32.inf)
            row_sum = Float32(0.0)
            with record.loop("n_blocks"):
                for i in cutlass.range(n_max - n_min, unroll=1):
                    row_max, row_sum, s_phase, stats_phase, split_phase = softmax_step(
                        cfg, stage, v, tidx, n_max - 1 - i, row, row_max, row_sum,
                        s_phase, stats_phase, split_phase, pipes, smem, tile_prob,
                    )
            # Final hand-off of this tile: row sum and row max (log2 units).
            pipes.sm_stats.producer_acquire(stage, stats_phase, stage_hint=stage)
            record.access(f"stats{stage}", "w")
            smem.sStats[tidx, STAT_SUM, stage] = row_sum
            smem.sStats[tidx, STAT_MAX, stage] = row_max * prob.scale_log2
            pipes.sm_stats.producer_commit(stage, stage_hint=stage, note="row sum and max")
            stats_phase ^= 1
            tile = sched.next(tile)
