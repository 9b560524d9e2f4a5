"""The 16-warp SM100 backward kernel: host-side setup, shared storage and warp dispatch.

``Sm100Backward(cfg)`` is called (inside ``cute.compile``) with BSHD tensors Q, K, V, dO, the
preprocess's float32 rows LSE2 = LSE log2(e) and Delta = rowsum(O dO) (batch, heads,
seqlen_q rounded up to m_block; padding rows LSE2 = +inf, Delta = 0), the float32 dQ
accumulator (batch, heads, padded seqlen_q, head_dim), BSHD dK and dV (KV heads), the dQ
semaphores (deterministic configs, else None), the softmax scale, the softcap (read by a
capped config), the window's bounds (``bands.kernel_window``, read by a windowed config) and
a stream. One CTA per work tile (key block, KV head, batch); ``kernel`` sets up SMEM,
pipelines and TMEM and dispatches each warp to its role module:

    warps 0-7   bwd_compute.compute (two warpgroups: query columns 0-63 and 64-127)
    warps 8-11  bwd_dq.dq_out       warp 12  bwd_mma.mma       warp 14  bwd_load.load
    warps 13, 15  (empty)

dq is scale * the accumulator, converted by the postprocess; the kernel writes dK = scale *
sum dS^T Q and dV = sum P^T dO of its key block directly (GQA: summed over the group in TMEM).

``use_2cta`` (Note [Backward 2-CTA] in bwd_config.py): clusters of two CTAs (the grid's key
blocks rounded up to whole pairs), cta_group::2 MMAs and TMA copies, the pair's shared
storage with sQt / sdOt / sKt and the TMEM deallocation's handshake, the same warp dispatch.
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
from fa_sm100.bands import q_block_range, traced_bounds
from fa_sm100.sm100 import bwd_compute, bwd_dq, bwd_load, bwd_mma
from fa_sm100.sm100.bwd_config import STATS_ALIGN
from fa_sm100.sm100.context import BwdProblem, BwdSmem, BwdTmem
from fa_sm100.sm100.kernel import _tmem_sync
from layouts import cute_layouts
from layouts.smem import ALIGN
from layouts.tmem import TmemPlan
from pipelines import mbarrier, record
from pipelines.named_barriers import NamedBarrier, num_threads
from pipelines.spec import barrier_count

@dataclass(frozen=True)
class BwdTmaAtoms:
    """The TMA copy atoms; under 2-CTA also (atom, TMA view of the global tensor) of each
    MN-major B operand with a buffer of its own (Note [Backward 2-CTA]): Q^T, dO^T, K^T."""

    k: object
    v: object
    q: object
    do: object
    qt: object = None
    dot: object = None
    kt: object = None


class Sm100Backward:
    """One compiled SM100 backward main kernel per (validated) ``Sm100BwdConfig``."""

    def __init__(self, cfg):
        self.cfg = cfg.validate()
        self.roles = cfg.warp_roles()
        self.tmem_plan = TmemPlan.for_backward(cfg)
        self.tx = {name: cfg.tma_tiles()[name] for name in ("K", "V", "Q", "dO")}
        self.shared_bytes = None  # set while tracing

    # ------------------------------------------------------------------------------ host
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 mLSE2: cute.Tensor, mDelta: cute.Tensor, mdQacc: cute.Tensor,
                 mdK: cute.Tensor, mdV: cute.Tensor, mdQsem, softmax_scale: Float32,
                 softcap: Float32, window_left: Int32, window_right: Int32, stream):
        cfg = self.cfg
        sdhb = [1, 3, 2, 0]  # BSHD -> (s, d, h, b)
        mQ_s, mK_s, mV_s, mdO_s = [cute.make_tensor(t.iterator, cute.select(t.layout, mode=sdhb))
                                   for t in (mQ, mK, mV, mdO)]
        mmas = cute_layouts.make_bwd_tiled_mmas(cfg)
        lay = cute_layouts.make_bwd_smem_layouts(cfg, mmas)
        tilers = cute_layouts.bwd_tilers(cfg)
        # 2-CTA: each CTA loads its part of the pair's operands; the copies complete the
        # leader's barrier
        op = cpasync.CopyBulkTensorTileG2SOp(
            tcgen05.CtaGroup.TWO if cfg.use_2cta else tcgen05.CtaGroup.ONE)
        vmnk = cute.tiled_divide(cute.make_layout(cfg.cluster_shape),
                                 (mmas.S.thr_id.shape,)).shape
        tma_k, mK_t = cute.nvgpu.make_tiled_tma_atom_A(op, mK_s, lay.sK, tilers["S"], mmas.S, vmnk)
        tma_v, mV_t = cute.nvgpu.make_tiled_tma_atom_A(op, mV_s, lay.sV, tilers["dP"], mmas.dP,
                                                       vmnk)
        tma_q, mQ_t = cute.nvgpu.make_tiled_tma_atom_B(
            op, mQ_s, cute.select(lay.sQ, mode=[0, 1, 2]), tilers["S"], mmas.S, vmnk)
        tma_do, mdO_t = cute.nvgpu.make_tiled_tma_atom_B(
            op, mdO_s, cute.select(lay.sdO, mode=[0, 1, 2]), tilers["dP"], mmas.dP, vmnk)
        atoms = BwdTmaAtoms(k=tma_k, v=tma_v, q=tma_q, do=tma_do)
        if cutlass.const_expr(cfg.use_2cta):
            dshb = [3, 1, 2, 0]  # BSHD -> (d, s, h, b): the MN-major B operands' view
            mQt_s, mdOt_s, mKt_s = [
                cute.make_tensor(t.iterator, cute.select(t.layout, mode=dshb))
                for t in (mQ, mdO, mK)]
            atoms = BwdTmaAtoms(
                k=tma_k, v=tma_v, q=tma_q, do=tma_do,
                qt=cute.nvgpu.make_tiled_tma_atom_B(
                    op, mQt_s, cute.select(lay.sQt, mode=[0, 1, 2]), tilers["dK"], mmas.dK,
                    vmnk),
                dot=cute.nvgpu.make_tiled_tma_atom_B(
                    op, mdOt_s, cute.select(lay.sdOt, mode=[0, 1, 2]), tilers["dV"], mmas.dV,
                    vmnk),
                kt=cute.nvgpu.make_tiled_tma_atom_B(op, mKt_s, lay.sKt, tilers["dQ"], mmas.dQ,
                                                    vmnk))

        dtype = cute_layouts.cutlass_dtype(cfg.dtype)
        n_bars = barrier_count(cfg)
        stats = cfg.m_block * cfg.q_stage

        pair = cfg.use_2cta

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[Int64, n_bars]  # every pipeline's full/empty barriers
            if cutlass.const_expr(pair):  # TmemAllocator's pair handshake before the dealloc
                tmem_dealloc_mbar: Int64  # (Note [Backward 2-CTA])
            tmem_base: Int32
            sLSE2: cute.struct.Align[cute.struct.MemRange[Float32, stats], STATS_ALIGN]
            sDelta: cute.struct.Align[cute.struct.MemRange[Float32, stats], STATS_ALIGN]
            sK: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(lay.sK)], ALIGN]
            sV: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(lay.sV)], ALIGN]
            sQ: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(lay.sQ)], ALIGN]
            sdO: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(lay.sdO)], ALIGN]
            sdS: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(lay.sdS)], ALIGN]
            if cutlass.const_expr(pair):  # Q^T, dO^T and K^T in buffers of their own
                sQt: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(lay.sQt)], ALIGN]
                sdOt: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(lay.sdOt)], ALIGN]
                sKt: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(lay.sKt)], ALIGN]

        self.shared_storage = SharedStorage
        self.shared_bytes = self.shared_storage.size_in_bytes()
        if cutlass.const_expr(self.shared_bytes != cfg.smem_bytes()):
            raise ValueError(f"SMEM: the backward's shared storage takes {self.shared_bytes} "
                             f"bytes, its config's model {cfg.smem_bytes()}")
        scale_log2 = softmax_scale * Float32(softmax_math.LOG2_E)
        softcap_k = None  # fa_sm100.softmax_math: t = tanh(raw S * softcap_k), P from c t
        if cutlass.const_expr(cfg.softcap):
            softcap_k = softmax_scale / softcap
            scale_log2 = softcap * Float32(softmax_math.LOG2_E)
        window = None  # only a windowed kernel takes the bounds as parameters
        if cutlass.const_expr(cfg.is_local):
            window = (window_left, window_right)
        n_blocks = (mK.shape[1] + cfg.n_block - 1) // cfg.n_block
        cluster = None
        if cutlass.const_expr(cfg.use_2cta):  # whole pairs: an odd count's last CTA has no key
            n_blocks = (n_blocks + cfg.cta_group - 1) // cfg.cta_group * cfg.cta_group
            cluster = list(cfg.cluster_shape)
        self.kernel(mQ_t, mK_t, mV_t, mdO_t, mLSE2, mDelta, mdQacc, mdK, mdV, mdQsem,
                    atoms, scale_log2, softmax_scale, window, softcap_k, lay, mmas).launch(
            grid=[n_blocks, mK.shape[2], mK.shape[0]],
            block=[self.roles.threads_per_cta, 1, 1],
            cluster=cluster,
            stream=stream,
            min_blocks_per_mp=1,
        )

    # ---------------------------------------------------------------------------- device
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
               mLSE2: cute.Tensor, mDelta: cute.Tensor, mdQacc: cute.Tensor, mdK: cute.Tensor,
               mdV: cute.Tensor, mdQsem, atoms: BwdTmaAtoms, scale_log2: Float32,
               softmax_scale: Float32, window, softcap_k, lay: cute_layouts.BwdSmemLayouts,
               mmas: cute_layouts.BwdMmas):
        cfg, roles = self.cfg, self.roles
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == roles.load:
            for atom in (atoms.k, atoms.v, atoms.q, atoms.do):
                cpasync.prefetch_descriptor(atom)
            if cutlass.const_expr(cfg.use_2cta):
                for atom_view in (atoms.qt, atoms.dot, atoms.kt):
                    cpasync.prefetch_descriptor(atom_view[0])
        storage = cutlass_utils.SmemAllocator().allocate(self.shared_storage)
        pipes = mbarrier.build_pipelines(cfg, roles, storage.mbar.data_ptr())
        smem = self._smem(storage, lay)
        tmem_bar = cpipe.NamedBarrier(barrier_id=int(NamedBarrier.TMEM_ALLOC),
                                      num_threads=num_threads(NamedBarrier.TMEM_ALLOC, roles))
        if cutlass.const_expr(cfg.use_2cta):
            tmem_alloc = TmemAllocator(
                storage.tmem_base.ptr, barrier_for_retrieve=tmem_bar,
                allocator_warp_id=roles.mma, is_two_cta=True,
                two_cta_tmem_dealloc_mbar_ptr=storage.tmem_dealloc_mbar.ptr)
        else:
            tmem_alloc = TmemAllocator(storage.tmem_base.ptr, barrier_for_retrieve=tmem_bar,
                                       allocator_warp_id=roles.mma)
        mbarrier.pipeline_init_sync(cfg)

        regs = roles.setmaxnreg()
        if warp_idx == roles.empty[0] or warp_idx == roles.empty[1]:
            cute.arch.setmaxregister_decrease(regs["other"])
        if warp_idx == roles.load:
            cute.arch.setmaxregister_decrease(regs["other"])
            prob = self._problem(mQ, mK, scale_log2, softmax_scale, window, softcap_k)
            with record.role("load"):
                bwd_load.load(cfg, atoms, self.tx, mQ, mK, mV, mdO, mLSE2, mDelta, smem, mmas,
                              pipes, prob)
        if warp_idx == roles.mma:
            cute.arch.setmaxregister_decrease(regs["other"])
            prob = self._problem(mQ, mK, scale_log2, softmax_scale, window, softcap_k)
            with record.role("mma"):
                tmem_alloc.allocate(self.tmem_plan.alloc_cols)
                _tmem_sync(tmem_bar)
                tmem = self._tmem_views(tmem_alloc, mmas, lay)
                bwd_mma.mma(cfg, mmas, smem, tmem, pipes, prob)
            tmem_alloc.relinquish_alloc_permit()
            _tmem_sync(tmem_bar, record_it=False)  # every TMEM user is done
            tmem_alloc.free(tmem_alloc.retrieve_ptr(Float32), self.tmem_plan.alloc_cols)
        if warp_idx <= roles.compute[-1]:
            cute.arch.setmaxregister_increase(regs["compute"])
            prob = self._problem(mQ, mK, scale_log2, softmax_scale, window, softcap_k)
            with record.role("compute"):
                _tmem_sync(tmem_bar)
                tmem = self._tmem_views(tmem_alloc, mmas, lay)
                bwd_compute.compute(cfg, tmem, smem, mdK, mdV, pipes, prob)
            cute.arch.barrier_arrive(barrier_id=int(NamedBarrier.TMEM_ALLOC),
                                     number_of_threads=tmem_bar.num_threads, aligned=False)
        if warp_idx >= roles.dq[0] and warp_idx <= roles.dq[-1]:
            cute.arch.setmaxregister_decrease(regs["dq"])
            prob = self._problem(mQ, mK, scale_log2, softmax_scale, window, softcap_k)
            with record.role("dq"):
                _tmem_sync(tmem_bar)
                tmem = self._tmem_views(tmem_alloc, mmas, lay)
                bwd_dq.dq_out(cfg, tmem, mdQacc, mdQsem, pipes, prob)
            cute.arch.barrier_arrive(barrier_id=int(NamedBarrier.TMEM_ALLOC),
                                     number_of_threads=tmem_bar.num_threads, aligned=False)

    def _smem(self, storage, lay) -> BwdSmem:
        """Every SMEM view; sQt / sdOt / sKt reread sQ / sdO / sK's bytes in the other major
        mode (layouts/cute_layouts.py: the two layouts agree element by element), or under
        2-CTA are buffers of their own."""
        dtype = cute_layouts.cutlass_dtype(self.cfg.dtype)

        def view(buf, layout):
            return buf.get_tensor(layout.outer, swizzle=layout.inner)

        def alias(t, layout):
            return cute.make_tensor(cute.recast_ptr(t.iterator, layout.inner, dtype=dtype),
                                    layout.outer)

        sK, sQ, sdO = view(storage.sK, lay.sK), view(storage.sQ, lay.sQ), view(storage.sdO, lay.sdO)
        stats = cute.make_layout((self.cfg.m_block, self.cfg.q_stage))
        if cutlass.const_expr(self.cfg.use_2cta):
            sQt, sdOt, sKt = (view(storage.sQt, lay.sQt), view(storage.sdOt, lay.sdOt),
                              view(storage.sKt, lay.sKt))
        else:
            sQt, sdOt, sKt = alias(sQ, lay.sQt), alias(sdO, lay.sdOt), alias(sK, lay.sKt)
        return BwdSmem(sK=sK, sV=view(storage.sV, lay.sV), sQ=sQ, sQt=sQt, sdO=sdO, sdOt=sdOt,
                       sKt=sKt, sdS=view(storage.sdS, lay.sdS),
                       sLSE2=storage.sLSE2.get_tensor(stats),
                       sDelta=storage.sDelta.get_tensor(stats))

    def _problem(self, mQ, mK, scale_log2, softmax_scale, window, softcap_k) -> BwdProblem:
        """This CTA's work tile (derived inside each role, as the forward does: values
        computed before the dispatch would stay live in every role's registers): the query
        blocks whose band reaches the key block (``bands.q_block_range`` with a window), so
        the work scales with the band; none when no row sees one of its keys."""
        cfg = self.cfg
        n_block, head_kv, batch = cute.arch.block_idx()
        seqlen_q, seqlen_k = mQ.shape[0], mK.shape[0]
        m_max = (seqlen_q + cfg.m_block - 1) // cfg.m_block
        m_min = Int32(0)
        if cutlass.const_expr(cfg.use_2cta):
            # the pair walks the query blocks its 2 n_block keys reach (Note [Backward
            # 2-CTA]): in a block one CTA's keys do not reach, its scores are masked
            keys = cfg.cta_group * cfg.n_block
            pair_key = n_block // cfg.cta_group * keys
            if cutlass.const_expr(cfg.is_local):
                left, right = traced_bounds(cfg, window)
                m_min, m_hi = q_block_range(pair_key, keys, cfg.m_block, seqlen_q,
                                            seqlen_k, left, right, imax=cutlass.max,
                                            imin=cutlass.min)
                m_max = cutlass.max(m_hi, m_min)
            elif cutlass.const_expr(cfg.causal):
                m_min = cutlass.max(pair_key - (seqlen_k - seqlen_q), 0) // cfg.m_block
        elif cutlass.const_expr(cfg.is_local):
            left, right = traced_bounds(cfg, window)
            m_min, m_hi = q_block_range(n_block * cfg.n_block, cfg.n_block, cfg.m_block,
                                        seqlen_q, seqlen_k, left, right, imax=cutlass.max,
                                        imin=cutlass.min)
            m_max = cutlass.max(m_hi, m_min)  # an empty range: no step
        elif cutlass.const_expr(cfg.causal):
            # bottom-right: row r sees key c iff c <= r + seqlen_k - seqlen_q, so the first row
            # that sees this block's first key is n_block * n_block_size - (seqlen_k - seqlen_q)
            first_row = n_block * cfg.n_block - (seqlen_k - seqlen_q)
            m_min = cutlass.max(first_row, 0) // cfg.m_block
        iters = cutlass.max(m_max - m_min, 0) * cfg.qhead_per_kvhead
        return BwdProblem(seqlen_q=seqlen_q, seqlen_k=seqlen_k, n_block=n_block, head_kv=head_kv,
                          batch=batch, m_min=m_min, m_max=m_max, iters=iters,
                          scale_log2=scale_log2, softmax_scale=softmax_scale, window=window,
                          softcap_k=softcap_k)

    def _tmem_views(self, tmem_alloc, mmas, lay) -> BwdTmem:
        """Each accumulator at its plan offset, as its MMA writes it (every CTA of a pair
        holds its own part at the same columns); under 2-CTA ``tdQ_lanes`` is dQ as the lanes
        and columns the dQ warps read (the (64 rows, head_dim) of the CTA folded into 128
        lanes x head_dim / 2, TmemPlan.for_backward)."""
        cfg, plan = self.cfg, self.tmem_plan
        base = tmem_alloc.retrieve_ptr(Float32)
        t = cute_layouts.bwd_tilers(cfg)

        def acc(mma, name, region):
            thr = mma.get_slice(0)
            frag = thr.make_fragment_C(thr.partition_shape_C(t[name][:2]))
            return cute.make_tensor(base + plan.offset(region), frag.layout)

        per_col = 4 // cfg.dtype_bytes  # 16-bit operands: two per 32-bit column

        def a_operand(mma, layout, region_prefix):
            frag = mma.get_slice(0).make_fragment_A(cute.make_tensor(base, layout.outer))
            frag = frag[None, None, None, 0] if cute.rank(frag) == 4 else frag
            halves = []
            for h in range(2):
                # k-block k of warpgroup h's half sits at column offset(prefix h) + 8 (k - 4h)
                col = plan.offset(f"{region_prefix}{h}") - h * cfg.m_block // 4
                halves.append(cute.make_tensor(frag.iterator + col * per_col, frag.layout))
            return tuple(halves)

        tdQ = acc(mmas.dQ, "dQ", "dQ")
        tdQ_lanes = None
        if cutlass.const_expr(cfg.use_2cta):
            # the fragment is (64 rows, (d / 2 columns, 2 halves)); the half moves 64 lanes
            rows = tdQ[(None, None), 0, 0].layout
            tdQ_lanes = cute.make_tensor(tdQ.iterator, cute.make_layout(
                ((rows.shape[0], cfg.cta_group), cfg.head_dim // cfg.cta_group),
                stride=((rows.stride[0], rows.stride[1][1]), rows.stride[1][0])))
        return BwdTmem(tS=acc(mmas.S, "S", "S"), tdP=acc(mmas.dP, "dP", "dP"),
                       tdV=acc(mmas.dV, "dV", "dV"), tdK=acc(mmas.dK, "dK", "dK"),
                       tdQ=tdQ, tP=a_operand(mmas.dV, lay.tP, "P"),
                       tdS=a_operand(mmas.dK, lay.tdS, "dS"), plan=plan, tdQ_lanes=tdQ_lanes)
