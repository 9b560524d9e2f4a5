"""Persistent CTAs of the SM90 backward (Notes [persistent CTAs] and [dynamic tiles] in
fa_sm100/hopper/bwd_tiles.py), on the CPU: the config's rules and defaults, the interface's
SM-count fit, and the cross-compiled kernel (no spill, the sweep's loop body unchanged, one TMA
load of K and V per tile behind the K/V-empty wait, one tile fetch). Gradients on an H200:
tests/test_sm90_bwd_gpu.py (``persistent``, ``dynamic_tiles``)."""

import collections

import pytest
from kept_sass import main_loop_ops, read_kept_sass

from fa_sm100.hopper.bwd_defaults import (DEFAULT_PERSISTENT_CTAS, PERSISTENT_MAX_SEQLEN,
                                          select_bwd_config)
from fa_sm100.hopper.bwd_interface import fit_persistent_ctas

# the hdim 128 non-causal defaults of a 1k problem: multicast pairs, staggered sweeps, first dQ
# stores, the early dQ postprocess
H128 = select_bwd_config(head_dim=128, seqlen_q=1024, seqlen_k=1024)


@pytest.mark.parametrize("changes,rule", [
    (dict(causal=True), "without a causal mask or window"),
    (dict(window_left=100), "without a causal mask or window"),
    (dict(deterministic=True, qdo_multicast=False, stagger_m=False), "deterministic=False"),
    (dict(qhead_per_kvhead=2), "MHA with dkv_tma_store=True"),
    (dict(dkv_tma_store=False), "MHA with dkv_tma_store=True"),
    (dict(dq_accum="red", early_dq_post=False), "dq_accum='bulk'"),
    (dict(pre_ctas=32), "pre_ctas=0"),
    (dict(longest_first=True), "longest_first=False"),
    (dict(persistent_ctas=131, qdo_multicast=True), "a multiple of the cluster size 2"),
    (dict(qdo_multicast=True, qdo_cluster=4), "do not all fit at once"),
    (dict(persistent_ctas=-1), "persistent_ctas=-1: must be an int >= 0"),
    (dict(persistent_ctas=True), "must be an int"),
])
def test_persistent_rules_raise_value_error_naming_the_rule(changes, rule):
    # the other switches' own rules (multicast, stagger) left out of the way
    base = H128.replace(qdo_multicast=False, stagger_m=False)
    cfg = base.replace(**{"persistent_ctas": 132, **changes})
    with pytest.raises(ValueError, match=rule):
        cfg.validate()


def test_persistent_epilogue_staging_must_fit():
    """dK is staged in the dS buffers, dV in the SMEM dQ tile: hdim 256 (64 keys of 256
    columns, 32 KiB each, against 16 KiB of dS) does not fit; hdim 64 and 128 do."""
    for d in (64, 128):
        assert select_bwd_config(head_dim=d).epilogue_staging_fits()
    wide = select_bwd_config(head_dim=256, dq_accum="bulk", q_stage=1, do_stage=1)
    assert not wide.epilogue_staging_fits()
    with pytest.raises(ValueError, match="dK to fit the dS buffers"):
        wide.replace(persistent_ctas=132).validate()


def test_persistent_defaults_where_measured():
    """select_bwd_config: on for non-causal MHA hdim 64 / 128 up to PERSISTENT_MAX_SEQLEN, with
    the preprocess ahead of the main kernel; off elsewhere and wherever a field it depends on
    is asked for."""
    for d in (64, 128):
        for s in (1024, PERSISTENT_MAX_SEQLEN):
            cfg = select_bwd_config(head_dim=d, seqlen_q=s, seqlen_k=s)
            assert cfg.persistent_ctas == DEFAULT_PERSISTENT_CTAS and cfg.pre_ctas == 0
        assert select_bwd_config(head_dim=d, seqlen_q=4096, seqlen_k=1024).persistent_ctas == 0
    assert select_bwd_config(head_dim=128, seqlen_q=4096, seqlen_k=4096).pre_ctas == 32
    off = [dict(head_dim=128, causal=True), dict(head_dim=128, window_left=64),
           dict(head_dim=128, qhead_per_kvhead=4), dict(head_dim=64, deterministic=True),
           dict(head_dim=96), dict(head_dim=256), dict(head_dim=128, pre_ctas=8),
           dict(head_dim=128, dkv_tma_store=False), dict(head_dim=128)]  # last: no lengths
    for kw in off:
        lengths = {} if kw == dict(head_dim=128) else dict(seqlen_q=1024, seqlen_k=1024)
        assert select_bwd_config(**kw, **lengths).persistent_ctas == 0, kw
    # pre_ctas=0 asked for keeps the default; an explicit persistent_ctas takes pre_ctas=0
    assert select_bwd_config(head_dim=128, seqlen_q=1024, seqlen_k=1024,
                             pre_ctas=0).persistent_ctas == DEFAULT_PERSISTENT_CTAS
    asked = select_bwd_config(head_dim=128, seqlen_q=8192, seqlen_k=8192, persistent_ctas=64)
    assert (asked.persistent_ctas, asked.pre_ctas) == (64, 0)


