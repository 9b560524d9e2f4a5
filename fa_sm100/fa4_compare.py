"""``scripts/inspect.py --compare-fa4``: compile FlashAttention-4's SM100 kernel the same way.

FA4 (the ``flash-attn-4`` distribution, package ``flash_attn.cute``) is compiled in a child
process under torch's FakeTensorMode, which is FA4's documented way to compile with no GPU
(FLASH_ATTENTION_ARCH=sm_100 selects the kernel, CUTE_DSL_ARCH=sm_100a the target):

- ``sm100_fwd`` (and every kernel but ``sm100_bwd``): FA4's public ``flash_attn_func``, which
  compiles ``FlashAttentionForwardSm100``;
- ``sm100_bwd``: FA4's ``_flash_attn_bwd`` (what its autograd backward calls), which compiles
  the preprocess, ``FlashAttentionBackwardSm100`` and the postprocess; the report is the main
  kernel's (its PTX and cubin, its launch).

The child keeps the PTX and cubin and ptxas's report; this process disassembles them and
builds the same report as ``inspect_kernel``.

Two things are substituted in the child, and the report says so in ``fa4_notes``:

- ``cutlass.utils.HardwareInfo`` (which needs the CUDA driver) by a fixed SM count
  (``num_sms`` of our config, 148 for B200): FA4's persistent scheduler sizes its grid with it;
- nothing else: FA4 picks its own tile sizes, stages and register split for the problem.

Requirements (the ``fa4`` extra): flash-attn-4, and what ``import flash_attn.cute`` needs beyond
this project's dependencies (triton, through quack; einops). ``check_fa4_available`` names what
is missing.

The report's ``config`` holds FA4's constructor arguments and what it chose while compiling
(forward: ``q_stage``, ``kv_stage``, tile sizes, register split; backward: ``Q_stage``,
``dO_stage``, tiles, 2-CTA, register split); ``tests/test_inspect_cli.py`` checks that our
forward's ``kv_stage`` is at least FA4's for the same problem.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

FA4_PROBLEM = {"batch": 2, "seqlen": 8192, "heads": 16}
# a window for configs that only say "windowed" (the backward's ``local``): the bounds are
# launch arguments of both kernels, so any window compiles the same code
FA4_BWD_WINDOW = 1024
FA4_BWD_SOFTCAP = 30.0  # likewise for a capped backward: the cap is a launch argument


@dataclass(frozen=True)
class Fa4Kernel:
    """Which FA4 kernel ``--compare-fa4`` compiles for one of ours, and how it is reported."""

    direction: str  # "fwd" | "bwd": what the child compiles
    class_name: str  # FA4's kernel class (its name is in the main kernel's dump files)
    report_name: str
    chosen: tuple  # config keys the CLI prints after "FA4 chose:"

    @property
    def title(self) -> str:
        return f"FA4 {self.class_name}"


FA4_FORWARD = Fa4Kernel(
    "fwd", "FlashAttentionForwardSm100", "fa4_sm100_fwd",
    ("q_stage", "kv_stage", "m_block_size", "n_block_size", "use_2cta_instrs",
     "is_static_persistent", "num_regs_softmax", "num_regs_correction", "num_regs_other"))
FA4_BACKWARD = Fa4Kernel(
    "bwd", "FlashAttentionBackwardSm100", "fa4_sm100_bwd",
    ("tile_m", "tile_n", "Q_stage", "dO_stage", "sdQaccum_stage", "use_2cta_instrs",
     "cluster_size", "num_regs_reduce", "num_regs_compute", "num_regs_load", "num_regs_mma",
     "num_regs_empty"))


def fa4_kernel_for(kernel: str) -> Fa4Kernel:
    """FA4's backward for ``sm100_bwd``, its forward for every other kernel."""
    return FA4_BACKWARD if kernel == "sm100_bwd" else FA4_FORWARD


class FA4Unavailable(ValueError):
    """FA4 cannot be compiled on this machine; the message says why."""


def check_fa4_available(kernel: str, arch: str) -> None:
    if arch != "sm_100a":
        raise FA4Unavailable(f"--compare-fa4 compares SM100 kernels: use --arch sm_100a, not {arch}")
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


