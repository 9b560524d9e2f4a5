"""The stores of the SM90 backward: dQ into its float32 accumulator, and dK, dV at the end of
a tile (of a CTA, or of a persistent CTA's walk). The dq-store warp's role (``dq_store``,
warp 1 with "bulk" dQ) and the functions the MMA warpgroups (bwd_mma.py) call per query block
(``stage_dq``, ``store_dq``) and per tile (``store_dkdv_tma``, ``store_dkdv``).

dQ is accumulated in float32 in global memory, by one of two switchable paths (``dq_accum``):
"bulk" stages the dQ tile in SMEM and the dq-store warp adds it with one bulk reduce; "red"
adds from the MMA registers, one ``red.global.add.v4.f32`` per four registers (16 contiguous
bytes in fragment order: a quarter of the scalar reductions; at hdim 256 this made "red"
2.5-3.1x faster and the fastest path, docs/hopper_backward.md). Deterministic mode orders the
additions: the CTAs that touch a query block add in increasing ``n_block`` order, through a
per-(batch, head, m_block) semaphore. Both add dS K without the softmax scale: the
postprocess applies it once per element (instead of a multiply per element per key block).

Note [dQ in fragment order]: the accumulator of one query block is not a row-major tile but
the MMA threads' registers in their order: thread T = 128 w + t stores its registers 4 i ..
4 i + 3 at ((w * dq_groups + i) * 128 + t) * 4 (``bwd_config.dq_fragment_index`` spells out
the element that lands there). So every thread's dQ leaves in dq_groups 16-byte STS.128 (a
warp's 32 stores cover 512 contiguous bytes: no bank conflict and no padding; row-major it
took twice as many STS.64 into padded rows), the SMEM tile is one contiguous range for the
bulk reduce, and GMEM holds the same image per (batch, head, query block). The postprocess
(``bwd_prepost.DqPostprocess``) maps it back to rows and columns with the same tiled MMA.

Note [dQ first store] (``dq_first_store``, "bulk" dQ): the float32 accumulator of a query
block needs zeros under the first addition into it, and writing them (the preprocess did, in
the same pass as Delta: 128 MiB at 16k tokens and hidden 2048, as much as it reads) cost
about as long as the rest of the preprocess. Instead the first CTA to reach a block stores
its tile with a plain bulk copy and the others add theirs. Each block has a state word (the
dQ semaphore, zeroed by the preprocess): 0 nobody yet, 1 the first store is in flight, 2
stored. Once its tile is in SMEM the dq-store warp swaps 0 for 1 (atomic CAS); if it won,
it copies its tile, waits until the copy has completed (``wait_group 0``, not ``.read``),
fences and releases 2; if it found 1, it polls (acquire) until it reads 2, then adds. A
poller waits until one bulk copy has completed, in the dq-store warp while the MMA warpgroups
compute the next block. That is cheap when the CTAs of a (batch, head) reach a block at
different times, as under a causal mask (key block n starts at the diagonal); without one they
run through the query blocks together and all but one wait at every block (slower than the zero
fill: tuning row "dQ first stores") unless their sweeps are staggered (Note [staggered query
blocks] in bwd_tiles.py), so ``select_bwd_config`` turns it on for causal problems and
staggered sweeps. Deterministic mode has its order already: the CTA whose turn is 0 stores
and the semaphore keeps counting turns. A block no CTA reaches (rows that see no
keys: seqlen_q > seqlen_k under a causal mask, a window) keeps state 0 and whatever the
allocator left in its accumulator; ``DqPostprocess`` writes zeros for it. "red" dQ (from the
MMA registers) keeps the zero fill.

Note [dK/dV by TMA] (``dkv_tma_store``, MHA): after the last query block every GEMM of
both warpgroups has retired (``EPILOGUE`` barrier), so K's and V's SMEM buffers are free; the
warpgroups write scaled dK and dV there with stmatrix, fence, meet again, and one warp stores
both tiles by TMA (one store per swizzle box; rows past seqlen_k are clipped by the TMA unit)
and waits for them to read SMEM before the CTA exits. Persistent CTAs stage dK in the dS
buffers and dV in the dQ tile instead, so that the next tile's K and V can load meanwhile
(Note [persistent CTAs] in bwd_tiles.py). The direct path
(``dkv_tma_store=False``, and GQA's float32 buffers) stores 2-byte elements from registers:
128 STG.U16 per thread at hdim 128, each touching 8 rows of 16 bytes.

Note [dK/dV by bulk reduces] (``gqa_reduce="bulk"``, GQA / MQA): the query heads of a group
add their float32 dK / dV tiles into one buffer per KV head, as ``atomic`` does, but not one
``red.add`` per element: after the ``EPILOGUE`` barrier the Q and dO stages are free (every
GEMM that reads them has retired, and no load is left for this CTA), and so are K and V: the
warpgroups write dK over the Q and dO stages and dV over K and V as row-major float32 tiles
(each pair of buffers adjacent in the SMEM struct: ``BwdConfig.bulk_dkv_fits``), fence, and
one thread per warpgroup adds its rows of each (whole rows: the warpgroups split the keys)
with one ``cp.reduce.async.bulk.add.f32``, then waits for them to read SMEM before the CTA
exits. The buffer is zeroed and converted by the dK / dV postprocess as for ``atomic``; the
order of the additions is not fixed (not deterministic).

Note [dQ SMEM handoff] ("bulk"): per query block the dq-store warp waits until its previous
bulk reduce has read the tile (``cp.async.bulk.wait_group.read``), arrives on ``DQ_EMPTY``,
then waits on ``DQ_FULL``; the MMA warpgroups wait on ``DQ_EMPTY``, store the tile, fence the
async proxy and arrive on ``DQ_FULL``. With ``dq_handoff_per_wg`` (default) every warpgroup
has its own pair of barriers for its half of the tile (contiguous in fragment order) and the
warp reduces each half on its own, so a warpgroup never waits for the other one here. With
one handoff for the whole tile, both warpgroups met at ``DQ_EMPTY`` once more per query block
(besides ``DS_READY``) and then stored their 2 x 8 x dq_groups STS.128 at the same moment:
Nsight Compute (hdim 128, 4k, non-causal) put 4.6% of the main loop's stall samples on that
barrier and 6.7% on the SMEM queue (MIO) behind the stores, where FA4, which hands off per
warpgroup, had 1.9% and under 1%.
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_helpers
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync
from cutlass.experimental import primitives as prims

from fa_sm100.config import WARP_SIZE, cutlass_dtype
from fa_sm100.hopper import probes
from fa_sm100.hopper.bwd_config import DQ_VEC
from fa_sm100.hopper.bwd_tiles import first_n_block, m_block_at, sweep_end, walk
from fa_sm100.hopper.common import assume_aligned, stmatrix_to_smem, transpose_view
from fa_sm100.hopper.config import WARPGROUP_THREADS, WGMMA_M
from fa_sm100.hopper.named_barriers import Sm90BwdBarrier


def dq_tiled_mma(cfg, dtype):
    """The tiled WGMMA of dQ = dS K, (tile_m, hdim): with tile_m 64 the two MMA warpgroups side
    by side along N (head-dim halves); with tile_m 128 stacked along M (64 query rows each, all
    of the head dim); with tile_m 80 it computes dQ^T = K^T dS^T, (hdim, tile_m), the
    warpgroups stacked along M (64 head-dim rows each, Note [dQ transposed]). Its accumulator
    partition is also the map the postprocess inverts (Note [dQ in fragment order])."""
    K, MN = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
    if cfg.dq_swap_ab:
        return sm90_helpers.make_trivial_tiled_mma(
            dtype, dtype, MN, K, Float32, (2, 1, 1), (WGMMA_M, cfg.tile_m))
    if cfg.dq_split_rows:
        return sm90_helpers.make_trivial_tiled_mma(
            dtype, dtype, K, MN, Float32, (2, 1, 1), (WGMMA_M, cfg.head_dim))
    return sm90_helpers.make_trivial_tiled_mma(
        dtype, dtype, K, MN, Float32, (1, 2, 1), (WGMMA_M, cfg.head_dim // 2))


def dq_fragment_view(cfg, ptr, tidx):
    """MMA thread ``tidx``'s dq_groups x 4 floats of a dQ accumulator block at ``ptr`` (SMEM
    or GMEM, 16-byte aligned), Note [dQ in fragment order]: (4, dq_groups), strides (1, 512).
    The main kernel stores through it; ``DqPostprocess`` loads through it."""
    groups = cfg.dq_groups
    wg, t = tidx // WARPGROUP_THREADS, tidx % WARPGROUP_THREADS
    layout = cute.make_layout((DQ_VEC, groups), stride=(1, WARPGROUP_THREADS * DQ_VEC))
    return cute.make_tensor(ptr + (wg * groups * WARPGROUP_THREADS + t) * DQ_VEC, layout)


def _sem_from_end(mdQsem, batch, head, after: int):
    """The pointer to (batch, head)'s dQ semaphore with ``after`` slots after it
    (``BwdConfig.dq_sem_slots`` puts the counts last)."""
    return mdQsem[batch, head, None].iterator + mdQsem.shape[2] - 1 - after


def finished_ctas_count(cfg, mdQsem, batch, head):
    """The pointer to (batch, head)'s count of finished main-kernel tiles (CTAs, unless
    persistent: Note [persistent CTAs] in bwd_tiles.py), its last dQ semaphore but the tile
    counter's and the preprocess's count (``BwdConfig.dq_sem_slots``, Note [dQ postprocess in
    the tail] in bwd_prepost.py): the dq-store warp adds to it, the dQ postprocess polls it."""
    return _sem_from_end(mdQsem, batch, head, cfg.slots_after_finished_count)


def tile_counter(cfg, mdQsem):
    """The pointer to the tile counter of ``dynamic_tiles``: (batch 0, head 0)'s dQ semaphore
    after the finished count, before the preprocess's count (``BwdConfig.dq_sem_slots``, Note
    [dynamic tiles] in bwd_tiles.py). The preprocess zeroes it; the load warps add to it."""
    return _sem_from_end(mdQsem, 0, 0, cfg.slots_after_tile_counter)


def preprocess_count(mdQsem, batch, head):
    """The pointer to (batch, head)'s count of query rows the persistent preprocess has
    finished, its last dQ semaphore (``BwdConfig.dq_sem_slots``, Note [Preprocess beside the
    main kernel] in bwd_prepost.py): the preprocess adds to it, the main kernel polls it."""
    return _sem_from_end(mdQsem, batch, head, 0)


# Polls of a count (each an L2 round trip, about a microsecond) before ``wait_for_count`` waits
# for the whole kernel before instead (Note [dQ postprocess in the tail], Note [Preprocess
# beside the main kernel], both in bwd_prepost.py)
MAX_POLLS = 1 << 16


@cute.jit
def wait_for_count(count_ptr, target, pdl: cutlass.Constexpr):
    """One whole warp: poll the int32 count at ``count_ptr`` (``ld.acquire.gpu``) until it
    reaches ``target``. After ``MAX_POLLS`` polls short of it, wait for the whole kernel before
    in the stream (``griddepcontrol.wait``; with ``pdl``, else that kernel has ended already),
    whose CTAs do the counting: slow, never wrong. Every lane loads and the warp votes, so the
    loop stays warp-uniform (a lane-0 loop left ptxas guarding every later elect and
    collective of the warp against divergence)."""
    short = cute.arch.vote_any_sync(
        cute.arch.load(count_ptr, Int32, sem="acquire", scope="gpu") < target)
    polls = Int32(0)
    while short and polls < MAX_POLLS:
        short = cute.arch.vote_any_sync(
            cute.arch.load(count_ptr, Int32, sem="acquire", scope="gpu") < target)
        polls = polls + 1
    if const_expr(pdl):
        if short:
            cute.arch.griddepcontrol_wait()


def dq_tile_shape(cfg):
    """The shape of the dQ accumulator tile as ``dq_tiled_mma`` computes it: (tile_m, hdim),
    or (hdim, tile_m) when dQ is computed transposed."""
    if cfg.dq_swap_ab:
        return (cfg.head_dim, cfg.tile_m)
    return (cfg.tile_m, cfg.head_dim)


@cute.jit
def _named_barrier(bar_id: cutlass.Constexpr, threads: cutlass.Constexpr, wait: cutlass.Constexpr):
    """bar.sync (``wait``) or bar.arrive on named barrier ``bar_id`` of ``threads`` threads."""
    if const_expr(wait):
        cute.arch.barrier(barrier_id=bar_id, number_of_threads=threads)
    else:
        cute.arch.barrier_arrive(barrier_id=bar_id, number_of_threads=threads)


def dq_registers(cfg, acc_dQ):
    """A dQ accumulator (registers) as (4, dq_groups) in register order."""
    return cute.make_tensor(acc_dQ.iterator, cute.make_layout((DQ_VEC, cfg.dq_groups)))


def _dq_handoffs(cfg):
    """(handoffs per query block, threads per handoff barrier) of Note [dQ SMEM handoff]:
    one per MMA warpgroup (128 + 32 threads), or one for the whole tile (256 + 32)."""
    if cfg.dq_handoff_per_wg:
        return cfg.num_mma_warpgroups, WARPGROUP_THREADS + WARP_SIZE
    return 1, cfg.num_mma_threads + WARP_SIZE


@cute.jit
def _dq_handoff_barrier(cfg, first: cutlass.Constexpr, tidx, wait: cutlass.Constexpr):
    """MMA side of one Note [dQ SMEM handoff] barrier: wait on it (``wait``) or arrive on
    it; ``first`` is warpgroup 0's id, warpgroup 1's is the next one when each hands off
    its own half. The ids stay constants in each branch: with the id in a register, ptxas
    spilled (deterministic mode, left window, tile_m 80)."""
    parts, handoff = _dq_handoffs(cfg)
    bar_id = int(first)
    if const_expr(parts == 1):
        _named_barrier(bar_id, handoff, wait)
    elif tidx < WARPGROUP_THREADS:
        _named_barrier(bar_id, handoff, wait)
    else:
        _named_barrier(bar_id + 1, handoff, wait)


@cute.jit
def wait_for_preprocess(cfg, gmem, batch, head):
    """The calling warp waits until what the preprocess writes for (batch, head) is
    visible: ``griddepcontrol.wait`` (Note [chained launches]), or with ``pre_ctas`` until
    the preprocess has counted all seqlen_q_pad rows of the pair, then a proxy fence, as
    the warp's TMA / bulk copies read them (Note [Preprocess beside the main kernel] in
    bwd_prepost.py). The load and dq-store warps call it."""
    if const_expr(cfg.pre_ctas):
        wait_for_count(preprocess_count(gmem.mdQsem, batch, head), gmem.mLSE2.shape[2], cfg.pdl)
        cute.arch.fence_proxy("async.global")
    elif const_expr(cfg.pdl):
        cute.arch.griddepcontrol_wait()


# ---- the dq-store warp ("bulk" dQ) -------------------------------------------------------

@cute.jit
def dq_store(cfg, prob, gmem, smem, work):
    """Warp 1 ("bulk" dQ). Consumes the MMA warpgroups' dQ tiles (``smem.sdQ``, Note [dQ SMEM
    handoff]); produces their sums in ``gmem.mdQacc`` and, deterministic or with first
    stores, the semaphores' turns and states. ``_dq_store_tile`` for this CTA's tile, or with
    persistent CTAs for each tile of its walk (Note [persistent CTAs] in bwd_tiles.py); then
    it waits until its last bulk operation has read SMEM."""
    walk(cfg, work, _dq_store_tile, (cfg, prob, gmem, smem), ())
    cute.arch.cp_async_bulk_wait_group(0, read=True)


@cute.jit
def _dq_store_tile(cfg, prob, gmem, smem, tile):
    """One tile (``BwdTile``) of warp 1, Note [dQ SMEM handoff]. Per query block m and per
    part of the tile (a warpgroup's half, or the whole tile): wait until the last bulk reduce
    of that part has read SMEM, arrive on its ``DQ_EMPTY``; then per part wait on its
    ``DQ_FULL`` and add it into dQacc[batch, head, m] with one cp.reduce.async.bulk.add.f32
    (both in fragment order, where a warpgroup's half is contiguous: Note [dQ in fragment
    order]). Deterministic: first wait for this CTA's turn on the query block's semaphore;
    after the reduces have completed, pass the turn on. With first stores (Note [dQ first
    store]) the first CTA at the block copies its tile instead of adding it. With
    ``early_dq_post``, once every reduce has completed the CTA counts itself done on the
    (batch, head)'s last semaphore (Note [dQ postprocess in the tail] in bwd_prepost.py).
    The ``dq_reduce`` cost probe (Note [cost probes] in probes.py) drops or shrinks the
    bulk operations here. With persistent CTAs, after the tile's last block it lends the
    SMEM dQ tile to the dK / dV epilogue (Note [persistent CTAs]): once its reduces have
    read it, it arrives on ``DQ_EMPTY`` and waits on ``DQ_FULL`` once more. Carries no
    pipeline state (returns none)."""
    n_block, head, batch, m_offset = tile.n_block, tile.head, tile.batch, tile.m_offset
    m_block_min, m_block_max = tile.m_block_min, tile.m_block_max
    mdQsem, sdQ = gmem.mdQsem, smem.sdQ
    # Note [chained launches]: the preprocess has zeroed the semaphores (and dQacc, without
    # first stores); Note [Preprocess beside the main kernel]: with pre_ctas, those of this
    # (batch, head) are zero already, dQacc not
    wait_for_preprocess(cfg, gmem, batch, head)
    parts, handoff = _dq_handoffs(cfg)
    probe = probes.active("dq_reduce")  # None unless timing a cost probe (probes.py)
    first_store = cfg.first_stores_dq
    det = cfg.deterministic
    part_elems = cfg.dq_block_elems // parts
    gdQ = gmem.mdQacc[batch, head, None, None]
    lane = cute.arch.lane_idx()
    for step in cutlass.range(m_block_min, sweep_end(m_block_min, m_block_max), unroll=1):
        m_block = m_block_at(cfg, step, m_offset, m_block_min, m_block_max)
        for part in cutlass.range_constexpr(parts):
            # bulk groups complete in commit order: this part's previous reduce is done
            # once at most the later parts' are in flight
            cute.arch.cp_async_bulk_wait_group(parts - 1 - part, read=True)
            cute.arch.barrier_arrive(barrier_id=int(Sm90BwdBarrier.DQ_EMPTY_WG0) + part,
                                     number_of_threads=handoff)
        dst = gdQ.iterator + m_block * cfg.dq_block_elems
        sem_ptr = mdQsem[batch, head, None].iterator + m_block
        first = cutlass.Boolean(False)  # copy the tile instead of adding it
        if const_expr(det):
            turn = n_block - _n_block_first(cfg, prob, m_block)
            if lane == 0:
                seen = cute.arch.load(sem_ptr, Int32, sem="acquire", scope="gpu")
                while seen != turn:
                    seen = cute.arch.load(sem_ptr, Int32, sem="acquire", scope="gpu")
            cute.arch.sync_warp()
            if const_expr(first_store):
                first = turn == 0
        for part in cutlass.range_constexpr(parts):
            cute.arch.barrier(barrier_id=int(Sm90BwdBarrier.DQ_FULL_WG0) + part,
                              number_of_threads=handoff)
            if const_expr(first_store and not det and part == 0):
                first = _claim_dq_block(sem_ptr, lane)
            src, out = sdQ.iterator + part * part_elems, dst + part * part_elems
            nbytes = (part_elems * (Float32.width // 8)) >> int(probe == "half")
            with cute.arch.elect_one():
                if first:
                    if const_expr(probe != "none"):
                        prims.cp_async_bulk_global_shared_cta(out, src, nbytes)
                else:
                    if const_expr(probe == "copy"):
                        prims.cp_async_bulk_global_shared_cta(out, src, nbytes)
                    elif const_expr(probe != "none"):
                        prims.cp_reduce_async_bulk_global_shared_cta(
                            out, src, nbytes, op=prims.CpReduceOp.ADD,
                            type=prims.CpReduceType.F32)
            cute.arch.cp_async_bulk_commit_group()
        if const_expr(det):
            _release_dq_block(sem_ptr, lane)  # the next turn
        elif const_expr(first_store):
            if first:
                _release_dq_block(sem_ptr, lane)  # state 1 -> 2: stored
    if const_expr(cfg.persistent_ctas):  # lend the tile once the reduces have read it
        cute.arch.cp_async_bulk_wait_group(0, read=True)
        for part in cutlass.range_constexpr(parts):
            cute.arch.barrier_arrive(barrier_id=int(Sm90BwdBarrier.DQ_EMPTY_WG0) + part,
                                     number_of_threads=handoff)
    if const_expr(cfg.early_dq_post):  # waits until the reduces have written
        _release_dq_block(finished_ctas_count(cfg, mdQsem, batch, head), lane)
    if const_expr(cfg.persistent_ctas):  # ... and take it back from the epilogue
        for part in cutlass.range_constexpr(parts):
            cute.arch.barrier(barrier_id=int(Sm90BwdBarrier.DQ_FULL_WG0) + part,
                              number_of_threads=handoff)
    return ()  # no states to carry (``walk``)


def _n_block_first(cfg, prob, m_block: Int32):
    """The first key block that adds into query block ``m_block`` (semaphore base)."""
    return first_n_block(cfg, m_block, prob.seqlen_q, prob.seqlen_k, cutlass.max, prob.band)


@cute.jit
def _claim_dq_block(sem_ptr, lane):
    """Note [dQ first store], non-deterministic: whether this CTA is the first at the
    block (it swapped state 0 for 1); a later one returns once the first store is out
    (state 2). Lane 0 does the atomics; the answer is the warp's."""
    state = Int32(0)
    if lane == 0:
        state = cute.arch.atomic_cas(sem_ptr, cmp=Int32(0), val=Int32(1), sem="acquire",
                                     scope="gpu")
        if state != 0:
            while state != 2:
                state = cute.arch.load(sem_ptr, Int32, sem="acquire", scope="gpu")
    return cute.arch.shuffle_sync(state, 0) == 0


