"""Packed tile spaces of variable-length batches, traced inside kernels: a grid (or a
persistent walk) whose tiles are the blocks that exist, sequence by sequence, with no tile for
the blocks past a sequence's end (Note [Packed workspace] in fa_sm100/varlen.py bounds them
on the host; ``packed_tile_model`` there is the Python reference). The SM90 backward decodes
its key-block tiles with ``packed_tile`` (Note [Varlen backward] in hopper/bwd_kernel.py), the
SM100 forward its query-block tiles (``scheduler.StaticScheduler``)."""

import cutlass
import cutlass.cute as cute
from cutlass import Int32


@cute.jit
def _blocks(cu_seqlens, seq_used, sequences, tile: int, s):
    """Blocks of ``tile`` rows of sequence ``s`` (0 past the last sequence): its length from
    ``seq_used`` where given, else from ``cu_seqlens``."""
    blocks = Int32(0)
    if s < sequences:
        length = cu_seqlens[s + 1] - cu_seqlens[s]
        if cutlass.const_expr(seq_used is not None):
            length = seq_used[s]
        blocks = (length + tile - 1) // tile
    return blocks


@cute.jit
def _inclusive_warp_sum(x):
    """The sum of ``x`` over lanes 0 .. this lane (five shuffles up)."""
    lane = cute.arch.lane_idx()
    for k in cutlass.range_constexpr(5):
        below = cute.arch.shuffle_sync_up(x, 1 << k)
        x = x + cutlass.select_(lane >= (1 << k), below, Int32(0))
    return x


@cute.jit
def packed_tile_count(cu_seqlens, seq_used, sequences, heads, tile: int):
    """``heads`` x sum ceil(len_s / tile): the tiles of a packed tile space, summed by each
    warp 32 sequences per turn (every lane of the warp gets it)."""
    lane = cute.arch.lane_idx()
    total = Int32(0)
    for chunk in cutlass.range(cute.ceil_div(sequences, cute.arch.WARP_SIZE), unroll=1):
        blocks = _blocks(cu_seqlens, seq_used, sequences, tile,
                         chunk * cute.arch.WARP_SIZE + lane)
        total = total + cute.arch.shuffle_sync(_inclusive_warp_sum(blocks * heads),
                                               cute.arch.WARP_SIZE - 1)
    return total


@cute.jit
def packed_tile(cu_seqlens, seq_used, sequences, heads, tile: int, t):
    """Tile ``t`` of a grid of ``heads`` x sum ceil(len_s / tile) tiles: (sequence, head, block, the
    sequence's blocks, valid). The tiles run sequence by sequence, head by head within one,
    block by block within a head (the padded grid's order without the blocks past a sequence's
    end); ``valid`` is false for the tiles past the last (the grid is ``heads`` x
    ``packed_blocks``, an upper bound), which then come back as zeros. ``len_s`` is
    ``seq_used[s]`` where given, else from ``cu_seqlens``.

    Each warp finds the sequence by itself, 32 sequences per turn: lane i counts sequence i's
    tiles, an inclusive warp sum gives where each lane's tiles end, and the lanes that end at
    or before ``t`` (a ballot) are the sequences before ``t``'s. A turn that ends before
    ``t`` moves on to the next 32. Traced inline (run by every warp of the CTA, whose values
    then agree)."""
    lane = cute.arch.lane_idx()
    chunk, before = Int32(0), Int32(0)
    seq, head, block, count, valid = Int32(0), Int32(0), Int32(0), Int32(0), Int32(0)
    while chunk * cute.arch.WARP_SIZE < sequences:
        blocks = _blocks(cu_seqlens, seq_used, sequences, tile,
                         chunk * cute.arch.WARP_SIZE + lane)
        tiles = blocks * heads
        ends = _inclusive_warp_sum(tiles)  # where lane i's tiles end in this turn
        turn = cute.arch.shuffle_sync(ends, cute.arch.WARP_SIZE - 1)
        if t < before + turn:
            j = cute.arch.popc(cute.arch.vote_ballot_sync(before + ends <= t))
            start = before + cute.arch.shuffle_sync(ends - tiles, j)
            count = cute.arch.shuffle_sync(blocks, j)
            seq = chunk * cute.arch.WARP_SIZE + j
            head = (t - start) // count
            block = t - start - head * count
            valid = Int32(1)
            chunk = sequences  # past the last turn
        else:
            before = before + turn
            chunk = chunk + 1
    return seq, head, block, count, valid
