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
dq_groups x 16 bytes (coalesced) and writes them into a row-major SMEM tile at the rows and
columns the same tiled MMA (``dq_tiled_mma``) assigns; then every thread stores whole
16-byte row pieces of that tile to dq (Note [dQ out through SMEM]). The scale is applied here
because the main kernel leaves it out of its per-block dQ tiles.

Note [dQ out through SMEM]: stored straight from the MMA layout, a warp's stores hit 8 rows
with 16 bytes each (4 bytes per lane; 2 with the transposed accumulator of tile_m 80): half
sectors, which the L2 merges and the LSU queues (Nsight Compute, hdim 64, 1k: 2.3 TB/s,
83 us against FA4's 4.0 TB/s, 45 us, its warps stalled on the LSU queue). Through SMEM each
lane stores 16 contiguous bytes and a warp whole rows. The tile's rows are padded by 16
bytes, so the MMA-layout writes (8 rows x 4 lanes per warp) fall in distinct banks.

Note [dQ postprocess in the tail] (``early_dq_post``): the dQ postprocess reads the whole
float32 accumulator and writes dq (192 MiB at 16k tokens, hidden 2048: about 70 us on an
H100), and as a plain programmatic dependent it started only once the main kernel had ended,
while the main kernel's last wave left more and more SMs idle. With the switch:
- every main-kernel CTA calls ``griddepcontrol.launch_dependents`` first thing, so the
  postprocess launches once the last main CTA has started and its CTAs take SMs as the main
  kernel's CTAs leave them;
- the dq-store warp of every main CTA, after its last query block, waits until its bulk
  reduces have completed (not only read SMEM), fences and adds 1 (release) to the last
  semaphore of its (batch, head), the count of finished CTAs (``BwdConfig.dq_sem_slots``;
  the preprocess zeroes it with the others);
- a postprocess CTA, instead of ``griddepcontrol.wait``, has thread 0 poll that count
  (acquire) until it equals the number of key blocks, every CTA of the (batch, head), then
  meets its CTA at a barrier and converts as before. After ``MAX_POLLS`` polls it waits for
  the whole main kernel instead (slow, never wrong);
- CTA (0, 0, 0) calls ``griddepcontrol.wait`` before it exits, so the postprocess grid ends
  after the main kernel: what follows it in the stream (the GQA dK/dV postprocess, the next
  call) may rely on everything the main kernel wrote, as before.
Counting in the dq-store warp per query block instead (each block's reduces waited for one
block later, so a postprocess CTA could start on its block alone) cost 2.5-14% in the main loop
(H100): a bulk reduce completes long after it has read SMEM. Counted once per CTA, at its
end, the main loop is unchanged. In the CUDA profiler's timeline (H100, hdim 128) the
postprocess then overlaps the main kernel by 49-84 us and ends 13-29 us after it instead of
68-69 us, but the main kernel's last wave takes 15-31 us longer beside it (a memory-bound
kernel on the SMs around it); at hdim 64 causal 1k the loss outweighed the gain (2.7%
longer calls), hence the default at hdim 128 only (``EARLY_DQ_POST_HEAD_DIMS``). "red" dQ
(from the MMA registers) has no dq-store warp to count its adds; ``validate()`` rejects it.

Note [Preprocess beside the main kernel] (``pre_ctas``): the preprocess reads O and dO (128 MiB
at 16k tokens, hidden 2048: 53 us on an H100, 7% of a hdim 128 call at 1k) on every SM, and
the main kernel, which needs all of an SM, starts only in its last wave. With the switch:
- ``pre_ctas`` persistent CTAs take units of ``groups`` x ROWS_PER_CTA query rows (every load
  of a unit in flight at once, PRE_BYTES_IN_FLIGHT per thread), (batch, head) after (batch,
  head) in the main kernel's order, unit u on CTA u mod pre_ctas; after a unit's stores the CTA
  meets and thread 0 adds the unit's rows to the (batch, head)'s count, the last dQ semaphore
  (fence, then a release add). Each CTA lets the main kernel launch once it has waited for the
  kernel before it, so the main kernel launches as soon as they all run, on the other SMs;
