"""sm_90a compile contract of the SM90 forward (issue 6 item 5), cross-compiled on the CPU.

Contract, read from the cubin/SASS through ``fa_sm100.inspection.inspect_kernel``: HGMMA
(warpgroup MMA) present, exactly one GEMM per issue site (no duplicated or lost k-steps), the
config's setmaxnreg values in the code, 128 x (1 + consumers) threads, no local memory and no
spills, SMEM within the sm_90a budget, TMA loads and the TMA store of O.
"""

import pytest

from fa_sm100.hopper.config import SM90_SMEM_BUDGET, sm90_fwd_config_from_overrides
from fa_sm100.inspection import inspect_kernel


def expected_hgmma(cfg) -> int:
    """HGMMA instructions the mainloop code should contain (one per k-step per GEMM site)."""
    qk, pv = cfg.head_dim // 16, cfg.n_block // 16
    if cfg.intra_wg_overlap:
        # first S; one overlapped step per loop (causal: masked + unmasked); last PV
        loops = 2 if cfg.causal else 1
        return qk + loops * (qk + pv) + pv
    # first serial step, then one per loop
    return (1 + (2 if cfg.causal else 1)) * (qk + pv)


CASES = [
    [],  # hdim 128, non-causal, ping-pong + intra-warpgroup overlap
    ["head_dim=64", "causal=true"],  # three consumer warpgroups, causal mask loops
    ["head_dim=256", "causal=true"],  # no ping-pong, O rescaled before the PV GEMM
    ["intra_wg_overlap=false", "pingpong=false", "causal=true"],
]


@pytest.mark.compile
@pytest.mark.parametrize("overrides", CASES, ids=lambda o: ",".join(o) or "default")
def test_sm90_fwd_compile_contract(overrides):
    cfg = sm90_fwd_config_from_overrides(overrides)
    rep = inspect_kernel("sm90_fwd", "sm_90a", overrides)
    assert rep["arch"] == "sm_90a" and rep["kernel"] == "sm90_fwd"
    assert rep["threads_per_cta"] == cfg.num_threads
    assert rep["cluster"] == [1, 1, 1]
    assert rep["sass"]["HGMMA"] == expected_hgmma(cfg), rep["sass"]
    assert rep["sass"]["USETMAXREG"] == 2  # producer gives registers away, consumers take them
    assert rep["setmaxnreg"] == {"producer": cfg.regs_producer, "consumer": cfg.regs_consumer}
    assert rep["spill_bytes"] == 0 and rep["local_bytes"] == 0
    assert rep["smem_bytes"] == cfg.smem_bytes() <= SM90_SMEM_BUDGET
    assert rep["sass"]["UTMALDG"] > 0 and rep["sass"]["UTMASTG"] > 0
    assert rep["sass"]["MUFU.EX2"] > 0
    assert not [w for w in rep["warnings"] if "setmaxnreg" in w], rep["warnings"]
