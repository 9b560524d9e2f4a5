"""Correction role (warps 8-11): rescale O in TMEM, then normalize it into SMEM and write LSE.

One thread owns one row (TMEM lane) of O_0 and O_1.

Consumes  per step the O rescale factor (``sm_stats``), the final row sum and max of a tile
          (``sm_stats``), the final O_i (``o_acc`` full).
Produces  "O_i rescaled" (``s_p_o`` release, which together with the softmax's P release lets
          the next PV MMA start), O_i normalized in sO (``o_epi``), LSE in global memory;
          hands O_i back to the MMA warp (``o_acc`` release) once read.

Per work tile, for each Q stage i in turn:

    each block:   wait sm_stats(i); each warp votes on its 32 rows' factors: if any row needs
                  it (factor < 1: the row max grew past the threshold; Note [Correction vote];
                  never at a tile's first block, whose PV MMA overwrites O) the warp multiplies
                  its rows of O_i in TMEM, otherwise it skips the work; release s_p_o(i)
    final:        wait sm_stats(i) (row sum, row max); wait o_acc(i); O_i / row_sum -> sO[i]
                  (acquire o_epi(i)); release o_acc(i); commit o_epi(i); LSE -> global

A rescale of block k runs after the softmax saw S_i of block k, which the MMA warp issued after
the PV MMA of block k-1, so that MMA has finished writing O_i.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import tcgen05

from fa_sm100 import softmax_math
from fa_sm100.sm100 import masking
from fa_sm100.sm100.context import STAT_MAX, STAT_SCALE, STAT_SUM
from fa_sm100.sm100.scheduler import rows_per_tile, tile_problem
from pipelines import record

O_CHUNK_COLS = 32  # O columns per tcgen05.ld / st of the correction


@dataclass(frozen=True)
class OViews:
    """tcgen05 load/store partitions of one thread's row of O_i, in 32-column chunks."""

    thr_load: object
    thr_store: object
    tOtO_ld: cute.Tensor
    tOtO_st: cute.Tensor
    reg_shape: object
    n_chunks: int

    def chunk_ld(self, j):
        return cute.make_tensor(self.tOtO_ld.iterator + j * O_CHUNK_COLS, self.tOtO_ld.layout)

    def chunk_st(self, j):
        return cute.make_tensor(self.tOtO_st.iterator + j * O_CHUNK_COLS, self.tOtO_st.layout)


def make_o_views(cfg, tidx, tO) -> OViews:
    acc = tO[(None, None), 0, 0]  # (m_block, head_dim_v) fp32
    chunk = cute.composition(acc, cute.make_layout((cfg.m_block, O_CHUNK_COLS)))
    ld = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(O_CHUNK_COLS)),
                             Float32)
    st = cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(O_CHUNK_COLS)),
                             Float32)
    thr_load = tcgen05.make_tmem_copy(ld, chunk).get_slice(tidx)
    thr_store = tcgen05.make_tmem_copy(st, chunk).get_slice(tidx)
    return OViews(
        thr_load=thr_load,
        thr_store=thr_store,
        tOtO_ld=thr_load.partition_S(chunk),
        tOtO_st=thr_store.partition_D(chunk),
        reg_shape=thr_load.partition_D(
            cute.make_identity_tensor((cfg.m_block, O_CHUNK_COLS))).shape,
        n_chunks=cfg.head_dim_v // O_CHUNK_COLS,
    )


@cute.jit
def _scale_regs(r: cute.Tensor, scale: Float32):
    for k in cutlass.range_constexpr(0, cute.size(r), 2):
        r[k], r[k + 1] = cute.arch.mul_packed_f32x2((r[k], r[k + 1]), (scale, scale))


@cute.jit
def rescale_o(v: OViews, scale: Float32):
    """O_i row *= scale, in TMEM (load, packed multiply, store back), one 32-column chunk at a
    time (a run-time loop keeps one chunk in registers: the role has 80)."""
    for j in cutlass.range(v.n_chunks, unroll=1):
        r = cute.make_rmem_tensor(v.reg_shape, Float32)
        cute.copy(v.thr_load, v.chunk_ld(j), r)
        cute.arch.fence_view_async_tmem_load()
        _scale_regs(r, scale)
        cute.copy(v.thr_store, r, v.chunk_st(j))
    cute.arch.fence_view_async_tmem_store()


