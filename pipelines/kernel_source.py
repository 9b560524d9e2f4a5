"""The SM100 kernel's own protocol, for the model and the CLI (``--source kernel``).

The kernel package traces (cross-compiles for sm_100a, no GPU) its forward kernel inside
``record.recording()``: ``fa_sm100.sm100.protocol.kernel_recording(cfg)``. While the DSL
traces the kernel, every pipeline object, named barrier, loop, branch and access logs itself,
so the ``Recording`` is the protocol the kernel's code performs. This module is the one place
the pipelines package reaches for it, and checks that it recorded every role.
"""

from __future__ import annotations

from fa_sm100.config import FmhaConfig
from pipelines import record

ROLES = ("load", "mma", "softmax0", "softmax1", "correction", "epilogue")


def kernel_recording(cfg: FmhaConfig) -> record.Recording:
    from fa_sm100.sm100.protocol import kernel_recording as trace

    rec = trace(cfg)
    missing = [r for r in ROLES if r not in rec.programs]
    if missing:
        raise RuntimeError(f"tracing the SM100 kernel recorded no program for roles {missing}: "
                           "each role must run inside record.role(name)")
    return rec
