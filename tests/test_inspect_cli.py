"""The command lines: scripts/inspect.py and the main job ``python -m fa_sm100`` (CPU path).

Error paths run the CLI's main() in-process (no compile); the JSON round trip and the main job
run as real subprocesses, as a user would.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fa_sm100.compile_tools import NVDISASM_DIRS_ENV
from fa_sm100.inspection import REPORT_KEYS, SASS_KEYS
from plain_text import word_lines
from script_loader import load_script, repo_env

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "inspect.py"


def _cli():
    return load_script("inspect")


def _env(**extra):
    return repo_env(**extra)


@pytest.mark.parametrize("argv, message", [
    (["--kernel", "nope"], "unknown kernel 'nope'"),
    (["--kernel", "tcgen05_demo", "--set", "bogus=1"], "has no field 'bogus'"),
    (["--kernel", "tcgen05_demo", "--set", "n=100"], "n=100: the demo tile's N must be"),
    (["--kernel", "tcgen05_demo", "--arch", "sm_90a"], "compiles for ['sm_100a'], not sm_90a"),
    (["--kernel", "tcgen05_demo", "--against", "n=7"], "n=7: the demo tile's N must be"),
])
def test_bad_input_exits_2_with_the_reason(argv, message, capsys):
    assert _cli().main(argv) == 2
    err = capsys.readouterr().err
    assert "error: " in err and message in err
    assert "compiling" not in err  # rejected before any compile


def test_missing_disassembler_exits_2(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(NVDISASM_DIRS_ENV, str(tmp_path))
    assert _cli().main(["--kernel", "tcgen05_demo"]) == 2
    err = capsys.readouterr().err
    assert "nvdisasm (the SASS disassembler) was not found" in err
    assert "pip install nvidia-cuda-nvdisasm" in err


def test_list_names_every_registered_kernel(capsys):
    assert _cli().main(["--list"]) == 0
    out = capsys.readouterr().out
    for name in ("sm100_fwd", "sm90_fwd", "sm90_bwd", "tcgen05_demo"):
        assert name in out


@pytest.mark.compile
def test_json_round_trip(tmp_path):
    """The CLI's --json file holds the pinned keys; its text report shows the same numbers."""
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--kernel", "tcgen05_demo", "--arch", "sm_100a",
         "--set", "use_2cta=false", "--set", "n=64", "--json", str(out)],
        capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(out.read_text())
    assert set(REPORT_KEYS) <= set(rep) and set(SASS_KEYS) <= set(rep["sass"])
    assert rep["config"]["use_2cta"] is False and rep["config"]["n"] == 64
    assert rep["cluster"] == [1, 1, 1] and rep["tmem_cols"] == 64
    assert rep["sass"]["UTCHMMA.2CTA"] == 0 and rep["sass"]["UTCHMMA"] == 4
    assert rep["sass"]["LDTM"] == 2  # 64 columns, 32 per load
    # the text report's rows are "label  value": each shows the JSON's number
    rows = dict(line.rsplit(" ", 1) for line in word_lines(proc.stdout) if " " in line)
    assert rows["threads/CTA"] == str(rep["threads_per_cta"])
    assert rows["smem bytes"] == str(rep["smem_bytes"])
    assert rows["spill bytes"] == str(rep["spill_bytes"])
    assert rows["UTCHMMA"] == str(rep["sass"]["UTCHMMA"])


