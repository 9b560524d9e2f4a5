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
  kernel's CTAs leave them (persistent CTAs, Note [persistent CTAs] in bwd_tiles.py, leave
  only after their last tile: then the postprocess has the SMs of the walks that end
  first);
- the dq-store warp of every main CTA, after its last query block, waits until its bulk
  reduces have completed (not only read SMEM), fences and adds 1 (release) to the last
  semaphore of its (batch, head), the count of finished CTAs (of finished tiles with
  persistent CTAs; ``BwdConfig.dq_sem_slots``;
  the preprocess zeroes it with the others);
- a postprocess CTA, instead of ``griddepcontrol.wait``, has thread 0 poll that count
  (acquire) until it equals the number of key blocks, every CTA of the (batch, head), then
  meets its CTA at a barrier and converts as before. After ``MAX_POLLS`` polls it waits for
  the whole main kernel instead (slow, never wrong);
- CTA (0, 0, 0) calls ``griddepcontrol.wait`` before it exits, so the postprocess grid ends
  after the main kernel: what follows it in the stream (the GQA dK/dV postprocess, the next
  call) may rely on everything the main kernel wrote, as before.
Counting in the dq-store warp per query block instead (each block's reduces waited for one
block later, so a postprocess CTA could start on its block alone) measured slower in the main
loop (H100): a bulk reduce completes long after it has read SMEM. Counted once per CTA, at its
end, the main loop is unchanged. In the CUDA profiler's timeline (H100, hdim 128) the
postprocess then overlaps the main kernel by 49-84 us and ends 13-29 us after it instead of
68-69 us, but the main kernel's last wave takes 15-31 us longer beside it (a memory-bound
kernel on the SMs around it); at hdim 64 causal 1k the loss outweighed the gain (longer
calls), hence the default at hdim 128 only (``EARLY_DQ_POST_HEAD_DIMS``). "red" dQ
(from the MMA registers) has no dq-store warp to count its adds; ``validate()`` rejects it.

Note [Preprocess beside the main kernel] (``pre_ctas``; hdim 128's default, 32 CTAs): the
preprocess reads O and dO (128 MiB at 16k tokens, hidden 2048: 53 us on an H100, 7% of a hdim
128 call at 1k) on every SM, and the main kernel, which needs all of an SM, starts only in its
last wave. With the switch:
- ``pre_ctas`` persistent CTAs (``persistent_kernel``) take the rows of the (batch, head) pairs
  in the main kernel's order: units of ``unit_rows`` rows (PRE_UNIT_BYTES of O and dO per
  worker thread: 128 rows, 64 KiB at hdim 128), in chunks of up to PRE_CHUNK_UNITS units of
  one pair, chunk c to CTA c mod ctas (``_PreSchedule``). In a CTA the load warp brings each
  unit's O and dO tiles by TMA into PRE_STAGES SMEM stages (rows past seqlen_q arrive as
  zeros); the 256 worker threads copy their rows' LSE with ``cp.async`` PRE_STAGES - 1 units
  ahead (each thread reads back only its own copies: ``cp.async.wait_group``), sum a unit
  from SMEM and store Delta and LSE2 (and with ``zero_dq`` zero its rows of the dQ
  accumulator); after a chunk's last unit they hand it (mbarrier, release at CTA scope) to
  one of PRE_COUNT_WARPS count warps, which adds the chunk's rows to the pair's count, the
  last dQ semaphore, with one release add at GPU scope (cumulative: the workers' stores it
  acquired go first). Each CTA lets the main kernel launch once it has waited for the kernel
  before it;
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
wait for nothing. How fast one SM moves the rows is what decides: the preprocess CTAs hold
their SMs while the main kernel runs on the others. Each thread loading its rows into
registers moved 22 GB/s per SM beside the main kernel. Alone on the H100 (hdim
128, 16k tokens, one to 32 CTAs), per SM: ``cp.async`` into SMEM stages 37 GB/s with 64 KiB
units and 22 GB/s with 32 KiB ones, whatever the stages (2, 3, 6) and count warps (1, 2, 4),
i.e. a fixed cost per unit (1.2-1.8 us) that neither hid; TMA tiles 46-48 GB/s, and counted
in chunks of 4 or 8 units 51-52 GB/s (55 with two stages). Beside the main kernel (CUDA
profiler, 1k non-causal) 32 CTAs take 111 us (38 GB/s per SM), and the main kernel runs as
long as without (641 vs 643 us) but starts 50 us earlier. On by default at hdim 128, where
paired timing measured it faster in most cells, off at hdim 64 (``PRE_CTAS_HEAD_DIMS``;
docs/tuning.md, row "preprocess beside the main kernel").

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
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import cpasync