@cute.jit
def _release_dq_block(sem_ptr, lane):
    """Once this CTA's bulk copies of the block have completed (written, not only read),
    add 1 to the block's semaphore with release semantics: the next deterministic turn,
    or Note [dQ first store]'s state 1 -> 2; or, after the last block, to the count of
    finished CTAs (Note [dQ postprocess in the tail])."""
    cute.arch.cp_async_bulk_wait_group(0, read=False)
    cute.arch.fence_acq_rel_gpu()
    if lane == 0:
        cute.arch.red(sem_ptr, Int32(1), op="add", dtype="s32", sem="release", scope="gpu")


# ---- the MMA warpgroups' side: dQ per query block, dK / dV per tile ----------------------

@cute.jit
def stage_dq(cfg, acc_dQ, sdQ, tidx):
    """"bulk" dQ, MMA side of Note [dQ SMEM handoff]: the tile (unscaled) into SMEM in
    fragment order (dq_groups STS.128 per thread)."""
    _dq_handoff_barrier(cfg, Sm90BwdBarrier.DQ_EMPTY_WG0, tidx, wait=True)
    smem = assume_aligned(sdQ.iterator)
    cute.autovec_copy(dq_registers(cfg, acc_dQ), dq_fragment_view(cfg, smem, tidx))
    cute.arch.fence_view_async_shared()
    _dq_handoff_barrier(cfg, Sm90BwdBarrier.DQ_FULL_WG0, tidx, wait=False)