@pytest.mark.compile
def test_main_job_without_gpu(tmp_path):
    """python -m fa_sm100 with no GPU: cross-compiles sm100_fwd (nothing else) and prints its
    report, which shows the design: 512 threads, a cluster of 2, no spills, no failed check."""
    out = tmp_path / "main.json"
    proc = subprocess.run(
        [sys.executable, "-m", "fa_sm100", "--no-gpu", "--json", str(out)],
        capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = proc.stdout
    assert "[1/3]" in text and "[2/3] cross-compiling sm100_fwd for sm_100a" in text
    assert "[3/3] summary" in text and "tcgen05_demo" not in text
    rep = json.loads(out.read_text())
    assert rep["kernel"] == "sm100_fwd" and rep["arch"] == "sm_100a"
    assert rep["threads_per_cta"] == 512 and rep["cluster"] == [2, 1, 1]
    assert rep["spill_bytes"] == 0 and rep["warnings"] == []
    assert "sm100_fwd: compiled for sm_100a" in text and "not run" in text
    assert "512 threads/CTA, cluster (2, 1, 1)" in text and "0 spill bytes" in text


def test_main_job_without_gpu_fails_loudly_when_sm100_fwd_cannot_be_built(monkeypatch, capsys):
    """If sm100_fwd cannot be built, the no-GPU job exits 1 with the reason and compiles no
    stand-in kernel."""
    import fa_sm100.__main__ as main_job
    from fa_sm100 import registry

    def no_compile(*a, **k):
        raise AssertionError("compiled something although sm100_fwd is not available")

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_100a")  # main() sets it; keep it test-local
    monkeypatch.setitem(registry.KERNEL_MODULES, "sm100_fwd", "fa_sm100.sm100.not_written_yet")
    monkeypatch.setattr("fa_sm100.inspection.cross_compile", no_compile)
    assert main_job.main(["--no-gpu"]) == 1
    out = capsys.readouterr().out
    assert "error: kernel 'sm100_fwd' is not available yet" in out
    assert "[3/3] summary: FAILED" in out and "tcgen05_demo" not in out


def test_compare_fa4_says_why_it_cannot_run(monkeypatch, capsys):
    """Without triton/einops FA4's package cannot be imported: --compare-fa4 exits 2 naming
    what is missing, before compiling anything. The look-up is faked both ways (flash_attn
    present, triton absent), so the check does not depend on what this machine has."""
    import importlib.util as iu

    import fa_sm100.fa4_compare as fc

    real = iu.find_spec
    present = iu.find_spec("json")  # any spec: "installed"
    fake = {"triton": None, "flash_attn": present}
    monkeypatch.setattr(fc.importlib.util, "find_spec",
                        lambda name, *a: fake[name] if name in fake else real(name, *a))
    assert _cli().main(["--kernel", "sm100_fwd", "--compare-fa4"]) == 2
    err = capsys.readouterr().err
    assert "needs triton" in err and "pip install triton" in err
    assert "compiling" not in err
    with pytest.raises(fc.FA4Unavailable, match="use --arch sm_100a"):
        fc.check_fa4_available("sm100_fwd", "sm_90a")


def _fa4_missing() -> list:
    import importlib.util as iu

    return [m for m in ("flash_attn", "triton", "einops") if iu.find_spec(m) is None]


@pytest.mark.compile
@pytest.mark.slow
def test_compare_fa4_report():
    """Where FA4 can be imported, its SM100 forward compiles here and reports the design it
    shares with ours: 512 threads, cluster 2, cta_group::2 MMAs, 512 TMEM columns, each
    setmaxnreg budget executed by its role's warps; and our kv_stage is at least the K/V stage
    count FA4 chooses for the same problem (design issue 4.6)."""
    missing = _fa4_missing()
    if missing:
        pytest.skip(f"FA4 comparison: {', '.join(missing)} not importable here; install the "
                    "fa4 extra: pip install -e \".[fa4]\" (flash-attn-4, triton, einops)")
    from fa_sm100.config import config_from_overrides
    from fa_sm100.fa4_compare import inspect_fa4_sm100

    rep = inspect_fa4_sm100(["use_2cta=true"])
    assert set(REPORT_KEYS) <= set(rep)
    assert rep["kernel"] == "fa4_sm100_fwd" and rep["arch"] == "sm_100a"
    assert rep["threads_per_cta"] == 512 and rep["cluster"] == [2, 1, 1]
    assert rep["sass"]["UTCHMMA"] > 0 and rep["sass"]["UTCHMMA.2CTA"] == rep["sass"]["UTCHMMA"]
    assert rep["tmem_cols"] == 512 and rep["tmem_alloc_ptx"] == [{"cta_group": 2, "cols": 512}]
    assert rep["config"]["head_dim"] == 128 and rep["config"]["head_dim_v"] == 128
    assert set(rep["setmaxnreg"]) == {"softmax", "correction", "other"}
    assert rep["warnings"] == []
    ours = config_from_overrides(["use_2cta=true"]).kv_stage
    fa4 = rep["config"]["kv_stage"]
    assert isinstance(fa4, int) and fa4 >= 1
    assert ours >= fa4, f"our kv_stage {ours} < FA4's {fa4} for the same problem"


@pytest.mark.compile
@pytest.mark.slow
def test_compare_fa4_backward(tmp_path):
    """``--kernel sm100_bwd --compare-fa4`` for the default hdim-128 problem: FA4's
    FlashAttentionBackwardSm100 compiles here for the same head dims, and both reports (ours,
    FA4's) are filled with plausible figures, in the side-by-side text and in the --json file
    (ours at the top level, FA4's under "fa4"). FA4's own numbers are not pinned: only that it
    is a 16-warp tcgen05 kernel whose setmaxnreg budgets are executed by its roles' warps."""
    missing = _fa4_missing()
    if missing:
        pytest.skip(f"FA4 comparison: {', '.join(missing)} not importable here; install the "
                    "fa4 extra: pip install -e \".[fa4]\" (flash-attn-4, triton, einops)")
    out = tmp_path / "bwd.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--kernel", "sm100_bwd", "--compare-fa4",
         "--json", str(out)],
        capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    both = json.loads(out.read_text())
    ours, fa4 = both, both["fa4"]
    assert ours["kernel"] == "sm100_bwd" and fa4["kernel"] == "fa4_sm100_bwd"
    assert fa4["fa4_problem"]["head_dim"] == fa4["config"]["head_dim"] == 128
    for rep in (ours, fa4):
        assert set(REPORT_KEYS) <= set(rep) and set(SASS_KEYS) <= set(rep["sass"])
        assert rep["arch"] == "sm_100a"
        assert rep["threads_per_cta"] == 512  # 16 warps, both designs
        assert 0 < rep["regs_at_launch"] <= 255 and rep["setmaxnreg"]
        assert 0 < rep["smem_bytes"] <= 232448
        assert 0 < rep["tmem_cols"] <= 512 and rep["tmem_alloc_ptx"]
        assert rep["spill_bytes"] >= 0 and rep["local_bytes"] >= 0
        assert rep["sass"]["UTCHMMA"] > 0 and rep["sass"]["UTMALDG"] > 0
        assert rep["sass"]["USETMAXREG"] > 0 and sum(rep["sass_full"].values()) > 0
        assert not [w for w in rep["warnings"] if "setmaxnreg" in w], rep["warnings"]
    assert ours["warnings"] == []
    text = proc.stdout
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if "FA4 FlashAttentionBackwardSm100" in line)
    assert "sm100_bwd" in lines[at]
    for label, key in (("threads/CTA", "threads_per_cta"), ("smem bytes", "smem_bytes"),
                       ("tmem cols", "tmem_cols"), ("spill bytes", "spill_bytes")):
        row = next(line for line in lines[at:] if line.startswith(label)).split()
        assert row[-2:] == [str(ours[key]), str(fa4[key])], row
    assert "FA4 chose: tile_m=" in text and "use_2cta_instrs=" in text


