"""``scripts/inspect.py --compare-fa4``: compile FlashAttention-4's SM100 forward the same way.

FA4 (the ``flash-attn-4`` distribution, package ``flash_attn.cute``) is compiled in a child
process, through its own public entry point ``flash_attn_func`` under torch's FakeTensorMode,
which is FA4's documented way to compile with no GPU (FLASH_ATTENTION_ARCH=sm_100 selects the
kernel, CUTE_DSL_ARCH=sm_100a the target). The child keeps the PTX and cubin and ptxas's
report; this process disassembles them and builds the same report as ``inspect_kernel``.

Two things are substituted in the child, and the report says so in ``fa4_notes``:

- ``cutlass.utils.HardwareInfo`` (which needs the CUDA driver) by a fixed SM count
  (``num_sms`` of our config, 148 for B200): FA4's persistent scheduler sizes its grid with it;
- nothing else: FA4 picks its own tile sizes, stages and register split for the problem.

Requirements (the ``fa4`` extra): flash-attn-4, and what ``import flash_attn.cute`` needs beyond
this project's dependencies (triton, through quack; einops). ``check_fa4_available`` names what
is missing.

The report's ``config`` holds FA4's constructor arguments and what it chose while compiling
(``q_stage``, ``kv_stage``, tile sizes, register split); ``tests/test_inspect_cli.py`` checks
that our ``kv_stage`` is at least FA4's for the same problem.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

FA4_PROBLEM = {"batch": 2, "seqlen": 8192, "heads": 16}


class FA4Unavailable(ValueError):
    """FA4 cannot be compiled on this machine; the message says why."""


def check_fa4_available(kernel: str, arch: str) -> None:
    if arch != "sm_100a":
        raise FA4Unavailable(f"--compare-fa4 compares SM100 forwards: use --arch sm_100a, not {arch}")
    missing = [m for m in ("flash_attn", "triton", "einops") if importlib.util.find_spec(m) is None]
    if "flash_attn" in missing:
        raise FA4Unavailable("--compare-fa4 needs FlashAttention-4: pip install flash-attn-4 "
                             "triton einops (the fa4 extra: pip install -e \".[fa4]\")")
    if missing:
        raise FA4Unavailable(
            f"--compare-fa4: flash-attn-4 is installed, but `import flash_attn.cute` also needs "
            f"{' and '.join(missing)} (triton through the quack package), which "
            f"{'is' if len(missing) == 1 else 'are'} not installed here: "
            f"pip install {' '.join(missing)} (the fa4 extra: pip install -e \".[fa4]\")"
        )


def _problem_config(kernel: str, overrides):
    """Our FmhaConfig for the problem FA4 is asked to solve (defaults for non-forward kernels)."""
    from fa_sm100.config import FmhaConfig, config_from_overrides

    return config_from_overrides(overrides) if kernel == "sm100_fwd" else FmhaConfig()


def inspect_fa4_sm100(overrides=(), keep_dir=None, kernel: str = "sm100_fwd",
                      timeout_s: int = 600) -> dict:
    """Compile FA4's SM100 forward for our config's problem; return its inspect report."""
    from fa_sm100.compile_tools import CompileArtifacts, disassemble, find_nvdisasm
    from fa_sm100.inspection import make_report

    check_fa4_available(kernel, "sm_100a")
    cfg = _problem_config(kernel, overrides)
    nvdisasm = find_nvdisasm()
    tmp = None
    if keep_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="fa_sm100_fa4_")
        out = Path(tmp.name)
    else:
        out = Path(keep_dir) / "fa4"
        out.mkdir(parents=True, exist_ok=True)
    try:
        problem = dict(FA4_PROBLEM, head_dim=cfg.head_dim, head_dim_v=cfg.head_dim_v,
                       dtype=cfg.dtype, causal=cfg.causal, qhead_per_kvhead=cfg.qhead_per_kvhead,
                       window=[cfg.window_left, cfg.window_right], num_sms=cfg.num_sms)
        env = dict(os.environ, CUTE_DSL_ARCH="sm_100a", FLASH_ATTENTION_ARCH="sm_100",
                   FLASH_ATTENTION_NUM_SMS=str(cfg.num_sms), CUTE_DSL_KEEP="ptx,cubin",
                   CUTE_DSL_DUMP_DIR=str(out), CUTE_DSL_COMPILER_OPT="remarks{ptx}")
        proc = subprocess.run(
            [sys.executable, "-m", "fa_sm100.fa4_compare", str(out), json.dumps(problem)],
            capture_output=True, text=True, env=env, timeout=timeout_s,
        )
        meta_path = out / "fa4_meta.json"
        if proc.returncode != 0 or not meta_path.exists():
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
            raise RuntimeError(f"compiling FA4's SM100 forward failed (exit {proc.returncode}):\n{tail}")
        meta = json.loads(meta_path.read_text())
        ptx = sorted(out.glob("*.sm_100a.ptx"))
        cubin = sorted(out.glob("*.sm_100a.cubin"))
        if len(ptx) != 1 or len(cubin) != 1:
            raise RuntimeError(f"expected one FA4 PTX and cubin in {out}, found {ptx + cubin}")
        art = CompileArtifacts(
            arch="sm_100a", compile_s=meta["compile_s"], ptx=ptx[0].read_text(),
            cubin=cubin[0].read_bytes(), sass=disassemble(cubin[0], nvdisasm),
            ptxas_log=(out / "fa4_ptxas.log").read_text(), dump_dir=str(out),
            launches=[dict(l, **{k: tuple(l[k]) for k in ("grid", "block", "cluster")
                                 if isinstance(l.get(k), list)}) for l in meta["launches"]],
        )
        launch = next((l for l in art.launches if l.get("block")), {})
        build = SimpleNamespace(
            config=meta["fa4_config"], smem_bytes=meta["smem_bytes"],
            tmem_cols=meta["tmem_cols"], setmaxnreg=meta["setmaxnreg"],
            setmaxnreg_warps=meta["setmaxnreg_warps"],
            cluster=tuple(launch.get("cluster", (1, 1, 1))),
        )
        report = make_report("fa4_sm100_fwd", build, art)
        report["fa4_problem"] = problem
        report["fa4_notes"] = [
            f"compiled by FA4's flash_attn_func under FakeTensorMode for {problem}",
            f"cutlass.utils.HardwareInfo replaced by a fixed count of {cfg.num_sms} SMs "
            "(FA4's persistent scheduler sizes its grid with it; there is no driver here)",
            "FA4 chooses its own tiles, stages and register split for this problem",
        ]
        return report
    finally:
        if tmp is not None:
            tmp.cleanup()


# ---------------------------------------------------------------------------------------------
# child process: python -m fa_sm100.fa4_compare OUT_DIR PROBLEM_JSON
# ---------------------------------------------------------------------------------------------


def _jsonable(v):
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return repr(v)


@contextlib.contextmanager
def fixed_sm_count(num_sms: int):
    """``cutlass.utils.HardwareInfo`` (a CUDA driver query) answers ``num_sms`` SMs, for FA4's
    persistent scheduler, which sizes its grid with it, while compiling with no GPU. Patched
    before FA4's scheduler module is first imported, which binds the name itself."""
    import cutlass.utils

    class FixedHardwareInfo:
        """Stands in for the driver query: the SM count of the cross-compile target."""

        def __init__(self, *args, **kwargs):
            pass

        def get_device_multiprocessor_count(self):
            return num_sms

        def get_max_active_clusters(self, cluster_size):
            return num_sms // cluster_size

    saved = cutlass.utils.HardwareInfo
    cutlass.utils.HardwareInfo = FixedHardwareInfo
    import flash_attn.cute.tile_scheduler as sched_mod

    saved_sched = sched_mod.HardwareInfo
    sched_mod.HardwareInfo = FixedHardwareInfo
    try:
        yield
    finally:
        cutlass.utils.HardwareInfo, sched_mod.HardwareInfo = saved, saved_sched


