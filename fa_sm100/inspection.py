"""Compile a registered kernel for sm_100a / sm_90a on a CPU and report what the compiler made.

``inspect_kernel(name, arch, overrides)`` builds the kernel through the registry, cross-compiles
it (``fa_sm100.compile_tools``) and returns a JSON-ready dict. The pinned keys (documented in
docs/inspect.md; tests and other tools read them):

    arch, kernel, config, compile_s, threads_per_cta, cluster, regs_at_launch, setmaxnreg,
    smem_bytes, tmem_cols, local_bytes, spill_bytes, sass

plus informational keys: kernel_symbol, launch, setmaxnreg_ptx, setmaxnreg_sass,
setmaxnreg_by_warp, registers_after_setmaxnreg, tmem_alloc_ptx, spill_store_bytes,
spill_load_bytes, sass_full, sources, warnings.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from typing import Optional, Sequence

from fa_sm100.compile_tools import (
    check_arch,
    cross_compile,
    cubin_attributes,
    find_nvdisasm,
    parse_ptx,
    parse_ptxas_log,
    prepare_arch_env,
    sass_full_histogram,
    sass_histogram,
    sass_setmaxnreg,
)
from fa_sm100.config import REGISTER_FILE, WARP_SIZE
from fa_sm100.ptx_dispatch import DispatchUnknown, setmaxnreg_by_warp
from fa_sm100.registry import get_kernel
from layouts.smem import SMEM_BUDGET

# SASS keys every report carries, zero when absent (see compile_tools.sass_histogram).
SASS_KEYS = (
    "UTCHMMA", "UTCHMMA.2CTA", "LDTM", "STTM", "UTMALDG", "UTMASTG", "HGMMA", "MUFU.EX2",
    "FFMA2", "FMUL2", "USETMAXREG", "SYNCS", "BAR.SYNC",
)
REPORT_KEYS = (
    "arch", "kernel", "config", "compile_s", "threads_per_cta", "cluster", "regs_at_launch",
    "setmaxnreg", "smem_bytes", "tmem_cols", "local_bytes", "spill_bytes", "sass",
)


class CompileFailed(RuntimeError):
    """Building or compiling the kernel failed (its code, the tracer, MLIR, ptxas or nvdisasm),
    as opposed to bad input from the caller (ValueError)."""


def _config_dict(cfg) -> dict:
    if isinstance(cfg, dict):
        return dict(cfg)
    if dataclasses.is_dataclass(cfg):
        return dataclasses.asdict(cfg)
    return dict(vars(cfg)) if hasattr(cfg, "__dict__") else {"repr": repr(cfg)}


def _main_entry(entries: dict) -> str:
    if not entries:
        raise RuntimeError("the compiled PTX has no .entry (no kernel was generated)")
    return next(iter(entries))


_REPORT_CACHE: dict = {}


def inspect_kernel(name: str, arch: str, overrides: Sequence[str] = (),
                   keep_dir: Optional[os.PathLike] = None, log=None, cache: bool = False) -> dict:
    """Cross-compile kernel ``name`` for ``arch`` with ``--set`` overrides; return the report.

    Raises ValueError for an unknown kernel, an arch the kernel does not support or a bad
    override (before compiling), KernelNotAvailable when the kernel's module is missing and
    DisassemblerMissing when nvdisasm cannot be found (also before compiling), and
    CompileFailed when building or compiling the kernel fails. ``log``, when given, is called
    with a progress line just before the compile starts.

    ``cache=True`` reuses the report of an identical earlier call in this process (same name,
    arch and overrides, no keep_dir), so several contract tests can share one compile; each
    caller gets its own copy.
    """
    check_arch(arch)
    prepare_arch_env(arch)  # before the kernel's module may import cutlass
    entry = get_kernel(name)
    if arch not in entry.archs:
        raise ValueError(f"kernel {name!r} compiles for {list(entry.archs)}, not {arch}")
    cfg = entry.make_config(list(overrides))
    nvdisasm = find_nvdisasm()
    key = (name, arch, tuple(overrides))
    if cache and keep_dir is None and key in _REPORT_CACHE:
        return copy.deepcopy(_REPORT_CACHE[key])
    try:
        build = entry.build(cfg, arch)
    except ValueError:
        raise
    except Exception as e:
        raise CompileFailed(f"building {name} for {arch} failed: {type(e).__name__}: "
                            f"{_first_lines(str(e))}") from e
    if log is not None:
        log(f"compiling {name} for {arch} ...")
    try:
        art = cross_compile(build.fn, build.args, arch, keep_dir=keep_dir, nvdisasm=nvdisasm)
    except Exception as e:  # the kernel's code (or the compiler) failed, not the caller's input
        raise CompileFailed(f"compiling {name} for {arch} failed: {type(e).__name__}: "
                            f"{_first_lines(str(e))}") from e
    report = make_report(name, build, art)
    if cache and keep_dir is None:
        _REPORT_CACHE[key] = copy.deepcopy(report)
    return report


def _first_lines(text: str, n: int = 12) -> str:
    lines = [l for l in text.strip().splitlines() if l.strip()]
    return "\n".join(lines[:n]) + ("\n..." if len(lines) > n else "")


def make_report(name: str, build, art) -> dict:
    """The report dict of one compile (``build``: KernelBuild, ``art``: CompileArtifacts)."""
    warnings: list[str] = []
    sources: dict[str, str] = {}
    ptx_entries = parse_ptx(art.ptx)
    kernel = _main_entry(ptx_entries)
    if len(ptx_entries) > 1:
        warnings.append(f"{len(ptx_entries)} kernels in the module; reporting {kernel}")
    ptx = ptx_entries[kernel]
    ptxas = parse_ptxas_log(art.ptxas_log).get(kernel, {})
    elf = cubin_attributes(art.cubin).get(kernel, {})
    launch = next((l for l in art.launches if l.get("block")), None)

    # threads per CTA: .reqntid, else the launch's block
    if ptx["reqntid"]:
        threads = ptx["reqntid"][0] * ptx["reqntid"][1] * ptx["reqntid"][2]
        sources["threads_per_cta"] = "ptx .reqntid"
    elif launch and isinstance(launch["block"], tuple):
        threads = launch["block"][0] * launch["block"][1] * launch["block"][2]
        sources["threads_per_cta"] = "host launch block"
    else:
        threads = None
        warnings.append("threads per CTA unknown: no .reqntid and no static launch block")
    if elf.get("reqntid") and ptx["reqntid"] and tuple(elf["reqntid"]) != tuple(ptx["reqntid"]):
        warnings.append(f"cubin REQNTID {elf['reqntid']} differs from PTX .reqntid {ptx['reqntid']}")

    # cluster: declared in the PTX when the kernel fixes it, else the host launch attribute
    if ptx["cluster"] != (1, 1, 1) or ptx["explicit_cluster"]:
        cluster = ptx["cluster"]
        sources["cluster"] = "ptx .reqnctapercluster"
    elif launch and isinstance(launch["cluster"], tuple):
        cluster = launch["cluster"]
        sources["cluster"] = "host launch cluster"
    else:
        cluster = tuple(build.cluster)
        sources["cluster"] = "declared by the build"
    if tuple(cluster) != tuple(build.cluster):
        warnings.append(f"cluster {tuple(cluster)} differs from the build's declared {build.cluster}")

    # registers, local memory, spills: ptxas report, else the cubin attributes
    if "registers" in ptxas:
        regs = ptxas["registers"]
        local = ptxas.get("stack_frame")
        stores, loads = ptxas.get("spill_stores"), ptxas.get("spill_loads")
        sources["regs_at_launch"] = "ptxas resource report"
        if "registers" in elf and elf["registers"] != regs:
            warnings.append(f"cubin REGCOUNT {elf['registers']} differs from ptxas {regs}")
    else:
        regs = elf.get("registers")
        local = elf.get("frame_size")
        stores = loads = None
        sources["regs_at_launch"] = "cubin EIATTR_REGCOUNT (no ptxas report captured)"
        warnings.append("no ptxas resource report: spill bytes unknown")
    if threads and regs and threads * regs > REGISTER_FILE:
        warnings.append(f"{threads} threads x {regs} registers = {threads * regs} exceeds the "
                        f"register file ({REGISTER_FILE}): the CTA cannot launch")
    spill = None if stores is None else stores + loads
    if spill:
        warnings.append(f"register spills: {stores} bytes stored, {loads} bytes loaded")

    # setmaxnreg: the build declares role -> registers; the SASS (what runs) must carry each
    # value, the PTX must let exactly the role's warps reach it (when the build names them),
    # and every value the PTX asks for must survive ptxas.
    sass = sass_histogram(art.sass, always=SASS_KEYS)
    seen = ptx["setmaxnreg"]
    in_sass = sass_setmaxnreg(art.sass)
    values = {n for _, n in in_sass}
    by_warp, wrong_roles = _check_setmaxnreg_warps(build, art.ptx, kernel, threads, warnings,
                                                   sources)
    setmaxnreg = {role: r for role, r in build.setmaxnreg.items()
                  if r in values and role not in wrong_roles}
    for role, r in build.setmaxnreg.items():
        if r not in values:
            warnings.append(f"setmaxnreg {r} declared for role {role!r} is not in the SASS")
    for d, n in sorted(set(in_sass)):
        if n not in build.setmaxnreg.values():
            warnings.append(f"SASS setmaxnreg.{d} {n} is not declared for any role")
    held = None if by_warp is None or not regs else registers_after_setmaxnreg(by_warp, regs)
    if held is not None and held > threads * regs:
        warnings.append(f"setmaxnreg: the warps hold {held} registers after their setmaxnreg, "
                        f"more than the {threads * regs} the CTA launches with ({threads} x "
                        f"{regs}): setmaxnreg.inc waits for registers that never free up, so "
                        "the kernel hangs")
    dropped = sorted(set(seen) - set(in_sass))
    if dropped:
        warnings.append(
            f"ptxas dropped PTX setmaxnreg {dropped} (no USETMAXREG for them in the SASS; "
            "ptxas keeps setmaxnreg only when the register count at entry is known, e.g. "
            "launch with min_blocks_per_mp=1)"
        )

    allocs = ptx.get("tmem_alloc", [])
    if build.tmem_cols is not None:
        if not allocs:
            warnings.append(f"tmem_cols={build.tmem_cols} declared but the PTX has no tcgen05.alloc")
        for group, cols in allocs:
            if cols is not None and cols != build.tmem_cols:
                warnings.append(f"PTX tcgen05.alloc of {cols} columns, the build declares "
                                f"{build.tmem_cols}")
    elif allocs:
        warnings.append(f"the PTX allocates TMEM {allocs} but the build declares no tmem_cols")

    smem = int(build.smem_bytes)
    if launch and isinstance(launch.get("smem"), int) and launch["smem"] != smem:
        warnings.append(f"build smem_bytes {smem} differs from the launch's smem {launch['smem']}")
    if smem > SMEM_BUDGET[art.arch]:
        warnings.append(f"smem_bytes {smem} exceeds the {art.arch} limit {SMEM_BUDGET[art.arch]}")

    return {
        "arch": art.arch,
        "kernel": name,
        "config": _config_dict(build.config),
        "compile_s": round(art.compile_s, 3),
        "threads_per_cta": threads,
        "cluster": list(cluster),
        "regs_at_launch": regs,
        "setmaxnreg": setmaxnreg,
        "smem_bytes": smem,
        "tmem_cols": build.tmem_cols,
        "local_bytes": local,
        "spill_bytes": spill,
        "sass": sass,
        # informational
        "kernel_symbol": kernel,
        "launch": {k: (list(v) if isinstance(v, tuple) else v) for k, v in launch.items()}
        if launch else None,
        "setmaxnreg_ptx": [[d, n] for d, n in seen],
        "setmaxnreg_sass": [[d, n] for d, n in in_sass],
        "setmaxnreg_by_warp": by_warp,
        "registers_after_setmaxnreg": held,
        "tmem_alloc_ptx": [{"cta_group": g, "cols": c} for g, c in allocs],
        "spill_store_bytes": stores,
        "spill_load_bytes": loads,
        "sass_full": dict(sorted(sass_full_histogram(art.sass).items())),
        "sources": sources,
        "warnings": warnings,
    }


def registers_after_setmaxnreg(per_warp, launch_regs: int) -> int:
    """Registers a CTA holds once each warp has run its setmaxnreg: ``per_warp`` lists each
    warp's [direction, count] pairs (``setmaxnreg_by_warp``); a warp with several counts is
    taken at its largest, a warp with none keeps ``launch_regs``."""
    return sum(WARP_SIZE * max((n for _, n in w), default=launch_regs) for w in per_warp)


def _warp_list(warps) -> str:
    warps = sorted(warps)
    if len(warps) > 2 and warps == list(range(warps[0], warps[-1] + 1)):
        return f"{warps[0]}-{warps[-1]}"
    return ",".join(map(str, warps))


def _check_setmaxnreg_warps(build, ptx: str, entry: str, threads, warnings: list,
                            sources: dict):
    """Tie each declared setmaxnreg value to the warps that execute it in the PTX.

    Returns (per-warp [[dir, n], ...] lists or None, the roles whose warps do not execute
    exactly their declared value). Appends a warning for each role that fails, for a warp of no
    role that executes setmaxnreg, and when the PTX cannot be read for warp dispatch."""
    role_warps = dict(getattr(build, "setmaxnreg_warps", None) or {})
    if not threads:
        sources["setmaxnreg"] = "SASS values only (threads per CTA unknown)"
        return None, set()
    try:
        per_warp = setmaxnreg_by_warp(ptx, entry, threads // WARP_SIZE)
    except DispatchUnknown as e:
        if role_warps:
            warnings.append(f"setmaxnreg not tied to warps: {e}")
        sources["setmaxnreg"] = f"SASS values only ({e})"
        return None, set()
    by_warp = [[[d, n] for d, n in w] for w in per_warp]
    if not role_warps:
        sources["setmaxnreg"] = "SASS values only (the build names no warps per role)"
        return by_warp, set()
    sources["setmaxnreg"] = "SASS values, each reached in the PTX by exactly its role's warps"
    wrong = set()
    for role, regs in build.setmaxnreg.items():
        warps = role_warps.get(role)
        if warps is None:
            wrong.add(role)
            warnings.append(f"setmaxnreg role {role!r} has no warps in the build's declaration")
            continue
        found = sorted({n for w in warps if w < len(per_warp) for _, n in per_warp[w]})
        missing = [w for w in warps if w >= len(per_warp) or not per_warp[w]]
        if found and found != [regs]:
            wrong.add(role)
            warnings.append(f"setmaxnreg role {role!r} (warps {_warp_list(warps)}) executes "
                            f"setmaxnreg {', '.join(map(str, found))} in the PTX; the build "
                            f"declares {regs}")
        if missing:
            wrong.add(role)
            warnings.append(f"setmaxnreg role {role!r}: warps {_warp_list(missing)} execute no "
                            f"setmaxnreg in the PTX; the build declares {regs}")
    declared = {w for ws in role_warps.values() for w in ws}
    stray = [w for w, found in enumerate(per_warp) if found and w not in declared]
    if stray:
        warnings.append(f"warps {_warp_list(stray)} execute setmaxnreg in the PTX but belong to "
                        "no declared setmaxnreg role")
    return by_warp, wrong


def format_report(rep: dict) -> str:
    """A readable text form of a report."""
    cfg = ", ".join(f"{k}={v}" for k, v in rep["config"].items())
    lines = [
        f"kernel          {rep['kernel']}  ({rep['arch']}, compiled in {rep['compile_s']:.2f} s)",
        f"config          {cfg}",
        f"threads/CTA     {rep['threads_per_cta']}",
        f"cluster         {tuple(rep['cluster'])}",
        f"regs at launch  {rep['regs_at_launch']}",
        "setmaxnreg      " + (", ".join(f"{r}={n}" for r, n in rep["setmaxnreg"].items()) or "none"),
        f"smem bytes      {rep['smem_bytes']}",
        f"tmem cols       {rep['tmem_cols']}",
        f"local bytes     {rep['local_bytes']}",
        f"spill bytes     {rep['spill_bytes']}",
        "sass (key instructions):",
    ]
    for key in SASS_KEYS:
        lines.append(f"  {key:14} {rep['sass'].get(key, 0)}")
    total = sum(rep["sass_full"].values())
    lines.append(f"  {'(all)':14} {total} instructions, {len(rep['sass_full'])} distinct spellings")
    for w in rep.get("warnings", []):
        lines.append(f"warning: {w}")
    return "\n".join(lines)


def format_side_by_side(left: dict, right: dict, left_name: str, right_name: str) -> str:
    """Two reports in columns (scalar fields and the pinned SASS keys)."""
    rows = [("arch", "arch"), ("compile s", "compile_s"), ("threads/CTA", "threads_per_cta"),
            ("cluster", "cluster"), ("regs at launch", "regs_at_launch"),
            ("setmaxnreg", "setmaxnreg"), ("smem bytes", "smem_bytes"),
            ("tmem cols", "tmem_cols"), ("local bytes", "local_bytes"),
            ("spill bytes", "spill_bytes")]

    def show(v):
        if isinstance(v, dict):
            return ",".join(f"{k}={x}" for k, x in v.items()) or "none"
        if isinstance(v, list):
            return str(tuple(v))
        return str(v)

    width = max(30, len(left_name), len(right_name),
                *(len(show(r.get(key))) for r in (left, right) for _, key in rows))
    out = [f"{'':18}{left_name:>{width}}  {right_name:>{width}}"]
    for label, key in rows:
        out.append(f"{label:18}{show(left.get(key)):>{width}}  {show(right.get(key)):>{width}}")
    for key in SASS_KEYS:
        out.append(f"{'sass ' + key:18}{left['sass'].get(key, 0):>{width}}  "
                   f"{right['sass'].get(key, 0):>{width}}")
    lt, rt = sum(left["sass_full"].values()), sum(right["sass_full"].values())
    out.append(f"{'sass (all)':18}{lt:>{width}}  {rt:>{width}}")
    return "\n".join(out)
