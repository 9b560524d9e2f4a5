"""Backward dQ role (warps 8-11): dQ_j out of TMEM into the float32 accumulator in global memory.

Consumes  dQ_j = dS_j K (``bwd_dq`` full): TMEM lane t holds query row ``m * 128 + t``; under
          2-CTA (Note [Backward 2-CTA] in bwd_config.py) the CTA's 64 rows summed over the
          pair's keys, folded: lane t holds row ``m * 128 + 64 r + t mod 64``, columns
          ``[c d / 2, (c + 1) d / 2)``, c = t div 64.
Produces  the accumulator rows of that query block: acc[b, head, row, :] += dQ_j[t, :] with
          one ``red.global.add.v4.f32`` per four columns; then hands the region back
          (``bwd_dq`` empty) so the next dP^T may overwrite it.

Rows past seqlen_q land in the accumulator's padding rows (it has the preprocess's padded row
count), which the postprocess never reads. Without ``deterministic`` the adds of the key
blocks of a query block arrive in any order (float32 sums that may differ in the last bits
from run to run); with it they take turns (Note [Deterministic dQ]).

Note [Deterministic dQ] (``Sm100BwdConfig.deterministic``): one int32 semaphore per (batch,
query head, query block), zeroed by the preprocess. The key blocks that add into query block
m are consecutive, n_first(m) .. (``bands.kv_block_range``'s first block: the sweeps of
``bands.q_block_range`` reach m from exactly those; 0 without a window, causal included, as
the SM90 backward's ``first_n_block``), and key block n's turn there is t = n - n_first(m).
Each of the four dQ warps adds its own 32 rows and takes its turn alone: lane 0 polls the
semaphore (acquire) until it reads at least 4 t, the warp adds, every lane fences
(``fence.acq_rel.gpu``), and lane 0 adds 1 (release). The semaphore reaches 4 t only once
all four warps of every earlier turn have released, and no later turn passes before all four
of turn t have (it stays below 4 (t + 1)), so every row's adds land in key-block order, and
dq is bitwise reproducible. GQA: only the CTAs of a query head's KV head add into its rows,
each walking its group's heads in the same order. No deadlock: a CTA waits only for lower
key blocks of its (KV head, batch), and those never wait for it (they are also launched
first: the key block is the grid's fastest index). Under 2-CTA the adders are pairs: pair p's
turn is p - n_first(m) div 2 (the pairs of consecutive key blocks are consecutive), and a turn
is eight releases, the four dQ warps of each CTA (``Sm100BwdConfig.dq_releases_per_turn``).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from fa_sm100.bands import kv_block_range, traced_bounds
from fa_sm100.sm100.bwd_compute import lane_reader
from fa_sm100.sm100.bwd_load import step_head_block
from pipelines import record

CHUNK = 16  # dQ columns per tcgen05.ld (the warpgroup's 64 registers: 32 spill)
VEC = 4  # float32 per red.global.add.v4.f32


@cute.jit
def dq_out(cfg, tmem, mdQacc, mdQsem, pipes, prob):
    tidx = cute.arch.thread_idx()[0] % 128
    lane = cute.arch.lane_idx()
    row_in_block, col0, cols = tidx, None, cfg.head_dim
    if cutlass.const_expr(cfg.use_2cta):
        # Note [Backward 2-CTA]: this CTA's dQ is query rows [64 r, 64 r + 64) (pair rank r)
        # over every head-dim column, folded into 128 lanes: lane t holds row t mod 64's
        # columns [c d / 2, (c + 1) d / 2), c = t div 64
        rows = cfg.m_block // cfg.cta_group
        cols = cfg.head_dim // cfg.cta_group
        row_in_block = prob.n_block % cfg.cta_group * rows + tidx % rows
        col0 = tidx // rows * cols
        thr, src, regs = lane_reader(tmem.tdQ_lanes, cols, CHUNK, tidx)
    else:
        thr, src, regs = lane_reader(tmem.tdQ[(None, None), 0, 0], cfg.head_dim, CHUNK, tidx)
    one_phase = Int32(0)
    with record.loop("steps"):
        for step in cutlass.range(prob.iters, unroll=1):
            head, m = step_head_block(cfg, prob, step)
            sem_ptr = None
            if cutlass.const_expr(cfg.deterministic):
                # Note [Deterministic dQ]: poll while the MMAs of this step run
                sem_ptr = mdQsem[prob.batch, head, None].iterator + m
                _wait_for_turn(sem_ptr, _turn(cfg, prob, m) * cfg.dq_releases_per_turn(), lane)
            pipes.bwd_dq.consumer_wait(0, one_phase)
            record.access("dQ", "r")
            row = mdQacc[prob.batch, head, m * cfg.m_block + row_in_block, None].iterator
            if cutlass.const_expr(col0 is not None):
                row = row + col0
            for c in cutlass.range_constexpr(cols // CHUNK):
                r = cute.make_rmem_tensor(regs[None, None, c].shape, Float32)
                cute.copy(thr, src[None, None, c], r)
                cute.arch.fence_view_async_tmem_load()
                vecs = cute.logical_divide(cute.make_tensor(r.iterator, cute.make_layout(CHUNK)),
                                           cute.make_layout(VEC))
                for i in cutlass.range_constexpr(CHUNK // VEC):
                    cute.arch.red(row + c * CHUNK + i * VEC, vecs[None, i].load().ir_value(),
                                  op="add", dtype="f32", sem="relaxed", scope="gpu")
            pipes.bwd_dq.consumer_release(0, note="dQ read")
            if cutlass.const_expr(cfg.deterministic):
                _end_turn(sem_ptr, lane)
            one_phase = one_phase ^ 1


def _turn(cfg, prob, m):
    """This CTA's key block's place among the key blocks that add into query block ``m``
    (Note [Deterministic dQ]): n - n_first(m)."""
    left, right = traced_bounds(cfg, prob.window)
    if cutlass.const_expr(cfg.use_2cta):
        # the adders are pairs (Note [Backward 2-CTA]): those that reach query block m are the
        # pairs of the consecutive key blocks from n_first(m), consecutive from n_first div 2
        if cutlass.const_expr(left is None):
            return prob.n_block // cfg.cta_group
        first, _ = kv_block_range(m * cfg.m_block, cfg.m_block, cfg.n_block, prob.seqlen_q,
                                  prob.seqlen_k, left, right, imax=cutlass.max,
                                  imin=cutlass.min)
        return prob.n_block // cfg.cta_group - first // cfg.cta_group
    if cutlass.const_expr(left is None):  # no window: every key block from 0 on
        return prob.n_block
    first, _ = kv_block_range(m * cfg.m_block, cfg.m_block, cfg.n_block, prob.seqlen_q,
                              prob.seqlen_k, left, right, imax=cutlass.max, imin=cutlass.min)
    return prob.n_block - first


@cute.jit
def _wait_for_turn(sem_ptr, at_least, lane):
    """Lane 0 polls the semaphore (acquire, GPU scope) until it holds ``at_least``; the warp
    waits for lane 0."""
    if lane == 0:
        seen = cute.arch.load(sem_ptr, Int32, sem="acquire", scope="gpu")
        while seen < at_least:
            seen = cute.arch.load(sem_ptr, Int32, sem="acquire", scope="gpu")
    cute.arch.sync_warp()


@cute.jit
def _end_turn(sem_ptr, lane):
    """Once every lane's adds are ordered before it (each lane fences, the warp meets), lane
    0 adds 1 to the semaphore with release semantics: this warp's part of the turn is done."""
    cute.arch.fence_acq_rel_gpu()
    cute.arch.sync_warp()
    if lane == 0:
        cute.arch.red(sem_ptr, Int32(1), op="add", dtype="s32", sem="release", scope="gpu")
