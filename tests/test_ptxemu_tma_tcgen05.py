"""PTX emulator, Blackwell data path: TMA boxes through the tensor maps the DSL's host code
encodes, and one-tile tcgen05 GEMMs (TMA -> SMEM -> tcgen05.mma -> TMEM -> tcgen05.ld) run
from their sm_100a PTX and compared bit for bit with NumPy. Hand-written PTX provokes the
TMEM checks (unallocated columns, tcgen05.ld results used before wait::ld, leftover
allocations)."""

import numpy as np
import pytest
import torch

cutlass = pytest.importorskip("cutlass")

from cutlass.cute.runtime import from_dlpack, make_fake_compact_tensor, make_fake_stream  # noqa: E402

from fa_sm100.ptxemu import EmulationError, capture_launch, emulate, launch_from_ptx  # noqa: E402
from fa_sm100.ptxemu import samples as S  # noqa: E402
from fa_sm100.ptxemu.ops_tma import tensormap_of  # noqa: E402
from fa_sm100.ptxemu.emulator import build_launch  # noqa: E402
from fa_sm100.ptxemu.machine import Machine  # noqa: E402
from fa_sm100.ptxemu.memory import GlobalMemory, PARAM_GENERIC_BASE  # noqa: E402

TORCH = {"bf16": torch.bfloat16, "f32": torch.float32}


def _stream():
    import cuda.bindings.driver as cuda
    return cuda.CUstream(0)


def _fake(t, dtype):
    order = (1, 0) if t.stride(1) == 1 else (0, 1)
    return make_fake_compact_tensor(dtype, tuple(t.shape), stride_order=order, assumed_align=16)


def _dl(t):
    return from_dlpack(t, assumed_align=16)


@pytest.mark.parametrize("dt,shape,box,tile,swz", [
    ("bf16", (30, 40), (8, 16), (3, 2), 0),     # last tile: 6 valid rows, 8 valid columns
    ("f32", (100, 72), (16, 8), (6, 8), 0),     # 4 valid rows, 8 valid columns
    ("bf16", (100, 72), (32, 64), (3, 1), 3),   # 128-byte swizzle, partly out of bounds
    ("bf16", (100, 128), (32, 64), (1, 1), 3),  # 128-byte swizzle, inside
    ("f32", (64, 64), (16, 16), (1, 1), 2),     # 64-byte swizzle
    ("f32", (64, 64), (8, 8), (1, 1), 1),       # 32-byte swizzle
])
def test_tma_box_lands_with_zero_fill_and_tensormap_decodes(dt, shape, box, tile, swz):
    """The copy-out reads SMEM through CuTe's own byte-address swizzle, so the emulated TMA
    swizzle is checked against the DSL's, not against itself."""
    cdt = {"bf16": cutlass.BFloat16, "f32": cutlass.Float32}[dt]
    torch.manual_seed(0)
    src = torch.randn(*shape).to(TORCH[dt])
    out = torch.full(box, 7.0).to(TORCH[dt])
    cap = capture_launch(S.make_tma_tile_host(box[0], box[1], tile, swz),
                         (_fake(src, cdt), _fake(out, cdt), make_fake_stream()),
                         (_dl(src), _dl(out), _stream()))
    # the descriptor in the kernel parameters decodes to the tensor it was built from
    m = Machine(build_launch(cap), GlobalMemory())
    tm = tensormap_of(m, None, PARAM_GENERIC_BASE, "test")
    assert tm.address == src.data_ptr()
    assert tm.dims == (shape[1], shape[0]) and tm.box == (box[1], box[0])
    assert tm.strides == (shape[1] * src.element_size(),) and tm.elem_bytes == src.element_size()
    assert tm.swizzle == swz
    for seed in (0, 1):
        out.fill_(7.0)
        emulate(cap, [src, out], seed=seed)
        ref = torch.zeros(*box).to(TORCH[dt])
        part = src[tile[0] * box[0]:(tile[0] + 1) * box[0], tile[1] * box[1]:(tile[1] + 1) * box[1]]
        ref[:part.shape[0], :part.shape[1]] = part
        assert torch.equal(out, ref)


