"""Cost probes of the SM90 backward (``fa_sm100.hopper.probes``, Note [cost probes]): the
probe context, the compile key that keeps probed kernels apart from plain ones, and, on the
sm_90a SASS cross-compiled on the CPU, that each probe changes what it says (``dq_reduce``: the
dq-store warp's bulk operations; ``ds_barrier``: the MMA loop's ``DS_READY`` barrier;
``sweep``: where the loops end, not their body; ``dq_post``: the launch plan) and nothing once
it is closed."""

import glob
import os
import re

import pytest

from fa_sm100.hopper import probes
from fa_sm100.hopper.bwd_defaults import select_bwd_config
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


def test_probe_sets_apply_together_and_refuse_a_name_twice():
    pairs = probes.parse_probe_set("pointwise=none+ds_barrier=none")
    assert pairs == (("pointwise", "none"), ("ds_barrier", "none"))
    with probes.probes_active(pairs):
        assert probes.compile_tag() == (("ds_barrier", "none"), ("pointwise", "none"))
    assert probes.compile_tag() == ()
    with pytest.raises(ValueError, match="each probe once"):
        probes.parse_probe_set("dq_reduce=none+dq_reduce=half")
    with pytest.raises(ValueError, match="expected name=value"):
        probes.parse_probe_set("dq_reduce=none+")
    with pytest.raises(ValueError, match="already active"):  # a set beside an open probe
        with probes.probe("pointwise", "none"), probes.probes_active(pairs):
            pass
    assert probes.compile_tag() == ()


def test_probed_kernels_compile_under_their_own_key():
    cfg = select_bwd_config(head_dim=128, causal=False, seqlen_q=16384, seqlen_k=16384)
    assert main_compile_key(cfg) == cfg
    keys = set()
    for value in probes.PROBES["dq_reduce"]:
        with probes.probe("dq_reduce", value):
            keys.add(main_compile_key(cfg))
    with probes.probe("ds_barrier", "none"):
        keys.add(main_compile_key(cfg))
        with probes.probe("dq_reduce", "none"):  # two probes at once: a key of their own
            keys.add(main_compile_key(cfg))
    with probes.probe("sweep", "twice"):
        keys.add(main_compile_key(cfg))
    assert len(keys) == 6 and cfg not in keys
    with probes.probe("dq_post", "none"):  # the main kernel does not read it: the plain key
        assert main_compile_key(cfg) == cfg
    assert main_compile_key(cfg) == cfg


# Configs whose traced code paths reach every probe read: "bulk" dQ (dq_reduce), shuffled
# statistics (stats: hdim 64's 128-row blocks, hdim 128 causal), "red" dQ (hdim 256)
READ_CONFIGS = [dict(head_dim=128), dict(head_dim=64), dict(head_dim=256),
                dict(head_dim=128, causal=True)]


@pytest.mark.compile
def test_the_main_kernel_key_carries_exactly_the_probes_its_code_reads():
    """``MAIN_KERNEL_PROBES`` (what ``main_compile_key`` tags) is the set of probes the main
    kernel reads while it is traced (``probes.recording_reads`` around a cross-compile of each
    of READ_CONFIGS): one read there and not in the key would let a probed kernel serve a
    plain call, one in the key and never read would compile a second, identical kernel. The
    launch plan reads ``dq_post`` (which kernels run) and the forward its own."""
    from fa_sm100.compile_tools import cross_compile
    from fa_sm100.hopper.bwd_interface import fake_arguments, kernel_specs
    from fa_sm100.hopper.bwd_kernel import Sm90FlashBackward

    read, planned = set(), set()
    for fields in READ_CONFIGS:
        cfg = select_bwd_config(**fields)
        with probes.recording_reads() as reads:
            cross_compile(Sm90FlashBackward(cfg.kernel_config()), fake_arguments(cfg), "sm_90a")
        read |= reads
        with probes.recording_reads() as reads:
            kernel_specs(cfg)
        planned |= reads
    assert read == set(probes.MAIN_KERNEL_PROBES)
    assert planned == {"dq_post"}
    assert set(probes.PROBES) == read | planned | set(probes.FWD_KERNEL_PROBES)


@pytest.mark.compile
def test_the_forward_key_carries_exactly_the_probes_its_code_reads():
    """``FWD_KERNEL_PROBES`` (what ``compile_sm90_fwd`` keys on) is the set of probes the
    forward reads while it is traced (the default config, whose rescale vote is the probed
    one)."""
    from fa_sm100.compile_tools import cross_compile
    from fa_sm100.hopper.fwd_kernel import Sm90FwdKernel
    from fa_sm100.hopper.config import select_sm90_fwd_config
    from fa_sm100.hopper.interface import fake_arguments

    cfg = select_sm90_fwd_config(128, causal=True, seqlen_q=4096, seqlen_k=4096)
    with probes.recording_reads() as reads:
        cross_compile(Sm90FwdKernel(cfg), fake_arguments(cfg), "sm_90a")
    assert reads == set(probes.FWD_KERNEL_PROBES)


