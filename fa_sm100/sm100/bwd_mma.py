"""Backward MMA role (warp 12): one thread issues every tcgen05 MMA of the CTA.

Consumes  sK, sV (``bwd_kv``), Q_j / dO_j (``bwd_q``), P^T_j and dS^T_j in TMEM with dS_j in
          SMEM (``bwd_ds`` full), the dP^T region back from the dQ warpgroup (``bwd_dq``
          empty), the S^T region back from the compute warpgroups (``bwd_s_dp`` empty).
Produces  S^T_j, dP^T_j (``bwd_s_dp`` full), dQ_j (``bwd_dq`` full), the tile's dK and dV
          (``bwd_dkv`` full); frees Q_j / dO_j, sdS and K / V by UMMA commits.

Note [Backward MMA order]: per step j (query block j of one query head):

    S^T_j  = K Q_j^T            after bwd_s_dp empty: the compute warps are done with step j-1
    dP^T_j = V dO_j^T           after bwd_dq empty: dQ_{j-1} (over dP^T) has been read out
                                                     -> commit bwd_s_dp full
    dV    += P^T_j dO_j         after bwd_ds full: P^T_j, dS^T_j in TMEM and dS_j in SMEM
    dK    += dS^T_j Q_j                              -> commit bwd_q empty (Q_j, dO_j read)
    dQ_j   = dS_j K                                  -> commit bwd_ds empty, bwd_dq full

TMEM regions are reused without extra waits where one thread's MMAs are ordered: dQ_j
overwrites dP^T after dK has read dS^T_j (which lies inside dP^T), and S^T_{j+1} overwrites
P^T_j after dV has read it; tcgen05 MMAs issued by one thread execute in issue order.

Under 2-CTA (Note [Backward 2-CTA] in bwd_config.py) the leader CTA's MMA warp issues the same
order for the pair (``_issue`` with ``use_2cta``), except that Q_j / dO_j are handed back
after dP^T_j (dV and dK read Q^T_j / dO^T_j from bwd_qt, waited for before dV_j and handed
back after dK_j), and dQ_j waits for both CTAs' dS at cluster scope.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Int32
from cutlass.cute.nvgpu import tcgen05

from fa_sm100.sm100.mma import advance
from fa_sm100.sm100.pipes import acquire_at_cluster_scope
from pipelines import record


@cute.jit
def _gemm(mma, acc, tA, tB, accumulate: Boolean):
    """acc (+)= A B over every k-block (run-time loop: one SMEM descriptor live)."""
    atom = cute.make_mma_atom(mma.op)
    atom.set(tcgen05.Field.ACCUMULATE, accumulate)
    for k in cutlass.range(cute.size(tA.shape[2]), unroll=1):
        cute.gemm(atom, acc, tA[None, None, k], tB[None, None, k], acc)
        atom.set(tcgen05.Field.ACCUMULATE, True)


@cute.jit
def _gemm_tmem_a(mma, acc, halves, tB, accumulate: Boolean):
    """acc (+)= A B with A in TMEM as two warpgroup halves (BwdTmem.tP / tdS): k-blocks
    [0, n/2) from the first, [n/2, n) from the second."""
    atom = cute.make_mma_atom(mma.op)
    atom.set(tcgen05.Field.ACCUMULATE, accumulate)
    n_k = cute.size(tB.shape[2])
    for h in cutlass.range_constexpr(2):
        for k in cutlass.range(h * n_k // 2, (h + 1) * n_k // 2, unroll=1):
            cute.gemm(atom, acc, halves[h][None, None, k], tB[None, None, k], acc)
            atom.set(tcgen05.Field.ACCUMULATE, True)


def _umma_reads(*regions):
    """Record the operands the next MMA reads: (region, pipeline whose stage it is or None)."""
    for region, stage_of in regions:
        record.access(region, "r", unit="umma", stage_of=stage_of)


@cute.jit
def mma(cfg, mmas, smem, tmem, pipes, prob):
    """Issue the MMAs of the work tile (Note [Backward MMA order]); under 2-CTA only the
    leader CTA's MMA warp issues them, for the pair (its peer's MMA warp only allocates
    TMEM)."""
    if cutlass.const_expr(cfg.use_2cta):
        # the recorded branch lets the protocol model build the peer's MMA warp too
        with record.branch("is_leader_cta"):
            if prob.n_block % cfg.cta_group == 0:
                _issue(cfg, mmas, smem, tmem, pipes, prob)
    else:
        _issue(cfg, mmas, smem, tmem, pipes, prob)


@cute.jit
def _issue(cfg, mmas, smem, tmem, pipes, prob):
    """The MMA warp's loop. Under 2-CTA (the leader's MMAs for the pair, Note [Backward 2-CTA]
    in bwd_config.py) the order is the same, with Q_j / dO_j (``bwd_q``, read by S^T and dP^T
    only) handed back once dP^T_j is issued, and Q^T_j / dO^T_j (``bwd_qt``, one stage, buffers
    of their own) waited for before dV_j and handed back after dK_j; dQ reads sdS and sKt."""
    pair = cfg.use_2cta
    # dV / dK's B and its pipeline: Q^T / dO^T views of the q stages, or under 2-CTA their
    # own one-stage buffers
    qt_pipe, sQt, sdOt, sKt = "bwd_q", "sQ", "sdO", "sK"
    if cutlass.const_expr(pair):
        qt_pipe, sQt, sdOt, sKt = "bwd_qt", "sQt", "sdOt", "sKt"
    tSrK = mmas.S.make_fragment_A(smem.sK)
    tSrQ = mmas.S.make_fragment_B(smem.sQ)  # (MMA, MMA_N, MMA_K, q_stage)
    tdPrV = mmas.dP.make_fragment_A(smem.sV)
    tdPrdO = mmas.dP.make_fragment_B(smem.sdO)
    tdVrdO = mmas.dV.make_fragment_B(smem.sdOt)
    tdKrQ = mmas.dK.make_fragment_B(smem.sQt)
    tdQrdS = mmas.dQ.make_fragment_A(smem.sdS)
    tdQrK = mmas.dQ.make_fragment_B(smem.sKt)
    index = Int32(0)
    phase = Int32(0)
    one_phase = Int32(0)  # the single-stage pipelines move together: one phase per step
    if prob.iters > 0:
        pipes.bwd_kv.consumer_wait(0, Int32(0))
        pipes.bwd_dkv.producer_acquire(0, Int32(1))
    with record.loop("steps"):
        for step in cutlass.range(prob.iters, unroll=1):
            qt_index = index
            if cutlass.const_expr(pair):
                qt_index = 0
            pipes.bwd_q.consumer_wait(index, phase)
            pipes.bwd_s_dp.producer_acquire(0, one_phase ^ 1)
            _umma_reads(("sK", None), ("sQ", "bwd_q"))
            record.access("S", "w", unit="umma")
            _gemm(mmas.S, tmem.tS, tSrK, tSrQ[None, None, None, index], False)
            pipes.bwd_dq.producer_acquire(0, one_phase ^ 1)
            _umma_reads(("sV", None), ("sdO", "bwd_q"))
            record.access("dP", "w", unit="umma")
            _gemm(mmas.dP, tmem.tdP, tdPrV, tdPrdO[None, None, None, index], False)
            pipes.bwd_s_dp.producer_commit(0, note="S^T, dP^T")
            if cutlass.const_expr(pair):
                pipes.bwd_q.consumer_release(index)
            pipes.bwd_ds.consumer_wait(0, one_phase)
            if cutlass.const_expr(pair):
                # the peer's dS stores into this CTA's sdS and its own into the peer's:
                # acquire what both CTAs' compute warps released at cluster scope
                acquire_at_cluster_scope(pipes.bwd_ds, 0, one_phase)
                pipes.bwd_qt.consumer_wait(0, one_phase)
            _umma_reads(("P0", None), ("P1", None), (sdOt, qt_pipe))
            record.access("dV", "w", unit="umma")
            _gemm_tmem_a(mmas.dV, tmem.tdV, tmem.tP, tdVrdO[None, None, None, qt_index],
                         step > 0)
            _umma_reads(("dS0", None), ("dS1", None), (sQt, qt_pipe))
            record.access("dK", "w", unit="umma")
            _gemm_tmem_a(mmas.dK, tmem.tdK, tmem.tdS, tdKrQ[None, None, None, qt_index],
                         step > 0)
            getattr(pipes, qt_pipe).consumer_release(qt_index)
            _umma_reads(("sdS", None), (sKt, None))
            record.access("dQ", "w", unit="umma")
            _gemm(mmas.dQ, tmem.tdQ, tdQrdS, tdQrK, False)
            pipes.bwd_ds.consumer_release(0)
            pipes.bwd_dq.producer_commit(0, note="dQ")
            one_phase = one_phase ^ 1
            index, phase = advance(index, phase, cfg.q_stage)
    if prob.iters > 0:
        pipes.bwd_kv.consumer_release(0)
        pipes.bwd_dkv.producer_commit(0, note="dK, dV")
