"""Which tiles the SM90 backward's CTAs take, in what order, and which query blocks each
tile's sweep visits: plain functions, and the traced ones every role of the kernel walks with.

A tile is one key block ``n_block`` (``tile_n`` keys) of one (batch, query head) pair: its
CTA keeps K and V of those keys and accumulates their dK and dV over the query blocks that
see them (``m_block_range``). One CTA runs one tile (``cta_tile``: the grid's order, the
tail renumbered longest first), or with persistent CTAs each CTA walks several
(``TileWalk``, ``_tile_at``); every role walks through ``walk``. The sweep over a tile's
query blocks may start part-way and wrap (``m_block_at``). The plain functions take Python
or DSL integers: the kernel traces them, the tests and ``schedule_model`` call them.

Note [longest first] (``longest_first``): a CTA owns one key block of one (batch, head) pair
and visits the query blocks whose band reaches it. Under a causal mask key block n sees
``m_block_range`` = all query blocks from about n * tile_n / tile_m on, so key block 0 has the
most work and the last one the least. The hardware hands out CTAs in launch order, each to the
first SM that frees up. In the grid's order (key blocks of a pair, then the next pair) that
balances itself until the end: the last pair's key block 0 starts when most of the grid is
done and runs on alone (``python -m fa_sm100.hopper.schedule_model --mode bwd``: 1.03-1.07x
the ideal makespan at 1k-8k). With the switch on, the kernel renumbers its CTAs
(``longest_first_cta``): the grid's order up to the last ``tail_ctas`` CTAs (two waves,
rounded up to whole pairs); those start key block 0 of each of their pairs, then key block 1,
and so on, so the last CTAs to start are the shortest. Only the tail is reordered because the
grid's order is what keeps L2 warm: the CTAs that run together share a few pairs' Q, dO and
dQ accumulator (reordering the whole grid this way, in sections of 16-96 MiB of pairs,
measured slower, most at 1k, where a section spans many pairs). Within a pair key blocks
still start in increasing order, which the deterministic dQ semaphore relies on (Deterministic
mode in docs/hopper_backward.md).

Note [staggered query blocks] (``stagger_m``): without a mask every key block of a (batch,
head) pair visits the query blocks 0, 1, ... in step, so all of them (up to 128 at 16k) add
their dQ tiles into the same query block's accumulator at about the same moment, and with
``dq_first_store`` all but one wait for its copy at every block. With the switch the sweep of
key block n's cluster c (of C clusters in the pair; a cluster is one CTA without
``qdo_multicast``) starts ``c * count // C`` blocks in and wraps around (``stagger_offset``,
``staggered_m_block``): at any moment the clusters work on blocks spread over the whole range.
The load, MMA and dq-store roles map their step i to the same block; which blocks need the
mask, and everything else per block, follow the block, not the step. A block's first CTA is
then alone there and copies while the other clusters are elsewhere; only the CTAs of one
cluster (which share their Q/dO loads, hence their order) arrive together, and one of them
waits for the other's copy. Q/dO of a pair are read in C places at once instead of one (512
KiB per pair at 1k, 8 MiB at 16k, hdim 128: L2 holds them). Not for masked or deterministic
problems (``validate``). Default with first stores at hdim 128 (``STAGGER_HEAD_DIMS``), where
it measured faster (tuning row "staggered sweeps"); at hdim 64 and 256 it moved both ways.

Note [persistent CTAs] (``persistent_ctas``): one CTA per tile pays, per tile, for a CTA's end
and start and for a pipeline that drains and fills: the epilogue's TMA stores must read SMEM
before the CTA exits, the next CTA initializes its barriers, loads K and V, and only then
issues its first Q / dO. With ``persistent_ctas = P`` the grid is min(tiles, P) CTAs in one
row and CTA c walks the tiles c, c + grid, c + 2 grid, ... (numbered as the one-CTA grid:
key block fastest; ``TileWalk``, ``_tile_at``). Each role loops over the walk, carrying its
pipeline states from tile to tile, and between tiles:
- the load warp issues the next tile's first Q / dO into the stage the previous tile's
  second-to-last block has freed, then waits on K/V empty (``mbar_kv + 1``) and loads K, V;
- the MMA warpgroups' epilogue stages dK in the dS buffers and dV in the SMEM dQ tile
  instead of K's and V's buffers (bwd_kernel.py ``_epilogue_staging``, bwd_store.py
  ``store_dkdv_tma``; ``validate`` checks they fit), so
  that K/V empty is signalled as soon as the tile's GEMMs have retired, and the next K, V
  load while dK and dV are converted, staged and stored. The dS buffers are free once both
  warpgroups have passed the first epilogue barrier; the dQ tile is borrowed from the
  dq-store warp by one more round of its hand-off (``DQ_EMPTY`` once the tile's last reduce
  has read it, waited for after dK is staged; ``DQ_FULL`` once the stores have read both,
  after a last epilogue barrier, before the next tile writes dS or dQ);
- K/V full (``mbar_kv``) completes once per tile: tile k waits for phase k % 2.
Under ``qdo_multicast`` (clusters of 2: 4 do not all fit at once) the grid and
``persistent_ctas`` are whole clusters and so is every pair's key-block count (``sm90_bwd``
checks it), so the two CTAs of a cluster always hold neighbouring key blocks of one pair and
walk the same number of tiles in step: the Q/dO stages' multicast protocol (Note [Q/dO
multicast] in bwd_load.py) continues across tiles, as the forward's Note [Persistent
multicast] in fwd_kernel.py does. The order is static, so it balances only tiles of equal
length: no mask or window, unless the tiles are fetched (Note [dynamic tiles]). The
preprocess runs ahead (``pre_ctas=0``): its CTAs beside the main kernel would hold SMs that
some persistent CTAs then wait for, and those end last.
The gain is the per-tile cost, so it shrinks as tiles grow: ``select_bwd_config`` takes it up
to ``PERSISTENT_MAX_SEQLEN`` (hdim 64 and 128; the measurement is in the tuning row "persistent
CTAs"). GPU tests: the float64 rule with NaN-poisoned workspaces and CTAs walking many tiles,
and dK, dV bit for bit those of one CTA per tile.

Note [dynamic tiles] (``dynamic_tiles``): under a causal mask a tile's sweep is as long as
its key block is far from the diagonal (Note [longest first]), so a fixed stride deals the
CTAs unequal work (``schedule_model --mode bwd``: 1.08-1.56x the ideal makespan). Instead,
CTA c starts with tile c, and each later tile is the next one nobody has taken: the load warp
fetches it from a tile counter in GMEM (one ``atom.add`` by lane 0; index = grid + the count
before it), so tiles go out in launch order (renumbered longest first with
``longest_first``), each to the first CTA that asks, as the hardware hands out one CTA per
tile, without the CTA's end and start (Note [persistent CTAs]). The load warp fetches once it
has loaded its tile's last block, about two blocks before the MMA warpgroups need the index,
and hands it over in SMEM: TILE_SLOTS slots, each with a full mbarrier (the load warp's lane
0 arrives after writing it) and an empty one (lane 0 of each of the 8 MMA warps and of the
dq-store warp reads it, arrives, and shuffles it to its warp: each read is its releasing
thread's own, docs/hopper_backward.md, compute-sanitizer). Tile k's index travels in slot
k % TILE_SLOTS; the load warp reuses a slot only after every reader has arrived, which they
did at the end of tile k - 2, before tile k - 1's first dQ hand-off, so the load warp never
waits there in practice. An index >= the tile count ends every role's walk. The counter is
(batch 0, head 0)'s dQ semaphore after the finished-tile count (``tile_counter`` in
bwd_store.py), zeroed by the preprocess with the others: the first fetch comes after the load
warp's wait for the preprocess. The next call's preprocess zeroes it only after this kernel has
ended, fetches that find no tile included: it waits for the kernel before it, the dQ
postprocess, which itself ends after the main kernel (Note [chained launches] in
bwd_interface.py, also with ``early_dq_post``). Rules (``validate``): persistent CTAs; no
``qdo_multicast`` (both CTAs of a cluster would need one fetched index); head dims up to 96
(``DYNAMIC_TILES_MAX_HEAD_DIM``): at hdim 128 the walk's values take registers the MMA
warpgroups do not have, and ptxas spills 52-64 bytes and, with 80-row blocks, serializes every
WGMMA (34 commit groups per block instead of 5; the compile contract caught it).

Default (``select_bwd_config``) for causal hdim 64 without a window up to
``PERSISTENT_MAX_SEQLEN``, where paired timing on an H200 over one CTA per tile measured it
faster (docs/tuning.md, row "dynamic tiles"); slower at 4k, so off there. At hdim 128 causal
it measured slower, without the persistent preprocess one CTA per tile has beside it
(``pre_ctas``, which persistent CTAs refuse); that kernel (64-row blocks) spilled, but only
at a tile's start and in its epilogue, not in the sweep's loop, which kept its 5 commit
groups (read in its SASS): refused since. Non-causal, against the fixed stride without
multicast, the fetch costs about what multicast gains, so the fixed stride keeps non-causal
problems. A
fetch one tile ahead (at the tile's start) measured the same as at its end. The schedule
model's "longest first" column is what the fetched tiles deal (no per-tile cost). GPU tests:
the float64 rule with the counter poisoned (must be zeroed), many tiles per CTA, causal with
and without longest first, bottom-right ragged lengths, a band, no mask; causal dK, dV bit for
bit those of one CTA per tile over repeated calls.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from fa_sm100.hopper import probes
from fa_sm100.hopper.bwd_config import TILE_SLOTS, BwdConfig, band_bounds


def m_block_range(cfg: BwdConfig, n_block, seqlen_q, seqlen_k, imax=max, imin=min, band=None):
    """Query blocks [m_min, m_max) whose band reaches key block ``n_block``.

    Rows are aligned bottom-right: query i sees key j iff i + off - left <= j <= i + off + right
    with off = seqlen_k - seqlen_q (``fa_sm100.bands``). ``band``: (left, right), None for an
    unbounded side; ``band_bounds(cfg)`` when not given. The kernel calls this while tracing
    with DSL integers (``imax``/``imin`` = cutlass.max/min, its run-time bounds); the tests
    call it with Python integers.
    """
    left, right = band_bounds(cfg) if band is None else band
    tm, tn = cfg.tile_m, cfg.tile_n
    m_max = (seqlen_q + tm - 1) // tm
    m_min = 0 * n_block
    off = seqlen_k - seqlen_q
    if right is not None:
        m_min = imax(n_block * tn - off - right, 0) // tm
    if left is not None:
        m_max = imin(m_max, imax((n_block + 1) * tn - 1 - off + left + tm, 0) // tm)
    return m_min, m_max


def _choose(cond, a, b):
    return a if cond else b


def stagger_offset(cfg: BwdConfig, n_block, num_n_blocks, m_min, m_max):
    """Where key block ``n_block``'s sweep over its query blocks [m_min, m_max) starts,
    relative to m_min (Note [staggered query blocks]): 0 without
    ``stagger_m``; else its cluster's (its own without ``qdo_multicast``) share of the sweep,
    cluster c of C starting c / C of the way in. DSL or Python integers."""
    if not cfg.stagger_m:
        return 0 * n_block
    ctas = cfg.cluster[0]
    clusters = (num_n_blocks + ctas - 1) // ctas
    return (n_block // ctas) * (m_max - m_min) // clusters


def staggered_m_block(i, offset, m_min, m_max, pick=_choose):
    """The query block of step ``i`` (m_min <= i < m_max) of a sweep that starts ``offset``
    (0 <= offset < m_max - m_min) blocks in and wraps around at m_max."""
    m = i + offset
    return pick(m >= m_max, m - (m_max - m_min), m)


def first_n_block(cfg: BwdConfig, m_block, seqlen_q, seqlen_k, imax=max, band=None):
    """The lowest key block whose range contains query block ``m_block``: the base of the
    deterministic dQ semaphore (the key blocks that add into ``m_block`` are consecutive).
    ``band`` as ``m_block_range``'s."""
    left = (band_bounds(cfg) if band is None else band)[0]
    if left is None:
        return 0 * m_block
    return imax(m_block * cfg.tile_m + seqlen_k - seqlen_q - left, 0) // cfg.tile_n


