"""The SM100 kernel's recorded protocol, checked by the protocol model (issue 4, item 8).

Contract: the programs recorded while the kernel itself is traced (``kernel_recording``)
cover every role, follow the design's load order (K[n-1], Q stages, V[n-1], then K/V pairs),
and the protocol model (pipelines.model, via pipelines.check.check_config) finds no deadlock,
over-arrival, phase overrun, dangling arrival or race for several trip counts -- while the
same programs with a release dropped are rejected (so this check can fail).
"""

import os

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_100a")

from fa_sm100.config import config_from_overrides  # noqa: E402

pytestmark = [pytest.mark.compile, pytest.mark.slow]

# The first three are also compile-contract configs (their recordings are reused when
# test_sm100_compile.py ran first in the session); then the design's one-K/V-stage case and
# a paged-cache kernel.
CONFIGS = {
    "default": [],
    "1cta": ["use_2cta=false"],
    "q_stage1_2cta_no_split_p": ["q_stage=1", "use_2cta=true", "split_p=false"],
    "1cta_q1_nosplit_kv1": ["use_2cta=false", "q_stage=1", "split_p=false", "kv_stage=1"],
    # a paged cache: the load warp reads each block's page; its protocol must be unchanged
    "varlen_paged": ["varlen=true", "page_size=128", "qhead_per_kvhead=2"],
}
ROLES = {"load", "mma", "softmax0", "softmax1", "correction", "epilogue"}


def recording(name):
    from fa_sm100.sm100.protocol import kernel_recording

    return kernel_recording(config_from_overrides(CONFIGS[name]))


def findings(cfg, programs, n_blocks=(1, 2, 3), work_tiles=(1, 2)):
    from pipelines.check import check_config

    rows = check_config(cfg, programs, n_blocks, work_tiles, seeds=3, exhaustive_states=1500)
    return [f for r in rows for f in r["findings"]]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_model_finds_no_protocol_error_in_the_kernel(name):
    cfg = config_from_overrides(CONFIGS[name])
    rec = recording(name)
    assert set(rec.programs) == ROLES
    assert findings(cfg, rec.programs) == []


def test_load_order_is_the_reverse_kv_order_of_the_design():
    from pipelines.record import Event, Loop

    prog = recording("default").programs["load"]
    (tile_loop,) = [n for n in prog if isinstance(n, Loop)]
    assert tile_loop.trips == "work_tiles"
    seq = [(n.region, n.note) for n in tile_loop.body if isinstance(n, Event) and n.op == "access"]
    assert seq == [("sKV", "K"), ("sQ0", ""), ("sQ1", ""), ("sKV", "V")]
    (kv_loop,) = [n for n in tile_loop.body if isinstance(n, Loop)]
    assert kv_loop.trips == "n_blocks - 1"
    inner = [n.note for n in kv_loop.body if isinstance(n, Event) and n.op == "access"]
    assert inner == ["K", "V"]


@pytest.mark.parametrize("pipe", ["s_p_o", "kv", "o_epi"])
def test_model_rejects_the_kernel_protocol_with_a_dropped_release(pipe):
    from pipelines.program import inject

    cfg = config_from_overrides(CONFIGS["default"])
    broken = inject(recording("default").programs, "drop-release", pipe)
    assert findings(cfg, broken, n_blocks=(3,), work_tiles=(2,)), f"dropping {pipe} releases went unnoticed"
