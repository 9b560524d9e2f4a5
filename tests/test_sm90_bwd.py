"""SM90 backward, CPU side: config rules, input validation, block ranges, compile contract.

- ``BwdConfig.validate`` and ``sm90_bwd`` raise ValueError naming the rule, before any compile
  or launch (checked with CPU tensors, which never reach a kernel). The device rule (CUDA
  tensors on an sm_90 GPU) comes last; a non-sm_90 GPU is faked with FakeTensorMode.
- The query-block ranges the kernel walks (``m_block_range``, the same function the kernel
  traces) cover every visible (query, key) pair, and the key blocks adding into one query
  block are consecutive from ``first_n_block`` (what deterministic dQ ordering relies on).
- Launch order (Note [longest first]): ``longest_first_cta`` renumbers every CTA once, keeps
  the grid's order before the tail and increasing key blocks within every pair (what the
  deterministic semaphore's progress needs); the tail is whole pairs; causal problems
  without a left window take it by default; the main loop is unchanged by it.
- Compile contract (sm_90a cross-compile through ``fa_sm100.inspection.inspect_kernel``):
  384 threads, HGMMA present, setmaxnreg 24/240 in the PTX and the SASS, no local memory or
  spills, SMEM within the 227 KiB budget, and the dQ path the config asks for
  (UBLKRED bulk reduce, or REDG float adds); the preprocess and postprocess kernels compile.
  The five GEMMs stay five WGMMA groups (one ``gsb0`` commit each: ptxas did not serialize
  them). ``sdp_swap_ab``: dV and dK become RS HGMMAs (a register A operand in the SASS), the P
  stmatrix is gone and dS is stored with the transposing stmatrix, in 16 KiB less SMEM.
- ``tile_m=128`` (swapped, hdim 64): the config rules, block ranges and compile contract at
  128 query rows, twice the RS K slices, N = 128 S^T/dP^T, and the LSE2/Delta shuffle of
  Note [tile_m 128] checked against the real WGMMA accumulator partition.
"""

import collections
import glob
import re

import pytest
import torch

from fa_sm100.config import launch_registers
from fa_sm100.hopper.bwd_config import SM90_SMEM_BYTES, BwdConfig
from fa_sm100.hopper.bwd_defaults import DP_WAIT_AFTER_80, select_bwd_config
from fa_sm100.hopper.bwd_interface import sm90_bwd
from fa_sm100.hopper.inspect_bwd import make_config as make_sm90_bwd_config
from fa_sm100.hopper.bwd_tiles import (first_n_block, longest_first_cluster_cta,
                                       longest_first_cta, longest_first_tail_pairs,
                                       m_block_range, stagger_offset, staggered_m_block)
from fa_sm100.testing import attention_mask
from kept_sass import main_loop_ops, read_kept_sass
from script_loader import load_script


# ---- config rules ------------------------------------------------------------------------

@pytest.mark.parametrize("changes,rule", [
    (dict(head_dim=256, head_dim_v=128), "head dims"),
    (dict(head_dim=192, head_dim_v=192), "head dims"),
    (dict(head_dim_v=64), "head dims"),
    (dict(head_dim=256, head_dim_v=256), "tile_n=128 with head_dim=256"),
    (dict(head_dim=192, head_dim_v=128, early_dv=False), "tile_n=128 with head_dim=192"),
    (dict(tile_n=64), "tile_n=64 needs early_dv=False"),
    (dict(tile_n=64, early_dv=False, sdp_swap_ab=True), "tile_n=64 needs sdp_swap_ab=False"),
    (dict(tile_n=64, early_dv=False, dv_before_barrier=True),
     "tile_n=64 needs dv_before_barrier=False"),
    (dict(tile_m=128), "tile_m=128 needs sdp_swap_ab=True"),
    (dict(tile_m=128, sdp_swap_ab=True, head_dim=128, head_dim_v=128),
     "tile_m=128 with head_dim=128"),
    (dict(tile_m=128, sdp_swap_ab=True, head_dim=96, head_dim_v=96), "tile_m=128 with head_dim=96"),
    (dict(tile_m=96, sdp_swap_ab=True), "tile_m=96"),
    (dict(tile_m=80), "tile_m=80 needs sdp_swap_ab=True"),
    (dict(tile_m=80, sdp_swap_ab=True, head_dim=64, head_dim_v=64), "tile_m=80 needs"),
    (dict(tile_m=32), "tile_m=32"),
    (dict(tile_n=96), "tile_n=96 needs dkv_swap_ab=True"),
    (dict(tile_n=80), "tile_n=80"),
    (dict(dkv_swap_ab=1), "dkv_swap_ab=1: must be a bool"),
    (dict(gqa_reduce="bulk", tile_n=64, early_dv=False), "gqa_reduce='bulk' needs"),
    (dict(gqa_reduce="bulk", q_stage=1, do_stage=1), "gqa_reduce='bulk' needs"),
    (dict(gqa_reduce="bulk", qhead_per_kvhead=4, deterministic=True), "deterministic=True"),
    (dict(dkv_swap_ab=True, sdp_swap_ab=True), "dkv_swap_ab=True needs sdp_swap_ab=False"),
    (dict(dkv_swap_ab=True, tile_n=64, early_dv=False), "dkv_swap_ab=True needs tile_n"),
    (dict(head_dim=256, head_dim_v=256, tile_n=96, dkv_swap_ab=True), "192 float32 registers"),
    (dict(head_dim=192, head_dim_v=128, tile_n=96, dkv_swap_ab=True, persistent_ctas=132),
     "persistent_ctas=132 needs dkv_swap_ab=False"),
    (dict(q_stage=4), "q_stage=4"),
    (dict(do_stage=0), "do_stage=0"),
    (dict(q_stage=3, do_stage=3), "exceeds the SM90 budget"),  # with the SMEM dQ tile
    (dict(gqa_reduce="tree"), "gqa_reduce"),
    (dict(dq_accum="tma"), "dq_accum"),
    (dict(qhead_per_kvhead=4, deterministic=True, gqa_reduce="atomic"), "deterministic"),
    (dict(regs_mma=250), "setmaxnreg"),
    (dict(regs_producer=64, regs_mma=248), "register budget"),
    (dict(regs_producer=32), "exceeds the 64512 registers a CTA of 384 threads .*hang"),
    (dict(window_left=2.5), "window_left"),
    (dict(window_right=True), "window_right"),
    (dict(dtype="float32"), "dtype"),
    (dict(sdp_swap_ab=1), "sdp_swap_ab"),
    (dict(sdp_swap_ab="true"), "sdp_swap_ab"),
    (dict(overlap_dk=1), "overlap_dk"),
    (dict(overlap_dk=True, sdp_swap_ab=True), "needs sdp_swap_ab=False"),
    (dict(overlap_dk=True, q_stage=1), "needs q_stage >= 2"),
    (dict(dv_before_barrier=True, early_dv=True), "needs early_dv=False"),
    (dict(stats_first=1), "stats_first=1: must be a bool"),
    (dict(dv_before_fence="yes"), "dv_before_fence='yes': must be a bool"),
    (dict(longest_first=1), "longest_first=1: must be a bool"),
    (dict(tail_ctas=0), "tail_ctas=0: must be an int >= 1"),
    (dict(tail_ctas=True), "tail_ctas=True: must be an int >= 1"),
    (dict(tail_ctas=2.5), "tail_ctas=2.5: must be an int >= 1"),
    (dict(qdo_multicast=1), "qdo_multicast=1: must be a bool"),
    (dict(qdo_multicast=True, window_left=64), "qdo_multicast=True without a window"),
    (dict(qdo_multicast=True, causal=True, window_right=8), "qdo_multicast=True without a window"),
    (dict(qdo_multicast=True, deterministic=True), "qdo_multicast=True without deterministic"),
    (dict(qdo_cluster=3), "qdo_cluster=3: must be one of"),
    (dict(stagger_m=1), "stagger_m=1: must be a bool"),
    (dict(stagger_m=True, causal=True), "stagger_m=True needs a problem without a causal"),
    (dict(stagger_m=True, window_left=64), "stagger_m=True needs a problem without a causal"),
    (dict(stagger_m=True, deterministic=True), "not deterministic"),
    (dict(lse_early=1), "lse_early=1: must be a bool"),
    (dict(lse_early=True, tile_m=80, sdp_swap_ab=True), "lse_early=True needs stats_shuffle"),
    (dict(lse_early=True, tile_m=128, sdp_swap_ab=True, head_dim=64, head_dim_v=64),
     "lse_early=True needs stats_shuffle=False"),
    (dict(dp_wait_after=-2), "dp_wait_after=-2: must be an int >= -1"),
    (dict(dp_wait_after=True), "dp_wait_after=True: must be an int >= -1"),
])
def test_bad_config_raises_value_error_naming_the_rule(changes, rule):
    with pytest.raises(ValueError, match=rule):
        BwdConfig().replace(**changes).validate()


def test_default_configs_fit_smem_and_follow_the_measured_choices():
    for d in (64, 96, 128, 192, 256):
        for kw in (dict(), dict(causal=True), dict(qhead_per_kvhead=4, deterministic=True)):
            cfg = select_bwd_config(head_dim=d, **kw)
            assert cfg.smem_bytes() <= SM90_SMEM_BYTES
            # Note [dK/dV by columns]: hdim 256, and only that; (192, 128) transposed with 96
            # keys (Note [dK/dV transposed]), everything else 128 keys
            assert cfg.dkv_split_cols == (d == 256)
            assert cfg.dkv_swap_ab == (d == 192)
            assert cfg.tile_n == {192: 96, 256: 64}.get(d, 128)
            # each warpgroup's keys are whole P / dS swizzle atoms
            assert cfg.keys_per_warpgroup % cfg.ps_atom_cols == 0 or cfg.dkv_split_cols
    assert select_bwd_config(head_dim=192).head_dim_v == 128
    assert select_bwd_config(head_dim=256).head_dim_v == 256
    # dQ by vector reductions at hdim 256 only (2-stage Q/dO fit there only without the SMEM
    # dQ tile), the SMEM tile elsewhere
    for d in (64, 96, 128, 192, 256):
        cfg = select_bwd_config(head_dim=d)
        assert cfg.dq_accum == ("red" if d == 256 else "bulk")
        assert (cfg.q_stage, cfg.do_stage) == (2, 2)
    # tile_n=64 asked for at a narrow head dim takes the mode's other defaults
    for d, causal in ((64, False), (64, True), (128, False), (128, True)):
        cfg = select_bwd_config(head_dim=d, causal=causal, tile_n=64)
        assert cfg.dkv_split_cols and cfg.tile_m == 64 and not cfg.sdp_swap_ab
        assert not cfg.early_dv and not cfg.dv_before_barrier
    # GQA: bulk reduces into one buffer per KV head, except where an order is asked for
    # (deterministic) or the warpgroups split dK / dV by columns (hdim 256)
    for d in (64, 96, 128, 192, 256):
        for det in (False, True):
            cfg = select_bwd_config(head_dim=d, qhead_per_kvhead=4, deterministic=det)
            assert cfg.gqa_reduce == ("buffers" if det or d == 256 else "bulk")
            assert cfg.gqa_reduce != "bulk" or cfg.bulk_dkv_fits()
    assert select_bwd_config(qhead_per_kvhead=4, gqa_reduce="atomic").gqa_reduce == "atomic"
    # early dV: unswapped 64-row blocks (hdim 96), non-causal problems only
    assert select_bwd_config(head_dim=96).early_dv
    assert not select_bwd_config(head_dim=96, causal=True).early_dv
    assert not select_bwd_config(head_dim=96, window_left=10).early_dv
    # hdim 128 (Note [dQ transposed]): 80 swapped rows, dV before the dS barrier, every problem
    # without a window (windows: test_short_bands_at_hdim128_take_64_row_blocks)
    for kw in (dict(), dict(causal=True), dict(qhead_per_kvhead=4)):
        cfg = select_bwd_config(head_dim=128, **kw)
        assert (cfg.tile_m, cfg.sdp_swap_ab, cfg.dq_swap_ab) == (80, True, True)
        assert cfg.dv_before_barrier and not cfg.early_dv
    with pytest.raises(ValueError, match="deterministic"):
        select_bwd_config(qhead_per_kvhead=4, deterministic=True, gqa_reduce="atomic")
    assert not select_bwd_config(head_dim=96).sdp_swap_ab
    assert select_bwd_config(head_dim=96, sdp_swap_ab=True).sdp_swap_ab
    assert not select_bwd_config().overlap_dk
    assert select_bwd_config(head_dim=96, overlap_dk=True).overlap_dk
    # Note [try first]: on everywhere (round 30 timed the swapped 64-row blocks with a left
    # window, off until then: a tie)
    for kw in (dict(), dict(causal=True), dict(head_dim=64, window_left=10),
               dict(window_left=10), dict(window_left=10, tile_m=64),
               dict(window_left=10, sdp_swap_ab=False), dict(causal=True, stats_smem=False)):
        assert select_bwd_config(**kw).try_wait, kw
    assert not select_bwd_config(try_wait=False).try_wait
    # Note [dQ SMEM handoff]: per warpgroup, except deterministic with a left window (one
    # handoff measured faster there)
    assert select_bwd_config().dq_handoff_per_wg
    assert select_bwd_config(window_left=10).dq_handoff_per_wg
    assert select_bwd_config(deterministic=True, causal=True).dq_handoff_per_wg
    assert not select_bwd_config(deterministic=True, window_left=10).dq_handoff_per_wg
    assert not select_bwd_config(dq_handoff_per_wg=False).dq_handoff_per_wg
    # Note [tile_m 128]: 128-row blocks shuffle their stats unless asked not to; 64-row blocks
    # have nothing to shuffle
    assert select_bwd_config(head_dim=64).shuffled_stats
    assert not select_bwd_config(head_dim=64, stats_shuffle=False).shuffled_stats
    assert not select_bwd_config(head_dim=96).shuffled_stats
    # Note [dP wait placement]: 80-row blocks load their own stats, LSE2 early, and place the
    # dP wait, causal or not; asked to shuffle, the loop before it (no boundary)
    for kw in (dict(), dict(causal=True, seqlen_q=16384, seqlen_k=16384)):
        cfg = select_bwd_config(**kw)
        assert cfg.tile_m == 80 and not cfg.shuffled_stats, kw
        assert cfg.lse_early and cfg.dp_wait_after == DP_WAIT_AFTER_80, kw
    shuffled = select_bwd_config(stats_shuffle=True)
    assert shuffled.shuffled_stats and not shuffled.lse_early and shuffled.dp_wait_after == -1
    assert select_bwd_config(dp_wait_after=20).dp_wait_after == 20
    for kw in (dict(head_dim=64), dict(causal=True, seqlen_q=2048, seqlen_k=2048),
               dict(head_dim=256)):
        cfg = select_bwd_config(**kw)
        assert not cfg.lse_early and cfg.dp_wait_after == -1, kw
    # ... only where they compile without spills (_own_stats_fit): not with persistent CTAs,
    # nor causal without multicast or with GQA; asked for, they are taken anyway
    for kw in (dict(seqlen_q=1024, seqlen_k=1024), dict(causal=True),
               dict(causal=True, deterministic=True),
               dict(causal=True, seqlen_q=16384, seqlen_k=16384, qhead_per_kvhead=4)):
        cfg = select_bwd_config(**kw)
        assert cfg.tile_m == 80 and cfg.shuffled_stats and cfg.dp_wait_after == -1, kw
    for kw in (dict(deterministic=True), dict(qhead_per_kvhead=4)):
        assert select_bwd_config(**kw).dp_wait_after == DP_WAIT_AFTER_80, kw
    asked = select_bwd_config(causal=True, stats_shuffle=False)
    assert asked.lse_early and asked.dp_wait_after == DP_WAIT_AFTER_80


