"""The load role of the SM90 backward (a mixin of ``Sm90FlashBackward``): warp 0 of the
producer warpgroup. It loads K and V of the CTA's key block once and then, per query block in
the order of Note [staggered query blocks], Q and dO into the ``q`` and ``do`` pipelines, each
stage with its block's LSE2 / Delta (Note [stats with their stage]); under ``qdo_multicast``
this CTA's share of each tile, multicast to the cluster (Note [Q/dO multicast]). With
persistent CTAs it does so for each tile of the CTA's walk, the next tile's first Q / dO
before its K / V. The Notes are in ``bwd_kernel.py``, but [staggered query blocks] and
[persistent CTAs], which are in ``bwd_tiles.py``.
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import const_expr
from cutlass.cute.nvgpu import cpasync
from cutlass.experimental import primitives as prims

from fa_sm100.hopper.bwd_store import preprocess_count, wait_for_count


class BwdLoadRole:
    """Mixin of ``Sm90FlashBackward``: the load warp.

    Uses the kernel's ``cfg``, ``tile_m``, ``tile_n``, ``hdim``, ``hdimv``, ``bytes_kv`` and
    ``_m_block_at``.
    """

    @cute.jit
    def load(self, mQ, mK, mV, mdO, tma_Q, tma_K, tma_V, tma_dO, sQ, sK, sV, sdO,
             mLSE2, mDelta, sLSE2, sDelta, mdQsem, mbar_kv, pipe_q, pipe_do, work, group):
        """Warp 0: ``_load_tile`` for this CTA's tile, or with persistent CTAs for each tile of
        its walk (Note [persistent CTAs] in bwd_tiles.py), the ``q`` / ``do`` states carried
        from one to the next; under ``qdo_multicast`` it then waits for the peers' last
        releases."""
        state_q = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.cfg.q_stage)
        state_do = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.cfg.do_stage)
        args = (mQ, mK, mV, mdO, tma_Q, tma_K, tma_V, tma_dO, sQ, sK, sV, sdO, mLSE2, mDelta,
                sLSE2, sDelta, mdQsem, mbar_kv, pipe_q, pipe_do, group)
        state_q, state_do = self._walk(work, self._load_tile, args, (state_q, state_do),
                                        fetches=True)
        if const_expr(self.cfg.qdo_multicast):  # Note [Q/dO multicast]: the peer's releases
            pipe_q.producer_tail(state_q)
            pipe_do.producer_tail(state_do)

    @cute.jit
    def _load_tile(self, mQ, mK, mV, mdO, tma_Q, tma_K, tma_V, tma_dO, sQ, sK, sV, sdO,
                   mLSE2, mDelta, sLSE2, sDelta, mdQsem, mbar_kv, pipe_q, pipe_do, group,
                   tile, k, state_q, state_do):
        """One tile (``BwdTile``): K, V of its key block (``mbar_kv``); then for each query
        block m from ``m_block_first`` to ``m_block_max``, in the order of Note [staggered query
        blocks]: acquire a ``q`` stage, TMA Q[m] (and, with ``stats_smem``, bulk-copy LSE2[m]);
        acquire a ``do`` stage, TMA dO[m] (and Delta[m]). The MMA warpgroups release the
        stages. With persistent CTAs (``k``: which of the CTA's tiles this is) a later
        tile's first Q and dO go first, into stages the previous tile has freed, and its K, V
        wait until the previous tile's last GEMMs have retired (K/V empty, ``mbar_kv + 1``).
        Returns the advanced states."""
        n_block, head, batch = tile.n_block, tile.head, tile.batch
        m_block_min, m_block_max, m_offset = tile.m_block_first, tile.m_block_max, tile.m_offset
        head_kv = head // group
        gK = cute.local_tile(mK[None, None, head_kv, batch], (self.tile_n, self.hdim), (n_block, 0))
        gV = cute.local_tile(mV[None, None, head_kv, batch], (self.tile_n, self.hdimv), (n_block, 0))
        gQ = cute.local_tile(mQ[None, None, head, batch], (self.tile_m, self.hdim), (None, 0))
        gdO = cute.local_tile(mdO[None, None, head, batch], (self.tile_m, self.hdimv), (None, 0))
        one = cute.make_layout(1)
        tKsK, tKgK = cpasync.tma_partition(tma_K, 0, one, cute.group_modes(sK, 0, 2),
                                           cute.group_modes(gK, 0, 2))
        tVsV, tVgV = cpasync.tma_partition(tma_V, 0, one, cute.group_modes(sV, 0, 2),
                                           cute.group_modes(gV, 0, 2))
        # Note [Q/dO multicast]: this CTA's share of each Q / dO tile (the whole tile without)
        rank, qdo = 0, cute.make_layout(self.cfg.cluster[0])
        mcast = {}
        if const_expr(self.cfg.qdo_multicast):
            rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
            mcast = {"mcast_mask": cutlass.Int16((1 << self.cfg.cluster[0]) - 1)}
        tQsQ, tQgQ = cpasync.tma_partition(tma_Q, rank, qdo, cute.group_modes(sQ, 0, 2),
                                           cute.group_modes(gQ, 0, 2))
        tdOsdO, tdOgdO = cpasync.tma_partition(tma_dO, rank, qdo, cute.group_modes(sdO, 0, 2),
                                               cute.group_modes(gdO, 0, 2))
        # what _load_block loads Q and dO with: pipelines, TMA, their partitions, statistics
        stages = ((pipe_q, tma_Q, tQgQ, tQsQ, mLSE2, sLSE2),
                  (pipe_do, tma_dO, tdOgdO, tdOsdO, mDelta, sDelta))
        first_step = m_block_min
        if const_expr(self.cfg.persistent_ctas):
            # Note [persistent CTAs]: the first tile's K / V before the preprocess's wait (Note
            # [chained launches]); a later tile's first Q / dO (seqlen_q >= 1: there is one)
            # while the previous tile ends, then its K / V once that tile's GEMMs have retired
            if k == 0:
                self._load_kv(tma_K, tma_V, tKgK, tKsK, tVgV, tVsV, mbar_kv)
            self.wait_for_preprocess(mdQsem, mLSE2, batch, head)
            m_first = self._m_block_at(m_block_min, m_offset, m_block_min, m_block_max)
            self._load_block(stages, state_q, state_do, mcast, batch, head, m_first)
            state_q.advance()
            state_do.advance()
            first_step = m_block_min + 1
            if k > 0:
                cute.arch.mbarrier_wait(mbar_kv + 1, (k - 1) % 2)
                self._load_kv(tma_K, tma_V, tKgK, tKsK, tVgV, tVsV, mbar_kv)
        else:
            self._load_kv(tma_K, tma_V, tKgK, tKsK, tVgV, tVsV, mbar_kv)
            # Note [chained launches]: K, V do not come from the preprocess; LSE2 / Delta
            # (with Q / dO) do
            self.wait_for_preprocess(mdQsem, mLSE2, batch, head)
        for step in cutlass.range(first_step, self._sweep_end(m_block_min, m_block_max),
                                  unroll=1):
            m_block = self._m_block_at(step, m_offset, m_block_min, m_block_max)
            self._load_block(stages, state_q, state_do, mcast, batch, head, m_block)
            state_q.advance()
            state_do.advance()
        return state_q, state_do

    def _load_block(self, stages, state_q, state_do, mcast, batch, head, m_block):
        """Query block ``m_block``'s Q and dO, each into the stage its state names
        (``_load_stage``); ``stages`` holds, for Q then dO, (pipeline, TMA atom, GMEM and SMEM
        partitions, statistic in GMEM and SMEM). Traced inline."""
        for (pipe, tma, t_g, t_s, m_stat, s_stat), state in zip(stages, (state_q, state_do)):
            self._load_stage(pipe, state, tma, t_g, t_s, mcast, m_stat, s_stat, batch, head,
                             m_block)

    def _load_kv(self, tma_K, tma_V, tKgK, tKsK, tVgV, tVsV, mbar_kv):
        """TMA K and V of the tile's key block onto K/V full (``mbar_kv``), which expects
        their bytes. Traced inline."""
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(mbar_kv, self.bytes_kv)
        cute.copy(tma_K, tKgK, tKsK, tma_bar_ptr=mbar_kv)
        cute.copy(tma_V, tVgV, tVsV, tma_bar_ptr=mbar_kv)

    @cute.jit
    def wait_for_preprocess(self, mdQsem, mLSE2, batch, head):
        """The calling warp waits until what the preprocess writes for (batch, head) is
        visible: ``griddepcontrol.wait`` (Note [chained launches]), or with ``pre_ctas`` until
        the preprocess has counted all seqlen_q_pad rows of the pair, then a proxy fence, as
        the warp's TMA / bulk copies read them (Note [Preprocess beside the main kernel] in
        bwd_prepost.py)."""
        if const_expr(self.cfg.pre_ctas):
            wait_for_count(preprocess_count(mdQsem, batch, head), mLSE2.shape[2], self.cfg.pdl)
            cute.arch.fence_proxy("async.global")
        elif const_expr(self.cfg.pdl):
            cute.arch.griddepcontrol_wait()

    def _load_stage(self, pipe, state, tma, tXgX, tXsX, mcast, mStat, sStat, batch, head,
                    m_block):
        """Acquire ``pipe``'s stage ``state`` and TMA query block ``m_block`` of Q or dO into it
        (``mcast``: this CTA's share, multicast to the cluster); with ``stats_smem`` also the
        block's tile_m values of its statistic (LSE2 with Q, Delta with dO) by one bulk copy
        completing on the same mbarrier (its tx count includes them). Rows of the statistics
        are padded to a multiple of tile_m and start 16-byte aligned, as bulk copies require.
        Traced inline (plain Python: ``mcast`` is a dict of keyword arguments)."""
        pipe.producer_acquire(state)
        mbar = pipe.producer_get_barrier(state)
        cute.copy(tma, tXgX[None, m_block], tXsX[None, state.index], tma_bar_ptr=mbar, **mcast)
        if const_expr(self.cfg.stats_smem):
            src = mStat[batch, head, None].iterator + m_block * self.tile_m
            with cute.arch.elect_one():
                prims.cp_async_bulk_shared_cluster_global(
                    sStat[None, state.index].iterator, src, mbar, self.tile_m * 4)