from fa_sm100.hopper.bwd_config import DQ_VEC
from fa_sm100.hopper.bwd_store import (dq_fragment_view, dq_registers, dq_tile_shape,
                                       dq_tiled_mma, finished_ctas_count,
                                       preprocess_count, wait_for_count)
from fa_sm100.hopper.common import assume_aligned
from fa_sm100.hopper.config import WARPGROUP_THREADS
from fa_sm100.varlen import first_block, sequence_rows, sequence_views
from pipelines.dsl_values import NoLoopCarriedValues

THREADS_PER_ROW = 16
CTA_THREADS = 256
ROWS_PER_CTA = CTA_THREADS // THREADS_PER_ROW
OUT_VEC = 8  # 16-bit elements per 16-byte store of the dQ postprocess
LOG2_E = math.log2(math.e)
# Note [Preprocess beside the main kernel]: a persistent preprocess CTA's unit of work is
# PRE_UNIT_BYTES of O and dO per worker thread (128 rows at hdim 128: 64 KiB), PRE_STAGES
# units in SMEM (PRE_STAGES - 1 in flight while one is summed), counted in chunks of up to
# PRE_CHUNK_UNITS units of one (batch, head) by PRE_COUNT_WARPS count warps in turn
PRE_UNIT_BYTES = 256
PRE_STAGES = 3
PRE_COUNT_WARPS = 4
PRE_LOAD_WARP = CTA_THREADS // 32  # after the worker warps; the count warps follow it
PRE_CHUNK_UNITS = 8


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
    zeroed. With ``mCuSeqlens`` (varlen, one CTA per group only: Note [Varlen backward] in
    bwd_kernel.py) O, dO are packed (1, total, h, d) and LSE (1, h, total): batch index i of
    the grid reads sequence i's rows and writes its blocks of the packed workspace (Note
    [Packed workspace] in varlen.py); ``max_seqlen``, the longest sequence, sizes the grid."""

    def __init__(self, head_dim_v: int, head_dim: int, pdl: bool, zero_dq: bool = True,
                 ctas: int = 0, tile_m: int = 0):
        assert head_dim_v % THREADS_PER_ROW == 0, head_dim_v
        self.tile_m = tile_m  # varlen: the query blocks of the packed workspace
        self.hdimv = head_dim_v
        self.cols = head_dim_v // THREADS_PER_ROW
        # the dQ accumulator: head_dim floats per padded query row, in 16-byte vectors
        self.zero_vecs = ROWS_PER_CTA * head_dim // DQ_VEC
        self.pdl = pdl
        self.zero_dq = zero_dq
        self.ctas = ctas
        # persistent CTAs: units of ``groups`` ROWS_PER_CTA-row groups (PRE_UNIT_BYTES of O and
        # dO per worker thread), ``unit_rows`` rows; the worker warps, the load warp, the count
        # warps
        self.groups = max(1, PRE_UNIT_BYTES // (2 * self.cols * 2))
        self.unit_rows = self.groups * ROWS_PER_CTA
        self.threads = CTA_THREADS
        if ctas:
            self.threads += (1 + PRE_COUNT_WARPS) * cute.arch.WARP_SIZE

    def smem_bytes(self, dtype) -> int:
        """SMEM of a persistent CTA, as ``persistent_kernel`` allocates it: the mbarriers of
        the loads and of the handoff, PRE_STAGES units of O and dO (128-byte aligned) and LSE;
        none for one CTA per ROWS_PER_CTA rows."""
        if not self.ctas:
            return 0
        rows = PRE_STAGES * self.unit_rows * self.hdimv * dtype.width // 8
        end = 0
        for size, align in ((2 * PRE_STAGES * 8, 8), (2 * PRE_COUNT_WARPS * 8, 8), (rows, 128),
                            (rows, 128), (PRE_STAGES * self.unit_rows * 4, 16)):
            end = -(-end // align) * align + size
        return end

    @cute.jit
    def __call__(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor,
                 mLSE2: cute.Tensor, mDelta: cute.Tensor, mdQacc: cute.Tensor,
                 mdQsem: cute.Tensor, mCuSeqlens, max_seqlen, stream):
        # mO, mdO: (batch, seqlen_q, heads, hdimv); mLSE: (batch, heads, seqlen_q) f32;
        # mLSE2, mDelta: (batch, heads, seqlen_q_pad) f32; mdQacc: (batch, heads, m_blocks,
        # tile_m * hdim) f32, seqlen_q_pad * hdim floats per (batch, head); mdQsem: (batch,
        # heads, n) i32
        self.dtype = mO.element_type
        if const_expr(self.ctas):
            # a unit of O / dO is one TMA tile (unit_rows, hdimv) of a (batch, head):
            # (b, s, h, d) -> (s, d, h, b); rows past seqlen_q arrive as zeros
            s_layout = cute.make_layout((self.unit_rows, self.hdimv, PRE_STAGES),
                                        stride=(self.hdimv, 1, self.unit_rows * self.hdimv))
            tmas = [cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp(),
                cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0])),
                cute.select(s_layout, mode=[0, 1]), (self.unit_rows, self.hdimv))
                for t in (mO, mdO)]
            self.persistent_kernel(tmas[0][0], tmas[0][1], tmas[1][0], tmas[1][1], s_layout,
                                   mLSE, mLSE2, mDelta, mdQacc, mdQsem).launch(
                grid=[self.ctas, 1, 1], block=[self.threads, 1, 1],
                smem=self.smem_bytes(mO.element_type), stream=stream, use_pdl=self.pdl)
        else:
            grid = [cute.ceil_div(mLSE2.shape[2], ROWS_PER_CTA), mO.shape[2], mLSE2.shape[0]]
            if const_expr(mCuSeqlens is not None):  # varlen: the longest sequence's blocks
                rows = cute.ceil_div(max_seqlen, self.tile_m) * self.tile_m
                grid = [cute.ceil_div(rows, ROWS_PER_CTA), mO.shape[2], mCuSeqlens.shape[0] - 1]
            self.kernel(mO, mdO, mLSE, mLSE2, mDelta, mdQacc, mdQsem, mCuSeqlens).launch(
                grid=grid, block=[CTA_THREADS, 1, 1], stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mO, mdO, mLSE, mLSE2, mDelta, mdQacc, mdQsem, mCuSeqlens):
        tidx, _, _ = cute.arch.thread_idx()
        bx, head, batch = cute.arch.block_idx()
        seqlen = mO.shape[1]
        active = True
        if const_expr(mCuSeqlens is not None):  # varlen: sequence ``batch``'s rows
            mO, mdO, mLSE, seqlen = sequence_rows(mCuSeqlens, None, batch, (mO, 1, 0), (mdO, 1, 0),
                                                   (mLSE, 2, 0))
            # its blocks of the packed workspace (Note [Packed workspace] in varlen.py); the
            # CTAs past them have nothing to write
            first = first_block(mCuSeqlens, batch, self.tile_m)
            mLSE2, mDelta = sequence_views(batch, first * self.tile_m, (mLSE2, 2, 0),
                                           (mDelta, 2, 0))
            mdQacc = sequence_views(batch, first, (mdQacc, 2, 0))[0]
            active = bx * ROWS_PER_CTA < cute.ceil_div(seqlen, self.tile_m) * self.tile_m
        if const_expr(self.pdl):  # Note [chained launches]: the kernel before has finished
            cute.arch.griddepcontrol_wait()
        if active:
            # the main kernel may launch once O and dO are read; it waits before reading ours
            self._rows(mO, mdO, mLSE, mLSE2, mDelta, batch, head, bx, tidx, seqlen)
            if const_expr(self.zero_dq):
                self._zero_dq_rows(mdQacc, bx, head, batch, tidx)
        # the dQ semaphores (deterministic mode's turns or Note [dQ first store]'s states, one
        # per query block; a single unused one per (batch, head) otherwise)
        sem = bx * CTA_THREADS + tidx
        if sem < mdQsem.shape[2]:
            mdQsem[batch, head, sem] = Int32(0)

    @cute.jit
    def _rows(self, mO, mdO, mLSE, mLSE2, mDelta, batch, head, bx, tidx, seqlen):
        """Delta and LSE2 of the ROWS_PER_CTA rows of group ``bx``, each row on THREADS_PER_ROW
        adjacent threads: O and dO loaded (then ``griddepcontrol.launch_dependents`` with
        ``pdl``), then summed. Rows past seqlen_q read nothing: zeros (Delta 0, LSE2 +inf)."""
        row = bx * ROWS_PER_CTA + tidx // THREADS_PER_ROW
        part = tidx % THREADS_PER_ROW
        rO = cute.make_rmem_tensor((self.cols,), mO.element_type)
        rdO = cute.make_rmem_tensor((self.cols,), mdO.element_type)
        rO.fill(0.0)
        rdO.fill(0.0)
        lse = -Float32.inf
        if row < seqlen:
            cute.autovec_copy(_row_part(mO[batch, row, head, None], part, self.cols), rO)
            cute.autovec_copy(_row_part(mdO[batch, row, head, None], part, self.cols), rdO)
            if part == 0:
                lse = mLSE[batch, head, row]
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_launch_dependents()
        self._store_row(rO, rdO, lse, row, row < seqlen, mLSE2, mDelta, batch, head, tidx)

    @cute.kernel
    def persistent_kernel(self, tma_O: cute.CopyAtom, mO: cute.Tensor, tma_dO: cute.CopyAtom,
                          mdO: cute.Tensor, s_layout: cute.Layout, mLSE, mLSE2, mDelta, mdQacc,
                          mdQsem):
        """Note [Preprocess beside the main kernel]: this CTA's units (``_PreSchedule``). The
        load warp keeps up to PRE_STAGES units of O and dO in SMEM (TMA); the worker threads
        copy their rows' LSE (``cp.async``, each thread reading back only what it copied) and
        sum (``_work``); the count warps add each finished chunk's rows to its (batch, head)'s
        count (release). ``mO``, ``mdO``: the TMA views, (seqlen_q, hdimv, heads, batch)."""
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp == PRE_LOAD_WARP:
            cpasync.prefetch_descriptor(tma_O)
            cpasync.prefetch_descriptor(tma_dO)
        smem = cutlass.utils.SmemAllocator()
        mbar_rows = smem.allocate_array(cutlass.Int64, 2 * PRE_STAGES)
        mbar_count = smem.allocate_array(cutlass.Int64, 2 * PRE_COUNT_WARPS)
        sO = smem.allocate_tensor(self.dtype, s_layout, byte_alignment=128)
        sdO = smem.allocate_tensor(self.dtype, s_layout, byte_alignment=128)
        sLSE = smem.allocate_tensor(Float32, cute.make_layout((self.unit_rows, PRE_STAGES)),
                                    byte_alignment=16)
        workers = pipeline.CooperativeGroup(pipeline.Agent.Thread, CTA_THREADS)
        pipe_rows = pipeline.PipelineTmaAsync.create(
            barrier_storage=mbar_rows, num_stages=PRE_STAGES,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                     CTA_THREADS // cute.arch.WARP_SIZE),
            tx_count=2 * cute.size_in_bytes(self.dtype, cute.select(s_layout, mode=[0, 1])),
            defer_sync=True)
        # the workers hand finished units to the count warps (slot c: count warp c)
        handoff = pipeline.PipelineAsync.create(
            barrier_storage=mbar_count, num_stages=PRE_COUNT_WARPS, producer_group=workers,
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, cute.arch.WARP_SIZE),
            defer_sync=True)
        cute.arch.mbarrier_init_fence()
        cute.arch.barrier()
        if const_expr(self.pdl):  # Note [chained launches]: the kernel before has finished
            cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()  # the main kernel may start at once
        sched = _PreSchedule(self, cta, mLSE2.shape[2], mO.shape[2], mO.shape[3])
        if warp < PRE_LOAD_WARP:
            self._work(mO, mLSE, mLSE2, mDelta, mdQacc, sO, sdO, sLSE, pipe_rows, handoff, sched,
                       tidx)
        elif warp == PRE_LOAD_WARP:
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, PRE_STAGES)
            for i in cutlass.range(sched.slots, unroll=1):
                batch, head, tile, real = sched.unit(i)
                if real:
                    pipe_rows.producer_acquire(state)
                    for tma, mX, sX in ((tma_O, mO, sO), (tma_dO, mdO, sdO)):
                        gX = cute.local_tile(mX[None, None, head, batch],
                                             (self.unit_rows, self.hdimv), (None, 0))
                        sX_part, gX_part = cpasync.tma_partition(
                            tma, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2),
                            cute.group_modes(gX, 0, 2))
                        cute.copy(tma, gX_part[None, tile], sX_part[None, state.index],
                                  tma_bar_ptr=pipe_rows.producer_get_barrier(state))
                    state.advance()
        else:
            # count warp c takes this CTA's chunks c, c + PRE_COUNT_WARPS, ..., always in
            # handoff slot c
            c = warp - PRE_LOAD_WARP - 1
            state = pipeline.PipelineState(PRE_COUNT_WARPS, c, c, Int32(0))
            for j in cutlass.range(c, sched.chunks, PRE_COUNT_WARPS, unroll=1):
                handoff.consumer_wait(state)  # acquire (CTA): every worker's stores of the chunk
                if tidx % cute.arch.WARP_SIZE == 0:
                    batch, head, rows = sched.chunk_rows(j)
                    # release (GPU), cumulative: the workers' stores this warp acquired go first
                    cute.arch.red(preprocess_count(mdQsem, batch, head), rows, op="add",
                                  dtype="s32", sem="release", scope="gpu")
                handoff.consumer_release(state)
                for _ in cutlass.range_constexpr(PRE_COUNT_WARPS):
                    state.advance()

    @cute.jit
    def _work(self, mO, mLSE, mLSE2, mDelta, mdQacc, sO, sdO, sLSE, pipe_rows, handoff, sched,
              tidx):
        """The worker threads of a persistent CTA: for each of this CTA's units, the LSE of
        this thread's rows copied PRE_STAGES - 1 units ahead (``cp.async``), then, once the
        unit's O and dO have landed, its Delta and LSE2 (and the dQ accumulator's zeros); after
        a chunk's last unit, the chunk to the count warps."""
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, PRE_STAGES)
        count_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                   PRE_COUNT_WARPS)
        for i in cutlass.range_constexpr(PRE_STAGES - 1):
            self._load_lse(mO, mLSE, sLSE, sched, i, tidx)
            cute.arch.cp_async_commit_group()
        for i in cutlass.range(sched.slots, unroll=1):
            self._load_lse(mO, mLSE, sLSE, sched, i + PRE_STAGES - 1, tidx)
            cute.arch.cp_async_commit_group()  # empty past the last unit: the count holds
            batch, head, tile, real = sched.unit(i)
            if real:
                cute.arch.cp_async_wait_group(PRE_STAGES - 1)  # this thread's LSE of unit i
                pipe_rows.consumer_wait(state)
                self._finish_unit(mO, mLSE2, mDelta, mdQacc, sO, sdO, sLSE, batch, head,
                                  tile * self.unit_rows, i % PRE_STAGES, state.index, tidx)
                pipe_rows.consumer_release(state)
                state.advance()
            if i % sched.chunk_units == sched.chunk_units - 1:
                handoff.producer_acquire(count_state)
                handoff.producer_commit(count_state)  # release (CTA): this thread's stores
                count_state.advance()

    @cute.jit
    def _load_lse(self, mO, mLSE, sLSE, sched, i, tidx):
        """Start the copy of the LSE of this thread's row in each group of this CTA's unit
        slot ``i`` into LSE stage i mod PRE_STAGES (the row's first thread; nothing for a slot
        past the last unit or of no unit, or for rows past seqlen_q: ``_finish_unit`` reads
        those as -inf)."""
        batch, head, tile, real = sched.unit(i)
        copy_lse = cute.make_copy_atom(cpasync.CopyG2SOp(), Float32, num_bits_per_copy=32)
        if i < sched.slots and tidx % THREADS_PER_ROW == 0:
            if real:
                for g in cutlass.range_constexpr(self.groups):
                    r = g * ROWS_PER_CTA + tidx // THREADS_PER_ROW
                    row = tile * self.unit_rows + r
                    if row < mO.shape[0]:
                        cute.copy(copy_lse,
                                  cute.local_tile(mLSE[batch, head, None], (1,), (row,)),
                                  cute.local_tile(sLSE[None, i % PRE_STAGES], (1,), (r,)))

    @cute.jit
    def _finish_unit(self, mO, mLSE2, mDelta, mdQacc, sO, sdO, sLSE, batch, head, first_row,
                     lse_stage, stage, tidx):
        """Delta and LSE2 of the unit of (batch, head) from row ``first_row`` on, from SMEM
        stage ``stage`` (O, dO) and ``lse_stage`` (this thread's LSE), which have landed; with
        ``zero_dq`` its rows of the dQ accumulator."""
        part = tidx % THREADS_PER_ROW
        rO = cute.make_rmem_tensor((self.cols,), self.dtype)
        rdO = cute.make_rmem_tensor((self.cols,), self.dtype)
        for g in cutlass.range_constexpr(self.groups):
            r = g * ROWS_PER_CTA + tidx // THREADS_PER_ROW
            cute.autovec_copy(_row_part(sO[r, None, stage], part, self.cols), rO)
            cute.autovec_copy(_row_part(sdO[r, None, stage], part, self.cols), rdO)
            valid = first_row + r < mO.shape[0]
            lse = -Float32.inf
            if valid and part == 0:
                lse = sLSE[r, lse_stage]
            self._store_row(rO, rdO, lse, first_row + r, valid, mLSE2, mDelta, batch, head,
                            tidx)
        if const_expr(self.zero_dq):
            first_group = first_row // ROWS_PER_CTA
            for g in cutlass.range_constexpr(self.groups):
                if (first_group + g) * ROWS_PER_CTA < mLSE2.shape[2]:
                    self._zero_dq_rows(mdQacc, first_group + g, head, batch, tidx)

    @cute.jit
    def _store_row(self, rO, rdO, lse, row, valid, mLSE2, mDelta, batch, head, tidx):
        """Sum this thread's part of O * dO over the row's THREADS_PER_ROW lanes (every lane of
        the warp shuffles, so only the stores are predicated) and store the row's Delta and
        LSE2 (an invalid row, past seqlen_q: Delta 0 whatever the registers hold, LSE2 +inf;
        rows past seqlen_q_pad are not stored)."""
        delta = (rO.load().to(Float32) * rdO.load().to(Float32)).reduce(
            cute.ReductionOp.ADD, Float32(0.0), 0)
        for offset in cutlass.range_constexpr(THREADS_PER_ROW.bit_length() - 2, -1, -1):
            delta = delta + cute.arch.shuffle_sync_bfly(delta, offset=1 << offset)
        if not valid:
            delta = Float32(0.0)
        if tidx % THREADS_PER_ROW == 0 and row < mLSE2.shape[2]:
            # -inf: a row past seqlen_q, or one that sees no key
            lse2 = Float32.inf
            if lse != -Float32.inf:
                lse2 = lse * LOG2_E
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


