"""``sm100_fwd`` rejects bad input with ValueError before any compile or launch (CPU test).

Contract: CPU tensors, bad dtypes / head dims / GQA ratios fail in validation; a config that
does not match the inputs (sliding window included) or breaks its own rules fails in
``config_for_problem``; the default config follows the problem (dtype, head dims, causal,
GQA ratio, window) and carries write_lse = return_lse. Only the last test compiles (on the
CPU, for sm_100a).
"""

import pytest
import torch

from fa_sm100.config import FmhaConfig
from fa_sm100.sm100.interface import config_for_problem, sm100_fwd
from fa_sm100.validation import validate_attention_inputs


def _qkv(b=1, sq=256, sk=256, h=4, hk=4, d=128, dv=128, dtype=torch.bfloat16):
    return (torch.zeros(b, sq, h, d, dtype=dtype), torch.zeros(b, sk, hk, d, dtype=dtype),
            torch.zeros(b, sk, hk, dv, dtype=dtype))


def _prob(**kw):
    causal = kw.pop("causal", False)
    window = kw.pop("window", (None, None))
    return validate_attention_inputs(*_qkv(**kw), causal=causal, window_size=window,
                                     require_cuda=False)


@pytest.mark.parametrize("bad,match", [
    (dict(dtype=torch.float32), "dtype"),
    (dict(h=6, hk=4), "multiple"),
    (dict(d=80, dv=80), "head dims"),
])
def test_bad_inputs_raise_before_anything_runs(bad, match):
    with pytest.raises(ValueError, match=match):
        sm100_fwd(*_qkv(**bad))


def test_cpu_tensors_are_rejected():
    with pytest.raises(ValueError, match="CUDA"):
        sm100_fwd(*_qkv())


def test_default_config_follows_the_problem():
    cfg = config_for_problem(_prob(sq=4096, sk=1000, h=8, hk=2, d=192, dv=128, causal=True),
                             return_lse=True)
    assert (cfg.head_dim, cfg.head_dim_v, cfg.dtype) == (192, 128, "bfloat16")
    assert cfg.causal and cfg.qhead_per_kvhead == 4 and cfg.write_lse
    assert not config_for_problem(_prob()).write_lse


@pytest.mark.parametrize("cfg,match", [
    (FmhaConfig(head_dim=64, head_dim_v=64), "head_dim"),
    (FmhaConfig(dtype="float16"), "dtype"),
    (FmhaConfig(causal=True), "causal"),
    (FmhaConfig(qhead_per_kvhead=2), "qhead_per_kvhead"),
    (FmhaConfig(kv_stage=40), "SMEM"),
    ("not a config", "FmhaConfig"),
])
def test_mismatched_or_invalid_config_is_rejected(cfg, match):
    with pytest.raises(ValueError, match=match):
        config_for_problem(_prob(), config=cfg)


def test_sliding_window_reaches_the_config_and_must_match_it():
    cfg = config_for_problem(_prob(window=(64, 0)))
    assert (cfg.window_left, cfg.window_right) == (64, 0)
    with pytest.raises(ValueError, match="window_left"):
        config_for_problem(_prob(window=(64, 0)), config=FmhaConfig())


@pytest.mark.compile
def test_interface_compile_path_cross_compiles_without_a_gpu():
    """The exact compile sm100_fwd performs (TVM-FFI, environment stream, dynamic batch and
    sequence lengths, static heads) cross-compiles for sm_100a; the result is callable."""
    import os

    os.environ.setdefault("CUTE_DSL_ARCH", "sm_100a")
    from fa_sm100.sm100.interface import compile_for

    fn = compile_for(FmhaConfig(qhead_per_kvhead=2, causal=True, write_lse=False), 8,
                     arch="sm_100a")
    assert callable(fn)
