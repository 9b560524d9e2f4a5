"""Planted faults in the SM100 forward's PTX (``fa_sm100.ptxemu.mutate``): every fault of the
catalogue is caught by at least one CPU layer, and docs/verification.md shows the current
outcomes (``python scripts/mutate.py --write-docs`` regenerates it)."""

import os

import pytest

pytest.importorskip("cutlass")

from fa_sm100.ptxemu import mutate  # noqa: E402
from script_loader import load_script  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.compile]


@pytest.fixture(scope="module")
def outcomes():
    return mutate.run_catalogue()


@pytest.mark.parametrize("name", sorted(mutate.BY_NAME))
def test_every_planted_fault_is_caught(outcomes, name):
    assert mutate.caught(outcomes[name]), f"{name}: caught by no layer: {outcomes[name]}"


def test_the_late_schedule_catches_the_halved_expect_tx(outcomes):
    """The fault random seeds missed (the barrier completes once one CTA's half of Q has
    landed): the default schedule of ``run_forward``, "late", reports it."""
    assert outcomes["expect_tx_half"]["late"].startswith("report:")


def test_the_docs_table_is_current(outcomes):
    script = load_script("mutate")
    text = open(os.path.join(os.path.dirname(__file__), "..", "docs", "verification.md")).read()
    block = text.split(script.BEGIN, 1)[1].split(script.END, 1)[0].strip()
    assert block == mutate.render_table(outcomes), (
        "docs/verification.md is out of date: python scripts/mutate.py --write-docs")


def test_bounded_delay_search_passes_the_kernel_and_finds_the_halved_expect_tx():
    """``explore_delays``: the forward is bit-identical to the numerics emulation under every
    single delay of its first 8 asynchronous operations; with Q's expected bytes halved, some
    delay in that range holds back one CTA's half of Q and the MMA reading it is reported."""
    import math

    import torch

    from fa_sm100.config import config_from_overrides
    from fa_sm100.emulation import emulate_sm100_fwd
    from fa_sm100.ptxemu.memory import EmulationError
    from fa_sm100.ptxemu.sm100_run import explore_delays

    cfg = config_from_overrides(list(mutate.CONFIGS["2cta"]))
    q, k, v = mutate.mutation_inputs()
    ref, _ = emulate_sm100_fwd(q, k, v, 1.0 / math.sqrt(64), config=cfg)
    for n, run in explore_delays(cfg, q, k, v, limit=8):
        assert not isinstance(run, EmulationError), f"delay:{n}: {run}"
        assert torch.equal(run.out.view(torch.int16), ref.view(torch.int16)), f"delay:{n}"
    faulty = explore_delays(cfg, q, k, v, limit=8,
                            ptx_edit=mutate.BY_NAME["expect_tx_half"].edit)
    assert any(isinstance(r, EmulationError) and "pending" in str(r) for _, r in faulty)
