"""The SM100 backward's plans as data (no compile): its TMEM columns, SMEM budget, warp-role
registers and pipeline table hold their invariants for every supported problem, and a problem
that cannot fit says why."""

import itertools

import pytest

from fa_sm100.bands import kernel_window, kv_block_range, q_block_range
from fa_sm100.config import REGISTER_FILE
from fa_sm100.sm100.bwd_config import (SM100_BWD_HEAD_DIMS, SMEM_BYTES, Sm100BwdConfig,
                                       select_sm100_bwd_config)
from layouts.tmem import TMEM_COLS, TmemPlan
from pipelines.spec import active_specs, barrier_count

PROBLEMS = list(itertools.product(SM100_BWD_HEAD_DIMS, ("bfloat16", "float16"), (False, True),
                                  (1, 4)))


def _cfg(dims, dtype, causal, group):
    return select_sm100_bwd_config(dims[0], dims[1], dtype, causal, group)


@pytest.mark.parametrize("dims,dtype,causal,group", PROBLEMS)
def test_every_default_validates_and_fits(dims, dtype, causal, group):
    cfg = _cfg(dims, dtype, causal, group)
    assert cfg.smem_bytes() <= SMEM_BYTES
    roles = cfg.warp_roles()
    assert roles.registers_used() <= REGISTER_FILE
    # two Q stages wherever they fit (every supported head dim today)
    assert cfg.q_stage == 2


@pytest.mark.parametrize("d", [d for d, _ in SM100_BWD_HEAD_DIMS])
def test_tmem_plan_gives_each_warpgroup_its_own_columns(d):
    cfg = Sm100BwdConfig(head_dim=d, head_dim_v=d)
    plan = TmemPlan.for_backward(cfg)
    assert plan.cols_used <= TMEM_COLS
    half = cfg.m_block // 2
    for h in range(2):
        # P^T / dS^T of warpgroup h lie over the S^T / dP^T columns that warpgroup reads
        for alias, host in ((f"P{h}", "S"), (f"dS{h}", "dP")):
            r, base = plan[alias], plan.offset(host) + h * half
            assert base <= r.start and r.stop <= base + half
            # 16-bit pairs: the half's 64 queries take 32 columns
            assert r.cols == half * cfg.dtype_bytes // 4
    # dQ lands over dP^T, never over the accumulators that live through the tile
    dq = plan["dQ"]
    assert dq.host == "dP" and dq.cols == d
    for acc in ("dK", "dV"):
        assert not dq.overlaps(plan[acc]) and not plan["S"].overlaps(plan[acc])


def test_hdim_192_does_not_fit_and_says_why_in_columns():
    with pytest.raises(ValueError, match="576 of 512 columns"):
        Sm100BwdConfig(head_dim=192, head_dim_v=128).validate()


def test_a_window_and_a_cap_are_bools_that_change_no_plan():
    """Only whether there is a window or a cap is compile-time (their values are launch
    arguments): the defaults pass the two bools through, and SMEM, TMEM and registers stay
    those of the plain problem."""
    for dims, dtype, causal, group in PROBLEMS:
        plain = _cfg(dims, dtype, causal, group)
        for local, softcap in ((True, False), (False, True), (True, True)):
            cfg = select_sm100_bwd_config(dims[0], dims[1], dtype, causal, group, local=local,
                                          softcap=softcap)
            assert (cfg.local, cfg.is_local, cfg.softcap) == (local, local, softcap)
            assert cfg.replace(local=False, softcap=False) == plain
            assert cfg.smem_bytes() == plain.smem_bytes()
            assert TmemPlan.for_backward(cfg).table() == TmemPlan.for_backward(plain).table()
    for name, value in (("local", 1), ("softcap", 30.0)):
        with pytest.raises(ValueError, match=f"{name}=.*a compile-time switch is a bool"):
            Sm100BwdConfig(**{name: value}).validate()


def test_switches_that_do_not_exist_yet_are_refused():
    with pytest.raises(ValueError, match="q_stage"):
        Sm100BwdConfig(q_stage=3).validate()


