"""CPU tests of the SM90 forward config (issue 6 item 1): validate() names the violated rule,
the per-problem defaults are valid, and sm90_fwd checks a given config against its inputs."""

import pytest
import torch

from fa_sm100.config import launch_registers
from fa_sm100.hopper.config import (
    MULTICAST_MIN_SEQLEN_K,
    SM90_HEAD_DIMS,
    SM90_SMEM_BUDGET,
    TILE_BOUNDARY_MAX_SEQLEN_K,
    Sm90FwdConfig,
    select_sm90_fwd_config,
    sm90_fwd_config_from_overrides,
)
from fa_sm100.hopper.interface import sm90_config_for, sm90_fwd
from fa_sm100.softmax_math import P_MAX_LOG2
from fa_sm100.validation import validate_attention_inputs
from script_loader import load_script


@pytest.mark.parametrize("dims", SM90_HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_defaults_are_valid_and_fit(dims, causal):
    cfg = select_sm90_fwd_config(*dims, causal=causal)
    assert cfg.validate() is cfg
    assert cfg.smem_bytes() <= SM90_SMEM_BUDGET
    # exactly the pool a CTA launches with (384 threads x 168, 512 x 128): no register is idle
    assert cfg.registers_used() == cfg.num_threads * launch_registers(cfg.num_threads)
    assert cfg.m_block == 64 * cfg.num_consumer_wg
    # which switches each problem gets (ping-pong, the rescale threshold, ...) is the tuning
    # table's (docs/tuning.md) and the golden snapshot's (tests/test_fwd_defaults_golden.py)


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"head_dim": 80, "head_dim_v": 80}, "not supported on SM90"),
        ({"dtype": "float32"}, "dtype"),
        ({"num_consumer_wg": 4, "m_block": 256}, "num_consumer_wg"),
        ({"m_block": 192}, "m_block"),
        ({"n_block": 120}, "multiple of 16"),
        ({"n_block": 272}, "multiple of 16"),
        ({"kv_stage": 1}, "at least 2 stages"),
        ({"kv_stage": 0, "intra_wg_overlap": False}, "at least 1"),
        ({"regs_consumer": 250}, "multiple of 8"),
        ({"regs_consumer": 256, "regs_producer": 64}, "register budget"),
        # 65536 registers, but 384 threads launch with 168 each: setmaxnreg.inc would hang
        ({"regs_producer": 32}, "exceeds the 64512 registers a CTA of 384 threads .*hang"),
        ({"kv_stage": 8}, "SMEM"),
        ({"rescale_o_before_pv": True, "intra_wg_overlap": False}, "needs intra_wg_overlap"),
        ({"l2_section_mib": 0}, "l2_section_mib"),
        ({"l2_section_mib": 2048}, "32-bit"),
        ({"q_stage": 3, "persistent": True}, "q_stage=3: must be 1 or 2"),
        ({"q_stage": 2}, "q_stage=2 needs persistent=True"),
        ({"q_stage": 2, "persistent": True, "o_in_q_buffer": True},
         "q_stage=2 needs persistent=True and o_in_q_buffer=False"),
        ({"q_stage": 2, "persistent": True, "head_dim": 192, "n_block": 112}, "SMEM"),
        ({"wg_epilogue": True}, "wg_epilogue=True needs persistent=True"),
        ({"wg_epilogue": True, "persistent": True, "o_in_q_buffer": True},
         "wg_epilogue=True needs persistent=True and o_in_q_buffer=False"),
        ({"rescale_threshold": -1.0}, "must be >= 0"),
        ({"rescale_threshold": float("nan")}, "must be >= 0"),
        ({"rescale_threshold": 16.0, "dtype": "float16"}, "float16 holds at most 2\\^15"),
        ({"rescale_threshold": 128.0}, "bfloat16 holds at most 2\\^127"),
    ],
)
def test_validate_names_the_rule(changes, match):
    with pytest.raises(ValueError, match=match):
        Sm90FwdConfig().replace(**changes).validate()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_rescale_threshold_up_to_what_p_can_hold(dtype):
    """P may reach 2^threshold (Note [Rescale threshold]): validate() takes the threshold up
    to ``P_MAX_LOG2`` of the P type (the largest power of two it holds, checked against the
    float formats in tests/test_softmax_math.py) and refuses one beyond it."""
    top = P_MAX_LOG2[dtype]
    assert Sm90FwdConfig(dtype=dtype, rescale_threshold=top).validate()
    with pytest.raises(ValueError, match=f"{dtype} holds at most"):
        Sm90FwdConfig(dtype=dtype, rescale_threshold=top + 0.5).validate()


