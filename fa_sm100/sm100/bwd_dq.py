"""Backward dQ role (warps 8-11): dQ_j out of TMEM into the float32 accumulator in global memory.

Consumes  dQ_j = dS_j K (``bwd_dq`` full): TMEM lane t holds query row ``m * 128 + t``.
Produces  the accumulator rows of that query block: acc[b, head, row, :] += dQ_j[t, :] with
          one ``red.global.add.v4.f32`` per four columns; then hands the region back
          (``bwd_dq`` empty) so the next dP^T may overwrite it.

Rows past seqlen_q land in the accumulator's padding rows (it has the preprocess's padded row
count), which the postprocess never reads. The adds of the key blocks of a query block arrive
in any order (float32 sums that may differ in the last bits from run to run).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from fa_sm100.sm100.bwd_compute import lane_reader
from fa_sm100.sm100.bwd_load import step_head_block
from pipelines import record

CHUNK = 16  # dQ columns per tcgen05.ld (the warpgroup's 64 registers: 32 spill)
VEC = 4  # float32 per red.global.add.v4.f32


@cute.jit
def dq_out(cfg, tmem, mdQacc, mdQsem, pipes, prob):
    tidx = cute.arch.thread_idx()[0] % 128
    thr, src, regs = lane_reader(tmem.tdQ[(None, None), 0, 0], cfg.head_dim, CHUNK, tidx)
    one_phase = Int32(0)
    with record.loop("steps"):
        for step in cutlass.range(prob.iters, unroll=1):
            head, m = step_head_block(cfg, prob, step)
            pipes.bwd_dq.consumer_wait(0, one_phase)
            record.access("dQ", "r")
            row = mdQacc[prob.batch, head, m * cfg.m_block + tidx, None]
            for c in cutlass.range_constexpr(cfg.head_dim // CHUNK):
                r = cute.make_rmem_tensor(regs[None, None, c].shape, Float32)
                cute.copy(thr, src[None, None, c], r)
                cute.arch.fence_view_async_tmem_load()
                vecs = cute.logical_divide(cute.make_tensor(r.iterator, cute.make_layout(CHUNK)),
                                           cute.make_layout(VEC))
                for i in cutlass.range_constexpr(CHUNK // VEC):
                    cute.arch.red(row.iterator + c * CHUNK + i * VEC, vecs[None, i].load().ir_value(),
                                  op="add", dtype="f32", sem="relaxed", scope="gpu")
            pipes.bwd_dq.consumer_release(0, note="dQ read")
            one_phase = one_phase ^ 1
