"""The MMA role of the SM90 backward: warpgroups 1 and 2 (256 threads), warps 4-11.

Consumes K and V of the tile (K/V full, ``BwdPipes.kv``), and per query block a ``q`` and a
``do`` stage (Q, dO and their LSE2 / Delta) from the load warp (bwd_load.py). Produces, per
query block, dQ (into the dq-store warp's SMEM tile, Note [dQ SMEM handoff], or added into the
float32 accumulator from registers: bwd_store.py) and releases the stages; per tile, dK and
dV (bwd_store.py ``store_dkdv_tma`` / ``store_dkdv``). Per query block m (``_mma_tile``):

    wait q; S = Q K^T                 wait do; dP = dO V^T
    P = exp2(S * scale_log2 - LSE2) with the band mask, dS = P (dP - Delta)   (bwd_scores.py)
    P, dS -> SMEM; DS_READY (both warpgroups)
    dV += P^T dO; dQ = dS K; dK += dS^T Q; release do; dQ out; release q

The two warpgroups split every GEMM in half (the table in bwd_kernel.py); the Notes below say
how the order and the operands change with the config's switches.

Note [swapped S/dP] (``sdp_swap_ab``): the warpgroups compute S^T = K Q^T and dP^T = V dO^T
instead (A = K / V, B = Q / dO, both from SMEM; warpgroup w owns key rows 64w .. 64w+63 and
all tile_m query columns). The accumulator of an m64 WGMMA with N = tile_m = 64 has, element
for element, the register layout of the A operand of an m64 WGMMA with K = 64, so P^T and dS^T
are converted to 16 bits in place and dV += P^T dO, dK += dS^T Q are RS WGMMAs: no P buffer, no
``P_READY`` barrier, and dV/dK read only dO/Q from SMEM. LSE2 and Delta belong to the queries,
now the accumulator's columns (16 per thread instead of 2 rows), and the mask sees (key, query)
coordinates. dQ = dS K still reads dS from SMEM, M = queries, K = keys: each warpgroup stores
its dS^T with a transposing stmatrix into the same dS image the unswapped path writes (keys
contiguous), so the dQ GEMM and Note [dS double buffer] are unchanged.

Note [tile_m 128] (``tile_m=128``, swapped only, hdim 64): per warpgroup S^T and dP^T are
64 keys x 128 queries (WGMMA N = 128, 64 float32 registers each), dV and dK are RS WGMMAs with
K = 128, and dQ = dS K (M = 128 queries) is split by query rows: warpgroup w computes rows
64w .. 64w+63 over the whole head dim (K is then one MN-major B of hdim columns), so the dQ
tile, its SMEM image and bulk reduce are simply tile_m rows. What keeps it in 240 registers:
- LSE2 / Delta: a thread's S^T columns are 32 queries, 2 (lane % 4) + {0, 1} + 8 j, and the
  8 lanes with the same lane % 4 need the same 32 values. Lane l holds only the queries
  2 l + {0, 1} and 64 + 2 l + {0, 1} (4 registers, two 64-bit loads, from SMEM with
  ``stats_smem``); ``_query_stat`` (bwd_scores.py) fetches a column's value with one shuffle
  (columns outer in the exp2 and dS loops), and Delta is loaded only after P is computed.
- P^T is never held in float32 and 16 bits beside dP^T: without ``early_dv`` it is converted
  to 16 bits after dS = P (dP - Delta); with ``early_dv`` (dV issued before the dS math, so
  16-bit P^T must exist first) dS is computed from the 16-bit P^T, the value dV uses (a
  rounding of P that the tile_m 64 paths do not make). Holding both made ptxas spill and
  serialize every WGMMA.
hdim 96/128 do not fit (larger dK/dV accumulators: ptxas spills ~0.9-1.4 KB and serializes
every WGMMA even with 1-stage Q/dO), hence the config rule.

Note [dQ transposed] (``tile_m`` 80, swapped S/dP, hdim 128; ``BwdConfig.dq_swap_ab``): 80
query rows are not a whole number of 64-row WGMMA M atoms, so dQ = dS K cannot take the
queries as M. The warpgroups compute dQ^T = K^T dS^T instead: M = the head dim (64 rows per
warpgroup), N = the 80 queries, K = the 128 keys; A = K^T is K's SMEM buffer read MN-major,
B = dS from the same dS image the other paths read (keys contiguous: K-major). The
accumulator is (hdim, tile_m); the fragment order (Note [dQ in fragment order]) and the
postprocess follow the tiled MMA, so the dQ stores and the bulk reduce do not change.
S^T/dP^T have N = 80 and dV/dK are RS WGMMAs with K = 80 (five k16 slices); LSE2/Delta are
held and shuffled as in Note [tile_m 128], the lanes 0-7 holding queries 64-79, or, the
default, each thread loads its 20 (Note [dP wait placement]; an earlier
layout of those loads spilled ~300 bytes). FA4 runs hdim 128 non-causal this way.

Note [dK/dV by columns] (``tile_n`` 64, ``BwdConfig.dkv_split_cols``; head dims 192 and
256): with 128 key rows, dK and dV of a warpgroup's 64 keys are 64 x (hdim + hdim_v) float32,
256 registers per thread at hdim 256. So the CTA owns 64 keys, S and dP are split by key
columns (32 per warpgroup), and dV = P^T dO, dK = dS^T Q are split by head-dim columns:
warpgroup w computes all 64 keys x columns [w hdim/2, (w+1) hdim/2), 64 + 64 registers at
hdim 256 (Q's and dO's SMEM swizzle atoms are then chosen for hdim/2 columns, so that each
half is whole atoms: 32-column atoms for the 96 columns of hdim 192). Each warpgroup's dV and
dK read both warpgroups' P and dS from SMEM, so dV is issued after the 256-thread
``DS_READY`` barrier (no early dV, no ``P_READY``) and P is double-buffered like dS (Note
[dS double buffer]: both warpgroups' dV of block i retired before either passes ``DS_READY``
of block i+1).

Note [dK/dV transposed] (``BwdConfig.dkv_swap_ab``; tile_n 96 at (192, 128)): the MMA warp
group computes dV^T = dO^T P and dK^T = Q^T dS, (head dim, keys) tiles whose M is the head dim
(64-row atoms: 2 for dV^T, 3 for dK^T at (192, 128)) and whose N is the warpgroup's own keys,
the same ones its S and dP hold (S/dP unswapped, warpgroups side by side along the keys). So
each warpgroup's dV and dK read only the P and dS it stored itself: early dV waits for its own
128 threads (``P_READY_WG0 + w``) and P needs one buffer; only dQ = dS K reads both
warpgroups' dS (``DS_READY``, Note [dS double buffer]). All four operands come from SMEM as
MN-major descriptors: dO^T and Q^T over the whole head dim (128-byte swizzle atoms), P and dS
over the warpgroup's keys, which with 48 keys per warpgroup (tile_n 96) must be whole swizzle
atoms: 16 key columns each (``ps_atom_cols``). A key block of 96 fits where 128 does not:
(192 + 128) x 48 / 128 = 120 accumulator registers per thread (``dkv_acc_regs``), against 160
for 64 key rows per warpgroup; against tile_n 64 (Note [dK/dV by columns]) each CTA re-reads Q
and dO and adds dQ for 1.5 times as many keys, and S / dP are N = 48 per warpgroup, not 32.
The epilogue stores the transposed tiles through a transposed view of the output (stmatrix
with ``transpose``; or element by element, where the key index is the column).

Note [dS double buffer]: dQ = dS K reads both warpgroups' halves of dS, so a warpgroup may
only overwrite dS once the other has finished the dQ GEMM of the previous query block. dS has
two SMEM buffers (``ds_stage == 2``): iteration i writes buffer i % 2 and then waits on the
``DS_READY`` barrier; a warpgroup that passed ``DS_READY`` of iteration i has retired all
GEMMs of iteration i-1 (``wait_group(0)`` ends every iteration, or see Note [overlapped dK]),
so buffer (i+1) % 2 is free.
P is written and read by one warpgroup only and needs a single buffer (none when swapped;
two with Note [dK/dV by columns], by the same argument as dS).

Note [early dV] (``early_dv``): dV += P^T dO needs only this warpgroup's P, so it is issued as
soon as the warpgroup's 128 threads have stored P (``P_READY_WG0 + w``; swapped, as soon as P^T
is in registers) and runs on the tensor cores while dS = P (dP - Delta) is computed. Per
iteration the WGMMA groups are S, dP, dV, dQ, dK and retire in that order: ``wait_group(1)``
after dK means dV and dQ are done (release ``do``, hand dQ over) while dK still reads Q;
``wait_group(0)`` then releases ``q``.

Note [dV before the dS barrier] (``dv_before_barrier``, without ``early_dv``): dV += P^T dO
is issued once this warpgroup has stored its dS (and, unswapped, its P: one 128-thread
``P_READY`` barrier), before the 256-thread ``DS_READY`` barrier, so the tensor cores run dV
while the warpgroups meet there; dQ and dK follow the barrier as before (FA4's order). The
groups still retire dV, dQ, dK.

Note [dV before the fence] (``dv_before_fence``, swapped with ``dv_before_barrier``): dV reads
P^T from registers and dO from its stage, nothing of the dS just stored, so it is issued
before the ``fence.proxy.async`` that publishes dS to the tensor cores rather than after it.
The fence lowers to ``MEMBAR.ALL.CTA`` + ``FENCE.VIEW.ASYNC.S``, which wait for the dS
``STSM``s to complete; issued after them, dV waits too, and the tensor cores idle between
the last dP and this warpgroup's dV. FA4's order; faster in paired timing on the H200 at
hdim 64 and 128 (``scripts/ab_bench.py``; CHANGELOG.md).

Note [overlapped dK] (``overlap_dk``, unswapped S/dP only): the iteration ends without
``wait_group(0)``, so dK of block i still runs when S and dP of block i+1 are issued and the
tensor cores go from one to the other without a gap. The ``wait_group(1)`` after dP of block
i+1 (groups retire in order) covers dK of block i, and only then is the ``q`` stage of block i
released (block i+1's Q must sit in another stage: ``q_stage >= 2``); after the loop
``wait_group(0)`` waits for the last dK. Note [dS double buffer] still holds: that
``wait_group(1)`` comes before ``DS_READY`` of block i+1. With ``sdp_swap_ab`` dK would read
dS^T from registers across the loop's back edge, and ptxas then serializes every WGMMA of the
kernel, hence the config rule.

Note [stats before the GEMMs] (``stats_first``): a block's LSE2 / Delta are read into
registers (16 LDS.64 per thread swapped, from the stage's SMEM slot) right after the ``q`` /
``do`` wait and before the S / dP GEMM is issued, instead of after both GEMMs. Placed after
them, ptxas issues the loads between the HGMMAs, and they and the HGMMAs wait on each other in
the MIO queue (Nsight Compute, hdim 128 causal 4k: MIO throttle was 23% of the MMA warps'
stall samples against FA4's 5%); placed first, their latency hides behind the GEMMs.
``select_bwd_config`` turns it on for short causal hdim 128 (swapped 64-row blocks) and
windows at hdim 128, where paired timing measured it faster (docs/tuning.md, row "short
band"); at unswapped hdim 256 it measured no gain.

Note [dP wait placement] (``stats_shuffle=False``, ``lse_early``, ``dp_wait_after``; blocks
of 80 / 128 rows): after S^T's GEMM is done the warpgroup computes P = exp2(S^T * scale -
LSE2) and then waits for dP^T (``wait_group(0)``); how many of the exp2s run before that
wait, under the dP^T GEMM, decides how much of the pointwise math the tensor cores hide.
ptxas places the wait where it likes: with shuffled statistics after 10 of hdim 128's 40
``MUFU.EX2``; with FA4's unshuffled loads (every thread its 20 columns, two per ``LDS.64``)
issued as FA4 issues them, after 1, because it lifts Delta's loads and the wait above the
exp2s (FA4's own kernel: after 11). Two switches take that choice back:
- ``lse_early``: the 10 LSE2 loads are issued right after S^T's GEMM, while it runs (FA4's
  order), not after dP^T's; they are done when the exp2s need them. (Shuffled, the 20 values
  would live across the S^T GEMM: ptxas serializes every WGMMA, hence the config rule.)
- ``dp_wait_after = n``: after the n-th exp2, a branch on warp-uniform values that never
  holds (``m_block == seqlen_q``) around a ``wait_group(0)`` that would be right if it ran
  (``_schedule_boundary`` in bwd_scores.py). ptxas does not schedule across a branch, so the
  first n exp2s are issued before it and the real wait comes after it; the exp2s are only
  issued there, not waited for (the branch on the smallest P had to wait for all 40
  results, and measured slower).
hdim 128 (H200, ``scripts/ab_bench.py --top-clock``, paired over the shuffled default):
unshuffled with both switches and n = 26 (the real wait then after 30 exp2s, both masks)
measured faster from 4k on, causal and not (docs/tuning.md, row "own statistics"; at 1k / 2k
the persistent CTAs spill with them, see below); n = 14, 20, 32, 40 and either switch alone
measured no better (CHANGELOG.md lists them). The exp2s go columns outer: rows outer, with both
switches, ptxas serialized every WGMMA (34 commit groups per block).
``select_bwd_config`` takes them where they compile without spills (``_own_stats_fit``:
beside the preprocess, non-causal or causal MHA with Q/dO multicast); elsewhere (persistent
CTAs, causal without multicast or with GQA) ptxas spills 8-76 bytes with them, and the
shuffled loop stays. hdim 64 (128-row blocks, 64 exp2s): unshuffled with n = 32, 42, 52
measured 0.967-0.981, 0.951-0.960, 0.929-0.943, and shuffled with n = 16, 32, 48
0.978-0.992, 0.969-0.979, 0.948-0.952, so its loop stays as ptxas places it.

Note [try first] (``try_wait``): the MMA warpgroups' waits for a ``q`` / ``do`` stage first
poll the mbarrier once (``consumer_try_wait``) and pass the result as the token of the
blocking wait, which runs only if the poll failed. Without the token the wait lowers to
try-wait + ``NANOSLEEP.SYNCS`` inside the loop body; with it, to a test and a branch to an
out-of-line retry loop, as in the forward and in FA4. The token is one more live register:
with swapped 64-row blocks and a left window (GQA, deterministic) ptxas once spilled; since
the mask by limits (``bwd_scores.mask``) that kernel fits with the token (the compile test),
and a paired timing there was a tie, so it is on everywhere.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, const_expr
from cutlass.cute.nvgpu import warpgroup

from fa_sm100.config import cutlass_dtype
from fa_sm100.hopper import probes
from fa_sm100.hopper.bwd_scores import (block_needs_mask, block_stats, ds_rows, exp2_rows, mask,
                                        query_stats, softcap_p, softcap_rows, stat_block)
from fa_sm100.hopper.bwd_store import (dq_tile_shape, stage_dq, store_dkdv, store_dkdv_bulk,
                                       store_dkdv_tma, store_dq)
from fa_sm100.hopper.bwd_tiles import m_block_at, sweep_end, walk
from fa_sm100.hopper.common import NO_WAIT, rows_cols_view, transpose_view, wgmma
from fa_sm100.hopper.config import WARPGROUP_THREADS
from fa_sm100.hopper.fwd_math import convert_to, operand_a_view
from fa_sm100.hopper.named_barriers import Sm90BwdBarrier


@cute.jit
def mma(cfg, prob, gmem, smem, pipes, mmas, out, work):
    """Warpgroups 1-2: ``_mma_tile`` for this CTA's tile, or with persistent CTAs for each
    tile of its walk (Note [persistent CTAs] in bwd_tiles.py), the ``q`` / ``do`` states
    carried from one to the next. ``mmas``: the tiled MMAs and this thread's index among the
    256; ``out``: where dK and dV leave besides ``gmem`` (``BwdDkvOut``)."""
    state_q = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.q_stage)
    state_do = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.do_stage)
    walk(cfg, work, _mma_tile, (cfg, prob, gmem, smem, pipes, mmas, out), (state_q, state_do))


@dataclass(frozen=True)
class MmaOperands:
    """One MMA thread's view of the SMEM operands and of the S / dP tile, the same for every
    query block: WGMMA descriptors of S / dP (``tSrQ``, ``tSrK``, ``tdPrdO``, ``tdPrV``; the
    query side with a stage mode), of dV / dK's B (``tdVrdOt``, ``tdKrQt``) and of dQ
    (``tdQrdS``, ``tdQrKt``); unswapped also dV / dK's A from SMEM (``tdVrPt``, ``tdKrdSt``),
    else None. The stmatrix copy of P / dS (``st_copy``, ``st_thr``) and its destinations
    (``tPsP``, None when swapped; ``tdSsdS``). ``sdp_shape``: the S tile, (queries, keys) or
    swapped (keys, queries); ``tScS`` / ``tScS0``: this thread's and thread 0's coordinates
    in it (rows, cols views); ``thr_sdp``: this thread's slice of the S / dP MMA; ``wg``:
    its warpgroup."""

    wg: object
    thr_sdp: object
    tSrQ: cute.Tensor
    tSrK: cute.Tensor
    tdPrdO: cute.Tensor
    tdPrV: cute.Tensor
    tdVrdOt: cute.Tensor
    tdKrQt: cute.Tensor
    tdQrKt: cute.Tensor
    tdQrdS: cute.Tensor  # (..., DS_STAGE)
    st_copy: object
    st_thr: object
    sdp_shape: tuple
    tdSsdS: cute.Tensor
    tdVrPt: object
    tdKrdSt: object
    tPsP: object
    tScS: cute.Tensor
    tScS0: cute.Tensor


def _operands(cfg, mmas, smem):
    """This thread's ``MmaOperands`` and its zeroed dK and dV accumulators (registers), as
    (operands, acc_dK, acc_dV). Traced inline."""
    mma_sdp, mma_dk, mma_dv, mma_dq, tidx = mmas.sdp, mmas.dk, mmas.dv, mmas.dq, mmas.tidx
    sQ, sK, sV, sdO, sP, sdS = smem.sQ, smem.sK, smem.sV, smem.sdO, smem.sP, smem.sdS
    swap = cfg.sdp_swap_ab
    wg = cute.arch.make_warp_uniform(tidx // WARPGROUP_THREADS)
    wg_thread = wg * WARPGROUP_THREADS
    thr_sdp = mma_sdp.get_slice(tidx)
    wg_sdp, wg_dk, wg_dv, wg_dq = (m.get_slice(wg_thread)
                                   for m in (mma_sdp, mma_dk, mma_dv, mma_dq))
    # operand fragments (SMEM descriptors); the Q/dO ones carry a stage mode
    tSrQ, tSrK = _sdp_fragments(cfg, mma_sdp, wg_sdp, sQ, sK)
    tdPrdO, tdPrV = _sdp_fragments(cfg, mma_sdp, wg_sdp, sdO, sV)
    # dV / dK's query-side operand (dO^T, Q^T): B, or transposed A (Note [dK/dV transposed])
    tdVrdOt = _dkv_fragment(cfg, mma_dv, wg_dv, transpose_view(sdO), query=True)
    tdKrQt = _dkv_fragment(cfg, mma_dk, wg_dk, transpose_view(sQ), query=True)
    if const_expr(cfg.dq_swap_ab):  # Note [dQ transposed]: dQ^T = K^T dS^T
        tdQrKt = mma_dq.make_fragment_A(wg_dq.partition_A(transpose_view(sK)))
        tdQrdS = mma_dq.make_fragment_B(wg_dq.partition_B(sdS))  # (..., DS_STAGE)
    else:
        tdQrdS = mma_dq.make_fragment_A(wg_dq.partition_A(sdS))  # (..., DS_STAGE)
        tdQrKt = mma_dq.make_fragment_B(wg_dq.partition_B(transpose_view(sK)))
    # accumulators
    acc_dV = cute.make_rmem_tensor(mma_dv.partition_shape_C(cfg.dkv_tile_shape(cfg.head_dim_v)),
                                   Float32)
    acc_dK = cute.make_rmem_tensor(mma_dk.partition_shape_C(cfg.dkv_tile_shape(cfg.head_dim)),
                                   Float32)
    acc_dV.fill(0.0)
    acc_dK.fill(0.0)
    # P / dS register -> SMEM copies (stmatrix); swapped, dS^T is stored transposed
    st_atom = cute.make_copy_atom(
        cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=swap, num_matrices=4),
        cutlass_dtype(cfg.dtype))
    st_copy = cute.make_tiled_copy_C(st_atom, mma_sdp)
    st_thr = st_copy.get_slice(tidx)
    sdp_shape = (cfg.tile_m, cfg.tile_n)
    tdVrPt = tdKrdSt = tPsP = None  # swapped: P^T and dS^T are A operands in registers
    if const_expr(swap):
        sdp_shape = (cfg.tile_n, cfg.tile_m)
        tdSsdS = st_thr.partition_D(transpose_view(sdS))
    else:
        tdVrPt = _dkv_fragment(cfg, mma_dv, wg_dv, transpose_view(sP), query=False)
        tdKrdSt = _dkv_fragment(cfg, mma_dk, wg_dk, transpose_view(sdS), query=False)
        tPsP = st_thr.partition_D(sP)
        tdSsdS = st_thr.partition_D(sdS)
    # this thread's S coordinates in the tile: (query, key); swapped (key, query)
    tScS = rows_cols_view(thr_sdp.partition_C(cute.make_identity_tensor(sdp_shape)))
    # thread 0's coordinates: compile-time, for Note [tile_m 128]
    tScS0 = rows_cols_view(
        mma_sdp.get_slice(0).partition_C(cute.make_identity_tensor(sdp_shape)))
    ops = MmaOperands(wg=wg, thr_sdp=thr_sdp, tSrQ=tSrQ, tSrK=tSrK, tdPrdO=tdPrdO, tdPrV=tdPrV,
                      tdVrdOt=tdVrdOt, tdKrQt=tdKrQt, tdQrKt=tdQrKt, tdQrdS=tdQrdS,
                      st_copy=st_copy, st_thr=st_thr, sdp_shape=sdp_shape, tdSsdS=tdSsdS,
                      tdVrPt=tdVrPt, tdKrdSt=tdKrdSt, tPsP=tPsP, tScS=tScS, tScS0=tScS0)
    return ops, acc_dK, acc_dV


@cute.jit
def _mma_tile(cfg, prob, gmem, smem, pipes, mmas, out, tile, state_q, state_do):
    """One tile (``BwdTile``) of warpgroups 1-2 (``mmas.tidx`` 0..255). Per query block m:
    wait ``q``, ``do``; S, dP (WGMMA); P = exp2(S * scale_log2 - LSE2) with the band mask;
    dS = P (dP - Delta); P, dS -> SMEM; ``DS_READY``; dV += P^T dO, dK += dS^T Q,
    dQ = dS K; release ``q``, ``do``; dQ -> global float32 (atomic, or in n_block order when
    deterministic). After the last block: dK *= scale, then dK, dV -> global.

    With ``sdp_swap_ab`` (Note [swapped S/dP]) the S and dP accumulators hold S^T and dP^T,
    P^T and dS^T stay in registers as the A operands of dV and dK, and only dS^T goes to
    SMEM (transposed, into the dS image that dQ reads).

    ``tile.k``: which of the CTA's tiles this is (0 without persistent CTAs), for the phase
    of K/V's barrier. Returns the advanced ``q`` / ``do`` states."""
    n_block, head, batch, m_offset, k = (tile.n_block, tile.head, tile.batch, tile.m_offset,
                                         tile.k)
    m_block_first, m_block_min, m_block_max = (tile.m_block_first, tile.m_block_min,
                                               tile.m_block_max)
    mma_sdp, mma_dk, mma_dv, mma_dq, tidx = mmas.sdp, mmas.dk, mmas.dv, mmas.dq, mmas.tidx
    pipe_q, pipe_do, mbar_kv = pipes.q, pipes.do, pipes.kv
    seqlen_q, scale_log2 = prob.seqlen_q, prob.scale_log2
    dtype = cutlass_dtype(cfg.dtype)
    swap = cfg.sdp_swap_ab
    wide = cfg.wide_query_block  # tile_m 80 / 128 (swapped only): Note [tile_m 128]
    late_p = wide and not cfg.early_dv  # P^T converted after dS
    ds_from_p16 = wide and cfg.early_dv  # dS = P^T (16 bits) (dP^T - Delta)
    stats_first = cfg.stats_first and not wide  # wide blocks read the stats later
    lse_early = wide and cfg.lse_early
    dv_mid = cfg.dv_before_barrier  # validate(): only without early_dv
    p_staged = cfg.p_stage > 1  # Note [dK/dV by columns]: P double-buffered like dS
    ops, acc_dK, acc_dV = _operands(cfg, mmas, smem)

    cute.arch.mbarrier_wait(mbar_kv, k % 2)
    mLSE2_cur = gmem.mLSE2[batch, head, None]
    mDelta_cur = gmem.mDelta[batch, head, None]
    if const_expr(cfg.qdo_multicast and cfg.causal):
        # Note [Q/dO multicast] (bwd_load.py): the cluster's query blocks before this CTA's
        # first are loaded for the lower key blocks of the cluster; wait for each and release
        # it
        for _ in cutlass.range(m_block_first, m_block_min, unroll=1):
            pipe_q.consumer_wait(state_q)
            pipe_q.consumer_release(state_q)
            pipe_do.consumer_wait(state_do)
            pipe_do.consumer_release(state_do)
            state_q.advance()
            state_do.advance()
    if const_expr(cfg.overlap_dk):
        state_q_prev = state_q.clone()  # the stage the previous block's dK reads
    for step in cutlass.range(m_block_min, sweep_end(m_block_min, m_block_max),
                              unroll=1):
        m_block = m_block_at(cfg, step, m_offset, m_block_min, m_block_max)
        ds_idx = (step - m_block_min) % 2
        # S = Q K^T, dP = dO V^T (swapped: S^T = K Q^T, dP^T = V dO^T)
        _consumer_wait(cfg, pipe_q, state_q)
        lse_block = stat_block(cfg, mLSE2_cur, smem.sLSE2, m_block, state_q.index)
        if const_expr(stats_first):  # Note [stats before the GEMMs]
            lse = query_stats(cfg, lse_block, ops.thr_sdp, ops.sdp_shape, ops.tScS)
        acc_S = cute.make_rmem_tensor(mma_sdp.partition_shape_C(ops.sdp_shape), Float32)
        _sdp_gemm(cfg, mma_sdp, acc_S, ops.tSrQ[None, None, None, state_q.index], ops.tSrK)
        if const_expr(lse_early):  # Note [dP wait placement]: LSE2 loads while S^T runs
            lse = query_stats(cfg, lse_block, ops.thr_sdp, ops.sdp_shape, ops.tScS)
        _consumer_wait(cfg, pipe_do, state_do)
        delta_block = stat_block(cfg, mDelta_cur, smem.sDelta, m_block, state_do.index)
        if const_expr(stats_first):
            dpsum = query_stats(cfg, delta_block, ops.thr_sdp, ops.sdp_shape, ops.tScS)
        acc_dP = cute.make_rmem_tensor(mma_sdp.partition_shape_C(ops.sdp_shape), Float32)
        _sdp_gemm(cfg, mma_sdp, acc_dP, ops.tdPrdO[None, None, None, state_do.index], ops.tdPrV)
        S = rows_cols_view(acc_S)
        dP = rows_cols_view(acc_dP)
        if const_expr(not stats_first and not lse_early):
            lse = block_stats(cfg, lse_block, ops.thr_sdp, ops.sdp_shape, ops.tScS)
            if const_expr(not wide):  # wide blocks read Delta after P (below)
                dpsum = query_stats(cfg, delta_block, ops.thr_sdp, ops.sdp_shape, ops.tScS)
        warpgroup.wait_group(1)  # S done (Note [overlapped dK]: so is the previous dK)
        if const_expr(cfg.overlap_dk):
            if step > m_block_min:
                pipe_q.consumer_release(state_q_prev)
        pointwise = probes.active("pointwise") != "none"  # Note [cost probes]
        softcap = cfg.softcap
        if const_expr(pointwise):
            if const_expr(softcap):  # t = tanh(S * softcap_k), kept in S until dS
                softcap_rows(S, prob.softcap_k)
            if block_needs_mask(cfg, prob, m_block, n_block):
                mask(cfg, prob, S, ops.tScS, ops.tScS0, m_block, n_block)
            if const_expr(not softcap):
                exp2_rows(cfg, S, lse, scale_log2, ops.tScS0, m_block, seqlen_q)
        if const_expr(wide):  # Delta after P: its registers never live beside LSE2's
            dpsum = block_stats(cfg, delta_block, ops.thr_sdp, ops.sdp_shape, ops.tScS)
        rP = cute.make_fragment_like(acc_S, dtype)
        tdVrdOt_cur = ops.tdVrdOt[None, None, None, state_do.index]  # dV's dO^T (or dO^T as A)
        if const_expr(softcap):  # P straight into 16 bits; S keeps t (tile_m 64 only)
            if const_expr(pointwise):
                softcap_p(cfg, rP, acc_S, S, lse, scale_log2, ops.tScS0)
            if const_expr(not swap):
                cute.copy(ops.st_copy, ops.st_thr.retile(rP),
                          ops.tPsP[None, None, None, ds_idx if p_staged else 0])
                tdVrPt_cur = ops.tdVrPt[None, None, None, ds_idx if p_staged else 0]
            else:
                tdVrPt_cur = operand_a_view(rP)
        elif const_expr(not swap):
            rP.store(acc_S.load().to(dtype))
            p_idx = ds_idx if p_staged else 0
            cute.copy(ops.st_copy, ops.st_thr.retile(rP), ops.tPsP[None, None, None, p_idx])
            tdVrPt_cur = ops.tdVrPt[None, None, None, p_idx]
        elif const_expr(not late_p):
            convert_to(rP, acc_S)  # whole registers: the A operand of dV as it is
            tdVrPt_cur = operand_a_view(rP)
        if const_expr(cfg.early_dv):
            # Note [early dV]: P is this warpgroup's own; dV runs while dS is computed.
            if const_expr(not swap):
                cute.arch.fence_view_async_shared()
                cute.arch.barrier(barrier_id=int(Sm90BwdBarrier.P_READY_WG0) + ops.wg,
                                  number_of_threads=WARPGROUP_THREADS)
            _dkv_gemm(cfg, mma_dv, acc_dV, tdVrPt_cur, tdVrdOt_cur)
            warpgroup.wait_group(1)  # dP done; dV may still run
        else:
            warpgroup.wait_group(0)
        if const_expr(pointwise and softcap):
            ds_rows(cfg, dP, rows_cols_view(rP), dpsum, ops.tScS0, capped=S)
        elif const_expr(pointwise):
            ds_rows(cfg, dP, rows_cols_view(rP) if const_expr(ds_from_p16) else S, dpsum,
                          ops.tScS0)
        rdS = cute.make_fragment_like(acc_dP, dtype)
        if const_expr(swap):
            convert_to(rdS, acc_dP)
            tdKrdSt_cur = operand_a_view(rdS)
        else:
            rdS.store(acc_dP.load().to(dtype))
            tdKrdSt_cur = ops.tdKrdSt[None, None, None, ds_idx]
        if const_expr(late_p):
            convert_to(rP, acc_S)  # Note [tile_m 128]: only now, S^T is dead after this
            tdVrPt_cur = operand_a_view(rP)
        cute.copy(ops.st_copy, ops.st_thr.retile(rdS), ops.tdSsdS[None, None, None, ds_idx])
        dv_pre_fence = dv_mid and swap and cfg.dv_before_fence
        if const_expr(dv_pre_fence):  # Note [dV before the fence]
            _dkv_gemm(cfg, mma_dv, acc_dV, tdVrPt_cur, tdVrdOt_cur)
        cute.arch.fence_view_async_shared()
        if const_expr(dv_mid and not dv_pre_fence):  # Note [dV before the dS barrier]
            if const_expr(not swap):  # P in SMEM: this warpgroup's stores are done
                cute.arch.barrier(barrier_id=int(Sm90BwdBarrier.P_READY_WG0) + ops.wg,
                                  number_of_threads=WARPGROUP_THREADS)
            _dkv_gemm(cfg, mma_dv, acc_dV, tdVrPt_cur, tdVrdOt_cur)
        if const_expr(probes.active("ds_barrier") != "none"):  # Note [cost probes]
            cute.arch.barrier(barrier_id=int(Sm90BwdBarrier.DS_READY),
                              number_of_threads=cfg.num_mma_threads)
        # dV += P^T dO (unless issued before), dQ = dS K, dK += dS^T Q; groups retire in order
        if const_expr(not cfg.early_dv and not dv_mid):
            _dkv_gemm(cfg, mma_dv, acc_dV, tdVrPt_cur, tdVrdOt_cur)
        acc_dQ = cute.make_rmem_tensor(mma_dq.partition_shape_C(dq_tile_shape(cfg)),
                                       Float32)
        if const_expr(cfg.dq_swap_ab):
            wgmma(mma_dq, acc_dQ, ops.tdQrKt, ops.tdQrdS[None, None, None, ds_idx], True, NO_WAIT)
        else:
            wgmma(mma_dq, acc_dQ, ops.tdQrdS[None, None, None, ds_idx], ops.tdQrKt, True, NO_WAIT)
        _dkv_gemm(cfg, mma_dk, acc_dK, tdKrdSt_cur, ops.tdKrQt[None, None, None, state_q.index])
        warpgroup.wait_group(1)  # dV and dQ done, dK may still run
        pipe_do.consumer_release(state_do)
        if const_expr(cfg.dq_accum == "bulk"):
            stage_dq(cfg, acc_dQ, smem.sdQ, tidx)
        else:
            store_dq(cfg, prob, gmem, acc_dQ, tidx, tile, m_block)
        if const_expr(cfg.overlap_dk):
            state_q_prev = state_q.clone()  # dK runs on behind the next S and dP
        else:
            warpgroup.wait_group(0)
            pipe_q.consumer_release(state_q)
        state_q.advance()
        state_do.advance()
    if const_expr(cfg.overlap_dk):
        warpgroup.wait_group(0)  # the last dK
        if m_block_max > m_block_min:
            pipe_q.consumer_release(state_q_prev)
    _epilogue(cfg, prob, gmem, pipes, mmas, out, acc_dK, acc_dV, tile)
    return state_q, state_do


