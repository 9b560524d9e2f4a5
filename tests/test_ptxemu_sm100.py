"""PTX emulator, the project's SM100 forward: the kernel's own sm_100a PTX (all 16 warps, TMA,
tcgen05, mbarrier pipelines, 2-CTA pairs) executed on the emulator for small problems.

Contract checked per configuration: O and LSE meet the project's error rule against the
float64 reference (fa_sm100.testing), O does not depend on the scheduler seed, and O and LSE
are bit-identical to the numerics emulation (fa_sm100.emulation), the kernel's algorithm
written independently in torch (both share only the models of what the ISA leaves open:
correctly rounded MUFU results, one rounding per MMA instruction). Removing a
tcgen05.wait::st or the cluster mbarrier arrivals from the kernel's PTX must be reported.
Each run compiles the kernel (~5-10 s) and emulates it (~3-8 s)."""

import math

import pytest
import torch

pytest.importorskip("cutlass")

from fa_sm100.config import config_from_overrides  # noqa: E402
from fa_sm100.ptxemu.sm100_run import compare, run_forward  # noqa: E402

pytestmark = pytest.mark.slow

CASES = {
    # name: (batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, overrides, inputs)
    "default_hdim64": (1, 128, 128, 1, 1, 64, [], "randn"),
    "1cta_qstage1_causal_gqa_seq200_batch2": (2, 200, 200, 2, 1, 64,
                                              ["use_2cta=false", "q_stage=1", "causal=true"],
                                              "randn"),
    "nosplit_noex2emu_hdim128_fp16": (1, 128, 128, 2, 2, 128,
                                      ["split_p=false", "ex2_emu_fraction=0", "dtype=float16"],
                                      "randn"),
    # three K/V tiles whose scores rise by 12.8 log2 units per tile in processing order:
    # the correction warps must rescale O (threshold 8), and the pipelines wrap around
    "default_3tiles_rescale": (1, 128, 384, 1, 1, 64, [], "rising_order"),
}


def _inputs(b, sq, sk, h, hk, d, kind, seed=0, dtype="bf16"):
    from fa_sm100.emulation.cases import Case, make_inputs
    case = Case(name="ptxemu", seqlen_q=sq, seqlen_k=sk, heads=h, kv_heads=hk, head_dim=d,
                head_dim_v=d, batch=b, inputs=kind, slope=0.1, seed=seed, dtype=dtype)
    return make_inputs(case)


@pytest.mark.parametrize("name", list(CASES))
def test_sm100_forward_on_emulator(name):
    b, sq, sk, h, hk, d, sets, kind = CASES[name]
    cfg = config_from_overrides([f"head_dim={d}", f"head_dim_v={d}",
                                 f"qhead_per_kvhead={h // hk}"] + sets)
    q, k, v = _inputs(b, sq, sk, h, hk, d, kind,
                      dtype="fp16" if cfg.dtype == "float16" else "bf16")
    seeds = (0, 5) if name == "default_hdim64" else (1,)
    outs, lses = [], []
    for seed in seeds:
        run = run_forward(cfg, q, k, v, seed=seed)
        res = compare(run, cfg, q, k, v)
        assert res["rule_ok"], res["rule_failures"]
        outs.append(run.out)
        lses.append(run.lse)
    # the result does not depend on the warp interleaving
    for o in outs[1:]:
        assert torch.equal(o, outs[0])
    from fa_sm100.emulation import emulate_sm100_fwd
    emu, emu_lse, stats = emulate_sm100_fwd(q, k, v, 1.0 / math.sqrt(d), causal=cfg.causal,
                                      config=cfg, return_stats=True)
    if kind == "rising_order":
        assert stats.rescaled > 0           # the inputs do exercise the correction path
    assert torch.equal(outs[0], emu)
    assert torch.equal(lses[0], emu_lse)


def _drop_lines(pattern):
    def edit(ptx):
        lines = ptx.splitlines()
        kept = [ln for ln in lines if pattern not in ln]
        assert len(kept) < len(lines), f"no line with {pattern!r}"
        return "\n".join(kept)
    return edit


def test_missing_tcgen05_wait_st_in_the_forward_is_reported():
    """Without tcgen05.wait::st the softmax warps' P stores are still in flight when the MMA
    warp's P.V reads that TMEM: the emulator must say so, naming both instructions."""
    from fa_sm100.ptxemu import EmulationError
    b, sq, sk, h, hk, d, sets, kind = CASES["default_hdim64"]
    cfg = config_from_overrides([f"head_dim={d}", f"head_dim_v={d}"])
    q, k, v = _inputs(b, sq, sk, h, hk, d, kind)
    with pytest.raises(EmulationError, match=r"tcgen05\.(st|mma).*pending"):
        run_forward(cfg, q, k, v, ptx_edit=_drop_lines("tcgen05.wait::st"))


def test_missing_mbarrier_arrive_in_the_forward_deadlocks_with_a_report():
    from fa_sm100.ptxemu import EmulationError
    b, sq, sk, h, hk, d, sets, kind = CASES["default_hdim64"]
    cfg = config_from_overrides([f"head_dim={d}", f"head_dim_v={d}"])
    q, k, v = _inputs(b, sq, sk, h, hk, d, kind)
    with pytest.raises(EmulationError, match="deadlock") as e:
        run_forward(cfg, q, k, v, ptx_edit=_drop_lines("mbarrier.arrive.shared::cluster.b64"))
    assert "mbarrier.try_wait" in str(e.value)


def _tmem_a_with_offset(ptx: str) -> str:
    """Each TMEM A operand ``[%rA]`` of a tcgen05.mma becomes ``[t+8]`` with ``t = %rA - 8``
    in an inline scope: the same address, spelled with an immediate column offset (FA4's PTX
    uses that form)."""
    import re

    out, n = [], 0
    for line in ptx.splitlines():
        m = re.match(r"^(\s*)(tcgen05\.mma\S*\s+\[[^\]]+\],\s*)\[(%r\d+)\](.*)$", line)
        if m:
            indent, head, reg, tail = m.groups()
            line = (f"{indent}{{ .reg .b32 tofs<2>; sub.s32 tofs1, {reg}, 8; "
                    f"{head}[tofs1+8]{tail} }}")
            n += 1
        out.append(line)
    assert n > 0, "no tcgen05.mma with a TMEM A operand in the PTX"
    return "\n".join(out)


def test_tmem_a_operand_offset_is_honoured():
    """The PV MMAs read P from TMEM; written as ``[base - 8 + 8]`` they must compute the same
    bits (an emulator that dropped the immediate offset read A 8 columns early)."""
    from fa_sm100.emulation import emulate_sm100_fwd

    cfg = config_from_overrides(["head_dim=64", "head_dim_v=64", "use_2cta=false", "q_stage=1"])
    q, k, v = _inputs(1, 128, 256, 1, 1, 64, "randn")
    run = run_forward(cfg, q, k, v, ptx_edit=_tmem_a_with_offset)
    out, lse = emulate_sm100_fwd(q, k, v, 1.0 / math.sqrt(64), config=cfg)
    assert torch.equal(run.out.view(torch.int16), out.view(torch.int16))
