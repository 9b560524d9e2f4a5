"""Frozen configuration of the Hopper (SM90) attention backward (``select_bwd_config`` in
bwd_defaults.py picks one per problem).

One compiled backward kernel per value of ``BwdConfig``. Problem-shaped fields (head dims,
dtype, causal, window, GQA ratio) are static; the rest are switches that the benchmark can
flip: tile sizes, pipeline depths, the GQA reduction strategy and the deterministic mode.

GQA/MQA reduction (``gqa_reduce``):
- ``"atomic"``: every query head adds its float32 dK/dV tile into one buffer per KV head
  with ``red.global.add.f32``; the postprocess converts it. Order of additions is not fixed.
- ``"buffers"``: every query head stores its own float32 dK/dV tile (no atomics); the
  postprocess sums the heads of a group in a fixed order. Bitwise reproducible; costs
  ``qhead_per_kvhead`` times the float32 dK/dV memory.
- ``"bulk"``: as ``"atomic"``, one buffer per KV head, but each warpgroup adds its rows with
  one bulk reduce from SMEM (Note [dK/dV by bulk reduces] in bwd_store.py).
docs/hopper_backward.md records which is faster and why the default is what it is.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from fa_sm100.bands import effective_bounds
from fa_sm100.config import DTYPES, check_register_budget, check_setmaxnreg
from fa_sm100.hopper.config import SM90_ARCH, WARPGROUP_THREADS, WGMMA_M
from fa_sm100.machines import HOPPER_SMS
from layouts.smem import SMEM_BUDGET, align_up

# (qk, v) head-dim pairs with a backward: those of the SM90 forward
SM90_BWD_HEAD_DIMS = ((64, 64), (96, 96), (128, 128), (192, 128), (256, 256))
# tile_n 128 keeps 64 key rows of dK and dV per warpgroup: up to this head dim (registers);
# larger head dims take tile_n 64, split by head-dim columns (Note [dK/dV by columns]), or 96
# with dK / dV transposed (Note [dK/dV transposed])
TILE_N_128_MAX_HEAD_DIM = 128
TILE_N_TRANSPOSED = 96  # keys per CTA that only dK / dV transposed allows (48 per warpgroup)
# float32 dK + dV accumulator registers per MMA thread that leave room for S, dP and dQ: the
# tile_n 128 rule at hdim 128, and what (192, 128) takes at tile_n 96
DKV_ACC_MAX_REGS = 128
GQA_REDUCE_MODES = ("atomic", "buffers", "bulk")
# Query rows per iteration of the swapped hdim-64 default (the only head dim 128 rows fit).
TILE_M_SWAPPED_HDIM64 = 128
DQ_ACCUM_MODES = ("bulk", "red")
QDO_CLUSTER = 2  # CTAs that share each Q / dO tile under qdo_multicast, by default
QDO_CLUSTERS = (2, 4)  # cluster sizes qdo_multicast accepts (qdo_cluster)
DQ_VEC = 4  # float32 per dQ-accumulator store: one 16-byte STS.128 / bulk-reduce element run
TILE_M_ATOM = 64  # query rows of one WGMMA M atom
TILE_M_128_HEAD_DIMS = (64,)  # head dims that fit tile_m = 128 (registers: docs/hopper_backward.md)
# 80 query rows (swapped S/dP, dQ computed transposed: Note [dQ transposed] in bwd_mma.py):
# hdim 128 only (dQ^T's M is the head dim, 64 rows per warpgroup)
TILE_M_DQ_TRANSPOSED = 80
TILE_M_80_HEAD_DIMS = (128,)
# Note [dynamic tiles] (bwd_tiles.py): the tile indices in flight from the load warp to the
# other roles (one being read, the next being written)
TILE_SLOTS = 2
# Note [dynamic tiles]: allowed up to this head dim: at hdim 128 the MMA warpgroups have no registers left
# for the fetched walk (ptxas spills 52-64 bytes, and with 80-row blocks serializes the WGMMAs)
DYNAMIC_TILES_MAX_HEAD_DIM = 96
SMEM_BUFFER_ALIGN = 1024  # every SMEM buffer of the kernel starts on a swizzle-atom boundary
SM90_SMEM_BYTES = SMEM_BUDGET[SM90_ARCH]  # 227 KiB of dynamic shared memory per CTA on H100/H200


# The switches a varlen backward fixes (Note [Varlen backward] in bwd_kernel.py): each reads
# the problem's lengths outside the CTA's own tile and sequence (persistent walks, fetched
# tiles, clusters of key blocks, the longest-first order, a preprocess that counts rows beside
# the main kernel, dQ semaphores counting key blocks). Deterministic dQ orders its adds by
# those counts.
VARLEN_FIXED = dict(persistent_ctas=0, dynamic_tiles=False, qdo_multicast=False,
                    longest_first=False, pre_ctas=0, early_dq_post=False, deterministic=False)


@dataclass(frozen=True)
class BwdConfig:
    """Compile-time configuration of ``sm90_bwd`` (validated by ``validate()``)."""

    # problem
    head_dim: int = 128
    head_dim_v: int = 128
    dtype: str = "bfloat16"
    causal: bool = False
    window_left: Optional[int] = None
    window_right: Optional[int] = None
    qhead_per_kvhead: int = 1
    # logit softcapping (the cap is a launch argument): Note [softcap in the backward] in
    # bwd_scores.py; query blocks of 64 rows only
    softcap: bool = False
    # packed variable-length batches (Note [Varlen backward] in bwd_kernel.py): one CTA per
    # tile, each reading its sequence's offsets and lengths; the VARLEN_FIXED switches
    varlen: bool = False
    # tiles and pipelines
    # query rows per inner iteration: 64 (one WGMMA M atom), or with sdp_swap_ab 128 (S^T and
    # dP^T are 64 keys x 128 queries per warpgroup; dQ is split by query rows, see
    # ``dq_split_rows``) or 80 at hdim 128 (dQ computed transposed, see ``dq_swap_ab``)
    tile_m: int = 64
    # key rows owned by one CTA (dK/dV accumulated in registers): 128, the warpgroups owning
    # 64 key rows each; or 64, the warpgroups owning head-dim halves (Note [dK/dV by columns]
    # in bwd_mma.py)
    tile_n: int = 128
    q_stage: int = 2  # Q (+LSE) stages in flight (1-3; 3 measured no faster than 2)
    do_stage: int = 2  # dO (+Delta) stages in flight (1-3)
    ds_stage: int = 2  # dS SMEM buffers (2 removes one barrier per iteration)
    # switches
    deterministic: bool = False
    gqa_reduce: str = "buffers"
    # dQ accumulation: "bulk" = tile staged in SMEM, added by the dq-store warp with one
    # cp.reduce.async.bulk per query block; "red" = red.global.add.v4.f32 from the MMA
    # registers (no SMEM tile).
    dq_accum: str = "bulk"
    # "bulk" dQ: the first CTA to reach a query block stores its tile (a bulk copy) where the
    # others add theirs, so nothing zeroes the dQ accumulator; the dQ postprocess writes zeros
    # for a block no CTA reached (Note [dQ first store] in bwd_store.py). Off: the preprocess
    # zeroes the accumulator and every CTA adds. "red" dQ ignores it (see first_stores_dq).
    # select_bwd_config: on for causal problems and staggered sweeps (stagger_m; see there).
    dq_first_store: bool = False
    # "bulk" dQ: each MMA warpgroup hands its half of the SMEM dQ tile to the dq-store warp on
    # its own pair of barriers, and the warp reduces the halves separately (Note [dQ SMEM
    # handoff] in bwd_store.py); off: one handoff of the whole tile, which waits for both
    # warpgroups.
    dq_handoff_per_wg: bool = True
    # Issue dV += P^T dO right after P is in SMEM, overlapping it with the dS math
    # (select_bwd_config: on for non-causal problems, where it measured faster).
    early_dv: bool = True
    # MHA: dK/dV leave through SMEM by TMA stores (Note [dK/dV by TMA] in bwd_store.py);
    # off, each thread stores its elements directly. GQA/MQA ignore it (float32 buffers,
    # stored directly): see ``stores_dkv_by_tma``.
    dkv_tma_store: bool = True
    # Without early_dv: issue dV once dS is stored, before the barrier that waits for both
    # warpgroups' dS (Note [dV before the dS barrier] in bwd_mma.py), not after it.
    dv_before_barrier: bool = False
    # With dv_before_barrier and sdp_swap_ab: issue dV before the fence that publishes dS to
    # the tensor cores, not after it (Note [dV before the fence] in bwd_mma.py).
    dv_before_fence: bool = True
    # Compute S^T = K Q^T and dP^T = V dO^T (warpgroups stacked along the keys) so that P^T and
    # dS^T feed dV and dK from registers (RS WGMMA): no P in SMEM, dV/dK read only Q/dO there.
    sdp_swap_ab: bool = False
    # dV and dK computed transposed, dV^T = dO^T P and dK^T = Q^T dS (M = head dim, N = keys,
    # the warpgroups side by side along the keys): each warpgroup's dV / dK reads only its own
    # P / dS, and ``tile_n`` 96 becomes possible (Note [dK/dV transposed] in bwd_mma.py).
    # Unswapped S/dP, tile_n 96 or 128.
    dkv_swap_ab: bool = False
    # Leave this query block's dK GEMM running while the next block's S and dP are issued
    # (the q stage is released one block late). Unswapped S/dP only.
    overlap_dk: bool = False
    # LSE2 and Delta of each query block come into SMEM with its Q / dO stage (one bulk copy
    # each, on the same mbarrier); off: the MMA warpgroups load them from global memory in the
    # iteration that uses them, and wait for that load.
    stats_smem: bool = True
    # Read a block's LSE2 (Delta) into registers right after its Q (dO) stage is ready and
    # before the S (dP) GEMM is issued, not after both GEMMs (Note [stats before the GEMMs]
    # in bwd_mma.py; select_bwd_config: on for short causal hdim 128). Blocks of 80 / 128
    # rows keep their own order (Note [tile_m 128]).
    stats_first: bool = False
    # Blocks of 80 / 128 query rows: hold LSE2 / Delta 4 per lane and shuffle each query's
    # value to the lanes that need it (Note [tile_m 128] in bwd_mma.py); off: every thread
    # loads its own queries' values from SMEM (20 at tile_m 80, two per 64-bit load), as FA4
    # does. Ignored with 64-row blocks. select_bwd_config: off at tile_m 80 where that compiles
    # without spills (with lse_early and dp_wait_after, Note [dP wait placement]), else on.
    stats_shuffle: bool = True
    # Blocks of 80 / 128 rows, unshuffled statistics: load the block's LSE2 right after S^T's
    # GEMM is issued, while it runs, instead of after dP^T's (Note [dP wait placement]).
    lse_early: bool = False
    # Blocks of 80 / 128 rows: issue this many of S^T's exp2s (in the loop's order) before
    # the wait for dP^T may come, by a block boundary that ptxas does not schedule across
    # (Note [dP wait placement]); -1: no boundary, ptxas places the wait.
    dp_wait_after: int = -1
    # Poll a Q / dO stage's mbarrier once before the blocking wait (Note [try first] in
    # bwd_mma.py); off where the extra live register makes ptxas spill.
    try_wait: bool = True
    # Launch the main kernel and the postprocess as programmatic dependents of the kernel
    # before them, and have each wait for it only where it reads that kernel's output (Note
    # [chained launches] in bwd_interface.py); off: plain stream order.
    pdl: bool = True
    # Start the last CTAs longest first (Note [longest first] in bwd_tiles.py): a causal band
    # gives key block n fewer query blocks the larger n is. The grid's order (the key blocks
    # of a (batch, head) pair, then the next pair) leaves the last pair's key block 0 to start
    # when most of the grid is done; with this on, the last ``tail_ctas`` CTAs (rounded up to
    # whole pairs) start key block 0 of each of their pairs, then key block 1, ....
    longest_first: bool = False
    tail_ctas: int = 2 * HOPPER_SMS  # two waves of CTAs on an H100 / H200
    # The CTAs of key blocks q c .. q c + q - 1 (q = qdo_cluster) of a (batch, head) pair run
    # as a cluster; each loads its share of every Q and dO tile and multicasts it to all (Note
    # [Q/dO multicast] in bwd_load.py). Without a window (causal is allowed), not
    # deterministic, and a whole number of clusters of key blocks.
    qdo_multicast: bool = False
    # CTAs per cluster under qdo_multicast: each loads 1/qdo_cluster of every Q / dO tile
    qdo_cluster: int = QDO_CLUSTER
    # Each cluster of key blocks (each CTA without qdo_multicast) starts its sweep over the
    # query blocks at its own offset, spread evenly over them, and wraps around (Note
    # [staggered query blocks] in bwd_tiles.py): the CTAs of a (batch, head) pair no longer
    # add into the same dQ block at the same moment. No mask, not deterministic.
    stagger_m: bool = False
    # "bulk" dQ with pdl: every CTA counts itself done on a semaphore of its (batch, head)
    # once its dQ reduces have completed, the main kernel lets the dQ postprocess launch from
    # its start, and each postprocess CTA waits for its (batch, head)'s count instead of for
    # the whole main kernel: it converts finished heads on the SMs the main kernel's last
    # wave leaves idle (Note [dQ postprocess in the tail] in bwd_prepost.py).
    early_dq_post: bool = False
    # Run the preprocess on this many persistent CTAs beside the main kernel instead of one
    # CTA per 16 query rows ahead of it (Note [Preprocess beside the main kernel] in
    # bwd_prepost.py): the main kernel launches at once, and its load and dq-store warps wait
    # only for their (batch, head)'s rows; 0: off. select_bwd_config: DEFAULT_PRE_CTAS at
    # PRE_CTAS_HEAD_DIMS with "bulk" dQ and stats_smem.
    pre_ctas: int = 0
    # Launch at most this many CTAs and let each walk the tiles (key block, head, batch)
    # c, c + grid, c + 2 grid, ... instead of one CTA per tile (Note [persistent CTAs] in
    # bwd_tiles.py): the next tile's K, V and first Q / dO load while this tile's dK / dV
    # epilogue runs, and no CTA starts or ends between tiles. 0: off. The interface lowers it
    # to the device's SM count. MHA, "bulk" dQ, dK / dV by TMA staged where they fit
    # (``epilogue_staging_fits``), not deterministic, no pre_ctas (an explicit
    # persistent_ctas makes pre_ctas default to 0), whole clusters of 2; without
    # dynamic_tiles no causal mask or window and no longest_first (``validate``).
    persistent_ctas: int = 0
    # Persistent CTAs take their tiles from a counter instead of by a fixed stride: each CTA
    # starts at its own index, then its load warp fetches the next tile's (one atomic add)
    # and hands it to the other roles through SMEM (Note [dynamic tiles] in bwd_tiles.py).
    # The tiles go out in launch order, as the hardware hands out one CTA per tile, so tiles
    # of unequal length (a causal mask, a window; ``longest_first`` renumbers them) balance as
    # they do without persistent CTAs. Needs persistent_ctas, head_dim <= 96; no
    # qdo_multicast (a cluster's CTAs would need one index).
    dynamic_tiles: bool = False
    # registers after setmaxnreg: producer warpgroup and each of the two MMA warpgroups
    regs_producer: int = 24
    regs_mma: int = 240

    num_mma_warpgroups: int = dataclasses.field(default=2, init=False)

    @property
    def threads_per_cta(self) -> int:
        return WARPGROUP_THREADS * (1 + self.num_mma_warpgroups)

    @property
    def num_mma_threads(self) -> int:
        """Threads of the MMA warpgroups (the ``DS_READY`` / ``EPILOGUE`` barriers' count)."""
        return WARPGROUP_THREADS * self.num_mma_warpgroups

    @property
    def is_local(self) -> bool:
        return self.window_left is not None or self.window_right is not None

    def kernel_config(self) -> "BwdConfig":
        """The config the kernel is compiled from: with a window, both sides' values become 0,
        since the kernel takes the bounds as run-time arguments (``fa_sm100.bands``; an
        unbounded side arrives as a bound that covers every key) and reads only whether there
        is a window. Problems whose windows differ in size or in which sides are bounded share
        one kernel."""
        return self.replace(window_left=0, window_right=0) if self.is_local else self

    @property
    def dtype_bytes(self) -> int:
        return 2

    @property
    def uses_gqa_buffers(self) -> bool:
        """dK/dV go through float32 buffers (GQA/MQA); MHA stores them directly."""
        return self.qhead_per_kvhead > 1

    @property
    def stores_dkv_by_tma(self) -> bool:
        """dK/dV through SMEM and TMA: ``dkv_tma_store`` and MHA (Note [dK/dV by TMA])."""
        return self.dkv_tma_store and not self.uses_gqa_buffers

    @property
    def adds_dkv_by_bulk(self) -> bool:
        """GQA / MQA dK / dV added into one buffer per KV head by bulk reduces from SMEM
        (``gqa_reduce="bulk"``, Note [dK/dV by bulk reduces] in bwd_store.py)."""
        return self.uses_gqa_buffers and self.gqa_reduce == "bulk"

    @property
    def first_stores_dq(self) -> bool:
        """The first CTA at a query block stores its dQ tile instead of adding it (Note [dQ
        first store]): ``dq_first_store`` with "bulk" dQ (the dq-store warp's bulk copies)."""
        return self.dq_first_store and self.dq_accum == "bulk"

    @property
    def dq_sems_per_block(self) -> bool:
        """One dQ semaphore per query block (deterministic turns, or Note [dQ first store]'s
        state); else none (see ``dq_sem_slots``)."""
        return self.deterministic or self.first_stores_dq

    def dq_sem_slots(self, num_m_blocks: int) -> int:
        """dQ semaphores per (batch, head): one per query block where ``dq_sems_per_block``;
        with ``early_dq_post`` one more counting the finished CTAs (Note [dQ postprocess in
        the tail]); with ``dynamic_tiles`` one more, the tile counter (batch 0, head 0's)
        (Note [dynamic tiles] in bwd_tiles.py); with ``pre_ctas`` one more, last, counting
        the query rows the preprocess has finished (Note [Preprocess beside the main
        kernel]); at least one (unused without any of them)."""
        per_block = num_m_blocks if self.dq_sems_per_block else 0
        return max(per_block + int(self.early_dq_post) + int(self.dynamic_tiles)
                   + int(self.pre_ctas > 0), 1)

    @property
    def slots_after_finished_count(self) -> int:
        """dQ semaphore slots after the finished-tile count of ``early_dq_post``
        (``dq_sem_slots``): the tile counter of ``dynamic_tiles`` and the persistent
        preprocess's count, where they are. Where ``finished_ctas_count`` finds the count,
        hence part of the dQ postprocess's compile key."""
        return int(self.dynamic_tiles) + self.slots_after_tile_counter

    @property
    def slots_after_tile_counter(self) -> int:
        """dQ semaphore slots after the tile counter of ``dynamic_tiles`` (``dq_sem_slots``):
        the persistent preprocess's count, where there is one."""
        return int(self.pre_ctas > 0)

    @property
    def cluster(self) -> tuple:
        """The launch's cluster shape (Note [Q/dO multicast] in bwd_load.py)."""
        return (self.qdo_cluster, 1, 1) if self.qdo_multicast else (1, 1, 1)

    def num_key_blocks(self, seqlen_k):
        """Key blocks of ``tile_n`` keys: the CTAs of one (batch, head) pair. Python or DSL
        integers (the dQ postprocess waits for this many CTAs: Note [dQ postprocess in the
        tail])."""
        return (seqlen_k + self.tile_n - 1) // self.tile_n

    def pairs_key_blocks(self, seqlen_k: int) -> bool:
        """Whether ``seqlen_k``'s key blocks group into whole ``qdo_multicast`` clusters (of
        ``qdo_cluster``), so that no cluster spans two (batch, head) pairs (Note [Q/dO
        multicast])."""
        return self.num_key_blocks(seqlen_k) % self.qdo_cluster == 0

    def replace(self, **changes) -> "BwdConfig":
        return dataclasses.replace(self, **changes)

    def effective(self) -> "BwdConfig":
        """This config with the switches that its kernels do not read set to their defaults:
        ``stats_first`` with blocks of more than 64 query rows (they read LSE2/Delta after the
        GEMMs, Note [tile_m 128]), ``stats_shuffle``, ``lse_early`` and ``dp_wait_after``
        with 64-row blocks (Note [dP wait placement]), ``qdo_cluster``
        without ``qdo_multicast``, ``tail_ctas`` without ``longest_first`` (the kernel gets
        the tail as an argument that it then never reads). Two configs with equal
        ``effective()`` build the same kernels (a compile test holds their SASS equal), so
        timing one against the other measures noise (``scripts/ab_bench.py`` says so)."""
        if self.wide_query_block:
            changes = {"stats_first": BwdConfig.stats_first}
        else:
            changes = {name: getattr(BwdConfig, name)
                       for name in ("stats_shuffle", "lse_early", "dp_wait_after")}
        if not self.qdo_multicast:
            changes["qdo_cluster"] = BwdConfig.qdo_cluster
        if not self.longest_first:
            changes["tail_ctas"] = BwdConfig.tail_ctas
        return self.replace(**changes)

    @property
    def dq_split_rows(self) -> bool:
        """dQ = dS K split over the two MMA warpgroups by query rows (64 each; tile_m = 128)
        instead of by head-dim columns (tile_m = 64)."""
        return self.tile_m == 2 * TILE_M_ATOM

    @property
    def dkv_split_cols(self) -> bool:
        """dV = P^T dO and dK = dS^T Q split over the two MMA warpgroups by head-dim columns
        (tile_n = 64, every warpgroup reads all of P and dS from SMEM) instead of by key rows
        (tile_n = 128, each warpgroup its own keys' P and dS)."""
        return self.tile_n == WGMMA_M

    @property
    def keys_per_warpgroup(self) -> int:
        """Key columns of S / dP that one MMA warpgroup computes (unswapped: half the tile;
        swapped: the 64 keys of its M atom)."""
        return WGMMA_M if self.sdp_swap_ab else self.tile_n // 2

    @property
    def ps_atom_cols(self) -> int:
        """Key columns of one P / dS SMEM swizzle atom row: 64 (128 bytes), or with 48 keys
        per warpgroup (tile_n 96) 16, so that each warpgroup's keys are whole atoms (its dV^T
        / dK^T read them as an MN-major B: Note [dK/dV transposed])."""
        return next(c for c in (64, 32, 16)
                    if self.keys_per_warpgroup % c == 0 or self.dkv_split_cols)

    def bulk_dkv_fits(self) -> bool:
        """Whether the float32 dK tile fits the Q and dO stages and dV's K and V, where
        ``gqa_reduce="bulk"`` stages them (each pair adjacent in the SMEM struct, the first a
        whole number of 1024-byte alignment units: Note [dK/dV by bulk reduces] in
        bwd_store.py)."""
        b, hd, hdv = self.dtype_bytes, self.head_dim, self.head_dim_v
        q, do = self.tile_m * hd * b * self.q_stage, self.tile_m * hdv * b * self.do_stage
        k, v = self.tile_n * hd * b, self.tile_n * hdv * b
        return (q % SMEM_BUFFER_ALIGN == 0 and k % SMEM_BUFFER_ALIGN == 0
                and self.tile_n * hd * 4 <= q + do and self.tile_n * hdv * 4 <= k + v)

    def dkv_tile_shape(self, cols: int) -> tuple:
        """dK's (``cols`` = head_dim) or dV's (head_dim_v) accumulator tile: (keys, cols), or
        transposed (cols, keys) (Note [dK/dV transposed] in bwd_mma.py)."""
        return (cols, self.tile_n) if self.dkv_swap_ab else (self.tile_n, cols)

    def dkv_acc_regs(self) -> int:
        """Float32 dK + dV accumulator registers per MMA thread."""
        return (self.head_dim + self.head_dim_v) * self.tile_n // (
            WARPGROUP_THREADS * self.num_mma_warpgroups)

    @property
    def p_stage(self) -> int:
        """P buffers in SMEM: none with ``sdp_swap_ab``; ``ds_stage`` when both warpgroups read
        all of P (``dkv_split_cols``, Note [dS double buffer]); else one."""
        if self.sdp_swap_ab:
            return 0
        return self.ds_stage if self.dkv_split_cols else 1

    @property
    def wide_query_block(self) -> bool:
        """Swapped S^T/dP^T of more than 64 query columns (tile_m 80 and 128): P^T converted
        late or dS computed from 16-bit P^T, Delta read after P (Note [tile_m 128] in
        bwd_mma.py)."""
        return self.tile_m > TILE_M_ATOM

    @property
    def shuffled_stats(self) -> bool:
        """LSE2/Delta held 4 per lane and shuffled to the lanes that use them (Note [tile_m
        128]): wide query blocks with ``stats_shuffle``."""
        return self.wide_query_block and self.stats_shuffle

    @property
    def dq_swap_ab(self) -> bool:
        """dQ computed transposed, dQ^T = K^T dS^T (M = head dim, N = tile_m): tile_m not a
        multiple of the 64-row WGMMA M atom (Note [dQ transposed] in bwd_mma.py)."""
        return self.tile_m % TILE_M_ATOM != 0

    @property
    def dq_block_elems(self) -> int:
        """Float32 elements of one query block's dQ accumulator (Note [dQ in fragment order])."""
        return self.tile_m * self.head_dim

    @property
    def dq_groups(self) -> int:
        """16-byte groups of dQ accumulator registers per MMA thread (4 per group)."""
        return self.dq_block_elems // (WARPGROUP_THREADS * self.num_mma_warpgroups * DQ_VEC)

    def setmaxnreg(self) -> dict:
        return {"producer": self.regs_producer, "mma": self.regs_mma}

    def smem_bytes(self) -> int:
        """Dynamic shared memory of one CTA, laid out as the kernel's SharedStorage struct:
        the mbarriers; Q, dO stages, K, V, P (``p_stage`` buffers), dS stages and the dQ tile
        ("bulk"; "red" keeps a 16-byte placeholder), each 1024-byte aligned (swizzle atoms);
        LSE2 and Delta stages (``stats_smem``), 128-byte aligned; the whole rounded up to its
        1024-byte alignment (the struct's size, which is what a launch asks for: a test
        compares the two)."""
        b = self.dtype_bytes
        buffers = [
            self.tile_m * self.head_dim * b * self.q_stage,  # Q
            self.tile_m * self.head_dim_v * b * self.do_stage,  # dO
            self.tile_n * self.head_dim * b,  # K
            self.tile_n * self.head_dim_v * b,  # V
            self.tile_m * self.tile_n * b * self.p_stage,  # P
            self.tile_m * self.tile_n * b * self.ds_stage,  # dS
            self.dq_block_elems * 4 if self.dq_accum == "bulk" else 16,  # dQ
        ]
        # mbarriers: K/V full (and K/V empty with persistent CTAs), Q and dO full / empty;
        # with dynamic tiles the tile handoff's full / empty pairs and its index slots
        offset = 8 * (1 + int(self.persistent_ctas > 0) + 2 * self.q_stage + 2 * self.do_stage)
        if self.dynamic_tiles:
            offset += 8 * 2 * TILE_SLOTS + 4 * TILE_SLOTS
        for size in buffers:
            if size:
                offset = align_up(offset, SMEM_BUFFER_ALIGN) + size
        if self.stats_smem:
            for stages in (self.q_stage, self.do_stage):  # LSE2, Delta
                offset = align_up(offset, 128) + self.tile_m * 4 * stages
        return align_up(offset, SMEM_BUFFER_ALIGN)

    def epilogue_staging_fits(self) -> bool:
        """Whether dK fits in the dS buffers and dV in the SMEM dQ tile, where persistent
        CTAs stage them for their TMA stores (Note [persistent CTAs] in bwd_tiles.py)."""
        b = self.dtype_bytes
        return (self.dq_accum == "bulk"
                and self.tile_n * self.head_dim * b <= self.tile_m * self.tile_n * b * self.ds_stage
                and self.tile_n * self.head_dim_v * b <= self.dq_block_elems * 4)

    def _validate_persistent(self):
        """The rules of ``persistent_ctas`` > 0 (Note [persistent CTAs] in bwd_tiles.py)."""
        dynamic = self.dynamic_tiles
        rules = (
            (not dynamic and (self.causal or self.is_local),
             "a problem without a causal mask or window, or dynamic_tiles=True: a fixed "
             "order balances only tiles of equal length (Note [dynamic tiles])"),
            (dynamic and self.head_dim > DYNAMIC_TILES_MAX_HEAD_DIM,
             f"head_dim <= {DYNAMIC_TILES_MAX_HEAD_DIM} with dynamic_tiles: at head_dim="
             f"{self.head_dim} the MMA warpgroups have no registers left for the fetched walk "
             f"(ptxas spills, and with 80-row blocks serializes every WGMMA)"),
            (dynamic and self.qdo_multicast,
             "qdo_multicast=False with dynamic_tiles: both CTAs of a cluster would need the "
             "same fetched tile"),
            (self.deterministic, "deterministic=False"),
            (self.dkv_swap_ab, "dkv_swap_ab=False: its staging of dK / dV is not built for "
             "transposed tiles (Note [dK/dV transposed])"),
            (not self.stores_dkv_by_tma,
             "MHA with dkv_tma_store=True: the epilogue stages dK / dV for TMA stores"),
            (self.dq_accum != "bulk", "dq_accum='bulk'"),
            (not self.epilogue_staging_fits(),
             "dK to fit the dS buffers and dV the SMEM dQ tile, where the epilogue stages "
             "them, so that K and V can load meanwhile"),
            (self.pre_ctas > 0,
             "pre_ctas=0: the preprocess's CTAs would hold SMs that some of the persistent "
             "CTAs then wait for, and those would end last"),
            (self.longest_first and not dynamic,
             "longest_first=False, or dynamic_tiles=True: a fixed order takes no renumbering"),
            (self.persistent_ctas % self.cluster[0] != 0,
             f"a multiple of the cluster size {self.cluster[0]}"),
            (self.cluster[0] > QDO_CLUSTER,
             f"qdo_cluster={QDO_CLUSTER} under qdo_multicast: clusters of "
             f"{self.cluster[0]} do not all fit at once (an H200 holds 30 clusters of 4 CTAs "
             f"of this kernel, not 33), and a cluster that finds no room starts only when "
             f"another has walked all its tiles"),
        )
        for bad, need in rules:
            if bad:
                raise ValueError(f"persistent_ctas={self.persistent_ctas} needs {need}")
        return self

    def validate(self) -> "BwdConfig":
        if self.varlen:
            wrong = {k: getattr(self, k) for k, v in VARLEN_FIXED.items() if getattr(self, k) != v}
            if wrong:
                raise ValueError(f"varlen=True runs one CTA per tile with its own sequence's "
                                 f"lengths (Note [Varlen backward]): {wrong} must be "
                                 f"{ {k: VARLEN_FIXED[k] for k in wrong} }")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: must be one of {DTYPES}")
        if (self.head_dim, self.head_dim_v) not in SM90_BWD_HEAD_DIMS:
            raise ValueError(
                f"head dims (qk={self.head_dim}, v={self.head_dim_v}): the SM90 backward supports "
                f"(qk, v) in {SM90_BWD_HEAD_DIMS}"
            )
        if self.tile_m not in (TILE_M_ATOM, TILE_M_DQ_TRANSPOSED, 2 * TILE_M_ATOM):
            raise ValueError(f"tile_m={self.tile_m}: must be 64, or 80 or 128 with "
                             f"sdp_swap_ab=True")
        if self.tile_m == TILE_M_DQ_TRANSPOSED:
            if not self.sdp_swap_ab or self.head_dim not in TILE_M_80_HEAD_DIMS:
                raise ValueError(
                    f"tile_m=80 needs sdp_swap_ab=True and head_dim in {TILE_M_80_HEAD_DIMS}: "
                    f"S^T/dP^T take the 80 queries as WGMMA N, and dQ^T = K^T dS^T splits the "
                    f"head dim (its M) into the two warpgroups' 64-row atoms")
            if self.tile_n != 2 * WGMMA_M:
                raise ValueError("tile_m=80 needs tile_n=128")
        if self.tile_n not in (WGMMA_M, TILE_N_TRANSPOSED, 2 * WGMMA_M):
            raise ValueError(
                f"tile_n={self.tile_n}: must be 128 (64 key rows per MMA warpgroup), 64 "
                f"(dK/dV split by head-dim columns) or {TILE_N_TRANSPOSED} (dK/dV transposed)")
        if self.tile_n == TILE_N_TRANSPOSED and not self.dkv_swap_ab:
            raise ValueError(
                f"tile_n={TILE_N_TRANSPOSED} needs dkv_swap_ab=True: 96 keys are no whole number "
                f"of 64-row WGMMA M atoms per warpgroup; transposed, they are N (48 per "
                f"warpgroup, Note [dK/dV transposed])")
        if self.dkv_swap_ab:
            if self.sdp_swap_ab:
                raise ValueError(
                    "dkv_swap_ab=True needs sdp_swap_ab=False: dV^T and dK^T read P and dS from "
                    "SMEM, each warpgroup its own keys (Note [dK/dV transposed])")
            if self.tile_n == WGMMA_M:
                raise ValueError(f"dkv_swap_ab=True needs tile_n {TILE_N_TRANSPOSED} or "
                                 f"{2 * WGMMA_M}: tile_n 64 splits dK/dV by columns")
            if self.dkv_acc_regs() > DKV_ACC_MAX_REGS:
                raise ValueError(
                    f"dkv_swap_ab=True with tile_n={self.tile_n} at head dims ({self.head_dim}, "
                    f"{self.head_dim_v}): dK^T and dV^T take {self.dkv_acc_regs()} float32 "
                    f"registers per thread, more than the {DKV_ACC_MAX_REGS} that leave room "
                    f"for S, dP and dQ")
        if self.tile_n == 2 * WGMMA_M and self.head_dim > TILE_N_128_MAX_HEAD_DIM:
            raise ValueError(
                f"tile_n=128 with head_dim={self.head_dim}: dK and dV of 64 key rows take "
                f"{(self.head_dim + self.head_dim_v) // 2} float32 registers per thread beside "
                f"S and dP; head dims above {TILE_N_128_MAX_HEAD_DIM} need tile_n=64")
        if self.dkv_split_cols:
            for name, bad in (("sdp_swap_ab", self.sdp_swap_ab), ("early_dv", self.early_dv),
                              ("dv_before_barrier", self.dv_before_barrier)):
                if bad:
                    raise ValueError(
                        f"tile_n=64 needs {name}=False: dV reads both warpgroups' P, so it is "
                        f"issued after the dS barrier from P in SMEM (Note [dK/dV by columns])")
        for name in ("q_stage", "do_stage"):
            if getattr(self, name) not in (1, 2, 3):
                raise ValueError(f"{name}={getattr(self, name)}: must be 1, 2 or 3")
        if self.ds_stage != 2:
            raise ValueError("ds_stage must be 2: the single-buffer dS protocol is not implemented")
        if self.qhead_per_kvhead < 1:
            raise ValueError(f"qhead_per_kvhead={self.qhead_per_kvhead}: must be >= 1")
        if self.gqa_reduce not in GQA_REDUCE_MODES:
            raise ValueError(f"gqa_reduce={self.gqa_reduce!r}: must be one of {GQA_REDUCE_MODES}")
        if self.dq_accum not in DQ_ACCUM_MODES:
            raise ValueError(f"dq_accum={self.dq_accum!r}: must be one of {DQ_ACCUM_MODES}")
        if self.gqa_reduce == "bulk" and (self.dkv_split_cols or not self.bulk_dkv_fits()):
            raise ValueError(
                "gqa_reduce='bulk' needs each warpgroup's dK / dV to be whole rows (not "
                "tile_n=64 by columns), the float32 dK tile to fit the Q and dO stages and dV's "
                "K and V (Note [dK/dV by bulk reduces])")
        if self.deterministic and self.qhead_per_kvhead > 1 and self.gqa_reduce != "buffers":
            raise ValueError(
                "deterministic=True with GQA/MQA needs gqa_reduce='buffers' (atomics add in a "
                "run-dependent order)"
            )
        for name in ("sdp_swap_ab", "overlap_dk", "stats_smem", "try_wait", "stats_first",
                     "dv_before_barrier", "dkv_tma_store", "dq_handoff_per_wg", "pdl",
                     "stats_shuffle", "dv_before_fence", "longest_first", "qdo_multicast",
                     "dq_first_store", "stagger_m", "early_dq_post", "dynamic_tiles",
                     "lse_early", "dkv_swap_ab"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r}: must be a bool")
        if self.tile_m == 2 * TILE_M_ATOM:
            if not self.sdp_swap_ab:
                raise ValueError(
                    "tile_m=128 needs sdp_swap_ab=True: the unswapped S/dP path runs tile_m=64 "
                    "(one 64-row WGMMA M atom per query block, warpgroups split by keys)"
                )
            if self.head_dim not in TILE_M_128_HEAD_DIMS:
                raise ValueError(
                    f"tile_m=128 with head_dim={self.head_dim}: supported for head_dim in "
                    f"{TILE_M_128_HEAD_DIMS} only: S^T and dP^T take 64 float32 registers each "
                    f"per thread, and beside the larger dK/dV accumulators of hdim 96/128 ptxas "
                    f"spills and serializes every WGMMA (with 2-stage Q/dO the SMEM does not "
                    f"fit either)"
                )
        if self.lse_early and self.shuffled_stats:
            raise ValueError(
                "lse_early=True needs stats_shuffle=False with blocks of 80 / 128 rows: the "
                "shuffled values (20 at tile_m 80) would stay live across the S^T GEMM, and "
                "ptxas then serializes every WGMMA (Note [dP wait placement])")
        if self.dv_before_barrier and self.early_dv:
            raise ValueError(
                "dv_before_barrier=True needs early_dv=False: with early_dv, dV is issued "
                "before the dS math already"
            )
        if self.overlap_dk and self.sdp_swap_ab:
            raise ValueError(
                "overlap_dk=True needs sdp_swap_ab=False: a dK GEMM still reading dS^T from "
                "registers across the loop's back edge makes ptxas serialize every WGMMA"
            )
        if self.overlap_dk and self.q_stage < 2:
            raise ValueError(
                "overlap_dk=True needs q_stage >= 2: block i's Q stage is released only after "
                "block i+1's S GEMM, which needs the next stage"
            )
        if self.qdo_multicast:
            if self.is_local:
                raise ValueError(
                    "qdo_multicast=True without a window: the CTAs of a cluster load the query "
                    "blocks from the first one's first to the common last (Note [Q/dO "
                    "multicast]); a left window ends them at different blocks")
            if self.deterministic:
                raise ValueError(
                    "qdo_multicast=True without deterministic: the dQ semaphore's order across "
                    "the CTAs of a cluster is not built")
        if self.stagger_m and (self.causal or self.is_local or self.deterministic):
            raise ValueError(
                "stagger_m=True needs a problem without a causal mask or window, not "
                "deterministic: every key block then visits every query block, so any start "
                "covers them; deterministic turns go in key-block order, which a staggered "
                "start would serialize (Note [staggered query blocks])")
        if self.early_dq_post and (self.dq_accum != "bulk" or not self.pdl):
            raise ValueError(
                "early_dq_post=True needs dq_accum='bulk' and pdl=True: the dq-store warp counts "
                "its CTA done once its bulk reduces have completed, and the postprocess starts "
                "as a programmatic dependent of the main kernel (Note [dQ postprocess in the "
                "tail])")
        for name, least in (("pre_ctas", 0), ("tail_ctas", 1), ("persistent_ctas", 0),
                            ("dp_wait_after", -1)):
            n = getattr(self, name)
            if isinstance(n, bool) or not isinstance(n, int) or n < least:
                raise ValueError(f"{name}={n!r}: must be an int >= {least}")
        if self.pre_ctas and (self.dq_accum != "bulk" or not self.stats_smem):
            raise ValueError(
                "pre_ctas > 0 needs dq_accum='bulk' and stats_smem=True: then only the load "
                "warp (LSE2 / Delta) and the dq-store warp (semaphores, dQ accumulator) read "
                "what the preprocess writes, and they wait for their (batch, head)'s rows "
                "(Note [Preprocess beside the main kernel])")
        if self.persistent_ctas:
            self._validate_persistent()
        elif self.dynamic_tiles:
            raise ValueError("dynamic_tiles=True needs persistent_ctas > 0: the CTAs that fetch "
                             "the tiles (Note [dynamic tiles] in bwd_tiles.py)")
        if isinstance(self.qdo_cluster, bool) or self.qdo_cluster not in QDO_CLUSTERS:
            raise ValueError(f"qdo_cluster={self.qdo_cluster!r}: must be one of {QDO_CLUSTERS}")
        if self.softcap and self.wide_query_block:
            raise ValueError(f"softcap=True needs tile_m={TILE_M_ATOM} (query blocks of 80 or "
                             "128 rows form P^T late or from 16 bits in ways the capped "
                             "scores do not follow: Note [softcap in the backward])")
        for name in ("window_left", "window_right"):
            w = getattr(self, name)
            if w is not None and (isinstance(w, bool) or not isinstance(w, int)):
                raise ValueError(f"{name}={w!r}: a window bound is an int (None = unbounded; "
                                 "fa_sm100.bands)")
        for name in ("regs_producer", "regs_mma"):
            check_setmaxnreg(name, getattr(self, name))
        check_register_budget(
            WARPGROUP_THREADS * (self.regs_producer + self.num_mma_warpgroups * self.regs_mma),
            f"{WARPGROUP_THREADS} x ({self.regs_producer} + {self.num_mma_warpgroups} x "
            f"{self.regs_mma})",
            self.threads_per_cta,
        )
        if self.smem_bytes() > SM90_SMEM_BYTES:
            raise ValueError(
                f"shared memory {self.smem_bytes()} B exceeds the SM90 budget {SM90_SMEM_BYTES} B"
            )
        return self


