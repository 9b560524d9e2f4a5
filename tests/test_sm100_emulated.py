"""The SM100 forward's own PTX, executed on the CPU PTX emulator (fa_sm100.ptxemu): EMULATED,
not run on Blackwell hardware.

Contract: for features the emulator suite (tests/test_ptxemu_sm100.py) does not cover -- a
sliding window with causal (2-CTA, two Q stages), head dims (192, 128) with one K/V stage
(1-CTA), causal with seqlen_q > seqlen_k (rows that see no key) with rescale threshold 0,
two-sided and shifted windows (whose bounds are launch arguments: a second window runs the
same compiled PTX),
and one persistent CTA working through six tiles -- O meets the project's error rule against
the float64 reference (at most twice the error of the same attention in the input
precision) and LSE matches the reference (-inf exactly where the reference has it).
"""

import math

import pytest
import torch

pytest.importorskip("cutlass")

from fa_sm100.config import config_from_overrides  # noqa: E402
from fa_sm100.testing import attention_reference, check_against_reference  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.compile]

CASES = {
    # name: (batch, seqlen_q, seqlen_k, heads, kv heads, head_dim, head_dim_v, --set)
    "window_causal_2cta": (1, 200, 300, 1, 1, 64, 64, ["causal=true", "window_left=70"]),
    # both sides bounded, GQA, a key tail; then a band that ends left of the diagonal, so the
    # first rows see no key (O = 0, LSE = -inf) and the rest a band of 16 keys
    "window_two_sided_gqa": (1, 200, 333, 2, 1, 64, 64, ["window_left=40", "window_right=25"]),
    "window_shifted_left_1cta": (1, 150, 150, 1, 1, 64, 64,
                                 ["window_left=20", "window_right=-5", "use_2cta=false"]),
    "hdim192_1cta_one_kv_stage": (1, 128, 300, 1, 1, 192, 128, ["use_2cta=false"]),
    "causal_sq_gt_sk_threshold0": (1, 300, 130, 2, 1, 64, 64,
                                   ["causal=true", "rescale_threshold=0"]),
    # one persistent CTA (num_sms=1) works through all 6 tiles: pipeline phases carry across
    # tiles and the 2-stage K/V ring wraps many times
    "persistent_6_tiles_one_cta": (1, 300, 200, 2, 1, 64, 64,
                                   ["num_sms=1", "use_2cta=false", "q_stage=1", "kv_stage=2"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_emulated_kernel_matches_float64_reference(name):
    from fa_sm100.ptxemu.sm100_run import run_forward

    b, sq, sk, h, hk, d, dv, sets = CASES[name]
    cfg = config_from_overrides([f"head_dim={d}", f"head_dim_v={dv}",
                                 f"qhead_per_kvhead={h // hk}"] + sets)
    if name.startswith("hdim192"):
        assert cfg.kv_stage == 1  # the case is about the one-stage K/V ring
    g = torch.Generator().manual_seed(3)
    q = torch.randn(b, sq, h, d, generator=g).to(torch.bfloat16)
    k = torch.randn(b, sk, hk, d, generator=g).to(torch.bfloat16)
    v = torch.randn(b, sk, hk, dv, generator=g).to(torch.bfloat16)
    run = run_forward(cfg, q, k, v)
    scale = 1.0 / math.sqrt(d)
    window = (cfg.window_left, cfg.window_right)
    ref, ref_lse = attention_reference(q, k, v, scale, causal=cfg.causal, window=window)
    plain, _ = attention_reference(q, k, v, scale, causal=cfg.causal, window=window,
                                   dtype=q.dtype, upcast=False)
    check_against_reference(run.out, ref, plain, what="O")
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(run.lse)), "LSE: -inf rows differ"
    if name.startswith("causal_sq_gt_sk"):
        assert not finite.all()  # the case does have rows that see no key
        assert (run.out[:, : sq - sk].float() == 0).all()
    assert torch.allclose(run.lse[finite].double(), ref_lse[finite], atol=1e-4, rtol=1e-4)


def test_a_new_window_runs_the_same_compiled_kernel():
    """The window's bounds are launch arguments: a second window size reuses the compiled
    PTX (the emulator's compile cache gains nothing) and still meets the reference."""
    from fa_sm100.ptxemu import sm100_run

    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 160, 1, 64, generator=g).to(torch.bfloat16) for _ in range(3))
    sets = ["head_dim=64", "head_dim_v=64", "use_2cta=false"]
    sm100_run.run_forward(config_from_overrides(sets + ["window_left=30", "window_right=0"]),
                          q, k, v)
    compiled = len(sm100_run._COMPILED)
    for left, right in ((90, 3), (-2, 40)):
        cfg = config_from_overrides(sets + [f"window_left={left}", f"window_right={right}"])
        run = sm100_run.run_forward(cfg, q, k, v)
        ref, _ = attention_reference(q, k, v, causal=False, window=(left, right))
        plain, _ = attention_reference(q, k, v, causal=False, window=(left, right),
                                       dtype=q.dtype, upcast=False)
        check_against_reference(run.out, ref, plain, what=f"O window {(left, right)}")
    assert len(sm100_run._COMPILED) == compiled


@pytest.mark.parametrize("sets,softcap", [
    (["causal=true", "use_2cta=false"], 30.0),
    (["window_left=40", "window_right=25"], 5.0),
], ids=["causal_c30", "window_c5"])
def test_softcapped_kernel_matches_float64_reference(sets, softcap):
    """Logit softcapping (``softcap_tanh`` before the mask, c log2(e) in the softmax): the
    kernel's PTX against float64 under the rule, O and LSE, and against the numerics
    emulation of the same algorithm (which models MUFU.EX2 as the emulator does)."""
    from fa_sm100.emulation.forward import emulate_sm100_fwd
    from fa_sm100.ptxemu.sm100_run import run_forward

    cfg = config_from_overrides(["head_dim=64", "head_dim_v=64", "qhead_per_kvhead=2",
                                 "softcap=true"] + sets)
    g = torch.Generator().manual_seed(11)
    q = (torch.randn(1, 200, 2, 64, generator=g) * 3).to(torch.bfloat16)  # capped scores
    k, v = (torch.randn(1, 250, 1, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    run = run_forward(cfg, q, k, v, softcap=softcap)
    window = (cfg.window_left, cfg.window_right)
    ref, ref_lse = attention_reference(q, k, v, causal=cfg.causal, window=window,
                                       softcap=softcap)
    plain, _ = attention_reference(q, k, v, causal=cfg.causal, window=window, softcap=softcap,
                                   dtype=q.dtype, upcast=False)
    check_against_reference(run.out, ref, plain, what="O")
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(run.lse))
    _, plain32 = attention_reference(q, k, v, causal=cfg.causal, window=window,
                                     softcap=softcap, dtype=torch.float32)
    check_against_reference(run.lse[finite], ref_lse[finite], plain32[finite],
                            atol=1e-5 * float(ref_lse[finite].abs().max()), what="LSE")
    emu, emu_lse = emulate_sm100_fwd(q, k, v, causal=cfg.causal, window_size=window,
                                     config=cfg, softcap=softcap)
    assert (run.out.float() - emu.float()).abs().max() <= 2 ** -7  # one bf16 ulp of |O| <= 1
    assert torch.allclose(run.lse[finite], emu_lse[finite], atol=1e-5, rtol=1e-6)
