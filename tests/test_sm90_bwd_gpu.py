"""SM90 backward on an H100/H200: gradients against float64 autograd, determinism.

Contract: for every feature (MHA/GQA/MQA, causal, sliding window, ragged sequence lengths,
seqlen_q > seqlen_k, head dims 64/96/128/(192,128)/256, bf16/fp16), with S/dP unswapped and
swapped (``sdp_swap_ab``, also with tile_m=128 at hdim 64), and with dK/dV split by head-dim
columns (tile_n=64: the wide head dims, and hdim 64/128 by switch), each of dq, dk, dv satisfies the project
rule err(kernel) <= 2 x err(plain) + atol against the float64 reference gradient, where
"plain" is the same attention differentiated by torch autograd in the input precision. The
forward O and LSE fed to the backward come from the float64 reference, so this file tests the
backward alone. Deterministic mode: bitwise identical gradients over repeated runs.
Skips (lazily, with the reason) on anything but an sm_90 GPU.
"""

import pytest
import torch

from fa_sm100.testing import attention_reference_grads, check_against_reference, grad_atol

pytestmark = pytest.mark.gpu


def _run_case(b, sq, sk, hq, hk, d, causal=False, window=(None, None), dtype=torch.bfloat16,
              deterministic=False, config=None, seed=0):
    """``d``: the head dim, or a (qk, v) pair."""
    from fa_sm100.hopper.bwd_interface import sm90_bwd

    d, dv = d if isinstance(d, tuple) else (d, d)
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(b, sk, hk, dv, device="cuda", dtype=dtype, generator=g)
    dout = torch.randn(b, sq, hq, dv, device="cuda", dtype=dtype, generator=g)
    out64, lse64, ref = attention_reference_grads(q, k, v, dout, causal, window, torch.float64)
    _, _, plain = attention_reference_grads(q, k, v, dout, causal, window, dtype, upcast=False)
    out = out64.to(dtype)
    lse = lse64.float()
    got = sm90_bwd(dout, q, k, v, out, lse, causal=causal, window_size=window,
                   deterministic=deterministic, config=config)
    for name, x, r, p in zip(("dq", "dk", "dv"), got, ref, plain):
        assert x.shape == r.shape and x.dtype == dtype
        check_against_reference(x, r, p, atol=grad_atol(r), what=name)
    return (q, k, v, out, lse, dout), got


