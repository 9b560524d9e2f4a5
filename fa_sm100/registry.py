"""The table of kernels that ``scripts/inspect.py`` and the compile-contract tests can build.

Each kernel module defines a module-level ``KERNEL = KernelEntry(...)``. ``get_kernel(name)``
imports that module lazily, so listing or naming a kernel never imports CuTe DSL, and a kernel
whose module is not written yet gives a clear error instead of an ImportError deep inside.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

# kernel name -> module that defines KERNEL
KERNEL_MODULES = {
    "sm100_fwd": "fa_sm100.sm100.inspect_entry",
    "sm100_bwd": "fa_sm100.sm100.bwd_inspect_entry",
    "sm90_fwd": "fa_sm100.hopper.inspect_fwd",
    "sm90_bwd": "fa_sm100.hopper.inspect_bwd",
    "tcgen05_demo": "fa_sm100.demo_tcgen05",
}


class KernelNotAvailable(LookupError):
    """The kernel is in the table but its module does not exist (yet) or defines no KERNEL."""


@dataclass
class KernelBuild:
    """Everything needed to cross-compile one kernel and to read its report.

    fn: the ``@cute.jit`` host function; args: its fake arguments (``cutlass.cute.runtime``
    fake tensors/stream, plain Python numbers); arch: "sm_100a" | "sm_90a"; config: the frozen
    config it was built from; smem_bytes: dynamic + static shared memory per CTA (the cubin does
    not record the dynamic part); tmem_cols: TMEM columns allocated (None on sm_90a);
    setmaxnreg: role -> registers the kernel sets with setmaxnreg ({} if none);
    setmaxnreg_warps: role -> the warps that execute that role's setmaxnreg (the report checks
    in the PTX that exactly these warps reach that value; {} skips the check);
    cluster: the cluster shape the host launches with.
    """

    fn: Callable
    args: tuple
    arch: str
    config: Any
    smem_bytes: int
    tmem_cols: Optional[int]
    setmaxnreg: dict = field(default_factory=dict)
    setmaxnreg_warps: dict = field(default_factory=dict)
    cluster: tuple = (1, 1, 1)


@dataclass
class KernelEntry:
    """name; archs it compiles for; make_config(overrides) -> validated config (ValueError on
    a bad ``--set``); build(config, arch) -> KernelBuild."""

    name: str
    archs: Sequence[str]
    make_config: Callable[[Sequence[str]], Any]
    build: Callable[[Any, str], KernelBuild]


def kernel_names() -> list[str]:
    return list(KERNEL_MODULES)


def get_kernel(name: str) -> KernelEntry:
    """The KernelEntry registered as ``name``; ValueError for an unknown name,
    KernelNotAvailable when its module is missing."""
    if name not in KERNEL_MODULES:
        raise ValueError(f"unknown kernel {name!r}: known kernels are {kernel_names()}")
    module_name = KERNEL_MODULES[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        # Only "this kernel's module is missing" is a not-available kernel; a missing
        # dependency inside an existing module is a real error and propagates.
        if e.name is not None and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise KernelNotAvailable(
                f"kernel {name!r} is not available yet: its module {module_name} does not exist"
            ) from e
        raise
    entry = getattr(module, "KERNEL", None)
    if not isinstance(entry, KernelEntry):
        raise KernelNotAvailable(
            f"kernel {name!r}: module {module_name} defines no KERNEL = KernelEntry(...)"
        )
    return entry
