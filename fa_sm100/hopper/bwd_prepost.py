"""Backward preprocess and postprocess kernels (SM90; plain CUDA-core code, no tensor cores).

Preprocess, per query row of one (batch, head):
    Delta[b, h, i] = sum_d O[b, i, h, d] * dO[b, i, h, d]           (float32)
    LSE2[b, h, i]  = LSE[b, h, i] * log2(e), with -inf (fully masked row) -> +inf
and on the padding rows seqlen_q <= i < seqlen_q_pad: Delta = 0, LSE2 = +inf, so that the main
kernel's P = exp2(S * scale_log2 - LSE2) is exactly 0 there without any row predicate.

dQ postprocess (``DqPostprocess``), per query block of one (batch, head):
    dq[b, rows, h, :] = softmax_scale * acc[b, h, block]   converted to the input dtype
where the accumulator block is in fragment order (Note [dQ in fragment order] in
bwd_store.py): 256 threads stand in for the main kernel's MMA threads, each loads its own
dq_groups x 16 bytes (coalesced) and writes them to the rows and columns the same tiled MMA
(``dq_tiled_mma``) assigns, two columns (4 bytes) per store; a transposed accumulator
(tile_m 80: adjacent registers are adjacent queries) is stored 2 bytes per element. The scale
is applied here because the main kernel leaves it out of its per-block dQ tiles.

GQA dK/dV postprocess (``BwdPostprocess``), per output row:
    out[b, i, h, :] = scale * sum_{g < G} acc[b, h * G + g, i, :]   converted to the output dtype
G = 1 for dK/dV reduced with atomics; G = qhead_per_kvhead for dK/dV kept in per-query-head
buffers (the sum runs in a fixed order, so it is deterministic); they arrive scaled (scale 1).

The preprocess and ``BwdPostprocess`` give a row to ``THREADS_PER_ROW`` adjacent threads, each
owning head_dim / 16 contiguous columns, so a warp reads two whole rows per access
(coalesced); the preprocess sums its partial dot products with butterfly shuffles inside the
16 lanes of a row.
"""

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from fa_sm100.hopper.bwd_store import dq_fragment_view, dq_registers, dq_tile_shape, dq_tiled_mma
from fa_sm100.hopper.config import WARPGROUP_THREADS

THREADS_PER_ROW = 16
CTA_THREADS = 256
ROWS_PER_CTA = CTA_THREADS // THREADS_PER_ROW
LOG2_E = math.log2(math.e)


def _row_part(row, part: int, cols: int):
    """Columns [part * cols, (part + 1) * cols) of a 1-D row tensor."""
    return cute.local_tile(row, (cols,), (part,))


