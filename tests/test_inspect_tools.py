"""Contracts of the inspect tool's parsers, registry and error paths (no compile, no GPU)."""

import os
import stat

import pytest

from fa_sm100 import compile_tools as ct
from fa_sm100 import registry
from fa_sm100.demo_tcgen05 import DemoConfig, make_config

SASS = """
        /*0000*/                   LDC R1, c[0x0][0x37c] ;
        /*0010*/              @!P0 UTCHMMA.2CTA gdesc[UR4], gdesc[UR6], tmem[UR8], tmem[UR10], idesc[UR11], UPT ;
        /*0020*/               @P1 UTCHMMA tmem[UR12], gdesc[UR4], tmem[UR8], UPT ;
        /*0030*/                   MUFU.EX2 R3, R2 ;
        /*0040*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R5 ;
        /*0050*/                   BAR.SYNC.DEFER_BLOCKING 0x1, 0xa0 ;
        /*0060*/                   FFMA2 R4, R4.F32x2.HI_LO, R6.F32, R8.F32 ;
.L_x_1:
        /*0070*/                   EXIT ;
"""


def test_sass_histogram_rule():
    """Opcode keys count every instruction with that opcode (guard predicate dropped); each
    modifier adds an opcode.modifier key; pinned keys appear as 0 when absent."""
    h = ct.sass_histogram(SASS, always=("UTMALDG", "MUFU.EX2"))
    assert h["UTCHMMA"] == 2  # both the 2CTA one and the plain one
    assert h["UTCHMMA.2CTA"] == 1
    assert h["MUFU"] == 1 and h["MUFU.EX2"] == 1
    assert h["SYNCS"] == 1 and h["SYNCS.TRYWAIT"] == 1 and h["SYNCS.PHASECHK"] == 1
    assert h["BAR.SYNC"] == 1 and h["BAR"] == 1
    assert h["FFMA2"] == 1
    assert h["UTMALDG"] == 0
    assert "P0" not in h and "@!P0" not in h
    assert sum(ct.sass_full_histogram(SASS).values()) == 8
    assert ct.sass_full_histogram(SASS)["UTCHMMA.2CTA"] == 1


def test_sass_setmaxnreg():
    sass = """
        /*06a0*/                   USETMAXREG.DEALLOC.CTAPOOL 0x28 ;
        /*06d0*/                   USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xe8 ;
"""
    assert ct.sass_setmaxnreg(sass) == [("dec", 40), ("inc", 232)]


PTX = """
.visible .entry kern_a(
	.param .u64 p0
)
.reqntid 512, 1, 1
.reqnctapercluster 2, 1, 1
.minnctapersm 1
{
	mov.b32 	%r43, 512;
	tcgen05.alloc.cta_group::2.sync.aligned.shared::cta.b32 	[%r7], %r43;
	setmaxnreg.dec.sync.aligned.u32 	48;
	setmaxnreg.inc.sync.aligned.u32 	192;
	ret;
}
.visible .entry kern_b(
	.param .u64 p0
)
.reqntid 128
{
	ret;
}
"""


def test_parse_ptx_entries():
    e = ct.parse_ptx(PTX)
    assert list(e) == ["kern_a", "kern_b"]
    a, b = e["kern_a"], e["kern_b"]
    assert a["reqntid"] == (512, 1, 1) and a["cluster"] == (2, 1, 1)
    assert a["setmaxnreg"] == [("dec", 48), ("inc", 192)]
    assert a["tmem_alloc"] == [(2, 512)]  # the register operand resolved through its mov
    assert b["reqntid"] == (128, 1, 1) and b["cluster"] == (1, 1, 1)
    assert b["setmaxnreg"] == [] and b["tmem_alloc"] == []