class _PreSchedule(NoLoopCarriedValues):
    """Note [Preprocess beside the main kernel]: the work of persistent preprocess CTA ``cta``
    (traced inline). A (batch, head) pair's padded rows are ``units_per_pair`` units of
    ``unit_rows`` rows, split evenly into ``chunks_per_pair`` chunks of at most
    ``chunk_units`` (<= PRE_CHUNK_UNITS) consecutive units; the chunks, pair after pair in the
    main kernel's order, go to the CTAs in turn (chunk c to CTA c mod ctas), and each chunk is
    counted once. A CTA walks ``slots`` = ``chunks`` x ``chunk_units`` unit slots; a pair's
    last chunk may leave slots without a unit (``real`` false). Its values are defined before
    any branch, so branches and loops need not carry it."""

    def __init__(self, pre, cta, rows_pad, heads, batches):
        self.cta, self.ctas, self.unit_rows = cta, pre.ctas, pre.unit_rows
        self.rows_pad, self.heads = rows_pad, heads
        self.units_per_pair = cute.ceil_div(rows_pad, pre.unit_rows)
        self.chunks_per_pair = cute.ceil_div(self.units_per_pair, PRE_CHUNK_UNITS)
        self.chunk_units = cute.ceil_div(self.units_per_pair, self.chunks_per_pair)
        total = self.chunks_per_pair * heads * batches
        self.chunks = (total - cta + pre.ctas - 1) // pre.ctas  # cta < ctas: never negative
        self.slots = self.chunks * self.chunk_units

    def _chunk(self, j):
        """(batch, head, index in its pair) of this CTA's chunk ``j``."""
        chunk = self.cta + j * self.ctas
        pair = chunk // self.chunks_per_pair
        batch = pair // self.heads
        return batch, pair - batch * self.heads, chunk - pair * self.chunks_per_pair

    def unit(self, i):
        """(batch, head, unit index in the pair, whether the slot holds a unit) of slot i."""
        j = i // self.chunk_units
        batch, head, k = self._chunk(j)
        tile = k * self.chunk_units + i - j * self.chunk_units
        return batch, head, tile, tile < self.units_per_pair

    def chunk_rows(self, j):
        """(batch, head, padded rows) of this CTA's chunk ``j``: what its count adds."""
        batch, head, k = self._chunk(j)
        first_row = k * self.chunk_units * self.unit_rows
        return batch, head, cutlass.min(self.chunk_units * self.unit_rows,
                                        self.rows_pad - first_row)