def _problem(kernel: str, overrides) -> dict:
    """The problem FA4 is asked to solve: our config's for sm100_fwd and sm100_bwd, the
    default forward config's for every other kernel."""
    from fa_sm100.config import B200_SMS, FmhaConfig, config_from_overrides

    if kernel == "sm100_bwd":
        from fa_sm100.sm100.bwd_inspect_entry import make_config

        cfg = make_config(overrides)
        right = 0 if cfg.causal else FA4_BWD_WINDOW
        window = [FA4_BWD_WINDOW, right] if cfg.local else [None, None]
        return dict(FA4_PROBLEM, direction="bwd", head_dim=cfg.head_dim,
                    head_dim_v=cfg.head_dim_v, dtype=cfg.dtype, causal=cfg.causal,
                    qhead_per_kvhead=cfg.qhead_per_kvhead, window=window,
                    softcap=FA4_BWD_SOFTCAP if cfg.softcap else 0.0,
                    deterministic=cfg.deterministic, num_sms=B200_SMS)
    cfg = config_from_overrides(overrides) if kernel == "sm100_fwd" else FmhaConfig()
    return dict(FA4_PROBLEM, direction="fwd", head_dim=cfg.head_dim, head_dim_v=cfg.head_dim_v,
                dtype=cfg.dtype, causal=cfg.causal, qhead_per_kvhead=cfg.qhead_per_kvhead,
                window=[cfg.window_left, cfg.window_right], num_sms=cfg.num_sms)


