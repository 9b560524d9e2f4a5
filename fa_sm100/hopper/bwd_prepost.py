"""Backward preprocess and postprocess kernels (SM90; plain CUDA-core code, no tensor cores).

Preprocess, one thread per query row of one (batch, head):
    Delta[b, h, i] = sum_d O[b, i, h, d] * dO[b, i, h, d]           (float32)
    LSE2[b, h, i]  = LSE[b, h, i] * log2(e), with -inf (fully masked row) -> +inf
and on the padding rows seqlen_q <= i < seqlen_q_pad: Delta = 0, LSE2 = +inf, so that the main
kernel's P = exp2(S * scale_log2 - LSE2) is exactly 0 there without any row predicate.

Postprocess, one thread per output row:
    out[b, i, h, :] = sum_{g < G} acc[b, h * G + g, i, :]   converted to the output dtype
G = 1 for dQ (float32 accumulator -> input dtype and BSHD layout) and for GQA dK/dV reduced
with atomics; G = qhead_per_kvhead for GQA dK/dV kept in per-query-head buffers (the sum runs
in a fixed order, so it is deterministic).
"""

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32

ROWS_PER_CTA = 128
LOG2_E = math.log2(math.e)


class BwdPreprocess:
    """Delta = rowsum(O * dO) and LSE in log2 units, padded (see the module docstring)."""

    def __init__(self, head_dim_v: int):
        self.hdimv = head_dim_v

    @cute.jit
    def __call__(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor,
                 mLSE2: cute.Tensor, mDelta: cute.Tensor, stream):
        # mO, mdO: (batch, seqlen_q, heads, hdimv); mLSE: (batch, heads, seqlen_q) f32;
        # mLSE2, mDelta: (batch, heads, seqlen_q_pad) f32
        grid_x = cute.ceil_div(mLSE2.shape[2], ROWS_PER_CTA)
        self.kernel(mO, mdO, mLSE, mLSE2, mDelta).launch(
            grid=[grid_x, mO.shape[2], mO.shape[0]], block=[ROWS_PER_CTA, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mO, mdO, mLSE, mLSE2, mDelta):
        tidx, _, _ = cute.arch.thread_idx()
        bx, head, batch = cute.arch.block_idx()
        row = bx * ROWS_PER_CTA + tidx
        seqlen_q = mO.shape[1]
        if row < mLSE2.shape[2]:
            delta = Float32(0.0)
            lse2 = Float32.inf
            if row < seqlen_q:
                rO = cute.make_rmem_tensor((self.hdimv,), mO.element_type)
                rdO = cute.make_rmem_tensor((self.hdimv,), mdO.element_type)
                cute.autovec_copy(mO[batch, row, head, None], rO)
                cute.autovec_copy(mdO[batch, row, head, None], rdO)
                o = rO.load().to(Float32)
                do = rdO.load().to(Float32)
                delta = (o * do).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                lse = mLSE[batch, head, row]
                if lse != -Float32.inf:
                    lse2 = lse * LOG2_E
            mDelta[batch, head, row] = delta
            mLSE2[batch, head, row] = lse2


class BwdPostprocess:
    """out (batch, seqlen, heads_out, hdim) = sum over groups of acc (batch, heads_acc,
    seqlen_pad, pitch >= hdim)."""

    def __init__(self, head_dim: int, group: int):
        self.hdim = head_dim
        self.group = group

    def _acc_row(self, mAcc, batch, head, row):
        """The first ``hdim`` floats of one accumulator row (rows may be padded)."""
        return cute.make_tensor(mAcc[batch, head, row, None].iterator, cute.make_layout(self.hdim))

    @cute.jit
    def __call__(self, mAcc: cute.Tensor, mOut: cute.Tensor, stream):
        grid_x = cute.ceil_div(mOut.shape[1], ROWS_PER_CTA)
        self.kernel(mAcc, mOut).launch(
            grid=[grid_x, mOut.shape[2], mOut.shape[0]], block=[ROWS_PER_CTA, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mAcc, mOut):
        tidx, _, _ = cute.arch.thread_idx()
        bx, head, batch = cute.arch.block_idx()
        row = bx * ROWS_PER_CTA + tidx
        if row < mOut.shape[1]:
            total = cute.make_rmem_tensor((self.hdim,), Float32)
            cute.autovec_copy(self._acc_row(mAcc, batch, head * self.group, row), total)
            for g in cutlass.range_constexpr(1, self.group):
                part = cute.make_rmem_tensor((self.hdim,), Float32)
                cute.autovec_copy(self._acc_row(mAcc, batch, head * self.group + g, row), part)
                total.store(total.load() + part.load())
            out = cute.make_rmem_tensor((self.hdim,), mOut.element_type)
            out.store(total.load().to(mOut.element_type))
            cute.autovec_copy(out, mOut[batch, row, head, None])
