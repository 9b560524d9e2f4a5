"""The SM90 attention backward main kernel (`sm90_bwd`): warp-specialized, WGMMA.

One CTA owns one tile (key block ``n_block``, query head, batch), or with persistent CTAs
one tile at a time of its walk (Note [persistent CTAs] in bwd_tiles.py, which also
says which tiles a CTA takes and in what order): it keeps K and V of its
``tile_n`` key rows (128; 64 above hdim 128) in SMEM and accumulates dK and dV in registers
while it walks the query blocks that can see those keys. Per query block (``tile_m`` = 64
rows, or 80 / 128 with ``sdp_swap_ab``) it recomputes S and dP and produces P and dS.

Warps (384 threads):

| warpgroup | warps | role | does |
|---|---|---|---|
| 0 | 0 | load | TMA: K and V once; Q and dO per query block (``q``/``do`` pipelines), each stage with its block's LSE2 / Delta (Note [stats with their stage]) |
| 0 | 1 | dq-store | "bulk" dQ: per query block one cp.reduce.async.bulk.add.f32 per MMA warpgroup's half of the SMEM dQ tile (Note [dQ SMEM handoff]) |
| 0 | 2-3 | idle | register donors (setmaxnreg down to ``regs_producer``) |
| 1, 2 | 4-11 | mma | S = Q K^T, dP = dO V^T, P, dS, dV += P^T dO, dK += dS^T Q, dQ = dS K |

The two MMA warpgroups split every GEMM in half: S and dP by key columns (warpgroup w owns
keys 64w .. 64w+63), dV and dK by key rows (the same keys, so P and the dK operand dS^T
never cross warpgroups), dQ by head-dim columns (this one reads all of dS; with tile_m 128
by query rows, Note [tile_m 128]; with tile_m 80 it is computed transposed, Note [dQ
transposed]). Head dims above 128 split dV and dK by columns instead
(Note [dK/dV by columns]).

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

Note [overlapped dK] (``overlap_dk``, unswapped S/dP only): the iteration ends without
``wait_group(0)``, so dK of block i still runs when S and dP of block i+1 are issued and the
tensor cores go from one to the other without a gap. The ``wait_group(1)`` after dP of block
i+1 (groups retire in order) covers dK of block i, and only then is the ``q`` stage of block i
released (block i+1's Q must sit in another stage: ``q_stage >= 2``); after the loop
``wait_group(0)`` waits for the last dK. Note [dS double buffer] still holds: that
``wait_group(1)`` comes before ``DS_READY`` of block i+1. With ``sdp_swap_ab`` dK would read
dS^T from registers across the loop's back edge, and ptxas then serializes every WGMMA of the
kernel, hence the config rule.

Note [stats with their stage] (``stats_smem``): the exp2 needs LSE2 of the block's queries
right after the S GEMM, and dS needs Delta right after dP. Loaded from global memory in that
iteration, their latency sits on the critical path between the GEMMs and the pointwise math.
Instead the load warp bulk-copies each block's tile_m values of LSE2 (Delta) into a per-stage
SMEM slot next to the Q (dO) TMA, on the same mbarrier, whose transaction count includes
them; the MMA warpgroups have waited on that stage anyway, and the slot is released with it.

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
  results, and lost 3.4%).
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
the mask by limits (``_mask``) that kernel fits with the token (the compile test), and a
paired timing there was a tie, so it is on everywhere.

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
multicast]. Clusters of 4 measured slower than pairs on the H100 (backward 4.5-7%, forward
6.5-8%).

Note [Varlen backward] (``varlen``; ``sm90_bwd_varlen``): packed sequences (Note [Varlen] in
fwd_kernel.py) on the padded batch's grid (key blocks of max_seqlen_k, heads, sequences), one
CTA per tile. Each CTA reads its sequence's first rows and lengths from cu_seqlens
(``fa_sm100.varlen.sequence_rows``) and sees the packed tensors from that row at batch index
``seq``, so every role indexes them as a padded batch; the workspace is the padded batch
itself. Query rows past the end carry LSE2 = +inf (P = 0), keys past it are masked by the
sequence's own seqlen_k, MHA dK/dV are stored row by row below it, a key block past the keys
visits no query block; keys past ``seqused_k`` are zeroed by the host first. The switches that
read other tiles' lengths are off (``VARLEN_FIXED``). docs/varlen.md, "The backward".

dQ is accumulated in float32 in global memory by one of two switchable paths (``dq_accum``);
the load warp is in ``bwd_load.py`` (``BwdLoadRole``); the stores of dQ, dK and dV are in
``bwd_store.py`` (``BwdStoreRole``, with Note [dQ SMEM handoff]); the per-element math
(statistics, mask, P, dS) is in ``bwd_scores.py`` (``BwdScoresRole``).

"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_helpers
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.utils import LayoutEnum

from fa_sm100.config import WARP_SIZE, cutlass_dtype
from fa_sm100.hopper import probes
from fa_sm100.hopper.bwd_config import TILE_SLOTS, BwdConfig
from fa_sm100.hopper.bwd_load import BwdLoadRole
from fa_sm100.hopper.bwd_scores import BwdScoresRole
from fa_sm100.hopper.bwd_store import BwdStoreRole, dq_tile_shape, dq_tiled_mma, tile_counter
from fa_sm100.hopper.bwd_tiles import BwdTileRole, TileWalk, longest_first_tail_pairs
from fa_sm100.hopper.common import NO_WAIT, rows_cols_view, transpose_view, wgmma
from fa_sm100.hopper.config import SMEM_ALIGN, WARPGROUP_THREADS, WGMMA_M
from fa_sm100.hopper.fwd_math import convert_to, operand_a_view
from fa_sm100.hopper.named_barriers import Sm90BwdBarrier
from fa_sm100.softmax_math import LOG2_E
from fa_sm100.varlen import sequence_rows

# Warpgroup 0 (warps 0-3) is the producer warpgroup; warpgroups 1 and 2 run the MMAs.
PRODUCER_WARPS = WARPGROUP_THREADS // WARP_SIZE
LOAD_WARP = 0
DQ_STORE_WARP = 1  # "bulk" dQ only
PS_ATOM_COLS = 64  # key columns of one P / dS swizzle atom row (128 bytes)


class Sm90FlashBackward(BwdTileRole, BwdLoadRole, BwdStoreRole, BwdScoresRole):
    """Builds and launches the main backward kernel for one ``BwdConfig``."""

    def __init__(self, cfg: BwdConfig):
        self.cfg = cfg.validate()
        self.dtype = cutlass_dtype(cfg.dtype)
        self.tile_m, self.tile_n = cfg.tile_m, cfg.tile_n
        self.hdim, self.hdimv = cfg.head_dim, cfg.head_dim_v
        self.num_mma_threads = WARPGROUP_THREADS * cfg.num_mma_warpgroups
        self.num_threads = cfg.threads_per_cta

    # ---- layouts and MMAs (trace time) ---------------------------------------------------

    def _smem_layout(self, rows: int, cols: int, stage, major_size: int):
        kind = sm90_helpers.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, self.dtype, major_size)
        atom = warpgroup.make_smem_layout_atom(kind, self.dtype)
        if stage is None:
            return cute.tile_to_shape(atom, (rows, cols), order=(0, 1))
        return cute.tile_to_shape(atom, (rows, cols, stage), order=(0, 1, 2))

    def _setup_layouts(self):
        c = self.cfg
        # Q and dO serve as K-major A (S, dP) and as MN-major B (dK, dV) over the whole head
        # dim, or over head-dim halves (Note [dK/dV by columns]: each half whole swizzle atoms).
        split = 2 if c.dkv_split_cols else 1
        self.sQ_layout = self._smem_layout(self.tile_m, self.hdim, c.q_stage, self.hdim // split)
        self.sdO_layout = self._smem_layout(self.tile_m, self.hdimv, c.do_stage,
                                            self.hdimv // split)
        # K is also the MN-major B of dQ, split by head-dim columns over the two warpgroups
        # (tile_m 64), or read whole by both (tile_m 128, dQ split by query rows); with tile_m
        # 80 K^T is dQ^T's MN-major A, split by head-dim halves (Note [dQ transposed]).
        k_major = self.hdim if c.dq_split_rows else self.hdim // 2
        self.sK_layout = self._smem_layout(self.tile_n, self.hdim, None, k_major)
        self.sV_layout = self._smem_layout(self.tile_n, self.hdimv, None, self.hdimv)
        # P and dS: 64 key columns form one 128-byte swizzle atom row (one warpgroup's keys, or
        # with tile_n 64 both). With sdp_swap_ab P stays in registers and has no buffer.
        self.sP_layout = None
        if c.p_stage:
            self.sP_layout = self._smem_layout(self.tile_m, self.tile_n, c.p_stage, PS_ATOM_COLS)
        self.sdS_layout = self._smem_layout(self.tile_m, self.tile_n, c.ds_stage, PS_ATOM_COLS)

    def _tiled_mmas(self):
        """The tiled WGMMAs of S and dP, dK, dV and dQ."""
        K, MN = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        mma_dq = dq_tiled_mma(self.cfg, self.dtype)
        if self.cfg.sdp_swap_ab:
            # S^T = K Q^T and dP^T = V dO^T: (tile_n, tile_m), warpgroups stacked along M (keys).
            mma_sdp = sm90_helpers.make_trivial_tiled_mma(
                self.dtype, self.dtype, K, K, Float32, (2, 1, 1), (WGMMA_M, self.tile_m))
            # dV = P^T dO and dK = dS^T Q with P^T, dS^T from registers (an RS A is K-major).
            mma_dk, mma_dv = (sm90_helpers.make_trivial_tiled_mma(
                self.dtype, self.dtype, K, MN, Float32, (2, 1, 1), (WGMMA_M, cols),
                a_source=warpgroup.OperandSource.RMEM) for cols in (self.hdim, self.hdimv))
            return mma_sdp, mma_dk, mma_dv, mma_dq
        # S = Q K^T and dP = dO V^T: (tile_m, tile_n), warpgroups side by side along N.
        mma_sdp = sm90_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, K, K, Float32, (1, 2, 1), (WGMMA_M, self.tile_n // 2))
        # dK = dS^T Q and dV = P^T dO: (tile_n, hdim), warpgroups stacked along M (keys), or
        # side by side along N (Note [dK/dV by columns]).
        if self.cfg.dkv_split_cols:
            atoms, split = (1, 2, 1), 2
        else:
            atoms, split = (2, 1, 1), 1
        mma_dk, mma_dv = (sm90_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, MN, MN, Float32, atoms, (WGMMA_M, cols // split))
            for cols in (self.hdim, self.hdimv))
        return mma_sdp, mma_dk, mma_dv, mma_dq

    def _shared_storage(self):
        c = self.cfg
        buf = lambda layout: cute.struct.Align[
            cute.struct.MemRange[self.dtype, cute.cosize(layout)], SMEM_ALIGN]

        @cute.struct
        class SharedStorage:
            # K/V full; with persistent CTAs also K/V empty (Note [persistent CTAs], bwd_tiles.py)
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 1 + int(c.persistent_ctas > 0)]
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2 * c.q_stage]
            mbar_do: cute.struct.MemRange[cutlass.Int64, 2 * c.do_stage]
            if c.dynamic_tiles:  # Note [dynamic tiles] (bwd_tiles.py): full, then empty
                mbar_tile: cute.struct.MemRange[cutlass.Int64, 2 * TILE_SLOTS]
                tile_slots: cute.struct.MemRange[Int32, TILE_SLOTS]
            sQ: buf(self.sQ_layout)
            sdO: buf(self.sdO_layout)
            sK: buf(self.sK_layout)
            sV: buf(self.sV_layout)
            if c.p_stage:
                sP: buf(self.sP_layout)
            sdS: buf(self.sdS_layout)
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, self._sdq_elems()], SMEM_ALIGN]
            if c.stats_smem:  # bulk-copy destinations: 16-byte alignment is the rule
                sLSE2: cute.struct.Align[cute.struct.MemRange[Float32, self.tile_m * c.q_stage], 128]
                sDelta: cute.struct.Align[cute.struct.MemRange[Float32, self.tile_m * c.do_stage], 128]

        return SharedStorage

    def _sdq_elems(self) -> int:
        """Float32 elements of the SMEM dQ tile: the whole tile for "bulk" (Note [dQ in
        fragment order]); "red" stages nothing and keeps a 16-byte placeholder (the struct
        field needs a size)."""
        if self.cfg.dq_accum == "bulk":
            return self.cfg.dq_block_elems
        return 4

    # ---- host entry ------------------------------------------------------------------------

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (batch, seqlen_q, heads, hdim)
        mK: cute.Tensor,  # (batch, seqlen_k, heads_kv, hdim)
        mV: cute.Tensor,  # (batch, seqlen_k, heads_kv, hdimv)
        mdO: cute.Tensor,  # (batch, seqlen_q, heads, hdimv)
        mLSE2: cute.Tensor,  # (batch, heads, seqlen_q_pad) f32, log2 units, +inf on padding
        mDelta: cute.Tensor,  # (batch, heads, seqlen_q_pad) f32, rowsum(O * dO)
        mdQacc: cute.Tensor,  # (batch, heads, m_blocks, tile_m * hdim) f32, fragment order
        mdK: cute.Tensor,  # MHA: (batch, seqlen_k, heads, hdim) dtype; GQA: f32 (batch, h, seqlen_k_pad, hdim)
        mdV: cute.Tensor,
        mdQsem: cute.Tensor,  # (batch, heads, BwdConfig.dq_sem_slots) i32, zeroed
        softmax_scale: Float32,
        softcap: Float32,  # the cap, read only with cfg.softcap
        window_left: Int32,  # the band's run-time bounds (fa_sm100.bands.kernel_window), read
        window_right: Int32,  # only with a window (cfg.is_local)
        mCuSeqlensQ,  # varlen (Note [Varlen backward]): (sequences + 1,) int32 offsets, else None
        mCuSeqlensK,
        mSeqUsedK,  # varlen: (sequences,) int32 used key lengths, or None
        max_seqlen_k: Int32,  # varlen: the grid's key blocks cover this many keys
        stream,
    ):
        self._setup_layouts()
        mma_sdp, mma_dk, mma_dv, mma_dq = self._tiled_mmas()
        SharedStorage = self._shared_storage()
        # (b, s, h, d) -> (s, d, h, b) so the TMA tile is (rows, head dim)
        to_sdhb = lambda t: cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0]))
        mQ_t, mK_t, mV_t, mdO_t = [to_sdhb(t) for t in (mQ, mK, mV, mdO)]
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        # Note [Q/dO multicast]: each CTA of the cluster loads 1/qdo_cluster of a Q / dO tile
        qdo_ctas = self.cfg.cluster[0]
        qdo_op = cpasync.CopyBulkTensorTileG2SMulticastOp() if self.cfg.qdo_multicast else g2s
        tma_Q, tma_mQ = cpasync.make_tiled_tma_atom(
            qdo_op, mQ_t, cute.select(self.sQ_layout, mode=[0, 1]), (self.tile_m, self.hdim),
            qdo_ctas)
        tma_dO, tma_mdO = cpasync.make_tiled_tma_atom(
            qdo_op, mdO_t, cute.select(self.sdO_layout, mode=[0, 1]), (self.tile_m, self.hdimv),
            qdo_ctas)
        tma_K, tma_mK = cpasync.make_tiled_tma_atom(
            g2s, mK_t, self.sK_layout, (self.tile_n, self.hdim))
        tma_V, tma_mV = cpasync.make_tiled_tma_atom(
            g2s, mV_t, self.sV_layout, (self.tile_n, self.hdimv))
        # MHA dK/dV leave through SMEM (K's and V's buffers) by TMA (Note [dK/dV by TMA])
        tma_dK = tma_mdK = tma_dV = tma_mdV = None
        if const_expr(self.cfg.stores_dkv_by_tma):
            s2g = cpasync.CopyBulkTensorTileS2GOp()
            tma_dK, tma_mdK = cpasync.make_tiled_tma_atom(
                s2g, to_sdhb(mdK), self.sK_layout, (self.tile_n, self.hdim))
            tma_dV, tma_mdV = cpasync.make_tiled_tma_atom(
                s2g, to_sdhb(mdV), self.sV_layout, (self.tile_n, self.hdimv))
        self.bytes_q = self.tile_m * self.hdim * self.dtype.width // 8
        self.bytes_do = self.tile_m * self.hdimv * self.dtype.width // 8
        self.bytes_kv = self.tile_n * (self.hdim + self.hdimv) * self.dtype.width // 8
        num_n_blocks = cute.ceil_div(mK.shape[1], self.tile_n)
        num_batch = mQ.shape[0]
        varlen = None
        if const_expr(self.cfg.varlen):  # Note [Varlen backward]: a grid over the longest
            num_n_blocks = cute.ceil_div(max_seqlen_k, self.tile_n)
            num_batch = mLSE2.shape[0]
            varlen = (mCuSeqlensQ, mCuSeqlensK, mSeqUsedK)
        num_pairs = num_batch * mQ.shape[2]
        tail_pairs = longest_first_tail_pairs(self.cfg, num_n_blocks, num_pairs, cutlass.min,
                                              cutlass.max)  # Note [longest first], bwd_tiles.py
        window = None  # only a windowed kernel takes the bounds as parameters
        if const_expr(self.cfg.is_local):
            window = (window_left, window_right)
        # Note [softcap in the backward]: P from t = tanh(raw S * softcap_k) with c log2(e)
        scale_log2 = softmax_scale * LOG2_E
        softcap_k = None
        if const_expr(self.cfg.softcap):
            softcap_k = softmax_scale / softcap
            scale_log2 = softcap * LOG2_E
        self.kernel(
            tma_mQ, tma_mK, tma_mV, tma_mdO, tma_Q, tma_K, tma_V, tma_dO,
            mLSE2, mDelta, mdQacc, mdK, mdV, mdQsem, tma_dK, tma_mdK, tma_dV, tma_mdV,
            mQ.shape[1], mK.shape[1], mQ.shape[2] // mK.shape[2], tail_pairs, window, varlen,
            softmax_scale, scale_log2, softcap_k,
            mma_sdp, mma_dk, mma_dv, mma_dq,
            self.sQ_layout, self.sdO_layout, self.sK_layout, self.sV_layout,
            self.sP_layout, self.sdS_layout, SharedStorage,
        ).launch(
            grid=self._grid(num_n_blocks, mQ.shape[2], num_batch),
            block=[self.num_threads, 1, 1],
            stream=stream,
            min_blocks_per_mp=1,  # register count at entry known: ptxas keeps setmaxnreg
            use_pdl=self.cfg.pdl,  # Note [chained launches] in bwd_interface.py
            **({"cluster": list(self.cfg.cluster)} if self.cfg.qdo_multicast else {}),
        )

    # ---- kernel: shared storage, registers, role dispatch ------------------------------------

    @cute.kernel
    def kernel(
        self, mQ, mK, mV, mdO, tma_Q, tma_K, tma_V, tma_dO,
        mLSE2, mDelta, mdQacc, mdK, mdV, mdQsem, tma_dK, tma_mdK, tma_dV, tma_mdV,
        seqlen_q: Int32, seqlen_k: Int32, group: Int32, tail_pairs: Int32, window, varlen,
        softmax_scale: Float32, scale_log2: Float32, softcap_k,
        mma_sdp: cute.TiledMma, mma_dk: cute.TiledMma, mma_dv: cute.TiledMma,
        mma_dq: cute.TiledMma,
        sQ_layout: cute.ComposedLayout, sdO_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
        sP_layout: cute.ComposedLayout, sdS_layout: cute.ComposedLayout,
        SharedStorage: cutlass.Constexpr,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        self.band = self._band(window)
        self.softcap_k = softcap_k  # None without softcap
        if const_expr(self.cfg.early_dq_post):
            # Note [dQ postprocess in the tail] (bwd_prepost.py): once every CTA has started,
            # the dQ postprocess may take the SMs the last wave leaves idle
            cute.arch.griddepcontrol_launch_dependents()
        if warp_idx == LOAD_WARP:
            for atom in (tma_Q, tma_K, tma_V, tma_dO):
                cpasync.prefetch_descriptor(atom)
        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        mbar_kv = storage.mbar_kv.data_ptr()
        if warp_idx == LOAD_WARP:
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(mbar_kv, 1)
                if const_expr(self.cfg.persistent_ctas):  # K/V empty: one MMA thread arrives
                    cute.arch.mbarrier_init(mbar_kv + 1, 1)
                if const_expr(self.cfg.dynamic_tiles):  # Note [dynamic tiles] (bwd_tiles.py)
                    self._init_tile_handoff(storage.mbar_tile.data_ptr())
        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread)
        # consumer_release arrives once per warp (lane 0): 8 MMA warps, in each CTA of the
        # cluster under qdo_multicast (Note [Q/dO multicast]).
        qdo_ctas = self.cfg.cluster[0]
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                              qdo_ctas * self.num_mma_threads // WARP_SIZE)
        cluster = cute.make_layout((1, qdo_ctas, 1, 1))  # (V, M, N, K)
        # with stats_smem each Q (dO) stage also carries the block's LSE2 (Delta)
        stat_bytes = self.tile_m * 4 if const_expr(self.cfg.stats_smem) else 0
        pipe_q = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_q.data_ptr(), num_stages=self.cfg.q_stage,
            producer_group=producer, consumer_group=consumers, tx_count=self.bytes_q + stat_bytes,
            cta_layout_vmnk=cluster, mcast_mode_mn=(0, 1), defer_sync=True)
        pipe_do = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_do.data_ptr(), num_stages=self.cfg.do_stage,
            producer_group=producer, consumer_group=consumers, tx_count=self.bytes_do + stat_bytes,
            cta_layout_vmnk=cluster, mcast_mode_mn=(0, 1),
            defer_sync=False)  # fences the mbarrier inits and syncs the CTA (the cluster)

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sdO.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sP = None
        if const_expr(self.cfg.p_stage):
            sP = storage.sP.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)
        sdS = storage.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)
        sdQ = storage.sdQ.get_tensor(cute.make_layout(self._sdq_elems()))
        sLSE2 = sDelta = None
        if const_expr(self.cfg.stats_smem):
            sLSE2 = storage.sLSE2.get_tensor(cute.make_layout((self.tile_m, self.cfg.q_stage)))
            sDelta = storage.sDelta.get_tensor(cute.make_layout((self.tile_m, self.cfg.do_stage)))

        if const_expr(self.cfg.persistent_ctas):  # Note [persistent CTAs], bwd_tiles.py
            work = TileWalk(cute.arch.block_idx()[0], cute.arch.grid_dim()[0],
                            mQ.shape[3] * mQ.shape[2], mQ.shape[2], seqlen_q, seqlen_k,
                            self.cfg.num_key_blocks(seqlen_k))
            if const_expr(self.cfg.dynamic_tiles):  # Note [dynamic tiles], bwd_tiles.py
                work.fetch_from(tail_pairs, tile_counter(self.cfg, mdQsem),
                                storage.tile_slots.get_tensor(cute.make_layout(TILE_SLOTS)),
                                storage.mbar_tile.data_ptr())
        else:
            if const_expr(varlen is not None):  # Note [Varlen backward]: this CTA's sequence
                seq = cute.arch.block_idx()[2]
                # the TMA views are (s, d, h, b), the MHA dK / dV (b, s, h, d)
                mQ, mdO, seqlen_q = sequence_rows(varlen[0], None, seq, (mQ, 0, 3), (mdO, 0, 3))
                mK, mV, seqlen_k = sequence_rows(varlen[1], varlen[2], seq, (mK, 0, 3), (mV, 0, 3))
                if const_expr(not self.cfg.uses_gqa_buffers):
                    mdK, mdV, _ = sequence_rows(varlen[1], None, seq, (mdK, 1, 0), (mdV, 1, 0))
            work = self._cta_tile(qdo_ctas, tail_pairs, seqlen_q, seqlen_k)
        if warp_idx < PRODUCER_WARPS:
            cute.arch.setmaxregister_decrease(self.cfg.regs_producer)
            if warp_idx == LOAD_WARP:
                self.load(mQ, mK, mV, mdO, tma_Q, tma_K, tma_V, tma_dO, sQ, sK, sV, sdO,
                          mLSE2, mDelta, sLSE2, sDelta, mdQsem, mbar_kv, pipe_q, pipe_do,
                          work, group)
            if const_expr(self.cfg.dq_accum == "bulk"):
                if warp_idx == DQ_STORE_WARP:
                    self.dq_store(mdQacc, mdQsem, sdQ, mLSE2, work, seqlen_q, seqlen_k)
        else:
            cute.arch.setmaxregister_increase(self.cfg.regs_mma)
            # Note [chained launches]: the preprocess is done. With pre_ctas the warpgroups
            # read nothing it writes (LSE2 / Delta come with the load warp's stages)
            if const_expr(self.cfg.pdl and not self.cfg.pre_ctas):
                cute.arch.griddepcontrol_wait()
            self.mma(mma_sdp, mma_dk, mma_dv, mma_dq, sQ, sK, sV, sdO, sP, sdS, sdQ, sLSE2, sDelta,
                     mLSE2, mDelta, mdQacc, (mdK, mdV, tma_dK, tma_mdK, tma_dV, tma_mdV),
                     mdQsem, mbar_kv, pipe_q, pipe_do, tidx - WARPGROUP_THREADS, work, group,
                     seqlen_q, seqlen_k, softmax_scale, scale_log2,
                     self._epilogue_staging(storage, sK, sV, sK_layout, sV_layout))

    def _epilogue_staging(self, storage, sK, sV, sK_layout, sV_layout):
        """Where the dK / dV epilogue stages its tiles for the TMA stores (Note [dK/dV by
        TMA]): K's and V's buffers; with persistent CTAs the dS buffers and the SMEM dQ tile,
        so that the next tile's K and V can load meanwhile (Note [persistent CTAs])."""
        if const_expr(not self.cfg.persistent_ctas):
            return sK, sV
        return (storage.sdS.get_tensor(sK_layout.outer, swizzle=sK_layout.inner),
                storage.sdQ.get_tensor(sV_layout.outer, swizzle=sV_layout.inner,
                                       dtype=self.dtype))

    # ---- MMA role ------------------------------------------------------------------------

    @cute.jit
    def mma(self, mma_sdp, mma_dk, mma_dv, mma_dq, sQ, sK, sV, sdO, sP, sdS, sdQ, sLSE2, sDelta,
            mLSE2, mDelta, mdQacc, dkv_out, mdQsem, mbar_kv, pipe_q, pipe_do,
            tidx, work, group, seqlen_q, seqlen_k, softmax_scale, scale_log2, staging):
        """Warpgroups 1-2: ``_mma_tile`` for this CTA's tile, or with persistent CTAs for each
        tile of its walk (Note [persistent CTAs]), the ``q`` / ``do`` states carried from one
        to the next."""
        state_q = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.cfg.q_stage)
        state_do = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.cfg.do_stage)
        args = (mma_sdp, mma_dk, mma_dv, mma_dq, sQ, sK, sV, sdO, sP, sdS, sdQ, sLSE2, sDelta,
                mLSE2, mDelta, mdQacc, dkv_out, mdQsem, mbar_kv, pipe_q, pipe_do, tidx, group,
                seqlen_q, seqlen_k, softmax_scale, scale_log2, staging)
        self._walk(work, self._mma_tile, args, (state_q, state_do))

    @cute.jit
    def _mma_tile(self, mma_sdp, mma_dk, mma_dv, mma_dq, sQ, sK, sV, sdO, sP, sdS, sdQ, sLSE2,
                  sDelta, mLSE2, mDelta, mdQacc, dkv_out, mdQsem, mbar_kv, pipe_q, pipe_do, tidx,
                  group, seqlen_q, seqlen_k, softmax_scale, scale_log2, staging, tile, k,
                  state_q, state_do):
        """One tile (``BwdTile``) of warpgroups 1-2 (``tidx`` 0..255 here). Per query block m:
        wait ``q``, ``do``; S, dP (WGMMA); P = exp2(S * scale_log2 - LSE2) with the band mask;
        dS = P (dP - Delta); P, dS -> SMEM; ``DS_READY``; dV += P^T dO, dK += dS^T Q,
        dQ = dS K; release ``q``, ``do``; dQ -> global float32 (atomic, or in n_block order when
        deterministic). After the last block: dK *= scale, then dK, dV -> global.

        With ``sdp_swap_ab`` (Note [swapped S/dP]) the S and dP accumulators hold S^T and dP^T,
        P^T and dS^T stay in registers as the A operands of dV and dK, and only dS^T goes to
        SMEM (transposed, into the dS image that dQ reads).

        ``k``: which of the CTA's tiles this is (0 without persistent CTAs), for the phase of
        K/V's barrier; ``staging``: where the epilogue stages dK and dV. Returns the advanced
        ``q`` / ``do`` states."""
        n_block, head, batch, m_offset = tile.n_block, tile.head, tile.batch, tile.m_offset
        m_block_first, m_block_min, m_block_max = (tile.m_block_first, tile.m_block_min,
                                                   tile.m_block_max)
        swap = self.cfg.sdp_swap_ab
        wide = self.cfg.wide_query_block  # tile_m 80 / 128 (swapped only): Note [tile_m 128]
        late_p = wide and not self.cfg.early_dv  # P^T converted after dS
        ds_from_p16 = wide and self.cfg.early_dv  # dS = P^T (16 bits) (dP^T - Delta)
        stats_first = self.cfg.stats_first and not wide  # wide blocks read the stats later
        lse_early = wide and self.cfg.lse_early
        dv_mid = self.cfg.dv_before_barrier  # validate(): only without early_dv
        p_staged = self.cfg.p_stage > 1  # Note [dK/dV by columns]: P double-buffered like dS
        wg = cute.arch.make_warp_uniform(tidx // WARPGROUP_THREADS)
        wg_thread = wg * WARPGROUP_THREADS
        thr_sdp = mma_sdp.get_slice(tidx)
        wg_sdp, wg_dk, wg_dv, wg_dq = (m.get_slice(wg_thread)
                                       for m in (mma_sdp, mma_dk, mma_dv, mma_dq))
        # operand fragments (SMEM descriptors); the Q/dO ones carry a stage mode
        tSrQ, tSrK = self._sdp_fragments(mma_sdp, wg_sdp, sQ, sK)
        tdPrdO, tdPrV = self._sdp_fragments(mma_sdp, wg_sdp, sdO, sV)
        tdVrdOt = mma_dv.make_fragment_B(wg_dv.partition_B(transpose_view(sdO)))
        tdKrQt = mma_dk.make_fragment_B(wg_dk.partition_B(transpose_view(sQ)))
        if const_expr(self.cfg.dq_swap_ab):  # Note [dQ transposed]: dQ^T = K^T dS^T
            tdQrKt = mma_dq.make_fragment_A(wg_dq.partition_A(transpose_view(sK)))
            tdQrdS = mma_dq.make_fragment_B(wg_dq.partition_B(sdS))  # (..., DS_STAGE)
        else:
            tdQrdS = mma_dq.make_fragment_A(wg_dq.partition_A(sdS))  # (..., DS_STAGE)
            tdQrKt = mma_dq.make_fragment_B(wg_dq.partition_B(transpose_view(sK)))
        # accumulators
        acc_dV = cute.make_rmem_tensor(mma_dv.partition_shape_C((self.tile_n, self.hdimv)), Float32)
        acc_dK = cute.make_rmem_tensor(mma_dk.partition_shape_C((self.tile_n, self.hdim)), Float32)
        acc_dV.fill(0.0)
        acc_dK.fill(0.0)
        # P / dS register -> SMEM copies (stmatrix); swapped, dS^T is stored transposed
        st_atom = cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=swap, num_matrices=4), self.dtype)
        st_copy = cute.make_tiled_copy_C(st_atom, mma_sdp)
        st_thr = st_copy.get_slice(tidx)
        sdp_shape = (self.tile_m, self.tile_n)
        if const_expr(swap):
            sdp_shape = (self.tile_n, self.tile_m)
            tdSsdS = st_thr.partition_D(transpose_view(sdS))
        else:
            tdVrPt = mma_dv.make_fragment_A(wg_dv.partition_A(transpose_view(sP)))
            tdKrdSt = mma_dk.make_fragment_A(wg_dk.partition_A(transpose_view(sdS)))
            tPsP = st_thr.partition_D(sP)
            tdSsdS = st_thr.partition_D(sdS)
        # this thread's S coordinates in the tile: (query, key); swapped (key, query)
        tScS = rows_cols_view(thr_sdp.partition_C(cute.make_identity_tensor(sdp_shape)))
        # thread 0's coordinates: compile-time, for Note [tile_m 128]
        tScS0 = rows_cols_view(
            mma_sdp.get_slice(0).partition_C(cute.make_identity_tensor(sdp_shape)))

        cute.arch.mbarrier_wait(mbar_kv, k % 2)
        mLSE2_cur = mLSE2[batch, head, None]
        mDelta_cur = mDelta[batch, head, None]
        if const_expr(self.cfg.qdo_multicast and self.cfg.causal):
            # Note [Q/dO multicast]: the cluster's query blocks before this CTA's first are
            # loaded for the lower key blocks of the cluster; wait for each and release it
            for _ in cutlass.range(m_block_first, m_block_min, unroll=1):
                pipe_q.consumer_wait(state_q)
                pipe_q.consumer_release(state_q)
                pipe_do.consumer_wait(state_do)
                pipe_do.consumer_release(state_do)
                state_q.advance()
                state_do.advance()
        if const_expr(self.cfg.overlap_dk):
            state_q_prev = state_q.clone()  # the stage the previous block's dK reads
        for step in cutlass.range(m_block_min, self._sweep_end(m_block_min, m_block_max),
                                  unroll=1):
            m_block = self._m_block_at(step, m_offset, m_block_min, m_block_max)
            ds_idx = (step - m_block_min) % 2
            # S = Q K^T, dP = dO V^T (swapped: S^T = K Q^T, dP^T = V dO^T)
            self._consumer_wait(pipe_q, state_q)
            lse_block = self._stat_block(mLSE2_cur, sLSE2, m_block, state_q.index)
            if const_expr(stats_first):  # Note [stats before the GEMMs]
                lse = self._query_stats(lse_block, thr_sdp, sdp_shape, tScS)
            acc_S = cute.make_rmem_tensor(mma_sdp.partition_shape_C(sdp_shape), Float32)
            self._sdp_gemm(mma_sdp, acc_S, tSrQ[None, None, None, state_q.index], tSrK)
            if const_expr(lse_early):  # Note [dP wait placement]: LSE2 loads while S^T runs
                lse = self._query_stats(lse_block, thr_sdp, sdp_shape, tScS)
            self._consumer_wait(pipe_do, state_do)
            delta_block = self._stat_block(mDelta_cur, sDelta, m_block, state_do.index)
            if const_expr(stats_first):
                dpsum = self._query_stats(delta_block, thr_sdp, sdp_shape, tScS)
            acc_dP = cute.make_rmem_tensor(mma_sdp.partition_shape_C(sdp_shape), Float32)
            self._sdp_gemm(mma_sdp, acc_dP, tdPrdO[None, None, None, state_do.index], tdPrV)
            S = rows_cols_view(acc_S)
            dP = rows_cols_view(acc_dP)
            if const_expr(not stats_first and not lse_early):
                lse = self._block_stats(lse_block, thr_sdp, sdp_shape, tScS)
                if const_expr(not wide):  # wide blocks read Delta after P (below)
                    dpsum = self._query_stats(delta_block, thr_sdp, sdp_shape, tScS)
            warpgroup.wait_group(1)  # S done (Note [overlapped dK]: so is the previous dK)
            if const_expr(self.cfg.overlap_dk):
                if step > m_block_min:
                    pipe_q.consumer_release(state_q_prev)
            pointwise = probes.active("pointwise") != "none"  # Note [cost probes]
            softcap = self.cfg.softcap
            if const_expr(pointwise):
                if const_expr(softcap):  # t = tanh(S * softcap_k), kept in S until dS
                    self._softcap_rows(S, self.softcap_k)
                if self._block_needs_mask(m_block, n_block, seqlen_q, seqlen_k):
                    self._mask(S, tScS, tScS0, m_block, n_block, seqlen_q, seqlen_k)
                if const_expr(not softcap):
                    self._exp2_rows(S, lse, scale_log2, tScS0, m_block, seqlen_q)
            if const_expr(wide):  # Delta after P: its registers never live beside LSE2's
                dpsum = self._block_stats(delta_block, thr_sdp, sdp_shape, tScS)
            rP = cute.make_fragment_like(acc_S, self.dtype)
            if const_expr(softcap):  # P straight into 16 bits; S keeps t (tile_m 64 only)
                if const_expr(pointwise):
                    self._softcap_p(rP, acc_S, S, lse, scale_log2, tScS0)
                if const_expr(not swap):
                    cute.copy(st_copy, st_thr.retile(rP),
                              tPsP[None, None, None, ds_idx if p_staged else 0])
                    tdVrPt_cur = tdVrPt[None, None, None, ds_idx if p_staged else 0]
                else:
                    tdVrPt_cur = operand_a_view(rP)
            elif const_expr(not swap):
                rP.store(acc_S.load().to(self.dtype))
                p_idx = ds_idx if p_staged else 0
                cute.copy(st_copy, st_thr.retile(rP), tPsP[None, None, None, p_idx])
                tdVrPt_cur = tdVrPt[None, None, None, p_idx]
            elif const_expr(not late_p):
                convert_to(rP, acc_S)  # whole registers: the A operand of dV as it is
                tdVrPt_cur = operand_a_view(rP)
            if const_expr(self.cfg.early_dv):
                # Note [early dV]: P is this warpgroup's own; dV runs while dS is computed.
                if const_expr(not swap):
                    cute.arch.fence_view_async_shared()
                    cute.arch.barrier(barrier_id=int(Sm90BwdBarrier.P_READY_WG0) + wg,
                                      number_of_threads=WARPGROUP_THREADS)
                wgmma(mma_dv, acc_dV, tdVrPt_cur, tdVrdOt[None, None, None, state_do.index], False,
                      NO_WAIT)
                warpgroup.wait_group(1)  # dP done; dV may still run
            else:
                warpgroup.wait_group(0)
            if const_expr(pointwise and softcap):
                self._ds_rows(dP, rows_cols_view(rP), dpsum, tScS0, capped=S)
            elif const_expr(pointwise):
                self._ds_rows(dP, rows_cols_view(rP) if const_expr(ds_from_p16) else S, dpsum,
                              tScS0)
            rdS = cute.make_fragment_like(acc_dP, self.dtype)
            if const_expr(swap):
                convert_to(rdS, acc_dP)
                tdKrdSt_cur = operand_a_view(rdS)
            else:
                rdS.store(acc_dP.load().to(self.dtype))
                tdKrdSt_cur = tdKrdSt[None, None, None, ds_idx]
            if const_expr(late_p):
                convert_to(rP, acc_S)  # Note [tile_m 128]: only now, S^T is dead after this
                tdVrPt_cur = operand_a_view(rP)
            cute.copy(st_copy, st_thr.retile(rdS), tdSsdS[None, None, None, ds_idx])
            dv_pre_fence = dv_mid and swap and self.cfg.dv_before_fence
            if const_expr(dv_pre_fence):  # Note [dV before the fence]
                wgmma(mma_dv, acc_dV, tdVrPt_cur, tdVrdOt[None, None, None, state_do.index], False,
                      NO_WAIT)
            cute.arch.fence_view_async_shared()
            if const_expr(dv_mid and not dv_pre_fence):  # Note [dV before the dS barrier]
                if const_expr(not swap):  # P in SMEM: this warpgroup's stores are done
                    cute.arch.barrier(barrier_id=int(Sm90BwdBarrier.P_READY_WG0) + wg,
                                      number_of_threads=WARPGROUP_THREADS)
                wgmma(mma_dv, acc_dV, tdVrPt_cur, tdVrdOt[None, None, None, state_do.index], False,
                      NO_WAIT)
            if const_expr(probes.active("ds_barrier") != "none"):  # Note [cost probes]
                cute.arch.barrier(barrier_id=int(Sm90BwdBarrier.DS_READY),
                                  number_of_threads=self.num_mma_threads)
            # dV += P^T dO (unless issued before), dQ = dS K, dK += dS^T Q; groups retire in order
            if const_expr(not self.cfg.early_dv and not dv_mid):
                wgmma(mma_dv, acc_dV, tdVrPt_cur, tdVrdOt[None, None, None, state_do.index], False,
                      NO_WAIT)
            acc_dQ = cute.make_rmem_tensor(mma_dq.partition_shape_C(dq_tile_shape(self.cfg)),
                                           Float32)
            if const_expr(self.cfg.dq_swap_ab):
                wgmma(mma_dq, acc_dQ, tdQrKt, tdQrdS[None, None, None, ds_idx], True, NO_WAIT)
            else:
                wgmma(mma_dq, acc_dQ, tdQrdS[None, None, None, ds_idx], tdQrKt, True, NO_WAIT)
            wgmma(mma_dk, acc_dK, tdKrdSt_cur, tdKrQt[None, None, None, state_q.index], False,
                  NO_WAIT)
            warpgroup.wait_group(1)  # dV and dQ done, dK may still run
            pipe_do.consumer_release(state_do)
            if const_expr(self.cfg.dq_accum == "bulk"):
                self._stage_dq(acc_dQ, sdQ, tidx)
            else:
                self._store_dq(acc_dQ, mdQacc, mdQsem, tidx, m_block, n_block, head, batch,
                               seqlen_q, seqlen_k)
            if const_expr(self.cfg.overlap_dk):
                state_q_prev = state_q.clone()  # dK runs on behind the next S and dP
            else:
                warpgroup.wait_group(0)
                pipe_q.consumer_release(state_q)
            state_q.advance()
            state_do.advance()
        if const_expr(self.cfg.overlap_dk):
            warpgroup.wait_group(0)  # the last dK
            if m_block_max > m_block_min:
                pipe_q.consumer_release(state_q_prev)
        for i in cutlass.range_constexpr(cute.size(acc_dK)):  # dK = scale * dS^T Q
            acc_dK[i] = acc_dK[i] * softmax_scale
        mdK, mdV, tma_dK, tma_mdK, tma_dV, tma_mdV = dkv_out
        if const_expr(self.cfg.stores_dkv_by_tma):
            self._store_dkdv_tma(mma_dk, mma_dv, acc_dK, acc_dV, staging, tma_dK, tma_mdK,
                                 tma_dV, tma_mdV, tidx, n_block, head, batch, mbar_kv)
        else:
            self._store_dkdv(mma_dk, mma_dv, acc_dK, acc_dV, mdK, mdV, tidx, n_block, head, batch,
                             group, seqlen_k)
        return state_q, state_do

    @cute.jit
    def _consumer_wait(self, pipe, state):
        """Wait for a ``q`` / ``do`` stage (Note [try first])."""
        if const_expr(self.cfg.try_wait):
            pipe.consumer_wait(state, pipe.consumer_try_wait(state))
        else:
            pipe.consumer_wait(state)

    def _sdp_fragments(self, mma_sdp, wg_sdp, s_query, s_key):
        """WGMMA descriptors of a query-side (Q, dO) and a key-side (K, V) SMEM operand of
        S = Q K^T / dP = dO V^T: A and B, or B and A with ``sdp_swap_ab``. Returns them as
        (query side, key side)."""
        if self.cfg.sdp_swap_ab:
            return (mma_sdp.make_fragment_B(wg_sdp.partition_B(s_query)),
                    mma_sdp.make_fragment_A(wg_sdp.partition_A(s_key)))
        return (mma_sdp.make_fragment_A(wg_sdp.partition_A(s_query)),
                mma_sdp.make_fragment_B(wg_sdp.partition_B(s_key)))

    @cute.jit
    def _sdp_gemm(self, mma_sdp, acc, frag_query, frag_key):
        """Issue S = Q K^T (or dP = dO V^T) into ``acc``; with ``sdp_swap_ab`` its transpose."""
        if const_expr(self.cfg.sdp_swap_ab):
            wgmma(mma_sdp, acc, frag_key, frag_query, True, NO_WAIT)
        else:
            wgmma(mma_sdp, acc, frag_query, frag_key, True, NO_WAIT)
