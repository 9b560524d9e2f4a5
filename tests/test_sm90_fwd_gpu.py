"""Hardware tests of the SM90 forward (issue 6 item 3). Skip off SM90 with the reason.

Contract: for every feature (bf16/fp16, causal or not, MHA/GQA/MQA, every head-dim pair,
seqlens 1, 17, 1000, 4097 for q and k, batch 1..8) the kernel's O and LSE are within the
STYLE.md rule of a float64 reference: max error <= 2 x the error of the same computation done
plainly in the kernel's precision, + a small absolute slack. For O that plain computation is
attention in the input precision (S and P rounded to bf16/fp16). LSE is a float32 quantity in
the kernel (float32 S from the tensor cores, float32 row max and sum), so its plain baseline
is attention in float32 and its slack is relative (LSE_RTOL x the largest |LSE|): a
low-precision baseline would hide real LSE errors. Inputs are fresh random tensors per check
and the output buffers are poisoned with NaN before each run, so unwritten rows fail.
"""

import zlib

import pytest
import torch

from fa_sm100.testing import (
    attention_reference,
    check_against_reference,
    growing_row_max_inputs,
    rescale_events,
)

# Slack of the LSE check, relative to max |LSE| (up to about 10 here, so about 1e-4 absolute).
# A float32 model of the kernel's LSE arithmetic (tile order, quad partial sums, rescales,
# MUFU.EX2 / LG2 errors of 2^-22) is off by at most ~2e-6 for these shapes; a bf16 LSE is off
# by ~3e-2, so an error that the old bf16 baseline let through now fails.
LSE_RTOL = 1e-5

HEAD_DIMS = [(64, 64), (96, 96), (128, 128), (192, 128), (256, 256)]
DTYPES = [torch.bfloat16, torch.float16]
# (batch, seqlen_q, seqlen_k, heads_q, heads_kv): every seqlen of the issue for q and for k,
# batch 1..8, MHA / GQA / MQA; the causal runs cover seqlen_q > seqlen_k (rows with no key).
SHAPES = [
    (1, 1, 1, 4, 4),
    (8, 17, 17, 2, 2),
    (3, 17, 1000, 6, 2),
    (2, 1000, 17, 4, 1),
    (5, 1000, 1000, 4, 4),
    (1, 4097, 4097, 4, 2),
    (2, 1000, 4097, 3, 1),
    (1, 4097, 1000, 2, 2),
    (4, 1, 4097, 8, 8),
]


def check_lse(lse, q, k, v, causal, ref_lse, what):
    """LSE against the float64 reference, with plain float32 attention as the baseline."""
    _, plain32_lse = attention_reference(q, k, v, causal=causal, dtype=torch.float32)
    finite = torch.isfinite(ref_lse)
    scale = max(1.0, float(ref_lse[finite].abs().max())) if finite.any() else 1.0
    check_against_reference(lse, ref_lse, plain32_lse, atol=LSE_RTOL * scale, what=what)


def _check_one(shape, head_dims, dtype, causal, gen, config=None):
    """One fresh problem of ``shape`` through ``sm90_fwd`` (``config``, or the default one),
    O and LSE poisoned first, against the float64 reference."""
    b, sq, sk, hq, hk = shape
    d, dv = head_dims
    dev = "cuda"
    q = torch.randn(b, sq, hq, d, device=dev, dtype=dtype, generator=gen)
    k = torch.randn(b, sk, hk, d, device=dev, dtype=dtype, generator=gen)
    v = torch.randn(b, sk, hk, dv, device=dev, dtype=dtype, generator=gen)
    what = f"{shape} hdim={head_dims} {dtype} causal={causal}" + ("" if config is None else
                                                                 f" config={config}")
    _check_inputs(q, k, v, causal, config, what)