@cute.jit
def store_dq(cfg, prob, gmem, acc_dQ, tidx, tile, m_block):
    """"red" dQ: add this CTA's dQ tile of query block ``m_block`` (unscaled) into the
    float32 accumulator, in fragment order (Note [dQ in fragment order]); deterministic, in
    the block's semaphore's turn."""
    n_block, head, batch = tile.n_block, tile.head, tile.batch
    mdQsem = gmem.mdQsem
    gdQ = dq_fragment_view(cfg, gmem.mdQacc[batch, head, m_block, None].iterator, tidx)
    rdQ = dq_registers(cfg, acc_dQ)
    if const_expr(cfg.deterministic):
        sem = mdQsem[batch, head, None]
        sem_ptr = sem.iterator + m_block
        turn = n_block - _n_block_first(cfg, prob, m_block)
        if tidx == 0:
            seen = cute.arch.load(sem_ptr, Int32, sem="acquire", scope="gpu")
            while seen != turn:
                seen = cute.arch.load(sem_ptr, Int32, sem="acquire", scope="gpu")
        cute.arch.barrier(barrier_id=int(Sm90BwdBarrier.DQ_TURN),
                          number_of_threads=cfg.num_mma_threads)
    for i in cutlass.range_constexpr(cfg.dq_groups):  # one red.v4.f32 per group
        cute.arch.red(gdQ[None, i].iterator, rdQ[None, i].load().ir_value(), op="add",
                      dtype="f32", sem="relaxed", scope="gpu")
    if const_expr(cfg.deterministic):
        cute.arch.fence_acq_rel_gpu()
        cute.arch.barrier(barrier_id=int(Sm90BwdBarrier.DQ_DONE),
                          number_of_threads=cfg.num_mma_threads)
        if tidx == 0:
            cute.arch.red(mdQsem[batch, head, None].iterator + m_block, Int32(1), op="add",
                          dtype="s32", sem="release", scope="gpu")


