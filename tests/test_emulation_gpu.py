"""Hardware check of the emulation's exp2 models (GPU; skipped elsewhere with the reason).

Contract (``gpu_ex2.check_report``): on a real NVIDIA GPU, the kernel's FMA-pipe exp2 sequence
(scalar PTX, the per-lane form of the kernel's packed f32x2 ops) gives exactly the bits of
``emulation.ex2.ex2_poly``; MUFU.EX2 stays within 2 ulp of correctly rounded exp2 and of the
emulation's SFU model; the epilogue's MUFU.RCP and MUFU.LG2, which the emulation takes as
exact, stay within 2 ulp and 2^-22 (+ result rounding). Measured on an H200 (sm_90): 0
polynomial mismatches in 9.4 million inputs; EX2 <= 2 ulp; RCP <= 1 ulp; LG2 <= 1.6e-7 on (1, 2].
"""

import pytest
import torch

from fa_sm100.emulation.gpu_ex2 import check_report


@pytest.fixture
def cuda_with_triton():
    if not torch.cuda.is_available():
        pytest.skip("exp2 hardware check: no CUDA device on this machine (runs on the lent GPU)")
    pytest.importorskip("triton", reason="exp2 hardware check: triton is not installed")


def test_ex2_models_match_the_gpu(cuda_with_triton):
    from fa_sm100.emulation.gpu_ex2 import gpu_ex2_report

    rep = gpu_ex2_report()
    assert check_report(rep) == []


def test_check_report_flags_violations():
    # The contract itself can fail: a report with one mismatching polynomial result and a
    # 3-ulp reciprocal is rejected on exactly those two counts.
    row = dict(inputs="x", count=10, poly_bit_mismatches=1, poly_max_ulp_vs_model=1,
               mufu_max_ulp_vs_exact=2, mufu_max_ulp_vs_sfu_model=1, mufu_share_exact=0.5,
               poly_gpu_zero_below_clamp=True)
    epi = dict(inputs="y", count=10, rcp_max_ulp_vs_exact=3, rcp_share_exact=0.5,
               lg2_max_abs_error=1e-7, lg2_result_ulp=2.0**-24)
    bad = check_report({"sets": [row], "epilogue": [epi]})
    assert len(bad) == 2 and "polynomial" in bad[0] and "RCP" in bad[1]
