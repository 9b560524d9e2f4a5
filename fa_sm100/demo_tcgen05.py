"""A one-tile tcgen05 GEMM: the project's smallest SM100 kernel, used to prove the inspect tool.

C[M, N] = A[M, K] . B[N, K]^T for a single tile, in float32, with the Blackwell data path the
forward kernel uses: TMA loads A and B into SMEM, one elected thread issues tcgen05.mma into
TMEM, the epilogue warpgroup reads the accumulator back with tcgen05.ld and stores it to GMEM.

``DemoConfig.use_2cta`` picks the MMA flavour:

- 1-CTA (cta_group::1): one CTA, M = 128 rows, the whole N x K tile of B in its SMEM;
- 2-CTA (cta_group::2): a cluster of two CTAs issues one M = 256 MMA; each CTA loads its own
  128 rows of A and half of B's N rows, the even (leader) CTA issues the MMA for the pair and
  each CTA's TMEM receives its 128 rows of C.

Warp roles (256 threads, two warpgroups because setmaxnreg acts per warpgroup):

====== =========== ==========================================================================
warps  role        does
====== =========== ==========================================================================
0-3    epilogue    wait for the accumulator, TMEM -> registers (tcgen05.ld) -> GMEM
4      load        TMA loads of this CTA's A and B tiles
5      mma         allocates TMEM, issues the MMAs (leader CTA), commits to the epilogue
6-7    (idle)      pad warpgroup 1 so that setmaxnreg can hand its registers to warpgroup 0
====== =========== ==========================================================================

Protocol: ``load`` (TMA -> MMA, one stage, transaction-counted on the leader CTA) and ``acc``
(MMA -> epilogue; the commit multicasts to both CTAs of the pair). TMEM is allocated by the
MMA warp (cta_group::2 under 2-CTA, so the pair allocates together); the epilogue learns the
address through the named barrier ``DemoBarrier.TMEM_ALLOC``; after a cluster-wide barrier the
MMA warp frees the columns.

It is compiled for sm_100a (``tests/test_inspect_demo.py`` checks the compiled code) and
emulated: ``tests/test_inspect_emulated.py`` runs its PTX on the project's PTX emulator. It has
never run on hardware (no SM100 GPU here).
"""

import enum
from dataclasses import dataclass

from fa_sm100.compile_tools import prepare_arch_env
from fa_sm100.config import (
    WARP_SIZE,
    CtaPairShape,
    check_setmaxnreg,
    cutlass_dtype,
    normalize_dtype,
    parse_overrides,
)
from fa_sm100.registry import KernelBuild, KernelEntry
from layouts.smem import ALIGN, align_up

ROWS_PER_CTA = 128  # M of the tile per CTA = TMEM lanes
K_ATOM = 64  # one 128-byte swizzle atom of a 16-bit type
WARPS = 8
EPILOGUE_WARPS = (0, 1, 2, 3)
LOAD_WARP = 4
MMA_WARP = 5
PRODUCER_WARPS = (4, 5, 6, 7)  # warpgroup 1: load, mma and the two idle warps
SMEM_ALIGN = ALIGN


class DemoBarrier(enum.IntEnum):
    """Named barriers of the demo (0 is __syncthreads)."""

    TMEM_ALLOC = 1  # MMA warp (arrive) -> epilogue warps (sync): the TMEM address is written