def test_short_bands_at_hdim128_take_64_row_blocks():
    """Causal hdim 128 up to SHORT_CAUSAL_SEQLEN (both lengths), and every windowed hdim 128
    problem, take FA4's causal tile: 64-row blocks with dV before the dS barrier and the stats
    before the GEMMs; longer or non-causal problems without a window, or without lengths,
    keep 80-row blocks; other head dims and explicit fields are untouched."""
    from fa_sm100.hopper.bwd_defaults import SHORT_CAUSAL_SEQLEN

    def pick(**kw):
        cfg = select_bwd_config(head_dim=kw.pop("head_dim", 128), **kw)
        return cfg.tile_m, cfg.dv_before_barrier, cfg.early_dv

    def stats_first(**kw):
        return select_bwd_config(head_dim=kw.pop("head_dim", 128), **kw).stats_first

    for s in (1, 1000, SHORT_CAUSAL_SEQLEN):
        assert pick(causal=True, seqlen_q=s, seqlen_k=s) == (64, True, False)
        assert stats_first(causal=True, seqlen_q=s, seqlen_k=s)  # Note [stats before the GEMMs]
    assert not stats_first(causal=True, seqlen_q=8192, seqlen_k=8192)
    assert not stats_first(causal=False, seqlen_q=1024, seqlen_k=1024)
    assert not stats_first(head_dim=96, causal=True, seqlen_q=1024, seqlen_k=1024)
    assert not stats_first(causal=True, seqlen_q=1024, seqlen_k=1024, stats_first=False)
    assert pick(causal=True, seqlen_q=SHORT_CAUSAL_SEQLEN + 1, seqlen_k=1000) == (80, True, False)
    assert pick(causal=True, seqlen_q=1000, seqlen_k=SHORT_CAUSAL_SEQLEN + 1)[0] == 80
    assert pick(causal=True, seqlen_q=8192, seqlen_k=8192)[0] == 80
    assert pick(causal=True)[0] == 80  # lengths unknown (inspect.py, direct config builds)
    assert pick(causal=False, seqlen_q=1024, seqlen_k=1024)[0] == 80
    # windows, whatever their size or sides; lengths not needed
    for kw in (dict(window_left=4096, window_right=0), dict(window_left=0, window_right=384),
               dict(causal=True, window_left=64), dict(window_left=512),
               dict(causal=True, window_left=512, seqlen_q=16384, seqlen_k=16384),
               dict(window_left=100, window_right=30, qhead_per_kvhead=4),
               dict(window_right=0), dict(window_left=8192, window_right=8192)):
        assert pick(**kw) == (64, True, False) and stats_first(**kw), kw
    assert pick(head_dim=64, window_left=512, window_right=0)[0] == 128
    assert pick(head_dim=64, causal=True, seqlen_q=1024, seqlen_k=1024)[0] == 128
    assert pick(head_dim=96, causal=True, seqlen_q=1024, seqlen_k=1024) == (64, False, False)
    assert pick(causal=True, seqlen_q=1024, seqlen_k=1024, tile_m=80)[0] == 80
    assert pick(causal=True, seqlen_q=1024, seqlen_k=1024, dv_before_barrier=False)[1] is False
    assert pick(causal=True, seqlen_q=1024, seqlen_k=1024, early_dv=True) == (64, False, True)


def test_tile_m_128_is_swapped_hdim64_only_and_overridable():
    """tile_m=128 (Note [tile_m 128]): allowed with sdp_swap_ab at hdim 64, reachable through
    select_bwd_config, fits SMEM with 2-stage Q/dO; the measured defaults: swapped with 128
    rows at hdim 64, swapped with 80 rows at hdim 128 (Note [dQ transposed]), 64 rows
    everywhere else."""
    for causal in (False, True):
        assert select_bwd_config(head_dim=64, causal=causal).tile_m == 128
        assert select_bwd_config(head_dim=64, causal=causal).sdp_swap_ab
        assert select_bwd_config(head_dim=64, causal=causal, sdp_swap_ab=False).tile_m == 64
        assert select_bwd_config(head_dim=96, causal=causal).tile_m == 64
        assert not select_bwd_config(head_dim=96, causal=causal).sdp_swap_ab
        assert select_bwd_config(head_dim=128, causal=causal).tile_m == 80
        assert select_bwd_config(head_dim=128, causal=causal).sdp_swap_ab
        assert select_bwd_config(head_dim=128, causal=causal, sdp_swap_ab=False).tile_m == 64
    assert select_bwd_config(head_dim=96, sdp_swap_ab=True).tile_m == 64
    assert select_bwd_config(head_dim=128, sdp_swap_ab=True, tile_m=64).dv_before_barrier is False
    for kw in (dict(), dict(causal=True), dict(qhead_per_kvhead=4, deterministic=True),
               dict(window_left=100, window_right=0), dict(dq_accum="red")):
        cfg = select_bwd_config(head_dim=64, tile_m=128, sdp_swap_ab=True, **kw)
        assert cfg.tile_m == 128 and cfg.sdp_swap_ab and cfg.dq_split_rows
        assert cfg.smem_bytes() <= SM90_SMEM_BYTES
    cfg = select_bwd_config(head_dim=64, tile_m=128, sdp_swap_ab=True)
    # Q, dO: 2 x 2 x 16 KiB; K, V: 2 x 16 KiB; dS: 2 x 32 KiB; dQ: 128 x 64 x 4 B (fragment
    # order, no padding); LSE2, Delta: 2 stages x 128 x 4 B each (stats_smem)
    assert cfg.smem_bytes() == (1024 + 4 * 16384 + 2 * 16384 + 2 * 32768 + 128 * 64 * 4
                                + 2 * 2 * 128 * 4)
    assert cfg.replace(stats_smem=False).smem_bytes() == cfg.smem_bytes() - 2 * 2 * 128 * 4
    assert not select_bwd_config(head_dim=64, tile_m=64).dq_split_rows
    with pytest.raises(ValueError, match="needs sdp_swap_ab=True"):
        select_bwd_config(head_dim=64, tile_m=128, sdp_swap_ab=False)
    with pytest.raises(ValueError, match="head_dim=128"):
        select_bwd_config(head_dim=128, tile_m=128, sdp_swap_ab=True)


def test_tile_m_128_stat_shuffle_sources_are_a_bijection():
    """Note [tile_m 128]: the 4 LSE2/Delta values a lane holds (``held_query``) are 128
    distinct queries, and ``query_stat_source`` inverts it for every column of a lane group."""
    from fa_sm100.hopper.bwd_scores import held_query, query_stat_source

    held = {held_query(lane, slot): (lane, slot) for lane in range(32) for slot in range(4)}
    assert sorted(held) == list(range(128))
    for q0 in [8 * j + p for j in range(16) for p in (0, 1)]:  # thread 0's columns
        for lane in range(32):
            base, slot = query_stat_source(q0)
            assert held_query(base + lane % 4, slot) == q0 + 2 * (lane % 4)


@pytest.mark.compile
@pytest.mark.parametrize("tile_m,head_dim", [(128, 64), (80, 128)], ids=["tile_m128", "tile_m80"])
def test_stat_shuffle_matches_the_wgmma_accumulator_layout(tile_m, head_dim):
    """The shuffle of Note [tile_m 128] assumes that every thread's S^T query columns are thread
    0's plus 2 (lane % 4). Read the real partition of the S^T tiled MMA (tile_m 128, and 80:
    Note [dQ transposed]) for the lanes of one warp per warpgroup while cross-compiling, and
    check that each column's value is fetched from the lane and slot that hold it, and, at
    80 rows, that a slot-2/3 value comes from a lane that ``_shuffled_stats`` loaded (lanes
    0-7: 64 + 2 lane < 80)."""
    import cutlass
    import cutlass.cute as cute

    from fa_sm100.hopper.bwd_kernel import Sm90FlashBackward
    from fa_sm100.hopper.bwd_scores import held_query, query_stat_source
    from fa_sm100.hopper.common import rows_cols_view

    cfg = select_bwd_config(head_dim=head_dim, tile_m=tile_m, sdp_swap_ab=True)
    kernel = Sm90FlashBackward(cfg)
    cols = {}

    @cute.jit
    def probe():
        mma_sdp = kernel._tiled_mmas()[0]
        ident = cute.make_identity_tensor((cfg.tile_n, cfg.tile_m))
        for lane in cutlass.range_constexpr(32):
            for t in (lane, 160 + lane):  # warp 0 (warpgroup 0), warp 5 (warpgroup 1)
                rc = rows_cols_view(mma_sdp.get_slice(t).partition_C(ident))
                cols[t] = [int(rc[0, c][1]) for c in range(cute.size(rc, mode=[1]))]

    cute.compile(probe, options="--gpu-arch sm_90a")
    per_thread = tile_m // 4
    assert len(cols) == 64 and all(len(v) == per_thread for v in cols.values())
    assert cols[5][:4] == [2, 3, 10, 11]  # lane 5: 2 (5 % 4) + {0, 1} + 8 j
    for t, qs in cols.items():
        lane = t % 32
        for c, q in enumerate(qs):
            base, slot = query_stat_source(cols[0][c])
            src = base + lane % 4
            assert held_query(src, slot) == q, (t, c, q)
            assert slot < 2 or 2 * src < tile_m - 64, (t, c, src, slot)  # a loaded slot
        # every thread sees distinct queries, and the 4 lanes of a row group all tile_m
        assert len(set(qs)) == per_thread
    assert sorted(q for t in range(4) for q in cols[t]) == list(range(tile_m))


def test_swapped_sdp_has_no_p_buffer():
    for d in (64, 96, 128):
        plain = select_bwd_config(head_dim=d, sdp_swap_ab=False)
        swapped = plain.replace(sdp_swap_ab=True).validate()
        assert plain.smem_bytes() - swapped.smem_bytes() == plain.tile_m * plain.tile_n * 2


# ---- input validation (CPU tensors never reach a kernel) ----------------------------------

def _cpu_inputs(b=1, sq=32, sk=32, hq=2, hk=2, d=64, dtype=torch.bfloat16, dv=None):
    dv = d if dv is None else dv
    q = torch.randn(b, sq, hq, d, dtype=dtype)
    k = torch.randn(b, sk, hk, d, dtype=dtype)
    v = torch.randn(b, sk, hk, dv, dtype=dtype)
    out, dout = torch.randn(b, sq, hq, dv, dtype=dtype), torch.randn(b, sq, hq, dv, dtype=dtype)
    lse = torch.randn(b, hq, sq, dtype=torch.float32)
    return dout, q, k, v, out, lse


@pytest.mark.parametrize("mutate,msg", [
    (lambda a: a.__setitem__(1, a[1].float()), "dtype"),
    (lambda a: a.__setitem__(slice(2, 4), [a[2][:, :, :1].repeat(1, 1, 3, 1)] * 2),
     "multiple of kv heads"),
    (lambda a: a.__setitem__(5, a[5][:, :, :-1]), "lse must be float32 of shape"),
    (lambda a: a.__setitem__(5, a[5].double()), "lse must be float32"),
    (lambda a: a.__setitem__(4, a[4][:, :-1]), "out"),
    (lambda a: a.__setitem__(3, a[3][:, :-1]), "same batch, seqlen, heads"),
    (lambda a: a.__setitem__(1, a[1][..., 0]), "4-D"),
    (lambda a: a.__setitem__(1, a[1].transpose(1, 3)), "contiguous in its last"),
])
def test_bad_inputs_raise_value_error(mutate, msg):
    args = list(_cpu_inputs())
    mutate(args)
    with pytest.raises(ValueError, match=msg):
        sm90_bwd(*args)


def test_unsupported_head_dim_and_window_raise():
    for d, dv in ((80, 80), (256, 128), (192, 192)):
        with pytest.raises(ValueError, match=rf"head dims \(qk={d}, v={dv}\) are not supported"):
            sm90_bwd(*_cpu_inputs(d=d, dv=dv))
    # out/dout take v's head dim
    dout, q, k, v, out, lse = _cpu_inputs(d=192, dv=128)
    with pytest.raises(ValueError, match="v's head dim"):
        sm90_bwd(dout, q, k, v, torch.randn_like(q), lse)
    for d, dv in ((192, 128), (256, 256)):  # supported: the device rule is reached
        with pytest.raises(ValueError, match="CUDA"):
            sm90_bwd(*_cpu_inputs(d=d, dv=dv))
    with pytest.raises(ValueError, match="window_size"):
        sm90_bwd(*_cpu_inputs(), window_size=(1.5, None))
    # A bool is an int to Python, but not a window size.
    with pytest.raises(ValueError, match="window_size"):
        sm90_bwd(*_cpu_inputs(), window_size=(True, None))
    with pytest.raises(ValueError, match="window_size"):
        sm90_bwd(*_cpu_inputs(), window_size=(None, False))


@pytest.mark.parametrize("scale", [-1.0, 0.0, float("nan"), float("inf"), "0.1", True])
def test_bad_softmax_scale_raises(scale):
    with pytest.raises(ValueError, match="softmax_scale"):
        sm90_bwd(*_cpu_inputs(), softmax_scale=scale)


def test_bad_flags_raise():
    with pytest.raises(ValueError, match="causal must be a bool"):
        sm90_bwd(*_cpu_inputs(), causal=1)
    with pytest.raises(ValueError, match="deterministic must be a bool"):
        sm90_bwd(*_cpu_inputs(), deterministic="yes")


def test_valid_cpu_inputs_stop_at_the_device_check():
    """The device rule is the last one: valid CPU tensors get a ValueError naming CUDA, and
    nothing is compiled."""
    with pytest.raises(ValueError, match="CUDA"):
        sm90_bwd(*_cpu_inputs(), softmax_scale=0.1, causal=True, window_size=(8, 0))


