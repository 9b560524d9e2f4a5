"""Run the SM100 forward kernel's own PTX on the CPU emulator (issue 9) and compare.

    python scripts/emulate_sm100.py [--set field=value ...] [--batch B] [--seqlen S]
        [--seqlen-k SK] [--heads H] [--kv-heads HK] [--seed N] [--trace out.json]

The config comes from --set (validated by the kernel registry; head_dim, causal and the GQA
ratio are fields of the config). The kernel is cross-compiled for sm_100a, its launch is
captured through the driver stand-in with CPU tensors, every thread of every CTA runs on the
emulator, and the output is compared with the float64 reference (the project's error rule)
and with the numerics emulation. --trace writes the per-warp event trace as JSON: one event
per executed warp instruction (warp, step, PTX line, opcode, active lanes). Nothing here runs
on an SM100 GPU: the results are emulated. Exit status 1 when the error rule fails.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

os.environ.setdefault("CUTE_DSL_ARCH", "sm_100a")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", action="append", default=[], metavar="field=value",
                    help="config override (repeatable), e.g. --set use_2cta=false")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seqlen", type=int, default=128)
    ap.add_argument("--seqlen-k", type=int, default=None)
    ap.add_argument("--heads", type=int, default=1)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0, help="scheduler seed")
    ap.add_argument("--input-seed", type=int, default=0)
    ap.add_argument("--trace", default=None, help="write a per-warp event trace (JSON)")
    args = ap.parse_args(argv)

    import torch

    from fa_sm100.ptxemu import write_trace
    from fa_sm100.ptxemu.sm100_run import compare, run_forward
    from fa_sm100.registry import get_kernel

    try:
        cfg = get_kernel("sm100_fwd").make_config(args.set)
    except ValueError as e:
        print(f"bad --set: {e}", file=sys.stderr)
        return 2
    hk = args.kv_heads or max(1, args.heads // cfg.qhead_per_kvhead)
    if args.heads != hk * cfg.qhead_per_kvhead:
        print(f"--heads {args.heads} / --kv-heads {hk} do not match qhead_per_kvhead="
              f"{cfg.qhead_per_kvhead}", file=sys.stderr)
        return 2
    sk = args.seqlen_k or args.seqlen
    g = torch.Generator().manual_seed(args.input_seed)
    q = torch.randn(args.batch, args.seqlen, args.heads, cfg.head_dim, generator=g)
    k = torch.randn(args.batch, sk, hk, cfg.head_dim, generator=g)
    v = torch.randn(args.batch, sk, hk, cfg.head_dim_v, generator=g)
    dt = {"bfloat16": torch.bfloat16, "float16": torch.float16}[cfg.dtype]
    q, k, v = q.to(dt), k.to(dt), v.to(dt)

    trace = [] if args.trace else None
    run = run_forward(cfg, q, k, v, 1.0 / math.sqrt(cfg.head_dim), seed=args.seed, trace=trace)
    print(f"config: {cfg}")
    print(f"launch (captured): {run.launch}")
    print(f"compile {run.compile_s:.1f} s, emulation {run.emulate_s:.1f} s, "
          f"{run.warp_steps} warp instructions in the last cluster (emulated, not run)")
    res = compare(run, cfg, q, k, v)
    print(json.dumps({k_: v_ for k_, v_ in res.items()}, indent=1))
    if trace is not None:
        roles = {w: role for role, ws in cfg.warp_roles().role_warps().items() for w in ws}
        write_trace(trace, args.trace, run.kernel, roles)
        print(f"trace: {len(trace)} events -> {args.trace}")
    return 0 if res["rule_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
