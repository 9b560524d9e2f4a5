"""The SM90 backward's SASS, pinned for three default configs: a change to the kernel's Python
that is meant to keep the compiled kernel as it is (a refactor: moving code between role
modules, bundling arguments into context objects) must keep these numbers. A change that is
meant to change the kernel updates them, and its CHANGELOG entry says by how much."""

import pytest

from fa_sm100.inspection import inspect_kernel

# (overrides of the hdim 128 bf16 defaults, SASS instructions, SMEM bytes), cross-compiled for
# sm_90a with the DSL the compile contracts use (pyproject.toml)
PINNED = [
    ([], 1520, 232448),
    (["causal=true"], 1696, 232448),
    (["head_dim=64", "causal=true"], 1640, 199680),
]


@pytest.mark.compile
@pytest.mark.parametrize("overrides,instructions,smem", PINNED,
                         ids=[",".join(c[0]) or "default" for c in PINNED])
def test_sm90_bwd_default_sass_is_pinned(overrides, instructions, smem):
    """The whole listing's instruction count, the SMEM bytes, 168 registers at launch and no
    spill are the pinned ones."""
    r = inspect_kernel("sm90_bwd", "sm_90a", overrides)
    assert sum(r["sass_full"].values()) == instructions
    assert r["smem_bytes"] == smem
    assert r["regs_at_launch"] == 168
    assert r["spill_bytes"] == 0 and r["local_bytes"] == 0
