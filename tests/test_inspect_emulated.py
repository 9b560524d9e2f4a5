"""The tcgen05 demo kernel's own PTX, executed by the project's PTX emulator (fa_sm100.ptxemu).

This is the *emulated* layer for the demo: the compiled sm_100a code (TMA loads, tcgen05.mma
into TMEM, tcgen05.ld, both cta_group flavours) computes C = A B^T on the CPU and is compared
with a float64 matmul. Nothing runs on a GPU.

Integer-valued inputs make every product and partial sum exact in float32, so the result must
equal the float64 reference exactly: any wrong swizzle, partition, K-block order or 2-CTA split
shows up as a mismatch, not as a rounding question.
"""

import pytest
import torch

from fa_sm100.demo_tcgen05 import ROWS_PER_CTA, DemoConfig, fake_args, make_kernel

pytestmark = pytest.mark.compile


def _run_demo(cfg: DemoConfig, a, b, seed: int):
    from cuda.bindings.driver import CUstream
    from cutlass.cute.runtime import from_dlpack

    from fa_sm100.ptxemu import capture_launch, emulate

    c = torch.zeros(ROWS_PER_CTA * cfg.cta_group, cfg.n, dtype=torch.float32)
    real = tuple(from_dlpack(t, assumed_align=16) for t in (a, b, c)) + (CUstream(0),)
    cap = capture_launch(make_kernel(cfg), fake_args(cfg), real)
    assert cap.launches[0].grid == (cfg.cta_group, 1, 1)
    emulate(cap, [a, b, c], seed=seed)
    return c


@pytest.mark.parametrize("use_2cta", [False, True], ids=["1cta", "2cta"])
def test_demo_emulated_exact(use_2cta):
    cfg = DemoConfig(use_2cta=use_2cta, n=128, k=128)  # 8 K-blocks: the accumulate path
    gen = torch.Generator().manual_seed(7)
    m = ROWS_PER_CTA * cfg.cta_group
    a = torch.randint(-4, 5, (m, cfg.k), generator=gen).to(torch.bfloat16)
    b = torch.randint(-4, 5, (cfg.n, cfg.k), generator=gen).to(torch.bfloat16)
    c = _run_demo(cfg, a, b, seed=3)
    ref = a.double() @ b.double().T
    assert torch.equal(c.double(), ref), f"max error {(c.double() - ref).abs().max().item()}"


def test_demo_emulated_random_inputs():
    """Normal inputs, 2-CTA: within float32 accumulation error of the float64 product."""
    cfg = DemoConfig(use_2cta=True, n=64, k=64)
    gen = torch.Generator().manual_seed(11)
    a = torch.randn(2 * ROWS_PER_CTA, cfg.k, generator=gen).to(torch.bfloat16)
    b = torch.randn(cfg.n, cfg.k, generator=gen).to(torch.bfloat16)
    c = _run_demo(cfg, a, b, seed=5)
    ref = a.double() @ b.double().T
    err = (c.double() - ref).abs().max().item()
    # K = 64 products of bf16 values summed in float32: a few float32 ulps of the row sums.
    bound = 64 * 2.0 ** -24 * (a.double().abs() @ b.double().abs().T).max().item()
    assert err <= bound, f"max error {err:.3e} > bound {bound:.3e}"
    assert err < 1e-3
