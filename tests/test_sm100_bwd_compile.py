"""Compile contract of the SM100 backward main kernel (``sm100_bwd``), through
``inspect_kernel``: every config is cross-compiled for sm_100a on the CPU (the registry entry,
the path of ``scripts/inspect.py --kernel sm100_bwd --set ...``). Together they cover both
dtypes, head dims 64 / 96 / 128, causal and not, sliding windows and softcap (each alone and
together), MHA / GQA / MQA, one or two Q stages and deterministic dQ. For each:

- 512 threads per CTA, cluster (1, 1, 1), no cta_group::2 MMA (the backward is 1-CTA);
- the five MMAs of Note [Backward MMA order] as UTCHMMA (dV and dK issue their A operand's
  two TMEM halves separately: seven MMA sites), TMA loads (UTMALDG), tcgen05.ld / st;
- setmaxnreg values in the PTX equal the BwdWarpRoles budgets; one TMEM allocation of 512
  columns; zero local memory and spill bytes; SMEM within the config's budget and an SM's.

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


@pytest.mark.parametrize("name", list(CONFIGS))
def test_compile_contract(name):
    rep, cfg = report(name), config(name)
    sass = rep["sass"]
    assert rep["threads_per_cta"] == 512
    assert tuple(rep["cluster"]) == (1, 1, 1)
    assert sass["UTCHMMA"] == 7 and sass["UTCHMMA.2CTA"] == 0
    assert [a["cols"] for a in rep["tmem_alloc_ptx"]] == [512]
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
    for name in CONFIGS:
        sass, det = report(name)["sass"], config(name).deterministic
        for op in ("LDG.STRONG", "REDG.S32", "MEMBAR.GPU"):
            assert (sass.get(op, 0) > 0) == det, f"{name}: {op} x {sass.get(op, 0)}"