@cute.jit
def _epilogue(cfg, prob, gmem, pipes, mmas, out, acc_dK, acc_dV, tile):
    """After the tile's last query block: dK = scale * dS^T Q, then dK and dV out, by TMA
    through SMEM (``store_dkdv_tma``, MHA) or from the registers (``store_dkdv``)."""
    for i in cutlass.range_constexpr(cute.size(acc_dK)):  # dK = scale * dS^T Q
        acc_dK[i] = acc_dK[i] * prob.softmax_scale
    if const_expr(cfg.stores_dkv_by_tma):
        store_dkdv_tma(cfg, mmas, out, pipes.kv, acc_dK, acc_dV, tile)
    elif const_expr(cfg.adds_dkv_by_bulk):
        store_dkdv_bulk(cfg, prob, gmem, mmas, acc_dK, acc_dV, tile, out.staging)
    else:
        store_dkdv(cfg, prob, gmem, mmas, acc_dK, acc_dV, tile)


@cute.jit
def _consumer_wait(cfg, pipe, state):
    """Wait for a ``q`` / ``do`` stage (Note [try first])."""
    if const_expr(cfg.try_wait):
        pipe.consumer_wait(state, pipe.consumer_try_wait(state))
    else:
        pipe.consumer_wait(state)


def _operand(mma, wg_mma, s_view, as_a: bool):
    """The WGMMA descriptor of an SMEM operand, as A or as B."""
    if as_a:
        return mma.make_fragment_A(wg_mma.partition_A(s_view))
    return mma.make_fragment_B(wg_mma.partition_B(s_view))