def test_overrides_parse_like_the_cli():
    cfg = sm90_fwd_config_from_overrides(["head_dim=256", "causal=true", "kv_stage=2"])
    assert (cfg.head_dim, cfg.head_dim_v, cfg.causal, cfg.n_block) == (256, 256, True, 80)
    cfg = sm90_fwd_config_from_overrides(["head_dim=192"])
    assert (cfg.head_dim, cfg.head_dim_v) == (192, 128)
    assert select_sm90_fwd_config(192).head_dim_v == 128  # default_head_dim_v
    cfg = sm90_fwd_config_from_overrides(["pingpong=false", "intra_wg_overlap=off"])
    assert not cfg.pingpong and not cfg.intra_wg_overlap
    with pytest.raises(ValueError, match="no field"):
        sm90_fwd_config_from_overrides(["use_2cta=true"])  # an SM100 switch


def test_given_config_must_match_the_inputs():
    q, k, v = (torch.randn(1, 16, 2, 128, dtype=torch.bfloat16) for _ in range(3))
    prob = validate_attention_inputs(q, k, v, causal=True, require_cuda=False)
    assert sm90_config_for(prob, None).causal
    with pytest.raises(ValueError, match="causal"):
        sm90_config_for(prob, select_sm90_fwd_config(128, causal=False))
    with pytest.raises(ValueError, match="head_dim"):
        sm90_config_for(prob, select_sm90_fwd_config(64, causal=True))
    with pytest.raises(ValueError, match="Sm90FwdConfig"):
        sm90_config_for(prob, object())


def test_config_without_lse_is_rejected_when_lse_is_needed():
    """A config with write_lse=False leaves the LSE buffer unwritten: asking for LSE with it
    (return_lse, an lse buffer, or autograd, whose backward reads LSE) is a ValueError."""
    q, k, v = (torch.randn(1, 16, 2, 128, dtype=torch.bfloat16) for _ in range(3))
    prob = validate_attention_inputs(q, k, v, require_cuda=False)
    no_lse = select_sm90_fwd_config(128, write_lse=False)
    with pytest.raises(ValueError, match="write_lse=False"):
        sm90_config_for(prob, no_lse, need_lse=True)
    assert sm90_config_for(prob, no_lse, need_lse=False) is no_lse
    assert sm90_config_for(prob, None, need_lse=True).write_lse
    # the default writes LSE only when it is read (as the SM100 path and FA4)
    assert not sm90_config_for(prob, None, need_lse=False).write_lse


