"""The load role of the SM90 backward: warp 0 of the producer warpgroup.

Consumes the TMA views of Q, K, V, dO and, with ``stats_smem``, LSE2 / Delta (``BwdGmem``).
Produces K and V of the tile's key block in SMEM once per tile (the K/V full mbarrier,
``BwdPipes.kv``), and per query block, in the order of Note [staggered query blocks]
(bwd_tiles.py), Q and dO in a ``q`` / ``do`` pipeline stage, each with its block's LSE2 /
Delta (Note [stats with their stage]); under ``qdo_multicast`` this CTA's share of each
tile, multicast to the cluster (Note [Q/dO multicast]). With persistent CTAs it does so for
each tile of the CTA's walk, the next tile's first Q / dO before its K / V (Note [persistent
CTAs] in bwd_tiles.py). The MMA warpgroups (bwd_mma.py) release the stages.

Note [stats with their stage] (``stats_smem``): the exp2 needs LSE2 of the block's queries
right after the S GEMM, and dS needs Delta right after dP. Loaded from global memory in that
iteration, their latency sits on the critical path between the GEMMs and the pointwise math.
Instead the load warp bulk-copies each block's tile_m values of LSE2 (Delta) into a per-stage
SMEM slot next to the Q (dO) TMA, on the same mbarrier, whose transaction count includes
them; the MMA warpgroups have waited on that stage anyway, and the slot is released with it.

Note [Q/dO multicast] (``qdo_multicast``): without a mask every key block of a (batch, head)
pair visits the same query blocks in the same order, so the CTAs of key blocks c q .. c q +
q - 1 (q = ``qdo_cluster``, 2 by default; the launch needs a whole number of clusters of key
blocks) run as one cluster and share their Q and dO loads: each CTA's load warp loads its
1/q of the rows of every Q and dO tile and multicasts it into every CTA's SMEM of the cluster
(LSE2 and Delta stay per-CTA bulk copies on the same barrier). A stage is empty only once the
MMA warpgroups of every CTA have released it: each MMA warp arrives on the empty barrier of
each CTA (lanes 0 .. q-1, the DSL's ``PipelineTmaAsync`` with a (1, q, 1, 1) cluster layout).
The load warp waits for every stage to be empty again before the CTA may exit
(``producer_tail``): the peers' last releases arrive on this CTA's barriers.
Under a causal mask (no window) all key blocks of a cluster end at the same query block but
start at different ones, the higher key blocks later (``m_block_range``). Every CTA of the
cluster then loads from the first query block of its rank-0 key block (``m_block_first``),
and a CTA whose own range starts later waits for each of the blocks before it and releases
it at once: the stage indices of the cluster stay in step. That CTA's SM idles about as long
as the lower key block takes for those blocks (1-2 blocks of 80 / 64 / 128 rows per cluster),
so the default turns it on only for long problems (``CAUSAL_MULTICAST_MIN_SEQLEN``), where
the blocks skipped are a small share of a CTA's. With ``longest_first`` the clusters, not the
CTAs, are renumbered (``longest_first_cluster_cta``). Same idea as the forward's Note [K/V
multicast]. Clusters of 4 measured slower than pairs on the H100, backward and forward.
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import const_expr
from cutlass.cute.nvgpu import cpasync
from cutlass.experimental import primitives as prims

from fa_sm100.config import cutlass_dtype
from fa_sm100.hopper.bwd_store import wait_for_preprocess
from fa_sm100.hopper.bwd_tiles import m_block_at, sweep_end, walk


def load_bytes(cfg) -> tuple:
    """TMA bytes of one Q tile, one dO tile, and K with V of one key block (the ``q`` /
    ``do`` stages' and K/V full's transaction counts, before the statistics)."""
    width = cutlass_dtype(cfg.dtype).width
    return (cfg.tile_m * cfg.head_dim * width // 8, cfg.tile_m * cfg.head_dim_v * width // 8,
            cfg.tile_n * (cfg.head_dim + cfg.head_dim_v) * width // 8)


@cute.jit
def load(cfg, prob, gmem, smem, pipes, atoms, work):
    """Warp 0: ``_load_tile`` for this CTA's tile, or with persistent CTAs for each tile of
    its walk (Note [persistent CTAs] in bwd_tiles.py), the ``q`` / ``do`` states carried
    from one to the next; under ``qdo_multicast`` it then waits for the peers' last
    releases. ``atoms``: the TMA atoms (``BwdLoadAtoms``)."""
    state_q = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, cfg.q_stage)
    state_do = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, cfg.do_stage)
    args = (cfg, prob, gmem, smem, pipes, atoms)
    state_q, state_do = walk(cfg, work, _load_tile, args, (state_q, state_do), fetches=True)
    if const_expr(cfg.qdo_multicast):  # Note [Q/dO multicast]: the peer's releases
        pipes.q.producer_tail(state_q)
        pipes.do.producer_tail(state_do)


@cute.jit
def _load_tile(cfg, prob, gmem, smem, pipes, atoms, tile, state_q, state_do):
    """One tile (``BwdTile``): K, V of its key block (``pipes.kv``); then for each query
    block m from ``m_block_first`` to ``m_block_max``, in the order of Note [staggered query
    blocks]: acquire a ``q`` stage, TMA Q[m] (and, with ``stats_smem``, bulk-copy LSE2[m]);
    acquire a ``do`` stage, TMA dO[m] (and Delta[m]). The MMA warpgroups release the
    stages. With persistent CTAs (``tile.k``: which of the CTA's tiles this is) a later
    tile's first Q and dO go first, into stages the previous tile has freed, and its K, V
    wait until the previous tile's last GEMMs have retired (K/V empty, ``pipes.kv + 1``).
    Returns the advanced states."""
    n_block, head, batch, k = tile.n_block, tile.head, tile.batch, tile.k
    m_block_min, m_block_max, m_offset = tile.m_block_first, tile.m_block_max, tile.m_offset
    mbar_kv, sQ, sdO = pipes.kv, smem.sQ, smem.sdO
    head_kv = head // prob.group
    gK = cute.local_tile(gmem.mK[None, None, head_kv, batch], (cfg.tile_n, cfg.head_dim),
                         (n_block, 0))
    gV = cute.local_tile(gmem.mV[None, None, head_kv, batch], (cfg.tile_n, cfg.head_dim_v),
                         (n_block, 0))
    gQ = cute.local_tile(gmem.mQ[None, None, head, batch], (cfg.tile_m, cfg.head_dim),
                         (None, 0))
    gdO = cute.local_tile(gmem.mdO[None, None, head, batch], (cfg.tile_m, cfg.head_dim_v),
                          (None, 0))
    one = cute.make_layout(1)
    tKsK, tKgK = cpasync.tma_partition(atoms.k, 0, one, cute.group_modes(smem.sK, 0, 2),
                                       cute.group_modes(gK, 0, 2))
    tVsV, tVgV = cpasync.tma_partition(atoms.v, 0, one, cute.group_modes(smem.sV, 0, 2),
                                       cute.group_modes(gV, 0, 2))
    kv = (tKgK, tKsK, tVgV, tVsV)
    kv_bytes = load_bytes(cfg)[2]
    # Note [Q/dO multicast]: this CTA's share of each Q / dO tile (the whole tile without)
    rank, qdo = 0, cute.make_layout(cfg.cluster[0])
    mcast = {}
    if const_expr(cfg.qdo_multicast):
        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        mcast = {"mcast_mask": cutlass.Int16((1 << cfg.cluster[0]) - 1)}
    tQsQ, tQgQ = cpasync.tma_partition(atoms.q, rank, qdo, cute.group_modes(sQ, 0, 2),
                                       cute.group_modes(gQ, 0, 2))
    tdOsdO, tdOgdO = cpasync.tma_partition(atoms.do, rank, qdo, cute.group_modes(sdO, 0, 2),
                                           cute.group_modes(gdO, 0, 2))
    # what _load_block loads Q and dO with: pipelines, TMA, their partitions, statistics
    stages = ((pipes.q, atoms.q, tQgQ, tQsQ, gmem.mLSE2, smem.sLSE2),
              (pipes.do, atoms.do, tdOgdO, tdOsdO, gmem.mDelta, smem.sDelta))
    first_step = m_block_min
    if const_expr(cfg.persistent_ctas):
        # Note [persistent CTAs]: the first tile's K / V before the preprocess's wait (Note
        # [chained launches]); a later tile's first Q / dO (seqlen_q >= 1: there is one)
        # while the previous tile ends, then its K / V once that tile's GEMMs have retired
        if k == 0:
            _load_kv(atoms, kv, mbar_kv, kv_bytes)
        wait_for_preprocess(cfg, gmem, batch, head)
        m_first = m_block_at(cfg, m_block_min, m_offset, m_block_min, m_block_max)
        _load_block(cfg, stages, state_q, state_do, mcast, batch, head, m_first)
        state_q.advance()
        state_do.advance()
        first_step = m_block_min + 1
        if k > 0:
            cute.arch.mbarrier_wait(mbar_kv + 1, (k - 1) % 2)
            _load_kv(atoms, kv, mbar_kv, kv_bytes)
    else:
        _load_kv(atoms, kv, mbar_kv, kv_bytes)
        # Note [chained launches]: K, V do not come from the preprocess; LSE2 / Delta
        # (with Q / dO) do
        wait_for_preprocess(cfg, gmem, batch, head)
    for step in cutlass.range(first_step, sweep_end(m_block_min, m_block_max), unroll=1):
        m_block = m_block_at(cfg, step, m_offset, m_block_min, m_block_max)
        _load_block(cfg, stages, state_q, state_do, mcast, batch, head, m_block)
        state_q.advance()
        state_do.advance()
    return state_q, state_do


def _load_block(cfg, stages, state_q, state_do, mcast, batch, head, m_block):
    """Query block ``m_block``'s Q and dO, each into the stage its state names
    (``_load_stage``); ``stages`` holds, for Q then dO, (pipeline, TMA atom, GMEM and SMEM
    partitions, statistic in GMEM and SMEM). Traced inline."""
    for stage, state in zip(stages, (state_q, state_do)):
        _load_stage(cfg, stage, state, mcast, batch, head, m_block)


def _load_kv(atoms, kv, mbar_kv, nbytes: int):
    """TMA K and V of the tile's key block (``kv``: the GMEM and SMEM partitions of K, then
    V) onto K/V full (``mbar_kv``), which expects their ``nbytes``. Traced inline."""
    tKgK, tKsK, tVgV, tVsV = kv
    with cute.arch.elect_one():
        cute.arch.mbarrier_arrive_and_expect_tx(mbar_kv, nbytes)
    cute.copy(atoms.k, tKgK, tKsK, tma_bar_ptr=mbar_kv)
    cute.copy(atoms.v, tVgV, tVsV, tma_bar_ptr=mbar_kv)


def _load_stage(cfg, stage, state, mcast, batch, head, m_block):
    """Acquire the pipeline's stage ``state`` and TMA query block ``m_block`` of Q or dO into
    it (``stage``: one entry of ``_load_block``'s ``stages``; ``mcast``: this CTA's share,
    multicast to the cluster); with ``stats_smem`` also the block's tile_m values of its
    statistic (LSE2 with Q, Delta with dO) by one bulk copy completing on the same mbarrier
    (its tx count includes them). Rows of the statistics are padded to a multiple of tile_m
    and start 16-byte aligned, as bulk copies require. Traced inline (plain Python:
    ``mcast`` is a dict of keyword arguments)."""
    pipe, tma, tXgX, tXsX, mStat, sStat = stage
    pipe.producer_acquire(state)
    mbar = pipe.producer_get_barrier(state)
    cute.copy(tma, tXgX[None, m_block], tXsX[None, state.index], tma_bar_ptr=mbar, **mcast)
    if const_expr(cfg.stats_smem):
        src = mStat[batch, head, None].iterator + m_block * cfg.tile_m
        with cute.arch.elect_one():
            prims.cp_async_bulk_shared_cluster_global(
                sStat[None, state.index].iterator, src, mbar, cfg.tile_m * 4)
