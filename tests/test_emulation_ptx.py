"""The numerics emulation against the SM100 kernel's own PTX (both EMULATED on the CPU).

Contract: for the same inputs and config, ``emulate_sm100_fwd`` and the kernel's sm_100a PTX
executed on the PTX emulator (``fa_sm100.ptxemu``) give bit-identical O and LSE. The two
share only the arithmetic model of what the ISA leaves open (an MMA instruction rounds its 16
exact products plus the accumulator once to float32; MUFU results are correctly rounded);
everything else -- tile order, Q stages, 2-CTA, masking, the row max and the thresholded
rescale, the ex2 polynomial and its column selection, P rounding, split P, the row-sum order,
1/row_sum and the LSE -- is the kernel's compiled code on one side and the emulation's torch
code on the other. Agreement to the bit says the emulation follows the kernel step by step.
"""

import math

import pytest
import torch

pytest.importorskip("cutlass")

from fa_sm100.config import config_from_overrides  # noqa: E402
from fa_sm100.emulation import emulate_sm100_fwd  # noqa: E402
from fa_sm100.emulation.cases import Case, make_inputs  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.compile]

CASES = {
    # name: (batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, --set, inputs)
    # the default design: 2-CTA, two Q stages, split P, ex2 polynomial on 1/8 of the columns,
    # three K/V blocks visited in reverse
    "default_3blocks": (1, 128, 384, 1, 1, 64, [], "randn"),
    # causal sliding window (keys [i - 70, i]): blocks below the window are skipped (n_min > 0)
    "window_causal": (1, 200, 300, 1, 1, 64, ["causal=true", "window_left=70"], "randn"),
    # fp16, 1-CTA, one Q stage, causal with GQA, two batches, split at column 64, half of
    # the exp2s on the polynomial; threshold 0 rescales O often
    "fp16_1cta_causal_gqa_threshold0": (2, 200, 200, 2, 1, 64,
                                        ["use_2cta=false", "q_stage=1", "causal=true",
                                         "rescale_threshold=0", "dtype=float16",
                                         "split_p_col=64", "ex2_emu_fraction=0.5"], "randn"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_emulation_is_bit_identical_to_the_kernels_ptx(name):
    from fa_sm100.ptxemu.sm100_run import run_forward

    b, sq, sk, h, hk, d, sets, kind = CASES[name]
    cfg = config_from_overrides([f"head_dim={d}", f"head_dim_v={d}",
                                 f"qhead_per_kvhead={h // hk}"] + sets)
    q, k, v = make_inputs(Case(name=name, seqlen_q=sq, seqlen_k=sk, heads=h, kv_heads=hk,
                               head_dim=d, head_dim_v=d, batch=b, inputs=kind,
                               dtype="fp16" if cfg.dtype == "float16" else "bf16"))
    run = run_forward(cfg, q, k, v)
    out, lse, stats = emulate_sm100_fwd(q, k, v, 1.0 / math.sqrt(d), causal=cfg.causal,
                                        window_size=(cfg.window_left, cfg.window_right),
                                        config=cfg, return_stats=True)
    if name.endswith("threshold0"):
        assert stats.rescaled > 0  # the correction path is exercised
    assert torch.equal(run.out.view(torch.int16), out.view(torch.int16)), (
        f"O differs in {int((run.out.view(torch.int16) != out.view(torch.int16)).sum())} elements")
    assert torch.equal(run.lse.view(torch.int32), lse.view(torch.int32)), (
        f"LSE differs in {int((run.lse.view(torch.int32) != lse.view(torch.int32)).sum())} rows")
