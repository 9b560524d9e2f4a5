"""Registry entry ``sm90_bwd``: the Hopper backward main kernel, for a cross-compile on the CPU.

``scripts/inspect.py sm90_bwd --arch sm_90a --set causal=true --set qhead_per_kvhead=4`` and
the compile-contract test reach the kernel through ``KERNEL``. The fake arguments are the ones
``sm90_bwd`` compiles with (``bwd_interface.fake_arguments``). The preprocess and postprocess
kernels are plain CUDA-core code and are not part of the report.
"""

from fa_sm100.config import parse_overrides
from fa_sm100.hopper.bwd_config import BwdConfig
from fa_sm100.hopper.bwd_defaults import select_bwd_config
from fa_sm100.hopper.config import SM90_ARCH
from fa_sm100.registry import KernelBuild, KernelEntry


def make_config(overrides) -> BwdConfig:
    """Defaults for hdim 128 bf16 with ``--set field=value`` overrides, validated."""
    changes = parse_overrides(overrides, cls=BwdConfig)
    return select_bwd_config(**changes)


def build(cfg: BwdConfig, arch: str = SM90_ARCH) -> KernelBuild:
    from fa_sm100.hopper.bwd_interface import fake_arguments
    from fa_sm100.hopper.bwd_kernel import Sm90FlashBackward
    from fa_sm100.hopper.common import sm90_kernel_build

    return sm90_kernel_build("sm90_bwd", cfg, arch, Sm90FlashBackward, fake_arguments)


KERNEL = KernelEntry(name="sm90_bwd", archs=(SM90_ARCH,), make_config=make_config, build=build)
