"""The SM100 kernel's own protocol, for the model and the CLI (``--source kernel``).

The kernel package traces (cross-compiles for sm_100a, no GPU) its forward kernel (or the
backward, for an ``Sm100BwdConfig``) inside
``record.recording()``: ``fa_sm100.sm100.protocol.kernel_recording(cfg)``. While the DSL
traces the kernel, every pipeline object, named barrier, loop, branch and access logs itself,
so the ``Recording`` is the protocol the kernel's code performs. This module is the one place
the pipelines package reaches for it, and checks that it recorded every role.
"""

from __future__ import annotations

from fa_sm100.config import FmhaConfig
from pipelines import record
from pipelines.spec import BWD_PIPELINES, table_of

ROLES = ("load", "mma", "softmax0", "softmax1", "correction", "epilogue")
# the SM100 backward's: its compute role is two parts (record.part), one per warpgroup
BWD_ROLES = ("load", "mma", "compute0", "compute1", "dq")


def roles_of(cfg) -> tuple[str, ...]:
    """The roles (and parts) the kernel of ``cfg`` records: the forward's or the backward's."""
    return BWD_ROLES if table_of(cfg) is BWD_PIPELINES else ROLES


def kernel_recording(cfg: FmhaConfig) -> record.Recording:
    from fa_sm100.sm100.protocol import kernel_recording as trace

    rec = trace(cfg)
    missing = [r for r in roles_of(cfg) if r not in rec.programs]
    if missing:
        raise RuntimeError(f"tracing the SM100 kernel recorded no program for roles {missing}: "
                           "each role must run inside record.role(name)")
    return rec
