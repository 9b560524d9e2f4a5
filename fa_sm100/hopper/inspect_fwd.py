"""Registry entry ``sm90_fwd``: build the Hopper forward for a cross-compile on the CPU.

``scripts/inspect.py sm90_fwd --arch sm_90a --set head_dim=256`` and the compile-contract tests
reach the kernel through ``KERNEL``. The fake arguments are the ones ``sm90_fwd`` compiles
with: dynamic batch, sequence lengths, head counts and strides; static head dims.
"""

from __future__ import annotations

from fa_sm100.hopper.config import SM90_ARCH, Sm90FwdConfig, sm90_fwd_config_from_overrides
from fa_sm100.registry import KernelBuild, KernelEntry


def _inspect_arguments(cfg: Sm90FwdConfig) -> tuple:
    """``sm90_fwd``'s fake arguments with a plain fake stream: the inspect compile has no
    TVM FFI environment stream."""
    from cutlass.cute.runtime import make_fake_stream

    from fa_sm100.hopper.interface import fake_arguments

    *args, _ = fake_arguments(cfg)
    return (*args, make_fake_stream())


def build(cfg: Sm90FwdConfig, arch: str = SM90_ARCH) -> KernelBuild:
    from fa_sm100.hopper.common import sm90_kernel_build
    from fa_sm100.hopper.fwd_kernel import Sm90FwdKernel

    return sm90_kernel_build("sm90_fwd", cfg, arch, Sm90FwdKernel, _inspect_arguments)


KERNEL = KernelEntry(
    name="sm90_fwd",
    archs=(SM90_ARCH,),
    make_config=sm90_fwd_config_from_overrides,
    build=build,
)