def _bf16_problem(b, s, h, d, causal, seed):
    """A random bf16 MHA problem (b, s, h, d) with O and LSE from the float64 reference:
    (q, k, v, out, lse, dout)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
                     for _ in range(4))
    out64, lse64, _ = attention_reference_grads(q, k, v, dout, causal, (None, None),
                                                torch.float64)
    return q, k, v, out64.to(q.dtype), lse64.float(), dout


def _poison_workspace(monkeypatch, sems=None, stats=False):
    """Make ``sm90_bwd``'s workspace start with a NaN dQ accumulator, every dQ semaphore at
    ``sems`` (unless None; not with ``pre_ctas``, whose semaphores arrive zeroed) and with
    ``stats`` NaN LSE2 and Delta: the preprocess must zero the semaphores, and nothing may read
    an accumulator block before a CTA has stored or added into it, or a statistic before the
    preprocess has written it."""
    from fa_sm100.hopper import bwd_interface

    workspace = bwd_interface.workspace

    def poisoned(config, q, k, layout=None, kept=False):
        ws = workspace(config, q, k, layout, kept)
        ws["dq_acc"].fill_(float("nan"))
        # with pre_ctas the semaphores must arrive zeroed (the workspace's torch.zeros): the
        # persistent preprocess counts on the last and zeroes none (Note [Preprocess beside
        # the main kernel])
        if sems is not None and not config.pre_ctas:
            ws["dq_sem"].fill_(sems)
        if stats:
            ws["lse2"].fill_(float("nan"))
            ws["delta"].fill_(float("nan"))
        return ws

    monkeypatch.setattr(bwd_interface, "workspace", poisoned)


CASES = [
    # (b, sq, sk, hq, hk, d, causal, window, dtype)
    (2, 256, 256, 2, 2, 128, False, (None, None), torch.bfloat16),
    (1, 200, 333, 3, 3, 128, True, (None, None), torch.bfloat16),
    (2, 300, 100, 2, 2, 128, True, (None, None), torch.float16),  # rows that see no key
    (1, 257, 257, 2, 2, 64, False, (None, None), torch.float16),
    (1, 190, 250, 2, 2, 96, True, (None, None), torch.bfloat16),
    (2, 384, 384, 4, 2, 128, False, (None, None), torch.bfloat16),  # GQA
    (1, 320, 200, 4, 1, 64, True, (None, None), torch.bfloat16),  # MQA
    (1, 500, 500, 2, 2, 128, False, (100, 30), torch.bfloat16),  # sliding window
    (1, 333, 444, 4, 2, 128, False, (64, None), torch.bfloat16),  # left window only, GQA
]


@pytest.mark.parametrize("sdp_swap_ab", [False, True], ids=["sdp", "sdp_swapped"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}-q{c[1]}-k{c[2]}-h{c[3]}/{c[4]}-d{c[5]}"
                         f"-{'causal' if c[6] else 'full'}-w{c[7][0]},{c[7][1]}-{str(c[8])[6:]}")
def test_sm90_bwd_matches_float64(sm90_device, case, sdp_swap_ab):
    from fa_sm100.hopper.bwd_defaults import select_bwd_config

    b, sq, sk, hq, hk, d, causal, window, dtype = case
    cfg = select_bwd_config(head_dim=d, causal=causal, window_left=window[0],
                            window_right=window[1], sdp_swap_ab=sdp_swap_ab)
    _run_case(b, sq, sk, hq, hk, d, causal, window, dtype, config=cfg)


# Head dims 192 (v 128) and 256: tile_n=64, dK/dV split by head-dim columns (Note [dK/dV by
# columns]). The forward's lengths 1, 17, 1000, 4097, batch 1..8, every mask and head layout.
WIDE_CASES = [
    # (b, sq, sk, hq, hk, (d, dv), causal, window, dtype)
    (2, 1, 1, 2, 2, (256, 256), False, (None, None), torch.bfloat16),
    (3, 17, 17, 2, 2, (192, 128), True, (None, None), torch.bfloat16),
    (1, 1000, 1000, 2, 2, (256, 256), True, (None, None), torch.float16),
    (1, 1000, 1000, 4, 1, (192, 128), False, (None, None), torch.bfloat16),  # MQA
    (1, 4097, 4097, 2, 2, (256, 256), False, (None, None), torch.bfloat16),
    (1, 4097, 4097, 2, 2, (192, 128), True, (None, None), torch.float16),
    (2, 300, 100, 2, 2, (256, 256), True, (None, None), torch.bfloat16),  # rows that see no key
    (1, 17, 1000, 4, 2, (256, 256), True, (None, None), torch.bfloat16),  # GQA
    (1, 333, 444, 4, 2, (192, 128), False, (64, None), torch.bfloat16),  # left window, GQA
    (1, 500, 500, 2, 2, (256, 256), False, (100, 30), torch.bfloat16),  # sliding window
    (8, 64, 64, 2, 2, (256, 256), False, (None, None), torch.bfloat16),
]


@pytest.mark.parametrize("case", WIDE_CASES,
                         ids=lambda c: f"b{c[0]}-q{c[1]}-k{c[2]}-h{c[3]}/{c[4]}-d{c[5][0]},{c[5][1]}"
                         f"-{'causal' if c[6] else 'full'}-w{c[7][0]},{c[7][1]}-{str(c[8])[6:]}")
def test_sm90_bwd_wide_head_dims_match_float64(sm90_device, case):
    b, sq, sk, hq, hk, d, causal, window, dtype = case
    _run_case(b, sq, sk, hq, hk, d, causal, window, dtype)  # sm90_bwd's own defaults


WIDE_SWITCHES = [  # (switches, kv heads of 4 query heads)
    (dict(dq_accum="bulk", q_stage=1, do_stage=1), 4), (dict(dq_accum="red", do_stage=1), 2),
    (dict(dq_accum="red"), 4),
    (dict(overlap_dk=True), 4), (dict(gqa_reduce="atomic"), 2), (dict(gqa_reduce="buffers"), 1),
    (dict(dkv_tma_store=False), 4), (dict(stats_smem=False), 4), (dict(try_wait=False), 4),
    (dict(stats_first=True), 2),
]


@pytest.mark.parametrize("switches,hk", WIDE_SWITCHES,
                         ids=lambda x: ",".join(f"{k}={v}" for k, v in x.items())
                         if isinstance(x, dict) else f"hk{x}")
@pytest.mark.parametrize("d", [(256, 256), (192, 128)], ids=["d256", "d192"])
def test_sm90_bwd_wide_head_dim_switches(sm90_device, switches, hk, d):
    from fa_sm100.hopper.bwd_defaults import select_bwd_config

    cfg = select_bwd_config(head_dim=d[0], head_dim_v=d[1], causal=True, qhead_per_kvhead=4 // hk,
                            **switches)
    _run_case(1, 333, 300, 4, hk, d, True, (None, None), torch.bfloat16, config=cfg)


# Note [dK/dV transposed]: tile_n 96 at (192, 128) with the switches it meets, over the
# (192, 128) cases above (tails, MQA, GQA with a left window) and rows that see no key
TRANSPOSED_SWITCHES = [
    {}, dict(early_dv=False), dict(early_dv=False, dv_before_barrier=True),
    dict(dq_accum="red"), dict(overlap_dk=True, early_dv=False), dict(gqa_reduce="atomic"),
    dict(dkv_tma_store=False), dict(stats_first=True), dict(q_stage=1, do_stage=1),
    dict(gqa_reduce="bulk"),
]
TRANSPOSED_CASES = [c for c in WIDE_CASES if c[5] == (192, 128)] + [
    (2, 300, 100, 4, 2, (192, 128), True, (None, None), torch.float16),
    (2, 1, 1, 2, 2, (192, 128), False, (None, None), torch.bfloat16),
]


@pytest.mark.parametrize("switches", TRANSPOSED_SWITCHES,
                         ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()) or "default")
@pytest.mark.parametrize("case", TRANSPOSED_CASES,
                         ids=lambda c: f"b{c[0]}-q{c[1]}-k{c[2]}-h{c[3]}/{c[4]}"
                         f"-{'causal' if c[6] else 'full'}-w{c[7][0]},{c[7][1]}")
def test_sm90_bwd_dkv_transposed_match_float64(sm90_device, switches, case):
    from fa_sm100.hopper.bwd_defaults import select_bwd_config

    b, sq, sk, hq, hk, d, causal, window, dtype = case
    cfg = select_bwd_config(head_dim=d[0], head_dim_v=d[1], causal=causal,
                            window_left=window[0], window_right=window[1],
                            qhead_per_kvhead=hq // hk, tile_n=96, dkv_swap_ab=True, **switches)
    _run_case(b, sq, sk, hq, hk, d, causal, window, dtype, config=cfg)


@pytest.mark.parametrize("hk", [2, 1], ids=["mha", "gqa"])
def test_sm90_bwd_dkv_transposed_deterministic_is_bitwise(sm90_device, hk):
    """Deterministic mode with tile_n 96: gradients under the rule, and bitwise equal over
    three runs (GQA through the per-head float32 buffers)."""
    from fa_sm100.hopper.bwd_defaults import select_bwd_config
    from fa_sm100.hopper.bwd_interface import sm90_bwd

    cfg = select_bwd_config(head_dim=192, causal=True, qhead_per_kvhead=2 // hk,
                            deterministic=True, tile_n=96, dkv_swap_ab=True)
    args, first = _run_case(1, 777, 777, 2, hk, (192, 128), True, dtype=torch.bfloat16,
                            deterministic=True, config=cfg)
    q, k, v, out, lse, dout = args
    for _ in range(2):
        again = sm90_bwd(dout, q, k, v, out, lse, causal=True, deterministic=True, config=cfg)
        for x, y in zip(first, again):
            assert torch.equal(x, y)


# Note [dK/dV by bulk reduces]: GQA / MQA with one float32 buffer per KV head added by bulk
# reduces, on every block shape that allows it (swapped 128 / 80 / 64-row blocks, unswapped,
# transposed), tails, rows that see no key, windows, Q/dO multicast
BULK_CASES = [  # (b, sq, sk, hq, hk, d, causal, window, switches)
    (2, 1000, 1000, 8, 2, 128, True, (None, None), {}),
    (1, 1000, 1000, 8, 1, 128, False, (None, None), {}),  # MQA
    (2, 333, 300, 4, 2, 64, True, (None, None), {}),
    (1, 4097, 4097, 4, 1, 64, False, (None, None), {}),
    (1, 333, 444, 4, 2, 96, False, (64, None), {}),
    (2, 300, 100, 4, 2, 128, True, (None, None), dict(sdp_swap_ab=False)),
    (1, 500, 500, 6, 2, 128, False, (100, 30), dict(tile_m=64)),
    (1, 1000, 1000, 4, 2, (192, 128), True, (None, None), {}),
    (2, 333, 500, 4, 2, 128, False, (None, None), dict(qdo_multicast=True)),
]


@pytest.mark.parametrize("case", BULK_CASES,
                         ids=lambda c: f"b{c[0]}-q{c[1]}-k{c[2]}-h{c[3]}/{c[4]}-d{c[5]}"
                         f"-{'causal' if c[6] else 'full'}-w{c[7][0]},{c[7][1]}"
                         + "".join(f"-{k}" for k in c[8]))
def test_sm90_bwd_gqa_bulk_reduce_match_float64(sm90_device, case):
    from fa_sm100.hopper.bwd_defaults import select_bwd_config

    b, sq, sk, hq, hk, d, causal, window, switches = case
    dd, dv = d if isinstance(d, tuple) else (d, d)
    cfg = select_bwd_config(head_dim=dd, head_dim_v=dv, causal=causal, window_left=window[0],
                            window_right=window[1], qhead_per_kvhead=hq // hk,
                            gqa_reduce="bulk", **switches)
    _run_case(b, sq, sk, hq, hk, d, causal, window, torch.bfloat16, config=cfg)


# tile_m=128 (swapped S/dP, hdim 64 only; Note [tile_m 128]): query-block tails of 1, 17, 1000
# (1000 = 7 x 128 + 104), 4097 rows; seqlen_q != seqlen_k both ways; GQA/MQA; windows.
TILE_M_128_CASES = [
    # (b, sq, sk, hq, hk, causal, window, dtype)
    (2, 1, 1, 2, 2, False, (None, None), torch.bfloat16),
    (2, 17, 17, 2, 2, True, (None, None), torch.bfloat16),
    (1, 1000, 1000, 4, 4, False, (None, None), torch.bfloat16),
    (1, 1000, 1000, 4, 4, True, (None, None), torch.float16),
    (1, 4097, 4097, 2, 2, False, (None, None), torch.bfloat16),
    (1, 4097, 4097, 2, 2, True, (None, None), torch.bfloat16),
    (1, 17, 1000, 2, 2, True, (None, None), torch.bfloat16),
    (2, 1000, 17, 2, 2, True, (None, None), torch.bfloat16),  # rows that see no key
    (2, 1000, 1000, 8, 2, True, (None, None), torch.bfloat16),  # GQA
    (1, 1000, 1000, 4, 1, False, (None, None), torch.bfloat16),  # MQA
    (1, 1000, 1000, 2, 2, False, (100, 30), torch.bfloat16),  # sliding window
    (1, 4097, 4097, 4, 2, False, (256, 0), torch.bfloat16),  # causal-like window, GQA
]


@pytest.mark.parametrize("early_dv", [True, False], ids=["early_dv", "late_dv"])
@pytest.mark.parametrize("case", TILE_M_128_CASES,
                         ids=lambda c: f"tile_m128-b{c[0]}-q{c[1]}-k{c[2]}-h{c[3]}/{c[4]}"
                         f"-{'causal' if c[5] else 'full'}-w{c[6][0]},{c[6][1]}-{str(c[7])[6:]}")
def test_sm90_bwd_tile_m_128_matches_float64(sm90_device, case, early_dv):
    """tile_m=128 with swapped S/dP: both early-dV variants (with early dV, dS is computed from
    the 16-bit P^T that dV uses)."""
    from fa_sm100.hopper.bwd_defaults import select_bwd_config

    b, sq, sk, hq, hk, causal, window, dtype = case
    cfg = select_bwd_config(head_dim=64, causal=causal, window_left=window[0],
                            window_right=window[1], qhead_per_kvhead=hq // hk, tile_m=128,
                            sdp_swap_ab=True, early_dv=early_dv)
    _run_case(b, sq, sk, hq, hk, 64, causal, window, dtype, config=cfg)


@pytest.mark.parametrize("early_dv", [True, False], ids=["early_dv", "late_dv"])
@pytest.mark.parametrize("case", TILE_M_128_CASES,
                         ids=lambda c: f"tile_m80-b{c[0]}-q{c[1]}-k{c[2]}-h{c[3]}/{c[4]}"
                         f"-{'causal' if c[5] else 'full'}-w{c[6][0]},{c[6][1]}-{str(c[7])[6:]}")
def test_sm90_bwd_tile_m_80_matches_float64(sm90_device, case, early_dv):
    """tile_m=80 at hdim 128 (Note [dQ transposed]): dQ^T = K^T dS^T, 80-row query blocks and
    their tails (1, 17, 1000 = 12 x 80 + 40, 4097 rows), both early-dV variants."""
    from fa_sm100.hopper.bwd_defaults import select_bwd_config

    b, sq, sk, hq, hk, causal, window, dtype = case
    cfg = select_bwd_config(head_dim=128, causal=causal, window_left=window[0],
                            window_right=window[1], qhead_per_kvhead=hq // hk, tile_m=80,
                            sdp_swap_ab=True, early_dv=early_dv)
    _run_case(b, sq, sk, hq, hk, 128, causal, window, dtype, config=cfg)


@pytest.mark.parametrize("switches", [dict(dq_accum="red", early_dv=True),
                                      dict(dq_accum="red", early_dv=False),
                                      dict(gqa_reduce="atomic"), dict(q_stage=1, do_stage=1)],
                         ids=lambda d: "tile_m128-" + ",".join(f"{k}={v}" for k, v in d.items()))
@pytest.mark.parametrize("case", [(2, 1000, 1000, 4, 2, True, (None, None)),
                                  (1, 4097, 4000, 2, 2, False, (300, 20))],
                         ids=["gqa-causal", "window"])
def test_sm90_bwd_tile_m_128_switches(sm90_device, switches, case):
    from fa_sm100.hopper.bwd_defaults import select_bwd_config

    b, sq, sk, hq, hk, causal, window = case
    cfg = select_bwd_config(head_dim=64, tile_m=128, sdp_swap_ab=True, **switches)
    _run_case(b, sq, sk, hq, hk, 64, causal, window, torch.bfloat16, config=cfg)


@pytest.mark.parametrize("sdp_swap_ab", [False, True])
@pytest.mark.parametrize("gqa_reduce", ["atomic", "buffers"])
def test_sm90_bwd_gqa_reduce_modes(sm90_device, gqa_reduce, sdp_swap_ab):
    from fa_sm100.hopper.bwd_defaults import select_bwd_config

    cfg = select_bwd_config(head_dim=128, causal=True, qhead_per_kvhead=4,
                            gqa_reduce=gqa_reduce, sdp_swap_ab=sdp_swap_ab)
    _run_case(1, 256, 300, 8, 2, 128, True, (None, None), torch.bfloat16, config=cfg)


# sdp_swap_ab is named in every entry: its default depends on the head dim and causality; so
# is dv_before_barrier wherever early_dv=False (its default is on with 128-row blocks).
# Swapped entries take the head dim's default tile_m (128 at hdim 64, 80 at hdim 128), except
# the ones that pin the 64-row swapped path.
SWITCHES = [
    dict(sdp_swap_ab=False, dq_accum="red", early_dv=False),
    dict(sdp_swap_ab=False, dq_accum="red", early_dv=True),
    dict(sdp_swap_ab=False, dq_accum="bulk", early_dv=False),
    dict(sdp_swap_ab=True, dq_accum="bulk", early_dv=True),
    dict(sdp_swap_ab=True, dq_accum="bulk", early_dv=False, dv_before_barrier=False),
    dict(sdp_swap_ab=True, dq_accum="red", early_dv=True),
    dict(sdp_swap_ab=True, dq_accum="red", early_dv=False, dv_before_barrier=False),
    dict(sdp_swap_ab=True, tile_m=64, dq_accum="bulk", early_dv=True),
    dict(sdp_swap_ab=False, overlap_dk=True, dq_accum="bulk", early_dv=True),
    dict(sdp_swap_ab=False, overlap_dk=True, dq_accum="red", early_dv=False),
    dict(sdp_swap_ab=False, stats_smem=False), dict(sdp_swap_ab=True, stats_smem=False),
    dict(sdp_swap_ab=True, tile_m=64, stats_first=True),
    dict(sdp_swap_ab=False, stats_first=True, stats_smem=False),
    dict(sdp_swap_ab=True, try_wait=False), dict(sdp_swap_ab=False, try_wait=True),
    dict(sdp_swap_ab=True, early_dv=False, dv_before_barrier=True),
    dict(sdp_swap_ab=True, early_dv=False, dv_before_barrier=True, dv_before_fence=False),
    # short causal hdim 128's default: 64-row blocks, dV before the barrier, stats first
    dict(sdp_swap_ab=True, tile_m=64, early_dv=False, dv_before_barrier=True, stats_first=True),
    dict(sdp_swap_ab=False, early_dv=False, dv_before_barrier=True),
    dict(sdp_swap_ab=True, dkv_tma_store=False), dict(sdp_swap_ab=False, dkv_tma_store=False),
    # 3-stage Q/dO pipelines (with "red" dQ: no SMEM dQ tile)
    dict(sdp_swap_ab=False, dq_accum="red", q_stage=3, do_stage=3),
    dict(sdp_swap_ab=True, tile_m=64, dq_accum="red", q_stage=3, do_stage=3),
    # Note [dK/dV by columns] at hdim 64 / 128
    dict(sdp_swap_ab=False, tile_m=64, tile_n=64, early_dv=False, dv_before_barrier=False),
    dict(sdp_swap_ab=False, tile_m=64, tile_n=64, early_dv=False, dv_before_barrier=False,
         dq_accum="red", overlap_dk=True),
    # Note [longest first] with a 7-CTA tail: gqa-causal's 8 pairs of 3 key blocks start 5
    # pairs in the grid's order and the last 3 longest first; window-d64's 2 pairs of 4 key
    # blocks all start longest first
    dict(sdp_swap_ab=True, longest_first=True, tail_ctas=7),
    dict(sdp_swap_ab=False, longest_first=True, tail_ctas=7),
    dict(sdp_swap_ab=True, longest_first=False),
    # Note [dK/dV transposed] at hdim 64 / 128 (tile_n 128, 64 keys per warpgroup)
    dict(sdp_swap_ab=False, tile_m=64, dkv_swap_ab=True),
    dict(sdp_swap_ab=False, tile_m=64, dkv_swap_ab=True, early_dv=False, dkv_tma_store=False),
]


@pytest.mark.parametrize("switches", SWITCHES,
                         ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
@pytest.mark.parametrize("case", [(2, 333, 300, 4, 2, 128, True, (None, None)),
                                  (1, 400, 500, 2, 2, 64, False, (80, 10))],
                         ids=["gqa-causal", "window-d64"])
def test_sm90_bwd_switches_keep_gradients_right(sm90_device, switches, case):
    """Every switch of BwdConfig (dQ path, early dV, swapped S/dP, overlapped dK, where the
    stats live and when they are read, how stage waits poll) computes the same gradients."""
    from fa_sm100.hopper.bwd_defaults import select_bwd_config

    b, sq, sk, hq, hk, d, causal, window = case
    cfg = select_bwd_config(head_dim=d, causal=causal, window_left=window[0],
                            window_right=window[1], qhead_per_kvhead=hq // hk, **switches)
    _run_case(b, sq, sk, hq, hk, d, causal, window, torch.bfloat16, config=cfg)


# Note [Q/dO multicast]: every tile path the switch meets (swapped 80 / 128-row blocks and
# the unswapped 64-row one; "bulk" and "red" dQ; dK/dV by columns at the wide head dims), on
# non-causal problems with an even number of key blocks: ragged seqlen_q, ragged last key
# block, GQA, MQA
MULTICAST_CASES = [  # (b, sq, sk, hq, hk, d, switches)
    (2, 333, 250, 4, 2, 128, {}),
    (1, 200, 512, 2, 2, 128, dict(sdp_swap_ab=False, dq_accum="red")),
    (2, 257, 255, 4, 1, 64, {}),
    (1, 190, 200, 2, 2, 96, {}),
    (1, 300, 190, 2, 1, (192, 128), {}),  # two key blocks of 96
    (1, 129, 120, 2, 2, 256, {}),
    # clusters of 4: a quarter of each tile per CTA (80 rows: 20, not whole swizzle atoms)
    (2, 333, 500, 4, 2, 128, dict(qdo_cluster=4)),
    (1, 257, 450, 2, 1, 64, dict(qdo_cluster=4)),
    (1, 129, 250, 2, 2, 256, dict(qdo_cluster=4)),
    # causal: a cluster's higher key blocks wait through the query blocks before their own
    # first (Note [Q/dO multicast]), the CTAs start longest first by whole clusters
    (2, 333, 500, 4, 2, 128, dict(causal=True)),
    (1, 700, 512, 2, 2, 128, dict(causal=True, tile_m=64, stats_first=True,
                                  dv_before_barrier=True)),
    (2, 257, 255, 4, 1, 64, dict(causal=True)),
    (1, 129, 250, 2, 2, 256, dict(causal=True)),
    (2, 333, 500, 4, 2, 128, dict(causal=True, qdo_cluster=4)),
    (3, 300, 1000, 4, 2, 128, dict(causal=True, tail_ctas=20)),
    # Note [staggered query blocks] with the zero fill (first stores off), "red" dQ
    (2, 333, 250, 4, 2, 128, dict(stagger_m=True, dq_first_store=False)),
    (1, 129, 250, 2, 2, 256, dict(stagger_m=True)),
]


@pytest.mark.parametrize("case", MULTICAST_CASES, ids=lambda c: f"d{c[5]}-sk{c[2]}-" + (
    ",".join(f"{k}={v}" for k, v in c[6].items()) or "default"))
def test_sm90_bwd_qdo_multicast_keeps_gradients_right(sm90_device, case):
    """Clusters of CTAs that multicast their shares of each Q and dO tile give the same
    gradients."""
    from fa_sm100.hopper.bwd_defaults import select_bwd_config

    b, sq, sk, hq, hk, d, switches = case
    switches = dict(switches)
    causal = switches.pop("causal", False)
    dd, dv = d if isinstance(d, tuple) else (d, d)
    cfg = select_bwd_config(head_dim=dd, head_dim_v=dv, qhead_per_kvhead=hq // hk,
                            causal=causal, qdo_multicast=True, **switches)
    assert cfg.qdo_multicast and (-(-sk // cfg.tile_n)) % cfg.qdo_cluster == 0
    assert cfg.longest_first == causal
    _run_case(b, sq, sk, hq, hk, d, causal=causal, config=cfg, seed=sq)


def _assert_reproducible(inputs, first, causal, window, cfg, runs=3):
    """``runs`` more deterministic backward passes give gradients bitwise equal to ``first``."""
    from fa_sm100.hopper.bwd_interface import sm90_bwd

    q, k, v, out, lse, dout = inputs
    for _ in range(runs):
        again = sm90_bwd(dout, q, k, v, out, lse, causal=causal, window_size=window,
                         deterministic=True, config=cfg)
        for a, b in zip(first, again):
            assert torch.equal(a, b), "deterministic backward changed between runs"


@pytest.mark.parametrize("hk,causal,window,dq_accum,switch", [
    (4, False, (None, None), "bulk", None), (4, True, (None, None), "bulk", None),
    (1, True, (None, None), "bulk", None), (4, False, (96, 0), "bulk", None),
    (2, True, (None, None), "red", None), (2, True, (None, None), "bulk", "sdp_swap_ab"),
    (4, False, (96, 0), "red", "sdp_swap_ab"), (4, True, (None, None), "bulk", "overlap_dk"),
    (2, True, (None, None), "bulk", "longest_first"),
    (4, True, (None, None), "red", "longest_first")])
def test_sm90_bwd_deterministic_is_bitwise_reproducible(sm90_device, hk, causal, window, dq_accum,
                                                        switch):
    from fa_sm100.hopper.bwd_defaults import select_bwd_config

    switches = {} if switch is None else {switch: True}
    if switch == "overlap_dk":  # unswapped only, so 64-row blocks at hdim 128
        switches["sdp_swap_ab"] = False
    if switch == "sdp_swap_ab":  # the swapped 64-row path (the default is 80 rows)
        switches["tile_m"] = 64
    if switch == "longest_first":  # 8 pairs of 8 key blocks: the last 3 longest first
        switches["tail_ctas"] = 20
    cfg = select_bwd_config(head_dim=128, causal=causal, window_left=window[0],
                            window_right=window[1], deterministic=True, dq_accum=dq_accum,
                            gqa_reduce="buffers", **switches)
    inputs, first = _run_case(2, 1000, 1000, 4, hk, 128, causal, window, torch.bfloat16,
                              deterministic=True, config=cfg)
    _assert_reproducible(inputs, first, causal, window, cfg)


@pytest.mark.parametrize("tile_m,d", [(128, 64), (80, 128)], ids=["tile_m128", "tile_m80"])
@pytest.mark.parametrize("hk,causal,window,dq_accum", [
    (4, False, (None, None), "bulk"), (1, True, (None, None), "bulk"),
    (2, True, (None, None), "red"), (4, False, (96, 0), "bulk")],
    ids=lambda x: str(x))
def test_sm90_bwd_wide_blocks_deterministic_is_bitwise_reproducible(sm90_device, hk, causal,
                                                                    window, dq_accum, tile_m, d):
    """The dQ semaphore counts 128-row (hdim 64) and 80-row (hdim 128, Note [dQ transposed])
    query blocks."""
    from fa_sm100.hopper.bwd_defaults import select_bwd_config

    cfg = select_bwd_config(head_dim=d, causal=causal, window_left=window[0],
                            window_right=window[1], deterministic=True, dq_accum=dq_accum,
                            tile_m=tile_m, sdp_swap_ab=True)
    inputs, first = _run_case(2, 1000, 1100, 4, hk, d, causal, window, torch.bfloat16,
                              deterministic=True, config=cfg)
    _assert_reproducible(inputs, first, causal, window, cfg)


@pytest.mark.parametrize("d,hk,window,dq_accum", [
    ((256, 256), 4, (None, None), "red"), ((256, 256), 2, (96, 0), "bulk"),
    ((192, 128), 1, (None, None), "bulk"), ((192, 128), 2, (None, None), "red")],
    ids=lambda x: str(x))
def test_sm90_bwd_wide_head_dims_deterministic_is_bitwise_reproducible(sm90_device, d, hk,
                                                                       window, dq_accum):
    """The dQ semaphore counts 64-row query blocks over 64-key blocks (tile_n=64)."""
    from fa_sm100.hopper.bwd_defaults import select_bwd_config

    stages = dict(q_stage=1, do_stage=1) if d[0] == 256 and dq_accum == "bulk" else {}
    cfg = select_bwd_config(head_dim=d[0], head_dim_v=d[1], dq_accum=dq_accum, **stages)
    inputs, first = _run_case(2, 700, 800, 4, hk, d, True, window, torch.bfloat16,
                              deterministic=True, config=cfg)
    _assert_reproducible(inputs, first, True, window, cfg)



# Note [dQ first store]: the first CTA at each query block stores its tile and nothing zeroes
# the accumulator, so these cases hand the kernels one full of NaN: many key blocks racing for
# the same first block (16 of them, non-causal), blocks that no CTA reaches (seqlen_q >
# seqlen_k under a causal mask; a window), GQA, Q/dO multicast, one dQ handoff per tile,
# deterministic turns (turn 0 stores), and the zero fill itself (first stores off; "red" dQ)
FIRST_STORE_CASES = [  # (b, sq, sk, hq, hk, d, causal, window, deterministic, switches)
    (2, 1000, 2048, 4, 4, 128, False, (None, None), False, dict(stagger_m=False)),
    (2, 700, 150, 2, 2, 128, True, (None, None), False, {}),
    (1, 600, 500, 4, 2, 64, False, (50, 20), False, {}),
    (2, 333, 500, 4, 2, 128, True, (None, None), False, dict(qdo_multicast=True)),
    (1, 500, 400, 2, 2, 128, False, (None, None), False, dict(dq_handoff_per_wg=False)),
    (2, 700, 150, 4, 2, 128, True, (None, None), True, {}),
    (1, 600, 500, 2, 2, 96, False, (50, 20), True, {}),
    (2, 700, 150, 2, 2, 128, True, (None, None), False, dict(dq_first_store=False)),
    (1, 300, 200, 2, 2, 256, True, (None, None), False, {}),
    # Note [staggered query blocks] (hdim 128's non-causal default): pairs, one CTA per
    # sweep with more sweeps than blocks, clusters of 4 with GQA, tile_m 128 at hdim 64, hdim 96
    (2, 1000, 2048, 4, 4, 128, False, (None, None), False, {}),
    (1, 200, 2048, 2, 2, 128, False, (None, None), False, dict(qdo_multicast=False)),
    (2, 1000, 2048, 4, 2, 128, False, (None, None), False, dict(qdo_cluster=4)),
    (1, 4097, 500, 2, 2, 64, False, (None, None), False, dict(stagger_m=True)),
    (1, 777, 640, 2, 1, 96, False, (None, None), False, dict(stagger_m=True)),
]


@pytest.mark.parametrize("case", FIRST_STORE_CASES, ids=lambda c: (
    f"d{c[5]}-q{c[1]}-k{c[2]}-{'causal' if c[6] else 'full'}-w{c[7][0]}"
    + ("-det" if c[8] else "") + "".join(f"-{k}={v}" for k, v in c[9].items())))
def test_sm90_bwd_dq_first_store_with_a_poisoned_accumulator(sm90_device, monkeypatch, case):
    from fa_sm100.hopper.bwd_defaults import select_bwd_config

    b, sq, sk, hq, hk, d, causal, window, det, switches = case
    switches = {"dq_first_store": True, **switches}  # on where the default is off too
    cfg = select_bwd_config(head_dim=d, causal=causal, window_left=window[0],
                            window_right=window[1], qhead_per_kvhead=hq // hk,
                            deterministic=det, seqlen_q=sq, seqlen_k=sk, **switches)
    assert cfg.first_stores_dq == (switches["dq_first_store"] and d != 256)
    assert cfg.stagger_m == switches.get("stagger_m", d == 128 and not (causal or det or
                                                                        window[0] or window[1]))
    _poison_workspace(monkeypatch, sems=7)
    _run_case(b, sq, sk, hq, hk, d, causal, window, deterministic=det, config=cfg, seed=sk)


# Note [dQ postprocess in the tail] (``early_dq_post``, hdim 128's default, so every hdim 128
# case of this file has it): more CTAs than SMs (the postprocess really starts while the main
# kernel runs), GQA (the dK/dV postprocess follows it), rows that see no key, deterministic
# turns, the zero fill, causal multicast with a short tail; at the other head dims by switch,
# with windows. The dQ accumulator and the semaphores (the count included) are poisoned: the
# preprocess must zero the count, and a count that starts high would let the postprocess read
# unfinished blocks (with hdim 128's persistent preprocess, ``pre_ctas``, the semaphores
# arrive zeroed instead: two cases turn it off).
EARLY_POST_CASES = [  # (b, sq, sk, hq, hk, d, causal, window, deterministic, switches)
    (4, 2048, 2048, 16, 16, 128, False, (None, None), False, dict(pre_ctas=0)),
    (4, 2048, 2048, 16, 4, 128, True, (None, None), False, {}),
    (2, 700, 150, 2, 2, 128, True, (None, None), False, {}),
    (2, 700, 150, 4, 2, 128, True, (None, None), True, dict(pre_ctas=0)),
    (1, 500, 400, 2, 2, 128, False, (None, None), False,
     dict(dq_first_store=False, stagger_m=False)),
    (2, 333, 500, 4, 2, 128, True, (None, None), False, dict(qdo_multicast=True, tail_ctas=7)),
    (1, 600, 500, 4, 2, 64, False, (50, 20), False, dict(early_dq_post=True)),
    (2, 1000, 900, 4, 4, 64, True, (None, None), False, dict(early_dq_post=True)),
    (1, 777, 640, 2, 1, 96, False, (None, None), False, dict(early_dq_post=True)),
    (1, 300, 200, 2, 1, (192, 128), True, (None, None), False, dict(early_dq_post=True)),
]


@pytest.mark.parametrize("case", EARLY_POST_CASES, ids=lambda c: (
    f"d{c[5] if isinstance(c[5], int) else c[5][0]}-b{c[0]}-q{c[1]}-k{c[2]}-h{c[3]}/{c[4]}"
    f"-{'causal' if c[6] else 'full'}-w{c[7][0]}" + ("-det" if c[8] else "")
    + "".join(f"-{k}={v}" for k, v in c[9].items())))
def test_sm90_bwd_early_dq_postprocess(sm90_device, monkeypatch, case):
    from fa_sm100.hopper.bwd_defaults import select_bwd_config

    b, sq, sk, hq, hk, d, causal, window, det, switches = case
    dqk, dv = d if isinstance(d, tuple) else (d, d)
    cfg = select_bwd_config(head_dim=dqk, head_dim_v=dv, causal=causal, window_left=window[0],
                            window_right=window[1], qhead_per_kvhead=hq // hk,
                            deterministic=det, seqlen_q=sq, seqlen_k=sk, **switches)
    assert cfg.early_dq_post
    _poison_workspace(monkeypatch, sems=1 << 20)
    _run_case(b, sq, sk, hq, hk, d, causal, window, deterministic=det, config=cfg, seed=sq)


# Note [Preprocess beside the main kernel] (``pre_ctas``): the main kernel starts beside the
# preprocess and each CTA's load and dq-store warps wait for their (batch, head)'s rows. Many
# heads over a few preprocess CTAs (the main kernel really waits), one preprocess CTA, more
# preprocess CTAs than units, GQA, causal multicast with a short tail, the zero fill, early
# dQ postprocess, windows, head dims 64 to (192, 128) (hdim 256 runs "red" dQ), pairs of 33
# units in chunks of 7 and 5. LSE2, Delta and the dQ accumulator start as NaN: read before the
# preprocess wrote them, they would show.
PRE_CASES = [  # (b, sq, sk, hq, hk, d, causal, window, switches)
    (4, 2048, 2048, 16, 16, 128, False, (None, None), dict(pre_ctas=32)),
    (4, 2048, 2048, 16, 4, 128, True, (None, None), dict(pre_ctas=8)),
    (2, 700, 150, 2, 2, 128, True, (None, None), dict(pre_ctas=1)),
    (1, 500, 400, 2, 2, 128, False, (None, None),
     dict(pre_ctas=132, dq_first_store=False, stagger_m=False)),
    (2, 333, 500, 4, 2, 128, True, (None, None), dict(pre_ctas=16, qdo_multicast=True,
                                                      tail_ctas=7)),
    (1, 600, 500, 4, 2, 64, False, (50, 20), dict(pre_ctas=16)),
    (2, 1000, 900, 4, 4, 64, True, (None, None), dict(pre_ctas=16, early_dq_post=True)),
    (1, 777, 640, 2, 1, 96, False, (None, None), dict(pre_ctas=4)),
    (1, 300, 200, 2, 1, (192, 128), True, (None, None), dict(pre_ctas=4)),
    (2, 1500, 1500, 8, 8, 128, False, (None, None), dict(pre_ctas=2)),
    (1, 4097, 1000, 4, 2, 128, False, (None, None), dict(pre_ctas=3)),
]


@pytest.mark.parametrize("case", PRE_CASES, ids=lambda c: (
    f"d{c[5] if isinstance(c[5], int) else c[5][0]}-b{c[0]}-q{c[1]}-k{c[2]}-h{c[3]}/{c[4]}"
    f"-{'causal' if c[6] else 'full'}-w{c[7][0]}"
    + "".join(f"-{k}={v}" for k, v in c[8].items())))
def test_sm90_bwd_preprocess_beside_the_main_kernel(sm90_device, monkeypatch, case):
    from fa_sm100.hopper.bwd_defaults import select_bwd_config

    b, sq, sk, hq, hk, d, causal, window, switches = case
    dqk, dv = d if isinstance(d, tuple) else (d, d)
    cfg = select_bwd_config(head_dim=dqk, head_dim_v=dv, causal=causal, window_left=window[0],
                            window_right=window[1], qhead_per_kvhead=hq // hk, seqlen_q=sq,
                            seqlen_k=sk, **switches)
    assert cfg.pre_ctas == switches["pre_ctas"]
    _poison_workspace(monkeypatch, stats=True)
    _run_case(b, sq, sk, hq, hk, d, causal, window, config=cfg, seed=sq)


@pytest.mark.parametrize("d,causal", [(128, True), (64, False)], ids=["d128-causal", "d64"])
def test_sm90_bwd_preprocess_beside_is_bitwise_the_one_before(sm90_device, d, causal):
    """Deterministic mode: the gradients with the preprocess beside the main kernel are bit for
    bit those with it ahead (the same Delta, the same order of dQ additions)."""
    from fa_sm100.hopper.bwd_defaults import select_bwd_config
    from fa_sm100.hopper.bwd_interface import sm90_bwd

    s = 1500
    q, k, v, out, lse, dout = _bf16_problem(2, s, 6, d, causal, seed=d)
    grads = []
    for pre in (0, 8):
        cfg = select_bwd_config(head_dim=d, causal=causal, deterministic=True, seqlen_q=s,
                                seqlen_k=s, pre_ctas=pre)
        grads.append(sm90_bwd(dout, q, k, v, out, lse, causal=causal, deterministic=True,
                              config=cfg))
    for name, x, y in zip(("dq", "dk", "dv"), *grads):
        assert torch.equal(x, y), name


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sm90_bwd_cost_probes_change_only_dq_and_leave_plain_calls_alone(sm90_device, causal):
    """Note [cost probes]: under a ``dq_reduce`` probe the same call runs the probed kernel
    (dK and dV bit for bit the plain kernel's, dQ no longer the sum over key blocks), and a
    plain call made after it gets the plain kernel again (the compile cache keeps them apart:
    the gradients pass the float64 rule)."""
    from fa_sm100.hopper import probes
    from fa_sm100.hopper.bwd_interface import sm90_bwd

    case = (1, 1000, 1000, 2, 2, 128, causal)
    inputs, plain = _run_case(*case)
    q, k, v, out, lse, dout = inputs
    for value in ("copy", "half", "none"):
        with probes.probe("dq_reduce", value):
            dq, dk, dv = sm90_bwd(dout, q, k, v, out, lse, causal=causal)
        assert torch.equal(dk, plain[1]) and torch.equal(dv, plain[2]), value
        if value != "none":  # "none": dQ is whatever the accumulator held
            assert not torch.allclose(dq.float(), plain[0].float(), atol=0.05), value
    _run_case(*case)  # plain again, checked against float64


@pytest.mark.parametrize("head_dim", [64, 128])
def test_sm90_bwd_ds_barrier_probe_runs_and_leaves_plain_calls_alone(sm90_device, head_dim):
    """Note [cost probes]: without the ``DS_READY`` barrier (``ds_barrier=none``) the two MMA
    warpgroups still finish (they stay coupled through the Q/dO stages and the dQ handoff,
    and the probed kernel must not hang: a deadline fails it), and a plain call afterwards
    gets the plain kernel (float64 rule)."""
    import time

    from fa_sm100.hopper import probes
    from fa_sm100.hopper.bwd_interface import sm90_bwd

    case = (2, 1000, 1000, 2, 2, head_dim, False)
    (q, k, v, out, lse, dout), _ = _run_case(*case)
    with probes.probe("ds_barrier", "none"):
        grads = sm90_bwd(dout, q, k, v, out, lse, causal=False)
    done = torch.cuda.Event()
    done.record()
    deadline = time.monotonic() + 120  # the call takes milliseconds: longer is a hang
    while not done.query():
        assert time.monotonic() < deadline, "the ds_barrier=none kernel did not finish"
        time.sleep(0.01)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    _run_case(*case)  # plain again, checked against float64


@pytest.mark.parametrize("head_dim", [64, 128])
def test_sm90_bwd_pointwise_probe_gives_the_gradients_of_raw_scores(sm90_device, head_dim):
    """Note [cost probes]: ``pointwise=none`` feeds the GEMMs S and dP as the tensor cores
    gave them, so the kernel computes dV = S^T dO, dK = scale dP^T Q and dQ = scale dP K with
    S = Q K^T and dP = dO V^T rounded to bf16 (no exp2, no Delta): checked against that
    float32 computation; a plain call afterwards gets the plain kernel (float64 rule)."""
    from fa_sm100.hopper import probes
    from fa_sm100.hopper.bwd_interface import sm90_bwd

    case = (1, 1000, 1000, 2, 2, head_dim, False)
    (q, k, v, out, lse, dout), _ = _run_case(*case)
    with probes.probe("pointwise", "none"):
        dq, dk, dv = sm90_bwd(dout, q, k, v, out, lse, causal=False)
    scale = head_dim ** -0.5
    qf, kf, vf, df = (x.float().transpose(1, 2) for x in (q, k, v, dout))  # (b, h, s, d)
    s_raw = (qf @ kf.transpose(-1, -2)).bfloat16().float()
    dp_raw = (df @ vf.transpose(-1, -2)).bfloat16().float()
    want = (scale * dp_raw @ kf, scale * dp_raw.transpose(-1, -2) @ qf,
            s_raw.transpose(-1, -2) @ df)
    for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        got = got.float().transpose(1, 2)
        err = (got - ref).abs().max().item()
        assert err <= 2 ** -6 * ref.abs().max().item(), (name, err, ref.abs().max().item())
    _run_case(*case)  # plain again, checked against float64


@pytest.mark.parametrize("head_dim", [64, 128])
def test_sm90_bwd_sweep_probe_adds_every_block_twice(sm90_device, head_dim):
    """Note [cost probes]: ``sweep=twice`` repeats each CTA's sweep over the same query blocks
    (staggered at hdim 128, with first dQ stores and tails), so dQ, dK and dV come out twice
    the plain gradients, up to the rounding of the longer sums and of bf16; a plain call
    afterwards gets the plain kernel (float64 rule)."""
    from fa_sm100.hopper import probes
    from fa_sm100.hopper.bwd_interface import sm90_bwd

    case = (2, 1000, 1000, 2, 2, head_dim, False)
    (q, k, v, out, lse, dout), plain = _run_case(*case)
    with probes.probe("sweep", "twice"):
        twice = sm90_bwd(dout, q, k, v, out, lse, causal=False)
    for name, x, p in zip(("dq", "dk", "dv"), twice, plain):
        ref = 2 * p.float()
        err = (x.float() - ref).abs().max().item()
        assert err <= 2 ** -7 * ref.abs().max().item(), (name, err)
    _run_case(*case)  # plain again, checked against float64


def test_sm90_bwd_dq_post_probe_leaves_dq_alone_and_dk_dv_right(sm90_device, monkeypatch):
    """Note [cost probes]: ``dq_post=none`` launches no dQ postprocess, so dq keeps what its
    allocation held (here NaN: ``empty_like`` made to fill) while dK and dV are the plain
    kernel's bit for bit; a plain call afterwards writes dq again (float64 rule)."""
    from fa_sm100.hopper import probes
    from fa_sm100.hopper.bwd_interface import sm90_bwd

    case = (1, 1000, 1000, 2, 2, 128, False)
    (q, k, v, out, lse, dout), plain = _run_case(*case)
    with monkeypatch.context() as m:
        m.setattr(torch, "empty_like", lambda t, **kw: torch.full_like(t, float("nan"), **kw))
        with probes.probe("dq_post", "none"):
            dq, dk, dv = sm90_bwd(dout, q, k, v, out, lse, causal=False)
    assert torch.isnan(dq).all()
    assert torch.equal(dk, plain[1]) and torch.equal(dv, plain[2])
    _run_case(*case)


PERSISTENT_CASES = [
    # (b, sq, sk, hq, hk, d, switches): persistent_ctas far below the tile count, so that every
    # CTA walks many tiles (Note [persistent CTAs])
    (2, 1000, 1000, 4, 4, 128, dict(persistent_ctas=4)),  # the defaults: multicast, stagger
    (3, 333, 250, 2, 2, 128, dict(persistent_ctas=2)),  # ragged, one cluster for 12 tiles
    (2, 700, 1024, 3, 3, 128, dict(persistent_ctas=6, qdo_multicast=False)),
    (2, 1000, 1000, 4, 4, 128, dict(persistent_ctas=8, stagger_m=False, dq_first_store=False,
                                    early_dq_post=False)),
    (2, 1000, 1000, 4, 4, 64, dict(persistent_ctas=4)),
    (1, 257, 255, 3, 3, 64, dict(persistent_ctas=2, qdo_multicast=False)),
    # one CTA per SM: 512 tiles, 3 or 4 each (the tile count not a multiple of the grid)
    (2, 2048, 2048, 16, 16, 128, dict(persistent_ctas=132)),
    # switches the defaults do not take with it: one dQ hand-off for the whole tile, one Q/dO
    # stage, unswapped 64-row blocks with overlapped dK (hdim 96), LSE2 / Delta from GMEM
    (2, 1000, 1000, 4, 4, 128, dict(persistent_ctas=4, dq_handoff_per_wg=False)),
    (2, 700, 512, 2, 2, 64, dict(persistent_ctas=2, q_stage=1, do_stage=1)),
    (2, 600, 512, 2, 2, 96, dict(persistent_ctas=2, overlap_dk=True)),
    (1, 1000, 768, 4, 4, 128, dict(persistent_ctas=6, stats_smem=False)),
]


@pytest.mark.parametrize("case", PERSISTENT_CASES, ids=lambda c: (
    f"d{c[5]}-b{c[0]}-q{c[1]}-k{c[2]}-h{c[3]}" + "".join(f"-{k}={v}" for k, v in c[6].items())))
def test_sm90_bwd_persistent_ctas_match_float64(sm90_device, monkeypatch, case):
    """Persistent CTAs (Note [persistent CTAs]) keep the gradients right, with a NaN dQ
    accumulator and NaN statistics to start from (nothing may read a block before it is
    written) and, where the defaults take them, multicast pairs, staggered sweeps, first dQ
    stores and the early dQ postprocess."""
    from fa_sm100.hopper.bwd_defaults import select_bwd_config

    b, sq, sk, hq, hk, d, switches = case
    cfg = select_bwd_config(head_dim=d, seqlen_q=sq, seqlen_k=sk, **switches)
    tiles = b * hq * cfg.num_key_blocks(sk)
    assert cfg.pre_ctas == 0 and tiles > cfg.persistent_ctas, "CTAs that walk several tiles"
    _poison_workspace(monkeypatch, sems=7, stats=True)
    _run_case(b, sq, sk, hq, hk, d, config=cfg, seed=sq)


DYNAMIC_CASES = [
    # (b, sq, sk, hq, hk, d, causal, window, switches): persistent CTAs that fetch their tiles
    # (Note [dynamic tiles]), far fewer than the tiles, so that the fetches and the handoff
    # slots go round many times
    (2, 1000, 1000, 4, 4, 64, True, (None, None), dict(persistent_ctas=4)),
    (2, 1000, 1000, 4, 4, 96, True, (None, None), dict(persistent_ctas=6)),  # unswapped
    (1, 3000, 3000, 2, 2, 96, True, (None, None), dict(persistent_ctas=5)),
    (3, 333, 777, 2, 2, 64, True, (None, None), dict(persistent_ctas=3)),  # ragged, sq < sk
    (2, 900, 700, 3, 3, 96, True, (None, None), dict(persistent_ctas=2)),  # sq > sk
    (2, 1000, 1000, 4, 4, 96, False, (256, 64), dict(persistent_ctas=4)),  # a band
    (2, 1000, 1000, 4, 4, 64, False, (256, 64), dict(persistent_ctas=4)),  # hdim 64's default
    (2, 1000, 1000, 4, 4, 64, False, (None, None), dict(persistent_ctas=4)),  # no mask
    (2, 1000, 1000, 4, 4, 96, False, (None, None), dict(persistent_ctas=4)),
    (2, 1000, 1000, 4, 4, 64, True, (None, None), dict(persistent_ctas=4, longest_first=False)),
    # one CTA per SM: 16 x 16 tiles of 1 to 16 query blocks each (hdim 64's default here)
    (2, 2048, 2048, 16, 16, 64, True, (None, None), dict(persistent_ctas=132)),
]


@pytest.mark.parametrize("case", DYNAMIC_CASES, ids=lambda c: (
    f"d{c[5]}-b{c[0]}-q{c[1]}-k{c[2]}-h{c[3]}-causal={c[6]}-w={c[7][0]},{c[7][1]}"
    + "".join(f"-{k}={v}" for k, v in c[8].items())))
def test_sm90_bwd_dynamic_tiles_match_float64(sm90_device, monkeypatch, case):
    """Dynamic tiles (Note [dynamic tiles]) keep the gradients right: every tile runs once
    (the tile counter, poisoned like every dQ semaphore, must be zeroed by the preprocess), with
    a causal mask (longest first, or in the grid's order), a band, or none, and with a NaN dQ
    accumulator and NaN statistics to start from."""
    from fa_sm100.hopper.bwd_defaults import select_bwd_config

    b, sq, sk, hq, hk, d, causal, window, switches = case
    cfg = select_bwd_config(head_dim=d, causal=causal, window_left=window[0],
                            window_right=window[1], seqlen_q=sq, seqlen_k=sk,
                            dynamic_tiles=True, **switches)
    tiles = b * hq * cfg.num_key_blocks(sk)
    assert cfg.pre_ctas == 0 and tiles > cfg.persistent_ctas, "CTAs that fetch several tiles"
    _poison_workspace(monkeypatch, sems=7, stats=True)
    _run_case(b, sq, sk, hq, hk, d, causal=causal, window=window, config=cfg, seed=sq + d)


@pytest.mark.parametrize("d", [64, 96])
def test_sm90_bwd_dynamic_tiles_dk_dv_are_bitwise_one_cta_per_tile(sm90_device, d):
    """Causal: whichever CTA fetches a tile runs the same GEMMs in the same order, so dK and
    dV are those of one CTA per tile bit for bit, over repeated calls (the counter starts from
    zero each time: a call that skipped or repeated a tile would differ)."""
    from fa_sm100.hopper.bwd_defaults import select_bwd_config
    from fa_sm100.hopper.bwd_interface import sm90_bwd

    s = 1536
    q, k, v, out, lse, dout = _bf16_problem(2, s, 6, d, True, seed=d)
    base = select_bwd_config(head_dim=d, causal=True, seqlen_q=s, seqlen_k=s, persistent_ctas=0)
    assert not base.persistent_ctas and not base.dynamic_tiles
    ref = sm90_bwd(dout, q, k, v, out, lse, causal=True, config=base)
    cfg = select_bwd_config(head_dim=d, causal=True, seqlen_q=s, seqlen_k=s,
                            persistent_ctas=10, dynamic_tiles=True)
    for _ in range(3):
        got = sm90_bwd(dout, q, k, v, out, lse, causal=True, config=cfg)
        for name, x, y in zip(("dk", "dv"), ref[1:], got[1:]):
            assert torch.equal(x, y), name


@pytest.mark.parametrize("d", [64, 128])
def test_sm90_bwd_persistent_dk_dv_are_bitwise_one_cta_per_tile(sm90_device, d):
    """A tile's dK and dV come from the same GEMMs in the same order whichever CTA runs it, so
    persistent CTAs give them bit for bit; dQ (added by many tiles in a run-dependent order)
    passes the float64 rule in the test above."""
    from fa_sm100.hopper.bwd_defaults import select_bwd_config
    from fa_sm100.hopper.bwd_interface import sm90_bwd

    s = 1536
    q, k, v, out, lse, dout = _bf16_problem(2, s, 6, d, False, seed=d)
    grads = []
    for ctas in (0, 10):
        cfg = select_bwd_config(head_dim=d, seqlen_q=s, seqlen_k=s, pre_ctas=0,
                                persistent_ctas=ctas)
        grads.append(sm90_bwd(dout, q, k, v, out, lse, config=cfg))
    for name, x, y in zip(("dk", "dv"), grads[0][1:], grads[1][1:]):
        assert torch.equal(x, y), name
