"""Compile contract of the tcgen05 demo kernel, read through the inspect tool (CPU only).

The demo is compiled for sm_100a in both MMA flavours; its report must show the design the
kernel's code states: 256 threads, cluster 2 only for the 2-CTA flavour, tcgen05 MMAs that are
all cta_group::2 (UTCHMMA.2CTA) or none of them, TMEM loads, TMA loads, the declared setmaxnreg
values in SASS, the declared TMEM allocation in the PTX, no local memory and no spills.
"""

import dataclasses
import json

import pytest

from fa_sm100 import compile_tools as ct
from fa_sm100.demo_tcgen05 import DemoConfig, build
from fa_sm100.inspection import REPORT_KEYS, SASS_KEYS, inspect_kernel, make_report

pytestmark = pytest.mark.compile


@pytest.fixture(scope="module")
def demo2(tmp_path_factory):
    keep = tmp_path_factory.mktemp("demo2")
    return inspect_kernel("tcgen05_demo", "sm_100a", [], keep_dir=keep), keep


@pytest.fixture(scope="module")
def demo1():
    """The 1-CTA flavour, compiled directly so tests can re-run make_report on its artifacts."""
    b = build(DemoConfig(use_2cta=False), "sm_100a")
    art = ct.cross_compile(b.fn, b.args, "sm_100a")
    return b, art


def test_report_has_every_pinned_key(demo2):
    rep, _ = demo2
    assert set(REPORT_KEYS) <= set(rep)
    assert set(SASS_KEYS) <= set(rep["sass"])
    assert rep["arch"] == "sm_100a" and rep["kernel"] == "tcgen05_demo"
    assert rep["config"] == dataclasses.asdict(DemoConfig())  # every field of what compiled
    assert rep["compile_s"] > 0
    json.loads(json.dumps(rep))  # JSON-ready


def test_2cta_report(demo2):
    rep, _ = demo2
    s = rep["sass"]
    assert rep["threads_per_cta"] == 256
    assert rep["cluster"] == [2, 1, 1]
    assert s["UTCHMMA"] == 4  # K = 64 in four K = 16 MMAs
    assert s["UTCHMMA.2CTA"] == s["UTCHMMA"]  # every MMA is cta_group::2
    assert s["LDTM"] == 4  # 128 columns read 32 at a time
    assert s["UTMALDG"] == 2  # A and B
    assert s["USETMAXREG"] >= 2
    assert s["HGMMA"] == 0 and s["UTMASTG"] == 0
    assert rep["setmaxnreg"] == {"epilogue": 232, "producer": 40}
    assert rep["setmaxnreg_sass"] == rep["setmaxnreg_ptx"] == [["dec", 40], ["inc", 232]]
    # warps 0-3 (epilogue warpgroup) reach only inc 232, warps 4-7 only dec 40
    assert rep["setmaxnreg_by_warp"] == [[["inc", 232]]] * 4 + [[["dec", 40]]] * 4
    assert "exactly its role's warps" in rep["sources"]["setmaxnreg"]
    assert rep["tmem_cols"] == 128
    assert rep["tmem_alloc_ptx"] == [{"cta_group": 2, "cols": 128}]
    assert rep["spill_bytes"] == 0 and rep["local_bytes"] == 0
    assert rep["regs_at_launch"] <= 255
    assert rep["warnings"] == []


def test_1cta_report(demo1):
    b, art = demo1
    rep = make_report("tcgen05_demo", b, art)
    s = rep["sass"]
    assert rep["threads_per_cta"] == 256 and rep["cluster"] == [1, 1, 1]
    assert s["UTCHMMA"] == 4 and s["UTCHMMA.2CTA"] == 0
    assert s["LDTM"] == 4 and s["UTMALDG"] == 2
    assert rep["tmem_alloc_ptx"] == [{"cta_group": 1, "cols": 128}]
    assert rep["spill_bytes"] == 0 and rep["warnings"] == []


def test_smem_bytes_match_the_traced_shared_storage(demo1):
    """The build's analytic SMEM size equals the struct the kernel really launches with."""
    b, art = demo1
    assert b.fn.traced_smem_bytes == b.smem_bytes == DemoConfig(use_2cta=False).smem_bytes
    assert art.launches[0]["smem"] == b.smem_bytes
    assert art.launches[0]["block"] == (256, 1, 1)


def test_resource_report_agrees_with_the_cubin(demo2):
    """ptxas's register count (from the remarks) equals EIATTR_REGCOUNT of the kept cubin."""
    rep, keep = demo2
    cubins = list(keep.glob("*.cubin"))
    assert len(cubins) == 1 and list(keep.glob("*.sass")) and list(keep.glob("*.ptx"))
    elf = ct.cubin_attributes(cubins[0].read_bytes())[rep["kernel_symbol"]]
    assert elf["registers"] == rep["regs_at_launch"]
    assert tuple(elf["reqntid"]) == (256, 1, 1)
    assert elf["frame_size"] == rep["local_bytes"] == 0


