"""Load role (warp 14): TMA copies of Q, K and V from global memory into SMEM.

Produces  sQ (``q`` pipeline, one stage per Q stage) and the K/V ring (``kv`` pipeline).
Per work tile, in the design's reverse order:

    K[n-1], Q[0], Q[1], V[n-1], then K[j], V[j] for j = n-2 .. 0

K first lets S0 = Q0 K[n-1]^T start as soon as Q0 lands. Under 2-CTA each CTA loads its own
128 rows of Q and its half of every K and V tile; the bytes of both CTAs complete the
leader CTA's barrier phase (expect-tx set once for the pair). Rows past the sequence ends
arrive as zeros (TMA out-of-bounds fill).
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.cute.nvgpu import cpasync

from fa_sm100.sm100 import masking
from fa_sm100.sm100.pipes import producer_tail
from fa_sm100.sm100.scheduler import tile_problem
from fa_sm100.varlen import ragged_tile_rows
from pipelines import record


@dataclass(frozen=True)
class LoadViews:
    """TMA partitions of one work tile: tQgQ (TMA, m tiles), tKgK / tVgV (TMA, n blocks)."""

    tQsQ: cute.Tensor
    tQgQ: cute.Tensor
    tKsK: cute.Tensor
    tKgK: cute.Tensor
    tVsV: cute.Tensor
    tVgV: cute.Tensor


def make_load_views(cfg, atoms, gmem, smem, thr_mma_qk, thr_mma_pv, head, batch,
                    prob=None) -> LoadViews:
    """``prob``: the tile's Problem under varlen (its sequence's first rows), else None."""
    head_kv = head // cfg.qhead_per_kvhead
    mma_m = cfg.cta_group * cfg.m_block
    mQ = gmem.mQ[None, None, head, batch]
    mK = gmem.mK[None, None, head_kv, batch]
    mV = gmem.mV[None, None, head_kv, batch]  # (d, s)
    if cutlass.const_expr(cfg.varlen):  # fa_sm100.varlen: one packed "batch"
        mQ = cute.domain_offset((prob.q_off, 0), gmem.mQ[None, None, head, 0])
        # K and V through their ragged views: rows past the used keys load as zeros
        mK = ragged_tile_rows(gmem.mK[None, None, head_kv, None], prob.seqlen_k, prob.k_off)
        mV = ragged_tile_rows(gmem.mV[None, None, head_kv, None], prob.seqlen_k, prob.k_off,
                              row_mode=1)
    gQ = cute.local_tile(mQ, (mma_m, cfg.head_dim), (None, 0))
    tSgQ = thr_mma_qk.partition_A(gQ)  # (MMA, MMA_M, MMA_K, m tiles)
    one = cute.make_layout(1)
    tQsQ, tQgQ = cpasync.tma_partition(
        atoms.q, 0, one, cute.group_modes(smem.sQ, 0, 3), cute.group_modes(tSgQ, 0, 3))
    return LoadViews(tQsQ, tQgQ, *_kv_partitions(cfg, atoms, smem, thr_mma_qk, thr_mma_pv, mK,
                                                 mV))


def _kv_partitions(cfg, atoms, smem, thr_mma_qk, thr_mma_pv, mK, mV):
    """(tKsK, tKgK, tVsV, tVgV): the TMA partitions of K (s, d) and V (d, s) by key block."""
    gK = cute.local_tile(mK, (cfg.n_block, cfg.head_dim), (None, 0))
    gV = cute.local_tile(mV, (cfg.head_dim_v, cfg.n_block), (0, None))
    tSgK = thr_mma_qk.partition_B(gK)  # (MMA, MMA_N, MMA_K, n blocks)
    tOgV = thr_mma_pv.partition_B(gV)  # (MMA, MMA_N, MMA_K, n blocks)
    one = cute.make_layout(1)
    tKsK, tKgK = cpasync.tma_partition(
        atoms.k, 0, one, cute.group_modes(smem.sK, 0, 3), cute.group_modes(tSgK, 0, 3))
    tVsV, tVgV = cpasync.tma_partition(
        atoms.v, 0, one, cute.group_modes(smem.sV, 0, 3), cute.group_modes(tOgV, 0, 3))
    return tKsK, tKgK, tVsV, tVgV


def _paged_block(cfg, atoms, gmem, smem, thr_mma_qk, thr_mma_pv, head_kv, batch, seqlen_k,
                 n_blk, varlen):
    """A paged cache's key block ``n_blk`` of sequence ``batch`` (cfg.page_size): its page
    from the page table, seen through the ragged views from the block's first row, so that
    the rows past the sequence's keys load as zeros. Returns (tKgK, tVgV) whose block 0 is it.
    Traced inline."""
    rows = n_blk * cfg.n_block
    slot = rows // cfg.page_size
    table = varlen[3]
    per_seq = table.shape[0] // (varlen[0].shape[0] - 1)  # the table's row length
    page = table[batch * per_seq + slot]
    first = page * cfg.page_size + (rows - slot * cfg.page_size)
    valid = cutlass.min(seqlen_k - rows, cfg.n_block)
    mK = ragged_tile_rows(gmem.mK[None, None, head_kv, None], valid, first)
    mV = ragged_tile_rows(gmem.mV[None, None, head_kv, None], valid, first, row_mode=1)
    _, tKgK, _, tVgV = _kv_partitions(cfg, atoms, smem, thr_mma_qk, thr_mma_pv, mK, mV)
    return tKgK, tVgV


def _block_source(v: LoadViews, paged, n_blk):
    """(K source, V source, block index) of key block ``n_blk``: the work tile's partitions
    and the block, or with a paged cache (cfg.page_size) the block's own page and block 0.
    ``paged``: (cfg, atoms, gmem, smem, thr_mma_qk, thr_mma_pv, work tile, its Problem).
    Traced inline."""
    cfg, atoms, gmem, smem, thr_mma_qk, thr_mma_pv, wt, prob = paged
    if not cfg.page_size:
        return v.tKgK, v.tVgV, n_blk
    tKgK, tVgV = _paged_block(cfg, atoms, gmem, smem, thr_mma_qk, thr_mma_pv,
                              wt.head // cfg.qhead_per_kvhead, wt.batch, prob.seqlen_k, n_blk,
                              prob.varlen)
    return tKgK, tVgV, Int32(0)


@cute.jit
def _load_kv(atom, src, dst, n_blk: Int32, kv_index: Int32, kv_phase: Int32, tx: int, pipes,
             what: str):
    pipes.kv.producer_acquire(kv_index, kv_phase, expected_tx=tx)
    record.access("sKV", "w", unit="tma", done_by="kv", stage_of="kv", note=what)
    cute.copy(atom, src[None, n_blk], dst[None, kv_index], tma_bar_ptr=pipes.kv.full_barrier(kv_index))
    pipes.kv.producer_commit(kv_index)  # TMA: the bytes complete the phase (records only)
    kv_index = kv_index + 1
    if kv_index == pipes.kv.stages:
        kv_index = Int32(0)
        kv_phase = kv_phase ^ 1
    return kv_index, kv_phase


@cute.jit
def load(cfg, atoms, tx, gmem, smem, thr_mma_qk, thr_mma_pv, pipes, prob, sched):
    """TMA producer for every work tile of this CTA (see the module docstring for the order)."""
    q_phase = Int32(1)
    kv_index = Int32(0)
    kv_phase = Int32(1)
    tile = sched.initial()
    num_tiles = sched.num_tiles
    with record.loop("work_tiles"):
        while tile < num_tiles:
            wt = sched.decode(tile)
            tile_prob = tile_problem(prob, wt)
            v = make_load_views(cfg, atoms, gmem, smem, thr_mma_qk, thr_mma_pv, wt.head, wt.batch,
                                tile_prob)
            n_min, n_max = masking.n_block_range(cfg, tile_prob, wt.m_block)
            paged = (cfg, atoms, gmem, smem, thr_mma_qk, thr_mma_pv, wt, tile_prob)
            src_k, src_v, idx = _block_source(v, paged, n_max - 1)
            kv_index, kv_phase = _load_kv(atoms.k, src_k, v.tKsK, idx, kv_index, kv_phase,
                                          tx["k"], pipes, "K")
            for stage in cutlass.range_constexpr(cfg.q_stage):
                pipes.q.producer_acquire(stage, q_phase, stage_hint=stage)
                record.access(f"sQ{stage}", "w", unit="tma", done_by="q")
                cute.copy(atoms.q, v.tQgQ[None, wt.m_block * cfg.q_stage + stage],
                          v.tQsQ[None, stage], tma_bar_ptr=pipes.q.full_barrier(stage))
                pipes.q.producer_commit(stage, stage_hint=stage)
            q_phase ^= 1
            kv_index, kv_phase = _load_kv(atoms.v, src_v, v.tVsV, idx, kv_index, kv_phase,
                                          tx["v"], pipes, "V")
            with record.loop("n_blocks - 1"):
                for i in cutlass.range(n_max - n_min - 1, unroll=1):
                    src_k, src_v, idx = _block_source(v, paged, n_max - 2 - i)
                    kv_index, kv_phase = _load_kv(atoms.k, src_k, v.tKsK, idx, kv_index,
                                                  kv_phase, tx["k"], pipes, "K")
                    kv_index, kv_phase = _load_kv(atoms.v, src_v, v.tVsV, idx, kv_index,
                                                  kv_phase, tx["v"], pipes, "V")
            tile = sched.next(tile)
    producer_tail(pipes.kv, kv_index, kv_phase)
    producer_tail(pipes.q, Int32(0), q_phase)
