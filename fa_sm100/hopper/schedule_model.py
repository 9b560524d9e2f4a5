"""How evenly CTAs share the SM90 kernels' work: a CPU model (forward tiles, backward CTAs).

A work tile costs its number of KV tiles (plus ``tile_overhead`` for its start and end). The
tiles come in the kernel's flat order (``work_tile_lengths`` mirrors
``Sm90FwdKernel.tile_coords``: non-causal tiles pair by pair; causal tiles longest first within
sections of (batch, head) pairs whose K/V fit ``l2_section_mib``). Two ways to deal them to
``num_ctas`` persistent CTAs:

- static: CTA c takes tiles c, c + num_ctas, ... (``dynamic_schedule=False``);
- dynamic: each tile goes to the CTA that becomes free first, which is what the global counter
  of Note [Dynamic tile schedule] does (a CTA fetches when it is about to need a tile).

The makespan (the busiest CTA's work) over the ideal (total work / CTAs) is the time lost to
imbalance. ``python -m fa_sm100.hopper.schedule_model`` prints it for the benchmark grid's
problems. A model: it knows tile lengths, not the hardware (no L2, no clocks, equal KV steps).

``--mode bwd`` models the backward's CTAs (one per key block and (batch, head) pair, one per SM
at a time): a CTA costs its query blocks (``m_block_range``, plus ``tile_overhead`` for K/V and
the dK/dV epilogue), the hardware hands CTAs out in launch order to the SM that frees up first
(the dynamic deal above), and the order is the grid's or ``longest_first_cta``'s (Note [longest
first] in bwd_tiles.py). Under ``qdo_multicast`` a cluster's CTAs start together and hold their
SMs for the cluster's query blocks (Note [Q/dO multicast]). A third column deals the tiles in
the grid's order to ``num_ctas`` persistent CTAs, statically (Note [persistent CTAs] in
bwd_tiles.py): equal to the hardware's deal for tiles of equal length, and why a fixed
stride is refused under a causal mask. Persistent CTAs that fetch their tiles (Note [dynamic
tiles]) deal them as the second column does, without the per-tile cost.
"""

from __future__ import annotations

import argparse
import heapq

from fa_sm100.hopper.bwd_config import BwdConfig
from fa_sm100.hopper.bwd_defaults import select_bwd_config
from fa_sm100.hopper.bwd_tiles import (longest_first_cluster_cta, longest_first_tail_pairs,
                                       m_block_range)