@cute.jit
def store_o(cfg, v: OViews, scale: Float32, sO_stage: cute.Tensor, tidx: Int32):
    """sO[row, :] = O_i row * scale in the output dtype (one thread writes its own row)."""
    dtype = sO_stage.element_type
    sO_row = cute.logical_divide(sO_stage[tidx, None], cute.make_layout(O_CHUNK_COLS))
    # A run-time loop over chunks: the swizzled SMEM addresses of one chunk are computed in
    # the loop instead of all being hoisted (and kept live) across the tile loop.
    for j in cutlass.range(v.n_chunks, unroll=1):
        r = cute.make_rmem_tensor(v.reg_shape, Float32)
        cute.copy(v.thr_load, v.chunk_ld(j), r)
        cute.arch.fence_view_async_tmem_load()
        _scale_regs(r, scale)
        out = cute.make_rmem_tensor(cute.make_layout(O_CHUNK_COLS), dtype)
        out.store(r.load().to(dtype))
        cute.autovec_copy(out, sO_row[None, j])


@cute.jit
def correction(cfg, tmem, smem, gmem, pipes, prob, sched, cta_v: Int32):
    """The correction warpgroup: every step of every work tile, both Q stages."""
    tidx = cute.arch.thread_idx()[0] % (4 * 32)
    views = tuple(make_o_views(cfg, tidx, tmem.tO[s]) for s in range(cfg.q_stage))
    stats_phase = Int32(0)
    oacc_phase = Int32(0)
    epi_phase = Int32(1)
    tile = sched.initial()
    num_tiles = sched.num_tiles
    with record.loop("work_tiles"):
        while tile < num_tiles:
            wt = sched.decode(tile)
            tile_prob = tile_problem(prob, wt)
            n_min, n_max = masking.n_block_range(cfg, tile_prob, wt.m_block)
            with record.loop("n_blocks"):
                for i in cutlass.range(n_max - n_min, unroll=1):
                    for stage in cutlass.range_constexpr(cfg.q_stage):
                        pipes.sm_stats.consumer_wait(stage, stats_phase, stage_hint=stage)
                        record.access(f"stats{stage}", "r")
                        scale = smem.sStats[tidx, STAT_SCALE, stage]
                        pipes.sm_stats.consumer_release(stage, stage_hint=stage)
                        # Note [Correction vote] (softmax_math): a factor of 0 is a max jump
                        # past float32's exp2 range and must clear the row; the first block's
                        # PV MMA overwrites O, so that block has nothing to rescale.
                        needs = softmax_math.correction_needed(scale) & (i > 0)
                        with record.branch("rescale"):
                            if cute.arch.vote_ballot_sync(needs) != 0:
                                record.access(f"O{stage}", "r")
                                record.access(f"O{stage}", "w")
                                rescale_o(views[stage], scale)
                        pipes.s_p_o.consumer_release(stage, stage_hint=stage, note="O rescaled")
                    stats_phase ^= 1
            for stage in cutlass.range_constexpr(cfg.q_stage):
                pipes.sm_stats.consumer_wait(stage, stats_phase, stage_hint=stage)
                record.access(f"stats{stage}", "r")
                row_sum = smem.sStats[tidx, STAT_SUM, stage]
                row_max_log2 = smem.sStats[tidx, STAT_MAX, stage]
                pipes.sm_stats.consumer_release(stage, stage_hint=stage)
                empty_row = row_sum == Float32(0.0)  # every key of the row masked
                inv = cute.arch.rcp_approx(row_sum)
                if empty_row:
                    inv = Float32(0.0)
                pipes.o_acc.consumer_wait(stage, oacc_phase, stage_hint=stage)
                pipes.o_epi.producer_acquire(stage, epi_phase, stage_hint=stage)
                record.access(f"O{stage}", "r")
                record.access(f"sO{stage}", "w")
                store_o(cfg, views[stage], inv, smem.sO[None, None, stage], tidx)
                pipes.o_acc.consumer_release(stage, stage_hint=stage)
                cute.arch.fence_view_async_shared()  # sO visible to the TMA store
                pipes.o_epi.producer_commit(stage, stage_hint=stage)
                if cutlass.const_expr(gmem.mLSE is not None):
                    row = (wt.m_block * rows_per_tile(cfg)
                           + (stage * cfg.cta_group + cta_v) * cfg.m_block + tidx)
                    lse = (row_max_log2 + cute.math.log2(row_sum, fastmath=True)) * Float32(
                        softmax_math.LN_2)
                    if empty_row:
                        lse = -Float32.inf
                    if row < tile_prob.seqlen_q:
                        if cutlass.const_expr(cfg.varlen):  # its sequence's packed rows
                            gmem.mLSE[tile_prob.q_off + row, wt.head, 0] = lse
                        else:
                            gmem.mLSE[row, wt.head, wt.batch] = lse
            stats_phase ^= 1
            oacc_phase ^= 1
            epi_phase ^= 1
            tile = sched.next(tile)

