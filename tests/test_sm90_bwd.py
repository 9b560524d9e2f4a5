"""SM90 backward, CPU side: config rules, input validation, block ranges, compile contract.

- ``BwdConfig.validate`` and ``sm90_bwd`` raise ValueError naming the rule, before any compile
  or launch (checked with CPU tensors, which never reach a kernel). The device rule (CUDA
  tensors on an sm_90 GPU) comes last; a non-sm_90 GPU is faked with FakeTensorMode.
- The query-block ranges the kernel walks (``m_block_range``, the same function the kernel
  traces) cover every visible (query, key) pair, and the key blocks adding into one query
  block are consecutive from ``first_n_block`` (what deterministic dQ ordering relies on).
- Compile contract (sm_90a cross-compile through ``fa_sm100.inspection.inspect_kernel``):
  384 threads, HGMMA present, setmaxnreg 24/240 in the PTX and the SASS, no local memory or
  spills, SMEM within the 227 KiB budget, and the dQ path the config asks for
  (UBLKRED bulk reduce, or REDG float adds); the preprocess and postprocess kernels compile.
"""


import pytest
import torch

from fa_sm100.hopper.bwd_config import (SM90_SMEM_BYTES, BwdConfig, first_n_block,
                                        m_block_range, select_bwd_config)
from fa_sm100.hopper.bwd_interface import sm90_bwd
from fa_sm100.testing import attention_mask


# ---- config rules ------------------------------------------------------------------------

@pytest.mark.parametrize("changes,rule", [
    (dict(head_dim=256, head_dim_v=256), "head dims"),
    (dict(head_dim_v=64), "head dims"),
    (dict(tile_m=128), "tile_m"),
    (dict(tile_n=64), "tile_n"),
    (dict(q_stage=3), "q_stage"),
    (dict(gqa_reduce="tree"), "gqa_reduce"),
    (dict(dq_accum="tma"), "dq_accum"),
    (dict(qhead_per_kvhead=4, deterministic=True, gqa_reduce="atomic"), "deterministic"),
    (dict(regs_mma=250), "setmaxnreg"),
    (dict(regs_producer=64, regs_mma=248), "register budget"),
    (dict(window_left=-1), "window_left"),
    (dict(window_right=True), "window_right"),
    (dict(dtype="float32"), "dtype"),
])
def test_bad_config_raises_value_error_naming_the_rule(changes, rule):
    with pytest.raises(ValueError, match=rule):
        BwdConfig().replace(**changes).validate()


def test_default_configs_fit_smem_and_follow_the_measured_choices():
    for d in (64, 96, 128):
        cfg = select_bwd_config(head_dim=d)
        assert cfg.smem_bytes() <= SM90_SMEM_BYTES
    assert select_bwd_config(qhead_per_kvhead=4).gqa_reduce == "buffers"
    assert select_bwd_config(qhead_per_kvhead=4, gqa_reduce="atomic").gqa_reduce == "atomic"
    assert select_bwd_config(causal=False).early_dv and not select_bwd_config(causal=True).early_dv
    assert not select_bwd_config(window_left=10).early_dv
    with pytest.raises(ValueError, match="deterministic"):
        select_bwd_config(qhead_per_kvhead=4, deterministic=True, gqa_reduce="atomic")


# ---- input validation (CPU tensors never reach a kernel) ----------------------------------

def _cpu_inputs(b=1, sq=32, sk=32, hq=2, hk=2, d=64, dtype=torch.bfloat16):
    q = torch.randn(b, sq, hq, d, dtype=dtype)
    k = torch.randn(b, sk, hk, d, dtype=dtype)
    v = torch.randn(b, sk, hk, d, dtype=dtype)
    out, dout = torch.randn_like(q), torch.randn_like(q)
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
    with pytest.raises(ValueError, match="head_dim=256"):
        sm90_bwd(*_cpu_inputs(d=256))
    with pytest.raises(ValueError, match="window_size"):
        sm90_bwd(*_cpu_inputs(), window_size=(-3, None))
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