def test_deterministic_is_a_validated_switch_that_changes_no_plan():
    """``deterministic`` is a bool; it changes neither SMEM, TMEM nor registers (its
    semaphores live in global memory), and a turn is one release per dQ warp."""
    for dims, dtype, causal, group in PROBLEMS:
        plain = _cfg(dims, dtype, causal, group)
        cfg = select_sm100_bwd_config(dims[0], dims[1], dtype, causal, group,
                                      deterministic=True)
        assert cfg.deterministic and cfg.replace(deterministic=False) == plain
        assert cfg.smem_bytes() == plain.smem_bytes()
        assert TmemPlan.for_backward(cfg).table() == TmemPlan.for_backward(plain).table()
        assert cfg.dq_releases_per_turn() == len(cfg.warp_roles().dq) == 4
    with pytest.raises(ValueError, match="deterministic=.*a compile-time switch is a bool"):
        Sm100BwdConfig(deterministic=1).validate()


def _visitors(cfg, m, sq, sk, left, right):
    """The key blocks whose walk reaches query block ``m``, as ``Sm100Backward._problem``
    walks (no mask: every block; causal alone, ``right`` 0: from the diagonal's block to the
    last; a window: q_block_range)."""
    n_blocks, m_blocks = -(-sk // cfg.n_block), -(-sq // cfg.m_block)
    out = []
    for n in range(n_blocks):
        if left is not None:
            lo, hi = q_block_range(n * cfg.n_block, cfg.n_block, cfg.m_block, sq, sk, left, right)
            hi = max(hi, lo)
        elif right is not None:  # causal
            lo, hi = max(n * cfg.n_block - (sk - sq), 0) // cfg.m_block, m_blocks
        else:
            lo, hi = 0, m_blocks
        if lo <= m < hi:
            out.append(n)
    return out


def test_deterministic_turns_count_only_the_key_blocks_that_reach_a_query_block():
    """Note [Deterministic dQ]: the key blocks whose walk reaches query block m are
    consecutive from ``kv_block_range``'s first block (0 without a window), so key block n's
    turn n - first is 0, 1, 2, ... there and no turn waits for a block that never comes."""
    cfg = Sm100BwdConfig()
    for sq, sk in itertools.product((1, 127, 128, 200, 300, 513), (1, 129, 256, 390, 640)):
        windows = [None, (None, 0)] + [kernel_window(causal, (lt, rt), sq, sk)
                                       for causal in (False, True)
                                       for lt, rt in ((60, None), (50, 20), (-20, 40),
                                                      (0, 0), (300, -130), (None, 5))]
        for w in windows:
            left, right = (None, None) if w is None else w
            for m in range(-(-sq // cfg.m_block)):
                got = _visitors(cfg, m, sq, sk, left, right)
                first = 0 if left is None else kv_block_range(
                    m * cfg.m_block, cfg.m_block, cfg.n_block, sq, sk, left, right)[0]
                assert got == list(range(first, first + len(got))), (sq, sk, w, m, got)


def test_backward_pipeline_table_arrival_counts_follow_the_roles():
    cfg = Sm100BwdConfig().validate()
    specs = {s.name: s for s in active_specs(cfg)}
    roles = cfg.warp_roles().role_warps()
    threads = {r: 32 * len(w) for r, w in roles.items()}
    assert specs["bwd_lse"].arrivals("empty", cfg) == threads["compute"]
    assert specs["bwd_s_dp"].arrivals("empty", cfg) == threads["compute"]
    assert specs["bwd_ds"].arrivals("full", cfg) == threads["compute"]
    assert specs["bwd_dq"].arrivals("empty", cfg) == threads["dq"]
    for name in ("bwd_kv", "bwd_q", "bwd_dkv"):
        assert specs[name].arrivals("full", cfg) == 1
    tiles = cfg.tma_tiles()
    assert specs["bwd_q"].tx_bytes(cfg) == tiles["Q"] + tiles["dO"]
    assert specs["bwd_kv"].tx_bytes(cfg) == tiles["K"] + tiles["V"]
    assert specs["bwd_lse"].tx_bytes(cfg) == 2 * cfg.m_block * 4
    # one full and one empty barrier per stage
    assert barrier_count(cfg) == 2 * sum(s.num_stages(cfg) for s in specs.values())


# -- 2-CTA (Note [Backward 2-CTA] in fa_sm100/sm100/bwd_config.py) ---------------------------
@pytest.mark.parametrize("dims,dtype,causal,group", PROBLEMS)
def test_every_2cta_problem_fits_with_two_q_stages(dims, dtype, causal, group):
    """Per CTA the pair adds sQt, sdOt (one stage) and sKt to the 1-CTA buffers and halves sQ,
    sdO's rows; the default keeps two Q stages at every head dim (head dim 128: exactly the
    232448 bytes of an SM). TMEM is the 1-CTA plan with dQ folded into head_dim / 2 columns;
    the compute warpgroups take 200 registers (the dS stores' 64-bit cluster addresses), the
    dQ warps 64 and the others 48, the whole register file."""
    cfg = select_sm100_bwd_config(dims[0], dims[1], dtype, causal, group, use_2cta=True)
    assert cfg.use_2cta and cfg.q_stage == 2 and cfg.cluster_shape == (2, 1, 1)
    assert cfg.smem_bytes() <= SMEM_BYTES
    b, one = cfg.smem_buffers(), cfg.replace(use_2cta=False).smem_buffers()
    assert (b["sQ"], b["sdO"]) == (one["sQ"] // 2, one["sdO"] // 2)
    assert b["sQt"] == one["sQ"] // cfg.q_stage // 2 and b["sKt"] == one["sK"]
    assert b["sdS"] == one["sdS"]  # m_block / 2 query rows x 2 n_block keys
    plan, plain = TmemPlan.for_backward(cfg), TmemPlan.for_backward(cfg.replace(use_2cta=False))
    assert plan["dQ"].cols == dims[0] // 2 and plan["dQ"].host == "dP"
    assert [r for r in plan.regions if r.name != "dQ"] == [r for r in plain.regions if r.name != "dQ"]
    roles = cfg.warp_roles()
    assert roles.setmaxnreg() == {"compute": 200, "dq": 64, "other": 48}
    assert roles.registers_used() == REGISTER_FILE
    assert cfg.dq_releases_per_turn() == 8  # four dQ warps in each CTA of the pair
    if dims[0] == 128:
        assert cfg.smem_bytes() == SMEM_BYTES


def test_2cta_pipeline_counts_follow_the_pair():
    """The MMA warp waits only in the leader CTA: the thread arrivals that hand it a stage are
    both CTAs' (bwd_s_dp, bwd_ds, bwd_dq, bwd_dkv); the leader's TMA barriers expect the pair's
    bytes (bwd_kv, bwd_q, bwd_qt), bwd_lse each CTA's own; bwd_qt exists only here, and bwd_ds's
    arrivals release at cluster scope (the dS exchange)."""
    cfg = Sm100BwdConfig(use_2cta=True).validate()
    specs = {s.name: s for s in active_specs(cfg)}
    plain = {s.name for s in active_specs(cfg.replace(use_2cta=False))}
    assert set(specs) - plain == {"bwd_qt"}
    threads = {r: 32 * len(w) for r, w in cfg.warp_roles().role_warps().items()}
    assert specs["bwd_lse"].arrivals("empty", cfg) == threads["compute"]
    assert specs["bwd_s_dp"].arrivals("empty", cfg) == 2 * threads["compute"]
    assert specs["bwd_ds"].arrivals("full", cfg) == 2 * threads["compute"]
    assert specs["bwd_dkv"].arrivals("empty", cfg) == 2 * threads["compute"]
    assert specs["bwd_dq"].arrivals("empty", cfg) == 2 * threads["dq"]
    t = cfg.tma_tiles()
    assert specs["bwd_kv"].tx_bytes(cfg) == 2 * (t["K"] + t["V"] + t["Kt"])
    assert specs["bwd_q"].tx_bytes(cfg) == 2 * (t["Q"] + t["dO"])
    assert specs["bwd_qt"].tx_bytes(cfg) == 2 * (t["Qt"] + t["dOt"])
    assert specs["bwd_lse"].tx_bytes(cfg) == t["LSE2"] + t["Delta"]
    assert [n for n, s in specs.items() if s.cluster_release] == ["bwd_ds"]
    assert barrier_count(cfg) == barrier_count(cfg.replace(use_2cta=False)) + 2
    with pytest.raises(ValueError, match="use_2cta=.*a compile-time switch is a bool"):
        Sm100BwdConfig(use_2cta=1).validate()