from fa_sm100.hopper.config import Sm90FwdConfig, select_sm90_fwd_config
from fa_sm100.machines import HOPPER_SMS


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def work_tile_lengths(cfg: Sm90FwdConfig, batch: int, heads: int, seqlen_q: int,
                      seqlen_k: int) -> list[int]:
    """KV tiles of every work tile, in the kernel's flat tile order (``tile_coords``)."""
    num_m = cfg.num_m_blocks(seqlen_q)
    all_n = _ceil_div(seqlen_k, cfg.n_block)
    pairs = batch * heads
    kv_bytes = seqlen_k * (cfg.head_dim + cfg.head_dim_v) * cfg.dtype_bytes
    l2_heads = max((cfg.l2_section_mib << 20) // max(kv_bytes, 1), 1)
    lengths = []
    for t in range(num_m * pairs):
        if not cfg.causal:
            lengths.append(all_n)
            continue
        section, in_section = divmod(t, l2_heads * num_m)
        pairs_here = min(l2_heads, pairs - section * l2_heads)
        m_block = num_m - 1 - in_section // pairs_here
        last_row_keys = (m_block + 1) * cfg.m_block + seqlen_k - seqlen_q
        lengths.append(min(all_n, _ceil_div(max(last_row_keys, 0), cfg.n_block)))
    return lengths


def makespan_static(costs: list[float], num_ctas: int) -> float:
    """Busiest CTA when CTA c takes tiles c, c + num_ctas, ..."""
    return max(sum(costs[c::num_ctas]) for c in range(min(num_ctas, len(costs))))


def makespan_dynamic(costs: list[float], num_ctas: int) -> float:
    """Busiest CTA when every tile, in order, goes to the CTA that is free first."""
    free_at = [0.0] * min(num_ctas, len(costs))
    heapq.heapify(free_at)
    for cost in costs:
        heapq.heappush(free_at, heapq.heappop(free_at) + cost)
    return max(free_at)


def imbalance(cfg: Sm90FwdConfig, batch: int, heads: int, seqlen: int, num_ctas: int = HOPPER_SMS,
              tile_overhead: float = 0.0) -> dict:
    """Makespan over the ideal for both deals, for one (square) problem."""
    costs = [n + tile_overhead for n in work_tile_lengths(cfg, batch, heads, seqlen, seqlen)]
    ideal = sum(costs) / min(num_ctas, len(costs))
    return {"tiles": len(costs), "static": makespan_static(costs, num_ctas) / ideal,
            "dynamic": makespan_dynamic(costs, num_ctas) / ideal}


def bwd_cta_work(cfg: BwdConfig, batch: int, heads: int, seqlen_q: int, seqlen_k: int,
                 held: bool = False) -> list[int]:
    """Query blocks of every backward CTA, in launch order (the grid's: key blocks of a pair,
    then the next pair; or, with ``longest_first``, ``longest_first_cluster_cta``'s). With
    ``held``, the blocks the CTA holds its SM for: under ``qdo_multicast`` its cluster's, from
    the rank-0 key block's first (Note [Q/dO multicast]); else its own."""
    num_n = cfg.num_key_blocks(seqlen_k)
    pairs = batch * heads
    tail = longest_first_tail_pairs(cfg, num_n, pairs)
    ctas = cfg.cluster[0]
    work = []
    for linear in range(num_n * pairs):
        n_block = linear % num_n
        if cfg.longest_first:
            n_block, _ = longest_first_cluster_cta(linear, num_n, pairs, tail, ctas)
        m_min, m_max = m_block_range(cfg, n_block, seqlen_q, seqlen_k)
        if held:
            m_min = m_block_range(cfg, n_block - n_block % ctas, seqlen_q, seqlen_k)[0]
        work.append(max(m_max - m_min, 0))
    return work


def makespan_clusters(costs: list[float], num_ctas: int, ctas: int) -> float:
    """Busiest SM when each cluster of ``ctas`` consecutive CTAs, in order, starts once that
    many SMs are free (on the ``ctas`` free first) and holds each for its CTA's cost."""
    free_at = [0.0] * min(num_ctas, len(costs))
    heapq.heapify(free_at)
    for first in range(0, len(costs), ctas):
        group = costs[first:first + ctas]
        start = max(heapq.heappop(free_at) for _ in group)
        for cost in group:
            heapq.heappush(free_at, start + cost)
    return max(free_at)


def bwd_imbalance(cfg: BwdConfig, batch: int, heads: int, seqlen: int, num_ctas: int = HOPPER_SMS,
                  tile_overhead: float = 0.0) -> float:
    """Makespan over the ideal of the backward's CTAs dealt in launch order (square problem):
    the ideal from the CTAs' own blocks, the makespan from the blocks they hold their SMs for
    (clusters start together, Note [Q/dO multicast])."""
    own = [w + tile_overhead for w in bwd_cta_work(cfg, batch, heads, seqlen, seqlen)]
    held = [w + tile_overhead for w in bwd_cta_work(cfg, batch, heads, seqlen, seqlen, True)]
    span = makespan_clusters(held, num_ctas, cfg.cluster[0])
    return span / (sum(own) / min(num_ctas, len(own)))


def bwd_persistent_imbalance(cfg: BwdConfig, batch: int, heads: int, seqlen: int,
                             num_ctas: int = HOPPER_SMS, tile_overhead: float = 0.0) -> float:
    """Makespan over the ideal of persistent backward CTAs (square problem; Note [persistent
    CTAs]): the tiles in the grid's order, CTA c walking c, c + G, ... (G = min(tiles,
    ``num_ctas``)), each tile holding its CTA for the blocks it holds its SM for (a
    cluster's CTAs walk in step, so both hold theirs for the cluster's blocks)."""
    grid = cfg.replace(longest_first=False)
    own = [w + tile_overhead for w in bwd_cta_work(grid, batch, heads, seqlen, seqlen)]
    held = [w + tile_overhead for w in bwd_cta_work(grid, batch, heads, seqlen, seqlen, True)]
    return makespan_static(held, num_ctas) / (sum(own) / min(num_ctas, len(own)))


def _problems(args):
    """(hdim, causal, seqlen, batch, heads) of the grid the command line asks for."""
    for hdim in args.hdim:
        for causal in {"yes": (True,), "no": (False,), "both": (False, True)}[args.causal]:
            for seqlen in args.seqlen:
                yield hdim, causal, seqlen, args.total_tokens // seqlen, args.hidden // hdim


def _print_fwd(args) -> None:
    print("| hdim | causal | seqlen | m_block | tiles | static / ideal | dynamic / ideal |")
    print("|---|---|---|---|---|---|---|")
    for hdim, causal, seqlen, batch, heads in _problems(args):
        cfg = select_sm90_fwd_config(hdim, causal=causal, seqlen_k=seqlen)
        r = imbalance(cfg, batch, heads, seqlen, args.num_ctas, args.tile_overhead)
        print(f"| {hdim} | {'yes' if causal else 'no'} | {seqlen} | {cfg.m_block} | "
              f"{r['tiles']} | {r['static']:.3f} | {r['dynamic']:.3f} |")


def _print_bwd(args) -> None:
    print("| hdim | causal | seqlen | tile_m x tile_n | CTAs | grid order / ideal "
          "| longest first / ideal | persistent, static / ideal |")
    print("|---|---|---|---|---|---|---|---|")
    for hdim, causal, seqlen, batch, heads in _problems(args):
        cfg = select_bwd_config(hdim, causal=causal, seqlen_q=seqlen, seqlen_k=seqlen)
        shape = (batch, heads, seqlen, args.num_ctas, args.tile_overhead)
        grid = bwd_imbalance(cfg.replace(longest_first=False), *shape)
        lpt = bwd_imbalance(cfg.replace(longest_first=True), *shape)
        static = bwd_persistent_imbalance(cfg, *shape)
        ctas = cfg.num_key_blocks(seqlen) * batch * heads
        print(f"| {hdim} | {'yes' if causal else 'no'} | {seqlen} | "
              f"{cfg.tile_m} x {cfg.tile_n} | {ctas} | {grid:.3f} | {lpt:.3f} | {static:.3f} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hdim", type=int, nargs="+", default=[64, 128])
    p.add_argument("--seqlen", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--causal", choices=("yes", "no", "both"), default="yes")
    p.add_argument("--total-tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--num-ctas", type=int, default=HOPPER_SMS,
                   help=f"SMs (H100/H200 SXM: {HOPPER_SMS})")
    p.add_argument("--tile-overhead", type=float, default=0.0,
                   help="cost of a tile's (CTA's) start and end, in KV steps (query blocks)")
    p.add_argument("--mode", choices=("fwd", "bwd"), default="fwd",
                   help="fwd: persistent forward tiles; bwd: the backward's CTAs")
    args = p.parse_args(argv)
    (_print_bwd if args.mode == "bwd" else _print_fwd)(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