def _check_inputs(q, k, v, causal, config, what):
    """``sm90_fwd`` (``config``, or the default one) on q, k, v, O and LSE poisoned first,
    against the float64 reference."""
    from fa_sm100.hopper.interface import sm90_fwd

    (b, sq, hq, _), dv = q.shape, v.shape[3]
    out = torch.full((b, sq, hq, dv), float("nan"), device=q.device, dtype=q.dtype)
    lse = torch.full((b, hq, sq), float("nan"), device=q.device, dtype=torch.float32)
    sm90_fwd(q, k, v, None, causal, (None, None), True, config, out=out, lse=lse)
    torch.cuda.synchronize()
    ref, ref_lse = attention_reference(q, k, v, causal=causal)
    plain, _ = attention_reference(q, k, v, causal=causal, dtype=q.dtype, upcast=False)
    check_against_reference(out, ref, plain, atol=1e-3, what=f"O {what}")
    check_lse(lse, q, k, v, causal, ref_lse, what=f"LSE {what}")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dims", HEAD_DIMS, ids=lambda p: f"d{p[0]}_{p[1]}")
def test_sm90_fwd_matches_float64_reference(sm90_device, head_dims, dtype, causal):
    gen = torch.Generator(device="cuda")
    gen.manual_seed(zlib.crc32(f"{head_dims}{dtype}{causal}".encode()))
    for shape in SHAPES:
        _check_one(shape, head_dims, dtype, causal, gen)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("head_dims", HEAD_DIMS, ids=lambda p: f"d{p[0]}_{p[1]}")
def test_sm90_fwd_without_lse_matches_float64_reference(sm90_device, head_dims, causal):
    """A call that does not ask for LSE runs the default config's ``write_lse=False`` kernel
    (no log, no LSE stores): O within the rule, on persistent (short keys) and one-tile-per-CTA
    shapes, tails and GQA included."""
    from fa_sm100.hopper.interface import sm90_config_for, sm90_fwd
    from fa_sm100.validation import validate_attention_inputs

    gen = torch.Generator(device="cuda")
    gen.manual_seed(zlib.crc32(f"nolse{head_dims}{causal}".encode()))
    d, dv = head_dims
    for b, sq, sk, hq, hk in [(3, 17, 1000, 6, 2), (2, 1000, 17, 4, 1), (1, 4097, 4097, 4, 2)]:
        q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        k = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn(b, sk, hk, dv, device="cuda", dtype=torch.bfloat16, generator=gen)
        problem = validate_attention_inputs(q, k, v, None, causal, (None, None))
        assert not sm90_config_for(problem, None).write_lse
        out = torch.full((b, sq, hq, dv), float("nan"), device="cuda", dtype=torch.bfloat16)
        got = sm90_fwd(q, k, v, causal=causal, out=out)
        torch.cuda.synchronize()
        assert got is out
        ref, _ = attention_reference(q, k, v, causal=causal)
        plain, _ = attention_reference(q, k, v, causal=causal, dtype=torch.bfloat16,
                                       upcast=False)
        check_against_reference(out, ref, plain, atol=1e-3,
                                what=f"O without LSE {(b, sq, sk, hq, hk)} {head_dims} {causal}")


@pytest.mark.gpu
def test_flash_attn_func_dispatches_to_sm90(sm90_device):
    """The public entry point reaches the SM90 kernel and returns (out, lse) on request."""
    from fa_sm100.interface import flash_attn_func

    gen = torch.Generator(device="cuda")
    gen.manual_seed(7)
    q, k, v = (torch.randn(2, 300, 4, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
               for _ in range(3))
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, causal=True)
    plain, _ = attention_reference(q, k, v, causal=True, dtype=torch.bfloat16, upcast=False)
    check_against_reference(out, ref, plain, atol=1e-3, what="O")
    check_lse(lse, q, k, v, True, ref_lse, what="LSE")


