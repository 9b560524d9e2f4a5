"""compute-sanitizer's racecheck over the SM90 backward, on an H100/H200.

racecheck reports one kind of hazard in the backward, and only one (docs/hopper_backward.md,
"compute-sanitizer"): a write-after-read on the LSE2 / Delta of a Q / dO stage. The MMA threads
read them with LDS, one lane per warp releases the stage (CUTLASS's ``PipelineTmaAsync``), and
the load warp's next bulk copy (UBLKCP) refills it; racecheck credits that release with its own
thread's reads only. FA4's SM90 backward draws the same reports. Any other pair of instructions
is a new hazard, and fails here. The memcheck cases run here (by their place in
``scripts/sm90_memcheck.py``) cover the handoffs of the walks and clusters: dynamic tiles (the
tile index slot), persistent multicast pairs, the causal default at hdim 128. Reports in
other kernels (cuBLAS, in the script's float32 reference) are not ours and are left out.
Skips (lazily, with the reason) without an sm_90 GPU or without compute-sanitizer.
"""

import shutil
import subprocess
import sys

import pytest
from script_loader import ROOT, load_script, repo_env

pytestmark = pytest.mark.gpu

KNOWN = {("Write", "UBLKCP", "Read", "LDS")}  # the stage's statistics, above


def _case_index(pred):
    mod = load_script("sm90_memcheck")
    for i, case in enumerate(mod.BWD_CASES):
        if pred(case, mod.bwd_config(case)):
            return i, len(mod.BWD_CASES)
    raise AssertionError("no memcheck case of this kind")


CASES = {
    "dynamic tiles": lambda c, cfg: cfg.dynamic_tiles and c[7],
    "persistent pairs": lambda c, cfg: (cfg.persistent_ctas and cfg.qdo_multicast
                                        and c[0] * c[3] * cfg.num_key_blocks(c[2])
                                        > cfg.persistent_ctas),
    "hdim 128 causal": lambda c, cfg: c[5] == 128 and c[7] and not c[-1],
}


@pytest.mark.parametrize("kind", list(CASES))
def test_sm90_bwd_racecheck_reports_only_the_stage_statistics(sm90_device, tmp_path, kind):
    tool = shutil.which("compute-sanitizer")
    if tool is None:
        pytest.skip("compute-sanitizer is not on PATH")
    sites = load_script("sanitizer_sites")
    i, n = _case_index(CASES[kind])
    cubins = tmp_path / "cubins"
    cubins.mkdir()  # the DSL writes into the folder, it does not make it
    # every kernel compiled afresh (no file cache), so that each one leaves its cubin
    env = repo_env(CUTE_DSL_KEEP="cubin", CUTE_DSL_DUMP_DIR=str(cubins),
                   CUTE_DSL_DISABLE_FILE_CACHING="1")
    out = subprocess.run([tool, "--tool", "racecheck", "--report-api-errors", "no",
                          sys.executable, str(ROOT / "scripts" / "sm90_memcheck.py"),
                          "--mode", "bwd", "--shard", f"{i + 1}/{n}"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    log = out.stdout + out.stderr
    assert "all 1 bwd cases ok" in log, log[-3000:]  # ran, and met the float32 reference
    reports = sites.parse_reports(log)
    # every report was read (a format the parser missed would otherwise pass as "none")
    assert sites.summary_count(log) == len(reports), log[-3000:]
    funcs = sites.load_functions(cubins)
    ours = [rep for rep in reports if "fa_sm100" in rep.first.func]  # not cuBLAS (the reference)
    for acc in (acc for rep in ours for acc in (rep.first, *rep.others)):
        assert acc.func in funcs, (f"no cubin kept for {acc.func}: "
                                   f"{sorted(p.name for p in cubins.rglob('*'))}")
    assert set(sites.instruction_pairs(ours, funcs)) <= KNOWN, sites.describe(ours, funcs)