class BwdPostprocess:
    """out (batch, seqlen, heads_out, hdim) = scale * sum over groups of acc (batch, heads_acc,
    seqlen_pad, pitch >= hdim). With ``mCuSeqlens`` (varlen: Note [Varlen backward] in
    bwd_kernel.py) out is packed (1, total, h, d) and acc is the packed workspace (Note
    [Packed workspace] in varlen.py): grid batch index i is sequence i, whose first
    ``mSeqUsed[i]`` rows (all without it) are written; ``max_seqlen`` sizes the grid."""

    def __init__(self, head_dim: int, group: int, pdl: bool, tile_n: int = 0):
        assert head_dim % THREADS_PER_ROW == 0, head_dim
        self.hdim = head_dim
        self.group = group
        self.cols = head_dim // THREADS_PER_ROW
        self.pdl = pdl
        self.tile_n = tile_n  # varlen: the key blocks of the packed workspace

    def _acc_part(self, mAcc, batch, head, row, part):
        """This thread's columns of one accumulator row (rows may be padded past hdim)."""
        row_t = cute.make_tensor(mAcc[batch, head, row, None].iterator, cute.make_layout(self.hdim))
        return _row_part(row_t, part, self.cols)

    @cute.jit
    def __call__(self, mAcc: cute.Tensor, mOut: cute.Tensor, scale: Float32, mCuSeqlens,
                 mSeqUsed, max_seqlen, stream):
        grid = [cute.ceil_div(mOut.shape[1], ROWS_PER_CTA), mOut.shape[2], mAcc.shape[0]]
        if const_expr(mCuSeqlens is not None):  # varlen: the rows of the longest sequence
            grid = [cute.ceil_div(max_seqlen, ROWS_PER_CTA), mOut.shape[2],
                    mCuSeqlens.shape[0] - 1]
        self.kernel(mAcc, mOut, scale, mCuSeqlens, mSeqUsed).launch(
            grid=grid, block=[CTA_THREADS, 1, 1], stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mAcc, mOut, scale: Float32, mCuSeqlens, mSeqUsed):
        tidx, _, _ = cute.arch.thread_idx()
        bx, head, batch = cute.arch.block_idx()
        seqlen = mOut.shape[1]
        if const_expr(mCuSeqlens is not None):  # varlen: sequence ``batch``'s rows, and its
            # blocks of the packed accumulator (Note [Packed workspace] in varlen.py)
            mOut, seqlen = sequence_rows(mCuSeqlens, mSeqUsed, batch, (mOut, 1, 0))
            mAcc = sequence_views(batch, first_block(mCuSeqlens, batch, self.tile_n) * self.tile_n,
                                  (mAcc, 2, 0))[0]
        if const_expr(self.pdl):  # Note [chained launches]: the kernel before has finished
            cute.arch.griddepcontrol_wait()
        row = bx * ROWS_PER_CTA + tidx // THREADS_PER_ROW
        part = tidx % THREADS_PER_ROW
        if row < seqlen:
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
    was reached by no CTA: its accumulator was never written, and dq is 0 there. With
    ``mCuSeqlens`` (varlen) the accumulator is the packed workspace (Note [Packed workspace]
    in varlen.py) and dq packed (1, total, h, d); ``max_seqlen`` sizes the grid, and the
    blocks past a sequence's rows do nothing."""

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
        it waits for) and where that count is (``slots_after_finished_count``, which
        ``finished_ctas_count`` reads)."""
        early = (cfg.tile_n, cfg.slots_after_finished_count) if cfg.early_dq_post else ()
        return (cfg.tile_m, cfg.head_dim, cfg.dtype, cfg.pdl, cfg.first_stores_dq,
                cfg.varlen) + early

    @cute.jit
    def __call__(self, mAcc: cute.Tensor, mSem: cute.Tensor, mOut: cute.Tensor, scale: Float32,
                 seqlen_k: Int32, mCuSeqlens, max_seqlen, stream):
        mma = dq_tiled_mma(self.cfg, mOut.element_type)
        grid = [mAcc.shape[2], mOut.shape[2], mAcc.shape[0]]
        if const_expr(mCuSeqlens is not None):  # varlen: the longest sequence's blocks
            grid = [cute.ceil_div(max_seqlen, self.tile_m), mOut.shape[2],
                    mCuSeqlens.shape[0] - 1]
        self.kernel(mAcc, mSem, mOut, scale, seqlen_k, mma, mCuSeqlens).launch(
            grid=grid, block=[self.threads, 1, 1], smem=self.smem_bytes(mOut.element_type),
            stream=stream, use_pdl=self.cfg.pdl)

    @cute.kernel
    def kernel(self, mAcc, mSem, mOut, scale: Float32, seqlen_k: Int32, mma: cute.TiledMma,
               mCuSeqlens):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        seqlen_q = mOut.shape[1]
        active = True
        if const_expr(mCuSeqlens is not None):  # varlen: sequence ``batch``'s rows of dq, and
            # its blocks of the packed accumulator (Note [Packed workspace] in varlen.py); the
            # blocks past the sequence have nothing to write
            mOut, seqlen_q = sequence_rows(mCuSeqlens, None, batch, (mOut, 1, 0))
            mAcc = sequence_views(batch, first_block(mCuSeqlens, batch, self.tile_m),
                                  (mAcc, 2, 0))[0]
            active = m_block * self.tile_m < seqlen_q
        if active:
            self._block(mAcc, mSem, mOut, scale, seqlen_k, mma, m_block, head, batch, seqlen_q,
                        tidx)

    @cute.jit
    def _block(self, mAcc, mSem, mOut, scale: Float32, seqlen_k: Int32, mma: cute.TiledMma,
               m_block: Int32, head: Int32, batch: Int32, seqlen_q: Int32, tidx: Int32):
        """Query block ``m_block`` of (``batch``, ``head``): its accumulator, scaled, to dq."""
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
        rows_left = seqlen_q - m_block * self.tile_m
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