@pytest.mark.gpu
@pytest.mark.parametrize("switch", [
    "intra_wg_overlap=false", "pingpong=false", "kv_stage=3", "persistent=true",
    "persistent=true,intra_wg_overlap=false", "num_consumer_wg=3,n_block=64",
    "ex2_emu_fraction=0.25", "persistent=false", "persistent=true,dynamic_schedule=true",
    "persistent=true,dynamic_schedule=false", "k_before_q=true",
    "k_before_q=true,persistent=false", "persistent=true,o_in_q_buffer=true",
    # causal sections of 2 and of 5 (batch, head) pairs: 32 pairs, the last section short
    "l2_section_mib=1", "l2_section_mib=2", "skip_empty_wg=false",
    "persistent=true,wg_epilogue=true", "persistent=true,q_stage=2", "rescale_threshold=0",
    "rescale_threshold=0,intra_wg_overlap=false",
])
def test_sm90_fwd_switches_keep_numerics(sm90_device, switch):
    """Every switch of the config computes the same attention (they change speed only).
    512 work tiles: more than the SMs, so a persistent CTA runs several."""
    from fa_sm100.config import parse_overrides
    from fa_sm100.hopper.config import Sm90FwdConfig, select_sm90_fwd_config
    from fa_sm100.hopper.interface import sm90_fwd

    gen = torch.Generator(device="cuda")
    gen.manual_seed(11)
    for causal in (False, True):
        cfg = select_sm90_fwd_config(128, causal=causal,
                                     **parse_overrides(switch.split(","), Sm90FwdConfig))
        q = torch.randn(4, 2000, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        k, v = (torch.randn(4, 777, 2, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
                for _ in range(2))
        out = sm90_fwd(q, k, v, None, causal, (None, None), False, cfg)
        ref, _ = attention_reference(q, k, v, causal=causal)
        plain, _ = attention_reference(q, k, v, causal=causal, dtype=torch.bfloat16, upcast=False)
        check_against_reference(out, ref, plain, atol=1e-3, what=f"O {switch} causal={causal}")


@pytest.mark.gpu
@pytest.mark.parametrize("switch", ["", "intra_wg_overlap=false", "persistent=false",
                                    "pingpong=false", "persistent=true,dynamic_schedule=false",
                                    "skip_empty_wg=false"])
def test_sm90_fwd_empty_warpgroups_keep_numerics(sm90_device, switch):
    """Note [Empty warpgroups]: the last m block of each head with one or two consumer
    warpgroups past seqlen_q (hdim 64, 192-row tiles: 1000 rows leave 40 in the last block,
    1060 leave 100; hdim 128, 128-row tiles: 1050 leave 26), causal and not, with the
    overlapped and the serial main loop, persistent CTAs (several tiles each, so the skipped
    turns must leave the pipelines and ping-pong barriers in step for the next tile) and one
    tile per CTA; O and LSE poisoned, against float64."""
    from fa_sm100.config import parse_overrides
    from fa_sm100.hopper.config import Sm90FwdConfig, select_sm90_fwd_config

    gen = torch.Generator(device="cuda")
    gen.manual_seed(23)
    changes = parse_overrides([x for x in switch.split(",") if x], Sm90FwdConfig)
    for d, sq in ((64, 1000), (64, 1060), (128, 1050)):
        for causal in (False, True):
            cfg = select_sm90_fwd_config(d, causal=causal, seqlen_q=sq, seqlen_k=1500, **changes)
            assert cfg.skip_empty_wg is ("skip_empty_wg=false" not in switch)
            _check_one((3, sq, 1500, 4, 2), (d, d), torch.bfloat16, causal, gen, config=cfg)


BOUNDARY_SWITCHES = ["wg_epilogue=true", "q_stage=2", "wg_epilogue=true,q_stage=2",
                     "wg_epilogue=true,q_stage=2,dynamic_schedule=false"]
# (head dims, consumer warpgroups, switch); (192, 128) has no room for two Q stages
BOUNDARY_CASES = [(dims, wgs, switch)
                  for dims, wgs in (((64, 64), 2), ((64, 64), 3), ((96, 96), 2), ((128, 128), 2))
                  for switch in BOUNDARY_SWITCHES] + [((192, 128), 2, "wg_epilogue=true")]


@pytest.mark.gpu
@pytest.mark.parametrize("head_dims,wgs,switch", BOUNDARY_CASES,
                         ids=[f"d{d[0]}_{w}wg-{s}" for d, w, s in BOUNDARY_CASES])
def test_sm90_fwd_tile_boundary_switches_match_float64_reference(sm90_device, head_dims, wgs,
                                                                  switch):
    """Note [Warpgroup epilogues] (each consumer warpgroup stores its own rows of O, so the
    warpgroups of a persistent CTA drift apart by up to a tile) and Note [Two Q stages] (the
    next tile's Q lands while this tile's is read): O and LSE, poisoned first, against float64
    over many tiles per CTA, tails of 17 / 1000 / 4097 rows (the last block with one or two
    warpgroups past seqlen_q, which store nothing), seqlen_q > seqlen_k (rows without keys),
    GQA and MQA, causal and not, with the dynamic and the static schedule."""
    from fa_sm100.config import parse_overrides
    from fa_sm100.hopper.config import Sm90FwdConfig, select_sm90_fwd_config

    gen = torch.Generator(device="cuda")
    gen.manual_seed(37 + wgs)
    d, dv = head_dims
    changes = {"wg_epilogue": False, "q_stage": 1,  # the switch alone, not the defaults
               **parse_overrides(switch.split(","), Sm90FwdConfig)}
    for causal in (False, True):
        for shape in ((3, 1000, 1500, 4, 2), (2, 4097, 1000, 4, 1), (8, 17, 17, 2, 2)):
            cfg = select_sm90_fwd_config(d, dv, causal=causal, seqlen_q=shape[1],
                                         seqlen_k=shape[2], num_consumer_wg=wgs,
                                         persistent=True, **changes)
            assert cfg.own_o_buffer
            assert (cfg.wg_epilogue, cfg.q_stage) == (changes["wg_epilogue"], changes["q_stage"])
            _check_one(shape, head_dims, torch.bfloat16, causal, gen, config=cfg)


# (head dims, dtype, further switches): every head-dim pair in both 16-bit types, then the
# serial main loop, one tile per CTA, a threshold of 0.5 (most growths move the max), two
# warpgroups at hdim 64, and hdim 256 with O rescaled after the PV GEMM's wait
RESCALE_CASES = ([(dims, dtype, "") for dims in HEAD_DIMS for dtype in DTYPES]
                 + [((128, 128), torch.bfloat16, s) for s in (
                     "intra_wg_overlap=false", "persistent=false", "rescale_threshold=0.5")]
                 + [((64, 64), torch.bfloat16, "num_consumer_wg=2"),
                    ((256, 256), torch.bfloat16, "rescale_o_before_pv=false")])


@pytest.mark.gpu
@pytest.mark.parametrize("head_dims,dtype,switch", RESCALE_CASES,
                         ids=[f"d{d[0]}_{d[1]}-{str(t)[6:]}-{s or 'default'}"
                              for d, t, s in RESCALE_CASES])
def test_sm90_fwd_rescale_threshold_matches_float64_reference(sm90_device, head_dims, dtype,
                                                             switch):
    """Note [Rescale threshold]: rows whose max jumps by more than the threshold between KV
    tiles (O rescaled), rows whose max creeps (stale max kept, P above 1) and rows whose max
    stays, mixed within every warp (``growing_row_max_inputs``; ``rescale_events`` checks that
    the inputs hold both kinds of step): O and LSE, poisoned first, against float64, causal
    (rows without keys) and not, GQA, tails."""
    from fa_sm100.config import parse_overrides
    from fa_sm100.hopper.config import Sm90FwdConfig, select_sm90_fwd_config

    gen = torch.Generator(device="cuda")
    gen.manual_seed(zlib.crc32(f"rescale{head_dims}{dtype}{switch}".encode()))
    d, dv = head_dims
    changes = {"rescale_threshold": 8.0,
               **parse_overrides([x for x in switch.split(",") if x], Sm90FwdConfig)}
    for causal in (False, True):
        for shape in ((2, 1000, 1000, 4, 2), (1, 1500, 1000, 2, 1)):
            cfg = select_sm90_fwd_config(d, dv, dtype=dtype, causal=causal, seqlen_q=shape[1],
                                         seqlen_k=shape[2], **changes)
            assert cfg.rescale_threshold == changes["rescale_threshold"] > 0
            q, k, v = growing_row_max_inputs(shape, head_dims, dtype, gen, device="cuda")
            moved, kept = rescale_events(q, k, cfg.n_block, causal, cfg.rescale_threshold)
            assert moved > 100 and kept > 100, (moved, kept)
            _check_inputs(q, k, v, causal, cfg,
                          f"{shape} {head_dims} {dtype} causal={causal} {cfg.rescale_threshold}")


@pytest.mark.gpu
@pytest.mark.parametrize("peer_release", [False, True], ids=["dsl_release", "peer_release"])
@pytest.mark.parametrize("cluster", [2, 4])
@pytest.mark.parametrize("head_dims", HEAD_DIMS, ids=lambda p: f"d{p[0]}_{p[1]}")
def test_sm90_fwd_kv_multicast_matches_float64_reference(sm90_device, head_dims, cluster,
                                                         peer_release):
    """Note [K/V multicast]: clusters of 2 or 4 CTAs that multicast their shares of each K/V
    tile compute the same O and LSE (NaN-poisoned first) for every head-dim pair: seqlen_q with
    a ragged last m block, seqlen_k with a ragged last KV tile, fewer keys than one KV tile (one
    key), more K/V tiles than stages, GQA and MQA, several batches; with the DSL's releases and
    with Note [Peer release]'s (lane r of each consumer warp releases on CTA r)."""
    from fa_sm100.hopper.config import select_sm90_fwd_config

    d, dv = head_dims
    cfg = select_sm90_fwd_config(d, dv, causal=False, write_lse=True, kv_multicast=True,
                                 kv_cluster=cluster, persistent=False, peer_release=peer_release)
    assert cfg.kv_multicast and not cfg.persistent and cfg.cluster == (cluster, 1, 1)
    assert cfg.peer_release == peer_release
    gen = torch.Generator(device="cuda")
    gen.manual_seed(zlib.crc32(f"multicast{d}-{cluster}-{peer_release}".encode()))
    m, c = cfg.m_block, cluster
    # (batch, seqlen_q, seqlen_k, heads_q, heads_kv); every seqlen_q gives a whole number of
    # clusters of m blocks
    shapes = [(2, 2 * c * m - 17, 777, 8, 2), (1, c * m, 1, 2, 1), (3, c * m - 1, 4097, 4, 4),
              (1, 4 * c * m, 2 * cfg.n_block, 6, 3)]
    assert all(cfg.num_m_blocks(sq) % cluster == 0 for _, sq, *_ in shapes)
    for shape in shapes:
        _check_one(shape, head_dims, torch.bfloat16, False, gen, config=cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("peer_release", [False, True], ids=["dsl_release", "peer_release"])
@pytest.mark.parametrize("head_dims,boundary",
                         [(hd, False) for hd in HEAD_DIMS]
                         + [((64, 64), True), ((96, 96), True), ((128, 128), True)],
                         ids=lambda p: f"d{p[0]}_{p[1]}" if isinstance(p, tuple) else
                         ("boundary" if p else "plain"))
def test_sm90_fwd_persistent_multicast_matches_float64_reference(sm90_device, head_dims,
                                                                 boundary, peer_release):
    """Note [Persistent multicast]: persistent CTA pairs on the static schedule, multicasting
    their halves of every K/V tile from one work tile to the next, compute the same O and LSE
    (NaN-poisoned first) for every head-dim pair, also with each warpgroup storing its own O
    and two Q stages (``boundary``) and with O staged in Q's buffer (hdim 256): more tiles than
    CTAs (two to four tiles per CTA, uneven between clusters), fewer tiles than CTAs, one key,
    a ragged last m block and KV tile, GQA and MQA."""
    from fa_sm100.hopper.config import select_sm90_fwd_config

    d, dv = head_dims
    extra = {"wg_epilogue": True, "q_stage": 2} if boundary else {}
    cfg = select_sm90_fwd_config(d, dv, causal=False, write_lse=True, kv_multicast=True,
                                 persistent=True, peer_release=peer_release, **extra)
    assert cfg.kv_multicast and cfg.persistent and not cfg.dynamic_schedule
    assert cfg.wg_epilogue == boundary and cfg.q_stage == (2 if boundary else 1)
    assert cfg.peer_release == peer_release
    gen = torch.Generator(device="cuda")
    gen.manual_seed(zlib.crc32(f"persistent-multicast{d}-{boundary}-{peer_release}".encode()))
    m = cfg.m_block
    # (batch, seqlen_q, seqlen_k, heads_q, heads_kv): 512, 288, 2 and 24 tiles on 132 SMs
    shapes = [(8, 4 * m - 5, 1000, 16, 4), (2, 6 * m, 300, 24, 24), (1, 2 * m, 1, 2, 1),
              (3, 2 * m - 1, 4097, 4, 1)]
    assert all(cfg.num_m_blocks(sq) % 2 == 0 for _, sq, *_ in shapes)
    for shape in shapes:
        _check_one(shape, head_dims, torch.bfloat16, False, gen, config=cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("persistent", [False, True], ids=["one_tile", "persistent"])
@pytest.mark.parametrize("head_dims", HEAD_DIMS, ids=lambda p: f"d{p[0]}_{p[1]}")
def test_sm90_fwd_odd_m_block_multicast_matches_float64_reference(sm90_device, head_dims,
                                                                  persistent):
    """Note [Odd m blocks]: with an odd number of m blocks per head, clusters of 2 share K/V
    over the even part and pair the last m blocks of two (batch, head) pairs, which load their
    own K/V, and compute the same O and LSE (NaN-poisoned first) for every head-dim pair: one m
    block per head (no shared tile at all), three to nine, more tiles than SMs (persistent CTAs
    go from shared tiles to own loads), a ragged last m block and KV tile, one key, GQA (the two
    heads of a pair may read one K/V head or two) and MQA."""
    from fa_sm100.hopper.config import select_sm90_fwd_config

    d, dv = head_dims
    cfg = select_sm90_fwd_config(d, dv, causal=False, write_lse=True, kv_multicast=True,
                                 persistent=persistent)
    assert cfg.odd_m_pairs and cfg.persistent == persistent and cfg.cluster == (2, 1, 1)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(zlib.crc32(f"odd-m{d}-{persistent}".encode()))
    m = cfg.m_block
    # (batch, seqlen_q, seqlen_k, heads_q, heads_kv): 48, 2, 60, 1152 and 36 tiles
    shapes = [(2, 3 * m - 5, 1000, 8, 2), (1, 1, 777, 2, 1), (3, 5 * m, 4097, 4, 4),
              (8, 9 * m - 1, 300, 16, 4), (2, 2 * m + 1, 1, 6, 1)]
    assert all(cfg.num_m_blocks(sq) % 2 == 1 and cfg.multicast_fits(sq, b * h)
               for b, sq, _, h, _ in shapes)
    for shape in shapes:
        _check_one(shape, head_dims, torch.bfloat16, False, gen, config=cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_sm90_fwd_dynamic_schedule_counter_and_numerics(sm90_device, head_dim):
    """Note [Dynamic tile schedule]: every launch processes each work tile once (O, NaN-poisoned
    first, meets the rule everywhere; LSE too) and leaves the tile counter at 0, so the next
    launch, with another tile count, starts right. Causal problems of 1 to ~1000 tiles, fewer
    and more tiles than SMs, tails, GQA, seqlen_q > seqlen_k (rows with no key). hdim 256
    stages O in Q's buffer (Note [O in Q's buffer])."""
    from fa_sm100.hopper.config import select_sm90_fwd_config
    from fa_sm100.hopper.interface import sm90_fwd, tile_counter

    gen = torch.Generator(device="cuda")
    gen.manual_seed(zlib.crc32(f"dynamic{head_dim}".encode()))
    counter = tile_counter(torch.device("cuda"))
    shapes = [(8, 2048, 2048, 8, 2), (1, 100, 100, 1, 1), (3, 1000, 777, 6, 3),
              (2, 4097, 4097, 4, 4), (1, 300, 1, 2, 1)]
    for b, sq, sk, hq, hk in shapes:
        cfg = select_sm90_fwd_config(head_dim, causal=True, seqlen_k=sk, persistent=True,
                                     dynamic_schedule=True)
        q = torch.randn(b, sq, hq, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        k, v = (torch.randn(b, sk, hk, head_dim, device="cuda", dtype=torch.bfloat16,
                            generator=gen) for _ in range(2))
        ref, ref_lse = attention_reference(q, k, v, causal=True)
        plain, _ = attention_reference(q, k, v, causal=True, dtype=torch.bfloat16, upcast=False)
        what = f"dynamic schedule {(b, sq, sk, hq, hk)} hdim {head_dim}"
        for _ in range(2):  # the second launch reuses what the first left in the counter
            out = torch.full((b, sq, hq, head_dim), float("nan"), device="cuda",
                             dtype=torch.bfloat16)
            lse = torch.full((b, hq, sq), float("nan"), device="cuda", dtype=torch.float32)
            sm90_fwd(q, k, v, None, True, (None, None), True,
                     cfg.replace(write_lse=True), out=out, lse=lse)
            torch.cuda.synchronize()
            assert int(counter.item()) == 0, f"tile counter left at {int(counter.item())}"
            check_against_reference(out, ref, plain, atol=1e-3, what="O " + what)
            check_lse(lse, q, k, v, True, ref_lse, what="LSE " + what)