- the semaphores arrive zeroed (``torch.zeros`` in the workspace: the preprocess cannot zero
  a count it adds to), and the preprocess no longer touches the others;
- in the main kernel the load warp (before the first Q / dO stage, with its LSE2 / Delta) and
  the dq-store warp (semaphores, and the dQ accumulator's zeros without first stores) poll
  their (batch, head)'s count until it reaches seqlen_q_pad (``wait_for_count``: every lane
  loads with acquire and the warp votes, so the loop stays warp-uniform), then fence the async
  proxy, as their TMA and bulk copies read what the preprocess wrote. The MMA warpgroups wait
  for nothing: ``validate()`` asks for "bulk" dQ and ``stats_smem``, so they read nothing the
  preprocess writes. After ``MAX_POLLS`` polls a warp waits for the whole preprocess instead.
No deadlock: the main kernel launches only once every preprocess CTA has started, and those
wait for nothing. Measured on the H100 (CUDA profiler, hdim 128, non-causal 1k): with 32 CTAs
the preprocess takes 184 us (0.7 TB/s, against 2.5 TB/s on all SMs: about 22 GB/s per SM
either way), with 64 96 us; the main kernel starts 50 us earlier and runs 30-50 us longer on
the SMs left, so a call is 1-2% shorter at best (paired: +2.1% / +1.7% at non-causal 1k / 4k
with 32 CTAs, -1.6% causal 2k). Off by default; a preprocess that moves more bytes per SM (TMA
into SMEM) is what it lacks.

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
from cutlass import Float32, Int32, const_expr

from fa_sm100.hopper.bwd_config import DQ_VEC
from fa_sm100.hopper.bwd_store import (dq_fragment_view, dq_registers, dq_tile_shape,
                                       dq_tiled_mma, finished_ctas_count,
                                       preprocess_count, wait_for_count)
from fa_sm100.hopper.common import assume_aligned
from fa_sm100.hopper.config import WARPGROUP_THREADS

THREADS_PER_ROW = 16
CTA_THREADS = 256
ROWS_PER_CTA = CTA_THREADS // THREADS_PER_ROW
OUT_VEC = 8  # 16-bit elements per 16-byte store of the dQ postprocess
LOG2_E = math.log2(math.e)
# Note [Preprocess beside the main kernel]: bytes of O and dO each thread of a persistent
# preprocess CTA loads at once (a unit of work: 256 rows at hdim 128, 128 KiB)
PRE_BYTES_IN_FLIGHT = 512


def _vector(ptr, n: int):
    """``n`` contiguous elements at the 16-byte aligned ``ptr``, copied as one vector."""
    return cute.make_tensor(assume_aligned(ptr), cute.make_layout(n))


def _row_part(row, part: int, cols: int):
    """Columns [part * cols, (part + 1) * cols) of a 1-D row tensor."""
    return cute.local_tile(row, (cols,), (part,))