def _dkv_fragment(cfg, mma, wg_mma, s_view, query: bool):
    """WGMMA descriptor of an SMEM operand of dV = P^T dO / dK = dS^T Q: the score side (P^T,
    dS^T; ``query`` False) is A and the query side (dO^T, Q^T) B, or the other way round with
    ``dkv_swap_ab`` (dV^T = dO^T P, dK^T = Q^T dS)."""
    return _operand(mma, wg_mma, s_view, as_a=cfg.dkv_swap_ab == query)


def _sdp_fragments(cfg, mma_sdp, wg_sdp, s_query, s_key):
    """WGMMA descriptors of a query-side (Q, dO) and a key-side (K, V) SMEM operand of
    S = Q K^T / dP = dO V^T: A and B, or B and A with ``sdp_swap_ab``. Returns them as
    (query side, key side)."""
    return (_operand(mma_sdp, wg_sdp, s_query, as_a=not cfg.sdp_swap_ab),
            _operand(mma_sdp, wg_sdp, s_key, as_a=cfg.sdp_swap_ab))


@cute.jit
def _gemm(mma, acc, first, second, swapped: cutlass.Constexpr, zero_init: cutlass.Constexpr):
    """Issue acc (+)= first x second^T without waiting, or with ``swapped`` its transpose,
    second x first^T (the operands' descriptors made for it)."""
    if const_expr(swapped):
        wgmma(mma, acc, second, first, zero_init, NO_WAIT)
    else:
        wgmma(mma, acc, first, second, zero_init, NO_WAIT)


@cute.jit
def _dkv_gemm(cfg, mma, acc, frag_score, frag_query):
    """Issue dV += P^T dO (dK += dS^T Q) into ``acc``; with ``dkv_swap_ab`` its transpose."""
    _gemm(mma, acc, frag_score, frag_query, cfg.dkv_swap_ab, False)


@cute.jit
def _sdp_gemm(cfg, mma_sdp, acc, frag_query, frag_key):
    """Issue S = Q K^T (or dP = dO V^T) into ``acc``; with ``sdp_swap_ab`` its transpose."""
    _gemm(mma_sdp, acc, frag_query, frag_key, cfg.sdp_swap_ab, True)