def test_report_catches_wrong_declarations(demo1):
    """The cross-checks can fail: a build that misstates its setmaxnreg, TMEM columns, cluster
    or SMEM size gets a warning for each."""
    b, art = demo1
    wrong = build(DemoConfig(use_2cta=False), "sm_100a")
    wrong.setmaxnreg = {"epilogue": 240, "producer": 40}
    wrong.tmem_cols = 256
    wrong.cluster = (2, 1, 1)
    wrong.smem_bytes = b.smem_bytes + 1024
    warnings = "\n".join(make_report("tcgen05_demo", wrong, art)["warnings"])
    assert "setmaxnreg 240 declared for role 'epilogue' is not in the SASS" in warnings
    assert "SASS setmaxnreg.inc 232 is not declared" in warnings
    assert "tcgen05.alloc of 128 columns, the build declares 256" in warnings
    assert "cluster (1, 1, 1) differs from the build's declared (2, 1, 1)" in warnings
    assert "differs from the launch's smem" in warnings


def test_report_catches_swapped_setmaxnreg_roles(demo1):
    """Role budgets swapped between the two warpgroups carry the same values (both are in the
    SASS), so only the PTX's warp dispatch can tell: each role's warps must reach its value."""
    b, art = demo1
    swapped = build(DemoConfig(use_2cta=False), "sm_100a")
    swapped.setmaxnreg = {"epilogue": 40, "producer": 232}
    rep = make_report("tcgen05_demo", swapped, art)
    warnings = "\n".join(rep["warnings"])
    assert "not in the SASS" not in warnings and "not declared for any role" not in warnings
    assert ("setmaxnreg role 'epilogue' (warps 0-3) executes setmaxnreg 232 in the PTX; the "
            "build declares 40") in warnings
    assert ("setmaxnreg role 'producer' (warps 4-7) executes setmaxnreg 40 in the PTX; the "
            "build declares 232") in warnings
    assert rep["setmaxnreg"] == {}

    # The same swap stated the other way: right budgets, wrong warps.
    swapped = build(DemoConfig(use_2cta=False), "sm_100a")
    swapped.setmaxnreg_warps = {"epilogue": (4, 5, 6, 7), "producer": (0, 1, 2, 3)}
    rep = make_report("tcgen05_demo", swapped, art)
    assert "setmaxnreg role 'epilogue' (warps 4-7) executes setmaxnreg 40" in "\n".join(
        rep["warnings"])
    assert rep["setmaxnreg"] == {}

    # A warp left out of every role that executes setmaxnreg is reported too.
    partial = build(DemoConfig(use_2cta=False), "sm_100a")
    partial.setmaxnreg_warps = {"epilogue": (0, 1, 2, 3), "producer": (4, 5)}
    rep = make_report("tcgen05_demo", partial, art)
    assert ("warps 6,7 execute setmaxnreg in the PTX but belong to no declared setmaxnreg role"
            in rep["warnings"])
    assert rep["setmaxnreg"] == {"epilogue": 232, "producer": 40}


def test_missing_disassembler_fails_before_compiling(monkeypatch, tmp_path):
    monkeypatch.setenv(ct.NVDISASM_DIRS_ENV, str(tmp_path))

    def no_compile(*a, **k):
        raise AssertionError("compiled although the disassembler is missing")

    monkeypatch.setattr("fa_sm100.inspection.cross_compile", no_compile)
    with pytest.raises(ct.DisassemblerMissing, match="nvdisasm"):
        inspect_kernel("tcgen05_demo", "sm_100a")


def test_cache_shares_one_compile(monkeypatch):
    """cache=True: the second identical call reuses the first compile and returns a copy."""
    first = inspect_kernel("tcgen05_demo", "sm_100a", ["n=64"], cache=True)

    def no_compile(*a, **k):
        raise AssertionError("compiled again although the report is cached")

    monkeypatch.setattr("fa_sm100.inspection.cross_compile", no_compile)
    second = inspect_kernel("tcgen05_demo", "sm_100a", ["n=64"], cache=True)
    assert second == first and second is not first
    second["sass"]["UTCHMMA"] = -1
    assert inspect_kernel("tcgen05_demo", "sm_100a", ["n=64"], cache=True)["sass"]["UTCHMMA"] == 4


def test_report_catches_dropped_setmaxnreg_and_register_overflow(demo1):
    """Artifacts edited the way a bad compile would look: USETMAXREG gone from the SASS, and a
    CTA of 512 threads at 232 registers (more than the 64K register file)."""
    import dataclasses

    b, art = demo1
    no_setmaxnreg = "\n".join(l for l in art.sass.splitlines() if "USETMAXREG" not in l)
    bad = dataclasses.replace(art, sass=no_setmaxnreg,
                              ptx=art.ptx.replace(".reqntid 256, 1, 1", ".reqntid 512, 1, 1"))
    rep = make_report("tcgen05_demo", b, bad)
    warnings = "\n".join(rep["warnings"])
    assert "ptxas dropped PTX setmaxnreg [('dec', 40), ('inc', 232)]" in warnings
    assert rep["setmaxnreg"] == {}
    assert "512 threads x 232 registers = 118784 exceeds the register file" in warnings
