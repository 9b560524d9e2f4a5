"""The SM90 attention backward main kernel (`sm90_bwd`): warp-specialized, WGMMA.

One CTA owns one tile (key block ``n_block``, query head, batch), or with persistent CTAs
one tile at a time of its walk (Note [persistent CTAs] in bwd_tiles.py, which also
says which tiles a CTA takes and in what order): it keeps K and V of its
``tile_n`` key rows (128; 64 above hdim 128) in SMEM and accumulates dK and dV in registers
while it walks the query blocks that can see those keys. Per query block (``tile_m`` = 64
rows, or 80 / 128 with ``sdp_swap_ab``) it recomputes S and dP and produces P and dS.

``Sm90FlashBackward.kernel`` only sets up shared storage, the pipelines and the registers,
bundles what the roles share into the frozen contexts of bwd_context.py (``BwdProblem``,
``BwdGmem``, ``BwdSmem``, ``BwdPipes``, ...) and dispatches each warp to its role module:

| warpgroup | warps | role | does |
|---|---|---|---|
| 0 | 0 | load (``bwd_load.load``) | TMA: K and V once; Q and dO per query block (``q``/``do`` pipelines), each stage with its block's LSE2 / Delta (Note [stats with their stage]) |
| 0 | 1 | dq-store (``bwd_store.dq_store``) | "bulk" dQ: per query block one cp.reduce.async.bulk.add.f32 per MMA warpgroup's half of the SMEM dQ tile (Note [dQ SMEM handoff]) |
| 0 | 2-3 | idle | register donors (setmaxnreg down to ``regs_producer``) |
| 1, 2 | 4-11 | mma (``bwd_mma.mma``) | S = Q K^T, dP = dO V^T, P, dS (bwd_scores.py), dV += P^T dO, dK += dS^T Q, dQ = dS K; dK / dV out (bwd_store.py) |

Every role walks the CTA's tiles through ``bwd_tiles.walk``. The two MMA warpgroups split
every GEMM in half: S and dP by key columns (warpgroup w owns keys 64w .. 64w+63), dV and dK
by key rows (the same keys, so P and the dK operand dS^T never cross warpgroups), dQ by
head-dim columns (this one reads all of dS; with tile_m 128 by query rows, Note [tile_m 128];
with tile_m 80 it is computed transposed, Note [dQ transposed]). Head dims above 128 split dV
and dK by columns instead (Note [dK/dV by columns]). Those Notes, and the others on the MMA
loop's order, are in bwd_mma.py; the load warp's (Note [stats with their stage], Note [Q/dO
multicast]) in bwd_load.py; the dQ paths' and the dK / dV epilogue's in bwd_store.py.

Note [Varlen backward] (``varlen``; ``sm90_bwd_varlen``): packed sequences (Note [Varlen] in
fwd_kernel.py), one CTA per key block that exists: the grid is heads x ``packed_blocks`` of the
keys (an upper bound of sum ceil(len_s / tile_n)), and each CTA decodes its tile from its block
index (``fa_sm100.packed_tiles.packed_tile``: sequence by sequence, head by head, key block
fastest, the padded grid's order without the blocks past a sequence's keys); the few CTAs past
the last tile exit at once. Each CTA reads its sequence's first rows and lengths from
cu_seqlens (``fa_sm100.varlen.sequence_rows``) and sees the packed tensors from that row at
batch index ``seq``, so every role indexes them as a padded batch; the float32 workspace holds
each sequence's rows in whole query (key) blocks of its own (Note [Packed workspace] in
fa_sm100/varlen.py), seen the same way. Query rows past the end carry LSE2 = +inf (P = 0), keys
past it are masked by the sequence's own seqlen_k, MHA dK/dV are stored row by row below it;
keys past ``seqused_k`` are zeroed by the host first. The switches that read other tiles'
lengths are off (``VARLEN_FIXED``). docs/varlen.md, "The backward".
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_helpers
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.utils import LayoutEnum

from fa_sm100.bands import traced_bounds
from fa_sm100.config import WARP_SIZE, cutlass_dtype
from fa_sm100.hopper import bwd_load, bwd_mma
from fa_sm100.hopper.bwd_config import TILE_SLOTS, BwdConfig
from fa_sm100.hopper.bwd_context import (BwdDkvOut, BwdGmem, BwdLoadAtoms, BwdMmas, BwdPipes,
                                         BwdProblem, BwdSmem)
from fa_sm100.hopper.bwd_store import dq_store, dq_tiled_mma, tile_counter
from fa_sm100.hopper.bwd_tiles import (TileWalk, cta_tile, grid, init_tile_handoff,
                                       longest_first_tail_pairs)
from fa_sm100.hopper.config import SMEM_ALIGN, WARPGROUP_THREADS, WGMMA_M
from fa_sm100.packed_tiles import packed_tile
from fa_sm100.softmax_math import LOG2_E
from fa_sm100.varlen import (first_block, packed_blocks, ragged_rows, ragged_tile_rows,
                              sequence_rows, sequence_views)

# Warpgroup 0 (warps 0-3) is the producer warpgroup; warpgroups 1 and 2 run the MMAs.
PRODUCER_WARPS = WARPGROUP_THREADS // WARP_SIZE
LOAD_WARP = 0
DQ_STORE_WARP = 1  # "bulk" dQ only


class Sm90FlashBackward:
    """Builds and launches the main backward kernel for one ``BwdConfig``."""

    def __init__(self, cfg: BwdConfig):
        self.cfg = cfg.validate()
        self.dtype = cutlass_dtype(cfg.dtype)
        self.tile_m, self.tile_n = cfg.tile_m, cfg.tile_n
        self.hdim, self.hdimv = cfg.head_dim, cfg.head_dim_v
        self.num_threads = cfg.threads_per_cta

    # ---- layouts and MMAs (trace time) ---------------------------------------------------

    def _smem_layout(self, rows: int, cols: int, stage, major_size: int):
        kind = sm90_helpers.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, self.dtype, major_size)
        atom = warpgroup.make_smem_layout_atom(kind, self.dtype)
        if stage is None:
            return cute.tile_to_shape(atom, (rows, cols), order=(0, 1))
        return cute.tile_to_shape(atom, (rows, cols, stage), order=(0, 1, 2))

    def _setup_layouts(self):
        c = self.cfg
        # Q and dO serve as K-major A (S, dP) and as MN-major B (dK, dV) over the whole head
        # dim, or over head-dim halves (Note [dK/dV by columns]: each half whole swizzle atoms).
        # Transposed (Note [dK/dV transposed]), they are MN-major A over the whole head dim.
        split = 2 if c.dkv_split_cols else 1
        self.sQ_layout = self._smem_layout(self.tile_m, self.hdim, c.q_stage, self.hdim // split)
        self.sdO_layout = self._smem_layout(self.tile_m, self.hdimv, c.do_stage,
                                            self.hdimv // split)
        # K is also the MN-major B of dQ, split by head-dim columns over the two warpgroups
        # (tile_m 64), or read whole by both (tile_m 128, dQ split by query rows); with tile_m
        # 80 K^T is dQ^T's MN-major A, split by head-dim halves (Note [dQ transposed]).
        k_major = self.hdim if c.dq_split_rows else self.hdim // 2
        self.sK_layout = self._smem_layout(self.tile_n, self.hdim, None, k_major)
        self.sV_layout = self._smem_layout(self.tile_n, self.hdimv, None, self.hdimv)
        # P and dS: ``ps_atom_cols`` key columns form one swizzle atom row (64, one
        # warpgroup's keys or with tile_n 64 both; 16 with 48 keys per warpgroup). With
        # sdp_swap_ab P stays in registers and has no buffer.
        self.sP_layout = None
        if c.p_stage:
            self.sP_layout = self._smem_layout(self.tile_m, self.tile_n, c.p_stage, c.ps_atom_cols)
        self.sdS_layout = self._smem_layout(self.tile_m, self.tile_n, c.ds_stage, c.ps_atom_cols)

    def _tiled_mmas(self):
        """The tiled WGMMAs of S and dP, dK, dV and dQ."""
        K, MN = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        mma_dq = dq_tiled_mma(self.cfg, self.dtype)
        if self.cfg.sdp_swap_ab:
            # S^T = K Q^T and dP^T = V dO^T: (tile_n, tile_m), warpgroups stacked along M (keys).
            mma_sdp = sm90_helpers.make_trivial_tiled_mma(
                self.dtype, self.dtype, K, K, Float32, (2, 1, 1), (WGMMA_M, self.tile_m))
            # dV = P^T dO and dK = dS^T Q with P^T, dS^T from registers (an RS A is K-major).
            mma_dk, mma_dv = (sm90_helpers.make_trivial_tiled_mma(
                self.dtype, self.dtype, K, MN, Float32, (2, 1, 1), (WGMMA_M, cols),
                a_source=warpgroup.OperandSource.RMEM) for cols in (self.hdim, self.hdimv))
            return mma_sdp, mma_dk, mma_dv, mma_dq
        # S = Q K^T and dP = dO V^T: (tile_m, tile_n), warpgroups side by side along N.
        mma_sdp = sm90_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, K, K, Float32, (1, 2, 1), (WGMMA_M, self.tile_n // 2))
        # dK = dS^T Q and dV = P^T dO: (tile_n, hdim), warpgroups stacked along M (keys), or
        # side by side along N (Note [dK/dV by columns]); transposed, dK^T = Q^T dS and
        # dV^T = dO^T P: (hdim, tile_n), warpgroups side by side along N (keys), the head dim
        # in 64-row M atoms (Note [dK/dV transposed]).
        if self.cfg.dkv_swap_ab:
            mma_dk, mma_dv = (sm90_helpers.make_trivial_tiled_mma(
                self.dtype, self.dtype, MN, MN, Float32, (1, 2, 1), (WGMMA_M, self.tile_n // 2))
                for _ in range(2))
            return mma_sdp, mma_dk, mma_dv, mma_dq
        if self.cfg.dkv_split_cols:
            atoms, split = (1, 2, 1), 2
        else:
            atoms, split = (2, 1, 1), 1
        mma_dk, mma_dv = (sm90_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, MN, MN, Float32, atoms, (WGMMA_M, cols // split))
            for cols in (self.hdim, self.hdimv))
        return mma_sdp, mma_dk, mma_dv, mma_dq

    def _shared_storage(self):
        c = self.cfg
        buf = lambda layout: cute.struct.Align[
            cute.struct.MemRange[self.dtype, cute.cosize(layout)], SMEM_ALIGN]

        @cute.struct
        class SharedStorage:
            # K/V full; with persistent CTAs also K/V empty (Note [persistent CTAs], bwd_tiles.py)
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 1 + int(c.persistent_ctas > 0)]
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2 * c.q_stage]
            mbar_do: cute.struct.MemRange[cutlass.Int64, 2 * c.do_stage]
            if c.dynamic_tiles:  # Note [dynamic tiles] (bwd_tiles.py): full, then empty
                mbar_tile: cute.struct.MemRange[cutlass.Int64, 2 * TILE_SLOTS]
                tile_slots: cute.struct.MemRange[Int32, TILE_SLOTS]
            sQ: buf(self.sQ_layout)
            sdO: buf(self.sdO_layout)
            sK: buf(self.sK_layout)
            sV: buf(self.sV_layout)
            if c.p_stage:
                sP: buf(self.sP_layout)
            sdS: buf(self.sdS_layout)
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, self._sdq_elems()], SMEM_ALIGN]
            if c.stats_smem:  # bulk-copy destinations: 16-byte alignment is the rule
                sLSE2: cute.struct.Align[cute.struct.MemRange[Float32, self.tile_m * c.q_stage], 128]
                sDelta: cute.struct.Align[cute.struct.MemRange[Float32, self.tile_m * c.do_stage], 128]

        return SharedStorage

    def _sdq_elems(self) -> int:
        """Float32 elements of the SMEM dQ tile: the whole tile for "bulk" (Note [dQ in
        fragment order]); "red" stages nothing and keeps a 16-byte placeholder (the struct
        field needs a size)."""
        if self.cfg.dq_accum == "bulk":
            return self.cfg.dq_block_elems
        return 4

    # ---- host entry ------------------------------------------------------------------------

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (batch, seqlen_q, heads, hdim)
        mK: cute.Tensor,  # (batch, seqlen_k, heads_kv, hdim)
        mV: cute.Tensor,  # (batch, seqlen_k, heads_kv, hdimv)
        mdO: cute.Tensor,  # (batch, seqlen_q, heads, hdimv)
        mLSE2: cute.Tensor,  # (batch, heads, seqlen_q_pad) f32, log2 units, +inf on padding
        mDelta: cute.Tensor,  # (batch, heads, seqlen_q_pad) f32, rowsum(O * dO)
        mdQacc: cute.Tensor,  # (batch, heads, m_blocks, tile_m * hdim) f32, fragment order
        mdK: cute.Tensor,  # MHA: (batch, seqlen_k, heads, hdim) dtype; GQA: f32 (batch, h, seqlen_k_pad, hdim)
        mdV: cute.Tensor,
        mdQsem: cute.Tensor,  # (batch, heads, BwdConfig.dq_sem_slots) i32, zeroed
        softmax_scale: Float32,
        softcap: Float32,  # the cap, read only with cfg.softcap
        window_left: Int32,  # the band's run-time bounds (fa_sm100.bands.kernel_window), read
        window_right: Int32,  # only with a window (cfg.is_local)
        mCuSeqlensQ,  # varlen (Note [Varlen backward]): (sequences + 1,) int32 offsets, else None
        mCuSeqlensK,
        mSeqUsedK,  # varlen: (sequences,) int32 used key lengths, or None
        stream,
    ):
        self._setup_layouts()
        mma_sdp, mma_dk, mma_dv, mma_dq = self._tiled_mmas()
        SharedStorage = self._shared_storage()
        # (b, s, h, d) -> (s, d, h, b) so the TMA tile is (rows, head dim)
        to_sdhb = lambda t: cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0]))
        mQ_t, mK_t, mV_t, mdO_t = [to_sdhb(t) for t in (mQ, mK, mV, mdO)]
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        # Note [Q/dO multicast] (bwd_load.py): each CTA of the cluster loads 1/qdo_cluster of
        # a Q / dO tile
        qdo_ctas = self.cfg.cluster[0]
        qdo_op = cpasync.CopyBulkTensorTileG2SMulticastOp() if self.cfg.qdo_multicast else g2s
        tma_Q, tma_mQ = cpasync.make_tiled_tma_atom(
            qdo_op, mQ_t, cute.select(self.sQ_layout, mode=[0, 1]), (self.tile_m, self.hdim),
            qdo_ctas)
        tma_dO, tma_mdO = cpasync.make_tiled_tma_atom(
            qdo_op, mdO_t, cute.select(self.sdO_layout, mode=[0, 1]), (self.tile_m, self.hdimv),
            qdo_ctas)
        tma_K, tma_mK = cpasync.make_tiled_tma_atom(
            g2s, mK_t, self.sK_layout, (self.tile_n, self.hdim))
        tma_V, tma_mV = cpasync.make_tiled_tma_atom(
            g2s, mV_t, self.sV_layout, (self.tile_n, self.hdimv))
        # MHA dK/dV leave through SMEM (K's and V's buffers) by TMA (Note [dK/dV by TMA])
        tma_dK = tma_mdK = tma_dV = tma_mdV = None
        if const_expr(self.cfg.stores_dkv_by_tma):
            s2g = cpasync.CopyBulkTensorTileS2GOp()
            mdK_store, mdV_store = to_sdhb(mdK), to_sdhb(mdV)
            if const_expr(self.cfg.varlen):  # Note [Varlen backward]: rows past a
                # sequence's keys are clipped (ragged views, Note [Varlen] in fwd_kernel.py)
                mdK_store, mdV_store = (ragged_rows(t[None, None, None, 0])
                                        for t in (mdK_store, mdV_store))
            tma_dK, tma_mdK = cpasync.make_tiled_tma_atom(
                s2g, mdK_store, self.sK_layout, (self.tile_n, self.hdim))
            tma_dV, tma_mdV = cpasync.make_tiled_tma_atom(
                s2g, mdV_store, self.sV_layout, (self.tile_n, self.hdimv))
        num_n_blocks = cute.ceil_div(mK.shape[1], self.tile_n)
        num_batch = mQ.shape[0]
        varlen = None
        launch_grid = None
        if const_expr(self.cfg.varlen):  # Note [Varlen backward]: one CTA per key block
            # that exists, plus at most one per (sequence, head) that finds none
            num_batch = mCuSeqlensK.shape[0] - 1
            varlen = (mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mQ.shape[2])
            launch_grid = [packed_blocks(mK.shape[1], num_batch, self.tile_n) * mQ.shape[2],
                           1, 1]
        num_pairs = num_batch * mQ.shape[2]
        tail_pairs = longest_first_tail_pairs(self.cfg, num_n_blocks, num_pairs, cutlass.min,
                                              cutlass.max)  # Note [longest first], bwd_tiles.py
        if const_expr(launch_grid is None):
            launch_grid = grid(self.cfg, num_n_blocks, mQ.shape[2], num_batch)
        window = None  # only a windowed kernel takes the bounds as parameters
        if const_expr(self.cfg.is_local):
            window = (window_left, window_right)
        # Note [softcap in the backward]: P from t = tanh(raw S * softcap_k) with c log2(e)
        scale_log2 = softmax_scale * LOG2_E
        softcap_k = None
        if const_expr(self.cfg.softcap):
            softcap_k = softmax_scale / softcap
            scale_log2 = softcap * LOG2_E
        self.kernel(
            tma_mQ, tma_mK, tma_mV, tma_mdO, tma_Q, tma_K, tma_V, tma_dO,
            mLSE2, mDelta, mdQacc, mdK, mdV, mdQsem, tma_dK, tma_mdK, tma_dV, tma_mdV,
            mQ.shape[1], mK.shape[1], mQ.shape[2] // mK.shape[2], tail_pairs, window, varlen,
            softmax_scale, scale_log2, softcap_k,
            mma_sdp, mma_dk, mma_dv, mma_dq,
            self.sQ_layout, self.sdO_layout, self.sK_layout, self.sV_layout,
            self.sP_layout, self.sdS_layout, SharedStorage,
        ).launch(
            grid=launch_grid,
            block=[self.num_threads, 1, 1],
            stream=stream,
            min_blocks_per_mp=1,  # register count at entry known: ptxas keeps setmaxnreg
            use_pdl=self.cfg.pdl,  # Note [chained launches] in bwd_interface.py
            **({"cluster": list(self.cfg.cluster)} if self.cfg.qdo_multicast else {}),
        )

    # ---- kernel: shared storage, registers, role dispatch ------------------------------------

    @cute.kernel
    def kernel(
        self, mQ, mK, mV, mdO, tma_Q, tma_K, tma_V, tma_dO,
        mLSE2, mDelta, mdQacc, mdK, mdV, mdQsem, tma_dK, tma_mdK, tma_dV, tma_mdV,
        seqlen_q: Int32, seqlen_k: Int32, group: Int32, tail_pairs: Int32, window, varlen,
        softmax_scale: Float32, scale_log2: Float32, softcap_k,
        mma_sdp: cute.TiledMma, mma_dk: cute.TiledMma, mma_dv: cute.TiledMma,
        mma_dq: cute.TiledMma,
        sQ_layout: cute.ComposedLayout, sdO_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
        sP_layout: cute.ComposedLayout, sdS_layout: cute.ComposedLayout,
        SharedStorage: cutlass.Constexpr,
    ):
        cfg = self.cfg
        coords, valid = None, True
        if const_expr(varlen is not None):  # Note [Varlen backward]: this CTA's tile, if any
            cu_k, used_k, heads = varlen[1], varlen[2], varlen[3]
            seq, head, n_block, n_blocks, found = packed_tile(
                cu_k, used_k, cu_k.shape[0] - 1, heads, cfg.tile_n, cute.arch.block_idx()[0])
            coords, valid = (n_block, head, seq, n_blocks), found != 0
        if valid:
            self._run(mQ, mK, mV, mdO, tma_Q, tma_K, tma_V, tma_dO, mLSE2, mDelta, mdQacc, mdK,
                      mdV, mdQsem, tma_dK, tma_mdK, tma_dV, tma_mdV, seqlen_q, seqlen_k, group,
                      tail_pairs, window, varlen, coords, softmax_scale, scale_log2, softcap_k,
                      mma_sdp, mma_dk, mma_dv, mma_dq, sQ_layout, sdO_layout, sK_layout,
                      sV_layout, sP_layout, sdS_layout, SharedStorage)

    @cute.jit
    def _run(self, mQ, mK, mV, mdO, tma_Q, tma_K, tma_V, tma_dO, mLSE2, mDelta, mdQacc, mdK,
             mdV, mdQsem, tma_dK, tma_mdK, tma_dV, tma_mdV, seqlen_q: Int32, seqlen_k: Int32,
             group: Int32, tail_pairs: Int32, window, varlen, coords, softmax_scale: Float32,
             scale_log2: Float32, softcap_k, mma_sdp: cute.TiledMma, mma_dk: cute.TiledMma,
             mma_dv: cute.TiledMma, mma_dq: cute.TiledMma, sQ_layout: cute.ComposedLayout,
             sdO_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
             sV_layout: cute.ComposedLayout, sP_layout: cute.ComposedLayout,
             sdS_layout: cute.ComposedLayout, SharedStorage: cutlass.Constexpr):
        """The CTA: shared storage, registers per role, the roles on its tile (``coords``:
        (key block, head, sequence, its key blocks) under varlen, else from the grid)."""
        cfg = self.cfg
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if const_expr(cfg.early_dq_post):
            # Note [dQ postprocess in the tail] (bwd_prepost.py): once every CTA has started,
            # the dQ postprocess may take the SMs the last wave leaves idle
            cute.arch.griddepcontrol_launch_dependents()
        if warp_idx == LOAD_WARP:
            for atom in (tma_Q, tma_K, tma_V, tma_dO):
                cpasync.prefetch_descriptor(atom)
        storage = cutlass.utils.SmemAllocator().allocate(SharedStorage)
        mbar_kv = storage.mbar_kv.data_ptr()
        if warp_idx == LOAD_WARP:
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(mbar_kv, 1)
                if const_expr(cfg.persistent_ctas):  # K/V empty: one MMA thread arrives
                    cute.arch.mbarrier_init(mbar_kv + 1, 1)
                if const_expr(cfg.dynamic_tiles):  # Note [dynamic tiles] (bwd_tiles.py)
                    init_tile_handoff(cfg, storage.mbar_tile.data_ptr())
        pipe_q, pipe_do = self._qdo_pipelines(storage)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sdO.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sP = None
        if const_expr(cfg.p_stage):
            sP = storage.sP.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)
        sdS = storage.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)
        sdQ = storage.sdQ.get_tensor(cute.make_layout(self._sdq_elems()))
        sLSE2 = sDelta = None
        if const_expr(cfg.stats_smem):
            sLSE2 = storage.sLSE2.get_tensor(cute.make_layout((self.tile_m, cfg.q_stage)))
            sDelta = storage.sDelta.get_tensor(cute.make_layout((self.tile_m, cfg.do_stage)))
        smem = BwdSmem(sQ=sQ, sdO=sdO, sK=sK, sV=sV, sP=sP, sdS=sdS, sdQ=sdQ, sLSE2=sLSE2,
                       sDelta=sDelta)

        if const_expr(varlen is not None):  # Note [Varlen backward]: this CTA's sequence
            seq = coords[2]  # (one CTA per tile: never persistent)
            # the TMA views are (s, d, h, b), the MHA dK / dV (b, s, h, d)
            mQ, mdO, seqlen_q = sequence_rows(varlen[0], None, seq, (mQ, 0, 3), (mdO, 0, 3))
            mK, mV, seqlen_k = sequence_rows(varlen[1], varlen[2], seq, (mK, 0, 3), (mV, 0, 3))
            # the workspace's rows of the sequence (Note [Packed workspace] in varlen.py)
            first_q = first_block(varlen[0], seq, cfg.tile_m)
            mLSE2, mDelta = sequence_views(seq, first_q * cfg.tile_m, (mLSE2, 2, 0),
                                           (mDelta, 2, 0))
            mdQacc = sequence_views(seq, first_q, (mdQacc, 2, 0))[0]
            if const_expr(cfg.uses_gqa_buffers):
                first_k = first_block(varlen[1], seq, cfg.tile_n) * cfg.tile_n
                mdK, mdV = sequence_views(seq, first_k, (mdK, 2, 0), (mdV, 2, 0))
            else:
                mdK, mdV, _ = sequence_rows(varlen[1], None, seq, (mdK, 1, 0), (mdV, 1, 0))
                if const_expr(cfg.stores_dkv_by_tma):  # the sequence's rows of the ragged views
                    tma_mdK, tma_mdV = (ragged_tile_rows(t, seqlen_k, varlen[1][seq])
                                        for t in (tma_mdK, tma_mdV))
        prob = BwdProblem(seqlen_q=seqlen_q, seqlen_k=seqlen_k, group=group,
                          band=traced_bounds(cfg, window), softmax_scale=softmax_scale,
                          scale_log2=scale_log2, softcap_k=softcap_k)
        gmem = BwdGmem(mQ=mQ, mK=mK, mV=mV, mdO=mdO, mLSE2=mLSE2, mDelta=mDelta, mdQacc=mdQacc,
                       mdK=mdK, mdV=mdV, mdQsem=mdQsem)
        pipes = BwdPipes(q=pipe_q, do=pipe_do, kv=mbar_kv)
        if const_expr(cfg.persistent_ctas):  # Note [persistent CTAs], bwd_tiles.py
            work = TileWalk(cute.arch.block_idx()[0], cute.arch.grid_dim()[0],
                            mQ.shape[3] * mQ.shape[2], mQ.shape[2],
                            cfg.num_key_blocks(seqlen_k), prob)
            if const_expr(cfg.dynamic_tiles):  # Note [dynamic tiles], bwd_tiles.py
                work.fetch_from(tail_pairs, tile_counter(cfg, mdQsem),
                                storage.tile_slots.get_tensor(cute.make_layout(TILE_SLOTS)),
                                storage.mbar_tile.data_ptr())
        else:
            work = cta_tile(cfg, prob, cfg.cluster[0], tail_pairs, coords)
        if warp_idx < PRODUCER_WARPS:
            cute.arch.setmaxregister_decrease(cfg.regs_producer)
            if warp_idx == LOAD_WARP:
                bwd_load.load(cfg, prob, gmem, smem, pipes,
                              BwdLoadAtoms(q=tma_Q, k=tma_K, v=tma_V, do=tma_dO), work)
            if const_expr(cfg.dq_accum == "bulk"):
                if warp_idx == DQ_STORE_WARP:
                    dq_store(cfg, prob, gmem, smem, work)
        else:
            cute.arch.setmaxregister_increase(cfg.regs_mma)
            # Note [chained launches]: the preprocess is done. With pre_ctas the warpgroups
            # read nothing it writes (LSE2 / Delta come with the load warp's stages)
            if const_expr(cfg.pdl and not cfg.pre_ctas):
                cute.arch.griddepcontrol_wait()
            bwd_mma.mma(cfg, prob, gmem, smem, pipes,
                        BwdMmas(sdp=mma_sdp, dk=mma_dk, dv=mma_dv, dq=mma_dq,
                                tidx=tidx - WARPGROUP_THREADS),
                        BwdDkvOut(tma_dk=tma_dK, tma_mdk=tma_mdK, tma_dv=tma_dV, tma_mdv=tma_mdV,
                                  staging=self._epilogue_staging(storage, sK, sV, sK_layout,
                                                                 sV_layout)),
                        work)

    def _qdo_pipelines(self, storage):
        """The ``q`` and ``do`` pipelines (``BwdPipes``): TMA-complete stages, each with its
        block's LSE2 / Delta with ``stats_smem``; released once per MMA warp, in each CTA of the
        cluster under ``qdo_multicast`` (Note [Q/dO multicast] in bwd_load.py). The second
        one's creation fences the mbarrier inits and syncs the CTA (the cluster)."""
        cfg = self.cfg
        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread)
        # consumer_release arrives once per warp (lane 0): 8 MMA warps, in each CTA of the
        # cluster under qdo_multicast (Note [Q/dO multicast]).
        qdo_ctas = cfg.cluster[0]
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                              qdo_ctas * cfg.num_mma_threads // WARP_SIZE)
        cluster = cute.make_layout((1, qdo_ctas, 1, 1))  # (V, M, N, K)
        # with stats_smem each Q (dO) stage also carries the block's LSE2 (Delta)
        stat_bytes = self.tile_m * 4 if const_expr(cfg.stats_smem) else 0
        bytes_q, bytes_do, _ = bwd_load.load_bytes(cfg)
        pipe_q = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_q.data_ptr(), num_stages=cfg.q_stage,
            producer_group=producer, consumer_group=consumers, tx_count=bytes_q + stat_bytes,
            cta_layout_vmnk=cluster, mcast_mode_mn=(0, 1), defer_sync=True)
        pipe_do = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_do.data_ptr(), num_stages=cfg.do_stage,
            producer_group=producer, consumer_group=consumers, tx_count=bytes_do + stat_bytes,
            cta_layout_vmnk=cluster, mcast_mode_mn=(0, 1),
            defer_sync=False)  # fences the mbarrier inits and syncs the CTA (the cluster)
        return pipe_q, pipe_do

    def _epilogue_staging(self, storage, sK, sV, sK_layout, sV_layout):
        """Where the dK / dV epilogue stages its tiles for the TMA stores (Note [dK/dV by
        TMA] in bwd_store.py): K's and V's buffers; with persistent CTAs the dS buffers and
        the SMEM dQ tile, so that the next tile's K and V can load meanwhile (Note
        [persistent CTAs] in bwd_tiles.py). GQA ``bulk``: where the float32 dK and dV tiles
        start, over the Q and dO stages and over K and V (Note [dK/dV by bulk reduces])."""
        if const_expr(self.cfg.adds_dkv_by_bulk):
            return tuple(cute.recast_ptr(buf.data_ptr(), dtype=Float32)
                         for buf in (storage.sQ, storage.sK))
        if const_expr(not self.cfg.persistent_ctas):
            return sK, sV
        return (storage.sdS.get_tensor(sK_layout.outer, swizzle=sK_layout.inner),
                storage.sdQ.get_tensor(sV_layout.outer, swizzle=sV_layout.inner,
                                       dtype=self.dtype))
