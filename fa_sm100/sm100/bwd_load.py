"""Backward load role (warp 14): TMA copies of the work tile's K and V, then Q_j and dO_j with
their float32 rows LSE2_j and Delta_j for every step j.

Produces  sK, sV (``bwd_kv``, once per tile), the sQ / sdO ring (``bwd_q``) and the sLSE2 /
          sDelta ring (``bwd_lse``), q_stage stages each.

Under 2-CTA (Note [Backward 2-CTA] in bwd_config.py) each CTA loads its part of
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
    """TMA producer of the work tile (see the module docstring). Under 2-CTA (Note [Backward
    2-CTA]) the load warp of one CTA of the pair: K, V of its own key block and K^T's half of
    the head dim over the pair's keys (``bwd_kv``); per step its half of Q_j's and dO_j's rows
    (``bwd_q``, q_stage stages), all of LSE2_j and Delta_j (``bwd_lse``, its own barrier),
    then every row of Q_j's and dO_j's half of the head dim (``_load_qt``). The leader's
    barriers of ``bwd_kv``, ``bwd_q`` and ``bwd_qt`` count both CTAs' bytes (the 2-CTA copies
    complete the leader's barrier)."""
    pair = cfg.use_2cta
    t = cute_layouts.bwd_tilers(cfg)
    hk, b = prob.head_kv, prob.batch
    # this CTA's slice of the MMAs (its rank in the pair) and the key block of K and V
    cta, kv_block = 0, prob.n_block
    if cutlass.const_expr(pair):
        cta, kv_block = prob.n_block % cfg.cta_group, prob.n_block // cfg.cta_group
    thr_s, thr_dp = mmas.S.get_slice(cta), mmas.dP.get_slice(cta)
    # S^T's M is the work tile's keys (under 2-CTA the pair's: each CTA's half in its lanes)
    gK = cute.local_tile(mK[None, None, hk, b], (t["S"][0], cfg.head_dim), (None, 0))
    gV = cute.local_tile(mV[None, None, hk, b], (t["dP"][0], cfg.head_dim_v), (None, 0))
    kv = [("sK", atoms.k, _partition(atoms.k, smem.sK, thr_s.partition_A(gK))),
          ("sV", atoms.v, _partition(atoms.v, smem.sV, thr_dp.partition_A(gV)))]
    if cutlass.const_expr(pair):  # K^T's half of the head dim over the pair's keys (dQ's K)
        atom_kt, mKt = atoms.kt
        gKt = cute.local_tile(mKt[None, None, hk, b], (cfg.head_dim, t["dQ"][2]), (0, None))
        kv.append(("sKt", atom_kt,
                   _partition(atom_kt, smem.sKt, mmas.dQ.get_slice(cta).partition_B(gKt))))
    if prob.iters > 0:
        pipes.bwd_kv.producer_acquire(0, Int32(1))
        for buf, _, _ in kv:
            record.access(buf, "w", unit="tma", done_by="bwd_kv")
        for _, atom, (s_part, g_part) in kv:
            cute.copy(atom, g_part[None, kv_block], s_part,
                      tma_bar_ptr=pipes.bwd_kv.full_barrier(0))
        pipes.bwd_kv.producer_commit(0)
    index = Int32(0)
    phase = Int32(1)
    one_phase = Int32(1)  # bwd_qt's (2-CTA)
    with record.loop("steps"):
        for step in cutlass.range(prob.iters, unroll=1):
            head, m = step_head_block(cfg, prob, step)
            gQ = cute.local_tile(mQ[None, None, head, b], (cfg.m_block, cfg.head_dim), (None, 0))
            gdO = cute.local_tile(mdO[None, None, head, b], (cfg.m_block, cfg.head_dim_v),
                                  (None, 0))
            qdo = ((atoms.q, _partition(atoms.q, smem.sQ, thr_s.partition_B(gQ))),
                   (atoms.do, _partition(atoms.do, smem.sdO, thr_dp.partition_B(gdO))))
            pipes.bwd_q.producer_acquire(index, phase)
            record.access("sQ", "w", unit="tma", done_by="bwd_q", stage_of="bwd_q")
            record.access("sdO", "w", unit="tma", done_by="bwd_q", stage_of="bwd_q")
            for atom, (s_part, g_part) in qdo:
                cute.copy(atom, g_part[None, m], s_part[None, index],
                          tma_bar_ptr=pipes.bwd_q.full_barrier(index))
            pipes.bwd_q.producer_commit(index)
            _load_rows(cfg, mLSE2, mDelta, smem, pipes, b, head, m, index, phase)
            if cutlass.const_expr(pair):
                _load_qt(cfg, atoms, smem, mmas, pipes, cta, head, b, m, one_phase)
                one_phase = one_phase ^ 1
            index, phase = advance(index, phase, cfg.q_stage)
    producer_tail(pipes.bwd_q, index, phase)
    producer_tail(pipes.bwd_lse, index, phase)
    if cutlass.const_expr(pair):
        producer_tail(pipes.bwd_qt, Int32(0), one_phase)


@cute.jit
def _load_qt(cfg, atoms, smem, mmas, pipes, cta, head, b, m, one_phase: Int32):
    """2-CTA: every row of Q_j's and dO_j's half of the head dim (``bwd_qt``, one stage: it
    waits for dK_j-1), the B operands of dK_j and dV_j."""
    atom_qt, mQt = atoms.qt
    atom_dot, mdOt = atoms.dot
    gQt = cute.local_tile(mQt[None, None, head, b], (cfg.head_dim, cfg.m_block), (0, None))
    gdOt = cute.local_tile(mdOt[None, None, head, b], (cfg.head_dim_v, cfg.m_block), (0, None))
    pipes.bwd_qt.producer_acquire(0, one_phase)
    for buf in ("sQt", "sdOt"):
        record.access(buf, "w", unit="tma", done_by="bwd_qt")
    full = pipes.bwd_qt.full_barrier(0)
    for atom, s_tile, g_tile in (
            (atom_qt, smem.sQt, mmas.dK.get_slice(cta).partition_B(gQt)),
            (atom_dot, smem.sdOt, mmas.dV.get_slice(cta).partition_B(gdOt))):
        s_part, g_part = _partition(atom, s_tile, g_tile)
        cute.copy(atom, g_part[None, m], s_part[None, 0], tma_bar_ptr=full)
    pipes.bwd_qt.producer_commit(0)


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