def test_recorded_reads_nest_and_end_with_their_block():
    """An inner recording's reads count in the outer one too; none are recorded after."""
    with probes.recording_reads() as outer:
        probes.active("sweep")
        with probes.recording_reads() as inner:
            probes.active("stats")
        assert inner == {"stats"}
    assert outer == {"sweep", "stats"}
    probes.active("pointwise")
    assert outer == {"sweep", "stats"}


def test_dq_reduce_needs_bulk_dq():
    probes.check_probe_config("dq_reduce", "none", select_bwd_config(head_dim=128))
    red = select_bwd_config(head_dim=256)
    assert red.dq_accum == "red"
    with pytest.raises(ValueError, match="nothing to probe"):
        probes.check_probe_config("dq_reduce", "none", red)


@pytest.mark.parametrize("hk", [4, 2], ids=["mha", "gqa"])
def test_dq_post_probe_leaves_only_the_dq_postprocess_out_of_the_plan(hk):
    """``dq_post=none``: the call's chain without the dQ postprocess; every other kernel (and
    the GQA dK/dV postprocesses) stays, and the plain plan comes back once it is closed."""
    import torch

    from fa_sm100.hopper.bwd_interface import launch_plan

    cfg = select_bwd_config(head_dim=128, qhead_per_kvhead=4 // hk)
    meta = dict(device="meta", dtype=torch.bfloat16)
    q, dq, out, dout = (torch.empty(1, 300, 4, 128, **meta) for _ in range(4))
    k, dk, v, dv = (torch.empty(1, 300, hk, 128, **meta) for _ in range(4))
    lse = torch.empty(1, 4, 300, device="meta", dtype=torch.float32)
    kinds = lambda: [c[0] for c in launch_plan(cfg, q, k, v, out, dout, lse, dq, dk, dv, 0.1)]
    plain = kinds()
    assert plain == ["pre", "main", "post_dq"] + ["post"] * (2 * (hk != 4))
    with probes.probe("dq_post", "none"):
        assert kinds() == [kind for kind in plain if kind != "post_dq"]
    assert kinds() == plain


def test_sweep_probe_refuses_causal_and_deterministic_problems_before_any_compile():
    probes.check_probe_config("sweep", "twice", select_bwd_config(head_dim=128))
    causal = select_bwd_config(head_dim=128, causal=True, seqlen_q=16384, seqlen_k=16384)
    with pytest.raises(ValueError, match="non-causal sweeps only"):
        probes.check_probe_config("sweep", "twice", causal)
    with probes.probe("sweep", "twice"):  # what sm90_bwd's launch plan asks first
        with pytest.raises(ValueError, match="non-causal sweeps only"):
            main_compile_key(causal)
    det = select_bwd_config(head_dim=128, deterministic=True)
    with pytest.raises(ValueError, match="cannot run deterministic"):
        probes.check_probe_config("sweep", "twice", det)


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


@pytest.mark.compile
@pytest.mark.parametrize("head_dim", [64, 128])
def test_ds_barrier_probe_drops_one_barrier_and_nothing_else(tmp_path, head_dim):
    """``ds_barrier=none`` takes exactly one ``BAR.SYNC`` out of the kernel (the ``DS_READY``
    wait of the MMA loop), leaves every GEMM, exp2 and bulk operation where it was, and the
    plain kernel compiled afterwards is the one compiled before."""
    overrides = [f"head_dim={head_dim}"]
    before = inspect_kernel("sm90_bwd", "sm_90a", overrides, keep_dir=tmp_path / "before")
    with probes.probe("ds_barrier", "none"):
        probed = inspect_kernel("sm90_bwd", "sm_90a", overrides, keep_dir=tmp_path / "probed")
    bar = "BAR.SYNC.DEFER_BLOCKING"
    assert probed["sass_full"][bar] == before["sass_full"][bar] - 1
    for op in ("HGMMA", "MUFU.EX2", "UTMALDG", "UTMASTG", "USETMAXREG"):
        assert probed["sass"][op] == before["sass"][op] > 0, op
    assert _bulk_ops(probed) == _bulk_ops(before)
    assert probed["spill_bytes"] == before["spill_bytes"] == 0
    inspect_kernel("sm90_bwd", "sm_90a", overrides, keep_dir=tmp_path / "after")
    assert read_kept_sass(tmp_path / "after") == read_kept_sass(tmp_path / "before")


@pytest.mark.compile
def test_sweep_probe_keeps_the_loop_body_and_nothing_after(tmp_path):
    """``sweep=twice`` changes where the three roles' loops end, not what a step does: the
    same GEMMs, exp2s, bulk operations and TMA copies, no spills; the plain kernel compiled
    afterwards is the one compiled before."""
    overrides = ["head_dim=128"]
    before = inspect_kernel("sm90_bwd", "sm_90a", overrides, keep_dir=tmp_path / "before")
    with probes.probe("sweep", "twice"):
        probed = inspect_kernel("sm90_bwd", "sm_90a", overrides, keep_dir=tmp_path / "probed")
    for op in ("HGMMA", "MUFU.EX2", "UTMALDG", "UTMASTG", "STS.128", "BAR.SYNC"):
        assert probed["sass"][op] == before["sass"][op] > 0, op
    assert _bulk_ops(probed) == _bulk_ops(before)
    assert probed["spill_bytes"] == before["spill_bytes"] == 0
    assert read_kept_sass(tmp_path / "probed") != read_kept_sass(tmp_path / "before")
    inspect_kernel("sm90_bwd", "sm_90a", overrides, keep_dir=tmp_path / "after")
    assert read_kept_sass(tmp_path / "after") == read_kept_sass(tmp_path / "before")


@pytest.mark.compile
@pytest.mark.parametrize("causal", [False, True])
def test_pointwise_probe_leaves_the_gemms_and_takes_the_math(tmp_path, causal):
    """``pointwise=none`` takes every exp2 and the stats' shuffles out of the MMA loop and
    keeps what moves data: the same GEMMs, TMA copies, bulk operations, barriers and dQ
    staging stores, no spills; the plain kernel compiled afterwards is the one compiled
    before. (Shuffled statistics, as the probe was measured in round 34: hdim 128's default
    loads them since round 36, Note [dP wait placement].)"""
    overrides = ["head_dim=128", f"causal={causal}", "qdo_multicast=true", "stats_shuffle=true"]
    before = inspect_kernel("sm90_bwd", "sm_90a", overrides, keep_dir=tmp_path / "before")
    with probes.probe("pointwise", "none"):
        probed = inspect_kernel("sm90_bwd", "sm_90a", overrides, keep_dir=tmp_path / "probed")
    assert before["sass"]["MUFU.EX2"] == 40  # 64 x 80 scores over 128 threads
    assert probed["sass"].get("MUFU.EX2", 0) == 0
    # one shuffle per column of S^T for LSE2 and one for Delta (20 columns, Note [tile_m 128])
    assert before["sass_full"]["SHFL.IDX"] - probed["sass_full"]["SHFL.IDX"] == 40
    _assert_kept_under_probe(before, probed, ("HGMMA", "UTMALDG", "UTMASTG", "STS.128",
                                              "BAR.SYNC", "STSM"), overrides, tmp_path)


def _assert_kept_under_probe(before, probed, ops, overrides, tmp_path):
    """What a pointwise-side probe must keep of the hdim 128 MMA loop: the same count of each
    of ``ops``, the same four WGMMA waits (ptxas serialized nothing: one wait per HGMMA if it
    had), the same bulk operations, no spill; and the plain kernel compiled afterwards is the
    one compiled before (kept in ``tmp_path / "before"``)."""
    for op in ops:
        assert probed["sass"][op] == before["sass"][op] > 0, op
    depbar = "WARPGROUP.DEPBAR.LE"
    assert probed["sass_full"][depbar] == before["sass_full"][depbar] == 4
    assert _bulk_ops(probed) == _bulk_ops(before)
    assert probed["spill_bytes"] == before["spill_bytes"] == 0
    inspect_kernel("sm90_bwd", "sm_90a", overrides, keep_dir=tmp_path / "after")
    assert read_kept_sass(tmp_path / "after") == read_kept_sass(tmp_path / "before")


@pytest.mark.compile
@pytest.mark.parametrize("causal", [False, True])
def test_stats_probe_takes_the_shuffles_and_keeps_the_math(tmp_path, causal):
    """``stats=unshuffled`` takes the 40 SHFL of LSE2 / Delta out of the MMA loop (one per
    column of S^T for each, 20 columns) and keeps the rest of it: the same exp2s, GEMMs, WGMMA
    waits, TMA copies, bulk operations, barriers and stores, no spills; the plain kernel
    compiled afterwards is the one compiled before. (Shuffled statistics at hdim 128: its
    default loads them since round 36, Note [dP wait placement].)"""
    overrides = ["head_dim=128", f"causal={causal}", "qdo_multicast=true", "stats_shuffle=true"]
    before = inspect_kernel("sm90_bwd", "sm_90a", overrides, keep_dir=tmp_path / "before")
    with probes.probe("stats", "unshuffled"):
        probed = inspect_kernel("sm90_bwd", "sm_90a", overrides, keep_dir=tmp_path / "probed")
    assert before["sass_full"]["SHFL.IDX"] - probed["sass_full"].get("SHFL.IDX", 0) == 40
    _assert_kept_under_probe(before, probed, ("MUFU.EX2", "HGMMA", "UTMALDG", "UTMASTG",
                                              "STS.128", "BAR.SYNC", "STSM"), overrides, tmp_path)


def test_stats_probe_needs_shuffled_stats():
    probes.check_probe_config("stats", "unshuffled", select_bwd_config(head_dim=64))
    probes.check_probe_config("stats", "unshuffled",
                              select_bwd_config(head_dim=128, stats_shuffle=True))
    # hdim 128's default loads its own statistics since round 36 (Note [dP wait placement])
    for cfg in (select_bwd_config(head_dim=128, tile_m=64), select_bwd_config(head_dim=256),
                select_bwd_config(head_dim=128)):
        with pytest.raises(ValueError, match="nothing to probe"):
            probes.check_probe_config("stats", "unshuffled", cfg)
