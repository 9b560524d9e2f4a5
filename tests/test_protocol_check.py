"""The CLI ``python -m pipelines.check``: the clean protocol passes, every injected fault on
every pipeline is rejected and named (drop-release -> deadlock, extra-arrive ->
over-arrival, skip-wait -> race)."""

import json
import subprocess
import sys

import pytest

from pipelines import check
from pipelines.program import INJECTION_KINDS
from pipelines.spec import PIPELINE_NAMES

EXPECTED = {"drop-release": "deadlock", "extra-arrive": "over-arrival", "skip-wait": "race"}
FAST = dict(n_blocks=(3,), work_tiles=(2,), exhaustive_states=0, source="design")


def test_clean_protocol_on_a_grid_slice():
    res = check.run({"kv_stage": 2}, **dict(FAST, n_blocks=(1, 2, 3), work_tiles=(1, 2)))
    assert res["ok"], res["first_findings"]
    assert res["configs_checked"] == 8 and res["runs"] == 8 * 6


@pytest.mark.parametrize("pipe", PIPELINE_NAMES)
@pytest.mark.parametrize("kind", INJECTION_KINDS)
def test_every_injection_on_every_pipeline_is_rejected(kind, pipe):
    res = check.run({"kv_stage": 3, "q_stage": 2, "split_p": True}, (kind, pipe), **FAST)
    assert not res["ok"]
    assert EXPECTED[kind] in res["findings_by_kind"], res["findings_by_kind"]
    # the finding names the pipeline's barrier or the region the pipeline protects
    assert res["first_findings"]
    # both the 2-CTA and the 1-CTA protocol reject it
    for r in res["results"]:
        assert any(run["findings"] for run in r["runs"]), r["fields"]


def test_cli_exit_codes_and_json(tmp_path):
    out = tmp_path / "r.json"
    assert check.main(["--source", "design", "--set", "use_2cta=false", "--set", "kv_stage=2",
                       "--n-blocks", "1-3", "--work-tiles", "1-2", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["ok"] and data["states_explored"] > 0 and data["configs_checked"] == 4
    # the default budget lets every search finish: 4 configs x n_blocks {1, 2} x one tile
    assert data["exhaustive_runs"] == 8 and data["exhaustive_truncated"] == 0
    assert check.main(["--source", "design", "--set", "use_2cta=false", "--set", "kv_stage=2",
                       "--n-blocks", "3", "--work-tiles", "2", "--inject", "drop-release:o_epi"]) == 1
    assert check.main(["--inject", "drop-release:nope"]) == 2
    assert check.main(["--inject", "forget:kv"]) == 2
    assert check.main(["--set", "kv_stages=2"]) == 2


def test_cli_module_names_the_fault():
    proc = subprocess.run(
        [sys.executable, "-m", "pipelines.check", "--source", "design", "--set", "q_stage=1", "--set", "kv_stage=2",
         "--set", "split_p=false", "--n-blocks", "2", "--work-tiles", "2",
         "--exhaustive-states", "0", "--inject", "skip-wait:s_p_o"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAILED" in proc.stdout and "race on S0" in proc.stdout


def test_config_rules_are_reported_as_skipped():
    res = check.run({"kv_stage": 1, "q_stage": 1, "split_p": False}, **FAST)
    assert res["configs_checked"] == 1  # 1-CTA only
    assert len(res["configs_skipped"]) == 1
    assert "2-CTA needs at least 2 K/V stages" in res["configs_skipped"][0]["reason"]


def test_untraceable_kernel_is_an_input_error(monkeypatch, capsys):
    """When the kernel cannot be traced the CLI says so (exit 2); it never falls back."""
    import pipelines.kernel_source as ks

    def broken(cfg):
        raise RuntimeError("kernel failed to trace")

    monkeypatch.setattr(ks, "kernel_recording", broken)
    assert check.main(["--set", "q_stage=1", "--set", "kv_stage=2", "--n-blocks", "1",
                       "--work-tiles", "1"]) == 2
    assert "could not record the kernel protocol" in capsys.readouterr().err


def test_truncated_search_is_reported_not_called_exhaustive():
    """A search that runs out of states is counted and named in the summary (``ok`` only
    says that nothing was found)."""
    res = check.run({"use_2cta": False, "kv_stage": 2, "q_stage": 2, "split_p": True}, None, "design",
                    n_blocks=(2,), work_tiles=(1,), exhaustive_states=100)
    assert res["ok"] and res["exhaustive_runs"] == 1 and res["exhaustive_truncated"] == 1
    text = check.summary(res)
    assert "1 truncated at 100 states (not exhaustive)" in text
    assert "incomplete" in text