def test_fit_persistent_ctas_to_the_device():
    """The interface lowers persistent_ctas to the device's SMs in whole clusters, and leaves
    every other config alone."""
    assert fit_persistent_ctas(H128, 132) == H128
    assert fit_persistent_ctas(H128, 114).persistent_ctas == 114
    assert fit_persistent_ctas(H128, 115).persistent_ctas == 114  # clusters of 2
    assert H128.qdo_multicast
    single = H128.replace(qdo_multicast=False)
    assert fit_persistent_ctas(single, 115).persistent_ctas == 115
    small = H128.replace(persistent_ctas=8)
    assert fit_persistent_ctas(small, 132) == small
    plain = select_bwd_config(head_dim=128, seqlen_q=8192, seqlen_k=8192)
    assert fit_persistent_ctas(plain, 100) == plain


@pytest.mark.compile
@pytest.mark.parametrize("head_dim", [64, 128])
def test_persistent_kernel_compiles_with_the_sweep_unchanged(head_dim, tmp_path):
    """The persistent kernel: no spill, the WGMMAs still issued in five commit groups per
    block, the sweep's loop body (its GEMMs, barriers, exp2s, stores and reduces) the one of
    one CTA per tile, one more mbarrier (K/V empty) and a cluster of 2."""
    from fa_sm100.inspection import inspect_kernel

    def build(persistent):
        keep = tmp_path / str(persistent)
        overrides = [f"head_dim={head_dim}", f"head_dim_v={head_dim}", "qdo_multicast=true",
                     "pre_ctas=0", f"persistent_ctas={132 if persistent else 0}"]
        report = inspect_kernel("sm90_bwd", "sm_90a", overrides, keep_dir=keep)
        return report, read_kept_sass(keep)

    (plain, plain_sass), (pers, pers_sass) = build(False), build(True)
    assert pers["spill_bytes"] == 0 and pers["local_bytes"] == 0
    assert list(pers["cluster"]) == [2, 1, 1]
    loop_kinds = ("HGMMA", "MUFU", "BAR", "WARPGROUP", "UBLKRED", "STSM", "FENCE", "SYNCS")

    def loop_work(sass):
        ops = collections.Counter(main_loop_ops(sass))
        return {k: v for k, v in ops.items() if k.split(".")[0] in loop_kinds}

    assert loop_work(pers_sass) == loop_work(plain_sass)
    commits = lambda s: len([line for line in s.splitlines() if "HGMMA" in line and "gsb0" in line])
    assert commits(pers_sass) == commits(plain_sass) == 5
    # every TMA load of one CTA per tile appears twice: K / V for the first tile (before the
    # preprocess's wait) and for a later one (after K/V empty); Q / dO for a tile's first
    # block (before K / V) and in the loop
    tma = lambda s: sum(1 for line in s.splitlines() if "UTMALDG" in line)
    assert tma(pers_sass) == 2 * tma(plain_sass)


# hdim 64 causal 1k with dynamic tiles, the default there
C64 = select_bwd_config(head_dim=64, causal=True, seqlen_q=1024, seqlen_k=1024)


@pytest.mark.parametrize("changes,rule", [
    (dict(persistent_ctas=0), "dynamic_tiles=True needs persistent_ctas > 0"),
    (dict(qdo_multicast=True), "qdo_multicast=False with dynamic_tiles"),
    (dict(pre_ctas=32), "pre_ctas=0"),
    (dict(deterministic=True), "deterministic=False"),
    (dict(dynamic_tiles=1), "dynamic_tiles=1: must be a bool"),
])
def test_dynamic_tiles_rules_raise_value_error_naming_the_rule(changes, rule):
    assert C64.dynamic_tiles and C64.persistent_ctas
    with pytest.raises(ValueError, match=rule):
        C64.replace(**changes).validate()