@dataclass(frozen=True)
class DemoConfig(CtaPairShape):
    use_2cta: bool = True
    n: int = 128  # N of the tile = accumulator columns in TMEM
    k: int = 64  # K of the tile
    dtype: str = "bfloat16"
    regs_epilogue: int = 232  # setmaxnreg of warpgroup 0 (epilogue)
    regs_producer: int = 40  # setmaxnreg of warpgroup 1 (load, mma, idle)

    @property
    def threads(self) -> int:
        return WARPS * WARP_SIZE

    @property
    def tmem_cols(self) -> int:
        """float32 accumulator: one TMEM column per N column (n is a power of two >= 32)."""
        return self.n

    @property
    def a_bytes(self) -> int:
        return ROWS_PER_CTA * self.k * 2

    @property
    def b_bytes(self) -> int:
        """This CTA's share of B: under 2-CTA each CTA of the pair holds n / 2 rows."""
        return self.n // self.cta_group * self.k * 2

    @property
    def smem_bytes(self) -> int:
        """Shared storage per CTA: 4 mbarriers + the TMEM address word, then sA and sB, each
        1024-byte aligned (the struct the kernel allocates; a test checks the traced size)."""
        head = 4 * 8 + 4
        return align_up(head) + align_up(self.a_bytes) + align_up(self.b_bytes)

    def validate(self) -> "DemoConfig":
        if normalize_dtype(self.dtype) != self.dtype:
            raise ValueError(f"dtype={self.dtype!r}: spell it {normalize_dtype(self.dtype)!r}")
        if self.n not in (64, 128, 256):
            raise ValueError(f"n={self.n}: the demo tile's N must be 64, 128 or 256")
        if self.k % K_ATOM or not K_ATOM <= self.k <= 256:
            raise ValueError(f"k={self.k}: must be a multiple of {K_ATOM} in [{K_ATOM}, 256]")
        for name in ("regs_epilogue", "regs_producer"):
            check_setmaxnreg(name, getattr(self, name))
        return self


def make_config(overrides=()) -> DemoConfig:
    """DemoConfig with ``--set field=value`` overrides applied, validated."""
    changes = parse_overrides(overrides, cls=DemoConfig)
    return DemoConfig(**changes).validate()


