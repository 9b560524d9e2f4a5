"""MMA role (warp 12): one thread issues every tcgen05 MMA of the CTA pair.

Under 2-CTA only the leader CTA's MMA warp issues (cta_group::2: one 256 x 128 x 16 MMA reads
both CTAs' SMEM and writes both CTAs' TMEM); the peer's MMA warp only allocates TMEM.

Consumes  sQ (``q``), the K/V ring (``kv``), P_i in TMEM (``s_p_o`` empty + ``p_lastsplit``),
          O_i free again (``o_acc`` empty, released by the correction after the epilogue read).
Produces  S_i (``s_p_o`` full), the final O_i of a tile (``o_acc`` full); frees sQ and K/V
          stages by UMMA commits (they arrive once the MMAs that read them completed).

Per work tile with n K/V blocks visited right to left (b_0 = n-1, ..., b_{n-1} = 0):

    S_0 = Q_0 K[b_0]^T, S_1 = Q_1 K[b_0]^T                      (commit s_p_o(0), s_p_o(1))
    for k in 0 .. n-2:
        O_0 += P_0 V[b_k]  (waits s_p_o(0): P_0 first part + O_0 rescaled; p_lastsplit(0))
        S_0 = Q_0 K[b_k+1]^T                                    (commit s_p_o(0))
        O_1 += P_1 V[b_k];  S_1 = Q_1 K[b_k+1]^T                (same for stage 1)
    O_0 += P_0 V[b_n-1], O_1 += P_1 V[b_n-1]                    (commit o_acc(0), o_acc(1))

S_i of the next block overwrites the TMEM columns P_i aliases; tcgen05 MMAs of one thread
execute in order, so the PV MMA reading P_i finishes first.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Int32
from cutlass.cute.nvgpu import tcgen05

from fa_sm100.sm100 import masking
from fa_sm100.sm100.scheduler import tile_problem
from pipelines import record

MMA_K = 16  # K of one tcgen05 f16/bf16 MMA instruction


@cute.jit
def _gemm_s(tiled_mma, tS, tSrQ, tSrK):
    """S = Q K^T over all k-blocks of the head dim (overwrites S).

    The k-block loops here are run-time loops: the SMEM descriptor of each k-block is derived
    in the loop, so the MMA warp (48 registers) keeps only the base descriptors live."""
    atom = cute.make_mma_atom(tiled_mma.op)  # a local atom: its ACCUMULATE field is per call
    atom.set(tcgen05.Field.ACCUMULATE, False)
    for k in cutlass.range(cute.size(tSrQ.shape[2]), unroll=1):
        cute.gemm(atom, tS, tSrQ[None, None, k], tSrK[None, None, k], tS)
        atom.set(tcgen05.Field.ACCUMULATE, True)


@cute.jit
def _gemm_pv(cfg, stage: cutlass.Constexpr, tiled_mma, tO, tOrP, tOrV, accumulate: Boolean,
             pipes, split_phase: Int32):
    """O += P V over the n_block keys; with split P the k-blocks past split_p_col wait for
    ``p_lastsplit`` first (Note [Split-P arrival] in softmax.py)."""
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(tcgen05.Field.ACCUMULATE, accumulate)
    n_k = cute.size(tOrP.shape[2])
    split_k = cfg.split_p_col // MMA_K if cfg.split_p else n_k
    for k in cutlass.range(split_k, unroll=1):
        cute.gemm(atom, tO, tOrP[None, None, k], tOrV[None, None, k], tO)
        atom.set(tcgen05.Field.ACCUMULATE, True)
    if cutlass.const_expr(cfg.split_p):
        pipes.p_lastsplit.consumer_wait(stage, split_phase, stage_hint=stage)
        record.access(f"P{stage}", "r", unit="umma", cols=p_columns(cfg))
        for k in cutlass.range(split_k, n_k, unroll=1):
            cute.gemm(atom, tO, tOrP[None, None, k], tOrV[None, None, k], tO)
        pipes.p_lastsplit.consumer_release(stage, stage_hint=stage)


def p_columns(cfg) -> tuple[int, int]:
    """(TMEM columns of the first P split, TMEM columns of P): 16-bit P packs 2 keys a column."""
    per_col = 4 // cfg.dtype_bytes
    total = cfg.n_block // per_col
    return (cfg.split_p_col // per_col if cfg.split_p else total), total


@cute.jit
def advance(kv_index: Int32, kv_phase: Int32, stages: cutlass.Constexpr):
    """The next (index, phase) of a ring of ``stages`` stages (the phase flips on wrap)."""
    nxt = kv_index + 1
    nxt_phase = kv_phase
    if nxt == stages:
        nxt = Int32(0)
        nxt_phase = kv_phase ^ 1
    return nxt, nxt_phase


@cute.jit
def _s_mma(cfg, stage: cutlass.Constexpr, tiled_mma_qk, tmem, tSrQ, tSrK, ki: Int32, pipes,
           kv_back: cutlass.Constexpr):
    record.access(f"sQ{stage}", "r", unit="umma")
    record.access("sKV", "r", unit="umma", stage_of="kv" if kv_back == 0 else f"kv-{kv_back}")
    record.access(f"S{stage}", "w", unit="umma")
    _gemm_s(tiled_mma_qk, tmem.tS[stage], tSrQ[None, None, None, stage], tSrK[None, None, None, ki])
    pipes.s_p_o.producer_commit(stage, stage_hint=stage, note="S full")


@cute.jit
def _pv_mma(cfg, stage: cutlass.Constexpr, tiled_mma_pv, tmem, tOrV, vi: Int32, accumulate,
            pipes, spo_phase: Int32, split_phase: Int32, v_back: cutlass.Constexpr):
    first, total = p_columns(cfg)
    pipes.s_p_o.producer_acquire(stage, spo_phase, stage_hint=stage)
    record.access(f"P{stage}", "r", unit="umma", cols=(0, first))
    record.access("sKV", "r", unit="umma", stage_of="kv" if v_back == 0 else f"kv-{v_back}")
    record.access(f"O{stage}", "w", unit="umma")
    _gemm_pv(cfg, stage, tiled_mma_pv, tmem.tO[stage], tmem.tP[stage], tOrV[None, None, None, vi],
             accumulate, pipes, split_phase)


@cute.jit
def mma(cfg, tiled_mma_qk, tiled_mma_pv, smem, tmem, pipes, prob, sched, is_leader):
    """Issue the MMAs of every work tile (see the module docstring for the order)."""
    tSrQ = tiled_mma_qk.make_fragment_A(smem.sQ)  # (MMA, MMA_M, MMA_K, q_stage)
    tSrK = tiled_mma_qk.make_fragment_B(smem.sK)  # (MMA, MMA_N, MMA_K, kv_stage)
    tOrV = tiled_mma_pv.make_fragment_B(smem.sV)  # (MMA, MMA_N, MMA_K, kv_stage)
    kvs = cfg.kv_stage
    q_phase = Int32(0)
    kv_index = Int32(0)
    kv_phase = Int32(0)
    spo_phase = Int32(0)  # s_p_o: the MMA commits S before its first acquire of P
    split_phase = Int32(0)
    oacc_phase = Int32(1)
    # The recorded branch lets the protocol model build the non-leader CTA's MMA warp too:
    # it has joined the TMEM_ALLOC named barrier (kernel.py) and issues nothing here.
    with record.branch("is_leader_cta"):
        if is_leader:
            tile = sched.initial()
            num_tiles = sched.num_tiles
            with record.loop("work_tiles"):
                while tile < num_tiles:
                    wt = sched.decode(tile)
                    n_min, n_max = masking.n_block_range(cfg, tile_problem(prob, wt),
                                                         wt.m_block)
                    n_blocks = n_max - n_min
                    for stage in cutlass.range_constexpr(cfg.q_stage):
                        pipes.q.consumer_wait(stage, q_phase, stage_hint=stage)
                    q_phase ^= 1
                    pipes.kv.consumer_wait(kv_index, kv_phase)  # K[n-1]
                    for stage in cutlass.range_constexpr(cfg.q_stage):
                        _s_mma(cfg, stage, tiled_mma_qk, tmem, tSrQ, tSrK, kv_index, pipes, 0)
                    pipes.kv.consumer_release(kv_index)
                    kv_index, kv_phase = advance(kv_index, kv_phase, kvs)
                    for stage in cutlass.range_constexpr(cfg.q_stage):
                        # The previous tile's O_i has been read out by the correction warps.
                        pipes.o_acc.producer_acquire(stage, oacc_phase, stage_hint=stage)
                    with record.loop("n_blocks - 1"):
                        for i in cutlass.range(n_blocks - 1, unroll=1):
                            pipes.kv.consumer_wait(kv_index, kv_phase)  # V[j]
                            vi = kv_index
                            kv_index, kv_phase = advance(kv_index, kv_phase, kvs)
                            if cutlass.const_expr(kvs == 1):
                                # One K/V stage: V[j] must be handed back before K[j-1] can land.
                                for stage in cutlass.range_constexpr(cfg.q_stage):
                                    _pv_mma(cfg, stage, tiled_mma_pv, tmem, tOrV, vi, i > 0, pipes,
                                            spo_phase, split_phase, 0)
                                pipes.kv.consumer_release(vi)
                                pipes.kv.consumer_wait(kv_index, kv_phase)  # K[j-1]
                                for stage in cutlass.range_constexpr(cfg.q_stage):
                                    _s_mma(cfg, stage, tiled_mma_qk, tmem, tSrQ, tSrK, kv_index,
                                           pipes, 0)
                            else:
                                for stage in cutlass.range_constexpr(cfg.q_stage):
                                    _pv_mma(cfg, stage, tiled_mma_pv, tmem, tOrV, vi, i > 0, pipes,
                                            spo_phase, split_phase, 0 if stage == 0 else 1)
                                    if cutlass.const_expr(stage == cfg.q_stage - 1):
                                        pipes.kv.consumer_release(vi)  # last PV reading V[j] issued
                                    if cutlass.const_expr(stage == 0):
                                        pipes.kv.consumer_wait(kv_index, kv_phase)  # K[j-1]
                                    _s_mma(cfg, stage, tiled_mma_qk, tmem, tSrQ, tSrK, kv_index,
                                           pipes, 0)
                            pipes.kv.consumer_release(kv_index)
                            kv_index, kv_phase = advance(kv_index, kv_phase, kvs)
                            spo_phase ^= 1
                            split_phase ^= 1
                    for stage in cutlass.range_constexpr(cfg.q_stage):
                        pipes.q.consumer_release(stage, stage_hint=stage)
                    pipes.kv.consumer_wait(kv_index, kv_phase)  # V[0]
                    for stage in cutlass.range_constexpr(cfg.q_stage):
                        _pv_mma(cfg, stage, tiled_mma_pv, tmem, tOrV, kv_index, n_blocks > 1, pipes,
                                spo_phase, split_phase, 0)
                        pipes.o_acc.producer_commit(stage, stage_hint=stage, note="O final")
                    pipes.kv.consumer_release(kv_index)
                    kv_index, kv_phase = advance(kv_index, kv_phase, kvs)
                    spo_phase ^= 1
                    split_phase ^= 1
                    oacc_phase ^= 1
                    tile = sched.next(tile)