@cute.jit
def store_dkdv_tma(cfg, mmas, out, mbar_kv, acc_dK, acc_dV, tile):
    """MHA dK (scaled by the caller) and dV -> SMEM (``out.staging``: K's and V's buffers,
    or with persistent CTAs the dS buffers and the dQ tile) -> GMEM by TMA (Note [dK/dV by
    TMA]). With persistent CTAs (Note [persistent CTAs] in bwd_tiles.py) the warpgroups
    tell the load warp that K and V are free (K/V empty, ``mbar_kv + 1``) right after the
    first ``EPILOGUE`` barrier, stage dK, take the dQ tile back from the dq-store warp
    (``DQ_EMPTY``, then ``EPILOGUE`` so that both halves are free) before they stage dV,
    and once the stores have read SMEM (a last ``EPILOGUE``) hand the dQ tile back
    (``DQ_FULL``); the dS buffers need no hand-off."""
    n_block, head, batch = tile.n_block, tile.head, tile.batch
    tidx, dtype = mmas.tidx, cutlass_dtype(cfg.dtype)
    persistent = cfg.persistent_ctas > 0
    sK_out, sV_out = out.staging
    rdK, rdV = _in_dtype(acc_dK, dtype), _in_dtype(acc_dV, dtype)
    # every dQ GEMM (reads K) and S/dP GEMM (K, V) of both warpgroups has retired
    cute.arch.barrier(barrier_id=int(Sm90BwdBarrier.EPILOGUE),
                      number_of_threads=cfg.num_mma_threads)
    if const_expr(persistent):
        if tidx == 0:  # K/V empty: the next tile's K and V may load
            cute.arch.mbarrier_arrive(mbar_kv + 1)
    stmatrix_to_smem(mmas.dk, dtype, tidx, rdK, sK_out, cfg.dkv_swap_ab)
    if const_expr(persistent):  # the dq-store warp's last reduce of the tile has read sdQ
        _dq_handoff_barrier(cfg, Sm90BwdBarrier.DQ_EMPTY_WG0, tidx, wait=True)
        cute.arch.barrier(barrier_id=int(Sm90BwdBarrier.EPILOGUE),
                          number_of_threads=cfg.num_mma_threads)
    stmatrix_to_smem(mmas.dv, dtype, tidx, rdV, sV_out, cfg.dkv_swap_ab)
    cute.arch.fence_view_async_shared()
    cute.arch.barrier(barrier_id=int(Sm90BwdBarrier.EPILOGUE),
                      number_of_threads=cfg.num_mma_threads)
    if tidx // WARP_SIZE == 0:
        one = cute.make_layout(1)
        for tma, m_out, s_tile, cols in ((out.tma_dk, out.tma_mdk, sK_out, cfg.head_dim),
                                         (out.tma_dv, out.tma_mdv, sV_out, cfg.head_dim_v)):
            # varlen: the sequence's ragged rows (s, d, h), rows past its keys clipped
            m_bh = m_out[None, None, head] if const_expr(cfg.varlen) else m_out[None, None, head,
                                                                                  batch]
            g_tile = cute.local_tile(m_bh, (cfg.tile_n, cols), (n_block, 0))
            t_s, t_g = cpasync.tma_partition(tma, 0, one, cute.group_modes(s_tile, 0, 2),
                                             cute.group_modes(g_tile, 0, 2))
            cute.copy(tma, t_s, t_g)
        cute.arch.cp_async_bulk_commit_group()
        cute.arch.cp_async_bulk_wait_group(0, read=True)  # SMEM is read before the exit
    if const_expr(persistent):  # ... and before the next tile writes dS and dQ there
        cute.arch.barrier(barrier_id=int(Sm90BwdBarrier.EPILOGUE),
                          number_of_threads=cfg.num_mma_threads)
        _dq_handoff_barrier(cfg, Sm90BwdBarrier.DQ_FULL_WG0, tidx, wait=False)


