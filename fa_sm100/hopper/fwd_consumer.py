"""The consumer warpgroups of the SM90 forward: mainloop and epilogue.

Each consumer warpgroup owns 64 query rows of the CTA's tile. Per KV tile j (last first):

    S = Q K[j]^T            SS WGMMA, float32 accumulator in registers
    mask, online softmax    row max / sum over quads of threads, exp2 on the SFU
    P = bf16/fp16(S)        stays in registers: the A operand of the next GEMM (RS WGMMA)
    O = O * scale + P V[j]

Note [Intra-warpgroup overlap]: with ``intra_wg_overlap`` the warpgroup issues S(j-1) = Q K[j-1]^T
and O += P(j) V[j] back to back and only then waits for S(j-1) (``wait_group(1)``): the tensor
cores compute the PV GEMM of tile j while the warpgroup runs the softmax of tile j-1. The
producer's load order (K[j-1] before V[j]) follows this. With ``rescale_o_before_pv`` the
rescale of O by the previous tile's factor moves before the PV GEMM, into the shadow of the QK
GEMM (pays off when O is large, head_dim_v > 128).

Note [Rescale threshold] (``rescale_threshold`` > 0): the online softmax multiplies O by
exp2(old max - new max) at every KV tile, 64 (hdim 128) or 128 (hdim 256) FMULs per thread
between two GEMMs of the warpgroup, although after the first few tiles the row max rarely
moves. With a threshold (log2 units, ``fa_sm100.softmax_math.rescale_needed``, the SM100
kernel's rule) a row keeps its max unless the tile raises it by more, so its factor is exactly
1, and the warp votes: only if one of its 16 rows has a factor in (0, 1) does it run the
multiply (a factor of 0 meets a row whose keys were all masked so far, still 0). P of such a
tile may reach 2^threshold (``validate()``: within the 16-bit type); the final 1 / row sum
divides the common factor out, and LSE is taken against the same stale max.

Note [O in Q's buffer]: O leaves through an SMEM tile before its TMA store. One tile per CTA
stages it in Q's buffer (Q is dead after the last QK GEMM). Persistent CTAs give O its own
buffer, so the next tile's Q can load while this tile's O is stored, unless ``o_in_q_buffer``
(hdim 256, where a second 64 KiB tile does not fit): then Q's stage is released only once the
store has read O (the storing warp waits for the bulk group's reads, then every consumer
thread passes the EPILOGUE barrier), and the producer issues the next tile's first K tile
before its Q so that K does not wait behind the store.

Note [Empty warpgroups] (``skip_empty_wg``): the last m block of a (batch, head) can hold
fewer rows than the tile: at hdim 64 (192-row tiles) and seqlen_q 1024 it holds 64, so two of
its three warpgroups own only rows past seqlen_q, whose O and LSE are never stored. Such a
warpgroup runs the tile's protocol without its work: it waits for every K / V stage and
releases it (a release before the stage is full would count toward the wrong phase of its
empty barrier) and takes its ping-pong turns, but issues no GEMM and computes no softmax; the
rest of the tile runs on the tensor cores without it. Its epilogue runs as usual (the
EPILOGUE barriers count every consumer thread) on an O that is never stored: the TMA store
clips those rows and their LSE is skipped. ``select_sm90_fwd_config`` turns the skip on where
the last m block has such a warpgroup (``Sm90FwdConfig.has_empty_wg``): where none is empty,
the branch around the main loop only costs (measured slower there).

Note [Warpgroup epilogues] (``wg_epilogue``): without it, O leaves through one SMEM tile and one
TMA store per work tile, after two EPILOGUE barriers of every consumer thread, so at the end of
every tile the warpgroup that finished first waits for the last one, and all of them start the
next tile together: their first QK GEMMs and softmaxes run side by side, with nothing else for
the tensor cores to do meanwhile. With it, O's SMEM tile is (64, head_dim_v, warpgroup): each
warpgroup stages its own rows, synchronised only among its 128 threads (EPILOGUE_WG0 + w), and
its first warp issues their TMA store (a 64-row box; none where all 64 rows lie past seqlen_q)
and waits for that store's reads before the warpgroup writes O there again. A warpgroup thus
goes on to the next tile while the others finish theirs; how far ahead it gets is bounded by the
K/V and Q pipelines, whose stages every warpgroup releases. Persistent CTAs with O's own buffer
only (``validate()``): where O is staged in Q's buffer, one warpgroup's O would overwrite the Q
rows that another's QK GEMMs still read. The default together with two Q stages
(row "fast tile boundaries" of ``FWD_TUNING`` in fwd_tuning.py holds the measurements).

Note [Ping-pong]: with ``pingpong`` consumer warpgroup w waits on barrier PINGPONG_WG0 + w
before issuing its GEMMs and then arrives on the next warpgroup's barrier, so the warpgroups
take turns on the tensor cores and one's softmax hides behind the other's GEMMs. Warpgroup 0
pre-arrives on its own barrier once, so it goes first. On by default at hdim 64 only
(``PINGPONG_MAX_HEAD_DIM``): with two warpgroups at hdim 128, each overlapping its own softmax
with its PV GEMM (Note [Intra-warpgroup overlap]), the turns measured slower on an H100 than
letting both issue as they are ready (CHANGELOG.md).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from fa_sm100 import bands
from fa_sm100.dsl_math import softcap_tanh
from fa_sm100.hopper.common import NO_WAIT, rows_cols_view, stmatrix_to_smem, transpose_view, wgmma
from fa_sm100.hopper.config import WARPGROUP_THREADS, WGMMA_M
from fa_sm100.hopper.fwd_math import (
    apply_mask,
    convert_to,
    finalize_softmax,
    online_softmax_step,
    operand_a_view,
    rescale_o,
    rescale_rows,
)
from fa_sm100.hopper.named_barriers import Sm90FwdBarrier
from fa_sm100.varlen import ragged_tile_rows


class ConsumerFrags:
    """What one consumer thread works with: GEMM fragments, O, row statistics, mask coordinates.

    A plain holder (not a dataclass): the DSL would carry a dataclass through run-time loops
    as run-time values and lose the static layouts of its tensors.

    tSrQ (MMA, MMA_M, MMA_K, STAGE) / tSrK (MMA, MMA_N, MMA_K, STAGE) / tOrV (MMA, MMA_N, MMA_K,
    STAGE): WGMMA descriptors of Q, K and V^T in SMEM. tOrP (MMA, MMA_M, MMA_K): P in registers,
    the A operand of O += P V. acc_O (MMA, MMA_M, MMA_N) float32. coord_rc / coord0_rc (ROWS,
    COLS): this thread's and thread 0's S coordinates. row_max, row_sum, row_scale (ROWS,).
    """

    def __init__(self, **fields):
        self.__dict__.update(fields)


class ConsumerRole:
    """Mixin of the kernel class: everything the consumer warpgroups run."""

    def pingpong_wait(self, wg: Int32):
        if const_expr(self.cfg.pingpong):
            cute.arch.barrier(barrier_id=int(Sm90FwdBarrier.PINGPONG_WG0) + wg,
                              number_of_threads=2 * WARPGROUP_THREADS)

    def pingpong_pass(self, wg: Int32):
        if const_expr(self.cfg.pingpong):
            nxt = (wg + 1) % self.cfg.num_consumer_wg
            cute.arch.barrier_arrive(barrier_id=int(Sm90FwdBarrier.PINGPONG_WG0) + nxt,
                                     number_of_threads=2 * WARPGROUP_THREADS)

    @cute.jit
    def qk_gemm(self, f: ConsumerFrags, tSrQ: cute.Tensor, stage: Int32,
                wait: cutlass.Constexpr[int]) -> cute.Tensor:
        """S = Q K^T with Q's stage ``tSrQ`` (MMA, MMA_M, MMA_K) and K's stage ``stage``."""
        acc_S = cute.make_rmem_tensor(f.s_shape, Float32)  # (MMA, MMA_M, MMA_N)
        wgmma(f.tiled_mma_qk, acc_S, tSrQ, f.tSrK[None, None, None, stage], True, wait)
        return acc_S

    def q_index(self, q_state):
        """The Q stage of ``q_state``: a constant 0 with one stage (Note [Two Q stages] in
        fwd_kernel.py)."""
        return 0 if const_expr(self.cfg.q_stage == 1) else q_state.index

    @cute.jit
    def pv_gemm(self, f: ConsumerFrags, stage: Int32, wait: cutlass.Constexpr[int]):
        wgmma(f.tiled_mma_pv, f.acc_O, f.tOrP, f.tOrV[None, None, None, stage], False, wait)

    @cute.jit
    def softmax(self, f: ConsumerFrags, acc_S: cute.Tensor, row_base: Int32, n: Int32,
                mask_seqlen: cutlass.Constexpr[bool], mask_band: cutlass.Constexpr[bool],
                is_first: cutlass.Constexpr[bool]):
        """Cap S of KV tile n (``softcap``: tanh(S * softcap_k)), mask it (``mask_band``: the
        causal diagonal, or with ``local`` both edges of the window), then one online-softmax
        step (row_scale = O's rescale factor)."""
        s_rc = rows_cols_view(acc_S)
        if const_expr(self.cfg.softcap):  # before the mask: tanh(-inf) would be -1
            for r in cutlass.range_constexpr(cute.size(s_rc, mode=[0])):
                for c in cutlass.range_constexpr(cute.size(s_rc, mode=[1])):
                    s_rc[r, c] = softcap_tanh(s_rc[r, c] * f.softcap_k)
        mask_right = mask_band and (self.cfg.causal or self.cfg.local)
        if const_expr(mask_seqlen or mask_right):
            apply_mask(s_rc, f.coord_rc, f.coord0_rc, row_base, n * self.cfg.n_block,
                       f.seqlen_k, f.right_edge, f.left_edge, mask_seqlen, mask_right,
                       mask_right and self.cfg.local)
        online_softmax_step(s_rc, f.row_max, f.row_sum, f.row_scale, f.scale_log2, is_first,
                            self.cfg.ex2_emu_fraction, self.cfg.rescale_threshold)

    def rescale_acc_o(self, f: ConsumerFrags):
        """O *= the last softmax step's factors (Note [Rescale threshold])."""
        rescale_o(rows_cols_view(f.acc_O), f.row_scale, self.cfg.rescale_threshold > 0.0)

    @cute.jit
    def consumer(self, mO, mLSE, mK, sQ, sK, sV, sO, tma_o, tiled_mma_qk, tiled_mma_pv,
                 pipe_q, pipe_k, pipe_v, scale_log2: Float32, total_tiles: Int32, l2_heads: Int32,
                 pipe_tile, sTile, window, softcap_k, varlen):
        """Consumer warpgroups: 64 rows each; per work tile all its KV tiles, then the epilogue.

        Consumes: q (released after the tile's last QK GEMM, or after the O store with
        ``o_in_q_buffer``, Note [O in Q's buffer]), k and v stages (each released right after
        the GEMM that read it); with ``dynamic_schedule``, the next tile's index from the tile
        pipeline (Note [Dynamic tile schedule] in fwd_kernel.py).
        Produces: O (staged in SMEM, TMA store) and LSE (direct stores). ``window``: the
        run-time (left, right) bounds of a ``local`` kernel, else None; ``softcap_k``: the
        raw scores' factor inside tanh of a softcapped kernel, else None; ``varlen``: the packed
        sequences' tensors (Note [Varlen] in fwd_kernel.py), else None.
        """
        cfg = self.cfg
        tidx = cute.arch.thread_idx()[0] - WARPGROUP_THREADS
        wg = cute.arch.make_warp_uniform(tidx // WARPGROUP_THREADS)
        seqlen_q = mO.shape[0]
        seqlen_k = mK.shape[0]

        wg_mma_qk = tiled_mma_qk.get_slice(wg * WARPGROUP_THREADS)
        wg_mma_pv = tiled_mma_pv.get_slice(wg * WARPGROUP_THREADS)
        cS = cute.make_identity_tensor((cfg.m_block, cfg.n_block))
        coord_rc = rows_cols_view(tiled_mma_qk.get_slice(tidx).partition_C(cS))
        rows = cute.size(coord_rc, mode=[0])
        f = ConsumerFrags(
            tiled_mma_qk=tiled_mma_qk,
            tiled_mma_pv=tiled_mma_pv,
            tSrQ=wg_mma_qk.make_fragment_A(wg_mma_qk.partition_A(sQ)),
            tSrK=wg_mma_qk.make_fragment_B(wg_mma_qk.partition_B(sK)),
            tOrV=wg_mma_pv.make_fragment_B(wg_mma_pv.partition_B(transpose_view(sV))),
            tOrP=wg_mma_pv.make_fragment_A(wg_mma_pv.partition_shape_A((cfg.m_block, cfg.n_block))),
            acc_O=cute.make_rmem_tensor(
                wg_mma_pv.partition_shape_C((cfg.m_block, cfg.head_dim_v)), Float32),
            s_shape=wg_mma_qk.partition_shape_C((cfg.m_block, cfg.n_block)),
            coord_rc=coord_rc,
            coord0_rc=rows_cols_view(tiled_mma_qk.get_slice(0).partition_C(cS)),
            row_max=cute.make_rmem_tensor((rows,), Float32),
            row_sum=cute.make_rmem_tensor((rows,), Float32),
            row_scale=cute.make_rmem_tensor((rows,), Float32),
            seqlen_k=seqlen_k,
            # key k of row r is masked where k > r + right_edge or k < r + left_edge
            right_edge=seqlen_k - seqlen_q,
            left_edge=None,
            scale_log2=scale_log2,
            window=window,
            softcap_k=softcap_k,
        )
        if const_expr(cfg.local):
            f.right_edge = seqlen_k - seqlen_q + window[1]
            f.left_edge = seqlen_k - seqlen_q - window[0]
        lse = cute.make_rmem_tensor((rows,), Float32)

        if const_expr(cfg.pingpong):
            if wg == 0:  # See Note [Ping-pong]: warpgroup 0 issues first.
                cute.arch.barrier_arrive(barrier_id=int(Sm90FwdBarrier.PINGPONG_WG0),
                                         number_of_threads=2 * WARPGROUP_THREADS)

        q_state = cutlass.pipeline.make_pipeline_state(
            cutlass.pipeline.PipelineUserType.Consumer, cfg.q_stage)
        state = cutlass.pipeline.make_pipeline_state(
            cutlass.pipeline.PipelineUserType.Consumer, cfg.kv_stage)
        # Work tiles: blockIdx.x, then (persistent) every gridDim.x-th. Without persistence the
        # single tile is not wrapped in a loop, which keeps the mainloop's addressing hoisted.
        if const_expr(cfg.dynamic_schedule):
            tile_state = cutlass.pipeline.make_pipeline_state(
                cutlass.pipeline.PipelineUserType.Consumer, pipe_tile.num_stages)
            t = cute.arch.block_idx()[0]
            while t < total_tiles:
                state, q_state = self.consumer_tile(
                    f, lse, t, state, q_state, wg, tidx, mO, mLSE, mK, sO, tma_o, tiled_mma_pv,
                    pipe_q, pipe_k, pipe_v, scale_log2, l2_heads, seqlen_q, varlen)
                pipe_tile.consumer_wait(tile_state)
                t = sTile[tile_state.index]
                pipe_tile.consumer_release(tile_state)  # after the read: the slot may be reused
                tile_state.advance()
        elif const_expr(cfg.persistent):
            for t in cutlass.range(cute.arch.block_idx()[0], total_tiles, cute.arch.grid_dim()[0],
                                   unroll=1):
                state, q_state = self.consumer_tile(
                    f, lse, t, state, q_state, wg, tidx, mO, mLSE, mK, sO, tma_o, tiled_mma_pv,
                    pipe_q, pipe_k, pipe_v, scale_log2, l2_heads, seqlen_q, varlen)
        else:
            self.consumer_tile(
                f, lse, cute.arch.block_idx()[0], state, q_state, wg, tidx, mO, mLSE, mK, sO, tma_o,
                tiled_mma_pv, pipe_q, pipe_k, pipe_v, scale_log2, l2_heads, seqlen_q, varlen)
        if self.stores_o(tidx):
            cute.arch.cp_async_bulk_wait_group(0, read=True)  # sO is read before the CTA exits

    def stores_o(self, tidx: Int32):
        """Whether this thread's warp issues O's TMA stores: the first consumer warp, or with
        ``wg_epilogue`` each consumer warpgroup's first (Note [Warpgroup epilogues])."""
        if const_expr(self.cfg.wg_epilogue):
            return tidx % WARPGROUP_THREADS // cute.arch.WARP_SIZE == 0
        return tidx // cute.arch.WARP_SIZE == 0

    @cute.jit
    def consumer_tile(self, f: ConsumerFrags, lse, t: Int32, state, q_state, wg: Int32,
                      tidx: Int32, mO, mLSE, mK, sO, tma_o, tiled_mma_pv, pipe_q, pipe_k, pipe_v,
                      scale_log2: Float32, l2_heads: Int32, seqlen_q: Int32, varlen):
        """One work tile: every KV tile of it (see the Notes above), then the epilogue.
        Returns the advanced (kv, q) pipeline states."""
        cfg = self.cfg
        m_block, head, batch, n_lo, n_blocks, masked_from, left_to, seq = self.tile_coords(
            t, mO, mK, l2_heads, f.window, varlen)  # mO: same (s, ., h, b) modes as Q
        if const_expr(varlen is not None):  # Note [Varlen]: this tile's sequence's lengths
            f.seqlen_k = seq[3]
            f.right_edge = seq[3] - seq[2] + f.window[1]
            f.left_edge = seq[3] - seq[2] - f.window[0]
            if m_block * cfg.m_block < seq[2]:  # a tile past its sequence: nothing at all
                state, q_state = self.tile_work(
                    f, lse, state, q_state, wg, tidx, mO, mLSE, sO, tma_o, tiled_mma_pv, pipe_q,
                    pipe_k, pipe_v, scale_log2, seq[2], m_block, head, batch, n_lo, n_blocks,
                    masked_from, left_to, seq)
        else:
            state, q_state = self.tile_work(
                f, lse, state, q_state, wg, tidx, mO, mLSE, sO, tma_o, tiled_mma_pv, pipe_q,
                pipe_k, pipe_v, scale_log2, seqlen_q, m_block, head, batch, n_lo, n_blocks,
                masked_from, left_to, seq)
        return state, q_state

    @cute.jit
    def tile_work(self, f: ConsumerFrags, lse, state, q_state, wg: Int32, tidx: Int32, mO, mLSE,
                  sO, tma_o, tiled_mma_pv, pipe_q, pipe_k, pipe_v, scale_log2: Float32,
                  seqlen_q: Int32, m_block: Int32, head: Int32, batch: Int32, n_lo: Int32,
                  n_blocks: Int32, masked_from: Int32, left_to: Int32, seq):
        """``consumer_tile``'s work on the tile ``tile_coords`` gave. Returns the advanced (kv,
        q) pipeline states."""
        cfg = self.cfg
        row_base = m_block * cfg.m_block
        self.reset_tile(f)
        n_masked = 0  # KV tiles after the first that cross the band's right edge
        n_left = 0  # the last KV tiles, which cross its left edge (a window only)
        if const_expr(cfg.local):
            n_masked, n_left = bands.kv_mask_phases(n_lo, n_blocks, masked_from, left_to,
                                                    cutlass.max, cutlass.min)
        elif const_expr(cfg.causal):
            n_masked = cutlass.max(n_blocks - 1 - masked_from, 0)
        pipe_q.consumer_wait(q_state)
        empty = cutlass.Boolean(False)  # Note [Empty warpgroups]
        if const_expr(cfg.skip_empty_wg):
            empty = row_base + WGMMA_M * wg >= seqlen_q
        if n_blocks > 0:
            if empty:
                state = self.empty_wg_steps(state, n_blocks, wg, pipe_q, q_state, pipe_k, pipe_v)
            else:
                state = self.mainloop(f, state, row_base, n_lo, n_blocks, n_masked, n_left, wg,
                                      pipe_q, q_state, pipe_k, pipe_v)
        else:
            self.release_q_after_gemms(pipe_q, q_state)

        finalize_softmax(f.row_max, f.row_sum, f.row_scale, lse, scale_log2)
        rescale_rows(rows_cols_view(f.acc_O), f.row_scale)  # by 1 / row sum
        self.epilogue(f.acc_O, lse, mO, mLSE, sO, tma_o, tiled_mma_pv, tidx, m_block, head,
                      batch, seqlen_q, seq)
        if const_expr(cfg.o_in_q_buffer):  # Note [O in Q's buffer]
            if tidx // cute.arch.WARP_SIZE == 0:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
            cute.arch.barrier(barrier_id=int(Sm90FwdBarrier.EPILOGUE),
                              number_of_threads=self.num_consumer_threads)
            pipe_q.consumer_release(q_state)
        q_state.advance()
        return state, q_state

    @cute.jit
    def mainloop(self, f: ConsumerFrags, state, row_base: Int32, n_lo: Int32, n_blocks: Int32,
                 n_masked: Int32, n_left: Int32, wg: Int32, pipe_q, q_state, pipe_k, pipe_v):
        """Every KV tile n_lo + n_blocks - 1 .. n_lo of a work tile (``n_blocks`` > 0, last
        first): the first always masked, then ``n_masked`` that cross the band's right edge,
        the unmasked middle, and last ``n_left`` that cross its left edge (a window only).
        Q's stage is released after the last QK GEMM. Returns the advanced KV pipeline state."""
        cfg = self.cfg
        q = f.tSrQ[None, None, None, self.q_index(q_state)]  # Q's stage
        n_hi = n_lo + n_blocks
        n_plain = n_blocks - 1 - n_masked - n_left
        if const_expr(cfg.intra_wg_overlap):
            # First tile: S and P only; its PV GEMM runs in the next step.
            pipe_k.consumer_wait(state, pipe_k.consumer_try_wait(state))
            acc_S = self.qk_gemm(f, q, state.index, 0)
            pipe_k.consumer_release(state)
            self.softmax(f, acc_S, row_base, n_hi - 1, True, True, True)
            convert_to(f.tOrP, operand_a_view(acc_S))
            for i in cutlass.range(n_masked, unroll=1):
                state = self.overlapped_step(f, q, state, row_base, n_hi - 2 - i, True, wg,
                                             pipe_k, pipe_v)
            for i in cutlass.range(n_plain, unroll=1):
                state = self.overlapped_step(f, q, state, row_base, n_hi - 2 - n_masked - i,
                                             False, wg, pipe_k, pipe_v)
            if const_expr(cfg.local):
                for i in cutlass.range(n_left, unroll=1):
                    state = self.overlapped_step(f, q, state, row_base, n_lo + n_left - 1 - i,
                                                 True, wg, pipe_k, pipe_v)
            self.release_q_after_gemms(pipe_q, q_state)
            if const_expr(cfg.rescale_o_before_pv):
                self.rescale_acc_o(f)
            pipe_v.consumer_wait(state, pipe_v.consumer_try_wait(state))
            self.pv_gemm(f, state.index, 0)
            pipe_v.consumer_release(state)
            state.advance()
        else:
            state = self.serial_step(f, q, state, row_base, n_hi - 1, True, True, wg,
                                     pipe_k, pipe_v)
            for i in cutlass.range(n_masked, unroll=1):
                state = self.serial_step(f, q, state, row_base, n_hi - 2 - i, False, True,
                                         wg, pipe_k, pipe_v)
            for i in cutlass.range(n_plain, unroll=1):
                state = self.serial_step(f, q, state, row_base, n_hi - 2 - n_masked - i,
                                         False, False, wg, pipe_k, pipe_v)
            if const_expr(cfg.local):
                for i in cutlass.range(n_left, unroll=1):
                    state = self.serial_step(f, q, state, row_base, n_lo + n_left - 1 - i,
                                             False, True, wg, pipe_k, pipe_v)
            self.release_q_after_gemms(pipe_q, q_state)
        return state

    @cute.jit
    def empty_wg_steps(self, state, n_blocks: Int32, wg: Int32, pipe_q, q_state, pipe_k, pipe_v):
        """``mainloop``'s waits, releases and ping-pong turns in its order, without its GEMMs
        and softmax (Note [Empty warpgroups])."""
        if const_expr(self.cfg.intra_wg_overlap):
            pipe_k.consumer_wait(state, pipe_k.consumer_try_wait(state))
            pipe_k.consumer_release(state)
            for _ in cutlass.range(n_blocks - 1, unroll=1):
                state_v = state.clone()
                state.advance()
                pipe_k.consumer_wait(state, pipe_k.consumer_try_wait(state))
                self.pingpong_wait(wg)
                pipe_v.consumer_wait(state_v, pipe_v.consumer_try_wait(state_v))
                self.pingpong_pass(wg)
                pipe_k.consumer_release(state)
                pipe_v.consumer_release(state_v)
            self.release_q_after_gemms(pipe_q, q_state)
            pipe_v.consumer_wait(state, pipe_v.consumer_try_wait(state))
            pipe_v.consumer_release(state)
            state.advance()
        else:
            for _ in cutlass.range(n_blocks, unroll=1):
                for pipe in (pipe_k, pipe_v):
                    pipe.consumer_wait(state, pipe.consumer_try_wait(state))
                    self.pingpong_wait(wg)
                    self.pingpong_pass(wg)
                    pipe.consumer_release(state)
                state.advance()
            self.release_q_after_gemms(pipe_q, q_state)
        return state

    def release_q_after_gemms(self, pipe_q, q_state):
        """Every QK GEMM of the tile has read Q: its stage is free, unless O is staged there
        next (Note [O in Q's buffer]), in which case it is released after the O store."""
        if const_expr(not self.cfg.o_in_q_buffer):
            pipe_q.consumer_release(q_state)

    @cute.jit
    def reset_tile(self, f: ConsumerFrags):
        f.acc_O.fill(0.0)
        f.row_max.fill(-Float32.inf)
        f.row_sum.fill(0.0)

    @cute.jit
    def overlapped_step(self, f: ConsumerFrags, q, state, row_base: Int32, n: Int32,
                        masked: cutlass.Constexpr[bool], wg: Int32, pipe_k, pipe_v):
        """S(n) = Q K[n]^T and O += P(n+1) V[n+1] in flight together, then the softmax of S(n).
        See Note [Intra-warpgroup overlap] and Note [Ping-pong]."""
        state_v = state.clone()
        state.advance()
        pipe_k.consumer_wait(state, pipe_k.consumer_try_wait(state))
        self.pingpong_wait(wg)
        acc_S = self.qk_gemm(f, q, state.index, NO_WAIT)
        if const_expr(self.cfg.rescale_o_before_pv):
            # While S(n) is computed, and before the wait for V: the wait orders what follows
            # it, so only here may ptxas spread the FMULs between the QK GEMM's HGMMAs (faster
            # than rescaling after the wait at hdim 256 on the H200).
            self.rescale_acc_o(f)
        pipe_v.consumer_wait(state_v, pipe_v.consumer_try_wait(state_v))
        self.pv_gemm(f, state_v.index, NO_WAIT)
        self.pingpong_pass(wg)
        warpgroup.wait_group(1)  # S(n) is ready; the PV GEMM may still run
        pipe_k.consumer_release(state)
        self.softmax(f, acc_S, row_base, n, False, masked, False)
        warpgroup.wait_group(0)  # the PV GEMM has read P(n+1) and written O
        pipe_v.consumer_release(state_v)
        convert_to(f.tOrP, operand_a_view(acc_S))
        if const_expr(not self.cfg.rescale_o_before_pv):
            self.rescale_acc_o(f)
        return state

    @cute.jit
    def serial_step(self, f: ConsumerFrags, q, state, row_base: Int32, n: Int32,
                    is_first: cutlass.Constexpr[bool], masked: cutlass.Constexpr[bool], wg: Int32,
                    pipe_k, pipe_v):
        """One KV tile without intra-warpgroup overlap: S, softmax, then PV (each GEMM waited on)."""
        pipe_k.consumer_wait(state, pipe_k.consumer_try_wait(state))
        self.pingpong_wait(wg)
        acc_S = self.qk_gemm(f, q, state.index, NO_WAIT)
        self.pingpong_pass(wg)
        warpgroup.wait_group(0)
        pipe_k.consumer_release(state)
        self.softmax(f, acc_S, row_base, n, is_first, masked, is_first)
        convert_to(f.tOrP, operand_a_view(acc_S))
        self.rescale_acc_o(f)
        pipe_v.consumer_wait(state, pipe_v.consumer_try_wait(state))
        self.pingpong_wait(wg)
        self.pv_gemm(f, state.index, NO_WAIT)
        self.pingpong_pass(wg)
        warpgroup.wait_group(0)
        pipe_v.consumer_release(state)
        state.advance()
        return state

    @cute.jit
    def epilogue(self, acc_O, lse, mO, mLSE, sO, tma_o, tiled_mma_pv, tidx: Int32, m_block: Int32,
                 head: Int32, batch: Int32, seqlen_q: Int32, seq=None):
        """O (registers) -> SMEM (stmatrix) -> GMEM (TMA store); LSE -> GMEM.

        One store of the whole tile after a barrier of every consumer thread, or with
        ``wg_epilogue`` one per warpgroup of its own rows after a barrier of its own threads
        (Note [Warpgroup epilogues]). Rows past seqlen_q are clipped by the TMA unit and
        skipped for LSE. ``seq``: the tile's sequence under ``varlen`` (``tile_coords``), whose
        rows are stored through O's ragged view (Note [Varlen] in fwd_kernel.py).
        """
        cfg = self.cfg
        rO = cute.make_rmem_tensor_like(acc_O, self.dtype)
        convert_to(rO, acc_O)
        wg = tidx // WARPGROUP_THREADS
        barrier_id, threads = int(Sm90FwdBarrier.EPILOGUE), self.num_consumer_threads
        if const_expr(cfg.wg_epilogue):
            barrier_id, threads = int(Sm90FwdBarrier.EPILOGUE_WG0) + wg, WARPGROUP_THREADS
        if self.stores_o(tidx):
            cute.arch.cp_async_bulk_wait_group(0, read=True)  # the previous tile's store read sO
        # The previous store has read sO, and (without wg_epilogue, where sO may alias Q) every
        # warpgroup's QK GEMMs have read Q, before anyone writes O there.
        cute.arch.barrier(barrier_id=barrier_id, number_of_threads=threads)
        if const_expr(cfg.wg_epilogue):
            stmatrix_to_smem(self._pv_mma(1), self.dtype, tidx % WARPGROUP_THREADS, rO,
                             sO[None, None, wg])
        else:
            stmatrix_to_smem(tiled_mma_pv, self.dtype, tidx, rO, sO)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=barrier_id, number_of_threads=threads)

        if const_expr(cfg.write_lse):
            cO = cute.make_identity_tensor((cfg.m_block, cfg.head_dim_v))
            coord_rc = rows_cols_view(tiled_mma_pv.get_slice(tidx).partition_C(cO))
            if coord_rc[0, 0][1] == 0:  # the quad's first thread writes its rows
                for r in cutlass.range_constexpr(cute.size(lse)):
                    row = m_block * cfg.m_block + coord_rc[r, 0][0]
                    if row < seqlen_q:
                        if const_expr(seq is not None):
                            mLSE[seq[0] + row, head, 0] = lse[r]
                        else:
                            mLSE[row, head, batch] = lse[r]

        if self.stores_o(tidx):
            if const_expr(seq is not None):  # ragged rows end at the sequence's last row
                mO_bh = ragged_tile_rows(mO[None, None, head, None], seqlen_q, seq[0])
            else:
                mO_bh = mO[None, None, head, batch]
            if const_expr(cfg.wg_epilogue):
                block = m_block * cfg.num_consumer_wg + wg  # in units of 64 rows
                if block * WGMMA_M < seqlen_q:  # an empty warpgroup stores nothing
                    self.store_o(tma_o, sO[None, None, wg],
                                 cute.local_tile(mO_bh, (WGMMA_M, cfg.head_dim_v), (block, 0)))
            else:
                self.store_o(tma_o, sO,
                             cute.local_tile(mO_bh, (cfg.m_block, cfg.head_dim_v), (m_block, 0)))

    @staticmethod
    def store_o(tma_o, sO, gO):
        """One TMA store of the SMEM tile sO to gO, as its own bulk group."""
        tOsO, tOgO = cpasync.tma_partition(tma_o, 0, cute.make_layout(1),
                                           cute.group_modes(sO, 0, 2), cute.group_modes(gO, 0, 2))
        cute.copy(tma_o, tOsO, tOgO)
        cute.arch.cp_async_bulk_commit_group()