def dq_fragment_index(cfg: BwdConfig, row: int, col: int) -> int:
    """Where element (row, col) of a query block's dQ tile lies in its accumulator block
    (Note [dQ in fragment order] in bwd_store.py): MMA thread T = 128 w + t holds accumulator
    registers e = 4 i + j of its warpgroup's WGMMA tile, stored at ((w * dq_groups + i) * 128
    + t) * 4 + j. The register layout is the PTX ISA's for an m64nN f32 accumulator: in warp
    u, lane l, register e holds row 16 u + 8 ((e // 2) % 2) + l // 4, column 8 (e // 4) +
    2 (l % 4) + e % 2. The warpgroups split the tile by head-dim columns (tile_m 64) or by
    query rows (tile_m 128); with tile_m 80 the accumulator is dQ^T, its rows the head dim
    (64 per warpgroup) and its columns the queries (Note [dQ transposed]). Python integers:
    what the tests check the kernels against."""
    if cfg.dq_swap_ab:
        w, r, c = col // TILE_M_ATOM, col % TILE_M_ATOM, row
    elif cfg.dq_split_rows:
        w, r, c = row // TILE_M_ATOM, row % TILE_M_ATOM, col
    else:
        half = cfg.head_dim // 2
        w, r, c = col // half, row, col % half
    u, rr = r // 16, r % 16
    lane = 4 * (rr % 8) + (c % 8) // 2
    e = 4 * (c // 8) + 2 * (rr // 8) + c % 2
    t = 32 * u + lane
    return ((w * cfg.dq_groups + e // DQ_VEC) * WARPGROUP_THREADS + t) * DQ_VEC + e % DQ_VEC


def effective_window_right(cfg: BwdConfig) -> Optional[int]:
    """The right window edge the mask uses: causal is a right edge of 0."""
    return causal_window_right(cfg.causal, cfg.window_right)


def band_bounds(cfg: BwdConfig) -> tuple:
    """(left, right) of the band a config's problem has, None for an unbounded side
    (``fa_sm100.bands``): what the tile functions take on the host and in the tests. The
    kernel gets the same from its run-time arguments (``BwdProblem.band``, bwd_context.py)."""
    return cfg.window_left, effective_window_right(cfg)


def causal_window_right(causal: bool, window_right: Optional[int]) -> Optional[int]:
    """``effective_window_right`` of a problem before its config is built
    (``bands.effective_bounds``)."""
    return effective_bounds(causal, None, window_right)[1]
