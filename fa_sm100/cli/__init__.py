"""The command lines of the project: ``python -m fa_sm100 <command> [flags]``.

Each command is a module with ``main(argv=None) -> int``; ``scripts/<name>.py`` is a thin
entry point to the same ``main`` (same flags, same output and JSON). ``COMMANDS`` maps a
command to its module; ``python -m fa_sm100 --help`` lists them.
"""

from __future__ import annotations

import os

COMMANDS = {
    "check": ("fa_sm100.__main__", "the default job: run the forward on the GPU against the "
              "float64 reference, or cross-compile it for sm_100a without one"),
    "inspect": ("fa_sm100.cli.inspect_kernel", "cross-compile a kernel, report resources, SASS "
                "and the TMEM/SMEM plans as JSON"),
    "benchmark": ("fa_sm100.cli.benchmark", "ours against FA4 and SDPA-cuDNN in one process, "
                  "forward or backward grid"),
    "ab_bench": ("fa_sm100.cli.ab_bench", "paired A/B timing of SM90 config switches"),
    "overhead": ("fa_sm100.cli.overhead", "host cost per call, ours beside the peers"),
    "window_bench": ("fa_sm100.cli.window_bench", "sliding windows against FA4"),
    "softcap_bench": ("fa_sm100.cli.softcap_bench", "softcapping against FA4"),
    "varlen_bench": ("fa_sm100.cli.varlen_bench", "packed variable-length batches against FA4"),
    "decode_bench": ("fa_sm100.cli.decode_bench", "decode against a paged KV cache: K/V read "
                     "bandwidth, ours against FA4"),
    "cp_bench": ("fa_sm100.cli.cp_bench", "context parallelism on several GPUs: tokens/s/GPU, "
                 "compute against communication"),
    "plot_ratios": ("fa_sm100.cli.plot_ratios", "ours over the best peer, paired, from benchmark JSON"),
    "emulate": ("fa_sm100.cli.emulate", "the numerics of the SM100 forward's algorithm, emulated on the CPU"),
    "emulate_sm100": ("fa_sm100.cli.emulate_sm100", "the SM100 forward kernel's own PTX on the CPU emulator"),
    "mutate": ("fa_sm100.cli.mutate", "plant faults into the SM100 forward's PTX: which CPU layer catches each"),
    "ablation": ("fa_sm100.research.ablation_cli", "one optimization at a time, in the protocol "
                 "model's timing mode (MODEL OUTPUT)"),
    "timeline": ("fa_sm100.research.timeline_cli", "the modelled warp timeline of the SM100 "
                 "forward (MODEL OUTPUT)"),
    "warmup": ("fa_sm100.warmup", "compile the kernels of given problems into the disk cache"),
    "claims": ("fa_sm100.results", "regenerate the speed claims of README.md and the docs from "
               "the results files (--check: only say which are stale)"),
    "sanitizer_sites": ("fa_sm100.cli.sanitizer_sites", "the instructions behind compute-sanitizer's "
                        "hazard reports"),
    "sm90_memcheck": ("fa_sm100.cli.sm90_memcheck", "the SM90 kernels on representative problems, for "
                      "compute-sanitizer"),
    "ncu_bwd": ("fa_sm100.cli.ncu_bwd", "Nsight Compute of one backward cell, ours and FA4"),
    "dump_fa4_sm90": ("fa_sm100.cli.dump_fa4_sm90", "FA4's SM90 forward, run once to keep its PTX and cubin"),
    "dump_fa4_sm90_sass": ("fa_sm100.cli.dump_fa4_sm90_sass", "FA4's SM90 SASS cross-compiled, beside ours"),
}


def child_env(**extra) -> dict:
    """``os.environ`` with the directory that holds ``fa_sm100`` first on PYTHONPATH (and
    ``extra``): a command that re-runs itself in a child process (``-m``) finds this copy of
    the package however the parent was started."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def usage() -> str:
    width = max(map(len, COMMANDS))
    return "commands:\n" + "\n".join(f"  {name:<{width}}  {what}"
                                     for name, (_, what) in COMMANDS.items())
