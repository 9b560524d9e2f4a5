"""Named barriers of the SM90 forward. Id 0 is ``__syncthreads``; ours start at 1."""

from enum import IntEnum


class Sm90FwdBarrier(IntEnum):
    # All consumer threads: O may be staged in SMEM (every QK GEMM has read Q), then O is staged.
    EPILOGUE = 1
    # Ping-pong: consumer warpgroup w waits on PINGPONG_WG0 + w before issuing its GEMMs and
    # arrives on the next warpgroup's barrier after issuing them (2 x 128 threads each).
    PINGPONG_WG0 = 2
    PINGPONG_WG1 = 3
    PINGPONG_WG2 = 4