def _make_demo_class():
    """Define the kernel class; imports CuTe DSL, so only called when a build is requested."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.pipeline as pipeline
    import cutlass.memory as cutlass_memory
    import cutlass.utils.blackwell_helpers as bw
    from cutlass.cute.nvgpu import cpasync, tcgen05

    class Tcgen05Demo:
        def __init__(self, cfg: DemoConfig):
            self.cfg = cfg.validate()
            self.ab_dtype = cutlass_dtype(cfg.dtype)
            self.cta_group = tcgen05.CtaGroup.TWO if cfg.use_2cta else tcgen05.CtaGroup.ONE
            self.mma_tiler = (ROWS_PER_CTA * cfg.cta_group, cfg.n, cfg.k)
            self.traced_smem_bytes = None  # set while tracing; tests compare with cfg.smem_bytes

        @cute.jit
        def __call__(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, stream):
            cfg = self.cfg
            mma_op = tcgen05.MmaF16BF16Op(
                self.ab_dtype, cutlass.Float32, (self.mma_tiler[0], cfg.n, 16), self.cta_group,
                tcgen05.OperandSource.SMEM, cute.nvgpu.OperandMajorMode.K,
                cute.nvgpu.OperandMajorMode.K,
            )
            tiled_mma = cute.make_tiled_mma(mma_op)
            a_smem = bw.make_smem_layout_a(tiled_mma, self.mma_tiler, self.ab_dtype, 1)
            b_smem = bw.make_smem_layout_b(tiled_mma, self.mma_tiler, self.ab_dtype, 1)
            # (V, M, N, L) view of the cluster: V = the CTAs that issue one MMA together.
            cluster_vmnk = cute.tiled_divide(
                cute.make_layout(cfg.cluster_shape), (tiled_mma.thr_id.shape,)
            )
            tma_op = cpasync.CopyBulkTensorTileG2SOp(self.cta_group)
            tma_a, tma_tensor_a = cute.nvgpu.make_tiled_tma_atom_A(
                tma_op, a, cute.select(a_smem, mode=[0, 1, 2]), self.mma_tiler, tiled_mma,
                cluster_vmnk.shape,
            )
            tma_b, tma_tensor_b = cute.nvgpu.make_tiled_tma_atom_B(
                tma_op, b, cute.select(b_smem, mode=[0, 1, 2]), self.mma_tiler, tiled_mma,
                cluster_vmnk.shape,
            )

            @cute.struct
            class SharedStorage:
                load_mbar: cute.struct.MemRange[cutlass.Int64, 2]  # full, empty
                acc_mbar: cute.struct.MemRange[cutlass.Int64, 2]
                tmem_holder: cutlass.Int32  # TMEM address written by tcgen05.alloc
                sA: cute.struct.Align[
                    cute.struct.MemRange[self.ab_dtype, cute.cosize(a_smem)], SMEM_ALIGN
                ]
                sB: cute.struct.Align[
                    cute.struct.MemRange[self.ab_dtype, cute.cosize(b_smem)], SMEM_ALIGN
                ]

            self.shared_storage = SharedStorage
            self.traced_smem_bytes = SharedStorage.size_in_bytes()
            self.kernel(tiled_mma, tma_a, tma_tensor_a, tma_b, tma_tensor_b, c, a_smem, b_smem,
                        cluster_vmnk).launch(
                grid=cfg.cluster_shape, block=(cfg.threads, 1, 1), cluster=cfg.cluster_shape,
                smem=SharedStorage.size_in_bytes(), stream=stream, min_blocks_per_mp=1,
            )

        @cute.kernel
        def kernel(self, tiled_mma: cute.TiledMma, tma_a: cute.CopyAtom, mA: cute.Tensor,
                   tma_b: cute.CopyAtom, mB: cute.Tensor, mC: cute.Tensor,
                   a_smem: cute.ComposedLayout, b_smem: cute.ComposedLayout,
                   cluster_vmnk: cute.Layout):
            """Sets up shared storage, the two pipelines and the partitions, then dispatches
            each warp to its role: ``load``, ``mma`` or ``epilogue`` (warps 6-7 only take part
            in setmaxnreg and the final barrier). Frees TMEM at the end."""
            cfg = self.cfg
            tidx, _, _ = cute.arch.thread_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
            mma_v = cta_rank % cfg.cta_group  # this CTA's half of the pair (0 = leader)
            two_cta = cfg.use_2cta

            smem = cutlass_memory.SmemAllocator()
            storage = smem.allocate(self.shared_storage)
            sA = storage.sA.get_tensor(a_smem.outer, swizzle=a_smem.inner)  # (MMA, MMA_M, MMA_K, 1)
            sB = storage.sB.get_tensor(b_smem.outer, swizzle=b_smem.inner)  # (MMA, MMA_N, MMA_K, 1)

            if warp == LOAD_WARP:
                cpasync.prefetch_descriptor(tma_a)
                cpasync.prefetch_descriptor(tma_b)

            thread = pipeline.CooperativeGroup(pipeline.Agent.Thread)
            load_producer, load_consumer = pipeline.PipelineTmaUmma.create(
                num_stages=1, producer_group=thread, consumer_group=thread,
                tx_count=(cfg.a_bytes + cfg.b_bytes) * cfg.cta_group,
                barrier_storage=storage.load_mbar.data_ptr(), cta_layout_vmnk=cluster_vmnk,
            ).make_participants()[:2]
            acc_producer, acc_consumer = pipeline.PipelineUmmaAsync.create(
                num_stages=1, producer_group=thread,
                consumer_group=pipeline.CooperativeGroup(
                    pipeline.Agent.Thread, len(EPILOGUE_WARPS) * WARP_SIZE * cfg.cta_group
                ),
                barrier_storage=storage.acc_mbar.data_ptr(), cta_layout_vmnk=cluster_vmnk,
            ).make_participants()[:2]

            # Global tiles of the pair, then this CTA's MMA partition of them.
            gA = cute.local_tile(mA, self.mma_tiler, (0, 0, None), proj=(1, None, 1))  # (bM, bK, 1)
            gB = cute.local_tile(mB, self.mma_tiler, (0, 0, None), proj=(None, 1, 1))  # (bN, bK, 1)
            gC = cute.local_tile(mC, self.mma_tiler, (0, 0, None), proj=(1, 1, None))  # (bM, bN)
            thr_mma = tiled_mma.get_slice(mma_v)
            tCgA = thr_mma.partition_A(gA)  # (MMA, MMA_M, MMA_K, 1)
            tCgB = thr_mma.partition_B(gB)  # (MMA, MMA_N, MMA_K, 1)
            tCgC = thr_mma.partition_C(gC)  # (MMA, MMA_M, MMA_N)
            tCrA = tiled_mma.make_fragment_A(sA)  # (MMA, MMA_M, MMA_K, 1)
            tCrB = tiled_mma.make_fragment_B(sB)  # (MMA, MMA_N, MMA_K, 1)
            acc_layout = tiled_mma.make_fragment_C(
                tiled_mma.partition_shape_C(self.mma_tiler[:2])
            ).layout  # (MMA, MMA_M, MMA_N) in TMEM
            # No multicast: each CTA loads its own slice, so the TMA CTA layout is trivial.
            tAsA, tAgA = cpasync.tma_partition(
                tma_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 3),
                cute.group_modes(tCgA, 0, 3),
            )
            tBsB, tBgB = cpasync.tma_partition(
                tma_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 3),
                cute.group_modes(tCgB, 0, 3),
            )

            if warp // 4 == PRODUCER_WARPS[0] // 4:
                cute.arch.setmaxregister_decrease(cfg.regs_producer)
            else:
                cute.arch.setmaxregister_increase(cfg.regs_epilogue)

            tmem_holder = storage.tmem_holder.ptr
            if warp == LOAD_WARP:
                self.load(load_producer, tma_a, tAgA, tAsA, tma_b, tBgB, tBsB)
            if warp == MMA_WARP:
                self.mma(tiled_mma, tCrA, tCrB, acc_layout, tmem_holder, load_consumer,
                         acc_producer, mma_v)
            if warp < len(EPILOGUE_WARPS):
                self.epilogue(acc_layout, tCgC, tmem_holder, acc_consumer, tidx)

            # Every thread of the cluster is done with TMEM before it is freed.
            if cutlass.const_expr(two_cta):
                cute.arch.cluster_arrive()
                cute.arch.cluster_wait()
            else:
                cute.arch.sync_threads()
            if warp == MMA_WARP:
                tmem_ptr = cute.arch.retrieve_tmem_ptr(cutlass.Float32, 16, tmem_holder)
                cute.arch.dealloc_tmem(tmem_ptr, cfg.tmem_cols, is_two_cta=two_cta)

        @cute.jit
        def load(self, load_producer, tma_a: cute.CopyAtom, tAgA: cute.Tensor, tAsA: cute.Tensor,
                 tma_b: cute.CopyAtom, tBgB: cute.Tensor, tBsB: cute.Tensor):
            """Load warp. Produces: this CTA's A and B tiles in SMEM (one ``load`` stage,
            completion counted in bytes on the leader CTA's full barrier)."""
            stage = load_producer.acquire_and_advance()
            cute.copy(tma_a, tAgA[(None, 0)], tAsA[(None, 0)], tma_bar_ptr=stage.barrier)
            cute.copy(tma_b, tBgB[(None, 0)], tBsB[(None, 0)], tma_bar_ptr=stage.barrier)

        @cute.jit
        def mma(self, tiled_mma: cute.TiledMma, tCrA: cute.Tensor, tCrB: cute.Tensor,
                acc_layout: cute.Layout, tmem_holder: cute.Pointer, load_consumer, acc_producer,
                mma_v: cutlass.Int32):
            """MMA warp. Allocates TMEM (the pair together under 2-CTA) and publishes its
            address to the epilogue (named barrier TMEM_ALLOC). On the leader CTA: consumes the
            ``load`` stage, issues the K/16 MMAs of C = A B^T into TMEM, releases the stage and
            commits the accumulator to ``acc`` (multicast to both CTAs of the pair)."""
            cfg = self.cfg
            cute.arch.alloc_tmem(cfg.tmem_cols, tmem_holder, is_two_cta=cfg.use_2cta)
            cute.arch.relinquish_tmem_alloc_permit(is_two_cta=cfg.use_2cta)
            cute.arch.barrier_arrive(barrier_id=int(DemoBarrier.TMEM_ALLOC),
                                     number_of_threads=(len(EPILOGUE_WARPS) + 1) * WARP_SIZE)
            tmem_ptr = cute.arch.retrieve_tmem_ptr(cutlass.Float32, 16, tmem_holder)
            tCtAcc = cute.make_tensor(tmem_ptr, acc_layout)  # (MMA, MMA_M, MMA_N)
            if mma_v == 0:
                acc_stage = acc_producer.acquire_and_advance()
                loaded = load_consumer.wait_and_advance()
                for kb in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
                    tiled_mma.set(tcgen05.Field.ACCUMULATE, kb != 0)
                    cute.gemm(tiled_mma, tCtAcc, tCrA[(None, None, kb, 0)],
                              tCrB[(None, None, kb, 0)], tCtAcc)
                loaded.release()
                acc_stage.commit()

        @cute.jit
        def epilogue(self, acc_layout: cute.Layout, tCgC: cute.Tensor, tmem_holder: cute.Pointer,
                     acc_consumer, tidx: cutlass.Int32):
            """Epilogue warpgroup (thread t owns TMEM lane t). Consumes the ``acc`` stage:
            TMEM -> registers (tcgen05.ld, 32 columns per load) -> GMEM, then releases it."""
            cute.arch.barrier(barrier_id=int(DemoBarrier.TMEM_ALLOC),
                              number_of_threads=(len(EPILOGUE_WARPS) + 1) * WARP_SIZE)
            tmem_ptr = cute.arch.retrieve_tmem_ptr(cutlass.Float32, 16, tmem_holder)
            tCtAcc = cute.make_tensor(tmem_ptr, acc_layout)  # (MMA, MMA_M, MMA_N)
            sub = ((cute.size(tCtAcc, mode=[0, 0]), 32),)  # (128 lanes, 32 columns) per copy
            tAcc_sub = cute.zipped_divide(tCtAcc, sub)  # (SUB, NUM_SUB)
            gC_sub = cute.zipped_divide(tCgC, sub)  # (SUB, NUM_SUB)
            ld_atom = cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition.x32),
                                          cutlass.Float32)
            tmem_copy = tcgen05.make_tmem_copy(ld_atom, tAcc_sub[None, 0])
            thr_copy = tmem_copy.get_slice(tidx)
            tTR_tAcc = thr_copy.partition_S(tAcc_sub)  # (CPY, CPY_M, NUM_SUB)
            tTR_gC = thr_copy.partition_D(gC_sub)  # (CPY, CPY_M, NUM_SUB)
            frag = cute.make_rmem_tensor(tTR_gC[None, None, 0].shape, cutlass.Float32)
            acc_ready = acc_consumer.wait_and_advance()
            for i in cutlass.range_constexpr(cute.size(tTR_tAcc, mode=[2])):
                cute.copy(tmem_copy, tTR_tAcc[None, None, i], frag)
                # tcgen05.ld is asynchronous: its registers are defined only after
                # tcgen05.wait::ld (the PTX emulator reports a read before the wait).
                cute.arch.fence_view_async_tmem_load()
                cute.autovec_copy(frag, tTR_gC[None, None, i])
            acc_ready.release()

    return Tcgen05Demo


