"""Compile contract of the SM100 backward main kernel (``sm100_bwd``), through
``inspect_kernel``: every config is cross-compiled for sm_100a on the CPU (the registry entry,
the path of ``scripts/inspect.py --kernel sm100_bwd --set ...``). Together they cover both
dtypes, head dims 64 / 96 / 128, causal and not, sliding windows and softcap (each alone and
together), MHA / GQA / MQA, one or two Q stages, deterministic dQ and 2-CTA (``use_2cta``,
Note [Backward 2-CTA] in bwd_config.py; head dims 64, 96 and 128, causal and not, GQA,
windows, softcap and deterministic dQ). For each:

- 512 threads per CTA; cluster (2, 1, 1) and every MMA cta_group::2 (UTCHMMA.2CTA) iff 2-CTA,
  else cluster (1, 1, 1) and none;
- the five MMAs of Note [Backward MMA order] as UTCHMMA (dV and dK issue their A operand's
  two TMEM halves separately: seven MMA sites), TMA loads (UTMALDG), tcgen05.ld / st;
- setmaxnreg values in the PTX equal the BwdWarpRoles budgets; one TMEM allocation of 512
  columns (cta_group::2 under 2-CTA); zero local memory and spill bytes; SMEM within the
  config's budget and an SM's; a 2-CTA config stores dS into the pair's SMEM with
  st.shared::cluster and fences it for the MMA (fence.proxy.async.shared::cluster), a 1-CTA
  one does neither.

The default config's kernel is pinned (``test_default_kernel_is_pinned``): the switch off
compiles the same SASS, byte for byte.

A deterministic config (Note [Deterministic dQ] in bwd_dq.py) polls its dQ semaphores with
acquire loads (LDG.STRONG.GPU), fences at GPU scope and releases with one s32 reduction
(REDG.S32); a config without it has none of the three.

A capped config takes tanh from MUFU.EX2 (``dsl_math.softcap_tanh``), never MUFU.TANH: at
least twice the MUFU.EX2 of the uncapped config of its head dim.
"""

import os

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_100a")

pytestmark = [pytest.mark.compile, pytest.mark.slow]

SMEM_LIMIT = 232448

CONFIGS = {
    "hdim128": ["head_dim=128"],
    "hdim128_causal": ["head_dim=128", "causal=true"],
    "hdim128_q1_causal": ["head_dim=128", "causal=true", "q_stage=1"],
    "hdim128_fp16_gqa": ["head_dim=128", "dtype=fp16", "qhead_per_kvhead=4"],
    "hdim96": ["head_dim=96"],
    "hdim96_causal_mqa": ["head_dim=96", "causal=true", "qhead_per_kvhead=8"],
    "hdim64": ["head_dim=64"],
    "hdim64_causal_gqa": ["head_dim=64", "causal=true", "qhead_per_kvhead=4"],
    "hdim64_q1_fp16": ["head_dim=64", "q_stage=1", "dtype=fp16"],
    "hdim64_fp16_causal_gqa2": ["head_dim=64", "dtype=fp16", "causal=true",
                                "qhead_per_kvhead=2"],
    "hdim128_causal_local": ["head_dim=128", "causal=true", "local=true"],
    "hdim128_softcap": ["head_dim=128", "softcap=true"],
    "hdim96_fp16_local_softcap_q1": ["head_dim=96", "dtype=fp16", "local=true", "softcap=true",
                                     "q_stage=1"],
    "hdim64_local_softcap_gqa": ["head_dim=64", "local=true", "softcap=true",
                                 "qhead_per_kvhead=4"],
    "hdim128_deterministic": ["head_dim=128", "deterministic=true"],
    "hdim64_fp16_causal_local_gqa_deterministic": ["head_dim=64", "dtype=fp16", "causal=true",
                                                   "local=true", "qhead_per_kvhead=4",
                                                   "deterministic=true"],
    "hdim128_2cta": ["head_dim=128", "use_2cta=true"],
    "hdim128_2cta_causal_gqa": ["head_dim=128", "use_2cta=true", "causal=true",
                                "qhead_per_kvhead=4"],
    "hdim64_2cta": ["head_dim=64", "use_2cta=true"],
    "hdim64_2cta_fp16_causal_gqa": ["head_dim=64", "use_2cta=true", "dtype=fp16", "causal=true",
                                    "qhead_per_kvhead=2"],
    "hdim96_2cta_local_softcap": ["head_dim=96", "use_2cta=true", "local=true", "softcap=true"],
    "hdim128_2cta_deterministic": ["head_dim=128", "use_2cta=true", "deterministic=true"],
}