def _child(out_dir: str, problem: dict) -> int:
    with fixed_sm_count(int(problem["num_sms"])):
        return _compile_in_child(out_dir, problem)


def _compile_in_child(out_dir: str, problem: dict) -> int:
    import io
    import time

    import flash_attn.cute.flash_fwd_sm100 as fwd_mod
    import torch
    from flash_attn.cute.interface import flash_attn_func
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fa_sm100.compile_tools import _record_launches
    from fa_sm100.config import WARP_SIZE

    instances = []
    original_init = fwd_mod.FlashAttentionForwardSm100.__init__

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        instances.append((self, args, kwargs))

    fwd_mod.FlashAttentionForwardSm100.__init__ = init
    dtype = getattr(torch, problem["dtype"])
    b, s, h = problem["batch"], problem["seqlen"], problem["heads"]
    hk = max(1, h // problem["qhead_per_kvhead"])
    launches: list = []
    err = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stderr(err), _record_launches(launches), FakeTensorMode():
        q = torch.empty(b, s, h, problem["head_dim"], dtype=dtype, device="cuda")
        k = torch.empty(b, s, hk, problem["head_dim"], dtype=dtype, device="cuda")
        v = torch.empty(b, s, hk, problem["head_dim_v"], dtype=dtype, device="cuda")
        flash_attn_func(q, k, v, causal=problem["causal"], window_size=tuple(problem["window"]))
    compile_s = time.perf_counter() - t0
    out = Path(out_dir)
    (out / "fa4_ptxas.log").write_text(err.getvalue())
    if not instances:
        print("FA4 did not construct FlashAttentionForwardSm100 for this problem", file=sys.stderr)
        return 1
    inst, args, kwargs = instances[-1]
    storage = getattr(inst, "shared_storage", None)
    launch_smem = next((l["smem"] for l in launches if isinstance(l.get("smem"), int)), None)
    import inspect as pyinspect

    bound = pyinspect.signature(original_init).bind(inst, *args, **kwargs).arguments
    fa4_config = {k: _jsonable(v) for k, v in bound.items() if k != "self"}
    # Attributes FA4 sets on its kernel object while building and compiling (kv_stage: the K/V
    # SMEM stages it chose for this problem, set in _setup_attributes during the compile).
    for attr in ("q_stage", "kv_stage", "m_block_size", "n_block_size", "use_2cta_instrs",
                 "num_regs_softmax", "num_regs_correction", "num_regs_other", "tmem_alloc_cols"):
        if hasattr(inst, attr):
            fa4_config[attr] = _jsonable(getattr(inst, attr))
    if "kv_stage" not in fa4_config:
        print("FA4's kernel object has no kv_stage after compiling", file=sys.stderr)
        return 1
    # setmaxnreg acts per warpgroup: the softmax warps, the correction warps, everyone else.
    softmax = tuple(inst.softmax0_warp_ids) + tuple(inst.softmax1_warp_ids)
    correction = tuple(inst.correction_warp_ids)
    meta = {
        "compile_s": compile_s,
        "launches": [{k: _jsonable(v) for k, v in l.items()} for l in launches],
        "fa4_config": fa4_config,
        "smem_bytes": storage.size_in_bytes() if storage is not None else launch_smem,
        "tmem_cols": getattr(inst, "tmem_alloc_cols", None),
        "setmaxnreg": {role: getattr(inst, f"num_regs_{role}")
                       for role in ("softmax", "correction", "other")
                       if hasattr(inst, f"num_regs_{role}")},
        "setmaxnreg_warps": {
            "softmax": softmax,
            "correction": correction,
            "other": tuple(w for w in range(inst.threads_per_cta // WARP_SIZE)
                           if w not in softmax + correction),
        },
    }
    (out / "fa4_meta.json").write_text(json.dumps(meta, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1], json.loads(sys.argv[2])))
