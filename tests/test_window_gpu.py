"""Sliding windows on an SM90 GPU: the forward (``sm90_fwd``, ``flash_attn_func``) and training
through autograd, against float64 under the project's rule (docs/testing.md): err(kernel) <=
2 x err(the same attention done plainly in the input precision) + a small slack.

Windows cover one key (0, 0), narrow and wide bands, causal with a left bound, unbounded
sides, negative bounds (bands shifted past the diagonal, FA4's convention) and bands that
leave rows with no key (O = 0, LSE = -inf); shapes cover tails, seqlen_q != seqlen_k both
ways, GQA and MQA. Outputs are poisoned with NaN first, so an unwritten row fails. Skips off
SM90 with the reason (the ``sm90_device`` fixture).
"""

import zlib

import pytest
import torch

from fa_sm100.testing import attention_reference, check_against_reference, check_training_step
from fa_sm100.validation import normalize_window

pytestmark = pytest.mark.gpu

LSE_RTOL = 1e-5  # as tests/test_sm90_fwd_gpu.py: LSE is a float32 quantity in the kernel

# (causal, (left, right)); None and -1 are unbounded
WINDOWS = [
    (False, (0, 0)),
    (False, (17, 3)),
    (True, (128, None)),
    (True, (300, 5)),  # causal caps the right bound at 0
    (False, (256, 64)),
    (False, (-1, 40)),
    (False, (1000, -1)),
    (False, (-3, 10)),  # the band starts 3 keys right of the diagonal
    (False, (20, -5)),  # ... ends 5 keys left of it: the first rows see nothing
    (False, (-50, 45)),  # narrower than one key: every row sees nothing
]
# (batch, seqlen_q, seqlen_k, heads_q, heads_kv)
SHAPES = [(2, 1000, 1000, 4, 4), (1, 333, 2049, 4, 1), (3, 1500, 700, 6, 2), (1, 4097, 4097, 2, 2)]


def _inputs(shape, head_dims, dtype, seed):
    b, sq, sk, hq, hk = shape
    d, dv = head_dims
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(b, sq, hq, d, device="cuda", dtype=dtype, generator=g),
            torch.randn(b, sk, hk, d, device="cuda", dtype=dtype, generator=g),
            torch.randn(b, sk, hk, dv, device="cuda", dtype=dtype, generator=g))


def check_forward(q, k, v, causal, window, out, lse, what):
    """O and LSE of one call against the float64 reference of the same window."""
    torch.cuda.synchronize()
    window = normalize_window(window)  # the reference's bounds: None is unbounded
    ref, ref_lse = attention_reference(q, k, v, causal=causal, window=window)
    plain, _ = attention_reference(q, k, v, causal=causal, window=window, dtype=q.dtype,
                                   upcast=False)
    check_against_reference(out, ref, plain, atol=1e-3, what=f"O {what}")
    empty = torch.isneginf(ref_lse)  # rows that see no key: exactly O = 0, LSE = -inf
    assert torch.equal(torch.isneginf(lse), empty), f"LSE -inf rows {what}"
    assert not out.permute(0, 2, 1, 3)[empty].any(), f"O of rows without keys {what}"
    if (~empty).any():
        _, plain32_lse = attention_reference(q, k, v, causal=causal, window=window,
                                             dtype=torch.float32)
        scale = max(1.0, float(ref_lse[~empty].abs().max()))
        check_against_reference(lse[~empty], ref_lse[~empty], plain32_lse[~empty],
                                atol=LSE_RTOL * scale, what=f"LSE {what}")


def run_forward(q, k, v, causal, window, config=None):
    from fa_sm100.hopper.interface import sm90_fwd

    b, sq, hq, _ = q.shape
    out = torch.full((b, sq, hq, v.shape[3]), float("nan"), device="cuda", dtype=q.dtype)
    lse = torch.full((b, hq, sq), float("nan"), device="cuda", dtype=torch.float32)
    sm90_fwd(q, k, v, None, causal, window, True, config, out=out, lse=lse)
    return out, lse


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dims", [(64, 64), (128, 128), (192, 128), (256, 256)],
                         ids=lambda p: f"d{p[0]}_{p[1]}")
def test_windowed_forward_matches_float64(sm90_device, head_dims, dtype):
    for shape in SHAPES:
        for causal, window in WINDOWS:
            seed = zlib.crc32(f"{shape}{head_dims}{dtype}{causal}{window}".encode())
            q, k, v = _inputs(shape, head_dims, dtype, seed)
            out, lse = run_forward(q, k, v, causal, window)
            check_forward(q, k, v, causal, window, out, lse,
                          f"{shape} {head_dims} {dtype} causal={causal} window={window}")


@pytest.mark.parametrize("switch", [
    "intra_wg_overlap=false", "persistent=false", "persistent=true,dynamic_schedule=false",
    "num_consumer_wg=3,n_block=64", "persistent=true,o_in_q_buffer=true",
    "persistent=true,wg_epilogue=true,q_stage=2", "rescale_threshold=0", "pingpong=false",
])
def test_windowed_forward_switches_keep_numerics(sm90_device, switch):
    """Every switch that a windowed config accepts computes the same attention."""
    from fa_sm100.config import parse_overrides
    from fa_sm100.hopper.config import Sm90FwdConfig, select_sm90_fwd_config

    changes = parse_overrides(switch.split(","), Sm90FwdConfig)
    for causal, window in [(True, (200, None)), (False, (90, 33)), (False, (-3, 300))]:
        cfg = select_sm90_fwd_config(128, causal=causal, local=True, **changes)
        q, k, v = _inputs((4, 1500, 2000, 8, 2), (128, 128), torch.bfloat16, 5)
        out, lse = run_forward(q, k, v, causal, window, cfg)
        check_forward(q, k, v, causal, window, out, lse, f"{switch} causal={causal} {window}")


def test_a_new_window_reuses_the_compiled_kernel(sm90_device):
    """The bounds are launch arguments: windows of any size share one kernel per config."""
    from fa_sm100 import kernel_cache

    q, k, v = _inputs((1, 700, 900, 2, 2), (128, 128), torch.bfloat16, 9)
    run_forward(q, k, v, False, (64, 0))
    before = len(kernel_cache.records())
    for window in [(65, 0), (1, 7), (-2, 300), (500, None)]:
        out, lse = run_forward(q, k, v, False, window)
        check_forward(q, k, v, False, window, out, lse, f"window={window}")
    assert len(kernel_cache.records()) == before


@pytest.mark.parametrize("causal,window", [(True, (256, -1)), (False, (100, 100)),
                                           (False, (-1, 0)), (False, (7, -3))])
@pytest.mark.parametrize("head_dims", [(64, 64), (128, 128)], ids=lambda p: f"d{p[0]}")
def test_windowed_training_step_matches_float64(sm90_device, head_dims, causal, window):
    """flash_attn_func with a window, forward and backward through autograd, GQA and a
    seqlen_q != seqlen_k tail: O and dq, dk, dv against float64 autograd of the reference."""
    from fa_sm100.interface import flash_attn_func

    q, k, v = _inputs((2, 1100, 1300, 8, 2), head_dims, torch.bfloat16, 3)
    dout = torch.randn_like(q[..., :head_dims[1]])
    check_training_step(lambda q, k, v: flash_attn_func(q, k, v, causal=causal,
                                                        window_size=window),
                        q, k, v, dout, causal, normalize_window(window), what=f"{window}")
