"""The 16-warp SM100 forward kernel: host-side setup, shared storage and warp dispatch.

``Sm100Forward(cfg)`` is called (inside ``cute.compile``) with BSHD tensors Q, K, V, O, the LSE
(batch, heads, seqlen_q) or None, the softmax scale and a stream. ``kernel`` only sets up SMEM,
pipelines and TMEM and dispatches each warp to its role module:

    warps 0-3  softmax.softmax(stage 0)     warps 4-7  softmax.softmax(stage 1)
    warps 8-11 correction.correction        warp 12    mma.mma
    warp 13    epilogue.epilogue            warp 14    load.load          warp 15  (empty)

Registers: every warpgroup sets its budget from ``WarpRoles`` with setmaxnreg (the softmax
warpgroups grow, the others shrink). TMEM: the MMA warp allocates the whole 512 columns; every
region is placed by ``TmemPlan`` (layouts/tmem.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.utils as cutlass_utils
from cutlass import Float32, Int32, Int64
from cutlass import pipeline as cpipe
from cutlass.memory import TmemAllocator
from cutlass.cute.nvgpu import cpasync, tcgen05

from fa_sm100 import softmax_math
from fa_sm100.sm100 import correction as correction_role
from fa_sm100.sm100 import epilogue as epilogue_role
from fa_sm100.sm100 import load as load_role
from fa_sm100.sm100 import mma as mma_role
from fa_sm100.sm100 import pipes as pipes_mod
from fa_sm100.sm100 import softmax as softmax_role
from fa_sm100.sm100.context import NUM_STATS, Gmem, Problem, Smem, Tmem
from fa_sm100.sm100.scheduler import make_scheduler, rows_per_tile
from fa_sm100.varlen import packed_blocks, ragged_rows
from layouts import cute_layouts
from layouts.smem import ALIGN, SmemPlan
from layouts.tmem import TmemPlan
from pipelines import mbarrier, record
from pipelines.named_barriers import NamedBarrier, num_threads
from pipelines.spec import get_spec


@dataclass(frozen=True)
class TmaAtoms:
    q: object
    k: object
    v: object


class Sm100Forward:
    """One compiled SM100 forward per (validated) ``FmhaConfig``."""

    def __init__(self, cfg):
        self.cfg = cfg.validate()
        self.roles = cfg.warp_roles()
        self.tmem_plan = TmemPlan.for_config(cfg)
        self.smem_plan = SmemPlan.for_config(cfg)
        # Transaction bytes per stage across the pair, from the pipeline table.
        self.tx = {
            "q": get_spec("q").tx_bytes(cfg),
            "k": get_spec("kv").tx_bytes(cfg, "K"),
            "v": get_spec("kv").tx_bytes(cfg, "V"),
        }
        self.shared_bytes = None  # set while tracing

    # ------------------------------------------------------------------------------ host
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE, softmax_scale: Float32, softcap: Float32, window_left: Int32,
                 window_right: Int32, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mPageTable,
                 max_seqlen_q: Int32, stream):
        cfg = self.cfg
        # BSHD -> (s, d, h, b) for Q, K, O; V -> (d, s, h, b) (the PV MMA reads V MN-major).
        sdhb = [1, 3, 2, 0]
        mQ, mK, mV, mO = [cute.make_tensor(t.iterator, cute.select(t.layout, mode=sdhb))
                          for t in (mQ, mK, mV, mO)]
        mV = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=[1, 0, 2, 3]))
        if cutlass.const_expr(mLSE is not None):
            mLSE = cute.make_tensor(mLSE.iterator, cute.select(mLSE.layout, mode=[2, 1, 0]))

        tiled_mma_qk, tiled_mma_pv = cute_layouts.make_tiled_mmas(cfg)
        lay = cute_layouts.make_smem_layouts(cfg, tiled_mma_qk, tiled_mma_pv)
        cluster = cfg.cluster_shape
        cta_layout_vmnk = cute.tiled_divide(cute.make_layout(cluster), (tiled_mma_qk.thr_id.shape,))
        group = tcgen05.CtaGroup.TWO if cfg.use_2cta else tcgen05.CtaGroup.ONE
        load_op = cpasync.CopyBulkTensorTileG2SOp(group)
        tma_q, mQ_t = cute.nvgpu.make_tiled_tma_atom_A(
            load_op, mQ, cute.select(lay.sQ, mode=[0, 1, 2]), cute_layouts.mma_tiler_qk(cfg),
            tiled_mma_qk, cta_layout_vmnk.shape)
        mK_load, mV_load = mK, mV
        if cutlass.const_expr(cfg.varlen):  # fa_sm100.varlen: keys past a sequence load as 0
            mK_load = ragged_rows(mK[None, None, None, 0])
            mV_load = ragged_rows(mV[None, None, None, 0], row_mode=1)
        tma_k, mK_t = cute.nvgpu.make_tiled_tma_atom_B(
            load_op, mK_load, cute.select(lay.sK, mode=[0, 1, 2]),
            cute_layouts.mma_tiler_qk(cfg), tiled_mma_qk, cta_layout_vmnk.shape)
        tma_v, mV_t = cute.nvgpu.make_tiled_tma_atom_B(
            load_op, mV_load, cute.select(lay.sV, mode=[0, 1, 2]),
            cute_layouts.mma_tiler_pv(cfg), tiled_mma_pv, cta_layout_vmnk.shape)
        mO_store = mO
        if cutlass.const_expr(cfg.varlen):  # fa_sm100.varlen: rows past a sequence clipped
            mO_store = ragged_rows(mO[None, None, None, 0])
        tma_o, mO_t = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mO_store, cute.select(lay.sO, mode=[0, 1]),
            (cfg.m_block, cfg.head_dim_v))

        dtype = cute_layouts.cutlass_dtype(cfg.dtype)
        n_bars = pipes_mod.barrier_count(cfg)
        kv_elems = cute_layouts.kv_ring_elems(lay)

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[Int64, n_bars]  # every pipeline's full/empty barriers
            tmem_dealloc_mbar: Int64
            tmem_base: Int32
            stats: cute.struct.MemRange[Float32, cfg.m_block * NUM_STATS * cfg.q_stage]
            sO: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(lay.sO)], ALIGN]
            sQ: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(lay.sQ)], ALIGN]
            sKV: cute.struct.Align[cute.struct.MemRange[dtype, kv_elems], ALIGN]

        self.shared_storage = SharedStorage
        self.shared_bytes = SharedStorage.size_in_bytes()
        if cutlass.const_expr(self.shared_bytes > self.smem_plan.total):
            raise ValueError(
                f"SMEM: the kernel's shared storage takes {self.shared_bytes} bytes, more than "
                f"the {self.smem_plan.total} bytes SmemPlan budgets for {cfg}")

        seqlen_q = mQ.shape[0]
        num_heads = mQ.shape[2]
        batch = mQ.shape[3]
        varlen = None  # fa_sm100.varlen: (cu_seqlens_q, cu_seqlens_k[, seqused_k], longest)
        if cutlass.const_expr(cfg.varlen):
            seqlen_q = max_seqlen_q
            batch = mCuSeqlensQ.shape[0] - 1
            varlen = (mCuSeqlensQ, mCuSeqlensK, max_seqlen_q)
            if cutlass.const_expr(mSeqUsedK is not None):
                varlen = (mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, max_seqlen_q)
            if cutlass.const_expr(cfg.page_size):  # a paged cache: the page table too
                varlen = (mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mPageTable, max_seqlen_q)
        num_m_blocks = (seqlen_q + rows_per_tile(cfg) - 1) // rows_per_tile(cfg)
        num_tiles = num_m_blocks * num_heads * batch
        if cutlass.const_expr(cfg.varlen):  # the packed query blocks, at most (scheduler.py)
            num_tiles = packed_blocks(mQ.shape[0], batch, rows_per_tile(cfg)) * num_heads
        clusters = num_tiles
        if cutlass.const_expr(cfg.persistent):
            clusters = cutlass.min(num_tiles, cfg.num_sms // cfg.cta_group)
        scale_log2 = softmax_scale * Float32(softmax_math.LOG2_E)
        softcap_k = None  # fa_sm100.softmax_math: tanh(raw S * softcap_k), then c log2(e)
        if cutlass.const_expr(cfg.softcap):
            softcap_k = softmax_scale / softcap
            scale_log2 = softcap * Float32(softmax_math.LOG2_E)
        window = None  # only a windowed kernel takes the bounds as parameters
        if cutlass.const_expr(cfg.is_local):
            window = (window_left, window_right)
        self.kernel(
            mQ_t, mK_t, mV_t, mO_t, mLSE, window, softcap_k, varlen, tma_q, tma_k, tma_v, tma_o,
            scale_log2,
            lay.sQ, lay.sK, lay.sV, lay.sO, lay.tP, tiled_mma_qk, tiled_mma_pv,
        ).launch(
            grid=[clusters * cfg.cta_group, 1, 1],
            block=[self.roles.threads_per_cta, 1, 1],
            cluster=list(cluster) if cfg.use_2cta else None,
            stream=stream,
            min_blocks_per_mp=1,
        )

    # ---------------------------------------------------------------------------- device
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE,
               window, softcap_k, varlen, tma_q: cute.CopyAtom, tma_k: cute.CopyAtom,
               tma_v: cute.CopyAtom,
               tma_o: cute.CopyAtom, scale_log2: Float32, sQ_layout: cute.ComposedLayout,
               sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
               sO_layout: cute.ComposedLayout, tP_layout: cute.ComposedLayout,
               tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma):
        cfg, roles, plan = self.cfg, self.roles, self.tmem_plan
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == roles.load:
            for atom in (tma_q, tma_k, tma_v, tma_o):
                cpasync.prefetch_descriptor(atom)
        bidx, _, _ = cute.arch.block_idx()
        cta_v = Int32(0)
        if cutlass.const_expr(cfg.use_2cta):
            cta_v = bidx % cfg.cta_group
        is_leader = cta_v == 0

        storage = cutlass_utils.SmemAllocator().allocate(self.shared_storage)
        pipes = pipes_mod.build(cfg, roles, storage.mbar.data_ptr())

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sKV.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = cute.make_tensor(cute.recast_ptr(sK.iterator, sV_layout.inner), sV_layout.outer)
        sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        sStats = storage.stats.get_tensor(cute.make_layout((cfg.m_block, NUM_STATS, cfg.q_stage)))
        smem = Smem(sQ=sQ, sK=sK, sV=sV, sO=sO, sStats=sStats)
        gmem = Gmem(mQ=mQ, mK=mK, mV=mV, mO=mO, mLSE=mLSE)


        tmem_bar = cpipe.NamedBarrier(barrier_id=int(NamedBarrier.TMEM_ALLOC),
                                      num_threads=num_threads(NamedBarrier.TMEM_ALLOC, roles))
        tmem_alloc = TmemAllocator(
            storage.tmem_base.ptr, barrier_for_retrieve=tmem_bar, allocator_warp_id=roles.mma,
            is_two_cta=cfg.use_2cta, two_cta_tmem_dealloc_mbar_ptr=storage.tmem_dealloc_mbar.ptr,
        )
        thr_mma_qk = tiled_mma_qk.get_slice(cta_v)
        thr_mma_pv = tiled_mma_pv.get_slice(cta_v)
        # Barrier inits (pipelines, TMEM dealloc) visible to the whole pair before first use.
        mbarrier.pipeline_init_sync(cfg)

        regs = roles.setmaxnreg()
        if warp_idx == roles.empty:
            cute.arch.setmaxregister_decrease(regs["other"])
        if warp_idx == roles.load:
            cute.arch.setmaxregister_decrease(regs["other"])
            prob, sched = self._problem(mQ, mK, scale_log2, window, softcap_k, varlen)
            with record.role("load"):
                load_role.load(cfg, TmaAtoms(q=tma_q, k=tma_k, v=tma_v), self.tx, gmem, smem,
                               thr_mma_qk, thr_mma_pv, pipes, prob, sched)
        if warp_idx == roles.epilogue:
            cute.arch.setmaxregister_decrease(regs["other"])
            prob, sched = self._problem(mQ, mK, scale_log2, window, softcap_k, varlen)
            with record.role("epilogue"):
                epilogue_role.epilogue(cfg, tma_o, gmem, smem, pipes, sched, cta_v, prob)
        if warp_idx == roles.mma:
            cute.arch.setmaxregister_decrease(regs["other"])
            prob, sched = self._problem(mQ, mK, scale_log2, window, softcap_k, varlen)
            with record.role("mma"):
                tmem_alloc.allocate(plan.alloc_cols)
                _tmem_sync(tmem_bar)
                tmem = self._tmem_views(tmem_alloc, thr_mma_qk, thr_mma_pv, tP_layout)
                mma_role.mma(cfg, tiled_mma_qk, tiled_mma_pv, smem, tmem, pipes, prob, sched,
                             is_leader)
            tmem_alloc.relinquish_alloc_permit()
            _tmem_sync(tmem_bar, record_it=False)  # every TMEM user is done
            tmem_alloc.free(tmem.base, plan.alloc_cols)
        if warp_idx >= roles.softmax0[0] and warp_idx <= roles.softmax1[-1]:
            cute.arch.setmaxregister_increase(regs["softmax"])
            prob, sched = self._problem(mQ, mK, scale_log2, window, softcap_k, varlen)
            if warp_idx <= roles.softmax0[-1]:
                with record.role("softmax0"):
                    _tmem_sync(tmem_bar)
                    tmem = self._tmem_views(tmem_alloc, thr_mma_qk, thr_mma_pv, tP_layout)
                    softmax_role.softmax(cfg, 0, tmem, smem, pipes, prob, sched, cta_v)
            if warp_idx >= roles.softmax1[0]:
                with record.role("softmax1"):
                    _tmem_sync(tmem_bar)
                    # With one Q stage the warpgroup still exists (no warp id moves) and idles.
                    if cutlass.const_expr(cfg.q_stage == 2):
                        tmem = self._tmem_views(tmem_alloc, thr_mma_qk, thr_mma_pv, tP_layout)
                        softmax_role.softmax(cfg, 1, tmem, smem, pipes, prob, sched, cta_v)
            cute.arch.barrier_arrive(barrier_id=int(NamedBarrier.TMEM_ALLOC),
                                     number_of_threads=tmem_bar.num_threads, aligned=False)
        if warp_idx >= roles.correction[0] and warp_idx <= roles.correction[-1]:
            cute.arch.setmaxregister_decrease(regs["correction"])
            prob, sched = self._problem(mQ, mK, scale_log2, window, softcap_k, varlen)
            with record.role("correction"):
                _tmem_sync(tmem_bar)
                tmem = self._tmem_views(tmem_alloc, thr_mma_qk, thr_mma_pv, tP_layout)
                correction_role.correction(cfg, tmem, smem, gmem, pipes, prob, sched, cta_v)
            cute.arch.barrier_arrive(barrier_id=int(NamedBarrier.TMEM_ALLOC),
                                     number_of_threads=tmem_bar.num_threads, aligned=False)

    def _problem(self, mQ, mK, scale_log2, window, softcap_k, varlen=None):
        """Problem sizes and this cluster's scheduler, derived inside each role (from kernel
        parameters and special registers) rather than once before the dispatch: values
        computed there would stay live through every role, the 48-register ones included.
        ``varlen``: the packed sequences' tensors and the longest query sequence (each tile's
        own lengths: ``scheduler.tile_problem``)."""
        cfg = self.cfg
        seqlen_q, seqlen_k = mQ.shape[0], mK.shape[0]
        num_heads, batch = mQ.shape[2], mQ.shape[3]
        tensors = None
        if cutlass.const_expr(varlen is not None):
            seqlen_q, batch, tensors = varlen[-1], varlen[0].shape[0] - 1, varlen[:-1]
        num_m_blocks = (seqlen_q + rows_per_tile(cfg) - 1) // rows_per_tile(cfg)
        prob = Problem(seqlen_q=seqlen_q, seqlen_k=seqlen_k, num_heads=num_heads, batch=batch,
                       num_m_blocks=num_m_blocks, scale_log2=scale_log2, window=window,
                       softcap_k=softcap_k, varlen=tensors)
        return prob, make_scheduler(cfg, num_m_blocks, num_heads, batch,
                                    None if tensors is None else tensors[0])

    def _tmem_views(self, tmem_alloc, thr_mma_qk, thr_mma_pv, tP_layout) -> Tmem:
        """S_i, O_i and P_i placed at their TmemPlan offsets from the allocated base."""
        cfg, plan = self.cfg, self.tmem_plan
        base = tmem_alloc.retrieve_ptr(Float32)
        s_frag = thr_mma_qk.make_fragment_C(
            thr_mma_qk.partition_shape_C(cute_layouts.mma_tiler_qk(cfg)[:2]))
        o_frag = thr_mma_pv.make_fragment_C(
            thr_mma_pv.partition_shape_C(cute_layouts.mma_tiler_pv(cfg)[:2]))
        # P is 16-bit: its TMEM operand counts 16-bit halves of 32-bit columns.
        p_per_col = 4 // cfg.dtype_bytes
        p_frag = thr_mma_pv.make_fragment_A(
            cute.make_tensor(base, tP_layout.outer))[None, None, None, 0]
        tS = tuple(cute.make_tensor(base + plan.offset(f"S{i}"), s_frag.layout)
                   for i in range(cfg.q_stage))
        tO = tuple(cute.make_tensor(base + plan.offset(f"O{i}"), o_frag.layout)
                   for i in range(cfg.q_stage))
        tP = tuple(cute.make_tensor(p_frag.iterator + plan.offset(f"P{i}") * p_per_col,
                                    p_frag.layout) for i in range(cfg.q_stage))
        return Tmem(tS=tS, tO=tO, tP=tP, p_minus_s=plan.offset("P0") - plan.offset("S0"),
                    base=base)


def _tmem_sync(bar, record_it: bool = True):
    """bar.sync on the TMEM_ALLOC named barrier from warp-specialized (divergent) code: the
    MMA warp has allocated TMEM (first use) or every TMEM user is done (second use)."""
    from cutlass._mlir.dialects import nvvm

    if record_it:
        record.emit("named_sync", NamedBarrier.TMEM_ALLOC.name, threads=bar.num_threads)
    nvvm.barrier_cta_sync(Int32(bar.barrier_id).ir_value(),
                          thread_count=Int32(bar.num_threads).ir_value(), aligned=False)
