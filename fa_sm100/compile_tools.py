"""Cross-compile a CuTe-DSL kernel on a machine with no GPU and read what the compiler made.

``cross_compile(fn, args, arch)`` runs ``cute.compile`` with the DSL told to keep the PTX and
the cubin in a directory and to hand back ptxas's resource report (the ``remarks{ptx}``
compile option; the report goes to stderr, which is captured). The cubin is then
disassembled with ``nvdisasm`` (from the ``nvidia-cuda-nvdisasm`` wheel, or PATH).

What is read from where:

================  =========================================================================
threads per CTA   ``.reqntid`` of the PTX entry (cross-checked: EIATTR_REQNTID in the cubin)
cluster           ``.reqnctapercluster`` of the PTX entry; (1, 1, 1) when absent
registers         ptxas's "Used N registers" (fallback: EIATTR_REGCOUNT of the cubin)
local / spills    ptxas's "N bytes stack frame, N bytes spill stores, N bytes spill loads"
                  (fallback for the stack frame: EIATTR_FRAME_SIZE; spills then unknown)
setmaxnreg        ``USETMAXREG.{TRY_ALLOC,DEALLOC} N`` in the SASS (and the PTX's
                  ``setmaxnreg.{inc,dec}.sync.aligned.u32 N``, to see what ptxas dropped)
SASS histogram    ``nvdisasm`` of the cubin, counted by ``sass_histogram`` (rule below)
================  =========================================================================

SASS histogram rule (``sass_histogram``). An instruction line such as
``@!P0 UTCHMMA.2CTA.F16 ...`` has the opcode ``UTCHMMA`` and the modifiers ``2CTA`` and
``F16`` (the guard predicate is dropped). It adds one to the key ``UTCHMMA`` (every
instruction with that opcode, whatever its modifiers) and one to ``UTCHMMA.2CTA`` and
``UTCHMMA.F16`` (one key per modifier it carries). So ``UTCHMMA`` counts all tcgen05 f16 MMAs,
``UTCHMMA.2CTA`` only the cta_group::2 ones, ``MUFU.EX2`` the SFU exp2s, ``BAR.SYNC`` the named
and CTA barriers, and ``SYNCS`` every mbarrier operation. The full spelling of each
instruction (``UTCHMMA.2CTA.F16``) is counted separately by ``sass_full_histogram``.

Nothing here needs a GPU or the CUDA driver.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import struct
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

ARCHS = ("sm_100a", "sm_90a")

# Environment variable: a os.pathsep-separated list of directories. When set, nvdisasm is
# looked for there only (neither the wheel nor PATH); tests use it to simulate a machine
# without the disassembler.
NVDISASM_DIRS_ENV = "FA_SM100_NVDISASM_DIRS"


class DisassemblerMissing(RuntimeError):
    """nvdisasm is not installed where we look for it."""


def _wheel_bin_dirs() -> list[Path]:
    """``site-packages/nvidia/*/bin`` directories of the NVIDIA CUDA wheels that are installed."""
    dirs = []
    try:
        import nvidia  # namespace package of the nvidia-cuda-* wheels
    except ImportError:
        return dirs
    for root in getattr(nvidia, "__path__", []):
        # newest CUDA first (cu13 before cu12): an older nvdisasm may not know sm_100a
        for sub in sorted(Path(root).iterdir(), reverse=True):
            if (sub / "bin").is_dir():
                dirs.append(sub / "bin")
    return dirs


def find_nvdisasm(search_dirs: Optional[Iterable[os.PathLike]] = None) -> str:
    """The path of ``nvdisasm``; raise ``DisassemblerMissing`` with what to install when absent.

    ``search_dirs`` (or the FA_SM100_NVDISASM_DIRS environment variable) restricts the search
    to those directories. Otherwise: the ``nvidia-cuda-nvdisasm`` wheel's bin directory, then PATH.
    """
    if search_dirs is None and os.environ.get(NVDISASM_DIRS_ENV) is not None:
        search_dirs = [d for d in os.environ[NVDISASM_DIRS_ENV].split(os.pathsep) if d]
    if search_dirs is not None:
        dirs = [Path(d) for d in search_dirs]
        where = "in " + (", ".join(str(d) for d in dirs) or "(no directories)")
    else:
        dirs = _wheel_bin_dirs()
        found = shutil.which("nvdisasm")
        if found:
            dirs.append(Path(found).parent)
        where = "in the nvidia-cuda-nvdisasm wheel (site-packages/nvidia/*/bin) or on PATH"
    for d in dirs:
        cand = d / "nvdisasm"
        if cand.is_file() and os.access(cand, os.X_OK):
            return str(cand)
    raise DisassemblerMissing(
        f"nvdisasm (the SASS disassembler) was not found {where}. Install it with "
        "`pip install nvidia-cuda-nvdisasm` (a dependency of `pip install -e .`) or put a CUDA "
        "toolkit's bin directory on PATH."
    )


