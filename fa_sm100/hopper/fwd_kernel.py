"""The warp-specialized SM90 forward kernel: host launch, shared storage and the producer role.

CTA = 1 + ``num_consumer_wg`` warpgroups. A work tile is one ``m_block`` x ``head_dim_v``
output tile of one (batch, head); the flat grid has one CTA per work tile, or, with
``persistent``, one CTA per SM that loops over every gridDim.x-th tile.

| warpgroup | role | does |
|---|---|---|
| 0 (warp 0) | producer | TMA loads of Q once per tile and K/V tiles into a ``kv_stage`` ring; keeps 24-32 registers |
| 1.. | consumers | 64 query rows each: S = Q K^T (SS WGMMA), mask, online softmax, O += P V (RS WGMMA), epilogue |

Pipelines (``cutlass.pipeline.PipelineTmaAsync``: the TMA's transaction count completes the full
barrier, one lane per consumer warp releases a stage): ``q`` (``q_stage`` stages, Note [Two Q
stages]), ``k`` and ``v``
(``kv_stage`` stages, advanced together; their states carry across work tiles). The producer
issues, per work tile,
Q, K[n-1], then (K[j-1], V[j]) for j = n-1 .. 1 and finally V[0] (intra-warpgroup overlap
order: the consumers need K[j-1] before V[j]); K[n-1] before Q with ``k_before_q`` or
``o_in_q_buffer`` (Note [O in Q's buffer] in fwd_consumer.py).

Note [Two Q stages] (``q_stage=2``): with one stage, the producer loads a work tile's Q only
once every consumer warpgroup has issued the previous tile's last QK GEMM, and the tile's first
K tile waits behind that Q (it goes first only with ``k_before_q``), so both land about one KV
step before the end of the previous tile: at short tiles (causal 1k: 4.5 KV tiles each on
average at hdim 64) the consumers wait for them. With two stages the producer issues the next
tile's Q right after the previous tile's last V load and its first K as soon as the K/V ring has
room for it (the ring runs up to ``kv_stage`` steps ahead of the consumers), and the consumers'
QK GEMMs read Q's stage ``q_state.index`` (its WGMMA descriptor is taken once per tile, outside
the KV loop). Persistent CTAs with O's own buffer only (one tile per CTA has no next Q; O staged
in Q's buffer would overwrite it). Costs one more Q tile of SMEM: 225 KiB at hdim 128, no room
at (192, 128) or hdim 256.

Note [Persistent multicast]: ``kv_multicast`` with ``persistent`` (static schedule, clusters
of 2): the grid is the SM count rounded down to whole clusters, so with an even tile count
(whole clusters of m blocks per head) CTA 2c + r takes tiles 2c + r + i * gridDim.x, i = 0, 1,
...: at every step the two CTAs of a cluster hold m blocks 2j and 2j + 1 of one (batch, head),
visit the same K/V tiles in the same order and run the same number of steps, so the K/V ring's
multicast protocol (Note [K/V multicast]) simply continues from one tile to the next, and each
producer waits for the peer's last releases once, after its last tile. A dynamic schedule would
have to hand both CTAs the same pair; it is refused. Each CTA stages and stores its own O and
loads its own Q, as any persistent CTA.

Note [Dynamic tile schedule]: a persistent CTA starts with work tile blockIdx.x. With
``dynamic_schedule`` it then takes the next tile from a global counter instead of every
gridDim.x-th one, so CTAs whose tiles were short (causal tiles near the diagonal) take more of
them. The producer warp fetches (one ``atom.add``; tile = gridDim.x + the old value) right after
issuing the current tile's loads, and hands the index to the consumers through a 2-slot ``tile``
pipeline in SMEM (its full barrier: one producer arrival; its empty barrier: every consumer
thread, once it has read the slot). A CTA stops at the first index >= the tile count, so a
launch makes exactly ``total_tiles`` fetches (gridDim.x failing ones among them) and the fetch
that returns ``total_tiles - 1`` is the launch's last: that CTA writes the counter back to 0 for
the next launch, which stream order starts only after this one has ended. The counter must
therefore not be shared by launches that run at the same time (``interface.tile_counter`` keeps
one per device and stream).

Note [K/V multicast]: with ``kv_multicast`` the CTAs of work tiles 2c and 2c+1 (neighbouring m
blocks of one (batch, head): the launch needs an even number of m blocks per head) form a
cluster of ``kv_cluster`` (2 by default) and read the same K/V tiles. Each CTA's producer loads
its half of the rows of every K/V tile and multicasts it into both CTAs' SMEM, so L2 serves
each K/V tile once per cluster instead of once per CTA. Each CTA's full barrier still expects
the whole tile's bytes (both halves land on it); a stage is empty only when both CTAs'
consumers have released it, so each consumer warp arrives on the empty barrier of both CTAs
(lanes 0 and 1, the DSL's ``PipelineTmaAsync`` with a (1, 2, 1, 1) cluster; with
``peer_release``, through addresses mapped once, Note [Peer release] in common.py), and a
producer issues its half only then. Before a CTA exits, its producer waits until every stage
is empty again (``producer_tail``): the peer's last releases arrive on this CTA's barriers,
which must still exist. With ``kv_cluster=4`` the same holds for four neighbouring m blocks, each loading
a quarter of every tile (measured slower than pairs on the H100).

Note [Odd m blocks] (``multicast_odd_m``, clusters of 2): with an odd number M of m blocks per
head, tiles 2c and 2c + 1 of the plain order would straddle two heads whose K/V differ. So the
flat order changes: its first (M - 1) x pairs tiles are m blocks 0 .. M - 2 of each (batch, head)
pair in turn (an even count per head: clusters share K/V as in Note [K/V multicast]), and the
last ``pairs`` tiles are the last m block of pair 0, 1, 2, ... Clusters there hold the last m
blocks of two pairs (an even number of pairs, so no cluster is left half empty): both CTAs see
the same seqlen_k, hence the same KV tiles in the same order, but not the same K/V, so each
producer loads both halves of every tile into its own SMEM only (the multicast TMA with its own
CTA's bit in the mask). Nothing else changes: each full barrier still expects the whole tile,
and the consumers still release on both CTAs' empty barriers, which only makes a producer wait
for the peer's consumers too. Static persistent CTAs walk the order upwards and the grid is even,
so a cluster meets its shared tiles first and its own-load tiles at the end. hdim 64 (192-row
blocks) gives 43 m blocks at 8k, which had no multicast before.

Note [Varlen] (``varlen``): a batch of sequences packed along the token axis, q (total_q, h,
d) and k, v (total_k, h_kv, d), sequence i at rows [cu_seqlens[i], cu_seqlens[i + 1]) (keys:
its first ``seqused_k[i]`` rows when given). The work tiles are ceil(max_seqlen_q / m_block)
m blocks per (sequence, head) pair, pair-major (the CTAs working at one time share few
pairs' K/V, which stay in L2: taking the m blocks of every pair in turn measured 0.85-0.97x
of this on an H200), each pair's from its last m block down (under a causal mask its
heaviest first). ``tile_coords`` reads the tile's sequence offsets and lengths from
cu_seqlens; a tile past its sequence's end is skipped by the producer and the consumers alike
(no Q load, no pipeline step, no store). Every length-dependent quantity (the band of key blocks, the masks' edges,
the empty warpgroups, the stored rows) uses the tile's own lengths. Causal masks and windows
are the run-time band of each sequence (a varlen kernel is ``local``: ``kernel_window`` with
the longest lengths, whose clamps cover every sequence). Loads offset the TMA coordinates by
the sequence's first row: Q rows past its end read the next sequence's rows (or zeros past the
tensor), which nobody stores. K and V load through ragged views (below) that end at the
sequence's last used key, so the rows past it arrive as zeros: whatever lies there (the next
sequence, or a cache's unfilled rows past ``seqused_k``, NaN included) cannot reach P V, where
a masked P of 0 times a NaN or infinite V would still be NaN. O's TMA store must not
write past the end either, so it goes through a ragged view of O (``fa_sm100.varlen.ragged_rows``): the row mode is
``RAGGED_ROWS`` long and another mode steps by one row too, with the base moved back by
``RAGGED_ROWS`` rows; a tile of sequence (offset, length) stores at row coordinate
``RAGGED_ROWS - length + r`` and that mode's coordinate ``offset + length``, which addresses
row ``offset + r`` and is out of bounds (clipped by the TMA unit) exactly from r = length on.
LSE is stored per row below the length.

Note [Paged K/V] (``page_size``): a varlen kernel whose K and V are a paged cache, the pages
(pages, page_size, h_kv, d) seen as rows, with a page table (sequences, pages per sequence)
naming each sequence's pages in order (``seqused_k`` its keys; ``cu_seqlens_k`` is not read
for offsets). Key block n of a sequence starts at key n x n_block, in the page of table slot
n x n_block // page_size, at row n x n_block mod page_size of it: ``page_block`` sees that
page through a ragged view ending at the sequence's last key, so one TMA copy loads the
block and the keys past the sequence's end arrive as zeros, as in Note [Varlen]. The page
size is a multiple of n_block (the block never crosses a page). Nothing else changes: the
bands, masks and the consumers see the sequence's lengths as before.
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.utils.hopper_helpers as sm90_helpers
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from fa_sm100 import bands
from fa_sm100.config import WARP_SIZE, cutlass_dtype
from fa_sm100.hopper.common import PeerReleasePipeline
from fa_sm100.hopper.config import WARPGROUP_THREADS, WGMMA_M, Sm90FwdConfig
from fa_sm100.hopper.fwd_consumer import ConsumerRole
from fa_sm100.softmax_math import LOG2_E
from fa_sm100.varlen import ragged_rows, ragged_tile_rows

# Warpgroup 0 is the producer: warp 0 issues the TMA loads, the others only donate registers.
PRODUCER_WARPS = WARPGROUP_THREADS // WARP_SIZE
PRODUCER_WARP = 0
# Slots of the tile pipeline (Note [Dynamic tile schedule]): the producer publishes the next
# tile while the consumers may still read the one before.
TILE_SLOTS = 2


def _select(t: cute.Tensor, modes) -> cute.Tensor:
    """The same memory seen with its modes reordered."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=modes))