_DEMO_CLASS = None


def make_kernel(cfg: DemoConfig):
    """A Tcgen05Demo instance for ``cfg`` (imports CuTe DSL)."""
    global _DEMO_CLASS
    if _DEMO_CLASS is None:
        _DEMO_CLASS = _make_demo_class()
    return _DEMO_CLASS(cfg)


def fake_args(cfg: DemoConfig):
    """Fake A (M x K), B (N x K), C (M x N) for a cross-compile: K-major A and B, row-major C."""
    import cutlass
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    dtype = cutlass_dtype(cfg.dtype)
    m = ROWS_PER_CTA * cfg.cta_group
    a = make_fake_compact_tensor(dtype, (m, cfg.k), stride_order=(1, 0), assumed_align=16)
    b = make_fake_compact_tensor(dtype, (cfg.n, cfg.k), stride_order=(1, 0), assumed_align=16)
    c = make_fake_compact_tensor(cutlass.Float32, (m, cfg.n), stride_order=(1, 0),
                                 assumed_align=16)
    return a, b, c, make_fake_stream()


def build(cfg: DemoConfig, arch: str = "sm_100a") -> KernelBuild:
    if arch != "sm_100a":
        raise ValueError(f"tcgen05_demo uses tcgen05 (sm_100a only), not {arch}")
    prepare_arch_env(arch)
    return KernelBuild(
        fn=make_kernel(cfg),
        args=fake_args(cfg),
        arch=arch,
        config=cfg,
        smem_bytes=cfg.smem_bytes,
        tmem_cols=cfg.tmem_cols,
        setmaxnreg={"epilogue": cfg.regs_epilogue, "producer": cfg.regs_producer},
        setmaxnreg_warps={"epilogue": EPILOGUE_WARPS, "producer": PRODUCER_WARPS},
        cluster=cfg.cluster_shape,
    )


KERNEL = KernelEntry(name="tcgen05_demo", archs=("sm_100a",), make_config=make_config,
                     build=build)
