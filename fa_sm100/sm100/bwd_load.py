"""Backward load role (warp 14): TMA copies of the work tile's K and V, then Q_j and dO_j with
their float32 rows LSE2_j and Delta_j for every step j.

Produces  sK, sV (``bwd_kv``, once per tile), the sQ / sdO ring (``bwd_q``) and the sLSE2 /
          sDelta ring (``bwd_lse``), q_stage stages each.

Under 2-CTA (``load_pair``, Note [Backward 2-CTA] in bwd_config.py) each CTA loads its part of
the pair's operands: also K^T's half of the head dim over the pair's keys (``bwd_kv``) and, per
step, Q^T_j / dO^T_j's half (``bwd_qt``, one stage).

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
from layouts import cute_layouts
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
    if cutlass.const_expr(cfg.use_2cta):
        load_pair(cfg, atoms, mQ, mK, mV, mdO, mLSE2, mDelta, smem, mmas, pipes, prob)
    else:
        _load_one(cfg, atoms, mQ, mK, mV, mdO, mLSE2, mDelta, smem, mmas, pipes, prob)


@cute.jit
def _load_one(cfg, atoms, mQ, mK, mV, mdO, mLSE2, mDelta, smem, mmas, pipes, prob):
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
            _load_rows(cfg, mLSE2, mDelta, smem, pipes, b, head, m, index, phase)
            index, phase = advance(index, phase, cfg.q_stage)
    producer_tail(pipes.bwd_q, index, phase)
    producer_tail(pipes.bwd_lse, index, phase)


@cute.jit
def _load_rows(cfg, mLSE2, mDelta, smem, pipes, b, head, m, index: Int32, phase: Int32):
    """LSE2_j and Delta_j of query block ``m`` into stage ``index`` (bulk copies; with 2-CTA
    every CTA of a pair loads all m_block rows, its compute warps read every query column)."""
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


@cute.jit
def load_pair(cfg, atoms, mQ, mK, mV, mdO, mLSE2, mDelta, smem, mmas, pipes, prob):
    """The load warp of one CTA of a 2-CTA pair (Note [Backward 2-CTA]): K, V of its own key
    block and K^T's half of the head dim over the pair's keys (``bwd_kv``); per step its half
    of Q_j's and dO_j's rows (``bwd_q``, q_stage stages), all of LSE2_j and Delta_j
    (``bwd_lse``, its own barrier), then every row of Q_j's and dO_j's half of the head dim
    (``bwd_qt``, one stage: it waits for dK_j-1). The leader's barriers of ``bwd_kv``,
    ``bwd_q`` and ``bwd_qt`` count both CTAs' bytes (the 2-CTA copies complete the leader's
    barrier)."""
    cta = prob.n_block % cfg.cta_group
    pair = prob.n_block // cfg.cta_group
    t = cute_layouts.bwd_tilers(cfg)
    thr_s, thr_dp = mmas.S.get_slice(cta), mmas.dP.get_slice(cta)
    thr_dv, thr_dk, thr_dq = mmas.dV.get_slice(cta), mmas.dK.get_slice(cta), mmas.dQ.get_slice(cta)
    hk, b = prob.head_kv, prob.batch
    atom_qt, mQt = atoms.qt
    atom_dot, mdOt = atoms.dot
    atom_kt, mKt = atoms.kt
    # pair tiles: S^T's M is the pair's keys (each CTA's half in its TMEM lanes), dQ's K too
    gK = cute.local_tile(mK[None, None, hk, b], (t["S"][0], cfg.head_dim), (None, 0))
    gV = cute.local_tile(mV[None, None, hk, b], (t["dP"][0], cfg.head_dim_v), (None, 0))
    gKt = cute.local_tile(mKt[None, None, hk, b], (cfg.head_dim, t["dQ"][2]), (0, None))
    tKsK, tKgK = _partition(atoms.k, smem.sK, thr_s.partition_A(gK))
    tVsV, tVgV = _partition(atoms.v, smem.sV, thr_dp.partition_A(gV))
    tKtsKt, tKtgKt = _partition(atom_kt, smem.sKt, thr_dq.partition_B(gKt))
    if prob.iters > 0:
        pipes.bwd_kv.producer_acquire(0, Int32(1))
        for buf in ("sK", "sV", "sKt"):
            record.access(buf, "w", unit="tma", done_by="bwd_kv")
        full = pipes.bwd_kv.full_barrier(0)
        cute.copy(atoms.k, tKgK[None, pair], tKsK, tma_bar_ptr=full)
        cute.copy(atoms.v, tVgV[None, pair], tVsV, tma_bar_ptr=full)
        cute.copy(atom_kt, tKtgKt[None, pair], tKtsKt, tma_bar_ptr=full)
        pipes.bwd_kv.producer_commit(0)
    index = Int32(0)
    phase = Int32(1)
    one_phase = Int32(1)
    with record.loop("steps"):
        for step in cutlass.range(prob.iters, unroll=1):
            head, m = step_head_block(cfg, prob, step)
            gQ = cute.local_tile(mQ[None, None, head, b], (cfg.m_block, cfg.head_dim), (None, 0))
            gdO = cute.local_tile(mdO[None, None, head, b], (cfg.m_block, cfg.head_dim_v),
                                  (None, 0))
            gQt = cute.local_tile(mQt[None, None, head, b], (cfg.head_dim, cfg.m_block),
                                  (0, None))
            gdOt = cute.local_tile(mdOt[None, None, head, b], (cfg.head_dim_v, cfg.m_block),
                                   (0, None))
            pipes.bwd_q.producer_acquire(index, phase)
            for buf in ("sQ", "sdO"):
                record.access(buf, "w", unit="tma", done_by="bwd_q", stage_of="bwd_q")
            full = pipes.bwd_q.full_barrier(index)
            for atom, s_tile, g_tile in ((atoms.q, smem.sQ, thr_s.partition_B(gQ)),
                                         (atoms.do, smem.sdO, thr_dp.partition_B(gdO))):
                s_part, g_part = _partition(atom, s_tile, g_tile)
                cute.copy(atom, g_part[None, m], s_part[None, index], tma_bar_ptr=full)
            pipes.bwd_q.producer_commit(index)
            _load_rows(cfg, mLSE2, mDelta, smem, pipes, b, head, m, index, phase)
            pipes.bwd_qt.producer_acquire(0, one_phase)
            for buf in ("sQt", "sdOt"):
                record.access(buf, "w", unit="tma", done_by="bwd_qt")
            full = pipes.bwd_qt.full_barrier(0)
            for atom, s_tile, g_tile in ((atom_qt, smem.sQt, thr_dk.partition_B(gQt)),
                                         (atom_dot, smem.sdOt, thr_dv.partition_B(gdOt))):
                s_part, g_part = _partition(atom, s_tile, g_tile)
                cute.copy(atom, g_part[None, m], s_part[None, 0], tma_bar_ptr=full)
            pipes.bwd_qt.producer_commit(0)
            one_phase = one_phase ^ 1
            index, phase = advance(index, phase, cfg.q_stage)
    producer_tail(pipes.bwd_q, index, phase)
    producer_tail(pipes.bwd_lse, index, phase)
    producer_tail(pipes.bwd_qt, Int32(0), one_phase)