_CACHE = {}


def report(name):
    if name not in _CACHE:
        from fa_sm100.inspection import inspect_kernel

        _CACHE[name] = inspect_kernel("sm100_bwd", "sm_100a", CONFIGS[name])
    return _CACHE[name]


def config(name):
    from fa_sm100.sm100.bwd_inspect_entry import make_config

    return make_config(CONFIGS[name])


def test_the_configs_cover_dtypes_head_dims_masks_groups_and_stages():
    cfgs = [config(n) for n in CONFIGS]
    seen = lambda f: {getattr(c, f) for c in cfgs}  # noqa: E731
    assert len(cfgs) >= 14
    assert seen("dtype") == {"bfloat16", "float16"}
    assert seen("head_dim") == {64, 96, 128}
    assert seen("causal") == {True, False}
    assert seen("local") == {True, False}
    assert seen("softcap") == {True, False}
    assert seen("q_stage") == {1, 2}
    assert seen("deterministic") == {True, False}
    assert seen("qhead_per_kvhead") >= {1, 2, 4, 8}
    assert seen("use_2cta") == {True, False}
    pairs = [c for c in cfgs if c.use_2cta]
    assert {c.head_dim for c in pairs} == {64, 96, 128}
    assert {c.causal for c in pairs} == {True, False} and max(c.qhead_per_kvhead for c in pairs) > 1


@pytest.mark.parametrize("name", list(CONFIGS))
def test_compile_contract(name):
    rep, cfg = report(name), config(name)
    sass = rep["sass"]
    assert rep["threads_per_cta"] == 512
    assert tuple(rep["cluster"]) == ((2, 1, 1) if cfg.use_2cta else (1, 1, 1))
    assert sass["UTCHMMA"] == 7 and sass["UTCHMMA.2CTA"] == (7 if cfg.use_2cta else 0)
    assert [(a["cta_group"], a["cols"]) for a in rep["tmem_alloc_ptx"]] == [(cfg.cta_group, 512)]
    roles = cfg.warp_roles().setmaxnreg()
    assert rep["setmaxnreg"] == roles
    assert {n for _, n in rep["setmaxnreg_ptx"]} == set(roles.values())
    assert rep["local_bytes"] == 0
    assert rep["spill_bytes"] == 0
    assert 0 < rep["smem_bytes"] <= SMEM_LIMIT
    assert rep["smem_bytes"] == cfg.smem_bytes()
    for op in ("UTMALDG", "LDTM", "STTM", "USETMAXREG", "MUFU.EX2"):
        assert sass[op] > 0, f"no {op} in the SASS"


def test_softcap_takes_tanh_from_ex2():
    """A capped config computes tanh with ``softmax_math.softcap_tanh`` (on exp2, as the
    forward), never the MUFU.TANH approximation. (The exp2 count is no measure: the compiler
    may merge the P loop's masked and unmasked copies of a capped config.)"""
    for capped in ("hdim128_softcap", "hdim64_local_softcap_gqa"):
        sass = report(capped)["sass"]
        assert sass.get("MUFU.TANH", 0) == 0 and sass["MUFU.EX2"] > 0