def test_sm90_fwd_asks_for_lse_when_it_returns_or_fills_lse():
    """The wiring in sm90_fwd: return_lse=True or an lse buffer means LSE is needed. Fake CUDA
    tensors (no GPU, no data) get past the device-type check; the config check comes before
    the device is queried."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    no_lse = select_sm90_fwd_config(128, write_lse=False)
    with FakeTensorMode():
        q, k, v = (torch.empty(1, 16, 2, 128, dtype=torch.bfloat16, device="cuda")
                   for _ in range(3))
        with pytest.raises(ValueError, match="write_lse=False"):
            sm90_fwd(q, k, v, return_lse=True, config=no_lse)
        lse = torch.empty(1, 2, 16, dtype=torch.float32, device="cuda")
        with pytest.raises(ValueError, match="write_lse=False"):
            sm90_fwd(q, k, v, config=no_lse, lse=lse)


def test_sm90_fwd_rejects_before_launch():
    q, k, v = (torch.randn(1, 16, 2, 128, dtype=torch.bfloat16) for _ in range(3))
    with pytest.raises(ValueError, match="CUDA"):
        sm90_fwd(q, k, v)
    with pytest.raises(ValueError, match="head dims"):
        sm90_fwd(*(torch.randn(1, 16, 2, 80, dtype=torch.bfloat16) for _ in range(3)))


def test_seqlen_hints_pick_the_measured_schedule():
    """Persistent CTAs with the dynamic schedule (where a separate O buffer fits in SMEM):
    causal problems at every length; non-causal 128-row tiles (hdim 96, 128) at every length,
    hdim 64 up to 8k and (192, 128) up to 2k keys; one tile per CTA otherwise (without seqlen_q:
    no multicast pairs). Short causal hdim-64 rows: 128-row tiles."""
    for head_dim, longest in ((64, 8192), (192, 2048), (256, 1024)):
        assert select_sm90_fwd_config(head_dim, seqlen_k=longest).persistent
        assert not select_sm90_fwd_config(head_dim, seqlen_k=2 * longest).persistent
        assert not select_sm90_fwd_config(head_dim).persistent  # no length: no hint
    for head_dim in (96, 128):
        for seqlen_k in (None, 1024, 16384):
            cfg = select_sm90_fwd_config(head_dim, seqlen_k=seqlen_k)
            assert cfg.persistent and cfg.dynamic_schedule, (head_dim, seqlen_k)
    # O in its own SMEM buffer where it fits, else in Q's (Note [O in Q's buffer])
    assert not select_sm90_fwd_config(128, causal=True).o_in_q_buffer
    for causal in (False, True):
        wide = select_sm90_fwd_config(256, causal=causal, seqlen_k=1024)
        assert wide.persistent and wide.dynamic_schedule and wide.o_in_q_buffer, wide
    for head_dim in (64, 96, 128, 192, 256):
        for seqlen_k in (None, 1024, 16384):
            cfg = select_sm90_fwd_config(head_dim, causal=True, seqlen_k=seqlen_k)
            assert cfg.persistent and cfg.dynamic_schedule, (head_dim, seqlen_k)
            assert cfg.o_in_q_buffer == (head_dim == 256)  # own O buffer: 288 KiB at hdim 256
    # overriding persistence alone takes the dynamic schedule with it; both may be set
    assert not select_sm90_fwd_config(128, causal=True, persistent=False).dynamic_schedule
    static = select_sm90_fwd_config(128, causal=True, persistent=True, dynamic_schedule=False)
    assert static.persistent and not static.dynamic_schedule
    with pytest.raises(ValueError, match="dynamic_schedule=True needs persistent=True"):
        select_sm90_fwd_config(128, causal=True, persistent=False, dynamic_schedule=True)
    # the schedule is picked after the other overrides: 3 K/V stages leave no room for the
    # separate O buffer, so O is staged in Q's (which any config that fits at all can do)
    deep = select_sm90_fwd_config(128, causal=True, kv_stage=3)
    assert (deep.kv_stage, deep.persistent, deep.o_in_q_buffer) == (3, True, True)
    with pytest.raises(ValueError, match="o_in_q_buffer=True needs persistent=True"):
        select_sm90_fwd_config(128, persistent=False, o_in_q_buffer=True)
    causal64 = select_sm90_fwd_config(64, causal=True, seqlen_k=1024)
    assert (causal64.num_consumer_wg, causal64.m_block, causal64.regs_consumer) == (2, 128, 240)
    assert select_sm90_fwd_config(64, causal=True, seqlen_k=4096).num_consumer_wg == 3
    assert select_sm90_fwd_config(64, causal=False, seqlen_k=1024).num_consumer_wg == 3
    # explicit overrides win over the hints
    assert not select_sm90_fwd_config(128, seqlen_k=1024, persistent=False).persistent


def test_kv_multicast_rules_and_default():
    """Note [K/V multicast]: only non-causal kernels, one tile per CTA or persistent pairs on
    the static schedule (Note [Persistent multicast]; ValueError otherwise); the default turns
    it on for non-causal problems from MULTICAST_MIN_SEQLEN_K keys on whose seqlen_q gives an
    even number of m blocks (or an odd one and an even number of (batch, head) pairs, Note [Odd
    m blocks]), and then runs the pairs persistent on the static schedule; never without
    seqlen_q, for causal problems, or when persistence alone is asked for."""

    with pytest.raises(ValueError, match="causal=False"):
        select_sm90_fwd_config(128, causal=True, kv_multicast=True)
    with pytest.raises(ValueError, match="dynamic_schedule=False"):
        select_sm90_fwd_config(128, kv_multicast=True, persistent=True, dynamic_schedule=True)
    with pytest.raises(ValueError, match="clusters of 2"):
        select_sm90_fwd_config(128, kv_multicast=True, persistent=True, kv_cluster=4)
    # Note [Persistent multicast]: pairs are persistent on the static schedule by default
    explicit = select_sm90_fwd_config(128, kv_multicast=True)
    assert explicit.kv_multicast and explicit.persistent and not explicit.dynamic_schedule
    assert explicit.cluster == (2, 1, 1) and explicit.own_o_buffer
    one = select_sm90_fwd_config(128, kv_multicast=True, persistent=False)
    assert one.kv_multicast and not one.persistent and one.cluster == (2, 1, 1)
    fours = select_sm90_fwd_config(128, kv_multicast=True, kv_cluster=4)
    assert fours.cluster == (4, 1, 1) and not fours.persistent  # clusters of 4: one tile each
    assert select_sm90_fwd_config(256, kv_multicast=True).o_in_q_buffer
    assert select_sm90_fwd_config(128).cluster == (1, 1, 1)
    for head_dim, shortest in MULTICAST_MIN_SEQLEN_K.items():
        m = select_sm90_fwd_config(head_dim).m_block
        even_q = 2 * m * (shortest // (2 * m) + 1)
        on = select_sm90_fwd_config(head_dim, seqlen_k=shortest, seqlen_q=even_q)
        assert on.kv_multicast and on.persistent and not on.dynamic_schedule, head_dim
        # the tile-boundary switches follow their own rule (up to TILE_BOUNDARY_MAX_SEQLEN_K)
        assert on.wg_epilogue == (on.own_o_buffer and shortest <= TILE_BOUNDARY_MAX_SEQLEN_K)
        # an odd number of m blocks: with an even number of (batch, head) pairs, or no count
        odd = dict(seqlen_k=shortest, seqlen_q=even_q - m)
        odd_on = select_sm90_fwd_config(head_dim, batch_heads=64, **odd)
        assert odd_on.kv_multicast and odd_on.odd_m_pairs, head_dim
        assert not on.multicast_odd_m  # Note [Odd m blocks]: on only for an odd count
        for off in (dict(seqlen_k=shortest // 2, seqlen_q=even_q),
                    dict(odd, batch_heads=63), odd, dict(odd, batch_heads=64, multicast_odd_m=False),
                    dict(seqlen_k=shortest),  # no seqlen_q
                    dict(seqlen_k=shortest, seqlen_q=even_q, causal=True),
                    dict(seqlen_k=shortest, seqlen_q=even_q, persistent=True),
                    dict(seqlen_k=shortest, seqlen_q=even_q, kv_multicast=False)):
            assert not select_sm90_fwd_config(head_dim, **off).kv_multicast, (head_dim, off)
    for head_dim in (96, 192):  # not measured: no multicast
        assert not select_sm90_fwd_config(head_dim, seqlen_k=16384, seqlen_q=16384).kv_multicast


def test_kv_multicast_needs_clusters_of_m_blocks_or_pairs_of_heads():
    """A given multicast config groups the CTAs of m blocks 2c and 2c+1 of a head (or four
    blocks with kv_cluster=4). A count that does not divide would group blocks of two heads
    (different K/V); with clusters of 2 and ``multicast_odd_m`` an odd count is fine when the
    (batch, head) pairs are even in number, whose last m blocks then pair up (Note [Odd m
    blocks]). Anything else: ValueError before any launch."""
    cfg = select_sm90_fwd_config(128, kv_multicast=True)  # persistent pairs
    no_odd = select_sm90_fwd_config(128, kv_multicast=True, multicast_odd_m=False)
    cfg4 = select_sm90_fwd_config(128, kv_multicast=True, kv_cluster=4)  # four-block groups
    assert cfg.odd_m_pairs and not no_odd.odd_m_pairs and not cfg4.odd_m_pairs
    # (config, seqlen_q, batch, heads, fits): 128-row m blocks
    cases = [(cfg, 256, 1, 2, True), (cfg, 255, 1, 3, True), (cfg, 129, 1, 1, True),
             (cfg, 257, 1, 2, True), (cfg, 1, 2, 3, True), (cfg, 4097, 3, 2, True),
             (cfg, 257, 1, 3, False), (cfg, 1, 3, 1, False), (cfg, 4097, 3, 1, False),
             (no_odd, 256, 1, 2, True), (no_odd, 257, 1, 2, False), (no_odd, 1, 2, 2, False),
             (cfg4, 512, 1, 2, True), (cfg4, 385, 1, 3, True), (cfg4, 256, 1, 2, False),
             (cfg4, 513, 1, 2, False)]
    for config, seqlen_q, batch, heads, ok in cases:
        assert config.multicast_fits(seqlen_q, batch * heads) == ok, (seqlen_q, batch, heads)
        q = torch.randn(batch, seqlen_q, heads, 128, dtype=torch.bfloat16)
        k, v = (torch.randn(batch, 300, heads, 128, dtype=torch.bfloat16) for _ in range(2))
        prob = validate_attention_inputs(q, k, v, require_cuda=False)
        if ok:
            assert sm90_config_for(prob, config) is config
        else:
            with pytest.raises(ValueError, match=f"in clusters of {config.kv_cluster}.*"
                                                 f"{batch * heads} \\(batch, head\\) pairs"):
                sm90_config_for(prob, config)
    # without the pair count an odd number of m blocks does not fit
    assert not cfg.multicast_fits(257) and cfg.multicast_fits(256)
    # the default multicasts where the problem fits, and otherwise simply does not
    k, v = (torch.randn(1, MULTICAST_MIN_SEQLEN_K[128], 2, 128, dtype=torch.bfloat16)
            for _ in range(2))
    for seqlen_q, heads, multicast in ((256, 2, True), (257, 2, True), (257, 1, False)):
        q = torch.randn(1, seqlen_q, heads, 128, dtype=torch.bfloat16)
        prob = validate_attention_inputs(q, k[:, :, :heads], v[:, :, :heads], require_cuda=False)
        assert sm90_config_for(prob, None).kv_multicast == multicast, (seqlen_q, heads)


def test_empty_warpgroups_are_skipped_by_default_only_where_there_is_one():
    """Note [Empty warpgroups]: ``skip_empty_wg`` is on by default when the last m block leaves
    a consumer warpgroup's 64 rows past seqlen_q (hdim 64's 192-row tiles at every power of
    two; ragged lengths), or when seqlen_q is not given; off where no warpgroup is empty (the
    branch measured slower there); an override is kept."""
    for d, causal, sq, on in ((64, False, 1024, True), (64, False, 16384, True),
                              (64, True, 1024, False),  # short causal: 128-row tiles
                              (64, True, 2048, True), (128, False, 4096, False),
                              (128, False, 1050, True), (128, True, 1000, False),
                              (256, True, 16384, False), (96, False, 256, False),
                              (96, False, 129, True), (96, False, 200, False),
                              (128, False, None, True)):
        cfg = select_sm90_fwd_config(d, causal=causal, seqlen_q=sq,
                                     seqlen_k=sq)
        assert cfg.skip_empty_wg is on, (d, causal, sq)
        if sq is not None:
            assert cfg.has_empty_wg(sq) is on
            want = (-sq) % cfg.m_block >= 64
            assert want is on
        assert select_sm90_fwd_config(d, causal=causal, seqlen_q=sq,
                                      skip_empty_wg=not on).skip_empty_wg is not on


def test_tile_boundary_switches_by_default_where_measured_and_where_they_fit():
    """Note [Warpgroup epilogues] and Note [Two Q stages]: both on for persistent CTAs with O's
    own buffer up to TILE_BOUNDARY_MAX_SEQLEN_K keys where two Q stages fit (hdim 64, 96,
    128); off beyond it, without a length, with O in Q's buffer (hdim 256), where two Q stages
    do not fit ((192, 128)) and for one tile per CTA; each may be set on its own."""
    from fa_sm100.hopper.config import SM90_SMEM_BUDGET, TILE_BOUNDARY_MAX_SEQLEN_K

    both = lambda cfg: (cfg.wg_epilogue, cfg.q_stage)  # noqa: E731
    for head_dim in (64, 96, 128):
        for causal in (False, True):
            for seqlen_k in (1024, TILE_BOUNDARY_MAX_SEQLEN_K):
                cfg = select_sm90_fwd_config(head_dim, causal=causal, seqlen_k=seqlen_k,
                                             seqlen_q=seqlen_k)
                want = (True, 2) if cfg.persistent else (False, 1)
                assert both(cfg) == want, (head_dim, causal, seqlen_k, cfg)
                assert cfg.smem_bytes() <= SM90_SMEM_BUDGET
            longer = select_sm90_fwd_config(head_dim, causal=causal, seqlen_q=16384,
                                            seqlen_k=2 * TILE_BOUNDARY_MAX_SEQLEN_K)
            assert both(longer) == (False, 1)
        assert both(select_sm90_fwd_config(head_dim, causal=True)) == (False, 1)  # no length
    # hdim 64 causal 1k, the cell that gained most: persistent, both on
    short = select_sm90_fwd_config(64, causal=True, seqlen_k=1024, seqlen_q=1024)
    assert short.persistent and both(short) == (True, 2)
    for head_dim in (192, 256):  # no room for two Q stages; hdim 256 stages O in Q's buffer
        cfg = select_sm90_fwd_config(head_dim, causal=True, seqlen_k=1024, seqlen_q=1024)
        assert cfg.persistent and both(cfg) == (False, 1), cfg
    assert select_sm90_fwd_config(256, causal=True, seqlen_k=1024).o_in_q_buffer
    # one tile per CTA (given, non-causal hdim 64 beyond 8k without multicast pairs, K/V
    # multicast in clusters of 4): neither
    for cfg in (select_sm90_fwd_config(128, causal=True, seqlen_k=1024, persistent=False),
                select_sm90_fwd_config(64, seqlen_k=16384, seqlen_q=16384 - 192),
                select_sm90_fwd_config(128, seqlen_k=8192, seqlen_q=8192, kv_cluster=4)):
        assert not cfg.persistent and both(cfg) == (False, 1), cfg
    # persistent multicast pairs (Note [Persistent multicast]) take both up to 8k keys
    pairs = select_sm90_fwd_config(128, seqlen_k=8192, seqlen_q=8192)
    assert pairs.kv_multicast and pairs.persistent and both(pairs) == (True, 2)
    # each alone, by override
    assert both(select_sm90_fwd_config(128, causal=True, seqlen_k=1024, q_stage=1)) == (True, 1)
    assert both(select_sm90_fwd_config(128, causal=True, seqlen_k=1024,
                                       wg_epilogue=False)) == (False, 2)
    assert both(select_sm90_fwd_config(192, 128, causal=True, seqlen_k=1024,
                                       wg_epilogue=True)) == (True, 1)


def test_fwd_memcheck_cases_fit_their_configs():
    """``scripts/sm90_memcheck.py`` (run under compute-sanitizer on the GPU): every forward
    case's config validates and takes its problem (no ValueError on the GPU), and between them
    the multicast cases cover clusters of 2 and 4, one tile per CTA and persistent pairs, and an
    odd number of m blocks paired across heads (Note [Odd m blocks]) both ways."""
    mod = load_script("sm90_memcheck")
    kinds = set()
    for b, sq, sk, h, hk, d, dv, causal, schedule in mod.CASES:
        cfg = select_sm90_fwd_config(d, dv, "bfloat16", causal, **mod.SCHEDULES[schedule])
        q = torch.randn(b, sq, h, d, dtype=torch.bfloat16)
        k = torch.randn(b, sk, hk, d, dtype=torch.bfloat16)
        v = torch.randn(b, sk, hk, dv, dtype=torch.bfloat16)
        prob = validate_attention_inputs(q, k, v, causal=causal, require_cuda=False)
        assert sm90_config_for(prob, cfg) is cfg
        if cfg.kv_multicast:
            odd = cfg.num_m_blocks(sq) % cfg.kv_cluster != 0
            kinds.add((cfg.kv_cluster, cfg.persistent, odd))
    assert kinds == {(2, False, False), (4, False, False), (2, True, False), (2, False, True),
                     (2, True, True)}, kinds
