"""Registry entry ``sm90_fwd``: build the Hopper forward for a cross-compile on the CPU.

``scripts/inspect.py sm90_fwd --arch sm_90a --set head_dim=256`` and the compile-contract tests
reach the kernel through ``KERNEL``. The fake arguments are the ones ``sm90_fwd`` compiles
with: dynamic batch, sequence lengths, head counts and strides; static head dims.
"""

from __future__ import annotations

from fa_sm100.hopper.config import Sm90FwdConfig, sm90_fwd_config_from_overrides
from fa_sm100.registry import KernelBuild, KernelEntry


def build(cfg: Sm90FwdConfig, arch: str = "sm_90a") -> KernelBuild:
    if arch != "sm_90a":
        raise ValueError(f"sm90_fwd compiles for sm_90a only, not {arch}")
    from fa_sm100.hopper.fwd_kernel import Sm90FwdKernel
    from fa_sm100.hopper.interface import fake_arguments

    from cutlass.cute.runtime import make_fake_stream

    *args, _ = fake_arguments(cfg)  # the inspect compile has no TVM FFI environment stream
    return KernelBuild(
        fn=Sm90FwdKernel(cfg),
        args=(*args, make_fake_stream()),
        arch=arch,
        config=cfg,
        smem_bytes=cfg.smem_bytes(),
        tmem_cols=None,
        setmaxnreg=cfg.setmaxnreg(),
        cluster=(1, 1, 1),
    )


KERNEL = KernelEntry(
    name="sm90_fwd",
    archs=("sm_90a",),
    make_config=sm90_fwd_config_from_overrides,
    build=build,
)