def test_compile_failure_exits_1_with_the_compiler_error(monkeypatch, capsys):
    """A kernel that fails to compile is not bad input: exit 1 and the compiler's message."""
    def broken(*args, **kwargs):
        raise RuntimeError("ptxas fatal: something the kernel did")

    monkeypatch.setattr("fa_sm100.inspection.cross_compile", broken)
    assert _cli().main(["--kernel", "tcgen05_demo"]) == 1
    err = capsys.readouterr().err
    assert "compiling tcgen05_demo for sm_100a failed: RuntimeError: ptxas fatal" in err


def test_main_job_gpu_check_can_fail():
    """The GPU path's check (run here on the CPU with stand-in backends): a correct forward
    passes, a wrong one and a raising one fail, and the run goes on after a failure."""
    import torch

    from fa_sm100.__main__ import run_on_gpu
    from fa_sm100.testing import attention_reference

    def good(q, k, v, scale, causal, window, return_lse, config):
        out, _ = attention_reference(q, k, v, causal=causal, dtype=torch.float32)
        return out.to(q.dtype)

    def wrong(q, k, v, scale, causal, window, return_lse, config):
        return good(q, k, v, scale, causal, window, return_lse, config) * 1.05

    calls = []

    def broken(*args):
        calls.append(1)
        raise RuntimeError("launch failed")

    shapes = [(1, 64, 80, 2, 64, False), (1, 64, 64, 2, 64, True)]
    assert run_on_gpu("stand-in", shapes, "bfloat16", backend=good, device="cpu")
    assert not run_on_gpu("stand-in", shapes, "bfloat16", backend=wrong, device="cpu")
    assert not run_on_gpu("stand-in", shapes, "bfloat16", backend=broken, device="cpu")
    assert len(calls) == 2


@pytest.mark.compile
def test_against_compiles_both_configs_side_by_side(tmp_path, capsys):
    """--against: the flipped switch shows up in the second column and in the JSON."""
    out = tmp_path / "ag.json"
    assert _cli().main(["--kernel", "tcgen05_demo", "--against", "use_2cta=false",
                        "--json", str(out)]) == 0
    text = capsys.readouterr().out
    rep = json.loads(out.read_text())
    assert rep["cluster"] == [2, 1, 1] and rep["against"]["cluster"] == [1, 1, 1]
    assert rep["sass"]["UTCHMMA.2CTA"] == 4 and rep["against"]["sass"]["UTCHMMA.2CTA"] == 0
    row = next(l for l in text.splitlines() if l.startswith("sass UTCHMMA.2CTA"))
    assert row.split()[-2:] == ["4", "0"]
    assert "use_2cta=false" in text
