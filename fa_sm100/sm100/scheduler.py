"""Static tile scheduling of the SM100 forward: which work tile each cluster does next.

A work tile is one (query block, head, batch) triple; its query block covers
``q_stage x cta_group x m_block`` rows (both Q stages of both CTAs of the pair). Tiles are
numbered 0 .. num_tiles-1 and decoded so that

- non-causal: consecutive tile ids walk the query blocks of one (head, batch) first, so
  clusters running at the same time share K/V in L2;
- causal (LPT order): tile ids start with the LAST query block of every (head, batch) and walk
  toward the first: under a bottom-right causal mask the last query block sees the most keys,
  so the longest tiles go first and the short ones fill the tail (longest processing time first).

Persistent (``cfg.persistent``): the grid holds ``num_sms / cta_group`` clusters (at most one
per tile) and cluster c does tiles c, c + num_clusters, c + 2 num_clusters, ...
Non-persistent: one cluster per tile, each does exactly one.

- varlen (``cfg.varlen``): ``batch`` counts the packed sequences, and the tiles are the query
  blocks that exist (``fa_sm100.packed_tiles``: each role counts them and decodes a tile id
  with warp sums over cu_seqlens_q): tile ids walk one (head, sequence) pair at a time (its K/V
  stays in L2), each pair's last query block first, and no tile lies past its sequence's end.
  The host launches for ``packed_blocks`` of the packed rows (an upper bound); a cluster with
  no tile left runs no loop turn. A sequence without keys still visits one fully masked block
  (the protocol is the same for every tile).

Every role of a CTA runs the same loop over the same tile ids, so the roles agree on the work
without talking to each other. ``tile_problem`` gives each role the tile's own lengths.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from fa_sm100.packed_tiles import packed_tile, packed_tile_count


def rows_per_tile(cfg) -> int:
    return cfg.q_stage * cfg.cta_group * cfg.m_block


def grid_clusters(cfg, num_tiles: int) -> int:
    """Clusters to launch for ``num_tiles`` work tiles (host-side, plain ints)."""
    if cfg.persistent:
        return max(1, min(num_tiles, cfg.num_sms // cfg.cta_group))
    return max(1, num_tiles)


@dataclass(frozen=True)
class WorkTile:
    m_block: Int32  # query block, in units of rows_per_tile(cfg)
    head: Int32
    batch: Int32


@dataclass(frozen=True)
class StaticScheduler:
    """Tile ids for this cluster: start at the cluster id, stride by the number of clusters."""

    cfg: object
    num_m_blocks: Int32
    num_heads: Int32
    num_tiles: Int32
    first: Int32
    stride: Int32
    cu_seqlens_q: object = None  # varlen: the packed sequences' offsets
    batch: object = None  # varlen: the number of sequences

    def initial(self) -> Int32:
        return self.first

    def next(self, tile: Int32) -> Int32:
        if cutlass.const_expr(self.cfg.persistent):
            return tile + self.stride
        return self.num_tiles  # one tile per cluster

    def decode(self, tile: Int32) -> WorkTile:
        if cutlass.const_expr(self.cfg.varlen):  # pair-major, last query block first
            seq, head, m, count, _ = packed_tile(self.cu_seqlens_q, None, self.batch,
                                                 self.num_heads, rows_per_tile(self.cfg), tile)
            return WorkTile(Int32(count - 1 - m), Int32(head), Int32(seq))
        if cutlass.const_expr(self.cfg.causal):
            # LPT: every (head, batch) pair of the last query block first.
            hb_count = self.num_tiles // self.num_m_blocks
            hb = tile % hb_count
            m = self.num_m_blocks - 1 - tile // hb_count
        else:
            m = tile % self.num_m_blocks
            hb = tile // self.num_m_blocks
        return WorkTile(Int32(m), Int32(hb % self.num_heads), Int32(hb // self.num_heads))


def make_scheduler(cfg, num_m_blocks, num_heads, batch, cu_seqlens_q=None) -> StaticScheduler:
    """The scheduler of this CTA (call inside the kernel: reads the block and grid ids; under
    varlen, counts the packed query blocks of ``cu_seqlens_q`` with a warp of its role)."""
    bidx, _, _ = cute.arch.block_idx()
    gdim, _, _ = cute.arch.grid_dim()
    num_tiles = num_m_blocks * num_heads * batch
    if cutlass.const_expr(cfg.varlen):
        num_tiles = packed_tile_count(cu_seqlens_q, None, batch, num_heads, rows_per_tile(cfg))
    return StaticScheduler(
        cfg=cfg,
        num_m_blocks=Int32(num_m_blocks),
        num_heads=Int32(num_heads),
        num_tiles=Int32(num_tiles),
        first=Int32(bidx // cfg.cta_group),
        stride=Int32(gdim // cfg.cta_group),
        cu_seqlens_q=cu_seqlens_q if cfg.varlen else None,
        batch=Int32(batch) if cfg.varlen else None,
    )


def tile_problem(prob, wt: WorkTile):
    """The Problem of work tile ``wt``: ``prob`` itself, or under varlen the tile's sequence's
    lengths and first rows (read from cu_seqlens, and seqused_k when given)."""
    if cutlass.const_expr(prob.varlen is None):
        return prob
    cu_q, cu_k = prob.varlen[0], prob.varlen[1]
    # a paged cache (cfg.page_size) names each key block's page instead: k_off stays unread
    q_off, k_off = cu_q[wt.batch], cu_k[wt.batch]
    seqlen_k = cu_k[wt.batch + 1] - k_off
    if cutlass.const_expr(len(prob.varlen) >= 3):
        seqlen_k = prob.varlen[2][wt.batch]
    return dataclasses.replace(prob, seqlen_q=cu_q[wt.batch + 1] - q_off, seqlen_k=seqlen_k,
                               q_off=q_off, k_off=k_off)


def lpt_order(num_m_blocks: int, num_heads: int, batch: int, causal: bool):
    """Host-side mirror of ``StaticScheduler.decode`` (for tests and the timeline script)."""
    out = []
    total = num_m_blocks * num_heads * batch
    for t in range(total):
        if causal:
            hb_count = num_heads * batch
            hb = t % hb_count
            m = num_m_blocks - 1 - t // hb_count
        else:
            m = t % num_m_blocks
            hb = t // num_m_blocks
        out.append((m, hb % num_heads, hb // num_heads))
    return out