class Sm90FwdKernel(ConsumerRole):
    """Callable with ``(mQ, mK, mV, mO, mLSE, mTileCounter, softmax_scale, softcap, num_ctas,
    window_left, window_right, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, max_seqlen_q, stream)`` on
    BSHD tensors.

    mQ (b, s_q, h, d), mK/mV (b, s_k, h_kv, d / dv), mO (b, s_q, h, dv), mLSE (b, h, s_q)
    float32 or None. GQA/MQA: query head h reads K/V head h // (h / h_kv). mTileCounter: (1,)
    int32, zero before the first launch (``dynamic_schedule``; else None). num_ctas: the SM count
    (the persistent grid). softcap: the cap, read only with ``cfg.softcap`` (else pass 0).
    window_left / window_right: the band's run-time bounds (``fa_sm100.bands.kernel_window``),
    read only with ``local`` (else pass 0). With ``varlen`` (Note [Varlen]) the tensors are the
    packed ones with a batch of 1 (mLSE (1, h, total_q)), mCuSeqlensQ / mCuSeqlensK (batch + 1,)
    int32, mSeqUsedK (batch,) int32 or None, max_seqlen_q the longest query sequence; without
    it pass None, None, None, 0.
    """

    def __init__(self, cfg: Sm90FwdConfig):
        self.cfg = cfg.validate()
        self.dtype = cutlass_dtype(cfg.dtype)
        self.num_threads = cfg.num_threads
        self.num_consumer_threads = cfg.num_consumer_wg * WARPGROUP_THREADS

    # ------------------------------------------------------------------ host side
    def _smem_layout(self, rows: int, cols: int, stages=None):
        """128/64/32-byte swizzled K-major layout of a (rows, cols[, stages]) tile."""
        atom = warpgroup.make_smem_layout_atom(
            sm90_helpers.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, self.dtype, cols), self.dtype
        )
        shape = (rows, cols) if stages is None else (rows, cols, stages)
        order = (0, 1) if stages is None else (0, 1, 2)
        return cute.tile_to_shape(atom, shape, order=order)

    def _tiled_mmas(self):
        cfg = self.cfg
        qk = sm90_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K,
            Float32, atom_layout_mnk=(cfg.num_consumer_wg, 1, 1), tiler_mn=(64, cfg.n_block),
        )
        return qk, self._pv_mma(cfg.num_consumer_wg)

    def _pv_mma(self, warpgroups: int):
        """O += P V over ``warpgroups`` x 64 rows: P comes from registers (RS); V^T is N-major
        (head_dim_v contiguous) in SMEM."""
        return sm90_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN,
            Float32, atom_layout_mnk=(warpgroups, 1, 1), tiler_mn=(64, self.cfg.head_dim_v),
            a_source=warpgroup.OperandSource.RMEM,
        )

    def _q_smem_layout(self):
        """Q's SMEM stages: (m_block, head_dim, q_stage)."""
        return self._smem_layout(self.cfg.m_block, self.cfg.head_dim, self.cfg.q_stage)

    def _o_smem_layout(self):
        """O's SMEM tile: (m_block, head_dim_v), or with ``wg_epilogue`` (64, head_dim_v,
        warpgroup), one TMA box per consumer warpgroup (Note [Warpgroup epilogues])."""
        cfg = self.cfg
        if cfg.wg_epilogue:
            return self._smem_layout(WGMMA_M, cfg.head_dim_v, cfg.num_consumer_wg)
        return self._smem_layout(cfg.m_block, cfg.head_dim_v)

    def _shared_storage(self, sQ_layout, sK_layout, sV_layout, sO_layout):
        """The CTA's SMEM: mbarriers (and the tile pipeline's index slots), then Q, O, K, V on
        1 KiB boundaries. ``Sm90FwdConfig.smem_parts`` gives the same sizes (a compile test
        holds them equal). O is staged in Q's buffer, unless persistent (without
        ``o_in_q_buffer``): then the next tile's Q may be in flight while O is stored."""
        cfg = self.cfg
        buf = lambda elems: cute.struct.Align[cute.struct.MemRange[self.dtype, elems], 1024]
        q_elems, o_elems = cute.cosize(sQ_layout), cute.cosize(sO_layout)

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2 * cfg.q_stage]
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * cfg.kv_stage]
            mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * cfg.kv_stage]
            if cfg.dynamic_schedule:  # the tile pipeline, Note [Dynamic tile schedule]
                mbar_tile: cute.struct.MemRange[cutlass.Int64, 2 * TILE_SLOTS]
                tile_index: cute.struct.MemRange[Int32, TILE_SLOTS]
            if cfg.own_o_buffer:
                sQ: buf(q_elems)
                sO: buf(o_elems)
            else:
                sQ: buf(max(q_elems, o_elems))
            sK: buf(cute.cosize(sK_layout))
            sV: buf(cute.cosize(sV_layout))

        return SharedStorage

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE,
        mTileCounter,
        softmax_scale: Float32,
        softcap: Float32,
        num_ctas: Int32,
        window_left: Int32,
        window_right: Int32,
        mCuSeqlensQ,
        mCuSeqlensK,
        mSeqUsedK,
        mPageTable,
        max_seqlen_q: Int32,
        stream: cuda.CUstream,
    ):
        cfg = self.cfg
        # (b, s, h, d) -> (s, d, h, b): TMA tiles over (s, d); (b, h, s) -> (s, h, b)
        mQ, mK, mV, mO = [_select(t, [1, 3, 2, 0]) for t in (mQ, mK, mV, mO)]
        if const_expr(mLSE is not None):
            mLSE = _select(mLSE, [2, 1, 0])

        sQ_layout = self._q_smem_layout()
        sK_layout = self._smem_layout(cfg.n_block, cfg.head_dim, cfg.kv_stage)
        sV_layout = self._smem_layout(cfg.n_block, cfg.head_dim_v, cfg.kv_stage)
        sO_layout = self._o_smem_layout()
        tiled_mma_qk, tiled_mma_pv = self._tiled_mmas()

        q_bytes = cute.size_in_bytes(self.dtype, cute.select(sQ_layout, mode=[0, 1]))
        k_bytes = cute.size_in_bytes(self.dtype, cute.select(sK_layout, mode=[0, 1]))
        v_bytes = cute.size_in_bytes(self.dtype, cute.select(sV_layout, mode=[0, 1]))
        load_op = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, tma_mQ = cpasync.make_tiled_tma_atom(
            load_op, mQ, cute.select(sQ_layout, mode=[0, 1]), (cfg.m_block, cfg.head_dim))
        # Note [K/V multicast]: each CTA of the cluster loads 1/kv_cluster of a K/V tile.
        kv_ctas = cfg.cluster[0]
        kv_op = cpasync.CopyBulkTensorTileG2SMulticastOp() if cfg.kv_multicast else load_op
        mK_load, mV_load = mK, mV
        if const_expr(cfg.varlen):  # Note [Varlen]: rows past a sequence's keys load as zeros
            mK_load, mV_load = (ragged_rows(t[None, None, None, 0]) for t in (mK, mV))
        tma_k, tma_mK = cpasync.make_tiled_tma_atom(
            kv_op, mK_load, cute.select(sK_layout, mode=[0, 1]), (cfg.n_block, cfg.head_dim),
            kv_ctas)
        tma_v, tma_mV = cpasync.make_tiled_tma_atom(
            kv_op, mV_load, cute.select(sV_layout, mode=[0, 1]), (cfg.n_block, cfg.head_dim_v),
            kv_ctas)
        o_rows = WGMMA_M if cfg.wg_epilogue else cfg.m_block  # one TMA store per warpgroup?
        mO_store = mO
        if const_expr(cfg.varlen):  # Note [Varlen]: rows past a sequence's end are clipped
            mO_store = ragged_rows(mO[None, None, None, 0])
        tma_o, tma_mO = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mO_store, cute.select(sO_layout, mode=[0, 1]),
            (o_rows, cfg.head_dim_v))

        SharedStorage = self._shared_storage(sQ_layout, sK_layout, sV_layout, sO_layout)

        num_m_blocks = cute.ceil_div(cute.size(mQ.shape[0]), cfg.m_block)
        total_tiles = num_m_blocks * cute.size(mQ.shape[2]) * cute.size(mQ.shape[3])
        varlen = None  # Note [Varlen]: (cu_seqlens_q, cu_seqlens_k, m blocks[, seqused_k])
        if const_expr(cfg.varlen):
            num_m_blocks = cute.ceil_div(max_seqlen_q, cfg.m_block)
            total_tiles = (num_m_blocks * cute.size(mQ.shape[2])
                           * (cute.size(mCuSeqlensQ.shape[0]) - 1))
            varlen = (mCuSeqlensQ, mCuSeqlensK, num_m_blocks)
            if const_expr(mSeqUsedK is not None):
                varlen = (mCuSeqlensQ, mCuSeqlensK, num_m_blocks, mSeqUsedK)
            if const_expr(cfg.page_size):  # Note [Paged K/V]
                varlen = (mCuSeqlensQ, mCuSeqlensK, num_m_blocks, mSeqUsedK, mPageTable)
        # Causal tiles run longest first in sections of (batch, head) pairs whose K and V fit
        # in L2 (see tile_coords).
        kv_bytes_per_head = mK.shape[0] * (cfg.head_dim + cfg.head_dim_v) * self.cfg.dtype_bytes
        l2_heads = cutlass.max(Int32(cfg.l2_section_mib << 20) // cutlass.max(kv_bytes_per_head, 1), 1)
        grid_x = total_tiles
        if const_expr(cfg.persistent):
            grid_x = cutlass.min(total_tiles, num_ctas)
            if const_expr(cfg.kv_multicast):  # Note [Persistent multicast]: whole clusters
                grid_x = grid_x // cfg.kv_cluster * cfg.kv_cluster
        scale_log2 = softmax_scale * LOG2_E
        softcap_k = None  # fa_sm100.softmax_math: tanh(raw score * softcap_k), then c log2(e)
        if const_expr(cfg.softcap):
            softcap_k = softmax_scale / softcap
            scale_log2 = softcap * LOG2_E
        window = None  # only a windowed kernel takes the bounds as parameters
        if const_expr(cfg.local):
            window = (window_left, window_right)
        self.kernel(
            tma_mQ, tma_mK, tma_mV, tma_mO, mLSE, mTileCounter, window, softcap_k, varlen,
            total_tiles,
            tma_q, tma_k, tma_v, tma_o,
            sQ_layout, sK_layout, sV_layout, sO_layout,
            tiled_mma_qk, tiled_mma_pv,
            scale_log2, l2_heads, q_bytes, k_bytes, v_bytes, SharedStorage,
        ).launch(grid=(grid_x, 1, 1), block=[self.num_threads, 1, 1], stream=stream,
                 min_blocks_per_mp=1, **({"cluster": cfg.cluster} if cfg.kv_multicast else {}))

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE,
        mTileCounter,
        window,
        softcap_k,
        varlen,
        total_tiles: Int32,
        tma_q: cute.CopyAtom,
        tma_k: cute.CopyAtom,
        tma_v: cute.CopyAtom,
        tma_o: cute.CopyAtom,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        scale_log2: Float32,
        l2_heads: Int32,
        q_bytes: cutlass.Constexpr[int],
        k_bytes: cutlass.Constexpr[int],
        v_bytes: cutlass.Constexpr[int],
        SharedStorage: cutlass.Constexpr,
    ):
        """Set up shared storage and pipelines, then dispatch to the producer or a consumer."""
        cfg = self.cfg
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == PRODUCER_WARP:
            for atom in (tma_q, tma_k, tma_v, tma_o):
                cpasync.prefetch_descriptor(atom)

        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        one_tma_thread = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        # PipelineTmaAsync releases with one lane per consumer warp (per CTA of the cluster
        # under kv_multicast, Note [K/V multicast]).
        consumer_warps = self.num_consumer_threads // cute.arch.WARP_SIZE
        pipe_q = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_q.data_ptr(), num_stages=cfg.q_stage,
            producer_group=one_tma_thread,
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_warps),
            tx_count=q_bytes, defer_sync=True)
        kv_ctas = cfg.cluster[0]
        kv_cluster = cute.make_layout((1, kv_ctas, 1, 1))  # (V, M, N, K): CTAs of m blocks
        kv_consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, kv_ctas * consumer_warps)
        pipe_k, pipe_v = [
            pipeline.PipelineTmaAsync.create(
                barrier_storage=mbar.data_ptr(), num_stages=cfg.kv_stage,
                producer_group=one_tma_thread, consumer_group=kv_consumers, tx_count=tx,
                cta_layout_vmnk=kv_cluster, mcast_mode_mn=(0, 1), defer_sync=True)
            for mbar, tx in ((storage.mbar_k, k_bytes), (storage.mbar_v, v_bytes))]
        pipe_tile = None
        sTile = None
        if const_expr(cfg.dynamic_schedule):  # Note [Dynamic tile schedule]
            pipe_tile = pipeline.PipelineAsync.create(
                barrier_storage=storage.mbar_tile.data_ptr(), num_stages=TILE_SLOTS,
                producer_group=one_tma_thread,
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                         self.num_consumer_threads),
                defer_sync=True)
            sTile = storage.tile_index.get_tensor(cute.make_layout(TILE_SLOTS))
        cute.arch.mbarrier_init_fence()
        if const_expr(cfg.kv_multicast):  # the peer arrives on and loads into this CTA
            cute.arch.cluster_arrive_relaxed()
            cute.arch.cluster_wait()
        else:
            cute.arch.sync_threads()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        if const_expr(cfg.own_o_buffer):
            sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        else:
            sO = storage.sQ.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)

        if warp_idx < PRODUCER_WARPS:
            cute.arch.setmaxregister_decrease(cfg.regs_producer)
            if warp_idx == PRODUCER_WARP:
                self.producer(mQ, mK, mV, sQ, sK, sV, tma_q, tma_k, tma_v, pipe_q, pipe_k, pipe_v,
                              total_tiles, l2_heads, mTileCounter, pipe_tile, sTile, window,
                              varlen)
        else:
            cute.arch.setmaxregister_increase(cfg.regs_consumer)
            kv_release = (pipe_k, pipe_v)
            if const_expr(cfg.kv_multicast and cfg.peer_release):  # Note [Peer release]
                kv_release = (PeerReleasePipeline.create(pipe_k),
                              PeerReleasePipeline.create(pipe_v))
            self.consumer(mO, mLSE, mK, sQ, sK, sV, sO, tma_o, tiled_mma_qk, tiled_mma_pv,
                          pipe_q, *kv_release, scale_log2, total_tiles, l2_heads, pipe_tile,
                          sTile, window, softcap_k, varlen)

    @cute.jit
    def tile_coords(self, t: Int32, mQ: cute.Tensor, mK: cute.Tensor, l2_heads: Int32, window,
                    varlen=None):
        """(m_block, head, batch, n_lo, n_blocks, masked_from, left_to, seq) of flat tile t.

        Keys of blocks [n_lo, n_lo + n_blocks) are visited, last block first. Blocks from
        ``masked_from`` on cross the right edge of the band (the causal diagonal), blocks
        before ``left_to`` its left edge (``fa_sm100.bands.kv_masked_blocks``). Non-causal
        and windowed (``local``, ``window`` = (left, right)): t runs over the m blocks of one
        (batch, head) pair, then the next pair. Causal without a window: t runs longest first:
        (batch, head) pairs are cut into sections of ``l2_heads`` (their K/V fit in L2);
        within a section the last m block of every pair comes first, then the one before, and
        so on. ``seq``: with ``varlen`` the tile's sequence as (first query row, first key row,
        query length, key length) (Note [Varlen]), else None.
        """
        cfg = self.cfg
        seqlen_q = mQ.shape[0]
        seqlen_k = mK.shape[0]
        num_heads = mQ.shape[2]
        num_m_blocks = cute.ceil_div(seqlen_q, cfg.m_block)
        seq = None
        if const_expr(varlen is not None):  # Note [Varlen]
            cu_q, cu_k = varlen[0], varlen[1]
            pair = t // varlen[2]  # pair-major (a pair's K/V stays in L2), last m block first
            m_block = varlen[2] - 1 - (t - pair * varlen[2])
            sequence = pair // num_heads
            q_off, k_off = cu_q[sequence], cu_k[sequence]
            seqlen_q = cu_q[sequence + 1] - q_off
            if const_expr(len(varlen) >= 4):
                seqlen_k = varlen[3][sequence]
            else:
                seqlen_k = cu_k[sequence + 1] - k_off
            seq = (q_off, k_off, seqlen_q, seqlen_k)
            if const_expr(self.cfg.page_size):  # Note [Paged K/V]: its page-table row
                seq = (q_off, k_off, seqlen_q, seqlen_k, sequence)
        elif const_expr(cfg.odd_m_pairs):  # Note [Odd m blocks]: the even part first
            paired_m, paired_tiles = self.paired_tiles(mQ)
            pair = t - paired_tiles
            m_block = num_m_blocks - 1
            if t < paired_tiles:
                pair = t // cutlass.max(paired_m, 1)
                m_block = t - pair * paired_m
        else:
            pair = t // num_m_blocks
            m_block = t - pair * num_m_blocks
        n_lo = 0
        n_blocks = cute.ceil_div(seqlen_k, cfg.n_block)
        masked_from = n_blocks
        left_to = 0
        if const_expr(cfg.local):
            left, right = window
            n_lo, n_hi = bands.kv_block_range(m_block * cfg.m_block, cfg.m_block, cfg.n_block,
                                              seqlen_q, seqlen_k, left, right, cutlass.max,
                                              cutlass.min)
            n_blocks = cutlass.max(n_hi - n_lo, 0)
            masked_from, left_to = bands.kv_masked_blocks(
                m_block * cfg.m_block, cfg.m_block, cfg.n_block, seqlen_q, seqlen_k, left, right,
                cutlass.max)
            if const_expr(varlen is not None):
                if m_block * cfg.m_block >= seqlen_q:  # past its sequence: nothing to do
                    n_blocks = 0
        elif const_expr(cfg.causal):
            pairs = num_heads * mQ.shape[3]
            section = t // (l2_heads * num_m_blocks)
            in_section = t - section * l2_heads * num_m_blocks
            pairs_here = cutlass.min(l2_heads, pairs - section * l2_heads)
            m_from_end = in_section // pairs_here
            pair = section * l2_heads + in_section - m_from_end * pairs_here
            m_block = num_m_blocks - 1 - m_from_end
            offset = seqlen_k - seqlen_q
            last_row_keys = (m_block + 1) * cfg.m_block + offset  # keys the tile's last row sees
            n_blocks = cutlass.min(n_blocks, cute.ceil_div(cutlass.max(last_row_keys, 0), cfg.n_block))
            first_row_keys = m_block * cfg.m_block + offset + 1
            masked_from = cutlass.max(first_row_keys, 0) // cfg.n_block
        batch = pair // num_heads
        head = pair - batch * num_heads
        return m_block, head, batch, n_lo, n_blocks, masked_from, left_to, seq

    @cute.jit
    def paired_tiles(self, mQ: cute.Tensor):
        """(m blocks per head that share K/V in clusters, flat tiles that do): the even part
        of each head's m blocks (Note [Odd m blocks])."""
        num_m_blocks = cute.ceil_div(mQ.shape[0], self.cfg.m_block)
        paired_m = num_m_blocks - num_m_blocks % 2
        return paired_m, paired_m * mQ.shape[2] * mQ.shape[3]

    @cute.jit
    def producer(self, mQ, mK, mV, sQ, sK, sV, tma_q, tma_k, tma_v, pipe_q, pipe_k, pipe_v,
                 total_tiles: Int32, l2_heads: Int32, mTileCounter, pipe_tile, sTile, window,
                 varlen):
        """Warp 0: per work tile, Q once, then K/V tiles last-to-first into the ``kv_stage`` ring.

        Consumes: free stages (empty barriers released by the consumers; Q is released after
        the tile's last QK GEMM, so the next tile's Q load overlaps the current tile's tail, or
        with ``o_in_q_buffer`` after its O store).
        Produces: full barriers completed by the TMA transaction bytes; with
        ``dynamic_schedule``, the next tile's index in the tile pipeline.
        """
        cfg = self.cfg
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, cfg.q_stage)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, cfg.kv_stage)
        if const_expr(cfg.dynamic_schedule):  # Note [Dynamic tile schedule]
            tile_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                      TILE_SLOTS)
            t = cute.arch.block_idx()[0]
            while t < total_tiles:
                state, q_state = self.producer_tile(
                    mQ, mK, mV, sQ, sK, sV, tma_q, tma_k, tma_v, pipe_q, pipe_k, pipe_v, t,
                    l2_heads, state, q_state, window, varlen)
                t, tile_state = self.publish_next_tile(mTileCounter, pipe_tile, sTile, tile_state,
                                                       total_tiles)
        elif const_expr(cfg.persistent):  # work tiles: blockIdx.x, then every gridDim.x-th
            for t in cutlass.range(cute.arch.block_idx()[0], total_tiles, cute.arch.grid_dim()[0],
                                   unroll=1):
                state, q_state = self.producer_tile(
                    mQ, mK, mV, sQ, sK, sV, tma_q, tma_k, tma_v, pipe_q, pipe_k, pipe_v, t,
                    l2_heads, state, q_state, window, varlen)
        else:
            state, q_state = self.producer_tile(
                mQ, mK, mV, sQ, sK, sV, tma_q, tma_k, tma_v, pipe_q, pipe_k, pipe_v,
                cute.arch.block_idx()[0], l2_heads, state, q_state, window, varlen)
        if const_expr(cfg.kv_multicast):  # Note [K/V multicast]: the peer's last releases
            pipe_k.producer_tail(state.clone())
            pipe_v.producer_tail(state)

    @cute.jit
    def publish_next_tile(self, mTileCounter, pipe_tile, sTile, tile_state, total_tiles: Int32):
        """Fetch the CTA's next work tile from the global counter and hand it to the consumers
        (Note [Dynamic tile schedule]). Returns (tile, advanced tile-pipeline state)."""
        lane = cute.arch.lane_idx()
        fetched = Int32(0)
        if lane == 0:
            fetched = cute.arch.atomic_add(mTileCounter.iterator, Int32(1), sem="relaxed",
                                           scope="gpu")
            if fetched == total_tiles - 1:  # the launch's last fetch: reset for the next launch
                mTileCounter[0] = Int32(0)
        tile = cute.arch.grid_dim()[0] + cute.arch.shuffle_sync(fetched, 0)
        pipe_tile.producer_acquire(tile_state)
        if lane == 0:
            sTile[tile_state.index] = tile
            pipe_tile.producer_commit(tile_state)  # release: the slot's store is seen with it
        tile_state.advance()
        return tile, tile_state

    @cute.jit
    def load_q(self, tma_q, tQgQ, tQsQ, pipe_q, q_state):
        """The work tile's Q into its stage (Note [Two Q stages]), once the consumers released
        the Q that was there. Returns the advanced q pipeline state."""
        pipe_q.producer_acquire(q_state, pipe_q.producer_try_acquire(q_state))
        cute.copy(tma_q, tQgQ, tQsQ[None, self.q_index(q_state)],
                  tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
        q_state.advance()
        return q_state

    @cute.jit
    def producer_tile(self, mQ, mK, mV, sQ, sK, sV, tma_q, tma_k, tma_v, pipe_q, pipe_k, pipe_v,
                      t: Int32, l2_heads: Int32, state, q_state, window, varlen):
        """The loads of one work tile; returns the advanced (kv, q) pipeline states."""
        cfg = self.cfg
        m_block, head, batch, n_lo, n_blocks, _, _, seq = self.tile_coords(
            t, mQ, mK, l2_heads, window, varlen)
        head_kv = head // (mQ.shape[2] // mK.shape[2])
        mQ_bh = mQ[None, None, head, batch]
        mK_bh = mK[None, None, head_kv, batch]
        mV_bh = mV[None, None, head_kv, batch]
        if const_expr(varlen is not None):  # Note [Varlen]: from the sequence's first rows
            mQ_bh = cute.domain_offset((seq[0], 0), mQ[None, None, head, 0])
            mK_bh = ragged_tile_rows(mK[None, None, head_kv, None], seq[3], seq[1])
            mV_bh = ragged_tile_rows(mV[None, None, head_kv, None], seq[3], seq[1])
        gQ = cute.local_tile(mQ_bh, (cfg.m_block, cfg.head_dim), (m_block, 0))
        gK = cute.local_tile(mK_bh, (cfg.n_block, cfg.head_dim), (None, 0))
        gV = cute.local_tile(mV_bh, (cfg.n_block, cfg.head_dim_v), (None, 0))
        # ((atom_v, rest_v)) / ((atom_v, rest_v), N_TILES) / ((atom_v, rest_v), STAGE)
        tQsQ, tQgQ = cpasync.tma_partition(tma_q, 0, cute.make_layout(1),
                                           cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
        # Note [K/V multicast]: this CTA's share of each K/V tile (the whole tile without it).
        kv_rank, kv_ctas = 0, cfg.cluster[0]
        if const_expr(cfg.kv_multicast):
            kv_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        share = lambda tma, sX, gX, rank: cpasync.tma_partition(
            tma, rank, cute.make_layout(kv_ctas), cute.group_modes(sX, 0, 2),
            cute.group_modes(gX, 0, 2))
        tKsK, tKgK = share(tma_k, sK, gK, kv_rank)
        tVsV, tVgV = share(tma_v, sV, gV, kv_rank)
        # Under multicast: the CTAs the loads go to, and the peer's shares to load as well when
        # this tile's K/V are this CTA's alone (Note [Odd m blocks]).
        mcast_mask = cutlass.Int16((1 << kv_ctas) - 1)
        peer_k, peer_v = None, None
        if const_expr(cfg.odd_m_pairs):
            peer_k = share(tma_k, sK, gK, 1 - kv_rank)
            peer_v = share(tma_v, sV, gV, 1 - kv_rank)
            if t >= self.paired_tiles(mQ)[1]:
                mcast_mask = cutlass.Int16(1 << kv_rank)
        load_k = lambda n, st: self.load_kv(tma_k, tKgK, tKsK, n, pipe_k, st, mcast_mask, peer_k)
        load_v = lambda n, st: self.load_kv(tma_v, tVgV, tVsV, n, pipe_v, st, mcast_mask, peer_v)
        if const_expr(cfg.page_size):  # Note [Paged K/V]: each block from its own page
            load_k = lambda n, st: self.load_kv(
                tma_k, self.page_block(tma_k, sK, mK, head_kv, cfg.head_dim, varlen, seq, n),
                tKsK, 0, pipe_k, st, mcast_mask, None)
            load_v = lambda n, st: self.load_kv(
                tma_v, self.page_block(tma_v, sV, mV, head_kv, cfg.head_dim_v, varlen, seq, n),
                tVsV, 0, pipe_v, st, mcast_mask, None)
        load_q = lambda st: self.load_q(tma_q, tQgQ, tQsQ, pipe_q, st)
        if const_expr(varlen is not None):
            if m_block * cfg.m_block < seq[2]:  # Note [Varlen]: a tile past its sequence
                state, q_state = self.tile_loads(load_q, load_k, load_v, n_lo, n_blocks, state,
                                                 q_state)
        else:
            state, q_state = self.tile_loads(load_q, load_k, load_v, n_lo, n_blocks, state,
                                             q_state)
        return state, q_state

    @cute.jit
    def page_block(self, tma, sX, mX, head_kv: Int32, cols: int, varlen, seq, n: Int32):
        """The TMA source of key block ``n`` of a paged cache (Note [Paged K/V]): the block's
        rows in the page of its page-table slot, seen through a ragged view that ends at the
        sequence's last key. Returns tXgX whose block 0 is it."""
        cfg = self.cfg
        rows = n * cfg.n_block
        slot = rows // cfg.page_size
        first = varlen[4][seq[4], slot] * cfg.page_size + (rows - slot * cfg.page_size)
        valid = cutlass.min(seq[3] - rows, cfg.n_block)
        mX_blk = ragged_tile_rows(mX[None, None, head_kv, None], valid, first)
        gX = cute.local_tile(mX_blk, (cfg.n_block, cols), (None, 0))
        _, tXgX = cpasync.tma_partition(tma, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2),
                                        cute.group_modes(gX, 0, 2))
        return tXgX

    @cute.jit
    def tile_loads(self, load_q, load_k, load_v, n_lo: Int32, n_blocks: Int32, state, q_state):
        """``producer_tile``'s loads of one work tile, in the order the consumers take them:
        Q, then K/V tiles last to first. Returns the advanced (kv, q) pipeline states."""
        cfg = self.cfg
        # With O in Q's buffer the Q stage frees only after the previous tile's O store: the
        # first K tile goes first so that it is not held up behind it.
        k_first = cfg.k_before_q or cfg.o_in_q_buffer
        if const_expr(not k_first):
            q_state = load_q(q_state)
        elif n_blocks == 0:  # no K tile to go first (a causal tile whose rows see no key)
            q_state = load_q(q_state)
        if n_blocks > 0:
            n_hi = n_lo + n_blocks  # n_lo: 0 without a window
            load_k(n_hi - 1, state)
            if const_expr(k_first):
                q_state = load_q(q_state)
            if const_expr(cfg.intra_wg_overlap):
                for i in cutlass.range(n_blocks - 1, unroll=1):
                    n = n_hi - 2 - i
                    state_v = state.clone()
                    state.advance()
                    load_k(n, state)
                    load_v(n + 1, state_v)
                load_v(n_lo, state)
                state.advance()
            else:
                load_v(n_hi - 1, state)
                state.advance()
                for i in cutlass.range(n_blocks - 1, unroll=1):
                    n = n_hi - 2 - i
                    load_k(n, state)
                    load_v(n, state)
                    state.advance()
        return state, q_state

    @cute.jit
    def load_kv(self, tma, tXgX, tXsX, n: Int32, pipe, state, mcast_mask, peer):
        """K or V tile n into the ring stage of ``state``, once the consumers released it (those
        of both CTAs under kv_multicast, which multicasts this CTA's share to the CTAs of
        ``mcast_mask``). ``peer``: the peer's share (sX, gX) under ``odd_m_pairs``, loaded too
        when the mask holds this CTA alone (Note [Odd m blocks])."""
        mcast = {}
        if const_expr(self.cfg.kv_multicast):
            mcast = {"mcast_mask": mcast_mask}
        pipe.producer_acquire(state, pipe.producer_try_acquire(state))
        bar = pipe.producer_get_barrier(state)
        cute.copy(tma, tXgX[None, n], tXsX[None, state.index], tma_bar_ptr=bar, **mcast)
        if const_expr(peer is not None):
            if mcast_mask != (1 << self.cfg.kv_cluster) - 1:
                cute.copy(tma, peer[1][None, n], peer[0][None, state.index], tma_bar_ptr=bar,
                          **mcast)
