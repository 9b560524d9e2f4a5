"""Randomized properties of the protocol model (hypothesis): over random configs, trip
counts, schedules and branch outcomes, the DESIGN.md protocol is clean, and a random planted
fault is always reported with its kind."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fa_sm100.config import FmhaConfig
from pipelines.design import design_recording
from pipelines.model import ProtocolModel
from pipelines.program import BRANCH_POLICIES, INJECTION_KINDS, inject
from pipelines.spec import PIPELINE_NAMES

EXPECTED = {"drop-release": "deadlock", "extra-arrive": "over-arrival", "skip-wait": "race"}



def _valid(cfg):
    try:
        cfg.validate()
        return True
    except ValueError:  # e.g. the SMEM budget of 1-CTA with many K/V stages
        return False


configs = st.builds(
    lambda q, kv, two, split: FmhaConfig(q_stage=q, kv_stage=kv, use_2cta=two, split_p=split),
    st.sampled_from([1, 2]), st.integers(1, 6), st.booleans(), st.booleans()).filter(_valid)
SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(cfg=configs, n=st.integers(1, 5), t=st.integers(1, 3), seed=st.integers(0, 10_000),
       policy=st.sampled_from(sorted(BRANCH_POLICIES)))
def test_design_protocol_clean_under_any_schedule(cfg, n, t, seed, policy):
    rec = design_recording(cfg)
    rep = ProtocolModel(cfg, rec.programs, {"n_blocks": n, "work_tiles": t},
                        BRANCH_POLICIES[policy]).run_random(seed)
    assert rep.ok, [f.message for f in rep.findings]


@SETTINGS
@given(cfg=configs, kind=st.sampled_from(INJECTION_KINDS), pipe=st.sampled_from(PIPELINE_NAMES),
       seed=st.integers(0, 10_000))
def test_planted_fault_is_always_reported(cfg, kind, pipe, seed):
    if pipe == "p_lastsplit" and not cfg.split_p:
        cfg = cfg.replace(split_p=True)
    rec = inject(design_recording(cfg).programs, kind, pipe)
    # enough trips for every stage ring to wrap (drop-release needs the producer to come back)
    bindings = {"n_blocks": max(3, cfg.kv_stage), "work_tiles": 2}
    rep = ProtocolModel(cfg, rec, bindings).run_random(seed)
    assert EXPECTED[kind] in {f.kind for f in rep.findings}, (kind, pipe, [f.message for f in rep.findings])