def check_arch(arch: str) -> str:
    if arch not in ARCHS:
        raise ValueError(f"arch {arch!r} is not supported: use one of {ARCHS}")
    return arch


def prepare_arch_env(arch: str) -> None:
    """Point CUTE_DSL_ARCH at ``arch`` when cutlass has not been imported yet.

    The DSL reads CUTE_DSL_ARCH once, at first import; after that the compile option
    ``--gpu-arch`` still selects the target of each compile.
    """
    check_arch(arch)
    if "cutlass" not in sys.modules:
        os.environ["CUTE_DSL_ARCH"] = arch


@dataclass
class CompileArtifacts:
    arch: str
    compile_s: float
    ptx: str
    cubin: bytes
    sass: str
    ptxas_log: str
    dump_dir: Optional[str]  # where the artifacts were kept, if anywhere
    entries: list = field(default_factory=list)  # PTX entry (kernel) names
    launches: list = field(default_factory=list)  # launch configs the host code emitted


def cross_compile(fn, args, arch: str, keep_dir: Optional[os.PathLike] = None,
                  nvdisasm: Optional[str] = None) -> CompileArtifacts:
    """Compile ``fn(*args)`` for ``arch``; return the PTX, cubin, SASS and ptxas report.

    ``keep_dir``: a directory to copy the PTX, cubin and SASS into (nothing is kept if None).
    The disassembler is located before compiling, so a missing one fails fast.
    """
    check_arch(arch)
    nvdisasm = nvdisasm or find_nvdisasm()
    prepare_arch_env(arch)
    import cutlass.cute as cute

    # Compile into a fresh directory (so exactly this compile's files are there); copy them to
    # keep_dir afterwards, leaving anything else in keep_dir alone.
    with tempfile.TemporaryDirectory(prefix="fa_sm100_inspect_") as tmp:
        out = Path(tmp)
        options = f"--gpu-arch {arch} --keep-ptx --keep-cubin --dump-dir={out} remarks{{ptx}}"
        err = io.StringIO()
        launches: list = []
        t0 = time.perf_counter()
        try:
            with contextlib.redirect_stderr(err), _record_launches(launches):
                cute.compile(fn, *args, options=options)
        except Exception:
            sys.stderr.write(err.getvalue())
            raise
        compile_s = time.perf_counter() - t0
        ptx_files = sorted(out.glob(f"*.{arch}.ptx"))
        cubin_files = sorted(out.glob(f"*.{arch}.cubin"))
        if len(ptx_files) != 1 or len(cubin_files) != 1:
            raise RuntimeError(
                f"expected one PTX and one cubin in {out} after compiling, found "
                f"{[p.name for p in ptx_files + cubin_files]}"
            )
        ptx = ptx_files[0].read_text()
        cubin = cubin_files[0].read_bytes()
        sass = disassemble(cubin_files[0], nvdisasm)
        dump_dir = None
        if keep_dir is not None:
            keep = Path(keep_dir)
            keep.mkdir(parents=True, exist_ok=True)
            for f in (ptx_files[0], cubin_files[0]):
                shutil.copy2(f, keep / f.name)
            (keep / cubin_files[0].name.replace(".cubin", ".sass")).write_text(sass)
            dump_dir = str(keep)
    return CompileArtifacts(
        arch=arch,
        compile_s=compile_s,
        ptx=ptx,
        cubin=cubin,
        sass=sass,
        ptxas_log=err.getvalue(),
        dump_dir=dump_dir,
        entries=list(parse_ptx(ptx)),
        launches=launches,
    )


def _static_dims(value):
    """A launch dimension as a tuple of 3 ints when it is static; else its repr."""
    if value is None:
        return None
    try:
        dims = tuple(int(v) for v in value)
    except Exception:  # a run-time (staged) value: the DSL refuses int() on it
        return "dynamic"
    return dims + (1,) * (3 - len(dims))


