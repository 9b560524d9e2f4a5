"""FlashAttention-4's SM100 forward on the PTX emulator (``fa_sm100.ptxemu.fa4_run``): a
foreign production kernel as the emulator's independent check.

Contract: FA4 4.0.0b36's forward, compiled for sm_100a and run on the emulator under the
"late" schedule (and a random one), runs to the end with no report, and its O and LSE meet the
project's rule against float64: 1-CTA and 2-CTA, causal and not, one and two Q stages, GQA,
a tail of rows and keys, bf16 and fp16, each with the options FA4's interface picks (it builds
no 2-CTA causal kernel below head dim 256). Every one of them compiles here. Skips when
flash-attn-4 is not installed (the test extra installs it)."""

import pytest
import torch

pytest.importorskip("cutlass")
pytest.importorskip("flash_attn.cute.flash_fwd_sm100",
                    reason="FlashAttention-4 (pip install -e '.[test]') is not installed")

from fa_sm100.ptxemu.fa4_run import fa4_choices, run_fa4_forward  # noqa: E402
from fa_sm100.testing import attention_reference, check_against_reference  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.compile]

CASES = {
    # name: (batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, causal, dtype); FA4's own
    # choices (fa4_run.fa4_choices) decide 2-CTA, Q stages and the scheduler
    "1cta_d64": (1, 128, 256, 1, 1, 64, False, torch.bfloat16),
    "1cta_d64_causal_tail_2stages": (1, 200, 200, 1, 1, 64, True, torch.bfloat16),
    "1cta_d64_gqa_fp16": (1, 128, 256, 2, 1, 64, False, torch.float16),
    "2cta_d128": (1, 256, 256, 1, 1, 128, False, torch.bfloat16),
    "1cta_d128_causal": (1, 256, 384, 1, 1, 128, True, torch.bfloat16),
}


def _inputs(name, seed):
    b, sq, sk, h, hk, d, causal, dtype = CASES[name]
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, s, heads, d, generator=gen).to(dtype)
               for s, heads in ((sq, h), (sk, hk), (sk, hk)))
    return q, k, v, causal


@pytest.mark.parametrize("name", list(CASES))
def test_fa4_forward_on_the_emulator_meets_the_float64_rule(name):
    q, k, v, causal = _inputs(name, len(name))
    run = run_fa4_forward(q, k, v, causal=causal)
    assert run.launch["cluster"] == ((2, 1, 1) if name.startswith("2cta") else (1, 1, 1))
    ref, ref_lse = attention_reference(q, k, v, causal=causal)
    plain, plain_lse = attention_reference(q, k, v, causal=causal, dtype=q.dtype, upcast=False)
    check_against_reference(run.out, ref, plain, atol=1e-3, what=f"FA4 {name} O")
    check_against_reference(run.lse, ref_lse, plain_lse.float(), atol=1e-3,
                            what=f"FA4 {name} LSE")


def test_fa4_builds_no_2cta_causal_kernel_below_head_dim_256():
    """What the issue asked of a 2-CTA causal run, answered from FA4's own choices: its
    interface takes 2-CTA instructions only without a causal mask at head dims 128 / 192."""
    assert fa4_choices(512, 128, 128, causal=False)["use_2cta_instrs"]
    assert not fa4_choices(512, 128, 128, causal=True)["use_2cta_instrs"]


def test_fa4_forward_is_schedule_independent():
    """The same inputs under the random schedule give FA4's output bit for bit."""
    q, k, v, causal = _inputs("1cta_d64_causal_tail_2stages", 7)
    late = run_fa4_forward(q, k, v, causal=causal)
    rnd = run_fa4_forward(q, k, v, causal=causal, policy="random", seed=3)
    assert torch.equal(late.out.view(torch.int16), rnd.out.view(torch.int16))


def test_strict_fences_find_both_forwards_without_tcgen05_thread_sync_fences():
    """Note [tcgen05 thread-sync fences]: neither FA4's forward nor this project's emits the
    ISA's tcgen05 thread-sync fences; the strict mode names the first place in each (a
    finding, docs/ptx_emulator.md; both run correctly without the strict mode)."""
    from fa_sm100.config import config_from_overrides
    from fa_sm100.ptxemu.memory import EmulationError
    from fa_sm100.ptxemu.sm100_run import run_forward

    q, k, v, causal = _inputs("1cta_d64", 1)
    with pytest.raises(EmulationError, match="strict fences"):
        run_fa4_forward(q, k, v, causal=causal, strict_fences=True)
    cfg = config_from_overrides(["head_dim=64", "head_dim_v=64", "use_2cta=false"])
    with pytest.raises(EmulationError, match="strict fences"):
        run_forward(cfg, q, k, v, strict_fences=True)
