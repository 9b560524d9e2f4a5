"""The SM100 kernel's own protocol: trace (cross-compile) it inside ``record.recording()``.

``kernel_recording(cfg)`` returns the ``pipelines.record.Recording`` of every warp role, as
the pipeline objects and the roles logged it while the kernel was traced, for the protocol
model (``pipelines.model``) to check. It cross-compiles for sm_100a on the CPU (a few
seconds); results are cached per config.
"""

from __future__ import annotations

import os

_CACHE: dict = {}


def kernel_recording(cfg):
    """Recording of the SM100 forward's roles for ``cfg`` (validated first)."""
    cfg = cfg.validate()
    if cfg not in _CACHE:
        os.environ.setdefault("CUTE_DSL_ARCH", "sm_100a")
        import cutlass.cute as cute

        from fa_sm100.sm100.inspect_entry import fake_arguments
        from fa_sm100.sm100.kernel import Sm100Forward
        from pipelines import record

        with record.recording() as rec:
            cute.compile(Sm100Forward(cfg), *fake_arguments(cfg), options="--gpu-arch sm_100a")
        _CACHE[cfg] = rec
    return _CACHE[cfg]


def remember(cfg, rec) -> None:
    """Store a Recording made elsewhere while tracing ``cfg`` (e.g. during ``inspect_kernel``
    inside ``record.recording()``), so ``kernel_recording`` need not compile it again."""
    _CACHE.setdefault(cfg.validate(), rec)