def test_dynamic_tiles_take_masks_windows_and_longest_first():
    """What a fixed stride refuses, fetched tiles take: a causal mask (longest first or not),
    a window, no mask."""
    for changes in (dict(), dict(longest_first=False), dict(causal=False, window_left=100),
                    dict(causal=False)):
        assert C64.replace(**changes).validate().dynamic_tiles
    with pytest.raises(ValueError, match="or dynamic_tiles=True"):
        C64.replace(dynamic_tiles=False).validate()


def test_dynamic_tiles_defaults_where_measured():
    """select_bwd_config: on for causal hdim 64 up to PERSISTENT_MAX_SEQLEN and for every
    windowed hdim 64 problem at any length (persistent CTAs, the preprocess ahead); off at
    longer causal lengths, at hdim 128, for GQA, and wherever persistent CTAs or their
    preprocess are asked for; asked for, it turns multicast off instead of failing on it."""
    on = [dict(head_dim=64, causal=True, seqlen_q=s, seqlen_k=s)
          for s in (1024, PERSISTENT_MAX_SEQLEN)]
    on += [dict(head_dim=64, causal=True, window_left=64, seqlen_q=16384, seqlen_k=16384),
           dict(head_dim=64, window_left=1024, window_right=0),
           dict(head_dim=64, window_left=8192, window_right=0),
           dict(head_dim=64, window_left=64), dict(head_dim=64, window_right=5),
           dict(head_dim=64, window_left=256, window_right=256, seqlen_q=8192, seqlen_k=8192)]
    for kw in on:
        cfg = select_bwd_config(**kw)
        assert (cfg.dynamic_tiles, cfg.persistent_ctas, cfg.pre_ctas) == (
            True, DEFAULT_PERSISTENT_CTAS, 0), kw
    off = [dict(head_dim=64, causal=True, seqlen_q=4096, seqlen_k=4096),
           dict(head_dim=128, causal=True), dict(head_dim=64, causal=False),
           dict(head_dim=128, window_left=64, window_right=0),
           dict(head_dim=64, window_left=64, window_right=0, qhead_per_kvhead=2),
           dict(head_dim=64, window_left=64, window_right=0, deterministic=True),
           dict(head_dim=64, causal=True, persistent_ctas=0),
           dict(head_dim=64, causal=True, pre_ctas=8),
           dict(head_dim=64, causal=True, deterministic=True)]
    for kw in off:
        lengths = {k: 1024 for k in ("seqlen_q", "seqlen_k") if k not in kw}
        assert not select_bwd_config(**kw, **lengths).dynamic_tiles, kw
    asked = select_bwd_config(head_dim=64, causal=True, seqlen_q=8192, seqlen_k=8192,
                              persistent_ctas=132, dynamic_tiles=True, early_dq_post=True)
    assert (asked.qdo_multicast, asked.early_dq_post, asked.pre_ctas) == (False, True, 0)
    assert select_bwd_config(head_dim=64, causal=True, seqlen_q=8192, seqlen_k=8192).qdo_multicast


def test_dynamic_tiles_refused_at_hdim_128():
    """At hdim 128 the fetched walk's values do not fit the MMA warpgroups' registers (the
    compile contract saw 34 WGMMA commit groups per block instead of 5 at 80-row blocks):
    refused, naming the rule; hdim 96 is taken."""
    for d in (64, 96):
        assert select_bwd_config(head_dim=d, causal=True, persistent_ctas=132,
                                 dynamic_tiles=True).dynamic_tiles
    with pytest.raises(ValueError, match="head_dim <= 96 with dynamic_tiles"):
        select_bwd_config(head_dim=128, causal=True, persistent_ctas=132, dynamic_tiles=True)