def inspect_fa4_sm100(overrides=(), keep_dir=None, kernel: str = "sm100_fwd",
                      timeout_s: int = 600) -> dict:
    """Compile FA4's SM100 forward (or, for ``sm100_bwd``, its backward) for our config's
    problem; return its inspect report. RuntimeError when FA4 cannot compile it."""
    from fa_sm100.compile_tools import CompileArtifacts, disassemble, find_nvdisasm
    from fa_sm100.inspection import make_report

    check_fa4_available(kernel, "sm_100a")
    fa4 = fa4_kernel_for(kernel)
    problem = _problem(kernel, overrides)
    what = f"FA4's SM100 {'backward' if fa4.direction == 'bwd' else 'forward'}"
    nvdisasm = find_nvdisasm()
    tmp = None
    if keep_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="fa_sm100_fa4_")
        out = Path(tmp.name)
    else:
        out = Path(keep_dir) / "fa4"
        out.mkdir(parents=True, exist_ok=True)
    try:
        env = dict(os.environ, CUTE_DSL_ARCH="sm_100a", FLASH_ATTENTION_ARCH="sm_100",
                   FLASH_ATTENTION_NUM_SMS=str(problem["num_sms"]), CUTE_DSL_KEEP="ptx,cubin",
                   CUTE_DSL_DUMP_DIR=str(out), CUTE_DSL_COMPILER_OPT="remarks{ptx}")
        proc = subprocess.run(
            [sys.executable, "-m", "fa_sm100.fa4_compare", str(out), json.dumps(problem)],
            capture_output=True, text=True, env=env, timeout=timeout_s,
        )
        meta_path = out / "fa4_meta.json"
        if proc.returncode != 0 or not meta_path.exists():
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
            raise RuntimeError(f"compiling {what} failed (exit {proc.returncode}) for "
                               f"{problem}:\n{tail}")
        meta = json.loads(meta_path.read_text())
        # the backward also compiles FA4's preprocess and postprocess: report the main kernel
        ptx = sorted(out.glob(f"*{fa4.class_name}*.sm_100a.ptx"))
        cubin = sorted(out.glob(f"*{fa4.class_name}*.sm_100a.cubin"))
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
        report = make_report(fa4.report_name, build, art)
        report["fa4_problem"] = problem
        entry = "_flash_attn_bwd" if fa4.direction == "bwd" else "flash_attn_func"
        report["fa4_notes"] = [
            f"compiled by FA4's {entry} under FakeTensorMode for {problem}",
            f"cutlass.utils.HardwareInfo replaced by a fixed count of {problem['num_sms']} SMs "
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
        if problem["direction"] == "bwd":
            return _compile_bwd_in_child(out_dir, problem)
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


def _compile_bwd_in_child(out_dir: str, problem: dict) -> int:
    """Compile FA4's backward (preprocess, ``FlashAttentionBackwardSm100``, postprocess)
    through ``_flash_attn_bwd`` on fake tensors; write the main kernel's meta."""
    import inspect as pyinspect
    import io
    import time

    import flash_attn.cute.flash_bwd_sm100 as bwd_mod
    import torch
    from flash_attn.cute.interface import _flash_attn_bwd
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fa_sm100.compile_tools import _record_launches

    cls = bwd_mod.FlashAttentionBackwardSm100
    instances = []
    original_init = cls.__init__

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        instances.append((self, args, kwargs))

    cls.__init__ = init
    dtype = getattr(torch, problem["dtype"])
    b, s, h = problem["batch"], problem["seqlen"], problem["heads"]
    hk = max(1, h // problem["qhead_per_kvhead"])
    d, dv = problem["head_dim"], problem["head_dim_v"]
    launches: list = []
    err = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stderr(err), _record_launches(launches), FakeTensorMode():
        q = torch.empty(b, s, h, d, dtype=dtype, device="cuda")
        k = torch.empty(b, s, hk, d, dtype=dtype, device="cuda")
        v = torch.empty(b, s, hk, dv, dtype=dtype, device="cuda")
        out = torch.empty(b, s, h, dv, dtype=dtype, device="cuda")
        dout = torch.empty(b, s, h, dv, dtype=dtype, device="cuda")
        lse = torch.empty(b, h, s, dtype=torch.float32, device="cuda")
        left, right = problem["window"]
        _flash_attn_bwd(q, k, v, out, dout, lse, causal=problem["causal"],
                        softcap=problem["softcap"], window_size_left=left,
                        window_size_right=right, deterministic=problem["deterministic"])
    compile_s = time.perf_counter() - t0
    out_path = Path(out_dir)
    (out_path / "fa4_ptxas.log").write_text(err.getvalue())
    if not instances:
        print("FA4 did not construct FlashAttentionBackwardSm100 for this problem (another "
              "backward kernel serves it)", file=sys.stderr)
        return 1
    inst, args, kwargs = instances[-1]
    smem = inst.shared_storage.size_in_bytes()
    # the main kernel's launch: FA4's preprocess and postprocess launch with other blocks
    main = [l for l in launches if l.get("block") == (inst.threads_per_cta, 1, 1)
            and l.get("smem") == smem]
    if len(main) != 1:
        print(f"expected one launch of FlashAttentionBackwardSm100, found {main} in {launches}",
              file=sys.stderr)
        return 1
    bound = pyinspect.signature(original_init).bind(inst, *args, **kwargs).arguments
    fa4_config = {k: _jsonable(v) for k, v in bound.items() if k != "self"}
    for attr in ("tile_m", "tile_n", "tile_hdim", "tile_hdimv", "Q_stage", "dO_stage",
                 "sdQaccum_stage", "sdKVaccum_stage", "use_2cta_instrs", "cluster_size",
                 "num_regs_reduce", "num_regs_compute", "num_regs_load", "num_regs_mma",
                 "num_regs_empty", "tmem_alloc_cols"):
        if hasattr(inst, attr):
            fa4_config[attr] = _jsonable(getattr(inst, attr))
    # setmaxnreg acts per warp here: each role's warps set their own budget; the relay warp
    # takes the MMA warp's with 2-CTA MMAs, else the empty warp's (FA4's kernel())
    relay = inst.num_regs_mma if inst.use_2cta_instrs else inst.num_regs_empty
    roles = {
        "reduce": (tuple(inst.reduce_warp_ids), inst.num_regs_reduce),
        "compute": (tuple(inst.compute_warp_ids), inst.num_regs_compute),
        "mma": ((inst.mma_warp_id,), inst.num_regs_mma),
        "load": ((inst.load_warp_id,), inst.num_regs_load),
        "relay": ((inst.relay_warp_id,), relay),
        "empty": ((inst.empty_warp_id,), inst.num_regs_empty),
    }
    meta = {
        "compile_s": compile_s,
        "launches": [{k: _jsonable(v) for k, v in l.items()} for l in main],
        "fa4_config": fa4_config,
        "smem_bytes": smem,
        "tmem_cols": inst.tmem_alloc_cols,
        "setmaxnreg": {role: regs for role, (_, regs) in roles.items()},
        "setmaxnreg_warps": {role: warps for role, (warps, _) in roles.items()},
    }
    (out_path / "fa4_meta.json").write_text(json.dumps(meta, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1], json.loads(sys.argv[2])))
