"""Backward load role (warp 14): TMA copies of the work tile's K and V, then Q_j and dO_j with
their float32 rows LSE2_j and Delta_j for every step j.

Produces  sK, sV (``bwd_kv``, once per tile), the sQ / sdO ring (``bwd_q``) and the sLSE2 /
          sDelta ring (``bwd_lse``), q_stage stages each.

Step j is query block ``m_min + j % blocks`` of query head ``head_kv * group + j // blocks``
(``BwdProblem``). Rows past seqlen_q and keys past seqlen_k arrive as zeros (TMA
out-of-bounds fill); LSE2 and Delta rows are padded by the preprocess (LSE2 = +inf, Delta = 0),
so a padding query row has P = 0 and dS = 0 without any predicate.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.cute.nvgpu import cpasync
from cutlass.experimental import primitives as prims

from fa_sm100.sm100.mma import advance
from fa_sm100.sm100.pipes import producer_tail
from pipelines import record


def step_head_block(cfg, prob, step: Int32):
    """(query head, query block) of step ``step`` of the work tile."""
    blocks = prob.m_max - prob.m_min
    g = step // blocks
    return prob.head_kv * cfg.qhead_per_kvhead + g, prob.m_min + (step - g * blocks)


def _partition(atom, s_tensor, g_tile):
    one = cute.make_layout(1)
    return cpasync.tma_partition(atom, 0, one, cute.group_modes(s_tensor, 0, 3),
                                 cute.group_modes(g_tile, 0, 3))


@cute.jit
def load(cfg, atoms, tx, mQ, mK, mV, mdO, mLSE2, mDelta, smem, mmas, pipes, prob):
    """TMA producer of the work tile (see the module docstring)."""
    thr_s, thr_dp = mmas.S.get_slice(0), mmas.dP.get_slice(0)
    n, hk, b = prob.n_block, prob.head_kv, prob.batch
    gK = cute.local_tile(mK[None, None, hk, b], (cfg.n_block, cfg.head_dim), (None, 0))
    gV = cute.local_tile(mV[None, None, hk, b], (cfg.n_block, cfg.head_dim_v), (None, 0))
    tKsK, tKgK = _partition(atoms.k, smem.sK, thr_s.partition_A(gK))
    tVsV, tVgV = _partition(atoms.v, smem.sV, thr_dp.partition_A(gV))
    if prob.iters > 0:
        pipes.bwd_kv.producer_acquire(0, Int32(1))
        record.access("sK", "w", unit="tma", done_by="bwd_kv")
        record.access("sV", "w", unit="tma", done_by="bwd_kv")
        cute.copy(atoms.k, tKgK[None, n], tKsK, tma_bar_ptr=pipes.bwd_kv.full_barrier(0))
        cute.copy(atoms.v, tVgV[None, n], tVsV, tma_bar_ptr=pipes.bwd_kv.full_barrier(0))
        pipes.bwd_kv.producer_commit(0)
    index = Int32(0)
    phase = Int32(1)
    with record.loop("steps"):
        for step in cutlass.range(prob.iters, unroll=1):
            head, m = step_head_block(cfg, prob, step)
            gQ = cute.local_tile(mQ[None, None, head, b], (cfg.m_block, cfg.head_dim), (None, 0))
            gdO = cute.local_tile(mdO[None, None, head, b], (cfg.m_block, cfg.head_dim_v),
                                  (None, 0))
            tQsQ, tQgQ = _partition(atoms.q, smem.sQ, thr_s.partition_B(gQ))
            tOsO, tOgO = _partition(atoms.do, smem.sdO, thr_dp.partition_B(gdO))
            pipes.bwd_q.producer_acquire(index, phase)
            record.access("sQ", "w", unit="tma", done_by="bwd_q", stage_of="bwd_q")
            record.access("sdO", "w", unit="tma", done_by="bwd_q", stage_of="bwd_q")
            cute.copy(atoms.q, tQgQ[None, m], tQsQ[None, index],
                      tma_bar_ptr=pipes.bwd_q.full_barrier(index))
            cute.copy(atoms.do, tOgO[None, m], tOsO[None, index],
                      tma_bar_ptr=pipes.bwd_q.full_barrier(index))
            pipes.bwd_q.producer_commit(index)
            pipes.bwd_lse.producer_acquire(index, phase)
            record.access("sLSE2", "w", unit="tma", done_by="bwd_lse", stage_of="bwd_lse")
            record.access("sDelta", "w", unit="tma", done_by="bwd_lse", stage_of="bwd_lse")
            bar = pipes.bwd_lse.full_barrier(index)
            with cute.arch.elect_one():
                for src, dst in ((mLSE2, smem.sLSE2), (mDelta, smem.sDelta)):
                    prims.cp_async_bulk_shared_cluster_global(
                        dst[None, index].iterator, src[b, head, None].iterator + m * cfg.m_block,
                        bar, cfg.m_block * 4)
            pipes.bwd_lse.producer_commit(index)
            index, phase = advance(index, phase, cfg.q_stage)
    producer_tail(pipes.bwd_q, index, phase)
    producer_tail(pipes.bwd_lse, index, phase)