@cute.jit
def _in_dtype(acc, dtype):
    """An accumulator converted to ``dtype`` (a new register fragment)."""
    out = cute.make_fragment_like(acc, dtype)
    out.store(acc.load().to(dtype))
    return out


@cute.jit
def store_dkdv(cfg, prob, gmem, mmas, acc_dK, acc_dV, tile):
    """dK (scaled by the caller) and dV of this key block to global memory.

    MHA: converted to the input dtype and stored into (batch, seqlen_k, heads, hdim), rows
    past seqlen_k skipped. GQA ``buffers``: float32 stores into this query head's slice of
    (batch, heads, seqlen_k_pad, hdim). GQA ``atomic``: float32 ``red.add`` into the KV
    head's slice of (batch, heads_kv, seqlen_k_pad, hdim)."""
    n_block = tile.n_block
    gqa = cfg.uses_gqa_buffers
    atomic = gqa and cfg.gqa_reduce == "atomic"
    for mma, acc, mOut, cols in ((mmas.dk, acc_dK, gmem.mdK, cfg.head_dim),
                                 (mmas.dv, acc_dV, gmem.mdV, cfg.head_dim_v)):
        thr = mma.get_slice(mmas.tidx)
        g_tile = _dkv_gmem_tile(cfg, prob, mOut, tile, cols)
        # Note [dK/dV transposed]: the accumulator is the tile's transpose
        key = 1 if const_expr(cfg.dkv_swap_ab) else 0
        t_g = thr.partition_C(_acc_view(cfg, g_tile))
        if const_expr(not gqa):
            t_c = thr.partition_C(cute.make_identity_tensor(cfg.dkv_tile_shape(cols)))
            regs = _in_dtype(acc, cutlass_dtype(cfg.dtype))
            for i in cutlass.range_constexpr(cute.size(acc)):
                if n_block * cfg.tile_n + t_c[i][key] < prob.seqlen_k:
                    t_g[i] = regs[i]
        elif const_expr(atomic):
            for i in cutlass.range_constexpr(cute.size(acc)):
                cute.arch.red(t_g.iterator + cute.crd2idx(i, t_g.layout), acc[i],
                              op="add", dtype="f32", sem="relaxed", scope="gpu")
        else:
            for i in cutlass.range_constexpr(cute.size(acc)):
                t_g[i] = acc[i]


