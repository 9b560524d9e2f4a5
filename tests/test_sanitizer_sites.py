"""``scripts/sanitizer_sites.py``: compute-sanitizer's hazard reports parsed, and their
offsets named by the SASS of the kernel's cubin."""

import pytest
from script_loader import load_script

sites = load_script("sanitizer_sites")

LOG = """\
========= COMPUTE-SANITIZER
========= Error: Race reported between Write access at kern_a+0x1840
=========     and Read access at kern_a+0x3420 [1024 hazards]
=========     and Read access at kern_a+0x3450 [512 hazards]
========= 
========= Error: Race reported between Read access at nvjet_x+0xb00
=========     and Write access at nvjet_x+0x2960 [192 hazards]
ok bwd b=2 ...
========= RACECHECK SUMMARY: 2 hazards displayed (2 errors, 0 warnings)
"""

SASS = """\
\t.section\t.text.kern_a,"ax",@progbits
.text.kern_a:
        /*1840*/                   UBLKCP.S.G [UR30], [UR42], UR6 ;
        /*3420*/                   LDS.64 R8, [R152+0x30400] ;
        /*3450*/              @!P1 LDS.64 R10, [R152+0x30420] ;
"""


def test_reports_are_parsed_with_their_paired_accesses():
    reps = sites.parse_reports(LOG)
    assert [r.first for r in reps] == [sites.Access("Write", "kern_a", 0x1840, None),
                                        sites.Access("Read", "nvjet_x", 0xb00, None)]
    assert reps[0].others == [sites.Access("Read", "kern_a", 0x3420, 1024),
                              sites.Access("Read", "kern_a", 0x3450, 512)]
    assert reps[1].others == [sites.Access("Write", "nvjet_x", 0x2960, 192)]
    assert sites.parse_reports("no hazards here\n") == []
    assert sites.summary_count(LOG) == len(reps) == 2
    assert sites.summary_count("no summary\n") is None
    with pytest.raises(ValueError, match="before any report"):
        sites.parse_reports("=========     and Read access at k+0x10 [1 hazards]\n")


def test_names_with_signatures_parse_and_unread_report_lines_raise():
    """A CUDA C++ kernel is named with its signature; a report line the parser cannot read
    stops it instead of being skipped (which would hide the report)."""
    reps = sites.parse_reports("========= Error: Race reported between Read access at "
                               "handoff(const float *, float *, int)+0x320\n"
                               "=========     and Write access at "
                               "handoff(const float *, float *, int)+0x400 [124 hazards]\n")
    assert reps[0].first == sites.Access("Read", "handoff(const float *, float *, int)", 0x320,
                                         None)
    assert reps[0].others[0].hazards == 124
    with pytest.raises(ValueError, match="not understood"):
        sites.parse_reports("========= Error: Race reported between Write access at kern\n")


def test_missing_offsets_count_as_unknown_and_shared_names_must_agree(tmp_path, monkeypatch):
    funcs = sites.sass_by_function(SASS)
    text = sites.describe(sites.parse_reports(
        "========= Error: Race reported between Write access at kern_a+0x1840\n"
        "=========     and Read access at kern_a+0x9990 [3 hazards]\n"), funcs)
    assert "(no instruction at this offset)" in text and "Write UBLKCP / Read ?: 3" in text
    # two cubins, one function name, different code: which one a report means is unknown
    (tmp_path / "a.cubin").write_bytes(b"a")
    (tmp_path / "b.cubin").write_bytes(b"b")
    listings = {"a.cubin": SASS, "b.cubin": SASS.replace("LDS.64 R8", "LDS.64 R9")}
    monkeypatch.setattr(sites, "disassemble", lambda path, nvdisasm: listings[path.name])
    with pytest.raises(ValueError, match="different code"):
        sites.load_functions(tmp_path, nvdisasm="nvdisasm")
    listings["b.cubin"] = SASS  # the same kernel twice is fine
    assert sites.load_functions(tmp_path, nvdisasm="nvdisasm") == funcs


def test_offsets_are_named_and_pairs_counted():
    funcs = sites.sass_by_function(SASS)
    assert funcs == {"kern_a": {0x1840: "UBLKCP.S.G [UR30], [UR42], UR6",
                                0x3420: "LDS.64 R8, [R152+0x30400]",
                                0x3450: "@!P1 LDS.64 R10, [R152+0x30420]"}}
    assert [sites.opcode(funcs["kern_a"][o]) for o in (0x1840, 0x3450)] == ["UBLKCP", "LDS"]
    text = sites.describe(sites.parse_reports(LOG), funcs)
    assert "Write UBLKCP / Read LDS: 1536" in text
    assert "UBLKCP.S.G [UR30], [UR42], UR6" in text and "LDS.64 R8, [R152+0x30400]" in text
    assert "Read ? / Write ?: 192" in text and "no cubin for nvjet_x" in text


def test_a_cross_compiled_kernel_names_its_bulk_copy_and_stat_loads(tmp_path, capsys):
    """On the default hdim 128 backward, cross-compiled for sm_90a: a log naming its first
    UBLKCP and first LDS is resolved to those instructions through nvdisasm's listing."""
    import re

    from fa_sm100.compile_tools import cross_compile
    from fa_sm100.hopper.inspect_bwd import build, make_config

    b = build(make_config([]))
    art = cross_compile(b.fn, b.args, "sm_90a", keep_dir=tmp_path)
    func = re.search(r"^\.text\.(\S+):", art.sass, re.M).group(1)
    offs = {}
    for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?(UBLKCP|LDS)\b", art.sass):
        offs.setdefault(m.group(2), int(m.group(1), 16))
    assert set(offs) == {"UBLKCP", "LDS"}
    log = tmp_path / "racecheck.txt"
    log.write_text(
        f"========= Error: Race reported between Write access at {func}+0x{offs['UBLKCP']:x}\n"
        f"=========     and Read access at {func}+0x{offs['LDS']:x} [7 hazards]\n")
    assert sites.main([str(log), str(tmp_path)]) == 0
    assert "Write UBLKCP / Read LDS: 7" in capsys.readouterr().out
