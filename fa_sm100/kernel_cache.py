"""Compiled kernels: compiled once per machine, loaded once per process.

Every kernel the public functions launch comes from ``kernel(kind, key, build)``:

1. in memory: a dict lookup, keyed by ``(kind, key)`` (``key`` holds the frozen config, the
   target arch and any active cost probe);
2. on disk: an object file named by a hash of the key and of everything the kernel's code
   depends on (``fingerprint``: the DSL and TVM-FFI versions, the Python version, the source of
   ``fa_sm100``, ``pipelines`` and ``layouts``), loaded with ``cute.runtime.load_module``;
3. otherwise ``build()`` compiles it (``cute.compile`` with ``--enable-tvm-ffi``), and the
   result is exported to the disk cache for the next process.

Either way the caller gets a ``tvm_ffi.Function``: positional arguments (torch tensors, None,
Python scalars), launched on the current torch stream, with no Python wrapper between the call
and the C entry point.

The disk cache lives in ``$FA_SM100_CACHE_DIR``, else ``$XDG_CACHE_HOME/fa_sm100``, else
``~/.cache/fa_sm100``; ``FA_SM100_DISK_CACHE=0`` turns it off. Entries are written to a
temporary name and renamed into place, so a reader never sees a partial file and two processes
compiling the same kernel at once both succeed (the second rename replaces an equal file). An
entry that fails to load is treated as a miss and replaced. Code changes never hit a stale
entry: they change the fingerprint, so the name.

``records()`` lists what each kernel cost this process (compile, disk load), for the warm-up
command (``python -m fa_sm100 warmup``) and for tests.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Optional

log = logging.getLogger("fa_sm100")

# The packages whose source a kernel is built from (the fingerprint hashes their .py files).
_SOURCE_PACKAGES = ("fa_sm100", "pipelines", "layouts")
_EXPORT_NAME = "fa_sm100_kernel"  # the symbol each object file exports

_lock = threading.Lock()
_memory: dict = {}
_records: list = []
# The DSL compiled functions whose inner tvm_ffi.Function we call: held for the life of the
# process, so nothing they own (the loaded CUDA library) is released under a live function.
_owners: list = []


@dataclasses.dataclass(frozen=True)
class KernelRecord:
    """One kernel made ready in this process: how (``compiled`` or ``disk``) and in how many
    seconds (the compile, or the load of the object file)."""

    kind: str
    key: str
    source: str
    seconds: float
    path: Optional[str] = None


def cache_dir() -> Path:
    """The disk cache's folder (see the module docstring for the order of the settings)."""
    explicit = os.environ.get("FA_SM100_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fa_sm100"


def disk_enabled() -> bool:
    return os.environ.get("FA_SM100_DISK_CACHE", "1") != "0"


_fingerprint: Optional[str] = None


def fingerprint() -> str:
    """A hash of what a compiled kernel depends on besides its key: the DSL, TVM-FFI and
    Python versions and the source files of the packages kernels are built from."""
    global _fingerprint
    if _fingerprint is None:
        from importlib import metadata

        h = hashlib.sha256()
        for dist in ("nvidia-cutlass-dsl", "apache-tvm-ffi"):
            try:
                h.update(f"{dist}={metadata.version(dist)};".encode())
            except metadata.PackageNotFoundError:
                h.update(f"{dist}=absent;".encode())
        h.update(f"python={sys.version_info[:2]};".encode())
        root = Path(__file__).resolve().parent.parent
        for package in _SOURCE_PACKAGES:
            for path in sorted((root / package).rglob("*.py")):
                h.update(str(path.relative_to(root)).encode())
                h.update(path.read_bytes())
        _fingerprint = h.hexdigest()
    return _fingerprint


def entry_path(kind: str, key) -> Path:
    """The object file of ``(kind, key)`` in the disk cache."""
    digest = hashlib.sha256(f"{fingerprint()}|{kind}|{key!r}".encode()).hexdigest()[:32]
    return cache_dir() / f"{kind}-{digest}.o"


def _raw_function(compiled):
    """The ``tvm_ffi.Function`` inside a DSL compiled function. The DSL wraps it in a Python
    adapter for keyword arguments, which we never pass; the adapter is skipped where the DSL
    exposes the function, and kept otherwise."""
    return getattr(compiled, "_tvm_ffi_function", None) or compiled


def _load(path: Path):
    import cutlass.cute as cute

    module = cute.runtime.load_module(str(path), enable_tvm_ffi=True)
    return getattr(module, _EXPORT_NAME)


def _export(compiled, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".o", dir=path.parent)
    os.close(fd)
    try:
        compiled.export_to_c(tmp, function_name=_EXPORT_NAME)
        if os.path.getsize(tmp) == 0:
            raise OSError("the DSL wrote an empty object file")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def kernel(kind: str, key, build: Callable[[], object]):
    """The launchable kernel of ``(kind, key)``: from memory, from disk, or ``build()`` (which
    returns a DSL compiled function). ``key`` must be hashable and its ``repr`` must name
    everything that changes the compiled code (frozen configs do)."""
    cache_key = (kind, key)
    fn = _memory.get(cache_key)
    if fn is not None:
        return fn
    with _lock:
        fn = _memory.get(cache_key)
        if fn is not None:
            return fn
        path = entry_path(kind, key) if disk_enabled() else None
        if path is not None and path.exists():
            start = time.perf_counter()
            try:
                fn = _load(path)
            except Exception as e:  # noqa: BLE001 - a bad entry is a miss; it is rebuilt
                log.warning("fa_sm100: kernel cache entry %s did not load (%s: %s); "
                            "recompiling", path, type(e).__name__, e)
            else:
                _records.append(KernelRecord(kind, repr(key), "disk",
                                             time.perf_counter() - start, str(path)))
        if fn is None:
            log.info("fa_sm100: compiling %s (first use of this config)", kind)
            start = time.perf_counter()
            compiled = build()
            seconds = time.perf_counter() - start
            written = None
            if path is not None:
                try:
                    _export(compiled, path)
                    written = str(path)
                except Exception as e:  # noqa: BLE001 - a read-only or full disk: memory only
                    log.warning("fa_sm100: could not write kernel cache entry %s (%s: %s)",
                                path, type(e).__name__, e)
            fn = _raw_function(compiled)
            _owners.append(compiled)
            _records.append(KernelRecord(kind, repr(key), "compiled", seconds, written))
            log.info("fa_sm100: compiled %s in %.1f s", kind, seconds)
        _memory[cache_key] = fn
        return fn


def records() -> list:
    """The kernels made ready in this process, in order (``KernelRecord``)."""
    return list(_records)


def clear_memory() -> None:
    """Forget the kernels loaded in this process (the disk cache stays)."""
    with _lock:
        _memory.clear()
