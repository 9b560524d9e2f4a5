"""The main job: ``python -m fa_sm100``.

- On an SM100 GPU: run the forward kernel (``fa_sm100.sm100.interface.sm100_fwd``) on random
  inputs and check it against the float64 reference with the project's error rule.
- On a Hopper (sm_90) GPU: the same with the fallback (``fa_sm100.hopper.interface.sm90_fwd``).
- With no GPU (or ``--no-gpu``): cross-compile the SM100 forward for sm_100a through the kernel
  registry and print its inspect report. If it cannot be built or compiled, the job fails with
  the reason (nothing else is compiled in its place).

Exit status 0 when every step passed, 1 when a check or a compile failed.

Commands: ``python -m fa_sm100 <command> ...`` runs one of the project's command lines
(``fa_sm100.cli.COMMANDS``: inspect, benchmark, emulate, timeline, ablation, warmup, ...; the
job above is ``check``); ``--help`` lists them.
"""

import argparse
import json
import os
import sys
import time


def _say(msg: str) -> None:
    print(msg, flush=True)


def _gpu_capability():
    """(major, minor) of GPU 0, or None with the reason. Called only when the job runs."""
    try:
        import torch
    except ImportError:
        return None, "torch is not installed"
    if not torch.cuda.is_available():
        return None, "no CUDA device on this machine"
    return torch.cuda.get_device_capability(0), None


def run_on_gpu(backend_name: str, shapes, dtype_name: str, backend=None,
               device: str = "cuda") -> bool:
    """Run ``backend_name`` on random inputs of each (batch, seqlen_q, seqlen_k, heads, head_dim,
    causal) and apply the float64 reference rule. True when every case passed.

    ``backend`` (a function with the backends' signature) and ``device`` exist for tests."""
    import torch

    from fa_sm100.testing import attention_reference, check_against_reference

    if backend is None and backend_name == "sm100_fwd":
        from fa_sm100.sm100.interface import sm100_fwd as backend
    elif backend is None:
        from fa_sm100.hopper.interface import sm90_fwd as backend
    dtype = getattr(torch, dtype_name)
    ok = True
    torch.manual_seed(0)
    for i, (b, sq, sk, h, d, causal) in enumerate(shapes, 1):
        q = torch.randn(b, sq, h, d, device=device, dtype=dtype)
        k = torch.randn(b, sk, h, d, device=device, dtype=dtype)
        v = torch.randn(b, sk, h, d, device=device, dtype=dtype)
        label = f"b={b} sq={sq} sk={sk} h={h} d={d} causal={causal} {dtype_name}"
        _say(f"  [{i}/{len(shapes)}] {backend_name} {label} ...")
        t0 = time.perf_counter()
        try:
            out = backend(q, k, v, None, causal, (None, None), False, None)
            out = out[0] if isinstance(out, tuple) else out
            if device == "cuda":
                torch.cuda.synchronize()
        except Exception as e:  # a compile or launch failure: report it, go on with the rest
            ok = False
            lines = [l for l in str(e).strip().splitlines() if l.strip()][:8]
            _say(f"        FAIL: {backend_name} raised {type(e).__name__}: " + "\n        ".join(lines))
            continue
        first = time.perf_counter() - t0
        ref64, _ = attention_reference(q, k, v, causal=causal)
        plain, _ = attention_reference(q, k, v, causal=causal, dtype=dtype, upcast=False)
        try:
            err, plain_err = check_against_reference(out.float().cpu(), ref64.cpu(),
                                                     plain.float().cpu())
            _say(f"        pass: max error {err:.3e} (plain {dtype_name}: {plain_err:.3e}); "
                 f"first call incl. compile {first:.1f} s")
        except AssertionError as e:
            ok = False
            _say(f"        FAIL: {e}")
    return ok