def test_non_sm90_gpu_raises_before_anything_is_compiled(monkeypatch):
    """On a CUDA device that is not sm_90 (here an SM100 one, faked: no GPU needed), sm90_bwd
    raises ValueError naming the capability before it builds any kernel."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fa_sm100.hopper import bwd_interface

    def no_compile(*args, **kwargs):
        raise AssertionError("sm90_bwd compiled a kernel for a device it cannot run on")

    monkeypatch.setattr(bwd_interface, "_compiled", no_compile)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    with FakeTensorMode():
        args = [torch.empty(t.shape, dtype=t.dtype, device="cuda") for t in _cpu_inputs()]
        with pytest.raises(ValueError, match="sm_100"):
            sm90_bwd(*args)


def test_qdo_multicast_default_needs_aligned_pairs():
    """Note [Q/dO multicast]: on by default for non-causal problems without a window, not
    deterministic, whose key blocks come in even numbers (so ``seqlen_k`` must be known);
    off otherwise, and an explicit choice wins."""
    for d in (64, 96, 128, 192, 256):
        tile_n = select_bwd_config(head_dim=d).tile_n
        even, odd = 4 * tile_n - 3, 3 * tile_n
        cfg = select_bwd_config(head_dim=d, seqlen_q=1000, seqlen_k=even)
        assert cfg.qdo_multicast and cfg.cluster == (2, 1, 1), d
        for kw in (dict(seqlen_k=odd), dict(), dict(seqlen_k=even, causal=True),
                   dict(seqlen_k=even, window_left=64), dict(seqlen_k=even, deterministic=True),
                   dict(seqlen_k=even, qdo_multicast=False)):
            cfg = select_bwd_config(head_dim=d, **kw)
            assert not cfg.qdo_multicast and cfg.cluster == (1, 1, 1), (d, kw)


def test_dq_first_store_default_is_causal_or_staggered_with_bulk_dq():
    """Note [dQ first store] is on by default for causal problems (with or without a window,
    deterministic or not) and for staggered sweeps (non-causal hdim 128 without a window, not
    deterministic: Note [staggered query blocks]), and off for the other non-causal ones,
    where the CTAs of a pair reach each query block together (measured slower); "red" dQ
    (hdim 256's default) ignores the switch, and then the accumulator needs its zeros and only
    one semaphore per (batch, head)."""
    for d in (64, 96, 128, 192):
        for kw in ({}, dict(deterministic=True), dict(window_left=100), dict(seqlen_q=1024,
                                                                            seqlen_k=16384)):
            assert select_bwd_config(head_dim=d, causal=True, **kw).first_stores_dq, (d, kw)
            cfg = select_bwd_config(head_dim=d, **kw)
            staggered = d == 128 and not kw.get("deterministic") and "window_left" not in kw
            assert cfg.stagger_m is staggered, (d, kw)
            assert cfg.dq_first_store is cfg.first_stores_dq is staggered, (d, kw)
            assert cfg.dq_sems_per_block == (staggered or bool(kw.get("deterministic"))), (d, kw)
            off = select_bwd_config(head_dim=d, stagger_m=False, **kw)
            assert not off.dq_first_store and not off.stagger_m, (d, kw)
    red = select_bwd_config(head_dim=256, causal=True)
    assert red.dq_first_store and red.dq_accum == "red" and not red.first_stores_dq
    assert not red.dq_sems_per_block
    assert select_bwd_config(head_dim=128, dq_first_store=True).first_stores_dq


def test_early_dq_post_default_rules_and_semaphore_slots():
    """Note [dQ postprocess in the tail]: on by default at the head dims of
    EARLY_DQ_POST_HEAD_DIMS (hdim 128) wherever it can run ("bulk" dQ, chained launches), off
    elsewhere; ``validate()`` rejects it with "red" dQ or without ``pdl``. The workspace holds
    one more semaphore per (batch, head), last, for the count of finished CTAs."""
    from fa_sm100.hopper.bwd_defaults import EARLY_DQ_POST_HEAD_DIMS
    from fa_sm100.hopper.bwd_interface import workspace

    seen_on = 0
    for kw in ({}, dict(causal=True), dict(deterministic=True), dict(window_left=100),
               dict(qhead_per_kvhead=4, causal=True, seqlen_q=8192, seqlen_k=8192)):
        for d in (64, 96, 128, 192, 256):
            cfg = select_bwd_config(head_dim=d, **kw)
            on = d in EARLY_DQ_POST_HEAD_DIMS and cfg.dq_accum == "bulk"
            assert cfg.early_dq_post == on, (d, kw)
            seen_on += on
        for d in EARLY_DQ_POST_HEAD_DIMS:
            assert not select_bwd_config(head_dim=d, pdl=False, **kw).early_dq_post, (d, kw)
            assert not select_bwd_config(head_dim=d, dq_accum="red", **kw).early_dq_post, (d, kw)
    assert seen_on  # the rule was on somewhere, not only checked off
    assert select_bwd_config(head_dim=64, early_dq_post=True).early_dq_post
    for bad in (dict(dq_accum="red"), dict(pdl=False)):
        with pytest.raises(ValueError, match="early_dq_post=True needs dq_accum='bulk' and pdl"):
            select_bwd_config(head_dim=128, early_dq_post=True, **bad)
    with pytest.raises(ValueError, match="early_dq_post=1: must be a bool"):
        BwdConfig(early_dq_post=1).validate()
    # (config, slots for 13 query blocks): per block (first stores, turns) + the count
    for cfg, slots in ((select_bwd_config(head_dim=128, pre_ctas=0), 14),
                       (select_bwd_config(head_dim=128, stagger_m=False, dq_first_store=False,
                                          pre_ctas=0), 1),
                       (select_bwd_config(head_dim=64), 1),
                       (select_bwd_config(head_dim=64, deterministic=True), 13),
                       (select_bwd_config(head_dim=64, deterministic=True, early_dq_post=True),
                        14)):
        assert cfg.dq_sem_slots(13) == slots, cfg
        q = torch.empty(2, 13 * cfg.tile_m - 5, 3, cfg.head_dim)
        assert workspace(cfg, q, q)["dq_sem"].shape == (2, 3, slots)


def test_pre_ctas_rules_semaphore_slot_and_zeroed_semaphores():
    """Note [Preprocess beside the main kernel]: ``validate()`` takes ``pre_ctas`` >= 0 (an
    int) and only with "bulk" dQ and ``stats_smem`` (the MMA warpgroups then read nothing the
    preprocess writes); the workspace holds one more semaphore per (batch, head), last, for
    the count of finished rows (after the finished-CTA count of ``early_dq_post``), and
    arrives zeroed (torch.zeros) as the preprocess no longer zeroes it."""
    from fa_sm100.hopper.bwd_interface import workspace

    for bad in (-1, True, 2.0):
        with pytest.raises(ValueError, match="pre_ctas=.*must be an int >= 0"):
            select_bwd_config(head_dim=128, pre_ctas=bad)
    for bad in (dict(dq_accum="red"), dict(stats_smem=False)):
        with pytest.raises(ValueError, match="pre_ctas > 0 needs dq_accum='bulk' and stats_smem"):
            select_bwd_config(head_dim=128, pre_ctas=8, **bad)
    # (switches, slots for 13 query blocks without and with): hdim 64's single slot was unused
    for kw, slots_off, slots in ((dict(head_dim=128), 14, 15), (dict(head_dim=64), 1, 1),
                                 (dict(head_dim=64, deterministic=True, early_dq_post=True), 14,
                                  15)):
        off, on = select_bwd_config(**kw, pre_ctas=0), select_bwd_config(**kw, pre_ctas=8)
        assert (off.dq_sem_slots(13), on.dq_sem_slots(13)) == (slots_off, slots), kw
        q = torch.zeros(2, 13 * on.tile_m - 5, 3, on.head_dim)
        sem = workspace(on, q, q)["dq_sem"]
        assert sem.shape == (2, 3, slots) and (sem == 0).all()
    # the early dQ postprocess polls the finished-CTA count, one slot earlier with pre_ctas: a
    # kernel compiled without it (cached under the same key) polled the preprocess's count
    # instead and converted dQ before the main kernel had finished (found on the H100)
    from fa_sm100.hopper.bwd_prepost import DqPostprocess

    on, off = select_bwd_config(head_dim=128, pre_ctas=8), select_bwd_config(head_dim=128,
                                                                               pre_ctas=0)
    assert on.early_dq_post and off.early_dq_post
    assert DqPostprocess.compile_key(on) != DqPostprocess.compile_key(off)


def test_pre_ctas_default_at_hdim_128_with_bulk_dq():
    """Note [Preprocess beside the main kernel]: on by default (DEFAULT_PRE_CTAS CTAs) at the
    head dims of PRE_CTAS_HEAD_DIMS (128: measured +1-2% a call) wherever it can run ("bulk"
    dQ and ``stats_smem``), causal or not, GQA, deterministic; off at the other head dims and
    where asked; a count asked for is kept."""
    from fa_sm100.hopper.bwd_defaults import DEFAULT_PRE_CTAS, PRE_CTAS_HEAD_DIMS

    seen_on = 0
    for kw in ({}, dict(causal=True, seqlen_q=2048, seqlen_k=2048), dict(deterministic=True),
               dict(qhead_per_kvhead=4), dict(window_left=100, window_right=0)):
        for d, dv in ((64, 64), (96, 96), (128, 128), (192, 128), (256, 256)):
            cfg = select_bwd_config(head_dim=d, head_dim_v=dv, **kw)
            on = d in PRE_CTAS_HEAD_DIMS and cfg.dq_accum == "bulk" and cfg.stats_smem
            assert cfg.pre_ctas == (DEFAULT_PRE_CTAS if on else 0), (d, kw)
            seen_on += on
        for d in PRE_CTAS_HEAD_DIMS:
            for off in (dict(pre_ctas=0), dict(dq_accum="red"), dict(stats_smem=False)):
                assert select_bwd_config(head_dim=d, **off, **kw).pre_ctas == 0, (d, off, kw)
    assert seen_on  # the rule was on somewhere, not only checked off
    assert select_bwd_config(head_dim=64, pre_ctas=16).pre_ctas == 16


def test_qdo_multicast_default_under_a_causal_mask_from_4k_at_hdim_64_and_128():
    """Causal problems multicast by default only where measured faster: hdim 64 and 128 with
    both lengths at least CAUSAL_MULTICAST_MIN_SEQLEN (4k), the key blocks even, not
    deterministic; the CTAs still start longest first (by clusters)."""
    from fa_sm100.hopper.bwd_defaults import CAUSAL_MULTICAST_MIN_SEQLEN

    for d in (64, 128):
        long = CAUSAL_MULTICAST_MIN_SEQLEN[d]
        cfg = select_bwd_config(head_dim=d, causal=True, seqlen_q=long, seqlen_k=2 * long)
        assert cfg.qdo_multicast and cfg.longest_first and cfg.cluster == (2, 1, 1), d
        for kw in (dict(seqlen_q=long // 2, seqlen_k=long), dict(seqlen_q=long, seqlen_k=long // 2),
                   dict(seqlen_q=long, seqlen_k=long + 1), dict(seqlen_k=long),
                   dict(seqlen_q=long, seqlen_k=long, deterministic=True),
                   dict(seqlen_q=long, seqlen_k=long, window_left=256)):
            assert not select_bwd_config(head_dim=d, causal=True, **kw).qdo_multicast, (d, kw)
    for d in (96, 192, 256):  # not measured: off
        assert d not in CAUSAL_MULTICAST_MIN_SEQLEN
        assert not select_bwd_config(head_dim=d, causal=True, seqlen_q=16384,
                                     seqlen_k=16384).qdo_multicast


def test_qdo_multicast_config_on_an_odd_number_of_key_blocks_raises(monkeypatch):
    """A given multicast config groups the CTAs of key blocks 2c and 2c+1 (or four with
    qdo_cluster=4): on a count that does not divide, sm90_bwd raises ValueError before
    anything is compiled (sm_90 faked, no GPU needed); otherwise it goes on to compile."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fa_sm100.hopper import bwd_interface

    class Compiled(Exception):
        pass

    def no_compile(*args, **kwargs):
        raise Compiled

    monkeypatch.setattr(bwd_interface, "_compiled", no_compile)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cfg = select_bwd_config(head_dim=64, qdo_multicast=True)
    cfg4 = cfg.replace(qdo_cluster=4)
    cases = [(cfg, 256, True), (cfg, 129, True), (cfg, 128, False), (cfg, 300, False),
             (cfg4, 512, True), (cfg4, 385, True), (cfg4, 256, False)]
    with FakeTensorMode():
        for config, sk, ok in cases:
            args = [torch.empty(t.shape, dtype=t.dtype, device="cuda")
                    for t in _cpu_inputs(sk=sk)]
            with pytest.raises(Compiled if ok else ValueError,
                               match=None if ok else f"in clusters of {config.qdo_cluster}"):
                sm90_bwd(*args, config=config)


# ---- block ranges ------------------------------------------------------------------------

RANGE_CASES = [
    (sq, sk, causal, window)
    for sq, sk in [(1, 1), (64, 64), (200, 333), (333, 200), (1000, 129), (129, 1000), (511, 512)]
    for causal, window in [(False, (None, None)), (True, (None, None)), (False, (100, 30)),
                           (False, (0, 0)), (True, (70, None)), (False, (None, 5)),
                           (False, (300, None))]
]


@pytest.mark.parametrize("tile_m", [64, 80, 128])
@pytest.mark.parametrize("sq,sk,causal,window", RANGE_CASES)
def test_block_ranges_cover_the_band_and_dq_order_is_consecutive(sq, sk, causal, window, tile_m):
    cfg = select_bwd_config(head_dim=128 if tile_m == 80 else 64, causal=causal,
                            window_left=window[0], window_right=window[1], tile_m=tile_m,
                            sdp_swap_ab=tile_m != 64)
    tm, tn = cfg.tile_m, cfg.tile_n
    n_blocks, m_blocks = -(-sk // tn), -(-sq // tm)
    ranges = [m_block_range(cfg, n, sq, sk) for n in range(n_blocks)]
    mask = attention_mask(sq, sk, causal, window)
    visible = torch.ones(sq, sk, dtype=torch.bool) if mask is None else mask
    for i, j in visible.nonzero().tolist():
        lo, hi = ranges[j // tn]
        assert lo <= i // tm < hi, f"visible pair ({i}, {j}) lies outside key block {j // tn}'s range"
    for m in range(m_blocks):
        adders = [n for n in range(n_blocks) if ranges[n][0] <= m < ranges[n][1]]
        if adders:
            assert adders == list(range(adders[0], adders[-1] + 1)), "key blocks not consecutive"
            assert adders[0] == first_n_block(cfg, m, sq, sk), "semaphore base is wrong"


# ---- launch order (Note [longest first]) ----------------------------------------------------

def test_longest_first_is_the_default_for_causal_bands_without_a_left_window():
    for d in (64, 96, 128, 192, 256):
        assert select_bwd_config(head_dim=d, causal=True).longest_first
        assert select_bwd_config(head_dim=d, causal=True, deterministic=True,
                                 qhead_per_kvhead=4).longest_first
        assert not select_bwd_config(head_dim=d).longest_first
        assert not select_bwd_config(head_dim=d, causal=True, window_left=100).longest_first
    assert not select_bwd_config(causal=True, longest_first=False).longest_first
    assert select_bwd_config(window_right=0, longest_first=True).longest_first


def test_longest_first_tail_is_whole_pairs_within_the_grid():
    cfg = BwdConfig(longest_first=True, tail_ctas=264)
    assert longest_first_tail_pairs(cfg, 32, 64) == 9  # 264 / 32 = 8.25 -> 9 pairs
    assert longest_first_tail_pairs(cfg, 8, 256) == 33
    assert longest_first_tail_pairs(cfg, 128, 16) == 3
    assert longest_first_tail_pairs(cfg, 8, 20) == 20  # more than the grid: all of it
    assert longest_first_tail_pairs(cfg, 1000, 5) == 1
    assert longest_first_tail_pairs(cfg.replace(tail_ctas=1), 7, 3) == 1


@pytest.mark.parametrize("num_n,pairs,tail", [(1, 1, 1), (8, 256, 33), (32, 64, 9), (3, 8, 3),
                                              (5, 7, 7), (4, 6, 1), (7, 13, 5)])
def test_longest_first_cta_renumbers_every_cta_once_and_keeps_key_block_order(num_n, pairs, tail):
    """A permutation of the grid: the grid's order (key block fastest) before the tail; in the
    tail's CTAs key block 0 of every tail pair, then key block 1, ...; within every pair key
    blocks start in increasing order (what the deterministic dQ semaphore needs)."""
    order = [longest_first_cta(linear, num_n, pairs, tail) for linear in range(num_n * pairs)]
    assert sorted(order) == [(n, p) for n in range(num_n) for p in range(pairs)]
    head = (pairs - tail) * num_n
    assert order[:head] == [(n, p) for p in range(pairs - tail) for n in range(num_n)]
    assert order[head:] == [(n, p) for n in range(num_n) for p in range(pairs - tail, pairs)]
    for p in range(pairs):
        assert [n for n, q in order if q == p] == list(range(num_n))


@pytest.mark.parametrize("num_n,pairs,tail,ctas", [(2, 1, 1, 2), (8, 256, 33, 2), (32, 64, 9, 2),
                                                   (8, 20, 5, 4), (6, 7, 3, 2), (1, 5, 2, 1)])
def test_longest_first_cluster_cta_moves_whole_clusters(num_n, pairs, tail, ctas):
    """Under qdo_multicast the hardware launches clusters of ``ctas`` consecutive CTAs: the
    renumbering keeps each cluster on key blocks ctas c .. ctas c + ctas - 1 of one pair, the
    CTA's rank its offset there; the clusters follow ``longest_first_cta`` on a grid of
    num_n / ctas columns; every CTA is renumbered once. One CTA per cluster is the plain
    renumbering."""
    grid = range(num_n * pairs)
    order = [longest_first_cluster_cta(linear, num_n, pairs, tail, ctas) for linear in grid]
    assert sorted(order) == [(n, p) for n in range(num_n) for p in range(pairs)]
    for first in range(0, len(order), ctas):
        cluster = order[first:first + ctas]
        column, pair = longest_first_cta(first // ctas, num_n // ctas, pairs, tail)
        assert cluster == [(column * ctas + rank, pair) for rank in range(ctas)]
    if ctas == 1:
        assert order == [longest_first_cta(linear, num_n, pairs, tail) for linear in grid]


@pytest.mark.parametrize("seqlen_q,seqlen_k,ctas", [(1024, 1024, 2), (16384, 16384, 2),
                                                   (2048, 1024, 1), (200, 16384, 2),
                                                   (1000, 2100, 4), (80, 512, 1), (4097, 300, 1)])
def test_staggered_sweeps_cover_every_query_block_and_spread_the_clusters(seqlen_q, seqlen_k,
                                                                          ctas):
    """Note [staggered query blocks]: each key block's sweep visits each of its query blocks
    exactly once; the CTAs of a cluster (which share their Q / dO loads) sweep in the same
    order; the clusters' starts are spread over the range, consecutive ones ``count / C``
    blocks apart (rounded), distinct wherever there are at least as many blocks as clusters;
    without the switch every sweep starts at m_min."""
    cfg = select_bwd_config(head_dim=128, stagger_m=True, qdo_multicast=ctas > 1,
                            qdo_cluster=max(ctas, 2), seqlen_q=seqlen_q, seqlen_k=seqlen_k)
    assert cfg.cluster[0] == ctas
    num_n = cfg.num_key_blocks(seqlen_k)
    clusters = -(-num_n // ctas)
    starts = {}
    for n in range(num_n):
        lo, hi = m_block_range(cfg, n, seqlen_q, seqlen_k)
        off = stagger_offset(cfg, n, num_n, lo, hi)
        assert 0 <= off < max(hi - lo, 1)
        sweep = [staggered_m_block(i, off, lo, hi) for i in range(lo, hi)]
        assert sorted(sweep) == list(range(lo, hi)), (n, sweep)
        assert sweep[0] == lo + off
        starts.setdefault(n // ctas, sweep)
        assert starts[n // ctas] == sweep, n  # one order per cluster
        assert stagger_offset(cfg.replace(stagger_m=False), n, num_n, lo, hi) == 0
    count = hi - lo
    firsts = [sweep[0] for _, sweep in sorted(starts.items())]
    assert len(firsts) == clusters
    gaps = [b - a for a, b in zip(firsts, firsts[1:])]
    assert all(count // clusters <= g <= -(-count // clusters) for g in gaps), gaps
    if count >= clusters:
        assert len(set(firsts)) == clusters


def test_bwd_memcheck_cases_run_the_orders_they_name():
    """``scripts/sm90_memcheck.py --mode bwd`` (run under compute-sanitizer on the GPU): its
    configs validate, and between them they take the whole grid longest first, a tail after
    CTAs in the grid's order (deterministic too), the grid's order under a causal mask, CTA
    pairs that multicast Q and dO (with each dQ path), every head-dim pair and both dQ
    paths, first dQ stores (Note [dQ first store]) claimed by CAS and by deterministic turn,
    causal and not, staggered sweeps (Note [staggered query blocks]) in clusters and alone,
    with first stores and without, persistent CTAs that each walk several tiles by a fixed
    stride (in clusters and alone) or fetch them (causal, banded), and hdim 128's narrow-window
    tile."""
    mod = load_script("sm90_memcheck")
    kinds, dims, dq, multicast_dq = set(), set(), set(), set()
    for case in mod.BWD_CASES:
        b, sq, sk, h, hk, d, dv, causal, _, deterministic, _ = case
        cfg = mod.bwd_config(case)  # validated
        dims.add((d, dv))
        dq.add(cfg.dq_accum)
        if causal and cfg.longest_first:
            num_n = -(-sk // cfg.tile_n)
            tail = longest_first_tail_pairs(cfg, num_n, b * h)
            kind = "whole grid" if tail == b * h else "tail"
            kinds.add(kind + (" det" if deterministic else ""))
        elif causal:
            kinds.add("grid order")
        if cfg.first_stores_dq:
            kinds.add("first store" + (" det" if deterministic else "")
                      + (" causal" if causal else ""))
        if cfg.stagger_m:
            kinds.add("staggered" + (" pairs" if cfg.qdo_multicast else "")
                      + (" first store" if cfg.first_stores_dq else ""))
        if cfg.persistent_ctas and b * h * cfg.num_key_blocks(sk) > cfg.persistent_ctas:
            walk = "fetched walk" if cfg.dynamic_tiles else "strided walk"
            kinds.add(walk + (" causal" if causal else "") + (" band" if cfg.is_local else "")
                      + (" pairs" if cfg.qdo_multicast else ""))
        if d == 128 and cfg.is_local and cfg.tile_m == 64 and cfg.stats_first:
            kinds.add("narrow window")
        if cfg.qdo_multicast:
            multicast_dq.add(cfg.dq_accum)
            kinds.add("multicast causal" if causal else "multicast")
            if cfg.qdo_cluster == 4:
                kinds.add("multicast 4")
    assert {"whole grid", "tail", "tail det", "grid order", "multicast", "multicast causal",
            "multicast 4", "first store", "first store causal", "first store det causal",
            "staggered pairs first store", "staggered first store", "staggered",
            "strided walk pairs", "strided walk", "fetched walk causal", "fetched walk band",
            "narrow window"} <= kinds
    assert any(not c.stagger_m and c.first_stores_dq and not c.causal
               for c in map(mod.bwd_config, mod.BWD_CASES))  # first stores racing in step
    assert multicast_dq == {"bulk", "red"}
    assert dims == {(64, 64), (96, 96), (128, 128), (192, 128), (256, 256)}
    assert dq == {"bulk", "red"}


# ---- compile contract ----------------------------------------------------------------------

def _hgmma_commits(sass: str) -> int:
    """HGMMAs that close a WGMMA group (``gsb0``): the kernel's five GEMMs, unless ptxas
    serialized them (then every HGMMA commits and waits)."""
    return len(re.findall(r"HGMMA\.[^;]*gsb0", sass))


def _hgmma_operands(sass: str) -> dict:
    """HGMMA instructions of a SASS listing by the kind of their A operand: "RS" (a register,
    ``HGMMA.64x128x16.F32.BF16 R24, R228, gdesc[UR12].tnspB, R24``) or "SS" (a descriptor)."""
    kinds = {"RS": 0, "SS": 0}
    for m in re.finditer(r"HGMMA\.\S+\s+R\d+,\s*(\S+?),", sass):
        kinds["SS" if m.group(1).startswith("gdesc") else "RS"] += 1
    return kinds


CONTRACT_CASES = [
    ([], "UBLKRED"),
    (["causal=true", "deterministic=true", "qhead_per_kvhead=4", "window_left=100"], "UBLKRED"),
    (["head_dim=96", "dq_accum=red", "early_dv=false", "dtype=float16"], "REDG.E.ADD.F32"),
    (["sdp_swap_ab=true", "causal=true", "deterministic=true", "qhead_per_kvhead=4"], "UBLKRED"),
    (["sdp_swap_ab=true", "head_dim=64", "dq_accum=red", "early_dv=false"], "REDG.E.ADD.F32"),
    (["overlap_dk=true", "sdp_swap_ab=false", "causal=true", "qhead_per_kvhead=4"], "UBLKRED"),
    (["overlap_dk=true", "sdp_swap_ab=false", "head_dim=64", "dq_accum=red",
      "deterministic=true"], "REDG.E.ADD.F32"),
    # tile_m=128 (Note [tile_m 128]): both early-dV variants, masks, GQA, deterministic, red
    (["sdp_swap_ab=true", "tile_m=128", "head_dim=64"], "UBLKRED"),
    (["sdp_swap_ab=true", "tile_m=128", "head_dim=64", "early_dv=false"], "UBLKRED"),
    (["sdp_swap_ab=true", "tile_m=128", "head_dim=64", "causal=true", "deterministic=true",
      "qhead_per_kvhead=4"], "UBLKRED"),
    (["sdp_swap_ab=true", "tile_m=128", "head_dim=64", "window_left=100", "window_right=30",
      "dtype=float16"], "UBLKRED"),
    (["sdp_swap_ab=true", "tile_m=128", "head_dim=64", "dq_accum=red", "deterministic=true",
      "causal=true", "early_dv=true"], "REDG.E.ADD.F32"),
    # Note [dV before the dS barrier]: swapped (P^T in registers) and unswapped (P in SMEM)
    (["causal=true", "dv_before_barrier=true"], "UBLKRED"),
    (["sdp_swap_ab=false", "early_dv=false", "dv_before_barrier=true", "head_dim=96"], "UBLKRED"),
    (["head_dim=64", "causal=true", "dv_before_barrier=true"], "UBLKRED"),
    # Note [dK/dV by columns]: the wide head dims' defaults and switches, and hdim 128 by switch
    (["head_dim=256"], "REDG.E.ADD.F32"),
    (["head_dim=256", "dq_accum=bulk", "q_stage=1", "do_stage=1", "causal=true"], "UBLKRED"),
    (["head_dim=256", "qhead_per_kvhead=2", "gqa_reduce=atomic", "overlap_dk=true"],
     "REDG.E.ADD.F32"),
    (["head_dim=192", "causal=true", "deterministic=true", "qhead_per_kvhead=4",
      "window_left=100"], "UBLKRED"),
    (["head_dim=192", "dtype=float16", "dq_accum=red", "stats_smem=false"], "REDG.E.ADD.F32"),
    (["tile_n=64", "sdp_swap_ab=false", "early_dv=false"], "UBLKRED"),
    # Note [dQ transposed]: 80 query rows, dQ^T = K^T dS^T
    (["tile_m=80", "sdp_swap_ab=true"], "UBLKRED"),
    (["tile_m=80", "sdp_swap_ab=true", "early_dv=false", "causal=true", "deterministic=true",
      "qhead_per_kvhead=4", "window_left=100"], "UBLKRED"),
    (["tile_m=80", "sdp_swap_ab=true", "dq_accum=red", "dtype=float16"], "REDG.E.ADD.F32"),
    (["tile_m=80", "sdp_swap_ab=true", "early_dv=true", "causal=true"], "UBLKRED"),
    # short causal hdim 128 (select_bwd_config with both lengths <= SHORT_CAUSAL_SEQLEN):
    # 64-row blocks, dV before the dS barrier, stats before the GEMMs; MHA and GQA
    (["causal=true", "tile_m=64", "dv_before_barrier=true", "stats_first=true"], "UBLKRED"),
    (["causal=true", "tile_m=64", "dv_before_barrier=true", "stats_first=true",
      "deterministic=true", "qhead_per_kvhead=4", "dtype=float16"], "UBLKRED"),
    # windowed hdim 128: the same tile; deterministic with a window hands dQ off once per
    # block
    (["window_left=512", "window_right=0", "tile_m=64", "dv_before_barrier=true",
      "stats_first=true"], "UBLKRED"),
    (["window_left=100", "window_right=30", "tile_m=64", "dv_before_barrier=true",
      "stats_first=true", "deterministic=true", "dq_handoff_per_wg=false"], "UBLKRED"),
    # Note [dQ SMEM handoff]: one handoff of the whole tile
    (["dq_handoff_per_wg=false"], "UBLKRED"),
    (["head_dim=64", "dq_handoff_per_wg=false", "deterministic=true", "causal=true"], "UBLKRED"),
    # Note [dynamic tiles]: persistent CTAs fetching causal tiles (hdim 64's default up to 2k),
    # and at hdim 96 (unswapped 64-row blocks) with the early dQ postprocess and a window
    (["head_dim=64", "causal=true", "persistent_ctas=132", "dynamic_tiles=true"], "UBLKRED"),
    (["head_dim=96", "causal=true", "window_left=300", "persistent_ctas=132",
      "dynamic_tiles=true", "early_dq_post=true"], "UBLKRED"),
    # Note [Varlen backward]: the varlen defaults' tiles (short causal hdim 128 with first dQ
    # stores, 80-row GQA, non-causal staggered sweeps, hdim 64's 128 rows, hdim 256 with a
    # window), MHA dK / dV by TMA through ragged views or stored by the threads
    (["varlen=true", "causal=true", "tile_m=64", "dv_before_barrier=true",
      "stats_first=true", "dq_first_store=true"], "UBLKRED"),
    (["varlen=true", "tile_m=80", "sdp_swap_ab=true", "qhead_per_kvhead=4"], "UBLKRED"),
    (["varlen=true", "tile_m=80", "sdp_swap_ab=true", "stagger_m=true", "dq_first_store=true"],
     "UBLKRED"),
    (["varlen=true", "sdp_swap_ab=true", "tile_m=128", "head_dim=64", "causal=true",
      "softcap=false"], "UBLKRED"),
    (["varlen=true", "dkv_tma_store=false", "head_dim=256", "window_left=100"],
     "REDG.E.ADD.F32"),
]


@pytest.mark.compile
@pytest.mark.parametrize("overrides,dq_mnemonic", CONTRACT_CASES,
                         ids=[",".join(c[0]) or "default" for c in CONTRACT_CASES])
def test_sm90_bwd_compile_contract(overrides, dq_mnemonic, tmp_path):
    from fa_sm100.inspection import inspect_kernel

    cfg = make_sm90_bwd_config(overrides)
    producer, mma = cfg.regs_producer, cfg.regs_mma
    r = inspect_kernel("sm90_bwd", "sm_90a", overrides, keep_dir=tmp_path)
    assert _hgmma_commits(read_kept_sass(tmp_path)) == 5, "WGMMAs serialized (one commit each)"
    sass = r["sass_full"]
    assert r["threads_per_cta"] == 384
    assert r["cluster"] in ([1, 1, 1], (1, 1, 1))
    assert sum(v for k, v in sass.items() if k.startswith("HGMMA")) >= 5, "no WGMMA in the SASS"
    assert [list(x) for x in r["setmaxnreg_ptx"]] == [["dec", producer], ["inc", mma]]
    # the launch declares min_blocks_per_mp=1, so ptxas keeps both setmaxnreg in the SASS
    assert r["setmaxnreg"] == {"producer": producer, "mma": mma}, r["warnings"]
    # 384 threads launch with 168 registers each; after setmaxnreg the warps hold at most
    # those 64512 (more would hang in setmaxnreg.inc)
    assert r["regs_at_launch"] == launch_registers(384) == 168
    assert r["registers_after_setmaxnreg"] == 128 * (producer + 2 * mma) <= 384 * 168
    assert r["spill_bytes"] == 0 and r["local_bytes"] == 0
    assert 0 < r["smem_bytes"] <= SM90_SMEM_BYTES
    assert any(k.startswith(dq_mnemonic) for k in sass), f"{dq_mnemonic} missing: {sorted(sass)}"
    assert sass.get("UTMALDG.4D", 0) >= 4, "Q, dO, K, V are loaded by TMA"


# main-loop SASS ops that are the loop's work and synchronization: a switch that only changes
# which block or CTA a step takes keeps their counts
_LOOP_WORK = ("HGMMA", "MUFU", "BAR", "WARPGROUP", "UBLKRED", "UBLKCP", "REDG", "STSM", "FENCE",
              "MEMBAR", "ATOMG")


def _loop_work(ops: collections.Counter, *more: str) -> dict:
    """``ops`` restricted to the ``_LOOP_WORK`` kinds (and ``more``), by opcode stem."""
    return {k: v for k, v in ops.items() if k.split(".")[0] in _LOOP_WORK + more}


@pytest.mark.compile
@pytest.mark.parametrize("head_dim,causal", [(64, False), (128, False), (256, False),
                                             (64, True), (128, True)])
def test_sm90_bwd_qdo_multicast_multicasts_q_and_do_only(head_dim, causal, tmp_path):
    """Note [Q/dO multicast] in the SASS: a (2, 1, 1) cluster; the Q and dO loads are
    multicast TMA loads and K's and V's are not (one load site each; 64-element-wide boxes:
    head_dim / 64 per tile); the main loop keeps its GEMMs, exp2s, barriers and dQ path, with
    the Q / dO releases as remote arrives; nothing spills. Causal too (the skipped query
    blocks' waits and releases sit before the main loop). Causal hdim 128 loads its own
    statistics with multicast only (``_own_stats_fit``), so both sides are pinned to the
    shuffled ones there."""
    from fa_sm100.inspection import inspect_kernel

    pinned = ["stats_shuffle=true"] if (head_dim, causal) == (128, True) else []
    loops = {}
    for on in (True, False):
        keep = tmp_path / str(on)
        r = inspect_kernel("sm90_bwd", "sm_90a", [f"head_dim={head_dim}", f"causal={causal}",
                                                  f"qdo_multicast={on}"] + pinned, keep_dir=keep)
        assert r["config"]["qdo_multicast"] is on
        assert r["spill_bytes"] == 0 and r["local_bytes"] == 0
        assert r["cluster"] == ([2, 1, 1] if on else [1, 1, 1])
        loops[on] = collections.Counter(main_loop_ops(read_kept_sass(keep)))
        ops = r["sass"]
        boxes = head_dim // 64
        assert ops.get("UTMALDG.MULTICAST", 0) == (2 * boxes if on else 0), ops
        assert ops["UTMALDG"] == 4 * boxes, ops  # Q, dO, K, V
    on, off = loops[True], loops[False]
    # SYNCS differ: the peer's releases
    assert sum(on.values()) > 100 and _loop_work(on) == _loop_work(off)
    remote = "SYNCS.ARRIVE.TRANS64.RED.ART0"
    assert on[remote] == 2 and off[remote] == 0, (on, off)  # the Q and dO releases


def _main_loops_with_and_without(switch, overrides, tmp_path):
    """The MMA main loop's SASS op counts with ``switch`` on and off (no spills either way),
    after checking that the switch changed the kernel."""
    from fa_sm100.inspection import inspect_kernel

    loops, sass = {}, {}
    for on in (True, False):
        keep = tmp_path / str(on)
        r = inspect_kernel("sm90_bwd", "sm_90a", overrides + [f"{switch}={on}".lower()],
                           keep_dir=keep)
        assert r["config"][switch] is on
        assert r["spill_bytes"] == 0 and r["local_bytes"] == 0
        sass[on] = read_kept_sass(keep)
        loops[on] = collections.Counter(main_loop_ops(sass[on]))
    assert sass[True] != sass[False]
    return loops[True], loops[False]


def _assert_loop_kept(on, off, within: float):
    """Two main loops (``_main_loops_with_and_without``) do the same work (``_loop_work`` with
    the mbarrier ops) and their lengths differ by at most ``within`` of the length without."""
    assert sum(on.values()) > 100 and sum(off.values()) > 100
    assert _loop_work(on, "SYNCS") == _loop_work(off, "SYNCS"), (on - off, off - on)
    assert abs(sum(on.values()) - sum(off.values())) <= within * sum(off.values()), \
        (on - off, off - on)


@pytest.mark.compile
@pytest.mark.parametrize("overrides", [["causal=true"], ["causal=true", "head_dim=64"],
                                       ["causal=true", "head_dim=256", "deterministic=true"]],
                         ids=["d128", "d64", "d256-deterministic"])
def test_sm90_bwd_longest_first_renumbers_ctas_outside_the_main_loop(overrides, tmp_path):
    """Note [longest first] only changes which key block and pair a CTA takes: the main loop
    keeps its GEMMs, exp2s, barriers and synchronization, and its length to within 2% (integer
    instructions of addresses built from the renumbered pair, which ptxas holds in vector
    registers instead of re-reading blockIdx: +8 and +9 of 441 / 518 in the "red" dQ loops of
    hdim 256); nothing spills."""
    on, off = _main_loops_with_and_without("longest_first", overrides, tmp_path)
    _assert_loop_kept(on, off, within=0.02)


@pytest.mark.compile
@pytest.mark.parametrize("overrides", [[], ["qdo_multicast=false", "dq_first_store=false"],
                                       ["head_dim=64"], ["head_dim=256"]],
                         ids=["d128", "d128-one-cta-zero-fill", "d64", "d256-red"])
def test_sm90_bwd_staggered_sweep_adds_a_select_to_the_main_loop(overrides, tmp_path):
    """Note [staggered query blocks] only changes which query block a step visits: the MMA
    main loop keeps its GEMMs, exp2s, barriers, synchronization and dQ reduces, and its length
    to within 2% (the wrap-around: compare, add, select; the "red" dQ loop of hdim 256 builds
    its addresses from the block instead of stepping a pointer: +8 of 413; at hdim 64 ptxas
    schedules 2 fewer); nothing spills."""
    on, off = _main_loops_with_and_without("stagger_m", overrides, tmp_path)
    _assert_loop_kept(on, off, within=0.02)


@pytest.mark.compile
@pytest.mark.parametrize("overrides", [[], ["causal=true", "deterministic=true"],
                                       ["head_dim=64", "causal=true"],
                                       ["head_dim=96", "dq_first_store=false"]],
                         ids=["d128", "d128-causal-deterministic", "d64-causal", "d96"])
def test_sm90_bwd_early_dq_post_leaves_the_main_loop_alone(overrides, tmp_path):
    """Note [dQ postprocess in the tail]: the count of finished CTAs is one release-add
    after the dq-store warp's last block, and the main kernel lets its dependents launch once:
    the MMA main loop keeps its GEMMs, exp2s, barriers, synchronization and dQ reduces and its
    length to within 1% (ptxas may pick a uniform add instead of a vector one: counting each
    block's reduces inside the loop measured 2.5-14% slower), nothing spills."""
    on, off = _main_loops_with_and_without("early_dq_post", overrides, tmp_path)
    _assert_loop_kept(on, off, within=0.01)
    ptx = {}
    for early in (True, False):
        (path,) = glob.glob(str(tmp_path / str(early) / "*.ptx"))
        ptx[early] = open(path).read()
    releases = {e: ptx[e].count("red.release.gpu") for e in ptx}
    assert releases[True] == releases[False] + 1, releases
    assert ptx[True].count("griddepcontrol.launch_dependents") == 1
    assert "griddepcontrol.launch_dependents" not in ptx[False]


@pytest.mark.compile
@pytest.mark.parametrize("overrides", [
    ["causal=true"],
    ["causal=true", "deterministic=true", "qhead_per_kvhead=4", "window_left=100"],
    ["causal=true", "deterministic=true", "qhead_per_kvhead=4", "window_left=100", "tile_m=64"],
], ids=["hdim128-causal", "hdim128-gqa-window", "hdim128-gqa-window-tile_m64"])
def test_sm90_bwd_try_wait_polls_before_the_blocking_wait(overrides, tmp_path):
    """Note [try first]: with ``try_wait`` the MMA warpgroups' two stage waits (q, dO) leave
    the main loop's body (try-wait + NANOSLEEP there) for a poll and an out-of-line retry,
    and the kernel has no spills; the switch is what selects it. Until round 7 the windowed
    swapped 64-row kernel spilled with it (why ``select_bwd_config`` turns it off there);
    the mask by limits freed the register, and the default stays off there until it is run
    and timed on a GPU."""
    from fa_sm100.inspection import inspect_kernel

    sleeps, spills = {}, {}
    for on in (False, True):
        keep = tmp_path / f"try_{on}"
        r = inspect_kernel("sm90_bwd", "sm_90a", overrides + [f"try_wait={str(on).lower()}"],
                           keep_dir=keep)
        sleeps[on] = sum(op.startswith("NANOSLEEP") for op in main_loop_ops(read_kept_sass(keep)))
        spills[on] = r["spill_bytes"]
    assert sleeps == {False: 2, True: 0}, sleeps
    assert spills == {False: 0, True: 0}, spills


@pytest.mark.compile
@pytest.mark.parametrize("overrides", [["causal=true", "tile_m=64"],
                                       ["sdp_swap_ab=false", "head_dim=96"]],
                         ids=["swapped", "unswapped"])
def test_sm90_bwd_stats_first_loads_before_the_gemms(overrides, tmp_path):
    """Note [stats before the GEMMs]: with ``stats_first`` the LSE2/Delta loads of the main
    loop start before the first HGMMA and all precede the first wait for a GEMM; without it
    they come after HGMMAs. No spills either way."""
    from fa_sm100.inspection import inspect_kernel

    for on in (True, False):
        keep = tmp_path / f"first_{on}"
        r = inspect_kernel("sm90_bwd", "sm_90a", overrides + [f"stats_first={str(on).lower()}"],
                           keep_dir=keep)
        assert r["spill_bytes"] == 0
        ops = main_loop_ops(read_kept_sass(keep))
        loads = [i for i, op in enumerate(ops) if op.startswith("LDS")]
        first_gemm = next(i for i, op in enumerate(ops) if op.startswith("HGMMA"))
        assert loads, "no LDS of the stats in the main loop"
        if on:  # all before the first wait for a GEMM, the first ones before any GEMM
            first_wait = next(i for i, op in enumerate(ops) if op.startswith("WARPGROUP.DEPBAR"))
            assert loads[0] < first_gemm and loads[-1] < first_wait
        else:
            assert loads[0] > first_gemm


@pytest.mark.compile
@pytest.mark.parametrize("overrides", [[], ["head_dim=64"], ["head_dim=96", "causal=true"],
                                       ["head_dim=192"],
                                       ["head_dim=256", "dq_accum=bulk", "q_stage=1",
                                        "do_stage=1"]],
                         ids=["d128", "d64-tile_m128", "d96", "d192", "d256-bulk"])
def test_sm90_bwd_dq_leaves_in_16_byte_stores(overrides, tmp_path):
    """Note [dQ in fragment order]: each MMA thread stores its dQ tile to SMEM in dq_groups
    STS.128 and nothing else (the row-major padded tile took twice as many STS.64)."""
    from fa_sm100.hopper.inspect_bwd import make_config
    from fa_sm100.inspection import inspect_kernel

    cfg = make_config(overrides)
    inspect_kernel("sm90_bwd", "sm_90a", overrides, keep_dir=tmp_path)
    ops = main_loop_ops(read_kept_sass(tmp_path))
    assert cfg.dq_groups == cfg.tile_m * cfg.head_dim // 1024  # 256 threads x 4 floats
    assert [op for op in ops if op.startswith("STS.")] == ["STS.128"] * cfg.dq_groups


@pytest.mark.compile
@pytest.mark.parametrize("overrides,per_wg", [([], True), (["dq_handoff_per_wg=false"], False),
                                              (["head_dim=64", "deterministic=true"], True),
                                              (["head_dim=96", "dq_handoff_per_wg=false"], False)],
                         ids=["d128", "d128-whole-tile", "d64-deterministic", "d96-whole-tile"])
def test_sm90_bwd_dq_handoff_barriers(overrides, per_wg, tmp_path):
    """Note [dQ SMEM handoff]: per warpgroup, the MMA warps wait on DQ_EMPTY_WG0 / _WG1 and
    arrive on DQ_FULL_WG0 / _WG1 with 128 + 32 threads and the dq-store warp issues one bulk
    reduce per warpgroup half; with one handoff, ids DQ_EMPTY_WG0 / DQ_FULL_WG0 only, with
    256 + 32 threads, and one bulk reduce."""
    from fa_sm100.hopper.named_barriers import Sm90BwdBarrier as B
    from fa_sm100.inspection import inspect_kernel

    inspect_kernel("sm90_bwd", "sm_90a", overrides, keep_dir=tmp_path)
    sass = read_kept_sass(tmp_path)
    # (barrier id, thread count) of every named barrier of a handoff's size (others: 128, 256)
    bars = {(int(i, 16), int(c, 16))
            for i, c in re.findall(r"BAR\.[\w.]+ (0x[0-9a-f]+), (0x[0-9a-f]+)", sass)
            if int(c, 16) in (160, 288)}
    if per_wg:
        want = {(int(b), 160) for b in (B.DQ_EMPTY_WG0, B.DQ_EMPTY_WG1, B.DQ_FULL_WG0, B.DQ_FULL_WG1)}
    else:
        want = {(int(B.DQ_EMPTY_WG0), 288), (int(B.DQ_FULL_WG0), 288)}
    assert bars == want
    assert len(re.findall(r"UBLKRED", sass)) == (2 if per_wg else 1)


@pytest.mark.compile
@pytest.mark.parametrize("overrides,on,copies,cas", [
    (["causal=true"], True, 2, 1), (["causal=true", "dq_first_store=false"], False, 0, 0),
    ([], True, 2, 1), (["stagger_m=false"], False, 0, 0), (["head_dim=64"], False, 0, 0),
    (["dq_first_store=true", "dq_handoff_per_wg=false"], True, 1, 1),
    (["head_dim=64", "deterministic=true", "causal=true"], True, 2, 0),
    (["head_dim=96", "deterministic=true", "window_left=100", "sdp_swap_ab=false",
      "dq_first_store=true"], True, 1, 0),
    (["causal=true", "dq_accum=red"], True, 0, 0)],
    ids=["d128-causal", "causal-off", "d128-non-causal-staggered", "d128-non-causal-in-step",
         "d64-non-causal", "d128-whole-tile", "d64-deterministic", "d96-deterministic-window",
         "red"])
def test_sm90_bwd_dq_first_store_copies_where_the_others_add(overrides, on, copies, cas,
                                                             tmp_path):
    """Note [dQ first store]: the dq-store warp has a bulk copy beside each bulk reduce (one
    per handoff part), and claims a block with one CAS (deterministic mode: none, turn 0
    copies); off, and with "red" dQ, neither. The MMA warpgroups' GEMMs are the same either
    way. On by default for causal problems and for staggered sweeps (Note [staggered query
    blocks]: non-causal hdim 128)."""
    from fa_sm100.inspection import inspect_kernel

    r = inspect_kernel("sm90_bwd", "sm_90a", overrides, keep_dir=tmp_path)
    sass = read_kept_sass(tmp_path)
    assert r["config"]["dq_first_store"] is on
    assert len(re.findall(r"UBLKCP\.G\.S", sass)) == copies
    assert len(re.findall(r"ATOMG\.E\.CAS", sass)) == cas
    if copies:
        assert len(re.findall(r"UBLKRED", sass)) == copies
        off = inspect_kernel("sm90_bwd", "sm_90a", [o for o in overrides if "first" not in o]
                             + ["dq_first_store=false"])
        assert r["sass"]["HGMMA"] == off["sass"]["HGMMA"]
        assert r["spill_bytes"] == 0


@pytest.mark.compile
def test_preprocess_writes_dq_zeros_only_without_first_stores():
    """Note [dQ first store]: the preprocess writes the accumulator's zeros (16-byte stores)
    only with ``zero_dq`` (no first stores)."""
    from fa_sm100.compile_tools import cross_compile, sass_full_histogram
    from fa_sm100.config import cutlass_dtype
    from fa_sm100.hopper.bwd_interface import fake_pre_arguments
    from fa_sm100.hopper.bwd_prepost import BwdPreprocess

    dt = cutlass_dtype("bfloat16")
    for zero_dq in (True, False):
        pre = cross_compile(BwdPreprocess(128, 128, True, zero_dq), fake_pre_arguments(dt, 128),
                            "sm_90a")
        assert ("STG.E.128" in sass_full_histogram(pre.sass)) is zero_dq


@pytest.mark.compile
@pytest.mark.parametrize("overrides", [["head_dim=256"], ["dq_accum=red", "deterministic=true"],
                                       ["head_dim=64", "dq_accum=red"]],
                         ids=["d256", "d128-deterministic", "d64-tile_m128"])
def test_sm90_bwd_red_dq_adds_16_bytes_per_instruction(overrides, tmp_path):
    """dq_accum="red": the fragment order (Note [dQ in fragment order]) puts each thread's four
    registers of a group on 16 contiguous bytes, so the main loop adds its dQ with dq_groups
    vector reductions (``REDG.E.ADD.F32x4``) and no scalar float reduction; 4x fewer than
    scalar ones, which is what makes "red" the fast path at hdim 256."""
    from fa_sm100.hopper.inspect_bwd import make_config
    from fa_sm100.inspection import inspect_kernel

    cfg = make_config(overrides)
    assert cfg.dq_accum == "red"
    inspect_kernel("sm90_bwd", "sm_90a", overrides, keep_dir=tmp_path)
    reds = [op for op in main_loop_ops(read_kept_sass(tmp_path)) if op.startswith("REDG.E.ADD.F32")]
    assert len(reds) == cfg.dq_groups and all(op.startswith("REDG.E.ADD.F32x4") for op in reds), reds


@pytest.mark.compile
@pytest.mark.parametrize("overrides,tma", [([], True), (["causal=true", "head_dim=64"], True),
                                           (["head_dim=192"], True),
                                           (["dkv_tma_store=false"], False),
                                           (["head_dim=256", "dkv_tma_store=false"], False),
                                           (["qhead_per_kvhead=4", "gqa_reduce=buffers"],
                                            False)],
                         ids=["mha", "mha-d64", "mha-d192", "direct", "direct-d256",
                              "gqa-buffers"])
def test_sm90_bwd_dk_dv_leave_by_tma_for_mha(overrides, tma, tmp_path):
    """Note [dK/dV by TMA]: MHA dK/dV go to SMEM by stmatrix and out by TMA stores (no STG);
    with dkv_tma_store=false, and for GQA's float32 per-head buffers, every thread stores
    directly (GQA's default, bulk reduces, has a test of its own below)."""
    from fa_sm100.inspection import inspect_kernel

    r = inspect_kernel("sm90_bwd", "sm_90a", overrides, keep_dir=tmp_path)
    stores = {k: v for k, v in r["sass_full"].items() if k.startswith(("UTMASTG", "STG"))}
    assert r["spill_bytes"] == 0
    if tma:
        assert any(k.startswith("UTMASTG") for k in stores), stores
        assert not any(k.startswith("STG") for k in stores), stores
    else:
        assert not any(k.startswith("UTMASTG") for k in stores), stores
        assert sum(v for k, v in stores.items() if k.startswith("STG")) >= 64, stores


@pytest.mark.compile
@pytest.mark.parametrize("overrides", [["causal=true"], ["head_dim=64"]],
                         ids=["d128-causal", "d64-tile_m128"])
def test_sm90_bwd_dv_before_barrier_issues_dv_before_the_ds_barrier(overrides, tmp_path):
    """Note [dV before the dS barrier] (swapped: dV and dK are the RS HGMMAs): on, the first RS
    HGMMA (dV) precedes the DS_READY barrier (``BAR.SYNC 0x1``) in the main loop; off (and
    early_dv off), every RS HGMMA follows it. Five WGMMA groups either way."""
    from fa_sm100.compile_tools import sass_main_loop
    from fa_sm100.hopper.named_barriers import Sm90BwdBarrier
    from fa_sm100.inspection import inspect_kernel

    barrier = f"BAR.SYNC.DEFER_BLOCKING {int(Sm90BwdBarrier.DS_READY):#x},"
    for on in (True, False):
        keep = tmp_path / f"mid_{on}"
        inspect_kernel("sm90_bwd", "sm_90a", overrides + [
            "early_dv=false", f"dv_before_barrier={str(on).lower()}"], keep_dir=keep)
        sass = read_kept_sass(keep)
        assert _hgmma_commits(sass) == 5
        loop = [t for _, t in sass_main_loop(sass)]
        at_barrier = next(i for i, t in enumerate(loop) if t.startswith(barrier))
        rs = [i for i, t in enumerate(loop) if re.match(r"HGMMA\.\S+\s+R\d+,\s*R\d+", t)]
        assert rs, "no RS HGMMA in the main loop"
        assert (rs[0] < at_barrier) == on, (on, rs[:2], at_barrier)
        assert all(i > at_barrier for i in rs[1:] if not on)


@pytest.mark.compile
@pytest.mark.parametrize("overrides", [[], ["causal=true", "tile_m=64", "dv_before_barrier=true"],
                                       ["head_dim=64"]],
                         ids=["d128-tile_m80", "d128-causal-tile_m64", "d64-tile_m128"])
def test_sm90_bwd_dv_before_fence_issues_dv_ahead_of_the_ds_fence(overrides, tmp_path):
    """Note [dV before the fence]: on (the default), the first RS HGMMA of the main loop (dV)
    comes after the last dS ``STSM`` and before the ``MEMBAR.ALL.CTA`` + ``FENCE.VIEW.ASYNC.S``
    that publish dS; off, after that fence. Either way it precedes the DS_READY barrier, the
    kernel has five WGMMA groups and no spills."""
    from fa_sm100.compile_tools import sass_main_loop
    from fa_sm100.hopper.named_barriers import Sm90BwdBarrier
    from fa_sm100.inspection import inspect_kernel

    barrier = f"BAR.SYNC.DEFER_BLOCKING {int(Sm90BwdBarrier.DS_READY):#x},"
    for on in (True, False):
        keep = tmp_path / f"fence_{on}"
        r = inspect_kernel("sm90_bwd", "sm_90a", overrides + [
            "early_dv=false", "dv_before_barrier=true", f"dv_before_fence={str(on).lower()}"],
            keep_dir=keep)
        assert r["spill_bytes"] == 0
        sass = read_kept_sass(keep)
        assert _hgmma_commits(sass) == 5
        loop = [t for _, t in sass_main_loop(sass)]
        last_stsm = max(i for i, t in enumerate(loop) if t.startswith("STSM"))
        fence = next(i for i, t in enumerate(loop) if i > last_stsm and t.startswith("MEMBAR"))
        assert loop[fence + 1].startswith("FENCE.VIEW.ASYNC.S")
        at_barrier = next(i for i, t in enumerate(loop) if t.startswith(barrier))
        first_rs = next(i for i, t in enumerate(loop)
                        if re.match(r"HGMMA\.\S+\s+R\d+,\s*R\d+", t))
        assert first_rs < at_barrier
        assert (last_stsm < first_rs < fence) == on, (on, last_stsm, first_rs, fence)
        assert (fence < first_rs) == (not on)


@pytest.mark.compile
@pytest.mark.parametrize("overrides,elements", [
    (["head_dim=64", "causal=true"], 64),  # S^T 64 keys x 128 queries per warpgroup
    (["causal=true"], 40),  # 64 x 80
    (["causal=true", "window_left=100", "window_right=30"], 40),
], ids=["d64-causal", "d128-causal", "d128-window"])
def test_sm90_bwd_mask_compares_constants_against_limits(overrides, elements, tmp_path):
    """The band and tail mask (``bwd_scores.mask``): per element one compare of a compile-time
    constant against a limit computed once per block and one ``FSEL``; with a window's two
    edges at most two integer instructions (ptxas may fold both edges into one add and an
    unsigned compare). The first version added per-element address arithmetic: 826 instead of 763
    loop instructions at hdim 64 causal, 724 instead of 607 at hdim 128 with a window."""
    from fa_sm100.inspection import inspect_kernel

    r = inspect_kernel("sm90_bwd", "sm_90a", overrides, keep_dir=tmp_path)
    assert r["spill_bytes"] == 0
    ops = main_loop_ops(read_kept_sass(tmp_path))
    isetp = sum(op.startswith("ISETP") for op in ops)
    masked = sum(op.startswith("FSEL") for op in ops)
    assert masked >= elements  # every element has its select (the exp2 may add its own)
    viadd = sum(op.startswith("VIADD") for op in ops)
    per_element = 2 if "window_left=100" in overrides else 1
    assert isetp + viadd <= per_element * elements + 8, (isetp, viadd, elements)
    if per_element == 1:
        assert viadd <= 4, viadd


@pytest.mark.compile
def test_preprocess_and_postprocess_cross_compile_for_sm90a():
    """The two CUDA-core kernels compile for TVM FFI with the run-time/static split sm90_bwd
    uses (and so take torch tensors directly, with no per-call conversion)."""
    from fa_sm100.config import cutlass_dtype
    from fa_sm100.hopper.bwd_interface import (_compiled, fake_dq_post_arguments,
                                               fake_post_arguments, fake_pre_arguments)
    from fa_sm100.hopper.bwd_prepost import BwdPostprocess, BwdPreprocess, DqPostprocess

    dt = cutlass_dtype("bfloat16")
    pre = _compiled("test-pre", 128, lambda: BwdPreprocess(128, 128, True),
                    lambda: fake_pre_arguments(dt, 128))
    post = _compiled("test-post", 128, lambda: BwdPostprocess(128, 2, True),
                     lambda: fake_post_arguments(dt, 128, 128))
    cfg = select_bwd_config(head_dim=128)
    post_dq = _compiled("test-post-dq", 128, lambda: DqPostprocess(cfg),
                        lambda: fake_dq_post_arguments(cfg))
    import tvm_ffi

    for fn in (pre, post, post_dq):  # the C entry point itself, no Python wrapper
        assert isinstance(fn, tvm_ffi.Function)
    # a cached kernel is returned without building or faking anything again (sm90_bwd's hot path)
    never = lambda: pytest.fail("built on a cache hit")  # noqa: E731
    assert _compiled("test-pre", 128, never, never) is pre


@pytest.mark.compile
@pytest.mark.parametrize("overrides", [dict(head_dim=64), dict(head_dim=128),
                                       dict(head_dim=96, tile_m=64, dtype="float16"),
                                       dict(head_dim=256)],
                         ids=["d64-tile_m128", "d128-tile_m80-transposed", "d96", "d256"])
def test_dq_postprocess_stores_whole_16_byte_pieces(overrides):
    """Note [dQ out through SMEM]: dq leaves in 16-byte STG.E.128 only (tile_m x hdim / 8
    per CTA, spread over its 256 threads), read back from SMEM in LDS.128, with one barrier
    between; stored straight from the MMA layout it took 4- or 2-byte STGs."""
    from fa_sm100.compile_tools import cross_compile, sass_full_histogram
    from fa_sm100.hopper.bwd_interface import fake_dq_post_arguments
    from fa_sm100.hopper.bwd_prepost import DqPostprocess

    cfg = select_bwd_config(**overrides)
    art = cross_compile(DqPostprocess(cfg), fake_dq_post_arguments(cfg), "sm_90a")
    ops = sass_full_histogram(art.sass)
    per_thread = cfg.tile_m * cfg.head_dim // 8 // 256
    assert {k: v for k, v in ops.items() if k.startswith("STG")} == {"STG.E.128": per_thread}
    # one barrier between the SMEM tile's writes and reads; with early_dq_post (hdim 128's
    # default) one more after the count is seen (Note [dQ postprocess in the tail])
    barriers = 1 + cfg.early_dq_post
    assert ops.get("LDS.128") == per_thread and ops.get("BAR.SYNC.DEFER_BLOCKING") == barriers
    assert ops.get("LDG.E.128") == cfg.dq_groups  # the fragment-order loads, unchanged


@pytest.mark.compile
@pytest.mark.parametrize("pdl,early", [(True, False), (False, False), (True, True)],
                         ids=["pdl", "plain", "pdl-early-dq-post"])
def test_chained_launches_wait_before_reading_the_kernel_before(pdl, early, tmp_path):
    """Note [chained launches]: with ``pdl`` every kernel of the chain is launched as a
    programmatic dependent and waits (``griddepcontrol.wait``) before it touches the previous
    kernel's output: the main kernel once per role that does (load warp after K/V, dq-store
    warp, MMA warpgroups), the preprocess once (and it lets the main kernel launch after its
    loads), the dQ postprocess once. Without ``pdl``: plain launches, no waits. With
    ``early_dq_post`` (Note [dQ postprocess in the tail]) the main kernel lets the dQ
    postprocess launch at once, and the postprocess polls its (batch, head)'s count
    (``ld.acquire.gpu``) instead of waiting first thing; it waits twice, after too many polls
    and in CTA (0, 0, 0) before the exit."""
    from fa_sm100.compile_tools import cross_compile
    from fa_sm100.config import cutlass_dtype
    from fa_sm100.hopper.bwd_interface import fake_dq_post_arguments, fake_pre_arguments
    from fa_sm100.hopper.bwd_prepost import BwdPreprocess, DqPostprocess
    from fa_sm100.inspection import inspect_kernel

    # the preprocess ahead of the main kernel (pre_ctas: test_preprocess_beside_the_main_...)
    switches = [f"pdl={pdl}".lower(), f"early_dq_post={early}".lower(), "pre_ctas=0"]
    r = inspect_kernel("sm90_bwd", "sm_90a", switches, keep_dir=tmp_path)
    (ptx_path,) = glob.glob(str(tmp_path / "*.ptx"))
    ptx = open(ptx_path).read()
    assert r["launch"]["use_pdl"] is pdl
    assert ptx.count("griddepcontrol.wait") == (3 if pdl else 0)
    assert ptx.count("griddepcontrol.launch_dependents") == int(early)
    cfg = select_bwd_config(pdl=pdl, early_dq_post=early, pre_ctas=0)
    pre = cross_compile(BwdPreprocess(128, 128, pdl), fake_pre_arguments(
        cutlass_dtype("bfloat16"), 128), "sm_90a")
    post = cross_compile(DqPostprocess(cfg), fake_dq_post_arguments(cfg), "sm_90a")
    for art, waits, dependents in ((pre, 1, 1), (post, 2 if early else 1, 0)):
        assert art.launches[0]["use_pdl"] is pdl
        assert art.ptx.count("griddepcontrol.wait") == (waits if pdl else 0)
        assert art.ptx.count("griddepcontrol.launch_dependents") == (dependents if pdl else 0)
    assert post.ptx.count("ld.acquire.gpu") == (2 if early else 0)  # before and in the loop


@pytest.mark.compile
@pytest.mark.parametrize("overrides", [["pre_ctas=32"], ["pre_ctas=32", "causal=true"],
                                       ["pre_ctas=8", "head_dim=64", "deterministic=true"]],
                         ids=["d128", "d128-causal", "d64-deterministic"])
def test_preprocess_beside_the_main_kernel_compiles_to_polls(overrides, tmp_path):
    """Note [Preprocess beside the main kernel]: the main kernel's load warp and dq-store warp
    each poll their (batch, head)'s row count (``ld.acquire.gpu`` before and in the loop, warp
    votes, no divergent lane-0 loop) and fence the async proxy once; ``griddepcontrol.wait``
    stays only as each poll's fallback, the MMA warpgroups wait for nothing; the main loop is
    the one without the switch. The preprocess launches ``pre_ctas`` CTAs of workers, a load
    warp and count warps with the SMEM it allocates, waits for the kernel before and then lets
    the main kernel launch, brings O and dO by TMA and the LSE by ``cp.async`` (no thread loads
    O or dO), and counts a chunk with one release add. (hdim 128 pinned to shuffled
    statistics on both sides: without the preprocess beside it, the default would go back to
    them, ``_own_stats_fit``, and the loops would differ for that reason.)"""
    from fa_sm100.compile_tools import cross_compile, sass_loops, sass_opcode
    from fa_sm100.config import cutlass_dtype
    from fa_sm100.hopper.bwd_interface import fake_pre_arguments
    from fa_sm100.hopper.bwd_config import SM90_SMEM_BYTES
    from fa_sm100.hopper.bwd_prepost import PRE_COUNT_WARPS, PRE_STAGES, BwdPreprocess
    from fa_sm100.inspection import inspect_kernel

    def main_kernel(switches, where):
        where.mkdir()
        inspect_kernel("sm90_bwd", "sm_90a", switches, keep_dir=where)
        (ptx,) = glob.glob(str(where / "*.ptx"))
        (sass,) = glob.glob(str(where / "*.sass"))
        loops = [[sass_opcode(t) for _, t in body] for body in sass_loops(open(sass).read())]
        main = max(loops, key=lambda ops: sum(op.startswith("HGMMA") for op in ops))
        return open(ptx).read(), open(sass).read(), main

    if "head_dim=64" not in overrides:
        overrides = overrides + ["stats_shuffle=true"]
    off = [o for o in overrides if not o.startswith("pre_ctas")] + ["pre_ctas=0"]
    ptx, sass, loop = main_kernel(overrides, tmp_path / "on")
    ptx0, _, loop0 = main_kernel(off, tmp_path / "off")
    assert loop == loop0
    assert ptx.count("griddepcontrol.wait") == 2 and ptx0.count("griddepcontrol.wait") == 3
    assert ptx.count("ld.acquire.gpu") == ptx0.count("ld.acquire.gpu") + 4
    assert ptx.count("fence.proxy.async.global") == 2
    assert "BRA.DIV" not in sass and "ENDCOLLECTIVE" not in sass
    ctas = int(overrides[0].split("=")[1])
    d = 64 if "head_dim=64" in overrides else 128
    dt = cutlass_dtype("bfloat16")
    kernel = BwdPreprocess(d, d, True, True, ctas)
    pre = cross_compile(kernel, fake_pre_arguments(dt, d), "sm_90a")
    launch = pre.launches[0]
    assert launch["grid"] == (ctas, 1, 1) and launch["use_pdl"]
    # the workers, the load warp, the count warps; PRE_STAGES units of O and dO in SMEM
    assert launch["block"] == (256 + 32 * (1 + PRE_COUNT_WARPS), 1, 1)
    assert launch["smem"] == kernel.smem_bytes(dt) <= SM90_SMEM_BYTES
    assert kernel.smem_bytes(dt) > 2 * PRE_STAGES * kernel.unit_rows * d * 2
    # one release add per chunk and no fence of its own (a release is cumulative)
    assert pre.ptx.count("red.release.gpu.global.add.s32") == 1 and "fence.acq_rel" not in pre.ptx
    wait, launch = pre.ptx.index("griddepcontrol.wait"), pre.ptx.index("griddepcontrol.launch")
    assert pre.ptx.count("griddepcontrol.launch_dependents") == 1 and wait < launch
    # O and dO by TMA (a tile each per unit), the LSE by cp.async, waited for PRE_STAGES - 1
    # groups behind; no thread loads O or dO itself
    assert pre.ptx.count("cp.async.bulk.tensor") == 2
    assert "cp.async.ca.shared.global" in pre.ptx
    assert re.findall(r"cp\.async\.wait_group\s+(\d+)", pre.ptx) == [str(PRE_STAGES - 1)]
    ops = [sass_opcode(line.split("*/", 1)[1].strip()) for line in pre.sass.splitlines()
           if re.match(r"\s*/\*[0-9a-f]{4}\*/", line)]
    assert ops.count("UTMALDG.4D") == 2 and "LDGSTS.E" in ops
    assert not [op for op in ops if op.split(".")[0] == "LDG"]


SWAP_CASES = [[], ["causal=true", "head_dim=64"], ["head_dim=96", "dq_accum=red", "early_dv=false"]]


@pytest.mark.compile
@pytest.mark.parametrize("overrides", SWAP_CASES,
                         ids=[",".join(c) or "default" for c in SWAP_CASES])
def test_sm90_bwd_swapped_sdp_feeds_dv_dk_from_registers(overrides, tmp_path):
    """sdp_swap_ab moves the A operand of dV and dK (K = tile_m = 64: 4 k16 slices each) from
    SMEM descriptors to registers, drops the P stmatrix and stores dS transposed, without
    spills and in less SMEM."""
    from fa_sm100.inspection import inspect_kernel

    reports, kinds, loops = {}, {}, {}
    for swap in (False, True):
        keep = tmp_path / f"swap_{swap}"
        # tile_m=64 on both sides (the hdim-64 default of 128 rows needs the swap)
        r = inspect_kernel("sm90_bwd", "sm_90a", overrides + [f"sdp_swap_ab={swap}", "tile_m=64"],
                           keep_dir=keep)
        sass = read_kept_sass(keep)
        loops[swap] = main_loop_ops(sass)
        kinds[swap] = _hgmma_operands(sass)
        assert _hgmma_commits(sass) == 5
        reports[swap] = r
        assert r["spill_bytes"] == 0 and r["local_bytes"] == 0
        assert r["setmaxnreg"] == {"producer": 24, "mma": 240}, r["warnings"]
    dkv_slices = 2 * 64 // 16
    assert kinds[False]["RS"] == 0
    assert kinds[True]["RS"] == dkv_slices
    assert kinds[True]["SS"] == kinds[False]["SS"] - dkv_slices
    # in the main loop (the MHA dK/dV epilogue stores by stmatrix too: Note [dK/dV by TMA])
    plain, swapped = loops[False], loops[True]
    assert plain.count("STSM.16.M88.4") == 8 and "STSM.16.MT88.4" not in plain  # P and dS
    assert swapped.count("STSM.16.MT88.4") == 4 and "STSM.16.M88.4" not in swapped  # dS^T only
    assert reports[False]["smem_bytes"] - reports[True]["smem_bytes"] == 64 * 128 * 2


TILE_M_128_CASES = [["head_dim=64"], ["head_dim=64", "early_dv=false", "causal=true"]]


@pytest.mark.compile
@pytest.mark.parametrize("overrides", TILE_M_128_CASES, ids=[",".join(c) for c in TILE_M_128_CASES])
def test_sm90_bwd_tile_m_128_doubles_the_gemms_per_query_block(overrides, tmp_path):
    """Swapped S/dP with tile_m=128 against tile_m=64: the WGMMAs that run over the queries
    double their K slices (dV, dK: RS, 8 -> 16 per thread; dQ: M 64 rows per warpgroup over the
    whole head dim, 8 k16 slices over the keys either way, N 32 -> 64), S^T and dP^T keep 4 each
    with N 64 -> 128; still five groups, no spills. dS^T takes twice the transposing stmatrix,
    LSE2/Delta are shuffled (64 SHFL per query block) and the SMEM grows by the Q/dO/dS/dQ
    tiles."""
    from fa_sm100.inspection import inspect_kernel

    reports, kinds, sass_text = {}, {}, {}
    for tile_m in (64, 128):
        keep = tmp_path / f"m{tile_m}"
        r = inspect_kernel("sm90_bwd", "sm_90a",
                           overrides + ["sdp_swap_ab=true", f"tile_m={tile_m}"], keep_dir=keep)
        sass_text[tile_m] = read_kept_sass(keep)
        kinds[tile_m] = _hgmma_operands(sass_text[tile_m])
        assert _hgmma_commits(sass_text[tile_m]) == 5, "WGMMAs serialized"
        assert r["spill_bytes"] == 0 and r["local_bytes"] == 0
        assert r["setmaxnreg"] == {"producer": 24, "mma": 240}, r["warnings"]
        reports[tile_m] = r
    assert kinds[64]["RS"] == 8 and kinds[128]["RS"] == 16
    # SS: S^T 4 + dP^T 4 + dQ 8 at both tile sizes
    assert kinds[64]["SS"] == kinds[128]["SS"] == 16
    assert re.search(r"HGMMA\.64x128x16\.F32", sass_text[128]), "S^T/dP^T should be N=128"
    assert re.search(r"HGMMA\.64x64x16\.F32", sass_text[128]), "dQ should be N=hdim=64"
    s64, s128 = reports[64]["sass_full"], reports[128]["sass_full"]
    assert s64.get("STSM.16.MT88.4", 0) == 4 and s128.get("STSM.16.MT88.4", 0) == 8  # dS^T
    assert sum(v for k, v in s128.items() if k.startswith("SHFL")) >= 64
    growth = reports[128]["smem_bytes"] - reports[64]["smem_bytes"]
    # Q, dO stages; dS stages; dQ tile; LSE2 and Delta stages (stats_smem): 64 more rows each
    assert growth == 4 * 64 * 64 * 2 + 2 * 64 * 128 * 2 + 64 * 64 * 4 + 2 * 2 * 64 * 4
    assert reports[128]["smem_bytes"] <= SM90_SMEM_BYTES


@pytest.mark.compile
@pytest.mark.parametrize("overrides", [["sdp_swap_ab=false"], ["causal=true"], ["head_dim=64"]],
                         ids=["d128-unswapped", "d128-m80", "d64-m128"])
def test_sm90_bwd_stats_come_with_their_stage(overrides, tmp_path):
    """stats_smem: the load warp bulk-copies LSE2 and Delta (one UBLKCP each per query block,
    on the Q / dO stage's mbarrier) and the MMA warpgroups read them from SMEM: fewer global
    loads than with stats_smem=false, no spills, the five WGMMA groups kept."""
    from fa_sm100.inspection import inspect_kernel

    sass = {}
    for on in (True, False):
        keep = tmp_path / f"stats_{on}"
        # pre_ctas off on both sides (it needs stats_smem, and its polls are loads too)
        r = inspect_kernel("sm90_bwd", "sm_90a", overrides + [f"stats_smem={on}", "pre_ctas=0"],
                           keep_dir=keep)
        assert r["spill_bytes"] == 0 and r["local_bytes"] == 0
        sass[on] = read_kept_sass(keep)
        assert _hgmma_commits(sass[on]) == 5, "WGMMAs serialized"
    # global -> shared copies (the dq-store warp's first stores go the other way: UBLKCP.G.S)
    assert len(re.findall(r"UBLKCP\.S\.G", sass[True])) == 2
    assert "UBLKCP.S.G" not in sass[False]
    ldg = {on: len(re.findall(r"\bLDG\.", sass[on])) for on in sass}
    assert ldg[True] < ldg[False]


WIDE_HEAD_CASES = [(["head_dim=256"], 256, 256),
                   (["head_dim=192", "causal=true", "tile_n=64"], 192, 128),
                   (["tile_n=64", "sdp_swap_ab=false", "early_dv=false"], 128, 128)]


@pytest.mark.compile
@pytest.mark.parametrize("overrides,d,dv", WIDE_HEAD_CASES,
                         ids=[",".join(c[0]) for c in WIDE_HEAD_CASES])
def test_sm90_bwd_tile_n_64_splits_dk_dv_by_columns(overrides, d, dv, tmp_path):
    """Note [dK/dV by columns]: with tile_n=64, S and dP are 64 x 32 per warpgroup (N = 32),
    dK and dQ are N = hdim/2 and dV N = hdim_v/2 per warpgroup over K = 64 (4 k16 slices
    each), and every dK/dV HGMMA follows the DS_READY barrier (they read both warpgroups' P
    and dS). P and dS are stored by stmatrix (2 + 2 per thread); five WGMMA groups, no spills,
    setmaxnreg kept."""
    from fa_sm100.compile_tools import sass_main_loop
    from fa_sm100.hopper.named_barriers import Sm90BwdBarrier
    from fa_sm100.inspection import inspect_kernel

    r = inspect_kernel("sm90_bwd", "sm_90a", overrides, keep_dir=tmp_path)
    sass = read_kept_sass(tmp_path)
    assert r["spill_bytes"] == 0 and r["local_bytes"] == 0
    assert r["setmaxnreg"] == {"producer": 24, "mma": 240}, r["warnings"]
    assert _hgmma_commits(sass) == 5
    loop = [t for _, t in sass_main_loop(sass)]
    shapes = [re.match(r"HGMMA\.64x(\d+)x16", t).group(1) for t in loop if t.startswith("HGMMA")]
    want = {"32": (d + dv) // 16}  # S over hdim, dP over hdim_v
    for n, gemms in ((d // 2, 2), (dv // 2, 1)):  # dK and dQ; dV
        want[str(n)] = want.get(str(n), 0) + 4 * gemms
    assert {n: shapes.count(n) for n in set(shapes)} == want
    barrier = f"BAR.SYNC.DEFER_BLOCKING {int(Sm90BwdBarrier.DS_READY):#x},"
    at_barrier = next(i for i, t in enumerate(loop) if t.startswith(barrier))
    after = [t for t in loop[at_barrier:] if t.startswith("HGMMA")]
    assert len(after) == 12, "dV, dQ and dK (4 k16 slices each) follow the dS barrier"
    assert [t.split()[0] for t in loop].count("STSM.16.M88.4") == 4  # P and dS


@pytest.mark.compile
@pytest.mark.parametrize("head_dim", [64, 128, 192])
def test_sm90_bwd_gqa_bulk_adds_dk_dv_by_two_bulk_reduces_per_warpgroup(head_dim, tmp_path):
    """Note [dK/dV by bulk reduces]: GQA dK and dV leave by bulk reduces (UBLKRED.ADD.F32:
    two for dQ's halves, one each for dK and dV, issued per warpgroup), no per-element float32
    reductions (``atomic``'s REDG.ADD.F32) and no per-element float32 stores; no spills."""
    from fa_sm100.inspection import inspect_kernel

    overrides = [f"head_dim={head_dim}", "qhead_per_kvhead=4", "causal=true"]
    counts = {}
    for mode in ("bulk", "atomic", "buffers"):
        keep = tmp_path / mode
        r = inspect_kernel("sm90_bwd", "sm_90a", overrides + [f"gqa_reduce={mode}"],
                           keep_dir=keep)
        assert r["spill_bytes"] == 0 and r["local_bytes"] == 0
        sass = read_kept_sass(keep)
        counts[mode] = (len(re.findall(r"UBLKRED\.G\.S\.ADD\.F32", sass)),
                        len(re.findall(r"REDG\.E\.ADD\.F32", sass)),
                        len(re.findall(r"\bSTG\.E(\.64)?\b", sass)))
    assert counts["bulk"][:2] == (4, 0)
    assert counts["atomic"][0] == 2 and counts["atomic"][1] > 0
    assert counts["buffers"][:2] == (2, 0) and counts["buffers"][2] > counts["bulk"][2]


@pytest.mark.compile
@pytest.mark.parametrize("causal,early", [(False, False), (True, False), (False, True)],
                         ids=["full", "causal", "full-early-dv"])
def test_sm90_bwd_tile_n_96_computes_dk_dv_transposed(causal, early, tmp_path):
    """Note [dK/dV transposed] at (192, 128): S and dP are 64 x 48 per warpgroup, and so are
    dV^T (2 head-dim atoms) and dK^T (3) over K = 64 (4 k16 slices each), both operands
    MN-major (``tnspA.tnspB``); dQ is N = 96 over K = 96 (6 slices). Early dV (a switch here:
    the default leaves it off) runs before the dS barrier, which only dQ and dK then wait for. P and dS
    are stored by stmatrix (3 + 3 per thread), dK^T and dV^T leave by ``stmatrix.trans``;
    five WGMMA groups, no spills, setmaxnreg kept."""
    from fa_sm100.compile_tools import sass_main_loop
    from fa_sm100.hopper.named_barriers import Sm90BwdBarrier
    from fa_sm100.inspection import inspect_kernel

    cfg = select_bwd_config(head_dim=192, causal=causal)
    assert cfg.tile_n == 96 and cfg.dkv_swap_ab and not cfg.early_dv
    assert cfg.dkv_acc_regs() == 120
    r = inspect_kernel("sm90_bwd", "sm_90a",
                       ["head_dim=192", f"causal={causal}", f"early_dv={early}"],
                       keep_dir=tmp_path)
    sass = read_kept_sass(tmp_path)
    assert r["spill_bytes"] == 0 and r["local_bytes"] == 0
    assert r["setmaxnreg"] == {"producer": 24, "mma": 240}, r["warnings"]
    assert _hgmma_commits(sass) == 5
    loop = [t for _, t in sass_main_loop(sass)]
    hgmma = [t for t in loop if t.startswith("HGMMA")]
    shapes = [re.match(r"HGMMA\.64x(\d+)x16", t).group(1) for t in hgmma]
    # S over hdim, dP over hdim_v, dV^T over 2 x 4 and dK^T over 3 x 4; dQ 6 slices of 96
    assert {n: shapes.count(n) for n in set(shapes)} == {"48": 12 + 8 + 8 + 12, "96": 6}
    assert sum(".tnspA.tnspB" in t for t in hgmma) == 8 + 12
    barrier = f"BAR.SYNC.DEFER_BLOCKING {int(Sm90BwdBarrier.DS_READY):#x},"
    at_barrier = next(i for i, t in enumerate(loop) if t.startswith(barrier))
    after = sum(t.startswith("HGMMA") for t in loop[at_barrier:])
    assert after == 6 + 12 + (0 if early else 8), "dV before the barrier only when early"
    assert [t.split()[0] for t in loop].count("STSM.16.M88.4") == 6  # P and dS
    assert len(re.findall(r"STSM\.16\.MT88\.4", sass)) == (192 + 128) * 48 // (4 * 4 * 64)


@pytest.mark.compile
@pytest.mark.parametrize("head_dim,shuffle", [(128, True), (128, False), (64, True), (64, False)])
def test_sm90_bwd_wide_blocks_shuffle_or_load_their_stats(head_dim, shuffle, tmp_path):
    """Note [tile_m 128] (``stats_shuffle``): with 80- or 128-row blocks each lane loads 4
    LSE2/Delta values (two LDS.64 per statistic) and every S^T column's value comes by one
    SHFL.IDX; without the shuffle every thread loads its own columns' values, two per LDS.64
    (FA4's way), and the main loop has no SHFL. Both compile without spills."""
    from fa_sm100.inspection import inspect_kernel

    cfg = select_bwd_config(head_dim=head_dim, stats_shuffle=shuffle)
    assert cfg.wide_query_block and cfg.shuffled_stats == shuffle
    r = inspect_kernel("sm90_bwd", "sm_90a", [f"head_dim={head_dim}",
                                              f"stats_shuffle={shuffle}".lower()], keep_dir=tmp_path)
    assert r["spill_bytes"] == 0
    ops = main_loop_ops(read_kept_sass(tmp_path))
    columns = cfg.tile_m // 4  # S^T columns (queries) per thread
    if shuffle:
        assert ops.count("SHFL.IDX") == 2 * columns and ops.count("LDS.64") == 4
    else:
        assert "SHFL.IDX" not in ops and ops.count("LDS.64") == columns  # 2 stats x columns / 2


@pytest.mark.compile
def test_sm90_bwd_tile_m_80_computes_dq_transposed(tmp_path):
    """Note [dQ transposed]: with 80 query rows, S^T/dP^T are N = 80 (8 k16 slices each over
    hdim 128), dV/dK RS with K = 80 (5 slices each), and dQ^T = K^T dS^T is M = 64 head-dim
    rows per warpgroup, N = 80, over K = 128 keys (8 SS slices); each thread loads its 20
    columns' LSE2/Delta, two per LDS.64 (Note [dP wait placement]); five WGMMA groups, no
    spills."""
    from fa_sm100.inspection import inspect_kernel

    r = inspect_kernel("sm90_bwd", "sm_90a", ["tile_m=80", "sdp_swap_ab=true"], keep_dir=tmp_path)
    sass = read_kept_sass(tmp_path)
    assert r["spill_bytes"] == 0 and r["local_bytes"] == 0
    assert _hgmma_commits(sass) == 5
    loop = main_loop_ops(sass)
    shapes = [op.split(".")[1] for op in loop if op.startswith("HGMMA")]
    assert shapes.count("64x80x16") == 8 + 8 + 8  # S^T, dP^T, dQ^T
    assert shapes.count("64x128x16") == 5 + 5  # dV, dK
    assert _hgmma_operands(sass) == {"RS": 10, "SS": 24}
    assert "SHFL.IDX" not in loop and loop.count("LDS.64") == 20  # 10 LSE2 + 10 Delta


@pytest.mark.compile
@pytest.mark.parametrize("causal", [False, True])
def test_sm90_bwd_dp_wait_comes_after_the_boundary(causal, tmp_path):
    """Note [dP wait placement], hdim 128's default (80-row blocks): LSE2's 10 LDS.64 are
    issued while S^T's GEMM runs (between its first HGMMA and dP^T's), the loop holds one more
    WGMMA wait than its GEMMs need (the never-taken branch's), and at least dp_wait_after
    exp2s are issued before the dP^T wait can come (both 0x0 waits after the S^T one), with no
    spills and five WGMMA groups. Under a causal mask too: a branch on ``m_block == -1`` there
    was folded away, since the sweep starts at a block >= 0."""
    from fa_sm100.inspection import inspect_kernel

    cfg = select_bwd_config(causal=causal, seqlen_q=16384, seqlen_k=16384)
    assert cfg.tile_m == 80 and cfg.dp_wait_after == DP_WAIT_AFTER_80
    r = inspect_kernel("sm90_bwd", "sm_90a", ["head_dim=128", f"causal={causal}".lower(),
                                              "qdo_multicast=true"], keep_dir=tmp_path)
    sass = read_kept_sass(tmp_path)
    assert r["spill_bytes"] == 0 and _hgmma_commits(sass) == 5
    from fa_sm100.compile_tools import sass_main_loop

    texts = [t for _, t in sass_main_loop(sass)]
    loop = main_loop_ops(sass)
    # the first HGMMA of S^T, then of dP^T: the first two that start from a zero accumulator
    s_first, dp_first = [i for i, t in enumerate(texts) if "RZ, !UPT" in t][:2]
    assert loop[s_first:dp_first].count("LDS.64") == 10
    waits = [i for i, t in enumerate(loop) if t.startswith("WARPGROUP.DEPBAR")]
    assert len(waits) == 5  # S^T; the branch's and the real dP^T wait; dV/dQ; dK
    for at in waits[1:3]:
        assert loop[:at].count("MUFU.EX2") >= cfg.dp_wait_after


SMEM_CASES = [dict(head_dim=128), dict(head_dim=128, tile_m=64, sdp_swap_ab=False),
              dict(head_dim=128, tile_m=64, dq_accum="red", q_stage=3, do_stage=3),
              dict(head_dim=64), dict(head_dim=64, stats_smem=False), dict(head_dim=96),
              dict(head_dim=192), dict(head_dim=256),
              dict(head_dim=256, dq_accum="bulk", q_stage=1, do_stage=1),
              # Note [persistent CTAs]: one more mbarrier (K/V empty)
              dict(head_dim=128, persistent_ctas=132, pre_ctas=0),
              dict(head_dim=64, persistent_ctas=8),
              # Note [dynamic tiles]: the handoff's mbarriers and index slots
              dict(head_dim=64, causal=True, persistent_ctas=8, dynamic_tiles=True)]


@pytest.mark.compile
@pytest.mark.parametrize("overrides", SMEM_CASES,
                         ids=[",".join(f"{k}={v}" for k, v in c.items()) for c in SMEM_CASES])
def test_smem_bytes_is_the_kernels_shared_storage_size(overrides):
    """``BwdConfig.smem_bytes`` (what validate() holds to the 227 KiB budget and what the
    compile contract reports) equals the size of the kernel's SharedStorage struct, which is
    what a launch asks for. It once left out the 1 KiB round-up of the struct and the "red"
    placeholder: a config the formula put at 232448 B needed 233472 B and failed to launch."""
    import cutlass.cute as cute

    from fa_sm100.hopper.bwd_kernel import Sm90FlashBackward

    cfg = select_bwd_config(**overrides)
    kernel = Sm90FlashBackward(cfg)
    size = {}

    @cute.jit
    def probe():
        kernel._setup_layouts()
        size["struct"] = kernel._shared_storage().size_in_bytes()

    cute.compile(probe, options="--gpu-arch sm_90a")
    assert size["struct"] == cfg.smem_bytes() <= SM90_SMEM_BYTES


def _grid_default_configs():
    """The distinct configs ``select_bwd_config`` picks for the benchmark grid's cells (head
    dims 64 / 128 / 256, causal and not, 1k-16k; MHA)."""
    configs = []
    for d in (64, 128, 256):
        for causal in (False, True):
            for s in (1024, 2048, 4096, 8192, 16384):
                cfg = select_bwd_config(head_dim=d, causal=causal, seqlen_q=s, seqlen_k=s)
                if cfg not in configs:
                    configs.append(cfg)
    return configs


GRID_DEFAULTS = _grid_default_configs()


@pytest.mark.compile
@pytest.mark.parametrize("cfg", GRID_DEFAULTS, ids=lambda c: (
    f"d{c.head_dim}-{'causal' if c.causal else 'full'}-tm{c.tile_m}"
    f"{'-pers' if c.persistent_ctas else ''}{'-dyn' if c.dynamic_tiles else ''}"
    f"{'-mc' if c.qdo_multicast else ''}{'-stagger' if c.stagger_m else ''}"
    f"{'-pre' if c.pre_ctas else ''}{'-post' if c.early_dq_post else ''}"))
def test_grid_defaults_compile_without_spill_or_serialized_wgmma(cfg, tmp_path):
    """Every config the benchmark grid runs by default cross-compiles with no spill and its
    five GEMMs as five WGMMA commit groups. When a value the sweep does not need stays live
    through it, ptxas runs out of registers in the MMA warpgroups and serializes every
    WGMMA (one commit each: 34 per block at hdim 128) or spills; the compile contract's
    hand-picked cases missed that for dynamic tiles at hdim 128 until one was added, so the
    defaults are checked here as ``select_bwd_config`` picks them."""
    from fa_sm100.compile_tools import cross_compile, find_nvdisasm, prepare_arch_env
    from fa_sm100.hopper.inspect_bwd import build
    from fa_sm100.inspection import make_report

    prepare_arch_env("sm_90a")
    kernel = build(cfg, "sm_90a")
    report = make_report("sm90_bwd", kernel, cross_compile(
        kernel.fn, kernel.args, "sm_90a", keep_dir=tmp_path, nvdisasm=find_nvdisasm()))
    assert report["spill_bytes"] == 0 and report["local_bytes"] == 0, report["warnings"]
    assert _hgmma_commits(read_kept_sass(tmp_path)) == 5, "WGMMAs serialized"
