"""Note [Packed workspace] (fa_sm100/varlen.py): the varlen backward's workspace blocks and its
grid of key-block tiles. The block arithmetic is checked on ragged batches in Python; the
traced tile decoder (``packed_tile``, warp sums, ballots and shuffles) is cross-compiled, run
on the PTX emulator for every tile of a grid, and compared with its Python model, which is
itself checked against the order the padded grid had."""

import itertools
import random

import pytest
import torch

from fa_sm100.varlen import first_block, packed_blocks, packed_tile_model

BATCHES = [
    [0, 1, 3000, 77, 1500, 640, 9000, 33],        # the benchmark's ragged mix
    [128, 4096, 1024, 2048, 3072, 3200, 4032],
    [0, 0, 5],
    [64] * 3 + [65, 63, 0, 1],
    [random.Random(s).randrange(0, 700) for s in range(70)],   # three warp turns
]
TILES = (64, 80, 128)


def _cu(lengths):
    return [0] + list(itertools.accumulate(lengths))


@pytest.mark.parametrize("lengths", BATCHES)
@pytest.mark.parametrize("tile", TILES)
def test_sequences_get_disjoint_blocks_inside_the_packed_bound(lengths, tile):
    """Each sequence's ceil(len / tile) blocks start at first_block and end at or before the
    next sequence's first block; the last ends by packed_blocks, which never exceeds the
    tokens' blocks plus one per sequence."""
    cu = _cu(lengths)
    n = len(lengths)
    for s, length in enumerate(lengths):
        end = first_block(cu, s, tile) + -(-length // tile)
        assert end <= first_block(cu, s + 1, tile)
    assert first_block(cu, n, tile) == packed_blocks(cu[-1], n, tile)
    assert packed_blocks(cu[-1], n, tile) <= -(-cu[-1] // tile) + n
    # and it bounds the key blocks, the grid of the packed tiles
    assert sum(-(-x // tile) for x in lengths) <= packed_blocks(cu[-1], n, tile)


@pytest.mark.parametrize("lengths", BATCHES[:4])
def test_model_is_the_padded_order_without_empty_blocks(lengths):
    """The model enumerates exactly the (sequence, head, block) tiles with a block inside its
    sequence, in the padded grid's order (block fastest, then head, then sequence)."""
    heads, tile = 3, 128
    padded = [(s, h, b) for s, length in enumerate(lengths) for h in range(heads)
              for b in range(-(-max(lengths) // tile)) if b * tile < length]
    bound = heads * packed_blocks(sum(lengths), len(lengths), tile)
    got = [packed_tile_model(lengths, heads, tile, t) for t in range(bound)]
    assert [g[:3] for g in got if g[4]] == padded
    assert all(g[3] == -(-lengths[g[0]] // tile) for g in got if g[4])
    assert all(g == (0,) * 5 for g in got[len(padded):])


# ---- the traced decoder on the PTX emulator --------------------------------------------------

cutlass = pytest.importorskip("cutlass")
import cutlass.cute as cute  # noqa: E402
from cutlass.cute.runtime import from_dlpack, make_fake_compact_tensor, make_fake_stream  # noqa: E402

from fa_sm100.ptxemu import capture_launch, emulate  # noqa: E402
from fa_sm100.packed_tiles import packed_tile, packed_tile_count  # noqa: E402

HEADS = 3
WARPS = 2


def _decode_host(tile: int, used: bool):
    @cute.kernel
    def kernel(cu: cute.Tensor, seq_used, out: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        t, _, _ = cute.arch.block_idx()
        decoded = packed_tile(cu, seq_used, cu.shape[0] - 1, HEADS, tile, t)
        count = packed_tile_count(cu, seq_used, cu.shape[0] - 1, HEADS, tile)
        if tidx % 32 == 0:
            for i in cutlass.range_constexpr(5):
                out[t, tidx // 32, i] = decoded[i]
            out[t, tidx // 32, 5] = count

    @cute.jit
    def host(cu: cute.Tensor, seq_used, out: cute.Tensor, tiles: cutlass.Int32, stream):
        kernel(cu, seq_used, out).launch(grid=(tiles, 1, 1), block=(32 * WARPS, 1, 1),
                                         stream=stream)
    return host


def _fake(rank):
    shape = (cute.sym_int(),) + (WARPS, 6)[:rank - 1]
    return make_fake_compact_tensor(cutlass.Int32, shape,
                                    stride_order=tuple(range(rank - 1, -1, -1)), assumed_align=4)


def _real(t, like):
    """A CPU tensor as the kernel compiled with ``like`` takes it: dim 0 of run-time extent."""
    ct = from_dlpack(t, assumed_align=4,
                     use_32bit_stride=bool(getattr(like, "_use_32bit_stride", False)))
    return ct.mark_compact_shape_dynamic(mode=0, stride_order=tuple(range(t.dim())))


@pytest.mark.parametrize("lengths,tile,used", [
    (BATCHES[0], 128, False), (BATCHES[3], 64, False), (BATCHES[4][:40], 80, False),
    ([300, 0, 1000, 77], 128, True)])
def test_packed_tile_decodes_every_tile_of_the_grid(lengths, tile, used):
    """Every CTA of the grid (heads x packed_blocks, the bound the kernel launches) decodes
    its tile as the model does, in every warp, and counts the tiles that exist
    (``packed_tile_count``); with seqused_k the used lengths count."""
    import cuda.bindings.driver as cuda

    cu = torch.tensor(_cu(lengths), dtype=torch.int32)
    seq_used = None
    counted = lengths
    if used:
        counted = [max(0, x - 37 * (i % 3)) for i, x in enumerate(lengths)]
        seq_used = torch.tensor(counted, dtype=torch.int32)
    bound = HEADS * packed_blocks(cu[-1].item(), len(lengths), tile)
    out = torch.full((bound, WARPS, 6), -1, dtype=torch.int32)
    fakes = (_fake(1), _fake(1) if used else None, _fake(3), cutlass.Int32(1),
             make_fake_stream())
    reals = (_real(cu, fakes[0]), _real(seq_used, fakes[1]) if used else None,
             _real(out, fakes[2]), cutlass.Int32(bound), cuda.CUstream(0))
    cap = capture_launch(_decode_host(tile, used), fakes, reals)
    emulate(cap, [cu] + ([seq_used] if used else []) + [out], seed=0)
    want = torch.tensor([packed_tile_model(counted, HEADS, tile, t) for t in range(bound)],
                        dtype=torch.int32)
    tiles = HEADS * sum(-(-x // tile) for x in counted)
    for w in range(WARPS):
        got = out[:, w, :5]
        assert torch.equal(got, want), (w, got[(got != want).any(1)][:4])
        assert (out[:, w, 5] == tiles).all(), "packed_tile_count"
    assert want[:, 4].sum() == tiles
