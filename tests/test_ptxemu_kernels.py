"""PTX emulator, DSL kernels: each sample kernel is cross-compiled for sm_100a, its launch is
captured through the driver stand-in, and the emulator's results are compared with values
computed independently by NumPy, under several scheduler seeds."""

import numpy as np
import pytest
import torch

cutlass = pytest.importorskip("cutlass")

from cutlass.cute.runtime import from_dlpack, make_fake_compact_tensor, make_fake_stream  # noqa: E402

from fa_sm100.ptxemu import capture_launch, emulate  # noqa: E402
from fa_sm100.ptxemu import samples as S  # noqa: E402
from script_loader import load_script  # noqa: E402

SEEDS = (0, 1, 2)


def _stream():
    import cuda.bindings.driver as cuda
    return cuda.CUstream(0)


def _fake(dtype, shape):
    order = tuple(range(len(shape) - 1, -1, -1))      # row-major, as torch allocates
    return make_fake_compact_tensor(dtype, shape, stride_order=order)


def test_capture_records_launch_geometry_and_parameters():
    """The stand-in driver sees the grid the host code computed (ceil(100/64) = 2), the
    block from the kernel, and parameter bytes holding the real tensor addresses."""
    a, b, c = torch.randn(100), torch.randn(100), torch.zeros(100)
    f32 = cutlass.Float32
    cap = capture_launch(S.axpb_host, (_fake(f32, (100,)),) * 3 + (f32(1.0), make_fake_stream()),
                         (from_dlpack(a), from_dlpack(b), from_dlpack(c), f32(1.5), _stream()))
    (rec,) = cap.launches
    assert rec.grid == (2, 1, 1) and rec.block == (64, 1, 1) and rec.cluster == (1, 1, 1)
    ptrs = np.frombuffer(rec.param_bytes[:24], dtype=np.uint64).tolist()
    assert ptrs == [a.data_ptr(), b.data_ptr(), c.data_ptr()]
    assert np.frombuffer(rec.param_bytes[24:28], dtype=np.float32)[0] == np.float32(1.5)
    assert cap.kernel.reqntid == (64, 1, 1)


@pytest.mark.parametrize("seed", SEEDS)
def test_axpb_fma_is_single_rounded_and_tail_guarded(seed):
    """c = fma(alpha, a, b) rounded once (PTX fma.rn.f32), and the 28 threads past n=100 in
    the second CTA store nothing (the guard branch diverges inside a warp)."""
    torch.manual_seed(seed)
    a, b = torch.randn(100), torch.randn(100)
    c = torch.full((100,), 7.0)
    f32 = cutlass.Float32
    cap = capture_launch(S.axpb_host, (_fake(f32, (100,)),) * 3 + (f32(1.0), make_fake_stream()),
                         (from_dlpack(a), from_dlpack(b), from_dlpack(c), f32(1.5), _stream()))
    emulate(cap, [a, b, c], seed=seed)
    ref = (a.double() * 1.5 + b.double()).float()     # exact product, one rounding
    assert torch.equal(c, ref)


@pytest.mark.parametrize("seed", SEEDS)
def test_smem_reverse_through_syncthreads(seed):
    """Each thread writes ex2(a[i]) to SMEM, bar.sync, then reads slot 127 - i: any thread
    running past the barrier early would read uninitialized SMEM and fail the check."""
    a, out = torch.randn(128), torch.zeros(128)
    f32 = cutlass.Float32
    cap = capture_launch(S.smem_reverse_host, (_fake(f32, (128,)), _fake(f32, (128,)),
                                               make_fake_stream()),
                         (from_dlpack(a), from_dlpack(out), _stream()))
    emulate(cap, [a, out], seed=seed)
    ref = np.exp2(a.numpy()[::-1].astype(np.float64)).astype(np.float32)
    np.testing.assert_array_equal(out.numpy(), ref)


@pytest.mark.parametrize("seed", SEEDS)
def test_warp_shuffle_vote_elect(seed):
    torch.manual_seed(seed)
    a = torch.randint(-5, 6, (64,), dtype=torch.int32)
    out = torch.zeros(64, 4, dtype=torch.int32)
    i32 = cutlass.Int32
    cap = capture_launch(S.warp_ops_host, (_fake(i32, (64,)), _fake(i32, (64, 4)),
                                           make_fake_stream()),
                         (from_dlpack(a), from_dlpack(out), _stream()))
    emulate(cap, [a, out], seed=seed)
    x = a.numpy().reshape(2, 32)
    o = out.numpy().reshape(2, 32, 4)
    for wp in range(2):
        assert (o[wp, :, 0] == x[wp].sum()).all()
        ballot = sum(1 << i for i in range(32) if x[wp, i] > 0)
        assert (o[wp, :, 1].view(np.uint32) == ballot).all()
        np.testing.assert_array_equal(o[wp, :, 2], np.roll(x[wp], -3))
        assert o[wp, :, 3].tolist() == [1] + [0] * 31     # one elected lane: lane 0 here


@pytest.mark.parametrize("seed", SEEDS + (7, 11))
def test_mbarrier_producer_consumer_rounds(seed):
    """Two rounds through one buffer: the consumer waits on the full barrier's phase, the
    producer on the empty barrier's previous phase; wrong phase logic reads stale data."""
    a = torch.arange(1, 33, dtype=torch.int32)
    out = torch.zeros(2, 32, dtype=torch.int32)
    i32 = cutlass.Int32
    cap = capture_launch(S.mbarrier_host, (_fake(i32, (32,)), _fake(i32, (2, 32)),
                                           make_fake_stream()),
                         (from_dlpack(a), from_dlpack(out), _stream()))
    emulate(cap, [a, out], seed=seed)
    rev = a.flip(0)
    assert out[0].tolist() == rev.tolist() and out[1].tolist() == (2 * rev).tolist()


def test_emulate_script_rejects_a_bad_override_before_compiling(capsys):
    """scripts/emulate_sm100.py validates --set through the kernel registry (exit 2)."""
    mod = load_script("emulate_sm100")
    assert mod.main(["--set", "no_such_field=1"]) == 2
    assert "bad --set" in capsys.readouterr().err