class BwdPreprocess:
    """Delta = rowsum(O * dO) and LSE in log2 units, padded; zeroes the dQ semaphores, and
    with ``zero_dq`` the dQ accumulator (not needed when the first CTA at each query block
    stores its tile: Note [dQ first store] in bwd_store.py) (see the module docstring).

    ``ctas`` = 0: one CTA per ROWS_PER_CTA rows, ahead of the main kernel. ``ctas`` > 0: that
    many persistent CTAs beside the main kernel, counting the rows of each (batch, head) they
    have finished (Note [Preprocess beside the main kernel]); the semaphores then arrive
    zeroed."""

    def __init__(self, head_dim_v: int, head_dim: int, pdl: bool, zero_dq: bool = True,
                 ctas: int = 0):
        assert head_dim_v % THREADS_PER_ROW == 0, head_dim_v
        self.hdimv = head_dim_v
        self.cols = head_dim_v // THREADS_PER_ROW
        # the dQ accumulator: head_dim floats per padded query row, in 16-byte vectors
        self.zero_vecs = ROWS_PER_CTA * head_dim // DQ_VEC
        self.pdl = pdl
        self.zero_dq = zero_dq
        self.ctas = ctas
        # persistent CTAs: ROWS_PER_CTA-row groups per unit of work, every load of a unit in
        # flight at once (PRE_BYTES_IN_FLIGHT per thread, O and dO)
        self.groups = max(1, PRE_BYTES_IN_FLIGHT // (2 * self.cols * 2))

    @cute.jit
    def __call__(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor,
                 mLSE2: cute.Tensor, mDelta: cute.Tensor, mdQacc: cute.Tensor,
                 mdQsem: cute.Tensor, stream):
        # mO, mdO: (batch, seqlen_q, heads, hdimv); mLSE: (batch, heads, seqlen_q) f32;
        # mLSE2, mDelta: (batch, heads, seqlen_q_pad) f32; mdQacc: (batch, heads, m_blocks,
        # tile_m * hdim) f32, seqlen_q_pad * hdim floats per (batch, head); mdQsem: (batch,
        # heads, n) i32
        grid = [cute.ceil_div(mLSE2.shape[2], ROWS_PER_CTA), mO.shape[2], mO.shape[0]]
        if const_expr(self.ctas):
            grid = [self.ctas, 1, 1]
        self.kernel(mO, mdO, mLSE, mLSE2, mDelta, mdQacc, mdQsem).launch(
            grid=grid, block=[CTA_THREADS, 1, 1], stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mO, mdO, mLSE, mLSE2, mDelta, mdQacc, mdQsem):
        tidx, _, _ = cute.arch.thread_idx()
        bx, head, batch = cute.arch.block_idx()
        if const_expr(self.pdl):  # Note [chained launches]: the kernel before has finished
            cute.arch.griddepcontrol_wait()
        if const_expr(self.ctas):
            self._persistent(mO, mdO, mLSE, mLSE2, mDelta, mdQacc, mdQsem, bx, tidx)
        else:
            # the main kernel may launch once O and dO are read; it waits before reading ours
            self._row_groups(mO, mdO, mLSE, mLSE2, mDelta, batch, head, bx, 1, tidx,
                             after_loads=self.pdl)
            if const_expr(self.zero_dq):
                self._zero_dq_rows(mdQacc, bx, head, batch, tidx)
            # the dQ semaphores (deterministic mode's turns or Note [dQ first store]'s states,
            # one per query block; a single unused one per (batch, head) otherwise)
            sem = bx * CTA_THREADS + tidx
            if sem < mdQsem.shape[2]:
                mdQsem[batch, head, sem] = Int32(0)

    @cute.jit
    def _persistent(self, mO, mdO, mLSE, mLSE2, mDelta, mdQacc, mdQsem, cta, tidx):
        """Note [Preprocess beside the main kernel]: units of ``groups`` x ROWS_PER_CTA rows,
        (batch, head) after (batch, head) in the main kernel's order, unit u to CTA u mod
        ctas; after each unit thread 0 adds its rows to the (batch, head)'s count (release)."""
        cute.arch.griddepcontrol_launch_dependents()  # the main kernel may start at once
        heads = mO.shape[2]
        rows_pad = mLSE2.shape[2]
        unit_rows = self.groups * ROWS_PER_CTA
        units_per_pair = cute.ceil_div(rows_pad, unit_rows)
        for unit in cutlass.range(cta, units_per_pair * heads * mO.shape[0], self.ctas, unroll=1):
            pair = unit // units_per_pair
            first_group = (unit - pair * units_per_pair) * self.groups
            batch = pair // heads
            head = pair - batch * heads
            self._row_groups(mO, mdO, mLSE, mLSE2, mDelta, batch, head, first_group, self.groups,
                             tidx, after_loads=False)
            if const_expr(self.zero_dq):
                for g in cutlass.range_constexpr(self.groups):
                    if (first_group + g) * ROWS_PER_CTA < rows_pad:
                        self._zero_dq_rows(mdQacc, first_group + g, head, batch, tidx)
            cute.arch.barrier()  # every thread's stores of the unit are done
            if tidx == 0:
                rows = cutlass.min(unit_rows, rows_pad - first_group * ROWS_PER_CTA)
                cute.arch.fence_acq_rel_gpu()
                cute.arch.red(preprocess_count(mdQsem, batch, head), rows, op="add",
                              dtype="s32", sem="release", scope="gpu")

    @cute.jit
    def _row_groups(self, mO, mdO, mLSE, mLSE2, mDelta, batch, head, first_group,
                    groups: cutlass.Constexpr, tidx, after_loads: cutlass.Constexpr):
        """Delta and LSE2 of the ``groups`` x ROWS_PER_CTA rows from row ``first_group`` x
        ROWS_PER_CTA on, each row on THREADS_PER_ROW adjacent threads: every group's O and dO
        loaded first (then ``griddepcontrol.launch_dependents`` if ``after_loads``), then
        summed. Rows past seqlen_q read as 0 (Delta 0, LSE2 +inf); rows past seqlen_q_pad are
        not stored."""
        seqlen_q = mO.shape[1]
        part = tidx % THREADS_PER_ROW
        rO = cute.make_rmem_tensor((self.cols, groups), mO.element_type)
        rdO = cute.make_rmem_tensor((self.cols, groups), mdO.element_type)
        rLSE = cute.make_rmem_tensor((groups,), Float32)
        rO.fill(0.0)
        rdO.fill(0.0)
        rLSE.fill(-Float32.inf)
        for g in cutlass.range_constexpr(groups):
            row = (first_group + g) * ROWS_PER_CTA + tidx // THREADS_PER_ROW
            if row < seqlen_q:
                cute.autovec_copy(_row_part(mO[batch, row, head, None], part, self.cols),
                                  rO[None, g])
                cute.autovec_copy(_row_part(mdO[batch, row, head, None], part, self.cols),
                                  rdO[None, g])
                if part == 0:
                    rLSE[g] = mLSE[batch, head, row]
        if const_expr(after_loads):
            cute.arch.griddepcontrol_launch_dependents()
        for g in cutlass.range_constexpr(groups):
            row = (first_group + g) * ROWS_PER_CTA + tidx // THREADS_PER_ROW
            # every lane of a row takes part in the shuffles, so only the stores are predicated
            delta = (rO[None, g].load().to(Float32) * rdO[None, g].load().to(Float32)).reduce(
                cute.ReductionOp.ADD, Float32(0.0), 0)
            for offset in cutlass.range_constexpr(THREADS_PER_ROW.bit_length() - 2, -1, -1):
                delta = delta + cute.arch.shuffle_sync_bfly(delta, offset=1 << offset)
            if part == 0 and row < mLSE2.shape[2]:
                # -inf: a row past seqlen_q, or one that sees no key
                lse2 = Float32.inf
                if rLSE[g] != -Float32.inf:
                    lse2 = rLSE[g] * LOG2_E
                mDelta[batch, head, row] = delta
                mLSE2[batch, head, row] = lse2

    @cute.jit
    def _zero_dq_rows(self, mdQacc, bx, head, batch, tidx):
        """Zero the ROWS_PER_CTA rows of group ``bx`` of the dQ accumulator (the main kernel
        adds into it; seqlen_q_pad / ROWS_PER_CTA groups cover it exactly)."""
        acc = mdQacc[batch, head, None, None].iterator + bx * self.zero_vecs * DQ_VEC
        zeros = cute.make_rmem_tensor((DQ_VEC,), Float32)
        zeros.fill(0.0)
        full_steps = self.zero_vecs // CTA_THREADS
        for step in cutlass.range_constexpr(full_steps):
            cute.autovec_copy(zeros, _vector(acc + (step * CTA_THREADS + tidx) * DQ_VEC, DQ_VEC))
        if const_expr(self.zero_vecs % CTA_THREADS):  # hdim 96: 1.5 vectors per thread
            if full_steps * CTA_THREADS + tidx < self.zero_vecs:
                cute.autovec_copy(zeros, _vector(acc + (full_steps * CTA_THREADS + tidx) * DQ_VEC,
                                                 DQ_VEC))


class BwdPostprocess:
    """out (batch, seqlen, heads_out, hdim) = scale * sum over groups of acc (batch, heads_acc,
    seqlen_pad, pitch >= hdim)."""

    def __init__(self, head_dim: int, group: int, pdl: bool):
        assert head_dim % THREADS_PER_ROW == 0, head_dim
        self.hdim = head_dim
        self.group = group
        self.cols = head_dim // THREADS_PER_ROW
        self.pdl = pdl

    def _acc_part(self, mAcc, batch, head, row, part):
        """This thread's columns of one accumulator row (rows may be padded past hdim)."""
        row_t = cute.make_tensor(mAcc[batch, head, row, None].iterator, cute.make_layout(self.hdim))
        return _row_part(row_t, part, self.cols)

    @cute.jit
    def __call__(self, mAcc: cute.Tensor, mOut: cute.Tensor, scale: Float32, stream):
        grid_x = cute.ceil_div(mOut.shape[1], ROWS_PER_CTA)
        self.kernel(mAcc, mOut, scale).launch(
            grid=[grid_x, mOut.shape[2], mOut.shape[0]], block=[CTA_THREADS, 1, 1], stream=stream,
            use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mAcc, mOut, scale: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        bx, head, batch = cute.arch.block_idx()
        if const_expr(self.pdl):  # Note [chained launches]: the kernel before has finished
            cute.arch.griddepcontrol_wait()
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
    (batch, heads, m_blocks, tile_m * hdim) of the main kernel (``BwdConfig`` ``cfg``). With
    first stores (Note [dQ first store] in bwd_store.py) a block whose semaphore is still 0
    was reached by no CTA: its accumulator was never written, and dq is 0 there."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.tile_m, self.hdim = cfg.tile_m, cfg.head_dim
        self.threads = WARPGROUP_THREADS * cfg.num_mma_warpgroups
        # Note [dQ out through SMEM]: 16-byte pieces of the row-major tile, rows padded
        self.pieces_per_row = self.hdim // OUT_VEC
        self.pitch = self.hdim + OUT_VEC
        assert (self.tile_m * self.pieces_per_row) % self.threads == 0, (self.tile_m, self.hdim)

    def smem_bytes(self, dtype) -> int:
        return self.tile_m * self.pitch * dtype.width // 8

    @staticmethod
    def compile_key(cfg) -> tuple:
        """What the compiled kernel depends on: the fragment order (tile_m, head dim), dtype,
        the launch, first stores, and with ``early_dq_post`` the key-block height (the count
        it waits for) and where that count is (``finished_ctas_count``: before the persistent
        preprocess's, with ``pre_ctas``)."""
        early = (cfg.tile_n, cfg.pre_ctas > 0) if cfg.early_dq_post else ()
        return (cfg.tile_m, cfg.head_dim, cfg.dtype, cfg.pdl, cfg.first_stores_dq) + early

    @cute.jit
    def __call__(self, mAcc: cute.Tensor, mSem: cute.Tensor, mOut: cute.Tensor, scale: Float32,
                 seqlen_k: Int32, stream):
        mma = dq_tiled_mma(self.cfg, mOut.element_type)
        self.kernel(mAcc, mSem, mOut, scale, seqlen_k, mma).launch(
            grid=[mAcc.shape[2], mOut.shape[2], mOut.shape[0]], block=[self.threads, 1, 1],
            smem=self.smem_bytes(mOut.element_type), stream=stream, use_pdl=self.cfg.pdl)

    @cute.kernel
    def kernel(self, mAcc, mSem, mOut, scale: Float32, seqlen_k: Int32, mma: cute.TiledMma):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        if const_expr(self.cfg.early_dq_post):
            self._wait_for_head(mSem, seqlen_k, head, batch, tidx)
        elif const_expr(self.cfg.pdl):  # Note [chained launches]: the main kernel has finished
            cute.arch.griddepcontrol_wait()
        thr = mma.get_slice(tidx)
        acc = cute.make_rmem_tensor(mma.partition_shape_C(dq_tile_shape(self.cfg)), Float32)
        src = assume_aligned(mAcc[batch, head, m_block, None].iterator)
        cute.autovec_copy(dq_fragment_view(self.cfg, src, tidx), dq_registers(self.cfg, acc))
        if const_expr(self.cfg.first_stores_dq):
            # a block no CTA reached: what the allocator left there (loaded anyway: under a
            # branch the loads were no longer 16 bytes wide) becomes 0
            if mSem[batch, head, m_block] == 0:
                acc.fill(0.0)
        out = cute.make_fragment_like(acc, mOut.element_type)
        out.store((acc.load() * scale).to(mOut.element_type))
        # 1. registers -> the row-major SMEM tile (tile_m, hdim), at the MMA's coordinates
        smem = cutlass.utils.SmemAllocator()
        sOut = smem.allocate_tensor(mOut.element_type,
                                    cute.make_layout((self.tile_m, self.hdim), stride=(self.pitch, 1)),
                                    byte_alignment=16)
        sAcc = sOut
        if const_expr(self.cfg.dq_swap_ab):  # the accumulator is dQ^T (Note [dQ transposed])
            sAcc = cute.make_tensor(sOut.iterator, cute.select(sOut.layout, mode=[1, 0]))
        cute.autovec_copy(out, thr.partition_C(sAcc))
        cute.arch.barrier()
        # 2. the tile -> dq, one 16-byte piece of a row per thread and step; rows of the block
        # past seqlen_q are not stored
        rows_left = mOut.shape[1] - m_block * self.tile_m
        gOut = cute.local_tile(mOut[batch, None, head, None], (self.tile_m, self.hdim), (m_block, 0))
        for step in cutlass.range_constexpr(self.tile_m * self.pieces_per_row // self.threads):
            piece = step * self.threads + tidx
            row, col = piece // self.pieces_per_row, piece % self.pieces_per_row
            if row < rows_left:
                # rows start 16-byte aligned: dq's head dim is a multiple of 8, SMEM rows are
                # padded by 8
                cute.autovec_copy(_vector(sOut[row, None].iterator + col * OUT_VEC, OUT_VEC),
                                  _vector(gOut[row, None].iterator + col * OUT_VEC, OUT_VEC))
        if const_expr(self.cfg.early_dq_post):
            # Note [dQ postprocess in the tail]: this grid ends after the main kernel
            if m_block + head + batch == 0 and tidx == 0:
                cute.arch.griddepcontrol_wait()

    @cute.jit
    def _wait_for_head(self, mSem, seqlen_k, head, batch, tidx):
        """Note [dQ postprocess in the tail]: warp 0 waits for the (batch, head)'s count of
        finished main-kernel CTAs to reach its number of key blocks (``wait_for_count``); then
        the CTA meets."""
        if tidx < 32:
            wait_for_count(finished_ctas_count(self.cfg, mSem, batch, head),
                           self.cfg.num_key_blocks(seqlen_k), True)
        cute.arch.barrier()
