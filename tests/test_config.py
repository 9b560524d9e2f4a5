"""Contract: FmhaConfig / WarpRoles reject every invalid setting with a ValueError that names
the rule, and select_config picks the reference design's defaults."""

import pytest

from fa_sm100.config import (
    FmhaConfig,
    WarpRoles,
    config_from_overrides,
    default_split_p_col,
    launch_registers,
    normalize_dtype,
    parse_overrides,
    select_config,
)


def test_the_dataclass_defaults_are_what_select_config_picks():
    """``FmhaConfig()`` (what the tools and tests build without a problem) is the config
    ``select_config`` derives for its problem: a long query sequence takes two Q stages, hence
    2-CTA, as many K/V stages as SMEM holds and the 3/4 split-P column. A default typed into
    the dataclass that the rules no longer give (a K/V stage count after the SMEM plan grew)
    fails here."""
    cfg = select_config(head_dim=128, dtype="bf16", seqlen_q=8192)
    assert cfg == FmhaConfig().validate()
    assert cfg.q_stage == 2 and cfg.use_2cta  # two Q tiles per CTA to ping-pong


def test_one_cta_takes_three_kv_stages():
    assert select_config(head_dim=128, use_2cta=False).kv_stage == 3


def test_short_queries_take_one_q_stage_and_one_cta():
    cfg = select_config(head_dim=128, seqlen_q=100)
    assert cfg.q_stage == 1 and not cfg.use_2cta


@pytest.mark.parametrize("n_block,col", [(128, 96), (256, 192), (64, 32)])
def test_split_p_column_is_three_quarters_rounded_to_32(n_block, col):
    assert default_split_p_col(n_block) == col


def test_split_p_column_needs_room():
    with pytest.raises(ValueError, match="too small to split P"):
        default_split_p_col(32)


BAD = [
    (dict(dtype="float32"), "dtype"),
    (dict(head_dim=80, head_dim_v=80), "head dims"),
    (dict(head_dim=192, head_dim_v=192), "head dims"),
    (dict(m_block=64), "m_block"),
    (dict(n_block=64), "n_block"),
    (dict(q_stage=3), "q_stage"),
    (dict(kv_stage=0), "kv_stage=0: must be at least 1"),
    (dict(kv_stage=1), "2-CTA needs at least 2 K/V stages"),
    (dict(split_p_col=100), "split_p_col"),
    (dict(split_p_col=128), "split_p_col"),
    (dict(ex2_emu_fraction=1.5), "ex2_emu_fraction"),
    (dict(ex2_emu_fraction=-0.1), "ex2_emu_fraction"),
    (dict(rescale_threshold=-1.0), "rescale_threshold"),
    (dict(rescale_threshold=float("nan")), "rescale_threshold"),
    # P may reach 2^threshold: float16 holds at most 2^15
    (dict(rescale_threshold=16.0, dtype="float16"), "float16 holds at most 2\\^15"),
    (dict(qhead_per_kvhead=0), "qhead_per_kvhead"),
    (dict(window_left=1.5), "window_left"),
    (dict(window_right=True), "window_right"),
    (dict(num_sms=0), "num_sms"),
    (dict(kv_stage=7), "SMEM budget"),
]


@pytest.mark.parametrize("change,message", BAD, ids=[m for _, m in BAD])
def test_validate_names_the_rule(change, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        FmhaConfig().replace(**change).validate()


def test_split_p_off_ignores_the_column():
    FmhaConfig(split_p=False, split_p_col=100).validate()


def test_every_supported_head_dim_fits_in_both_cta_modes():
    for hd, hv in ((64, 64), (96, 96), (128, 128), (192, 128)):
        for two in (True, False):
            cfg = select_config(hd, hv, use_2cta=two)
            assert cfg.kv_stage >= (2 if two else 1)


ROLE_BAD = [
    (dict(empty=14), "cover warps 0..15 exactly once"),
    (dict(softmax1=(4, 5, 6, 8), correction=(7, 9, 10, 11)), "aligned warpgroup"),
    (dict(softmax1=(5, 6, 7, 4)), "aligned warpgroup"),
    (dict(mma=12, load=15, empty=14, epilogue=11, correction=(8, 9, 10, 13)), "aligned warpgroup"),
    (dict(regs_softmax=196), "multiple of 8"),
    (dict(regs_other=16), "multiple of 8 in \\[24, 256\\]"),
    (dict(regs_softmax=240, regs_correction=80, regs_other=48),
     "exceeds the 65536 registers a CTA of 512 threads launches with"),
]


@pytest.mark.parametrize("change,message", ROLE_BAD, ids=[m for _, m in ROLE_BAD])
def test_warp_roles_validate_names_the_rule(change, message):
    with pytest.raises(ValueError, match=message):
        WarpRoles(**change).validate()


def test_default_warp_roles_fill_the_register_file_and_map_every_warp():
    roles = WarpRoles().validate()
    pool = roles.threads_per_cta * launch_registers(roles.threads_per_cta)
    assert roles.registers_used() <= pool == 64 * 1024
    assert roles.threads_per_cta == 512
    # role_of_warp inverts role_warps: each of the 16 warps has the one role that lists it
    for role, warps in roles.role_warps().items():
        for w in warps:
            assert roles.role_of_warp(w) == role, (w, role)
    with pytest.raises(ValueError, match="no role"):
        roles.role_of_warp(16)


def test_parse_overrides_types_values_and_rejects_unknown_fields():
    got = parse_overrides(["use_2cta=false", "kv_stage=3", "ex2_emu_fraction=0", "dtype=fp16",
                           "window_left=none"])
    assert got == dict(use_2cta=False, kv_stage=3, ex2_emu_fraction=0.0, dtype="float16",
                       window_left=None)
    assert isinstance(got["ex2_emu_fraction"], float)
    with pytest.raises(ValueError, match="no field 'kv_stages'"):
        parse_overrides(["kv_stages=3"])
    with pytest.raises(ValueError, match="expected field=value"):
        parse_overrides(["use_2cta"])
    with pytest.raises(ValueError, match="not a boolean"):
        parse_overrides(["split_p=maybe"])


def test_config_from_overrides_rederives_kv_stage():
    assert config_from_overrides(["use_2cta=false"]).kv_stage == 3
    assert config_from_overrides(["head_dim=192"]).head_dim_v == 128
    assert config_from_overrides(["kv_stage=4"]).kv_stage == 4


@pytest.mark.parametrize("name", ["bf16", "torch.bfloat16", "BFloat16", "fp16", "float16"])
def test_normalize_dtype(name):
    assert normalize_dtype(name) in ("bfloat16", "float16")


def test_normalize_dtype_rejects_fp32():
    with pytest.raises(ValueError, match="not supported"):
        normalize_dtype("float32")