def cross_compile_report(json_path=None) -> bool:
    """No GPU: compile sm100_fwd for sm_100a and print its report. False, with the reason
    printed, when it cannot be built or compiled."""
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_100a")
    from fa_sm100.compile_tools import DisassemblerMissing
    from fa_sm100.inspection import CompileFailed, format_report, inspect_kernel
    from fa_sm100.registry import KernelNotAvailable

    kernel = "sm100_fwd"
    _say(f"[2/3] cross-compiling {kernel} for sm_100a (5-20 s on a small CPU) ...")
    try:
        report = inspect_kernel(kernel, "sm_100a")
    except (KernelNotAvailable, DisassemblerMissing, CompileFailed) as e:
        _say(f"      error: {e}")
        _say("[3/3] summary: FAILED (see the error above)")
        return False
    except Exception as e:  # the kernel's module or build failed before compiling
        _say(f"      error: building {kernel} failed: {type(e).__name__}: {e}")
        _say("[3/3] summary: FAILED (see the error above)")
        return False
    _say("")
    _say(format_report(report))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=2)
        _say(f"wrote {json_path}")
    _say("")
    _say("[3/3] summary")
    sass = report["sass"]
    _say(f"  {kernel}: compiled for sm_100a in {report['compile_s']:.1f} s; not run "
         "(no SM100 GPU here).")
    _say(f"  {report['threads_per_cta']} threads/CTA, cluster {tuple(report['cluster'])}, "
         f"{report['regs_at_launch']} registers at launch, "
         f"{report['spill_bytes']} spill bytes, {report['smem_bytes']} SMEM bytes, "
         f"{report['tmem_cols']} TMEM columns")
    _say(f"  tcgen05 MMAs in SASS: {sass['UTCHMMA']} (cta_group::2: {sass['UTCHMMA.2CTA']}), "
         f"TMEM loads {sass['LDTM']}, TMA loads {sass['UTMALDG']}, "
         f"setmaxnreg {sass['USETMAXREG']}")
    for w in report["warnings"]:
        _say(f"  warning: {w}")
    if report["warnings"]:  # each warning is a cross-check of the compiled code that failed
        _say(f"  FAILED: {len(report['warnings'])} cross-check(s) of the compiled code failed")
        return False
    return True


def main(argv=None) -> int:
    from fa_sm100.cli import COMMANDS, usage

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "check":  # the job below, by its name
        argv = argv[1:]
    elif argv and argv[0] in COMMANDS:
        import importlib

        return importlib.import_module(COMMANDS[argv[0]][0]).main(argv[1:])
    p = argparse.ArgumentParser(prog="python -m fa_sm100", description=__doc__.split("\n\n")[0],
                                epilog=usage(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--no-gpu", action="store_true",
                   help="skip the GPU even if there is one: cross-compile and report")
    p.add_argument("--json", dest="json_path", metavar="PATH",
                   help="write the inspect report (no-GPU path) as JSON")
    args = p.parse_args(argv)

    _say("[1/3] looking for a GPU ...")
    cap, why = (None, "--no-gpu given") if args.no_gpu else _gpu_capability()
    if cap is not None and cap[0] == 10:
        _say(f"      sm_{cap[0]}{cap[1]} (Blackwell): running the SM100 forward kernel")
        os.environ.setdefault("CUTE_DSL_ARCH", f"sm_{cap[0]}{cap[1]}a")
        _say("[2/3] forward vs float64 reference")
        ok = run_on_gpu("sm100_fwd", _SHAPES, "bfloat16")
    elif cap == (9, 0):
        _say("      sm_90 (Hopper): running the Hopper fallback forward (sm90_fwd)")
        os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
        _say("[2/3] forward vs float64 reference")
        ok = run_on_gpu("sm90_fwd", _SHAPES, "bfloat16")
    else:
        if cap is not None:
            why = f"the GPU is sm_{cap[0]}{cap[1]}, which has no fa_sm100 kernel"
        _say(f"      none usable ({why}): cross-compiling instead")
        return 0 if cross_compile_report(args.json_path) else 1
    _say("[3/3] summary: " + ("all checks passed" if ok else "a check FAILED"))
    return 0 if ok else 1


# (batch, seqlen_q, seqlen_k, heads, head_dim, causal)
_SHAPES = [
    (2, 1024, 1024, 4, 128, False),
    (2, 1024, 1024, 4, 128, True),
    (1, 300, 700, 2, 64, False),
]

if __name__ == "__main__":
    sys.exit(main())
