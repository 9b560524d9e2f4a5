"""The SM100 kernels' own protocol: trace (cross-compile) them inside ``record.recording()``.

``kernel_recording(cfg)`` (the forward's, or the backward's for an ``Sm100BwdConfig``) returns the ``pipelines.record.Recording`` of every warp role, as
the pipeline objects and the roles logged it while the kernel was traced, for the protocol
model (``pipelines.model``) to check. It cross-compiles for sm_100a on the CPU (a few
seconds); results are cached per config.
"""

from __future__ import annotations

import os

_CACHE: dict = {}


def kernel_recording(cfg):
    """Recording of the SM100 forward's roles for ``cfg`` (validated first), or of the SM100
    backward's for an ``Sm100BwdConfig``."""
    cfg = cfg.validate()
    if cfg not in _CACHE:
        os.environ.setdefault("CUTE_DSL_ARCH", "sm_100a")
        import cutlass.cute as cute

        from fa_sm100.sm100.bwd_config import Sm100BwdConfig
        from pipelines import record

        if isinstance(cfg, Sm100BwdConfig):
            from fa_sm100.sm100.bwd_inspect_entry import fake_arguments
            from fa_sm100.sm100.bwd_kernel import Sm100Backward as Kernel
        else:
            from fa_sm100.sm100.inspect_entry import fake_arguments
            from fa_sm100.sm100.kernel import Sm100Forward as Kernel
        with record.recording() as rec:
            cute.compile(Kernel(cfg), *fake_arguments(cfg), options="--gpu-arch sm_100a")
        _CACHE[cfg] = rec
    return _CACHE[cfg]


def remember(cfg, rec) -> None:
    """Store a Recording made elsewhere while tracing ``cfg`` (e.g. during ``inspect_kernel``
    inside ``record.recording()``), so ``kernel_recording`` need not compile it again."""
    _CACHE.setdefault(cfg.validate(), rec)
