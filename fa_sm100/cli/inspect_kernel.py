"""Cross-compile a kernel of fa-sm100 on a machine with no GPU and report what the compiler made.

    python scripts/inspect.py --kernel tcgen05_demo --arch sm_100a
    python scripts/inspect.py --kernel sm100_fwd --arch sm_100a --set use_2cta=false --json out.json
    python scripts/inspect.py --kernel sm100_fwd --arch sm_100a --against split_p=false
    python scripts/inspect.py --kernel sm100_fwd --arch sm_100a --compare-fa4
    python scripts/inspect.py --kernel sm100_bwd --arch sm_100a --compare-fa4
    python scripts/inspect.py --list

The report's keys are documented in docs/inspect.md. Exit status: 0 on success, 2 for bad
input (unknown kernel, bad --set, arch), a kernel that is not available yet, or a missing
disassembler; 1 when a compile fails.
"""


import os
import sys

import argparse
import json


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="scripts/inspect.py",
        description="Cross-compile a kernel (no GPU needed) and report threads, cluster, "
        "registers, setmaxnreg, SMEM/TMEM, spills and a SASS histogram.",
    )
    p.add_argument("--kernel", help="registered kernel name (see --list)")
    p.add_argument("--arch", default="sm_100a", choices=("sm_100a", "sm_90a"))
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                   help="override one config field (repeatable), e.g. --set use_2cta=false")
    p.add_argument("--json", dest="json_path", metavar="PATH", help="also write the report as JSON")
    p.add_argument("--keep-dir", metavar="DIR", help="keep the PTX, cubin and SASS in DIR")
    p.add_argument("--compare-fa4", action="store_true",
                   help="also compile FlashAttention-4's SM100 forward (its backward for "
                   "--kernel sm100_bwd) for the same problem and print both reports side by "
                   "side (needs flash-attn-4, triton, einops)")
    p.add_argument("--against", action="append", default=[], metavar="FIELD=VALUE",
                   help="also compile the config with these further overrides (repeatable) and "
                   "print both side by side, e.g. --against ex2_emu_fraction=0")
    p.add_argument("--list", action="store_true", help="list the registered kernels and exit")
    args = p.parse_args(argv)
    if not args.list and not args.kernel:
        p.error("--kernel is required (or --list)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    # The DSL reads the target arch once, when cutlass is first imported (below, lazily).
    os.environ["CUTE_DSL_ARCH"] = args.arch

    from fa_sm100.compile_tools import DisassemblerMissing
    from fa_sm100.registry import KERNEL_MODULES, KernelNotAvailable

    if args.list:
        for name, module in KERNEL_MODULES.items():
            print(f"{name:14} {module}")
        return 0

    from fa_sm100.inspection import (
        CompileFailed,
        format_report,
        format_side_by_side,
        inspect_kernel,
    )

    from fa_sm100.registry import get_kernel

    progress = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    try:
        if args.compare_fa4:
            from fa_sm100.fa4_compare import check_fa4_available

            check_fa4_available(args.kernel, args.arch)
        if args.against:  # validate the second config before spending time on the first
            get_kernel(args.kernel).make_config(args.overrides + args.against)
        report = inspect_kernel(args.kernel, args.arch, args.overrides, keep_dir=args.keep_dir,
                                log=progress)
        print(format_report(report))
        out = dict(report)
        if args.against:
            other = inspect_kernel(args.kernel, args.arch, args.overrides + args.against,
                                   log=progress)
            print()
            print(format_side_by_side(report, other, args.kernel, " ".join(args.against)))
            out["against"] = other  # the pinned keys stay at the top level
        if args.compare_fa4:
            from fa_sm100.fa4_compare import fa4_kernel_for, inspect_fa4_sm100

            fa4_kernel = fa4_kernel_for(args.kernel)
            progress(f"compiling FlashAttention-4's {fa4_kernel.class_name} ...")
            fa4 = inspect_fa4_sm100(args.overrides, keep_dir=args.keep_dir, kernel=args.kernel)
            print()
            print(format_side_by_side(report, fa4, args.kernel, fa4_kernel.title))
            print("FA4 chose: " + ", ".join(f"{k}={fa4['config'][k]}" for k in fa4_kernel.chosen
                                            if k in fa4["config"]))
            for note in fa4["fa4_notes"]:
                print(f"note: {note}")
            out["fa4"] = fa4
    except (ValueError, KernelNotAvailable, DisassemblerMissing) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (CompileFailed, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(out, f, indent=2)
        print(f"wrote {args.json_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
