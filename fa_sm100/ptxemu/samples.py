"""Small CuTe-DSL kernels of our own, one per instruction family, for the PTX emulator's tests.

Each ``*_host`` function is the ``@cute.jit`` host side the capture runs; the kernels are kept
tiny so a test runs in well under a second on the emulator. Expected values are computed by
the tests with NumPy, never by the emulator.
"""

from __future__ import annotations

import cutlass
import cutlass.memory
import cutlass.cute as cute
from cutlass import Float32, Int32


@cute.kernel
def _axpb_kernel(a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, alpha: Float32):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    bdim, _, _ = cute.arch.block_dim()
    i = bidx * bdim + tidx
    if i < cute.size(c):
        c[i] = a[i] * alpha + b[i]


@cute.jit
def axpb_host(a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, alpha: Float32, stream):
    """c = alpha * a + b over a 1-D tensor, 64 threads per CTA, guarded tail."""
    n = cute.size(c)
    _axpb_kernel(a, b, c, alpha).launch(grid=((n + 63) // 64, 1, 1), block=(64, 1, 1),
                                         stream=stream)


@cute.kernel
def _smem_reverse_kernel(a: cute.Tensor, out: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    smem = cutlass.memory.SmemAllocator()
    buf = smem.allocate_tensor(Float32, cute.make_layout(128), byte_alignment=16)
    buf[tidx] = cute.math.exp2(a[tidx], fastmath=True)
    cute.arch.sync_threads()
    out[tidx] = buf[127 - tidx]


@cute.jit
def smem_reverse_host(a: cute.Tensor, out: cute.Tensor, stream):
    """out[i] = ex2.approx(a[127 - i]) through shared memory and __syncthreads (128 threads)."""
    _smem_reverse_kernel(a, out).launch(grid=(1, 1, 1), block=(128, 1, 1), smem=512,
                                        stream=stream)


@cute.kernel
def _warp_ops_kernel(a: cute.Tensor, out: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    lane = cute.arch.lane_idx()
    x = a[tidx]
    # butterfly sum over the warp
    s = x
    for k in cutlass.range_constexpr(5):
        s = s + cute.arch.shuffle_sync_bfly(s, offset=1 << k)
    ballot = cute.arch.vote_ballot_sync(x > 0)
    out[tidx, 0] = s
    out[tidx, 1] = ballot
    out[tidx, 2] = cute.arch.shuffle_sync(x, (lane + 3) % 32)
    out[tidx, 3] = 0
    with cute.arch.elect_one():
        out[tidx, 3] = 1 + lane


@cute.jit
def warp_ops_host(a: cute.Tensor, out: cute.Tensor, stream):
    """Per 32-thread warp: butterfly-shuffle sum, ballot of a > 0, rotate by 3, elect.sync."""
    _warp_ops_kernel(a, out).launch(grid=(1, 1, 1), block=(64, 1, 1), stream=stream)


@cute.kernel
def _mbarrier_kernel(a: cute.Tensor, out: cute.Tensor):
    """Warp 0 produces 32 values into SMEM and arrives; warp 1 waits on the phase and reads."""
    tidx, _, _ = cute.arch.thread_idx()
    warp = cute.arch.warp_idx()
    warp = cute.arch.make_warp_uniform(warp)
    lane = cute.arch.lane_idx()
    smem = cutlass.memory.SmemAllocator()
    mbar = smem.allocate_array(cutlass.Int64, num_elems=2)
    buf = smem.allocate_tensor(Int32, cute.make_layout(32), byte_alignment=16)
    if tidx == 0:
        cute.arch.mbarrier_init(mbar, 32)
        cute.arch.mbarrier_init(mbar + 1, 1)
    cute.arch.mbarrier_init_fence()
    cute.arch.sync_threads()
    for it in cutlass.range(2, unroll=1):
        if warp == 0:
            if it > 0:
                # wait until the consumer released the buffer (phase it - 1 of barrier 1)
                cute.arch.mbarrier_wait(mbar + 1, (it - 1) % 2)
            buf[lane] = a[lane] * (it + 1)
            cute.arch.mbarrier_arrive(mbar)
        if warp == 1:
            cute.arch.mbarrier_wait(mbar, it % 2)
            out[it, lane] = buf[31 - lane]
            cute.arch.sync_warp()
            if lane == 0:
                cute.arch.mbarrier_arrive(mbar + 1)


@cute.jit
def mbarrier_host(a: cute.Tensor, out: cute.Tensor, stream):
    """Two producer/consumer rounds through one SMEM buffer guarded by two mbarriers."""
    _mbarrier_kernel(a, out).launch(grid=(1, 1, 1), block=(64, 1, 1), smem=1024, stream=stream)


def make_tma_tile_host(box_rows: int, box_cols: int, tile: tuple, swizzle_bits: int = 0):
    """A host function that TMA-loads tile ``tile`` (box_rows x box_cols, row-major in SMEM,
    swizzled on the byte address by CuTe's Swizzle<swizzle_bits, 4, 3>: none, 32, 64 or
    128-byte) of a row-major 2-D tensor into SMEM, waits on the mbarrier's transaction count,
    and copies the tile out element by element through CuTe's swizzled view. Out-of-bounds
    parts of the box must arrive as zeros. The copy-out addresses are computed by the DSL's
    own swizzle, independently of the emulator's TMA swizzle."""
    from cutlass.cute.nvgpu import cpasync

    @cute.kernel
    def kernel(atom: cute.CopyAtom, m_src: cute.Tensor, out: cute.Tensor,
               s_layout: cute.ComposedLayout):
        tidx, _, _ = cute.arch.thread_idx()
        smem = cutlass.memory.SmemAllocator()
        mbar = smem.allocate_array(cutlass.Int64, num_elems=1)
        # the swizzle acts on the byte address (position dependent), as the TMA unit's does
        s_tile = smem.allocate_tensor(out.element_type, s_layout.outer, byte_alignment=1024,
                                      swizzle=s_layout.inner)
        g_tiles = cute.local_tile(m_src, (box_rows, box_cols), (None, None))  # (BR, BC, nR, nC)
        t_s, t_g = cpasync.tma_partition(atom, 0, cute.make_layout(1),
                                         cute.group_modes(s_tile, 0, 2),
                                         cute.group_modes(g_tiles, 0, 2))
        if tidx == 0:
            cute.arch.mbarrier_init(mbar, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == 0:
            # the whole warp issues the copy (CuTe elects the issuing lane itself)
            with cute.arch.elect_one():
                nbytes = box_rows * box_cols * out.element_type.width // 8
                cute.arch.mbarrier_arrive_and_expect_tx(mbar, nbytes)
            cute.copy(atom, t_g[(None, tile[0], tile[1])], t_s, tma_bar_ptr=mbar)
        cute.arch.mbarrier_wait(mbar, 0)
        for i in cutlass.range(tidx, box_rows * box_cols, 128):
            r = i // box_cols
            c = i % box_cols
            out[r, c] = s_tile[r, c]

    @cute.jit
    def host(src: cute.Tensor, out: cute.Tensor, stream):
        s_layout = cute.make_composed_layout(
            cute.make_swizzle(swizzle_bits, 4, 3), 0,
            cute.make_layout((box_rows, box_cols), stride=(box_cols, 1)))
        atom, m_tma = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), src,
                                                  s_layout, (box_rows, box_cols))
        kernel(atom, m_tma, out, s_layout).launch(grid=(1, 1, 1), block=(128, 1, 1),
                                                  smem=2048 + box_rows * box_cols * 4,
                                                  stream=stream)
    return host


UMMA_M = 128


def make_umma_tile_host(n: int, k: int, a_mn_major: bool = False, b_mn_major: bool = False):
    """D[128, n] = A[128, k] . B[n, k]^T in float32 from bf16, one CTA of 128 threads:
    warp 0 allocates TMEM, TMA-loads A and B (SMEM layouts from the MMA, 128-byte swizzle),
    issues k/16 tcgen05.mma (cta_group::1) and commits to an mbarrier; all four warps read
    their 32 TMEM lanes with tcgen05.ld 32x32b, wait::ld, and store D row by row.

    ``*_mn_major`` selects the operand's major mode (the GMEM tensor is then (k, 128)/(k, n)
    row-major, i.e. M/N contiguous, as V is in the attention PV product)."""
    import cutlass.utils.blackwell_helpers as bw
    from cutlass.cute.nvgpu import cpasync, tcgen05

    major = {False: cute.nvgpu.OperandMajorMode.K, True: cute.nvgpu.OperandMajorMode.MN}
    tiler = (UMMA_M, n, k)

    @cute.kernel
    def kernel(tiled_mma: cute.TiledMma, tma_a: cute.CopyAtom, m_a: cute.Tensor,
               tma_b: cute.CopyAtom, m_b: cute.Tensor, m_d: cute.Tensor,
               a_smem: cute.ComposedLayout, b_smem: cute.ComposedLayout, storage_cls: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(storage_cls)
        s_a = st.sA.get_tensor(a_smem.outer, swizzle=a_smem.inner)   # (MMA, MMA_M, MMA_K, 1)
        s_b = st.sB.get_tensor(b_smem.outer, swizzle=b_smem.inner)   # (MMA, MMA_N, MMA_K, 1)
        full = st.bars.data_ptr()
        done = full + 1
        if warp == 0:
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(full, 1)
                cute.arch.mbarrier_init(done, 1)
            cute.arch.alloc_tmem(n, st.tmem_addr.ptr)
            cute.arch.relinquish_tmem_alloc_permit()
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        tmem = cute.arch.retrieve_tmem_ptr(cutlass.Float32, 16, st.tmem_addr)
        acc_layout = tiled_mma.make_fragment_C(tiled_mma.partition_shape_C(tiler[:2])).layout
        t_acc = cute.make_tensor(tmem, acc_layout)                      # (MMA, MMA_M, MMA_N)
        g_a = cute.local_tile(m_a, tiler, (0, 0, None), proj=(1, None, 1))
        g_b = cute.local_tile(m_b, tiler, (0, 0, None), proj=(None, 1, 1))
        g_d = cute.local_tile(m_d, tiler, (0, 0, None), proj=(1, 1, None))
        thr = tiled_mma.get_slice(0)
        t_ga = thr.partition_A(g_a)
        t_gb = thr.partition_B(g_b)
        t_gd = thr.partition_C(g_d)                                     # (MMA, MMA_M, MMA_N)
        f_a = tiled_mma.make_fragment_A(s_a)
        f_b = tiled_mma.make_fragment_B(s_b)
        ta_s, ta_g = cpasync.tma_partition(tma_a, 0, cute.make_layout(1),
                                           cute.group_modes(s_a, 0, 3), cute.group_modes(t_ga, 0, 3))
        tb_s, tb_g = cpasync.tma_partition(tma_b, 0, cute.make_layout(1),
                                           cute.group_modes(s_b, 0, 3), cute.group_modes(t_gb, 0, 3))
        if warp == 0:
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(full, (UMMA_M + n) * k * 2)
            cute.copy(tma_a, ta_g[(None, 0)], ta_s[(None, 0)], tma_bar_ptr=full)
            cute.copy(tma_b, tb_g[(None, 0)], tb_s[(None, 0)], tma_bar_ptr=full)
            cute.arch.mbarrier_wait(full, 0)
            for kb in cutlass.range_constexpr(cute.size(f_a, mode=[2])):
                tiled_mma.set(tcgen05.Field.ACCUMULATE, kb != 0)
                cute.gemm(tiled_mma, t_acc, f_a[(None, None, kb, 0)], f_b[(None, None, kb, 0)],
                          t_acc)
            with cute.arch.elect_one():
                tcgen05.commit(done)
        cute.arch.mbarrier_wait(done, 0)
        sub = ((cute.size(t_acc, mode=[0, 0]), 32),)
        acc_sub = cute.zipped_divide(t_acc, sub)                        # (SUB, NUM_SUB)
        d_sub = cute.zipped_divide(t_gd, sub)
        ld_atom = cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition.x32), cutlass.Float32)
        tmem_copy = tcgen05.make_tmem_copy(ld_atom, acc_sub[None, 0])
        thr_copy = tmem_copy.get_slice(tidx)
        src = thr_copy.partition_S(acc_sub)                             # (CPY, CPY_M, NUM_SUB)
        dst = thr_copy.partition_D(d_sub)
        frag = cute.make_rmem_tensor(dst[None, None, 0].shape, cutlass.Float32)
        for i in cutlass.range_constexpr(cute.size(src, mode=[2])):
            cute.copy(tmem_copy, src[None, None, i], frag)
            cute.arch.fence_view_async_tmem_load()
            cute.autovec_copy(frag, dst[None, None, i])
        cute.arch.sync_threads()
        if warp == 0:
            cute.arch.dealloc_tmem(tmem, n)

    @cute.jit
    def host(a: cute.Tensor, b: cute.Tensor, d: cute.Tensor, stream):
        op = tcgen05.MmaF16BF16Op(cutlass.BFloat16, cutlass.Float32, (UMMA_M, n, 16),
                                  tcgen05.CtaGroup.ONE, tcgen05.OperandSource.SMEM,
                                  major[a_mn_major], major[b_mn_major])
        tiled_mma = cute.make_tiled_mma(op)
        a_smem = bw.make_smem_layout_a(tiled_mma, tiler, cutlass.BFloat16, 1)
        b_smem = bw.make_smem_layout_b(tiled_mma, tiler, cutlass.BFloat16, 1)
        vmnk = cute.tiled_divide(cute.make_layout((1, 1, 1)), (tiled_mma.thr_id.shape,))
        tma_op = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE)
        tma_a, m_a = cute.nvgpu.make_tiled_tma_atom_A(
            tma_op, a, cute.select(a_smem, mode=[0, 1, 2]), tiler, tiled_mma, vmnk.shape)
        tma_b, m_b = cute.nvgpu.make_tiled_tma_atom_B(
            tma_op, b, cute.select(b_smem, mode=[0, 1, 2]), tiler, tiled_mma, vmnk.shape)

        @cute.struct
        class Storage:
            bars: cute.struct.MemRange[cutlass.Int64, 2]
            tmem_addr: cutlass.Int32
            sA: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(a_smem)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(b_smem)], 1024]

        kernel(tiled_mma, tma_a, m_a, tma_b, m_b, d, a_smem, b_smem, Storage).launch(
            grid=(1, 1, 1), block=(128, 1, 1), smem=Storage.size_in_bytes(), stream=stream)

    return host
