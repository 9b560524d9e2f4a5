"""Epilogue role (warp 13): TMA store of the normalized O from SMEM to global memory.

Consumes  sO[i] (``o_epi`` full, written by the correction warps).
Produces  O in global memory; frees sO[i] (``o_epi`` release by one elected thread, once the
          bulk store has finished reading SMEM).

Per work tile: for each Q stage i, wait o_epi(i) and issue the store of this CTA's 128 rows;
then, oldest first, wait until each store has read sO[i] and release it. Rows past seqlen_q
are dropped by the TMA unit (out-of-bounds writes are clipped); under varlen, rows past the
tile's sequence (``fa_sm100.varlen.ragged_rows``).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.cute.nvgpu import cpasync

from fa_sm100.sm100.scheduler import tile_problem
from fa_sm100.varlen import ragged_tile_rows
from pipelines import record


@cute.jit
def epilogue(cfg, tma_atom_o, gmem, smem, pipes, sched, cta_v: Int32, prob=None):
    """Store O tile by tile (see the module docstring). ``prob``: read under varlen (each
    tile's sequence: its rows are stored through O's ragged view, ``fa_sm100.varlen``)."""
    phase = Int32(0)
    tile = sched.initial()
    num_tiles = sched.num_tiles
    with record.loop("work_tiles"):
        while tile < num_tiles:
            wt = sched.decode(tile)
            mO = gmem.mO[None, None, wt.head, wt.batch]
            if cutlass.const_expr(cfg.varlen):  # ragged rows end at the sequence's last row
                tile_prob = tile_problem(prob, wt)
                mO = ragged_tile_rows(gmem.mO[None, None, wt.head, None], tile_prob.seqlen_q,
                                      tile_prob.q_off)
            gO = cute.local_tile(mO, (cfg.m_block, cfg.head_dim_v), (None, 0))  # (M, DV, m tiles)
            tOsO, tOgO = cpasync.tma_partition(
                tma_atom_o, 0, cute.make_layout(1), cute.group_modes(smem.sO, 0, 2),
                cute.group_modes(gO, 0, 2))
            for stage in cutlass.range_constexpr(cfg.q_stage):
                pipes.o_epi.consumer_wait(stage, phase, stage_hint=stage)
                record.access(f"sO{stage}", "r", note="TMA store, waited before the release")
                m_tile = (wt.m_block * cfg.q_stage + stage) * cfg.cta_group + cta_v
                cute.copy(tma_atom_o, tOsO[None, stage], tOgO[None, m_tile])
                cute.arch.cp_async_bulk_commit_group()
            for stage in cutlass.range_constexpr(cfg.q_stage):
                cute.arch.cp_async_bulk_wait_group(cfg.q_stage - 1 - stage, read=True)
                pipes.o_epi.consumer_release(stage, stage_hint=stage)  # one elected thread
            phase ^= 1
            tile = sched.next(tile)
    cute.arch.cp_async_bulk_wait_group(0, read=False)