DISPATCH_PTX = """
.version 8.7
.target sm_100a
.address_size 64

.visible .entry roles(
	.param .u32 n
)
.reqntid 256, 1, 1
{
	.reg .pred 	%p<8>;
	.reg .b32 	%r<12>;

	ld.param.u32 	%r9, [n];
	mov.u32 	%r1, %tid.x;
	shr.u32 	%r2, %r1, 5;
	shfl.sync.idx.b32 	%r3, %r2, 0, 31, -1;
	setp.gt.u32 	%p1, %r3, 3;
	@%p1 bra 	$L__BB0_3;
	setmaxnreg.inc.sync.aligned.u32 	232;
	mov.u32 	%r4, 0;
$L__BB0_2:
	add.s32 	%r4, %r4, 1;
	setp.lt.s32 	%p2, %r4, %r9;
	@%p2 bra 	$L__BB0_2;
	bra.uni 	$L__BB0_5;
$L__BB0_3:
	and.b32 	%r5, %r3, -2;
	setp.ne.b32 	%p3, %r5, 4;
	@%p3 bra 	$L__BB0_4;
	setmaxnreg.dec.sync.aligned.u32 	40;
	bra.uni 	$L__BB0_5;
$L__BB0_4:
	setmaxnreg.dec.sync.aligned.u32 	24;
$L__BB0_5:
	ret;
}
"""


def test_setmaxnreg_by_warp_follows_the_warp_dispatch():
    """Each warp reaches only the setmaxnreg of its branch: warps 0-3 (warp < 4) inc 232 past a
    data-dependent loop, warps 4-5 ((warp & -2) == 4) dec 40, warps 6-7 dec 24."""
    from fa_sm100.ptx_dispatch import DispatchUnknown, setmaxnreg_by_warp

    got = setmaxnreg_by_warp(DISPATCH_PTX, "roles", 8)
    assert got == [[("inc", 232)]] * 4 + [[("dec", 40)]] * 2 + [[("dec", 24)]] * 2
    # A branch on tid.x itself (lane-dependent) is not a warp dispatch: both sides stay
    # reachable, so every warp may reach both budgets of that branch.
    lane = DISPATCH_PTX.replace("setp.gt.u32 \t%p1, %r3, 3;", "setp.gt.u32 \t%p1, %r1, 3;")
    assert lane != DISPATCH_PTX
    assert setmaxnreg_by_warp(lane, "roles", 8)[0] == [("inc", 232), ("dec", 24)]
    with pytest.raises(DispatchUnknown, match="no entry 'other'"):
        setmaxnreg_by_warp(DISPATCH_PTX, "other", 8)


def test_registers_after_setmaxnreg_takes_each_warps_largest_request():
    """DISPATCH_PTX's 8 warps: 4 x inc 232, 2 x dec 40, 2 x dec 24. A warp that may reach two
    requests counts at the larger; a warp with none keeps its launch registers."""
    from fa_sm100.inspection import registers_after_setmaxnreg
    from fa_sm100.ptx_dispatch import setmaxnreg_by_warp

    per_warp = setmaxnreg_by_warp(DISPATCH_PTX, "roles", 8)
    assert registers_after_setmaxnreg(per_warp, 128) == 32 * (4 * 232 + 2 * 40 + 2 * 24)
    assert registers_after_setmaxnreg([[("inc", 232), ("dec", 24)], []], 96) == 32 * (232 + 96)


@pytest.mark.parametrize("threads, regs", [(384, 168), (512, 128), (640, 96)])
def test_launch_registers_fill_the_register_file_in_steps_of_8(threads, regs):
    """The three CTA sizes whose cubins confirm the rule (tests/test_sm90_fwd_compile.py,
    tests/test_sm90_bwd.py)."""
    from fa_sm100.config import launch_registers

    assert launch_registers(threads) == regs
    assert threads * regs <= 64 * 1024 < threads * (regs + 8)


def test_parse_ptxas_log():
    log = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'kern_a' for 'sm_100a'
ptxas info    : Function properties for kern_a
ptxas         .     16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers
ptxas info    : Compiling entry function 'kern_b' for 'sm_100a'
ptxas info    : Function properties for kern_b
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 8 registers, used 0 barriers
"""
    r = ct.parse_ptxas_log(log)
    assert r["kern_a"] == {"stack_frame": 16, "spill_stores": 8, "spill_loads": 4, "registers": 168}
    assert r["kern_b"] == {"stack_frame": 0, "spill_stores": 0, "spill_loads": 0, "registers": 8}


def test_parse_ptxas_log_rewrapped_by_the_dsl():
    """With spills the DSL re-wraps ptxas's output inside a remark: name on its own line."""
    log = """  remark[ptxas]: ptxas detected register spills
          ptxas output:
          ptxas info    : Compiling entry function
          'kernel_cutlass_kernel_long_name_0'
          for 'sm_100a'
          ptxas info    : Function properties for
          kernel_cutlass_kernel_long_name_0
          ptxas         .     104 bytes stack frame, 128 bytes spill stores, 216 bytes spill loads
          ptxas info    : Used 128 registers, used 2 barriers, 104 bytes cumulative stack size
"""
    assert ct.parse_ptxas_log(log) == {"kernel_cutlass_kernel_long_name_0": {
        "stack_frame": 104, "spill_stores": 128, "spill_loads": 216, "registers": 128}}