def longest_first_tail_pairs(cfg: BwdConfig, num_n_blocks, num_pairs, imin=min, imax=max):
    """(batch, head) pairs whose CTAs start longest first: ``tail_ctas`` in whole pairs, at
    least one, at most all (Note [longest first])."""
    return imax(imin((cfg.tail_ctas + num_n_blocks - 1) // num_n_blocks, num_pairs), 1)


def longest_first_cluster_cta(linear, num_n_blocks, num_pairs, tail_pairs, ctas, pick=_choose):
    """``longest_first_cta`` for clusters of ``ctas`` neighbouring key blocks (Note [Q/dO
    multicast] in bwd_load.py): the cluster launched ``linear // ctas``-th is renumbered as
    one CTA of a grid of ``num_n_blocks // ctas`` columns, and the CTA keeps its rank in it,
    so that a cluster still holds key blocks ``ctas c .. ctas c + ctas - 1`` of one pair.
    ``ctas`` is a Python integer (1: ``longest_first_cta`` itself)."""
    if ctas == 1:
        return longest_first_cta(linear, num_n_blocks, num_pairs, tail_pairs, pick)
    rank = linear % ctas
    column, pair = longest_first_cta(linear // ctas, num_n_blocks // ctas, num_pairs,
                                     tail_pairs, pick)
    return column * ctas + rank, pair


def longest_first_cta(linear, num_n_blocks, num_pairs, tail_pairs, pick=_choose):
    """(key block, (batch, head) pair) of the CTA launched ``linear``-th (Note [longest first]
   ): the grid's order (``linear`` = key block + num_n_blocks x pair) up to
    the last ``tail_pairs`` pairs; those start key block 0 of each pair, then key block 1,
    .... The kernel calls this with DSL integers (``pick(cond, a, b)`` = a if cond else b, a
    select there), the tests and the schedule model with Python integers."""
    head_ctas = (num_pairs - tail_pairs) * num_n_blocks
    in_tail = linear >= head_ctas
    rest = linear - head_ctas
    n_tail = rest // tail_pairs
    pair_tail = num_pairs - tail_pairs + rest - n_tail * tail_pairs
    pair_grid = linear // num_n_blocks
    n_grid = linear - pair_grid * num_n_blocks
    return pick(in_tail, n_tail, n_grid), pick(in_tail, pair_tail, pair_grid)


def _select(cond, a, b) -> Int32:
    """a if cond else b, for DSL integers (a select, no branch)."""
    return Int32(cutlass.select_(cond, Int32(a), Int32(b)))


class BwdTile:
    """One tile of the main kernel: key block ``n_block`` of (``batch``, ``head``), the query
    blocks [``m_block_min``, ``m_block_max``) it visits from step ``m_offset`` on (Note
    [staggered query blocks]), ``m_block_first``, the first one its load warp loads (Note
    [Q/dO multicast] in bwd_load.py), and ``k``, which of the CTA's tiles it is (0 without
    persistent CTAs; the phase of K/V's barriers). A plain holder of DSL integers (the DSL
    would carry a dataclass through run-time loops as run-time values)."""

    def __init__(self, n_block, head, batch, m_block_first, m_block_min, m_block_max, m_offset,
                 k=0):
        self.n_block, self.head, self.batch = n_block, head, batch
        self.m_block_first, self.m_block_min, self.m_block_max = (m_block_first, m_block_min,
                                                                  m_block_max)
        self.m_offset, self.k = m_offset, k


class TileWalk:
    """A persistent CTA's tiles (Note [persistent CTAs]): ``first``, ``first + stride``, ...
    below ``num_n_blocks * num_pairs``, numbered as the one-CTA-per-tile grid is (key block
    fastest, then head, then batch), each with the query blocks ``prob``'s lengths and band
    give it; with ``dynamic_tiles`` ``first``, then the indices its load warp fetches (Note
    [dynamic tiles]: ``counter``, the tile counter in GMEM; ``slots``, the SMEM tensor of
    TILE_SLOTS indices; ``handoff``, their full then empty mbarriers; ``tail_pairs`` of Note
    [longest first]). A plain holder, like ``BwdTile``."""

    def __init__(self, first, stride, num_pairs, num_heads, num_n_blocks, prob):
        self.first, self.stride = first, stride
        self.count = num_n_blocks * num_pairs
        self.num_pairs, self.num_heads, self.num_n_blocks = num_pairs, num_heads, num_n_blocks
        self.prob = prob
        self.tail_pairs = self.counter = self.slots = self.handoff = None

    def fetch_from(self, tail_pairs, counter, slots, handoff):
        """With ``dynamic_tiles``: where the walk's later tiles come from (Note [dynamic
        tiles])."""
        self.tail_pairs, self.counter, self.slots, self.handoff = (tail_pairs, counter, slots,
                                                                   handoff)


# ---- the kernel's side: traced with DSL integers ------------------------------------------

def grid(cfg: BwdConfig, num_n_blocks, num_heads, num_batch):
    """One CTA per tile (key block, head, batch); with ``persistent_ctas`` at most that
    many CTAs in one row, each walking the tiles (Note [persistent CTAs]; every pair's
    key blocks are whole clusters, and so is ``persistent_ctas``)."""
    if const_expr(cfg.persistent_ctas):
        tiles = num_n_blocks * num_heads * num_batch
        return [cutlass.min(tiles, cfg.persistent_ctas), 1, 1]
    return [num_n_blocks, num_heads, num_batch]


def traced_m_block_range(cfg: BwdConfig, n_block: Int32, prob):
    """Query blocks [min, max) key block ``n_block`` visits (``m_block_range`` with the
    run-time lengths and band of ``prob``, a ``BwdProblem``)."""
    return m_block_range(cfg, n_block, prob.seqlen_q, prob.seqlen_k, cutlass.max, cutlass.min,
                         prob.band)


def cta_tile(cfg: BwdConfig, prob, qdo_ctas, tail_pairs, coords=None):
    """This CTA's one tile, from its block index (Note [longest first] renumbers it), or
    under varlen ``coords`` (key block, head, sequence, the sequence's key blocks), decoded by
    ``packed_tile``."""
    if const_expr(coords is not None):
        n_block, head, batch, num_n_blocks = coords
    else:
        n_block, head, batch = cute.arch.block_idx()
        num_n_blocks = cute.arch.grid_dim()[0]
    if const_expr(cfg.longest_first):  # Note [longest first], by whole clusters
        num_n_blocks, num_heads, num_batch = cute.arch.grid_dim()
        n_block, pair = longest_first_cluster_cta(
            n_block + num_n_blocks * (head + num_heads * batch), num_n_blocks,
            num_heads * num_batch, tail_pairs, qdo_ctas, _select)
        batch = pair // num_heads
        head = pair - batch * num_heads
    m_block_min, m_block_max = traced_m_block_range(cfg, n_block, prob)
    # The first query block this CTA loads and waits for: its own first, or under a causal
    # qdo_multicast the cluster's (its rank-0 key block's; Note [Q/dO multicast] in
    # bwd_load.py)
    m_block_first = m_block_min
    if const_expr(cfg.qdo_multicast and cfg.causal):
        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        m_block_first, _ = traced_m_block_range(cfg, n_block - rank, prob)

    # Note [staggered query blocks]: where this CTA's sweep starts (0 without)
    m_offset = stagger_offset(cfg, n_block, num_n_blocks, m_block_min, m_block_max)
    return BwdTile(n_block, head, batch, m_block_first, m_block_min, m_block_max, m_offset)


def _tile_at(cfg: BwdConfig, t: Int32, work: TileWalk, k: Int32):
    """Tile ``t`` of a persistent CTA's walk (Note [persistent CTAs]), its ``k``-th: key block
    ``t % num_n_blocks`` of (batch, head) pair ``t // num_n_blocks``, the grid's order; with
    ``longest_first`` (dynamic tiles only) the tail renumbered as one CTA per tile's is (Note
    [longest first])."""
    if const_expr(cfg.longest_first):
        n_block, pair = longest_first_cta(t, work.num_n_blocks, work.num_pairs,
                                          work.tail_pairs, _select)
    else:
        n_block = t % work.num_n_blocks
        pair = t // work.num_n_blocks
    batch = pair // work.num_heads
    head = pair - batch * work.num_heads
    m_block_min, m_block_max = traced_m_block_range(cfg, n_block, work.prob)
    m_offset = stagger_offset(cfg, n_block, work.num_n_blocks, m_block_min, m_block_max)
    return BwdTile(n_block, head, batch, m_block_min, m_block_min, m_block_max, m_offset, k)


def m_block_at(cfg: BwdConfig, step: Int32, m_offset: Int32, m_block_min: Int32,
               m_block_max: Int32):
    """The query block of sweep step ``step``: ``step`` itself, or with ``stagger_m`` the
    staggered sweep's (Note [staggered query blocks])."""
    if const_expr(probes.active("sweep") == "twice"):  # Note [cost probes]: two sweeps
        step = _select(step >= m_block_max, step - (m_block_max - m_block_min), step)
    if const_expr(not cfg.stagger_m):
        return step
    return staggered_m_block(step, m_offset, m_block_min, m_block_max, _select)


def sweep_end(m_block_min: Int32, m_block_max: Int32):
    """Where the sweep's steps end: ``m_block_max``; under the ``sweep=twice`` cost probe
    (Note [cost probes] in probes.py) one sweep later (``m_block_at`` folds the second onto
    the first)."""
    if const_expr(probes.active("sweep") == "twice"):
        return m_block_max + (m_block_max - m_block_min)
    return m_block_max


@cute.jit
def walk(cfg: BwdConfig, work, tile_body, args, states, fetches: cutlass.Constexpr = False):
    """``states = tile_body(*args, tile, *states)`` for this CTA's tile (``work``: a
    ``BwdTile``), or with persistent CTAs for each tile of its walk (``work``: a
    ``TileWalk``; the tiles' ``k`` = 0, 1, ...), ``states`` (a role's pipeline states, or
    none) carried from one tile to the next (Note [persistent CTAs]). Every role walks this
    way; with ``dynamic_tiles`` the load warp (``fetches``) fetches each next tile and the
    others wait for it (``_next_tile``, Note [dynamic tiles]). Returns the states after the
    last tile."""
    if const_expr(cfg.dynamic_tiles):
        t = work.first
        k = Int32(0)
        while t < work.count:
            states = tile_body(*args, _tile_at(cfg, t, work, k), *states)
            t = _next_tile(work, k, fetches)
            k += 1
    elif const_expr(cfg.persistent_ctas):
        k = Int32(0)
        for t in cutlass.range(work.first, work.count, work.stride, unroll=1):
            states = tile_body(*args, _tile_at(cfg, t, work, k), *states)
            k += 1
    else:
        states = tile_body(*args, work, *states)
    return states


def init_tile_handoff(cfg: BwdConfig, handoff):
    """Initialize the tile handoff's mbarriers (Note [dynamic tiles]): TILE_SLOTS full
    ones, which the load warp's lane 0 arrives on, then TILE_SLOTS empty ones, which lane 0
    of each MMA warp and of the dq-store warp arrives on. One thread; the kernel fences
    and syncs after it."""
    readers = cfg.num_mma_threads // cute.arch.WARP_SIZE + 1
    for i in range(TILE_SLOTS):  # traced inline
        cute.arch.mbarrier_init(handoff + i, 1)
        cute.arch.mbarrier_init(handoff + TILE_SLOTS + i, readers)


@cute.jit
def _next_tile(work, k: Int32, fetches: cutlass.Constexpr):
    """The index of the tile after this CTA's ``k``-th (Note [dynamic tiles]); at least
    ``work.count`` when there is none. The load warp (``fetches``; after its first tile's
    wait for the preprocess, which zeroed the counter): lane 0 adds one to the tile counter
    (the CTAs' first tiles are the grid's, so the count before it plus the grid is the
    index), the warp waits until every other role has read the index this slot held two
    tiles ago, and lane 0 writes the new one and arrives on the slot's full barrier. The
    other roles' warps: wait on the full barrier; lane 0 reads and arrives on the empty
    one and shuffles the index to the warp. One whole warp; slot ``k % TILE_SLOTS``, its
    ``k // TILE_SLOTS``-th use."""
    slot = k % TILE_SLOTS
    use = k // TILE_SLOTS
    full = work.handoff + slot
    empty = work.handoff + TILE_SLOTS + slot
    slots, lane = work.slots, cute.arch.lane_idx()
    t = Int32(0)
    if const_expr(fetches):
        if lane == 0:
            t = cute.arch.atomic_add(work.counter, Int32(1), sem="relaxed",
                                     scope="gpu") + work.stride
        t = cute.arch.shuffle_sync(t, 0)
        cute.arch.mbarrier_wait(empty, (use + 1) % 2)  # a fresh barrier passes parity 1
        if lane == 0:
            slots[slot] = t
            cute.arch.mbarrier_arrive(full)
    else:
        # lane 0 reads the slot and releases it, so its arrive orders the one read of it
        # (no other lane's read for the arrive to cover); the warp gets the index by shuffle
        cute.arch.mbarrier_wait(full, use % 2)
        if lane == 0:
            t = slots[slot]
            cute.arch.mbarrier_arrive(empty)
        t = cute.arch.shuffle_sync(t, 0)
    return t
