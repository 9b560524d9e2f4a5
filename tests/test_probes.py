"""Cost probes of the SM90 backward (``fa_sm100.hopper.probes``, Note [cost probes]): the
probe context, the compile key that keeps probed kernels apart from plain ones, and, on the
sm_90a SASS cross-compiled on the CPU, that each ``dq_reduce`` probe changes the dq-store
warp's bulk operations as it says and nothing once it is closed."""

import glob
import re

import pytest

from fa_sm100.hopper import probes
from fa_sm100.hopper.bwd_config import select_bwd_config
from fa_sm100.hopper.bwd_interface import main_compile_key
from fa_sm100.inspection import inspect_kernel
from kept_sass import read_kept_sass


def test_probe_is_active_only_inside_its_block():
    assert probes.active("dq_reduce") is None and probes.compile_tag() == ()
    with probes.probe("dq_reduce", "half"):
        assert probes.active("dq_reduce") == "half"
        assert probes.compile_tag() == (("dq_reduce", "half"),)
        with pytest.raises(ValueError, match="already active"):
            with probes.probe("dq_reduce", "none"):
                pass
        assert probes.active("dq_reduce") == "half"  # the refused inner block changed nothing
    assert probes.active("dq_reduce") is None
    with pytest.raises(RuntimeError):
        with probes.probe("dq_reduce", "none"):
            raise RuntimeError("a failing call inside the probe")
    assert probes.compile_tag() == ()  # closed on the way out of an exception too


@pytest.mark.parametrize("spec,message", [
    ("dq_reduce", "expected name=value"),
    ("dq_reduce=some", "values are ['copy', 'half', 'none']"),
    ("dk_store=none", "unknown probe 'dk_store'"),
])
def test_bad_probes_raise(spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        probes.parse_probe(spec)


def test_probed_kernels_compile_under_their_own_key():
    cfg = select_bwd_config(head_dim=128, causal=False, seqlen_q=16384, seqlen_k=16384)
    assert main_compile_key(cfg) == cfg
    keys = set()
    for value in probes.PROBES["dq_reduce"]:
        with probes.probe("dq_reduce", value):
            keys.add(main_compile_key(cfg))
    assert len(keys) == 3 and cfg not in keys
    assert main_compile_key(cfg) == cfg


def test_dq_reduce_needs_bulk_dq():
    probes.check_probe_config("dq_reduce", "none", select_bwd_config(head_dim=128))
    red = select_bwd_config(head_dim=256)
    assert red.dq_accum == "red"
    with pytest.raises(ValueError, match="nothing to probe"):
        probes.check_probe_config("dq_reduce", "none", red)


def _bulk_ops(report):
    """Counts of the dq-store warp's bulk SMEM -> global operations in a report's SASS."""
    h = report["sass_full"]
    return h.get("UBLKRED.G.S.ADD.F32.RN", 0), h.get("UBLKCP.G.S", 0)


def _reduce_bytes(keep_dir) -> list:
    """The byte counts of the bulk reduces in the PTX a compile kept."""
    (path,) = glob.glob(str(keep_dir / "*.ptx"))
    with open(path) as f:
        ptx = f.read()
    return re.findall(r"cp\.reduce\.async\.bulk\.global\.shared::cta\.bulk_group\.add\.f32 "
                      r"\[[^]]+\], \[[^]]+\], (\d+);", ptx)


@pytest.mark.compile
def test_dq_reduce_probes_change_the_bulk_operations_and_nothing_after(tmp_path):
    """hdim 128 ("bulk" dQ, one reduce and one first-store copy per warpgroup half): none
    drops both, copy turns the reduces into copies, half halves their byte counts; the plain
    kernel compiled after the probes is the one compiled before them."""
    overrides = ["head_dim=128"]
    before = inspect_kernel("sm90_bwd", "sm_90a", overrides, keep_dir=tmp_path / "before")
    assert _bulk_ops(before) == (2, 2)
    got = {}
    for value in probes.PROBES["dq_reduce"]:
        with probes.probe("dq_reduce", value):
            got[value] = inspect_kernel("sm90_bwd", "sm_90a", overrides,
                                        keep_dir=tmp_path / value)
    assert _bulk_ops(got["none"]) == (0, 0)
    assert _bulk_ops(got["copy"]) == (0, 4)
    assert _bulk_ops(got["half"]) == (2, 2)
    plain, half = _reduce_bytes(tmp_path / "before"), _reduce_bytes(tmp_path / "half")
    assert plain == ["20480", "20480"] and half == ["10240", "10240"]  # 80 x 64 float32 / half
    inspect_kernel("sm90_bwd", "sm_90a", overrides, keep_dir=tmp_path / "after")
    assert read_kept_sass(tmp_path / "after") == read_kept_sass(tmp_path / "before")