# ---- block ranges ------------------------------------------------------------------------

RANGE_CASES = [
    (sq, sk, causal, window)
    for sq, sk in [(1, 1), (64, 64), (200, 333), (333, 200), (1000, 129), (129, 1000), (511, 512)]
    for causal, window in [(False, (None, None)), (True, (None, None)), (False, (100, 30)),
                           (False, (0, 0)), (True, (70, None)), (False, (None, 5)),
                           (False, (300, None))]
]


@pytest.mark.parametrize("sq,sk,causal,window", RANGE_CASES)
def test_block_ranges_cover_the_band_and_dq_order_is_consecutive(sq, sk, causal, window):
    cfg = select_bwd_config(head_dim=64, causal=causal, window_left=window[0],
                            window_right=window[1])
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


# ---- compile contract ----------------------------------------------------------------------

CONTRACT_CASES = [
    ([], "UBLKRED"),
    (["causal=true", "deterministic=true", "qhead_per_kvhead=4", "window_left=100"], "UBLKRED"),
    (["head_dim=96", "dq_accum=red", "early_dv=false", "dtype=float16"], "REDG.E.ADD.F32"),
]


@pytest.mark.compile
@pytest.mark.parametrize("overrides,dq_mnemonic", CONTRACT_CASES,
                         ids=[",".join(c[0]) or "default" for c in CONTRACT_CASES])
def test_sm90_bwd_compile_contract(overrides, dq_mnemonic):
    from fa_sm100.inspection import inspect_kernel

    r = inspect_kernel("sm90_bwd", "sm_90a", overrides)
    sass = r["sass_full"]
    assert r["threads_per_cta"] == 384
    assert r["cluster"] in ([1, 1, 1], (1, 1, 1))
    assert sum(v for k, v in sass.items() if k.startswith("HGMMA")) >= 5, "no WGMMA in the SASS"
    assert [list(x) for x in r["setmaxnreg_ptx"]] == [["dec", 24], ["inc", 240]]
    # the launch declares min_blocks_per_mp=1, so ptxas keeps both setmaxnreg in the SASS
    assert r["setmaxnreg"] == {"producer": 24, "mma": 240}, r["warnings"]
    assert r["spill_bytes"] == 0 and r["local_bytes"] == 0
    assert 0 < r["smem_bytes"] <= SM90_SMEM_BYTES
    assert any(k.startswith(dq_mnemonic) for k in sass), f"{dq_mnemonic} missing: {sorted(sass)}"
    assert sass.get("UTMALDG.4D", 0) >= 4, "Q, dO, K, V are loaded by TMA"


@pytest.mark.compile
def test_preprocess_and_postprocess_cross_compile_for_sm90a():
    """The two CUDA-core kernels compile with the run-time/static split sm90_bwd uses."""
    from cutlass.cute.runtime import make_fake_stream

    from fa_sm100.hopper.bwd_interface import _compiled, _to_cute
    from fa_sm100.hopper.bwd_prepost import BwdPostprocess, BwdPreprocess

    o = torch.randn(1, 100, 4, 128, dtype=torch.bfloat16)
    lse, lse2, delta = torch.randn(1, 4, 100), torch.empty(1, 4, 128), torch.empty(1, 4, 128)
    acc, out = torch.zeros(1, 4, 128, 136), torch.empty(1, 100, 2, 128, dtype=torch.bfloat16)
    stream = make_fake_stream()
    pre = _compiled("test-pre", 128, lambda: BwdPreprocess(128), _to_cute(o), _to_cute(o),
                    _to_cute(lse, 4, False), _to_cute(lse2, 16, False),
                    _to_cute(delta, 16, False), stream)
    post = _compiled("test-post", 128, lambda: BwdPostprocess(128, 2), _to_cute(acc),
                     _to_cute(out), stream)
    assert callable(pre) and callable(post)