def test_missing_disassembler_is_a_clear_error(tmp_path, monkeypatch):
    """An empty search path means no nvdisasm: the error says what to install."""
    with pytest.raises(ct.DisassemblerMissing, match="pip install nvidia-cuda-nvdisasm"):
        ct.find_nvdisasm([tmp_path])
    monkeypatch.setenv(ct.NVDISASM_DIRS_ENV, str(tmp_path))
    with pytest.raises(ct.DisassemblerMissing, match=str(tmp_path)):
        ct.find_nvdisasm()
    # A file that is there but not executable is not a disassembler either.
    fake = tmp_path / "nvdisasm"
    fake.write_text("#!/bin/sh\n")
    with pytest.raises(ct.DisassemblerMissing):
        ct.find_nvdisasm()
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    assert ct.find_nvdisasm() == str(fake)


def test_nvdisasm_found_by_default():
    """nvidia-cuda-nvdisasm is a core dependency; the default search finds it."""
    path = ct.find_nvdisasm()
    assert os.access(path, os.X_OK) and path.endswith("nvdisasm")


def test_unknown_kernel_and_arch():
    with pytest.raises(ValueError, match="unknown kernel 'nope'.*tcgen05_demo"):
        registry.get_kernel("nope")
    with pytest.raises(ValueError, match="arch 'sm_80'"):
        ct.check_arch("sm_80")


def test_kernel_module_missing_is_reported(monkeypatch):
    monkeypatch.setitem(registry.KERNEL_MODULES, "later", "fa_sm100.not_written_yet")
    with pytest.raises(registry.KernelNotAvailable, match="not available yet.*not_written_yet"):
        registry.get_kernel("later")


def test_registered_demo_entry():
    entry = registry.get_kernel("tcgen05_demo")
    assert entry.name == "tcgen05_demo" and tuple(entry.archs) == ("sm_100a",)
    assert entry.make_config(["use_2cta=false", "n=64"]) == DemoConfig(use_2cta=False, n=64)


@pytest.mark.parametrize("item, message", [
    ("bogus=1", "DemoConfig has no field 'bogus'"),
    ("use_2cta=maybe", "not a boolean"),
    ("n", "expected field=value"),
    ("n=100", "n=100: the demo tile's N must be 64, 128 or 256"),
    ("k=96", "k=96: must be a multiple of 64"),
    ("regs_epilogue=230", "regs_epilogue=230: setmaxnreg takes a multiple of 8"),
    ("regs_producer=16", "regs_producer=16: setmaxnreg takes a multiple of 8"),
    ("dtype=float32", "dtype 'float32' is not supported"),
])
def test_bad_set_is_a_clear_value_error(item, message):
    with pytest.raises(ValueError, match=message):
        make_config([item])


def test_demo_builds_only_for_sm100():
    from fa_sm100.demo_tcgen05 import build

    with pytest.raises(ValueError, match="sm_100a only"):
        build(DemoConfig(), "sm_90a")


@pytest.mark.parametrize("name, arch", [("sm100_fwd", "sm_100a"), ("sm90_fwd", "sm_90a"),
                                        ("sm90_bwd", "sm_90a"), ("tcgen05_demo", "sm_100a")])
def test_every_registered_kernel_has_a_consistent_entry(name, arch):
    """Each table row's module defines KERNEL named like its row, for the expected arch, whose
    make_config builds the default config and rejects an unknown --set field."""
    entry = registry.get_kernel(name)
    assert isinstance(entry, registry.KernelEntry) and entry.name == name
    assert list(entry.archs) == [arch]
    cfg = entry.make_config([])
    assert cfg == entry.make_config([])  # deterministic defaults (frozen config)
    with pytest.raises(ValueError):
        entry.make_config(["no_such_field=1"])
