"""``effective()`` of the SM90 configs: switches that a kernel does not read in a config.

``scripts/ab_bench.py`` calls a variant an A/A check of noise when its config and the
default's have equal ``effective()`` configs. That claim is only as good as "equal
``effective()`` configs build the same kernel", which these compile tests check on the
sm_90a SASS (cross-compiled on the CPU), with a control pair that differs.
"""

import re

import pytest

from fa_sm100.hopper.bwd_defaults import select_bwd_config
from fa_sm100.inspection import inspect_kernel
from fa_sm100.registry import get_kernel
from kept_sass import read_kept_sass

# (kernel, --set overrides of the pair, the fields that differ): configs the same effective()
# makes equal, and one control pair per kernel that it does not
SAME = [
    ("sm90_bwd", ["head_dim=128", "causal=true", "qdo_multicast=true"], ["stats_first=true"]),
    ("sm90_bwd", ["head_dim=96"], ["stats_shuffle=false"]),
    ("sm90_bwd", ["head_dim=96"], ["dp_wait_after=10"]),  # 64-row blocks: no boundary
    ("sm90_bwd", ["head_dim=128", "qdo_multicast=false"], ["qdo_cluster=4"]),
    ("sm90_fwd", ["head_dim=128", "kv_multicast=false"],
     ["peer_release=false", "kv_cluster=4", "multicast_odd_m=false"]),
    ("sm90_fwd", ["head_dim=64", "kv_multicast=true", "kv_cluster=4", "persistent=false"],
     ["multicast_odd_m=false"]),
    ("sm90_bwd", ["head_dim=128"], ["tail_ctas=100"]),  # non-causal: not longest first
    ("sm90_fwd", ["head_dim=128"], ["l2_section_mib=40"]),  # non-causal: no sections
    ("sm90_fwd", ["head_dim=256", "causal=true"], ["k_before_q=true"]),  # O in Q's buffer
]
DIFFERENT = [
    ("sm90_bwd", ["head_dim=96"], ["stats_first=true"]),  # 64-row blocks read it
    ("sm90_fwd", ["head_dim=64", "kv_multicast=true", "persistent=true"],
     ["peer_release=false"]),
    ("sm90_fwd", ["head_dim=128", "causal=true"], ["k_before_q=true"]),  # O has its own buffer
]


def _instructions(sass: str) -> list:
    """Every SASS instruction with its guard and operands (the address comments dropped)."""
    return re.findall(r"/\*[0-9a-f]{4,}\*/\s+([^;]*?)\s*;", sass)


def _config(kernel, overrides):
    """The config ``inspect_kernel`` compiles for these ``--set`` overrides."""
    return get_kernel(kernel).make_config(overrides)


def test_effective_configs_name_exactly_the_unread_switches():
    """The CPU half: each SAME pair has equal effective() configs but unequal configs, each
    DIFFERENT pair unequal effective() configs; effective() keeps every other field."""
    for kernel, base, changed in SAME + DIFFERENT:
        a, b = _config(kernel, base), _config(kernel, base + changed)
        assert a != b, (kernel, changed)
        assert (a.effective() == b.effective()) == ((kernel, base, changed) in SAME), changed
        assert a.effective().effective() == a.effective()
    bwd = select_bwd_config(head_dim=128, causal=True, seqlen_q=16384, seqlen_k=16384)
    assert bwd.effective().replace(stats_first=bwd.stats_first) == bwd


@pytest.mark.compile
@pytest.mark.parametrize("case", SAME + DIFFERENT,
                         ids=lambda c: f"{c[0]}-{'-'.join(c[1])}-{'-'.join(c[2])}")
def test_equal_effective_configs_build_the_same_sass(case, tmp_path):
    """The GPU-free half: the pair's kernels, cross-compiled for sm_90a, have the same SASS
    instructions, operands and all, exactly when their effective() configs are equal (the control pairs differ,
    so the comparison can fail)."""
    kernel, base, changed = case
    listings = []
    for name, overrides in (("a", base), ("b", base + changed)):
        inspect_kernel(kernel, "sm_90a", overrides, keep_dir=tmp_path / name)
        listings.append(_instructions(read_kept_sass(tmp_path / name)))
    assert len(listings[0]) > 500
    assert (listings[0] == listings[1]) == (case in SAME), (case, len(listings[0]),
                                                            len(listings[1]))