def test_deterministic_configs_take_turns_on_the_dq_semaphores():
    """Acquire loads, s32 reductions and GPU fences iff deterministic; under 2-CTA the dS
    hand-off's cluster-scope proxy fence and release are GPU-scope barriers in the SASS as well
    (MEMBAR.ALL.GPU, two per compute warpgroup's step), and the deterministic mode adds its own."""
    for name in CONFIGS:
        cfg = config(name)
        sass, det = report(name)["sass"], cfg.deterministic
        ops = ("LDG.STRONG", "REDG.S32") + (() if cfg.use_2cta else ("MEMBAR.GPU",))
        for op in ops:
            assert (sass.get(op, 0) > 0) == det, f"{name}: {op} x {sass.get(op, 0)}"
    pair = report("hdim128_2cta")["sass"].get("MEMBAR.GPU", 0)
    assert pair == 4 and report("hdim128_2cta_deterministic")["sass"]["MEMBAR.GPU"] > pair


def test_the_pair_exchanges_ds_through_cluster_shared_memory():
    """Note [Backward 2-CTA]: each compute thread stores its 64 dS values (eight 16-byte
    vectors) into the sdS of the pair's CTA that owns those query rows, through shared::cluster,
    fences them for the MMA's async-proxy reads at cluster scope and arrives on the leader's
    bwd_ds barrier with release at cluster scope; the leader's MMA warp acquires that barrier
    at cluster scope before the dQ MMA reads both CTAs' sdS. A 1-CTA kernel stores to its own
    SMEM and fences, arrives and waits at CTA scope."""
    from fa_sm100.compile_tools import cross_compile
    from fa_sm100.sm100.bwd_inspect_entry import build, make_config

    for pair in (False, True):
        b = build(make_config(["head_dim=64", f"use_2cta={str(pair).lower()}"]))
        ptx = cross_compile(b.fn, b.args, "sm_100a").ptx
        # both compute warpgroups' stores, one copy of the step each
        assert ptx.count("st.shared::cluster.v4.b32") == (16 if pair else 0)
        assert ("fence.proxy.async.shared::cluster" in ptx) == pair
        assert ("fence.proxy.async.shared::cta" in ptx) != pair
        # one bwd_ds arrival per compute warpgroup
        assert ptx.count("mbarrier.arrive.release.cluster") == (2 if pair else 0)
        assert ("mbarrier.try_wait.parity.acquire.cluster" in ptx) == pair


# (overrides, SASS instructions, SMEM bytes, setmaxnreg) of the sm100_bwd kernels the switch
# leaves as they were: the default and deterministic hdim-128 configs, cross-compiled for
# sm_100a with the DSL the compile contracts use (pyproject.toml)
PINNED = [
    ([], 2704, 232448, "8792fa8a603ca02f77a5e70d530e74d166c14172fac838082d33bf6f90a725ee"),
    (["deterministic=true"], 2744, 232448,
     "99ce29eb9a8024df2600b0ac08242119b948555e668d986378d2a4fc0f5ab4b5"),
]


@pytest.mark.parametrize("overrides,instructions,smem,sha", PINNED,
                         ids=[",".join(p[0]) or "default" for p in PINNED])
def test_default_kernel_is_pinned(overrides, instructions, smem, sha, tmp_path):
    """With ``use_2cta`` off the kernel is the 1-CTA one, byte for byte: the SHA-256 of its
    SASS listing, its instruction count, SMEM, 512 TMEM columns, setmaxnreg 192 / 64 / 64 and
    no spill are the pinned ones. A change meant to change this kernel updates them."""
    import hashlib

    from kept_sass import read_kept_sass

    from fa_sm100.inspection import inspect_kernel

    r = inspect_kernel("sm100_bwd", "sm_100a", overrides, keep_dir=tmp_path)
    assert sum(r["sass_full"].values()) == instructions
    assert (r["smem_bytes"], r["tmem_cols"]) == (smem, 512)
    assert r["setmaxnreg"] == {"compute": 192, "dq": 64, "other": 64}
    assert r["spill_bytes"] == 0 and r["local_bytes"] == 0
    assert hashlib.sha256(read_kept_sass(tmp_path).encode()).hexdigest() == sha
