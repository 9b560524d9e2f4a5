"""PTX contract of our pipeline classes (sm_100a cross-compiles of a tiny probe kernel).

The reference implementation's ``producer_commit`` on a thread-arrive pipeline went through
the TMA-load arrive (arrive + expect-tx), a known defect. These tests compile a probe kernel
that performs one pipeline call and check the exact signalling instructions it generates.
"""

import pytest

from fa_sm100.config import FmhaConfig

pytest.importorskip("cutlass")

CFG_2CTA = FmhaConfig()
CFG_1CTA = FmhaConfig(use_2cta=False, kv_stage=3)


def signals(cfg, calls):
    from fa_sm100.compile_tools import cross_compile
    from pipelines.probe import make_probe, signal_instructions

    fn, args = make_probe(cfg, calls)
    art = cross_compile(fn, args, "sm_100a")
    return signal_instructions(art.ptx), art.ptx


@pytest.mark.parametrize("cfg", [CFG_2CTA, CFG_1CTA], ids=["2cta", "1cta"])
def test_thread_pipeline_commit_is_a_plain_arrive(cfg):
    """p_lastsplit (threads -> UMMA) producer_commit: one mbarrier.arrive, no expect-tx;
    under 2-CTA it is a remote arrive on the leader CTA's barrier (shared::cluster)."""
    sig, ptx = signals(cfg, [("p_lastsplit", "producer_commit", "softmax0")])
    assert len(sig) == 1, sig
    assert sig[0].startswith("mbarrier.arrive")
    assert "expect_tx" not in sig[0] and "expect_tx" not in ptx
    if cfg.use_2cta:
        assert sig[0] == "mbarrier.arrive.shared::cluster.b64"
        assert "mapa.shared::cluster" in ptx
    else:
        assert sig[0] == "mbarrier.arrive.shared.b64"


def test_threads_threads_commit_and_release_are_local_arrives():
    sig, ptx = signals(CFG_2CTA, [("sm_stats", "producer_commit", "softmax0"),
                                  ("o_epi", "consumer_release", "epilogue")])
    assert sig == ["mbarrier.arrive.shared.b64"] * 2
    assert "expect_tx" not in ptx


def test_tma_acquire_is_the_only_expect_tx():
    """The contrast that makes the grep meaningful: a TMA pipeline's acquire does emit
    arrive.expect_tx, and its commit emits nothing (the bytes complete the phase)."""
    sig, _ = signals(CFG_2CTA, [("kv", "producer_acquire", "load"), ("kv", "producer_commit", "load")])
    assert sig == ["mbarrier.arrive.expect_tx.shared.b64"]


def test_umma_commit_multicasts_to_the_pair_under_2cta():
    sig, _ = signals(CFG_2CTA, [("s_p_o", "producer_commit", "mma")])
    assert len(sig) == 1
    assert sig[0].startswith("tcgen05.commit.cta_group::2") and "multicast" in sig[0]
    sig1, _ = signals(CFG_1CTA, [("s_p_o", "producer_commit", "mma")])
    assert len(sig1) == 1 and sig1[0].startswith("tcgen05.commit.cta_group::1")
    assert "multicast" not in sig1[0]


def test_pipeline_state_compiles_through_a_dynamic_loop():
    """A loop-carried PipelineState (index, phase) walks the kv ring in a run-time loop."""
    from fa_sm100.compile_tools import cross_compile
    from pipelines.probe import make_probe, signal_instructions

    fn, args = make_probe(CFG_1CTA, [], ring_trips=7)
    art = cross_compile(fn, args, "sm_100a")
    assert signal_instructions(art.ptx) == ["mbarrier.arrive.expect_tx.shared.b64"]
    assert "mbarrier.try_wait.parity" in art.ptx
