"""Named (hardware) barriers of the SM100 forward kernel.

Barrier 0 is ``__syncthreads``; ours start at 1. A named barrier synchronizes a fixed set of
threads of one CTA (``bar.sync id, nthreads``). Each member of ``NamedBarrier`` names the roles
that take part; the thread count is derived from ``WarpRoles`` (never typed as a literal).

``named_sync(barrier, roles)`` issues ``bar.sync`` while tracing and records a ``named_sync``
event with the thread count it declares for the protocol model (pipelines/model.py), which
blocks each arriving role of a CTA until that many threads of the CTA have arrived -- as the
hardware counts, so a participant that never arrives (e.g. the MMA warp of the non-leader
CTA) is a deadlock.
"""

from __future__ import annotations

import enum

from fa_sm100.config import WARP_SIZE, WarpRoles
from pipelines import record


class NamedBarrier(enum.IntEnum):
    """Every named barrier id the SM100 forward uses. 0 is reserved for ``__syncthreads``."""

    # The MMA warp allocates TMEM and writes the base address to SMEM; every role that reads
    # or writes TMEM waits here before using the address.
    TMEM_ALLOC = 1


# Roles taking part in each named barrier ("softmax" = both softmax warpgroups).
NAMED_BARRIER_ROLES: dict[NamedBarrier, tuple[str, ...]] = {
    NamedBarrier.TMEM_ALLOC: ("mma", "softmax0", "softmax1", "correction"),
}


# The SM100 backward's (fa_sm100/sm100/bwd_kernel.py): the roles that touch TMEM.
BWD_NAMED_BARRIER_ROLES: dict[NamedBarrier, tuple[str, ...]] = {
    NamedBarrier.TMEM_ALLOC: ("mma", "compute", "dq"),
}


def participants(barrier: NamedBarrier, roles=None) -> tuple[str, ...]:
    """The roles that take part in ``barrier`` in the kernel of ``roles`` (the forward's
    ``WarpRoles`` by default, or the backward's ``BwdWarpRoles``)."""
    from fa_sm100.sm100.bwd_config import BwdWarpRoles

    table = BWD_NAMED_BARRIER_ROLES if isinstance(roles, BwdWarpRoles) else NAMED_BARRIER_ROLES
    return table[NamedBarrier(barrier)]


def num_threads(barrier: NamedBarrier, roles: WarpRoles | None = None) -> int:
    """Threads that must reach ``barrier`` (warps of its roles x 32)."""
    roles = roles or WarpRoles()
    warps = roles.role_warps()
    n = sum(len(warps[r]) for r in participants(barrier, roles)) * WARP_SIZE
    if n % WARP_SIZE or n <= 0:
        raise ValueError(f"named barrier {barrier.name}: thread count {n} must be a positive multiple of 32")
    return n


def check_named_barriers() -> None:
    """Ids start at 1, are unique and below the 16 hardware barriers; every id has its roles."""
    ids = [int(b) for b in NamedBarrier]
    if min(ids) != 1 or len(set(ids)) != len(ids) or max(ids) > 15:
        raise ValueError(f"named barrier ids must be unique in [1, 15], got {ids}")
    missing = [b.name for b in NamedBarrier if b not in NAMED_BARRIER_ROLES]
    if missing:
        raise ValueError(f"named barriers without participant roles: {missing}")
    roles = WarpRoles().role_warps()
    for b, rs in NAMED_BARRIER_ROLES.items():
        for r in rs:
            if r not in roles:
                raise ValueError(f"named barrier {b.name}: unknown role {r!r}")


def named_sync(barrier: NamedBarrier, roles: WarpRoles | None = None) -> None:
    """``bar.sync barrier, num_threads(barrier, roles)`` (records a ``named_sync`` event with
    that thread count first). ``roles``: the kernel's ``WarpRoles`` (default ``WarpRoles()``)."""
    barrier = NamedBarrier(barrier)
    threads = num_threads(barrier, roles)
    record.emit("named_sync", barrier.name, threads=threads)
    if record.is_dry():
        return
    import cutlass.cute as cute

    cute.arch.barrier(barrier_id=int(barrier), number_of_threads=threads)