def test_dynamic_tiles_take_one_more_semaphore_slot():
    """The tile counter is one more dQ semaphore of every (batch, head) (the kernel uses
    (0, 0)'s), zeroed by the preprocess with the others."""
    plain = C64.replace(dynamic_tiles=False, persistent_ctas=0)
    assert C64.dq_sems_per_block  # first dQ stores: one per query block
    assert (plain.dq_sem_slots(8), C64.dq_sem_slots(8)) == (8, 9)
    # without per-block semaphores the one slot every (batch, head) has is the counter
    assert C64.replace(dq_first_store=False).dq_sem_slots(8) == 1


@pytest.mark.compile
def test_dynamic_tiles_kernel_compiles_with_the_sweep_unchanged(tmp_path):
    """Causal hdim 64 with dynamic tiles: no spill, the sweep's loop body that of one CTA
    per tile, one atomic add (the tile fetch) beside the first dQ store's compare-and-swap,
    K / V loaded before the first tile's preprocess wait and after K/V empty."""
    from fa_sm100.inspection import inspect_kernel

    def build(dynamic):
        keep = tmp_path / str(dynamic)
        overrides = ["head_dim=64", "head_dim_v=64", "causal=true"]  # no lengths: no default
        if dynamic:
            overrides += ["persistent_ctas=132", "dynamic_tiles=true"]
        report = inspect_kernel("sm90_bwd", "sm_90a", overrides, keep_dir=keep)
        return report, read_kept_sass(keep)

    (plain, plain_sass), (dyn, dyn_sass) = build(False), build(True)
    assert dyn["config"]["dynamic_tiles"] and not plain["config"]["persistent_ctas"]
    assert dyn["spill_bytes"] == 0 and dyn["local_bytes"] == 0
    loop_kinds = ("HGMMA", "MUFU", "BAR", "WARPGROUP", "UBLKRED", "STSM", "FENCE", "SYNCS")

    def loop_work(sass):
        ops = collections.Counter(main_loop_ops(sass))
        return {k: v for k, v in ops.items() if k.split(".")[0] in loop_kinds}

    assert loop_work(dyn_sass) == loop_work(plain_sass)
    atomics = lambda s: sorted(line.split()[1] for line in s.splitlines() if "ATOMG" in line)
    assert atomics(plain_sass) == ["ATOMG.E.CAS.STRONG.GPU"]
    assert atomics(dyn_sass) == ["ATOMG.E.ADD.STRONG.GPU", "ATOMG.E.CAS.STRONG.GPU"]
    tma = lambda s: sum(1 for line in s.splitlines() if "UTMALDG" in line)
    assert tma(dyn_sass) == 2 * tma(plain_sass)


def test_dq_postprocess_compile_key_tells_where_its_count_is():
    """With ``early_dq_post`` the dQ postprocess polls the finished-tile count, whose slot
    among the dQ semaphores moves with the config (``finished_ctas_count``: before the tile
    counter of dynamic tiles and the persistent preprocess's count). One compiled
    postprocess serves every config with its compile key, so equal keys must mean the same
    slot: a key without ``dynamic_tiles`` once let a dynamic config's postprocess poll the
    tile counter and convert head (0, 0) too early, whenever a config without dynamic tiles
    had compiled it first (a GPU test failed only in the full run)."""
    from types import SimpleNamespace

    from fa_sm100.hopper.bwd_prepost import DqPostprocess
    from fa_sm100.hopper.bwd_store import finished_ctas_count

    class Semaphores:  # what finished_ctas_count reads of the (batch, heads, slots) tensor
        shape = (1, 1, 100)

        def __getitem__(self, index):
            return SimpleNamespace(iterator=0)

    slot_of_key = {}
    kinds = set()
    for causal, kw in ((False, dict()), (True, dict()), (False, dict(pre_ctas=32)),
                       (True, dict(pre_ctas=32)), (False, dict(persistent_ctas=132)),
                       (False, dict(persistent_ctas=132, dynamic_tiles=True)),
                       (True, dict(persistent_ctas=132, dynamic_tiles=True))):
        d = 96 if kw.get("dynamic_tiles") else 128  # dynamic tiles: head dims up to 96
        cfg = select_bwd_config(head_dim=d, causal=causal, seqlen_q=1024, seqlen_k=1024,
                                early_dq_post=True, **kw)
        slot = finished_ctas_count(cfg, Semaphores(), 0, 0)
        kinds.add(slot)
        assert slot_of_key.setdefault(DqPostprocess.compile_key(cfg), slot) == slot, kw
    assert kinds == {99, 98}  # last; before the tile counter or the preprocess's count