@cute.jit
def store_dkdv_bulk(cfg, prob, gmem, mmas, acc_dK, acc_dV, tile, staging):
    """GQA ``bulk`` (Note [dK/dV by bulk reduces]): dK (scaled by the caller) and dV into
    their float32 SMEM tiles ``staging`` (row-major, over the Q and dO stages and over K and
    V), each warpgroup's rows added into its KV head's slice of (batch, heads_kv,
    seqlen_k_pad, hdim) by one ``cp.reduce.async.bulk.add.f32`` each."""
    tidx = mmas.tidx
    wg = tidx // WARPGROUP_THREADS
    rows = cfg.tile_n // cfg.num_mma_warpgroups  # each warpgroup's keys: whole rows
    # every GEMM of both warpgroups has retired: Q, dO, K and V are free
    cute.arch.barrier(barrier_id=int(Sm90BwdBarrier.EPILOGUE),
                      number_of_threads=cfg.num_mma_threads)
    outs = []
    for mma, acc, mOut, cols, base in ((mmas.dk, acc_dK, gmem.mdK, cfg.head_dim, staging[0]),
                                       (mmas.dv, acc_dV, gmem.mdV, cfg.head_dim_v, staging[1])):
        s_tile = cute.make_tensor(base, cute.make_layout((cfg.tile_n, cols), stride=(cols, 1)))
        t_s = mma.get_slice(tidx).partition_C(_acc_view(cfg, s_tile))
        for i in cutlass.range_constexpr(cute.size(acc)):
            t_s[i] = acc[i]
        outs.append((mOut, cols, s_tile))
    cute.arch.fence_view_async_shared()
    # this warpgroup's rows are in SMEM
    cute.arch.barrier(barrier_id=int(Sm90BwdBarrier.P_READY_WG0) + wg,
                      number_of_threads=WARPGROUP_THREADS)
    if tidx % WARPGROUP_THREADS == 0:
        for mOut, cols, s_tile in outs:
            g_tile = _dkv_gmem_tile(cfg, prob, mOut, tile, cols)
            prims.cp_reduce_async_bulk_global_shared_cta(
                g_tile.iterator + wg * rows * cols, s_tile.iterator + wg * rows * cols,
                rows * cols * (Float32.width // 8), op=prims.CpReduceOp.ADD,
                type=prims.CpReduceType.F32)
        cute.arch.cp_async_bulk_commit_group()
        cute.arch.cp_async_bulk_wait_group(0, read=True)  # SMEM is read before the CTA exits


def _acc_view(cfg, t):
    """A (keys, cols) tile as the dK / dV accumulator's shape: itself, or its transpose
    (Note [dK/dV transposed])."""
    return transpose_view(t) if cfg.dkv_swap_ab else t


@cute.jit
def _dkv_gmem_tile(cfg, prob, mOut, tile, cols):
    """This key block's (tile_n, cols) tile of dK / dV: of (batch, seqlen_k, heads, hdim)
    (MHA), of this query head's float32 buffer (GQA ``buffers``), or of its KV head's
    (``atomic``, ``bulk``)."""
    n_block, head, batch = tile.n_block, tile.head, tile.batch
    if const_expr(not cfg.uses_gqa_buffers):
        g_out = mOut[batch, None, head, None]
    elif const_expr(cfg.gqa_reduce == "buffers"):
        g_out = mOut[batch, head, None, None]
    else:
        g_out = mOut[batch, head // prob.group, None, None]
    return cute.local_tile(g_out, (cfg.tile_n, cols), (n_block, 0))
