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
from cutlass.cute.nvgpu import tcgen05

from fa_sm100.sm100.bwd_load import step_head_block
from pipelines import record

CHUNK = 16  # dQ columns per tcgen05.ld (72 registers: a larger chunk spills)
VEC = 4  # float32 per red.global.add.v4.f32


@cute.jit
def dq_out(cfg, tmem, mdQacc, mdQsem, pipes, prob):
    tidx = cute.arch.thread_idx()[0] % 128
    acc = tmem.tdQ[(None, None), 0, 0]
    region = cute.make_tensor(acc.iterator,
                              cute.composition(acc.layout, cute.make_layout((128, cfg.head_dim))))
    atom = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(CHUNK)), Float32)
    thr = tcgen05.make_tmem_copy(atom, region).get_slice(tidx)
    src = thr.partition_S(region)
    regs = thr.partition_D(cute.make_identity_tensor((128, cfg.head_dim)))
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