def _umma_reference(a, b, k):
    """The emulator's documented MMA model: each K=16 instruction sums exact products in
    float64 with the float32 accumulator and rounds once."""
    acc = np.zeros((a.shape[0], b.shape[0]), np.float32)
    a64, b64 = a.double().numpy(), b.double().numpy()
    for kb in range(k // 16):
        sl = slice(16 * kb, 16 * kb + 16)
        acc = (acc.astype(np.float64) + a64[:, sl] @ b64[:, sl].T).astype(np.float32)
    return acc


@pytest.mark.parametrize("n,k,a_mn,b_mn", [
    (64, 64, False, False),       # K-major, 128-byte swizzle
    (256, 32, False, False),      # 64-byte swizzle, widest N of one MMA
    (32, 16, False, False),       # 32-byte swizzle
    (64, 64, False, True),        # B MN-major (V in the PV product)
    (128, 64, True, True),        # both MN-major
])
def test_umma_tile_bit_exact(n, k, a_mn, b_mn):
    torch.manual_seed(n + k)
    a = torch.randn(128, k).to(torch.bfloat16)
    b = torch.randn(n, k).to(torch.bfloat16)
    # MN-major operands live M/N-contiguous in GMEM: same logical (rows, k) tensor, strides (1, rows)
    ag = a.t().contiguous().t() if a_mn else a
    bg = b.t().contiguous().t() if b_mn else b
    d = torch.zeros(128, n)
    cap = capture_launch(S.make_umma_tile_host(n, k, a_mn, b_mn),
                         (_fake(ag, cutlass.BFloat16), _fake(bg, cutlass.BFloat16),
                          _fake(d, cutlass.Float32), make_fake_stream()),
                         (_dl(ag), _dl(bg), _dl(d), _stream()))
    ptx = cap.ptx
    assert "tcgen05.mma.cta_group::1.kind::f16" in ptx and "cp.async.bulk.tensor" in ptx
    ref = _umma_reference(a, b, k)
    buffers = [ag.t() if a_mn else ag, bg.t() if b_mn else bg, d]   # contiguous storage views
    for seed in (0, 3):
        d.zero_()
        emulate(cap, buffers, seed=seed)
        np.testing.assert_array_equal(d.numpy(), ref)


TMEM_PTX = """.version 8.8
.target sm_100a
.address_size 64
.extern .shared .align 1024 .b8 smem[];
.visible .entry k(.param .u64 pout)
.reqntid 128, 1, 1
{
    .reg .b32 %r<12>;
    .reg .b64 %rd<4>;
    .reg .pred %p<2>;
    ld.param.u64 %rd1, [pout];
    mov.u32 %r1, %tid.x;
    shr.u32 %r2, %r1, 5;
    mov.b32 %r3, smem;
    setp.ne.u32 %p1, %r2, 0;
    @%p1 bra ALLOCATED;
    tcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32 [%r3], 32;
ALLOCATED:
    bar.sync 0;
    ld.shared.b32 %r4, [%r3];
    shl.b32 %r5, %r2, 21;
    add.s32 %r6, %r4, %r5;
    mul.lo.u32 %r8, %r1, 3;
    tcgen05.st.sync.aligned.32x32b.x1.b32 [%r6+STCOL], {%r8};
    tcgen05.wait::st.sync.aligned;
    tcgen05.ld.sync.aligned.32x32b.x1.b32 {%r7}, [%r6];
    WAITLD
    AFTERLD
    mul.wide.u32 %rd2, %r1, 4;
    add.s64 %rd3, %rd1, %rd2;
    st.global.b32 [%rd3], %r7;
    LATEWAIT
    bar.sync 0;
    @%p1 bra END;
    DEALLOC
END:
    ret;
}
"""

GOOD = {"STCOL": "0", "WAITLD": "tcgen05.wait::ld.sync.aligned;", "AFTERLD": "", "LATEWAIT": "",
        "DEALLOC": "tcgen05.dealloc.cta_group::1.sync.aligned.b32 %r4, 32;"}


def _tmem_kernel(**changes):
    text = TMEM_PTX
    for key, val in {**GOOD, **changes}.items():
        text = text.replace(key, val)
    out = torch.zeros(128, dtype=torch.int32)
    return launch_from_ptx(text, block=(128, 1, 1), params=[out.data_ptr()],
                           dynamic_smem=64), out


def test_tmem_store_load_round_trip_per_warp_quarter():
    cap, out = _tmem_kernel()
    emulate(cap, [out], seed=2)
    assert out.tolist() == [3 * i for i in range(128)]


# Note [tcgen05.ld and wait::ld] (ops_tcgen05.py): the wait orders the load's read of TMEM;
# its destination registers are ordinary register results.
OVERWRITE = ("tcgen05.st.sync.aligned.32x32b.x1.b32 [%r6], {%r1}; "
             "tcgen05.wait::st.sync.aligned;")


def test_tcgen05_ld_result_is_a_register_value_before_the_wait():
    """The loaded value is used (stored to global) before wait::ld; the wait comes before the
    barrier that lets warp 0 free the columns (freeing them under a pending read is a race)."""
    cap, out = _tmem_kernel(WAITLD="", LATEWAIT="tcgen05.wait::ld.sync.aligned;")
    emulate(cap, [out], seed=1)
    assert out.tolist() == [3 * i for i in range(128)]


def test_tmem_write_racing_an_unwaited_tcgen05_ld_is_reported():
    cap, out = _tmem_kernel(WAITLD="", AFTERLD=OVERWRITE)
    with pytest.raises(EmulationError, match="asynchronous read still pending"):
        emulate(cap, [out])
    cap, out = _tmem_kernel(AFTERLD=OVERWRITE)   # the same write after wait::ld is ordered
    emulate(cap, [out])
    assert out.tolist() == [3 * i for i in range(128)]


def test_tmem_columns_outside_the_allocation_are_reported():
    cap, out = _tmem_kernel(STCOL="32")
    with pytest.raises(EmulationError, match=r"columns \[32, 33\) of CTA 0 are not allocated"):
        emulate(cap, [out])


def test_tmem_left_allocated_at_exit_is_reported():
    cap, out = _tmem_kernel(DEALLOC="")
    with pytest.raises(EmulationError, match="exited with TMEM columns still allocated"):
        emulate(cap, [out])


MULTICAST_PTX = """.version 8.8
.target sm_100a
.address_size 64
.extern .shared .align 1024 .b8 smem[];
.visible .entry k(.param .align 64 .b8 tmap[128], .param .u64 pout)
.reqntid 32, 1, 1
{
    .reg .b32 %r<20>;
    .reg .b64 %rd<12>;
    .reg .pred %p<4>;
    .reg .b16 %rs<2>;
    mov.u32 %r1, %tid.x;
    mov.u32 %r2, %cluster_ctarank;
    mov.b32 %r3, smem;
    setp.ne.u32 %p1, %r1, 0;
    @%p1 bra INITIALIZED;
    mbarrier.init.shared.b64 [%r3], 1;
INITIALIZED:
    barrier.cluster.arrive.aligned;
    barrier.cluster.wait.aligned;
    @%p1 bra ISSUED;
    mbarrier.arrive.expect_tx.shared.b64 %rd1, [%r3], 512;
    setp.ne.u32 %p2, %r2, 0;
    @%p2 bra ISSUED;
    mov.b64 %rd2, tmap;
    cvta.param.u64 %rd3, %rd2;
    mov.b16 %rs1, 3;
    add.s32 %r4, %r3, 1024;
    mov.b32 %r5, 0;
    cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster [%r4], [%rd3, {%r5, %r5}], [%r3], %rs1;
ISSUED:
    mov.b32 %r6, 0;
WAIT:
    mbarrier.try_wait.parity.shared.b64 %p3, [%r3], %r6;
    @!%p3 bra WAIT;
    shl.b32 %r7, %r1, 4;
    add.s32 %r8, %r3, %r7;
    ld.shared.v4.b32 {%r9, %r10, %r11, %r12}, [%r8+1024];
    ld.param.u64 %rd4, [pout];
    mad.lo.s32 %r13, %r2, 128, 0;
    shl.b32 %r14, %r1, 2;
    add.s32 %r15, %r13, %r14;
    mul.wide.u32 %rd5, %r15, 4;
    add.s64 %rd6, %rd4, %rd5;
    st.global.v4.b32 [%rd6], {%r9, %r10, %r11, %r12};
    barrier.cluster.arrive.aligned;
    barrier.cluster.wait.aligned;
    ret;
}
"""


@pytest.mark.parametrize("seed", (0, 1, 2))
def test_tma_multicast_lands_in_both_ctas_of_the_cluster(seed):
    """CTA 0 issues one multicast TMA (mask 0b11) for an 8x16 f32 box of an (8, 20) tensor;
    each CTA's mbarrier expects the 512 bytes; both CTAs read the box back from their own
    SMEM. Uses a tensor map recorded through the driver stand-in's encode path."""
    from fa_sm100.ptxemu.capture import TMAP_MAGIC, TensorMap
    src = torch.randn(8, 20)
    out = torch.zeros(2, 128)
    tm = TensorMap(dtype=7, rank=2, address=src.data_ptr(), dims=(20, 8), strides=(80,),
                   box=(16, 8), element_strides=(1, 1), interleave=0, swizzle=0,
                   l2_promotion=0, oob_fill=0)
    desc = np.zeros(16, dtype=np.uint64)
    desc[0] = TMAP_MAGIC
    cap = launch_from_ptx(MULTICAST_PTX, grid=(2, 1, 1), block=(32, 1, 1),
                          params=[desc, out.data_ptr()], dynamic_smem=2048,
                          cluster=(2, 1, 1), tensormaps=[tm])
    emulate(cap, [src, out], seed=seed)
    box = src[:, :16].reshape(-1)
    assert torch.equal(out[0], box) and torch.equal(out[1], box)


@pytest.mark.parametrize("two_cta", (False, True))
def test_project_tcgen05_demo_bit_exact(two_cta):
    """The project's tcgen05 demo (fa_sm100/demo_tcgen05.py, registry ``tcgen05_demo``): a
    2-CTA run exercises cta_group::2 TMA (leader-CTA barrier), the pair MMA (M = 256, B split
    across the pair), the multicast commit and cluster barriers."""
    from fa_sm100.registry import get_kernel
    entry = get_kernel("tcgen05_demo")
    cfg = entry.make_config([f"use_2cta={'true' if two_cta else 'false'}"])
    build = entry.build(cfg, "sm_100a")
    m = 128 * cfg.cta_group
    torch.manual_seed(7)
    a = torch.randn(m, cfg.k).to(torch.bfloat16)
    b = torch.randn(cfg.n, cfg.k).to(torch.bfloat16)
    c = torch.zeros(m, cfg.n)
    cap = capture_launch(build.fn, build.args, (_dl(a), _dl(b), _dl(c), _stream()))
    assert cap.launches[0].cluster == cfg.cluster_shape
    for seed in (0, 1):
        c.zero_()
        emulate(cap, [a, b, c], seed=seed)
        np.testing.assert_array_equal(c.numpy(), _umma_reference(a, b, cfg.k))


FENCED = {"WAITLD": "tcgen05.wait::ld.sync.aligned; tcgen05.fence::before_thread_sync;"}


def _after_first_barrier(text: str) -> str:
    return text.replace("bar.sync 0;\n    ld.shared.b32",
                        "bar.sync 0;\n    tcgen05.fence::after_thread_sync;\n    ld.shared.b32", 1)


def test_strict_fences_report_tcgen05_ops_around_thread_syncs_without_their_fences():
    """Note [tcgen05 thread-sync fences]: with ``strict_fences`` a tcgen05 operation after a
    wait needs ``fence::after_thread_sync`` and a thread sync after a tcgen05.ld / st needs
    ``fence::before_thread_sync``; with both fences the kernel runs, and without the strict
    mode it runs either way."""
    cap, out = _tmem_kernel()
    emulate(cap, [out])
    cap, out = _tmem_kernel()
    with pytest.raises(EmulationError, match="without tcgen05.fence::after_thread_sync"):
        emulate(cap, [out], strict_fences=True)
    text = _after_first_barrier(TMEM_PTX)
    for key, val in {**GOOD, "WAITLD": GOOD["WAITLD"]}.items():
        text = text.replace(key, val)
    cap = launch_from_ptx(text, block=(128, 1, 1), params=[out.data_ptr()], dynamic_smem=64)
    with pytest.raises(EmulationError, match="without tcgen05.fence::before_thread_sync"):
        emulate(cap, [out], strict_fences=True)
    text = _after_first_barrier(TMEM_PTX)
    for key, val in {**GOOD, **FENCED}.items():
        text = text.replace(key, val)
    cap = launch_from_ptx(text, block=(128, 1, 1), params=[out.data_ptr()], dynamic_smem=64)
    emulate(cap, [out], strict_fences=True)
    assert out.tolist() == [3 * i for i in range(128)]


def test_tma_load_into_an_operand_of_a_pending_mma_is_a_race():
    """MMA operands are pending-read from issue to completion: the UMMA tile kernel with its
    A tile's TMA load issued again right after the MMA (a slot refilled before the MMA has
    read it) is reported at the second load's issue under each schedule policy. The reloaded
    bytes are the same, so no value would show it."""
    from fa_sm100.ptxemu.parser import parse_ptx

    n, k = 64, 64
    a = torch.randn(128, k).to(torch.bfloat16)
    b = torch.randn(n, k).to(torch.bfloat16)
    d = torch.zeros(128, n)
    cap = capture_launch(S.make_umma_tile_host(n, k),
                         (_fake(a, cutlass.BFloat16), _fake(b, cutlass.BFloat16),
                          _fake(d, cutlass.Float32), make_fake_stream()),
                         (_dl(a), _dl(b), _dl(d), _stream()))
    lines = cap.ptx.splitlines()
    load = next(line for line in lines if "cp.async.bulk.tensor" in line)
    mma = next(i for i, line in enumerate(lines) if "tcgen05.mma" in line)
    cap.ptx = "\n".join(lines[:mma + 1] + [load] + lines[mma + 1:])
    cap.module = parse_ptx(cap.ptx)
    for policy in ("late", "early", "random"):
        d.zero_()
        with pytest.raises(EmulationError, match="asynchronous read of it is pending"):
            emulate(cap, [a, b, d], policy=policy)