@contextlib.contextmanager
def _record_launches(out: list):
    """Record the grid/block/cluster/smem of each kernel launch the host function emits.

    The cluster shape is a launch attribute: it is not in the PTX or the cubin unless the
    kernel declares .reqnctapercluster, so it is read where the host code launches.
    """
    try:
        from cutlass.cutlass_dsl.cutlass import KernelLauncher
    except ImportError:  # another DSL layout: the report falls back to the declared cluster
        yield
        return
    original = KernelLauncher.launch

    def launch(self, *args, **kwargs):
        try:
            smem = kwargs.get("smem")
            out.append({
                "kernel": getattr(self.funcBody, "__name__", "?"),
                "grid": _static_dims(kwargs.get("grid")),
                "block": _static_dims(kwargs.get("block")),
                "cluster": _static_dims(kwargs.get("cluster")) or (1, 1, 1),
                "smem": smem if isinstance(smem, int) else None,
                "use_pdl": bool(kwargs.get("use_pdl", False)),
            })
        except Exception:  # recording must never change what the compile does
            pass
        return original(self, *args, **kwargs)

    KernelLauncher.launch = launch
    try:
        yield
    finally:
        KernelLauncher.launch = original


def disassemble(cubin_path: os.PathLike, nvdisasm: str) -> str:
    import subprocess

    proc = subprocess.run([nvdisasm, "-c", str(cubin_path)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"nvdisasm failed on {cubin_path}: {proc.stderr.strip()}")
    return proc.stdout


# --------------------------------------------------------------------------------------------
# SASS
# --------------------------------------------------------------------------------------------

_SASS_LINE = re.compile(r"^\s*/\*(?P<addr>[0-9a-f]{4,})\*/\s+(?P<body>[^;]*);", re.IGNORECASE)
_GUARD = re.compile(r"^@!?U?P[0-9T]+\s+")


def sass_instructions(sass: str) -> list[str]:
    """The opcode (with modifiers, guard predicate dropped) of every instruction line."""
    ops = []
    for line in sass.splitlines():
        m = _SASS_LINE.match(line)
        if not m:
            continue
        body = _GUARD.sub("", m.group("body").strip())
        if body:
            ops.append(body.split()[0])
    return ops


_USETMAXREG = re.compile(r"USETMAXREG\.(?P<kind>\w+)[\w.]*\s+(?:U?P\w+,\s*)?(?P<n>0x[0-9a-f]+|\d+)\s*;",
                         re.IGNORECASE)


def sass_setmaxnreg(sass: str) -> list[tuple[str, int]]:
    """(direction, registers) of each USETMAXREG in the SASS: ``DEALLOC`` is setmaxnreg.dec,
    ``TRY_ALLOC``/``ALLOC`` setmaxnreg.inc; the register count is the immediate operand."""
    out = []
    for m in _USETMAXREG.finditer(sass):
        kind = "dec" if m.group("kind").upper() == "DEALLOC" else "inc"
        out.append((kind, int(m.group("n"), 0)))
    return out


def sass_full_histogram(sass: str) -> dict[str, int]:
    """Full spelling (opcode and all modifiers) -> count."""
    return dict(Counter(sass_instructions(sass)))


def sass_histogram(sass: str, always: Iterable[str] = ()) -> dict[str, int]:
    """Opcode -> count plus opcode.modifier -> count (see the module docstring).

    Keys in ``always`` are present even when zero, so a report's reader can tell "absent" from
    "not looked for".
    """
    hist: Counter = Counter({k: 0 for k in always})
    for op in sass_instructions(sass):
        base, *mods = op.split(".")
        hist[base] += 1
        for mod in dict.fromkeys(mods):
            hist[f"{base}.{mod}"] += 1
    return dict(sorted(hist.items()))


_SASS_LABEL = re.compile(r"^\s*(\.L_x_\d+):")


def sass_listing(sass: str) -> tuple[list[tuple[int, str]], dict[str, int]]:
    """[(address, instruction)] and {label: address} of an nvdisasm listing."""
    ins, labels, pending = [], {}, []
    for line in sass.splitlines():
        m = _SASS_LABEL.match(line)
        if m:
            pending.append(m.group(1))
            continue
        m = _SASS_LINE.match(line)
        if m:
            addr = int(m.group("addr"), 16)
            for name in pending:
                labels[name] = addr
            pending = []
            ins.append((addr, m.group("body").strip()))
    return ins, labels


def sass_opcode(instr: str) -> str:
    """The opcode with its modifiers, guard predicate dropped."""
    return _GUARD.sub("", instr).split()[0]


def sass_loops(sass: str) -> list[list[tuple[int, str]]]:
    """The instructions of every loop, in listing order of its branch: a conditional backward
    branch and everything from its target to it. Out-of-line mbarrier retry stubs branch back
    unconditionally and are skipped."""
    ins, labels = sass_listing(sass)
    loops = []
    for addr, instr in ins:
        if not sass_opcode(instr).startswith("BRA") or not _GUARD.match(instr):
            continue
        m = re.search(r"\((\.L_x_\d+)\)", instr)
        start = labels.get(m.group(1)) if m else None
        if start is None or start > addr:
            continue
        loops.append([x for x in ins if start <= x[0] <= addr])
    return loops


def sass_main_loop(sass: str) -> list[tuple[int, str]]:
    """The instructions of the loop (``sass_loops``) that holds the most HGMMAs (ties: the
    shortest). Raises ValueError if no loop has an HGMMA."""
    best = None
    for body in sass_loops(sass):
        n = sum(sass_opcode(t).startswith("HGMMA") for _, t in body)
        if best is None or (n, -len(body)) > (best[0], -len(best[1])):
            best = (n, body)
    if best is None or best[0] == 0:
        raise ValueError("no loop with an HGMMA found in the SASS")
    return best[1]


# --------------------------------------------------------------------------------------------
# PTX
# --------------------------------------------------------------------------------------------

_ENTRY = re.compile(r"\.entry\s+(?P<name>[\w$]+)\s*\(")
_DIM3 = r"(\d+)(?:\s*,\s*(\d+))?(?:\s*,\s*(\d+))?"
_TMEM_ALLOC = re.compile(
    r"tcgen05\.alloc\.cta_group::(?P<group>\d)[\w:.]*\s+\[[^\]]+\],\s*(?P<cols>%r\d+|\d+);"
)
_SETMAXNREG = re.compile(r"setmaxnreg\.(?P<dir>inc|dec)\.sync\.aligned\.u32\s+(?P<n>\d+)")


def _dim3(m) -> tuple[int, int, int]:
    return tuple(int(g) if g else 1 for g in m.groups()[:3])


def _tmem_allocs(text: str) -> list[tuple[int, Optional[int]]]:
    """(cta_group, columns) of each tcgen05.alloc; a register operand is resolved through the
    nearest preceding ``mov.b32 %rN, imm`` (None when it is not an immediate move)."""
    out = []
    for m in _TMEM_ALLOC.finditer(text):
        cols = m.group("cols")
        if cols.startswith("%"):
            movs = re.findall(r"mov\.[bu]32\s+" + re.escape(cols) + r",\s*(\d+);", text[:m.start()])
            cols = movs[-1] if movs else None
        out.append((int(m.group("group")), int(cols) if cols is not None else None))
    return out


def parse_ptx(ptx: str) -> dict[str, dict]:
    """Entry name -> {reqntid, cluster, explicit_cluster, maxnreg, setmaxnreg, tmem_alloc}.

    ``setmaxnreg`` is the list of (direction, registers) in program order within the entry;
    ``tmem_alloc`` the list of (cta_group, columns) of its tcgen05.alloc instructions.
    """
    entries = {}
    starts = [(m.start(), m.group("name")) for m in _ENTRY.finditer(ptx)]
    for i, (pos, name) in enumerate(starts):
        end = starts[i + 1][0] if i + 1 < len(starts) else len(ptx)
        text = ptx[pos:end]
        body_at = text.find("{")
        header = text[:body_at] if body_at >= 0 else text
        reqntid = re.search(r"\.reqntid\s+" + _DIM3, header)
        cluster = re.search(r"\.reqnctapercluster\s+" + _DIM3, header)
        maxnreg = re.search(r"\.maxnreg\s+(\d+)", header)
        entries[name] = {
            "reqntid": _dim3(reqntid) if reqntid else None,
            "cluster": _dim3(cluster) if cluster else (1, 1, 1),
            "explicit_cluster": ".explicitcluster" in header,
            "maxnreg": int(maxnreg.group(1)) if maxnreg else None,
            "setmaxnreg": [(m.group("dir"), int(m.group("n"))) for m in _SETMAXNREG.finditer(text)],
            "tmem_alloc": _tmem_allocs(text),
        }
    return entries


# --------------------------------------------------------------------------------------------
# ptxas resource report (from the remarks{ptx} compile option)
# --------------------------------------------------------------------------------------------

_PTXAS_ENTRY = re.compile(r"Compiling entry function\s+'?(?P<name>[\w$.]+)'?\s+for\b")
_PTXAS_FRAME = re.compile(
    r"(?P<stack>\d+) bytes stack frame, (?P<stores>\d+) bytes spill stores, "
    r"(?P<loads>\d+) bytes spill loads"
)
_PTXAS_REGS = re.compile(r"Used (?P<regs>\d+) registers")


def parse_ptxas_log(log: str) -> dict[str, dict]:
    """Entry name -> {registers, stack_frame, spill_stores, spill_loads} from ptxas -v text.

    The DSL may re-wrap ptxas's lines inside a diagnostic (the entry name on a line of its own,
    quotes dropped), so the text is read with all whitespace runs folded into single spaces.
    """
    text = " ".join(log.split())
    out: dict[str, dict] = {}
    starts = list(_PTXAS_ENTRY.finditer(text))
    for i, m in enumerate(starts):
        end = starts[i + 1].start() if i + 1 < len(starts) else len(text)
        chunk = text[m.end():end]
        info = out.setdefault(m.group("name"), {})
        frame = _PTXAS_FRAME.search(chunk)
        if frame:
            info.update(stack_frame=int(frame.group("stack")),
                        spill_stores=int(frame.group("stores")),
                        spill_loads=int(frame.group("loads")))
        regs = _PTXAS_REGS.search(chunk)
        if regs:
            info["registers"] = int(regs.group("regs"))
    return out


# --------------------------------------------------------------------------------------------
# cubin (ELF) attributes: the .nv.info sections
# --------------------------------------------------------------------------------------------

# EIATTR codes of the CUDA ELF .nv.info records used here.
EIATTR_FRAME_SIZE = 0x11
EIATTR_REQNTID = 0x10
EIATTR_MAX_STACK_SIZE = 0x23
EIATTR_REGCOUNT = 0x2F
EIATTR_CTA_PER_CLUSTER = 0x3D
_EIFMT_SVAL = 0x04


def _elf_sections(data: bytes) -> dict[str, tuple[int, int, int]]:
    """Section name -> (offset, size, info) of a little-endian ELF64 file."""
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise ValueError("not an ELF64 cubin")
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    raw = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    str_off = raw[shstrndx][4]

    def name(o):
        end = data.index(b"\0", str_off + o)
        return data[str_off + o:end].decode()

    return {name(s[0]): (s[4], s[5], s[7]) for s in raw}


def _elf_symbols(data: bytes, sections) -> list[str]:
    off, size, _ = sections[".symtab"]
    str_off = sections[".strtab"][0]
    names = []
    for i in range(size // 24):
        st_name = struct.unpack_from("<I", data, off + 24 * i)[0]
        end = data.index(b"\0", str_off + st_name)
        names.append(data[str_off + st_name:end].decode())
    return names


def _nv_info_records(blob: bytes):
    p = 0
    while p + 4 <= len(blob):
        fmt, attr, size = struct.unpack_from("<BBH", blob, p)
        p += 4
        if fmt == _EIFMT_SVAL:
            yield attr, blob[p:p + size]
            p += size
        else:
            yield attr, size


def cubin_attributes(cubin: bytes) -> dict[str, dict]:
    """Kernel name -> {registers, frame_size, max_stack, reqntid, cluster} from .nv.info records."""
    secs = _elf_sections(cubin)
    syms = _elf_symbols(cubin, secs)
    out: dict[str, dict] = {}

    def per_symbol(blob, attr, key):
        for a, val in _nv_info_records(blob):
            if a == attr and isinstance(val, bytes) and len(val) == 8:
                sym, value = struct.unpack("<II", val)
                if sym < len(syms):
                    out.setdefault(syms[sym], {})[key] = value

    if ".nv.info" in secs:
        off, size, _ = secs[".nv.info"]
        blob = cubin[off:off + size]
        per_symbol(blob, EIATTR_REGCOUNT, "registers")
        per_symbol(blob, EIATTR_FRAME_SIZE, "frame_size")
        per_symbol(blob, EIATTR_MAX_STACK_SIZE, "max_stack")
    for name, (off, size, _) in secs.items():
        if not name.startswith(".nv.info."):
            continue
        kernel = name[len(".nv.info."):]
        entry = out.setdefault(kernel, {})
        for attr, val in _nv_info_records(cubin[off:off + size]):
            if attr == EIATTR_REQNTID and isinstance(val, bytes) and len(val) == 12:
                entry["reqntid"] = struct.unpack("<III", val)
            elif attr == EIATTR_CTA_PER_CLUSTER and isinstance(val, bytes) and len(val) == 12:
                entry["cluster"] = struct.unpack("<III", val)
    return out


def fake_rowmajor(dtype, shape, align: int = 16):
    """A fake compact row-major tensor of ``shape`` (ints or ``cute.sym_int`` run-time
    extents) for a compile signature: the layout of a ``.contiguous()`` torch tensor, as TVM
    FFI checks it at each call."""
    from cutlass.cute.runtime import make_fake_compact_tensor

    order = tuple(range(len(shape) - 1, -1, -1))
    return make_fake_compact_tensor(dtype, shape, stride_order=order, assumed_align=align)
