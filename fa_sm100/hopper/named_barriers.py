"""Named barriers of the SM90 kernels. Id 0 is ``__syncthreads``; ours start at 1.

The forward and the backward are separate kernels, so their ids may overlap.
"""

from enum import IntEnum


class Sm90FwdBarrier(IntEnum):
    # All consumer threads: O may be staged in SMEM (every QK GEMM has read Q), then O is staged.
    EPILOGUE = 1
    # Ping-pong: consumer warpgroup w waits on PINGPONG_WG0 + w before issuing its GEMMs and
    # arrives on the next warpgroup's barrier after issuing them (2 x 128 threads each).
    PINGPONG_WG0 = 2
    PINGPONG_WG1 = 3
    PINGPONG_WG2 = 4
    # wg_epilogue: consumer warpgroup w's 128 threads, around staging its own rows of O
    # (Note [Warpgroup epilogues] in fwd_consumer.py).
    EPILOGUE_WG0 = 5
    EPILOGUE_WG1 = 6
    EPILOGUE_WG2 = 7


class Sm90BwdBarrier(IntEnum):
    # Both MMA warpgroups (256 threads): P and dS of this query block are in SMEM.
    DS_READY = 1
    # Both MMA warpgroups: dQ semaphore observed (deterministic mode only).
    DQ_TURN = 2
    # Both MMA warpgroups: every dQ addition of this CTA for this query block is issued.
    DQ_DONE = 3
    # "bulk" dQ (Note [dQ SMEM handoff]): the dq-store warp (32 threads) arrives when the SMEM
    # dQ tile may be overwritten and the MMA warpgroups wait; then the MMA warpgroups arrive
    # when the tile is in SMEM and the dq-store warp waits. Per warpgroup w (its half of the
    # tile, 128 + 32 threads): DQ_EMPTY_WG0 + w and DQ_FULL_WG0 + w; with one handoff of the
    # whole tile (``dq_handoff_per_wg=False``): DQ_EMPTY_WG0 and DQ_FULL_WG0, 256 + 32 threads.
    DQ_EMPTY_WG0 = 4
    DQ_EMPTY_WG1 = 5
    DQ_FULL_WG0 = 6
    DQ_FULL_WG1 = 7
    # early dV: warpgroup w's 128 threads have stored their P (P_READY_WG0 + w).
    P_READY_WG0 = 8
    P_READY_WG1 = 9
    # MHA dK/dV by TMA: both MMA warpgroups' GEMMs have retired (K and V may be overwritten),
    # then dK and dV are in SMEM (256 threads). With persistent CTAs also: both warpgroups
    # have the dQ tile back (before dV is staged there), and the stores have read SMEM
    # (before the next tile writes dS and dQ); Note [persistent CTAs] in bwd_tiles.py.
    EPILOGUE = 10
