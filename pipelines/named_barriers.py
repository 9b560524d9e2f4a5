"""Named (hardware) barriers of the SM100 forward kernel.

Barrier 0 is ``__syncthreads``; ours start at 1. A named barrier synchronizes a fixed set of
threads of one CTA (``bar.sync id, nthreads``). Each member of ``NamedBarrier`` names the roles
that take part; the thread count is derived from ``WarpRoles`` (never typed as a literal).

``named_sync(barrier, cfg)`` issues ``bar.sync`` while tracing and records a ``named_sync``
event for the protocol model (pipelines/model.py), which blocks each participant until all
participants of that CTA have arrived.
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
    # Softmax warpgroup of Q stage 0 / 1 <-> correction warpgroup: row statistics in SMEM
    # (used when the kernel hands the statistics over by named barrier instead of sm_stats).
    SOFTMAX_CORRECTION_STATS_0 = 2
    SOFTMAX_CORRECTION_STATS_1 = 3
    # The correction warpgroup's four warps agree on the rescale vote.
    CORRECTION_VOTE = 4


# Roles taking part in each named barrier ("softmax" = both softmax warpgroups).
NAMED_BARRIER_ROLES: dict[NamedBarrier, tuple[str, ...]] = {
    NamedBarrier.TMEM_ALLOC: ("mma", "softmax0", "softmax1", "correction"),
    NamedBarrier.SOFTMAX_CORRECTION_STATS_0: ("softmax0", "correction"),
    NamedBarrier.SOFTMAX_CORRECTION_STATS_1: ("softmax1", "correction"),
    NamedBarrier.CORRECTION_VOTE: ("correction",),
}


def participants(barrier: NamedBarrier) -> tuple[str, ...]:
    return NAMED_BARRIER_ROLES[NamedBarrier(barrier)]


def num_threads(barrier: NamedBarrier, roles: WarpRoles | None = None) -> int:
    """Threads that must reach ``barrier`` (warps of its roles x 32)."""
    roles = roles or WarpRoles()
    warps = roles.role_warps()
    n = sum(len(warps[r]) for r in participants(barrier)) * WARP_SIZE
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
    """``bar.sync barrier, num_threads(barrier)`` (records a ``named_sync`` event first)."""
    barrier = NamedBarrier(barrier)
    record.emit("named_sync", barrier.name)
    if record.is_dry():
        return
    import cutlass.cute as cute

    cute.arch.barrier(barrier_id=int(barrier), number_of_threads=num_threads(barrier, roles))