class BwdPreprocess:
    """Delta = rowsum(O * dO) and LSE in log2 units, padded (see the module docstring)."""

    def __init__(self, head_dim_v: int):
        assert head_dim_v % THREADS_PER_ROW == 0, head_dim_v
        self.hdimv = head_dim_v
        self.cols = head_dim_v // THREADS_PER_ROW

    @cute.jit
    def __call__(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor,
                 mLSE2: cute.Tensor, mDelta: cute.Tensor, stream):
        # mO, mdO: (batch, seqlen_q, heads, hdimv); mLSE: (batch, heads, seqlen_q) f32;
        # mLSE2, mDelta: (batch, heads, seqlen_q_pad) f32
        grid_x = cute.ceil_div(mLSE2.shape[2], ROWS_PER_CTA)
        self.kernel(mO, mdO, mLSE, mLSE2, mDelta).launch(
            grid=[grid_x, mO.shape[2], mO.shape[0]], block=[CTA_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mO, mdO, mLSE, mLSE2, mDelta):
        tidx, _, _ = cute.arch.thread_idx()
        bx, head, batch = cute.arch.block_idx()
        row = bx * ROWS_PER_CTA + tidx // THREADS_PER_ROW
        part = tidx % THREADS_PER_ROW
        seqlen_q = mO.shape[1]
        # every lane of a row takes part in the shuffles, so only the stores are predicated
        delta = Float32(0.0)
        if row < seqlen_q:
            rO = cute.make_rmem_tensor((self.cols,), mO.element_type)
            rdO = cute.make_rmem_tensor((self.cols,), mdO.element_type)
            cute.autovec_copy(_row_part(mO[batch, row, head, None], part, self.cols), rO)
            cute.autovec_copy(_row_part(mdO[batch, row, head, None], part, self.cols), rdO)
            delta = (rO.load().to(Float32) * rdO.load().to(Float32)).reduce(
                cute.ReductionOp.ADD, Float32(0.0), 0)
        for offset in cutlass.range_constexpr(THREADS_PER_ROW.bit_length() - 2, -1, -1):
            delta = delta + cute.arch.shuffle_sync_bfly(delta, offset=1 << offset)
        if part == 0 and row < mLSE2.shape[2]:
            lse2 = Float32.inf
            if row < seqlen_q:
                lse = mLSE[batch, head, row]
                if lse != -Float32.inf:
                    lse2 = lse * LOG2_E
            mDelta[batch, head, row] = delta
            mLSE2[batch, head, row] = lse2


class BwdPostprocess:
    """out (batch, seqlen, heads_out, hdim) = scale * sum over groups of acc (batch, heads_acc,
    seqlen_pad, pitch >= hdim)."""

    def __init__(self, head_dim: int, group: int):
        assert head_dim % THREADS_PER_ROW == 0, head_dim
        self.hdim = head_dim
        self.group = group
        self.cols = head_dim // THREADS_PER_ROW

    def _acc_part(self, mAcc, batch, head, row, part):
        """This thread's columns of one accumulator row (rows may be padded past hdim)."""
        row_t = cute.make_tensor(mAcc[batch, head, row, None].iterator, cute.make_layout(self.hdim))
        return _row_part(row_t, part, self.cols)

    @cute.jit
    def __call__(self, mAcc: cute.Tensor, mOut: cute.Tensor, scale: Float32, stream):
        grid_x = cute.ceil_div(mOut.shape[1], ROWS_PER_CTA)
        self.kernel(mAcc, mOut, scale).launch(
            grid=[grid_x, mOut.shape[2], mOut.shape[0]], block=[CTA_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mAcc, mOut, scale: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        bx, head, batch = cute.arch.block_idx()
        row = bx * ROWS_PER_CTA + tidx // THREADS_PER_ROW
        part = tidx % THREADS_PER_ROW
        if row < mOut.shape[1]:
            total = cute.make_rmem_tensor((self.cols,), Float32)
            cute.autovec_copy(self._acc_part(mAcc, batch, head * self.group, row, part), total)
            for g in cutlass.range_constexpr(1, self.group):
                acc = cute.make_rmem_tensor((self.cols,), Float32)
                cute.autovec_copy(self._acc_part(mAcc, batch, head * self.group + g, row, part), acc)
                total.store(total.load() + acc.load())
            out = cute.make_rmem_tensor((self.cols,), mOut.element_type)
            out.store((total.load() * scale).to(mOut.element_type))
            cute.autovec_copy(out, _row_part(mOut[batch, row, head, None], part, self.cols))


class DqPostprocess:
    """dq (batch, seqlen_q, heads, hdim) = scale * the fragment-order accumulator
    (batch, heads, m_blocks, tile_m * hdim) of the main kernel (``BwdConfig`` ``cfg``)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.tile_m, self.hdim = cfg.tile_m, cfg.head_dim
        self.threads = WARPGROUP_THREADS * cfg.num_mma_warpgroups

    @cute.jit
    def __call__(self, mAcc: cute.Tensor, mOut: cute.Tensor, scale: Float32, stream):
        mma = dq_tiled_mma(self.cfg, mOut.element_type)
        self.kernel(mAcc, mOut, scale, mma).launch(
            grid=[mAcc.shape[2], mOut.shape[2], mOut.shape[0]], block=[self.threads, 1, 1],
            stream=stream)

    @cute.kernel
    def kernel(self, mAcc, mOut, scale: Float32, mma: cute.TiledMma):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        thr = mma.get_slice(tidx)
        swap = self.cfg.dq_swap_ab  # the accumulator is dQ^T (Note [dQ transposed])
        acc = cute.make_rmem_tensor(mma.partition_shape_C(dq_tile_shape(self.cfg)), Float32)
        src = cute.make_ptr(Float32, mAcc[batch, head, m_block, None].iterator.toint(),
                            cute.AddressSpace.gmem, assumed_align=16)
        cute.autovec_copy(dq_fragment_view(self.cfg, src, tidx), dq_registers(self.cfg, acc))
        out = cute.make_fragment_like(acc, mOut.element_type)
        out.store((acc.load() * scale).to(mOut.element_type))
        gOut = cute.local_tile(mOut[batch, None, head, None], (self.tile_m, self.hdim), (m_block, 0))
        if const_expr(swap):  # (hdim, tile_m), as the accumulator
            gOut = cute.make_tensor(gOut.iterator, cute.select(gOut.layout, mode=[1, 0]))
        tOgO = thr.partition_C(gOut)
        tOcO = thr.partition_C(cute.make_identity_tensor(dq_tile_shape(self.cfg)))
        rows_left = mOut.shape[1] - m_block * self.tile_m
        if const_expr(swap):
            # adjacent accumulator columns are adjacent queries, a row apart in memory: one
            # 2-byte store each (8 lanes write 16 contiguous bytes of one query row)
            for i in cutlass.range_constexpr(cute.size(out)):
                if tOcO[i][1] < rows_left:
                    tOgO[i] = out[i]
        else:
            # pairs of adjacent columns (mode 0 of the accumulator's first mode): one 4-byte store
            for v in cutlass.range_constexpr(cute.size(out) // 2):
                if tOcO[2 * v][0] < rows_left:
                    cute.autovec_copy(_pair(out, v), _pair(tOgO, v))


def _pair(t, v: int):
    """Elements 2 v and 2 v + 1 of an accumulator-shaped tensor (adjacent columns)."""
    return cute.make_tensor(t.iterator + cute.crd2idx(2 * v, t.layout), cute.make_layout(2))
