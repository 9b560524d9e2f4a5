"""Split tail: the last rounds of a persistent walk's tiles shared out by query blocks (a
mixin of ``Sm90FlashBackward``, and the plain functions behind it).

Note [split tail] (``split_tail``): with a fixed stride (Note [persistent CTAs] in
bwd_tiles.py) and tiles of equal length, the last round is short: 2048 tiles on 132 SMs are
15.5 rounds, and the 16th leaves half the SMs idle for a whole tile, 3% of the call
(``schedule_model --mode bwd``: 1.031 the ideal makespan in every non-causal cell of the
benchmark grid; one CTA per tile has the same last wave). With the switch each persistent CTA
takes ``rounds`` tiles whole by the stride (all but the last one to two rounds), and the rest,
the tail, is cut into units of one sweep step (a query block; one per cluster under
multicast, whose CTAs walk in step) shared out as evenly as whole units allow: cluster c takes
units [c T / C, (c + 1) T / C) of the T tail units over C clusters (``split_tail_range``).
Every cluster's share is at least one tile, so a tile is cut at most once, into two pieces:
the later part of one cluster's share and the first part of the next one's
(``split_tail_piece``). A piece is a sweep over steps [s0, s1) instead of all of them (the
load, MMA and dq-store roles loop over ``BwdTile.step_begin`` / ``step_end``); its dQ adds
into the accumulator like any tile's. Its dK and dV are partial sums that the two pieces meet
to add:
- the fix-up slot of the cut between clusters c - 1 and c is slot c * ctas + rank (one per
  persistent CTA): a flag among (batch 0, head 0)'s dQ semaphores (``split_flags`` in
  bwd_store.py; the preprocess zeroes it) and two halves of float32 partial dK and dV in the
  ``dkv_part`` workspace (half 0: the piece that ends part-way, 1: the one that starts
  part-way);
- the MMA warpgroups of each piece write their dK (scaled) and dV to their half in fragment
  order (16-byte stores: ``split_parts``), skip the TMA stores, and after a barrier thread 0
  fences and adds 1 to the flag (acq_rel); it finds 1 when the other piece has already
  written, and hands that answer to the producer warpgroup's two idle warps (warps 2 and 3)
  through a named barrier per half (``_hand_in_piece``), at which they wait asleep;
- those fix-up warps (``split_fixup``) wait for each piece their CTA has, and for the piece
  that finished second add the two halves, convert and store dK and dV (rows past seqlen_k
  skipped), 16 bytes of each half at a time, while the MMA warpgroups go on.
The sum is one float32 addition of the two pieces' partials, so dK and dV come out the same
bits whichever piece finishes first (a GPU test repeats calls). The MMA warpgroups only read
their accumulators: loading the other piece's partial beside them, or storing from them
directly, made ptxas serialize the sweep's WGMMAs for want of registers. The walk's numbers
(``rounds``, the share, the sweep's step count, where the flags start) sit in SMEM words that
each role reads per tile (``_split_tile_at``, ``_split_slot``), for the same reason. Rules
(``validate``): persistent CTAs without dynamic tiles, so no mask or window (the tiles' sweeps
are equal), and no ``early_dq_post``: its count is of whole tiles, and the split tail leaves
it no idle SMs to use.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from fa_sm100.hopper.bwd_store import fragment_registers, fragment_view
from fa_sm100.hopper.common import assume_aligned
from fa_sm100.hopper.config import WARPGROUP_THREADS
from fa_sm100.hopper.named_barriers import Sm90BwdBarrier

# the producer warpgroup's warps that add split tiles' pieces (Note [split tail])
FIXUP_WARPS = (2, 3)
FIXUP_THREADS = 32 * len(FIXUP_WARPS)


def _choose(cond, a, b):
    return a if cond else b


def _select(cond, a, b) -> Int32:
    """a if cond else b, for DSL integers (a select, no branch)."""
    return Int32(cutlass.select_(cond, Int32(a), Int32(b)))


def split_tail_range(count, grid, ctas, blocks, cta, imax=max):
    """Note [split tail]: (rounds, u_begin, u_end) of persistent CTA ``cta`` of ``grid`` (in
    clusters of ``ctas``) over ``count`` tiles of ``blocks`` sweep steps each: it takes
    ``rounds`` tiles whole by the fixed stride (``cta``, ``cta + grid``, ...), then the units
    (one cluster tile's step) [u_begin, u_end) of the tail, the tiles from ``rounds * grid``
    on, which its cluster shares with the others as evenly as whole units allow. DSL or
    Python integers (the kernel, the tests)."""
    clusters = grid // ctas
    cluster_tiles = count // ctas
    rounds = imax(cluster_tiles // clusters - 1, 0)
    tail_units = (cluster_tiles - rounds * clusters) * blocks
    c = cta // ctas
    return rounds, c * tail_units // clusters, (c + 1) * tail_units // clusters


def split_tail_piece(u, u_end, rounds, grid, ctas, blocks, cta, imin=min, pick=None):
    """Note [split tail]: the piece of the tail that starts at unit ``u`` of CTA ``cta``'s
    range (ending at ``u_end``): (tile, s0, s1, slot): tile index (the one-CTA grid's
    numbering), the sweep steps [s0, s1) of its ``blocks``, and the fix-up slot that its other
    piece shares (-1: the whole tile). Both pieces of a split tile name the slot of the
    boundary between their clusters: the later cluster's index (times ``ctas``, plus the
    rank). ``pick(cond, a, b)``: a if cond else b (a select in the kernel)."""
    pick = pick or _choose
    cluster, rank = cta // ctas, cta % ctas
    tile = u // blocks
    s0 = u - tile * blocks
    s1 = imin(blocks, s0 + (u_end - u))
    slot = pick(s0 > 0, cluster * ctas + rank, pick(s1 < blocks, (cluster + 1) * ctas + rank, -1))
    return rounds * grid + tile * ctas + rank, s0, s1, slot


class BwdSplitRole:
    """Mixin of ``Sm90FlashBackward``: the split tail's walk, the pieces' hand-in and the
    fix-up warps (Note [split tail]).

    Uses the kernel's ``cfg``, ``dtype``, ``tile_n``, ``hdim``, ``hdimv``,
    ``num_mma_threads``, ``_tile_at`` and ``_m_block_range``.
    """

    def _split_walk_words(self, words, work, flags: Int32):
        """Note [split tail]: one thread writes this CTA's ``split_tail_range`` and the sweep's
        step count (every tile's is the same: no mask) into ``words[1:5]``, and into
        ``words[5]`` where the fix-up flags start among (batch 0, head 0)'s dQ semaphores
        (``flags``), before the CTA's first sync. The roles read them per tile
        (``_split_tile_at``, ``_split_slot``) instead of keeping them in registers through the
        sweep, where the MMA warpgroups had no room for them."""
        m_block_min, m_block_max = self._m_block_range(Int32(0), work.seqlen_q, work.seqlen_k)
        blocks = m_block_max - m_block_min
        rounds, u_begin, u_end = split_tail_range(work.count, work.stride, self.cfg.cluster[0],
                                                  blocks, work.first, cutlass.max)
        for i, value in enumerate((rounds, u_begin, u_end, blocks, flags)):  # traced inline
            words[1 + i] = value

    def _split_tile_at(self, v: Int32, work):
        """Note [split tail]: the tile (or piece) at unit ``v`` of this CTA's walk: the
        ``rounds`` whole tiles of the fixed stride come first (``blocks`` units each), then
        its pieces of the tail (``split_tail_piece``). ``work.split``: the SMEM words of
        ``_split_walk_words``."""
        words = work.split
        rounds, u_begin, u_end, blocks = words[1], words[2], words[3], words[4]
        whole = v < rounds * blocks
        tile, s0, s1, slot = split_tail_piece(u_begin + v - rounds * blocks, u_end, rounds,
                                              work.stride, self.cfg.cluster[0], blocks,
                                              work.first, cutlass.min, _select)
        t = _select(whole, work.first + (v // blocks) * work.stride, tile)
        out = self._tile_at(t, work)
        out.step_begin = out.m_block_min + _select(whole, 0, s0)
        out.step_end = out.m_block_min + _select(whole, blocks, s1)
        out.split_unit = v
        if const_expr(self.cfg.stagger_m):  # the tail's sweeps start at block 0
            out.m_offset = _select(whole, out.m_offset, 0)
        return out

    def _split_slot(self, v: Int32, work):
        """Note [split tail]: (fix-up slot, half) of the tile at unit ``v`` of this CTA's walk:
        slot -1 for a whole tile; half 1 for the piece that starts part-way, 0 for the one
        that ends part-way. From the SMEM words again: the epilogue asks, and nothing of it
        stays in registers through the sweep."""
        words = work.split
        rounds, u_begin, u_end, blocks = words[1], words[2], words[3], words[4]
        _, s0, _, slot = split_tail_piece(u_begin + v - rounds * blocks, u_end, rounds,
                                          work.stride, self.cfg.cluster[0], blocks, work.first,
                                          cutlass.min, _select)
        return _select(v < rounds * blocks, -1, slot), _select(s0 > 0, 1, 0)

    def _split_walk_end(self, work):
        """Note [split tail]: the units of this CTA's walk, ``rounds`` whole tiles and its
        share of the tail."""
        words = work.split
        return words[1] * words[4] + words[3] - words[2]

    def split_parts(self, mPart, slot, half, tidx):
        """Thread ``tidx``'s (of the 256 MMA threads) dK and dV partials in half ``half`` of
        fix-up slot ``slot`` of ``mPart`` ((4, n / 4) views, ``fragment_view``): per half,
        dK's registers of all 256 threads, then dV's."""
        n_k = self.tile_n * self.hdim // self.num_mma_threads
        n_v = self.tile_n * self.hdimv // self.num_mma_threads
        base = assume_aligned(mPart[slot, None].iterator + half * self.cfg.split_part_elems)
        return (fragment_view(base, tidx, self.num_mma_threads, n_k),
                fragment_view(base + n_k * self.num_mma_threads, tidx, self.num_mma_threads,
                              n_v))

    @cute.jit
    def _hand_in_piece(self, acc_dK, acc_dV, mPart, mdQsem, work, slot: Int32, half: Int32,
                       tidx):
        """The MMA warpgroups after a tile's last GEMM and dK's scale: for a piece of a split
        tile (``slot`` >= 0), write its dK and dV to half ``half`` of the fix-up slot; after a
        barrier thread 0 fences and adds 1 to the slot's flag (acq_rel: the writes of all 256
        threads, cumulative through the barrier, go first; it finds 1 when the other piece is
        in) and tells the warpgroups through SMEM word 6 after another. Returns 0 for a whole
        tile (store it), 1 for a piece that finished first (store nothing), 2 for one that
        finished second (store the sum of the halves: ``_sum_halves``)."""
        role = Int32(0)
        if slot >= 0:
            words = work.split
            for acc, part in zip((acc_dK, acc_dV), self.split_parts(mPart, slot, half, tidx)):
                cute.autovec_copy(fragment_registers(acc), part)
            cute.arch.barrier(barrier_id=int(Sm90BwdBarrier.EPILOGUE),
                              number_of_threads=self.num_mma_threads)
            if tidx == 0:
                cute.arch.fence_acq_rel_gpu()
                words[6] = cute.arch.atomic_add(mdQsem[0, 0, None].iterator + words[5] + slot,
                                                Int32(1), sem="acq_rel", scope="gpu")
            cute.arch.barrier(barrier_id=int(Sm90BwdBarrier.EPILOGUE),
                              number_of_threads=self.num_mma_threads)
            role = _select(words[6] == 1, 2, 1)
            if role == 2:  # the other piece's half, acquired by thread 0
                cute.arch.fence_acq_rel_gpu()
        return role

    @cute.jit
    def _sum_halves(self, out, halves, which: cutlass.Constexpr):
        """``out`` (a register fragment in the input dtype) = dK (``which`` 0) or dV (1) of a
        split tile: the sum of the fix-up slot's two halves (``halves``: ``split_parts`` of
        half 0 and 1), this thread's accumulator positions, after its accumulators have been
        written there: read back from GMEM instead of added to the registers (ptxas
        serialized the sweep's WGMMAs when the accumulators stayed live beside the loads)."""
        dst = fragment_registers(out)
        p0, p1 = halves[0][which], halves[1][which]
        for g in cutlass.range_constexpr(cute.size(out) // 4):
            a = cute.make_rmem_tensor((4,), Float32)
            b = cute.make_rmem_tensor((4,), Float32)
            cute.autovec_copy(p0[None, g], a)
            cute.autovec_copy(p1[None, g], b)
            for j in cutlass.range_constexpr(4):
                dst[j, g] = (a[j] + b[j]).to(self.dtype)
