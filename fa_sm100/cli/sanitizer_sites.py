"""Name the instructions behind compute-sanitizer's hazard reports.

racecheck (and synccheck) name each access by kernel and offset, ``KERNEL+0x1840``; this
script looks the offsets up in the SASS of the cubins the run kept and prints each report
with its instructions, then the reports grouped by the pair of opcodes:

    CUTE_DSL_KEEP=cubin CUTE_DSL_DUMP_DIR=cubins \\
        compute-sanitizer --tool racecheck --report-api-errors no \\
        python scripts/sm90_memcheck.py --mode bwd --shard 1/25 > racecheck.txt 2>&1
    python scripts/sanitizer_sites.py racecheck.txt cubins

Keep the cubins of the run itself: a cross-compile with fake tensors (``scripts/inspect.py
--keep-dir``) may lay the code out differently. A kernel with no cubin in the folder (cuBLAS,
say) is listed, not looked up. ``nvdisasm`` comes from the ``nvidia-cuda-nvdisasm`` wheel or
PATH (fa_sm100/compile_tools.py). docs/hopper_backward.md (Tests, compute-sanitizer) says
what the backward's reports are.
"""

import argparse
import re
import sys
from collections import Counter
from pathlib import Path
from typing import NamedTuple, Optional


from fa_sm100.compile_tools import (disassemble, find_nvdisasm, sass_listing,
                                    sass_opcode)

# "========= Error: Race reported between Write access at NAME+0x1840"
# "=========     and Read access at NAME+0x3420 [1024 hazards]"
_ACCESS = re.compile(r"(?P<head>Race reported between|and) (?P<kind>Read|Write) access at "
                     r"(?P<func>.+?)\+0x(?P<off>[0-9a-fA-F]+)"
                     r"(?:.*?\[(?P<count>\d+) hazards?\])?")
_REPORT_LINE = re.compile(r"(Race reported between|^=+\s+and) (Read|Write) access at ")
_SECTION = re.compile(r"^\.text\.(?P<func>\S+):\s*$", re.MULTILINE)


class Access(NamedTuple):
    kind: str  # "Read" / "Write"
    func: str
    offset: int
    hazards: Optional[int]  # on the paired accesses only


class Report(NamedTuple):
    first: Access  # the access named after "Race reported between"
    others: list  # the accesses paired with it ("and ...")


def parse_reports(text: str) -> list:
    """The hazard reports of a compute-sanitizer log, in order."""
    reports = []
    for line in text.splitlines():
        m = _ACCESS.search(line)
        if not m:
            if _REPORT_LINE.search(line):  # a report this parser does not read: say so
                raise ValueError(f"an access line not understood: {line.strip()!r}")
            continue
        acc = Access(m["kind"], m["func"], int(m["off"], 16),
                     int(m["count"]) if m["count"] else None)
        if m["head"] == "and":
            if not reports:
                raise ValueError(f"a paired access before any report: {line.strip()!r}")
            reports[-1].others.append(acc)
        else:
            reports.append(Report(acc, []))
    return reports


def summary_count(text: str) -> Optional[int]:
    """The report count of racecheck's closing line ("RACECHECK SUMMARY: 5 hazards displayed
    (...)"), or None without one: what ``parse_reports`` must have found."""
    m = re.search(r"RACECHECK SUMMARY: (\d+) hazards? displayed", text)
    return int(m.group(1)) if m else None


def sass_by_function(sass: str) -> dict:
    """{function name: {offset: instruction text}} of one nvdisasm listing: each function's
    section read by ``compile_tools.sass_listing``."""
    heads = list(_SECTION.finditer(sass))
    out = {}
    for m, nxt in zip(heads, heads[1:] + [None]):
        section = sass[m.end():nxt.start() if nxt else len(sass)]
        out[m["func"]] = {addr: " ".join(body.split()) for addr, body in sass_listing(section)[0]}
    return out


def load_functions(cubin_dir, nvdisasm: Optional[str] = None) -> dict:
    """Every function of every ``*.cubin`` under ``cubin_dir``, disassembled. Two cubins
    with one function name but different code (the DSL shortens long kernel names, so two
    configs of one kernel can share a name) raise ValueError: a report could not say which
    of them it meant. Run one case per sanitizer run then (``--shard I/N``, N the count)."""
    nvdisasm = nvdisasm or find_nvdisasm()
    funcs = {}
    for cubin in sorted(Path(cubin_dir).rglob("*.cubin")):
        for name, table in sass_by_function(disassemble(cubin, nvdisasm)).items():
            if name in funcs and funcs[name] != table:
                raise ValueError(f"two cubins under {cubin_dir} define {short_name(name)} "
                                 f"with different code; keep one case's cubins per run")
            funcs[name] = table
    return funcs


def opcode(instr: Optional[str]) -> str:
    """``@!P1 STS [UR8+0x70], R0`` -> ``STS``; None (not found) -> ``?``."""
    return "?" if instr is None else sass_opcode(instr).split(".")[0]


def short_name(func: str, width: int = 60) -> str:
    return func if len(func) <= width else func[:width - 3] + "..."


def instruction(acc: Access, funcs: dict) -> Optional[str]:
    """The instruction an access names, or None (no cubin for its kernel, or no instruction
    at its offset)."""
    return funcs.get(acc.func, {}).get(acc.offset)


def instruction_pairs(reports: list, funcs: dict) -> Counter:
    """{(kind, opcode, kind, opcode): hazards} over every report's paired accesses."""
    pairs = Counter()
    for rep in reports:
        first = opcode(instruction(rep.first, funcs))
        for acc in rep.others:
            pairs[(rep.first.kind, first, acc.kind, opcode(instruction(acc, funcs)))] += (
                acc.hazards or 0)
    return pairs


def describe(reports: list, funcs: dict) -> str:
    """The reports with their instructions, then the count of each (opcode, opcode) pair."""
    lines = []
    missing = sorted({acc.func for rep in reports for acc in (rep.first, *rep.others)
                      if acc.func not in funcs})

    def shown(acc: Access) -> str:
        if acc.func not in funcs:
            return "(kernel without a cubin here)"
        return instruction(acc, funcs) or "(no instruction at this offset)"

    for i, rep in enumerate(reports, 1):
        lines.append(f"report {i}: {rep.first.kind} at {short_name(rep.first.func)}"
                     f"+0x{rep.first.offset:x}  {shown(rep.first)}")
        for acc in rep.others:
            lines.append(f"    and {acc.kind} at +0x{acc.offset:x}  {shown(acc)}  "
                         f"[{acc.hazards} hazards]")
    pairs = instruction_pairs(reports, funcs)
    lines.append("")
    lines.append("by instruction pair (hazards):")
    for (k1, o1, k2, o2), n in pairs.most_common():
        lines.append(f"  {k1} {o1} / {k2} {o2}: {n}")
    for func in missing:
        lines.append(f"no cubin for {short_name(func)}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("log", help="compute-sanitizer's output")
    p.add_argument("cubin_dir", help="folder with the run's cubins (CUTE_DSL_DUMP_DIR)")
    args = p.parse_args(argv)
    text = Path(args.log).read_text(errors="replace")
    reports = parse_reports(text)
    expected = summary_count(text)
    if expected is not None and expected != len(reports):
        print(f"warning: racecheck's summary counts {expected} reports, {len(reports)} were "
              f"read", file=sys.stderr)
    if not reports:
        print("no hazard reports in the log")
        return 0
    print(describe(reports, load_functions(args.cubin_dir)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
