"""Paired A/B timing of SM90 config switches: is a change faster, and by how much?

    python scripts/ab_bench.py --mode bwd --hdim 128 --seqlen 4096 16384 \\
        --variant nofence:dv_before_fence=false
    python scripts/ab_bench.py --mode fwd --hdim 128 --seqlen 4096 --causal false \\
        --variant pers:persistent=true --rounds 16 --json ab.json

Every cell (bf16, 16k tokens, hidden 2048, as ``scripts/benchmark.py``) times ``default`` (the
config ``select_sm90_fwd_config`` / ``select_bwd_config`` picks for the cell), each
``--variant NAME:field=value,...`` (the same picks with these fields replaced) and, unless
``--no-fa4``, FlashAttention-4, in one process on one GPU. Before timing, every output is
checked (forward: the float32 rule of ``scripts/benchmark.py``; backward: gradients against
the float32 reference, ``fa_sm100.hopper.bwd_bench.check_grads``); a wrong or failing
provider stops the run with exit status 1.

Timing (``fa_sm100.benchmarking.paired_rounds``): ``--rounds`` rounds; a round times every
provider once, as ``calls`` back-to-back calls between two CUDA events (``calls`` makes the
default's measurement last about ``--round-ms``), in an order balanced for carry-over
(``round_order``: each provider first equally often, each pair back to back equally often). A
provider's speed-up over ``default`` is the median over rounds of the ratio of the two
measurements of the same round, printed with its lowest and highest round. A provider whose
host-side launch path takes about as long as its kernels (short sequences: Python-level
launchers) is flagged "launch-bound": back-to-back calls then time the host. Drifts of clock
and power between rounds cancel in these ratios; in this project's runs on an H200, a 1-2%
effect that the benchmark grid's medians could not separate from noise (cells moving by up
to 12% between runs) showed up with paired ranges of +-1% (docs/hopper_backward.md).

A variant whose config builds the same kernels as the default's in a cell (equal
``effective()`` configs: a switch the kernel does not read there, such as the backward's
``stats_first`` with 80-row blocks) is named before any GPU work and marked "[same kernel as
default: A/A]" in its cell; its ratio is a measure of the noise. On an H200, such a
variant measured 0.997x-1.007x over 16 rounds in ten cells, +0.6% / +1.0% over 12 rounds at
16k: read smaller effects with that in mind.

Beside the config variants:

- ``--fa4-variant NAME:field=value,...`` (forward) also times FlashAttention-4's forward with
  its own tile choices (``flash_attn.cute.interface._flash_attn_fwd``'s ``tile_mn``,
  ``mma_pv_is_rs``, ``intra_wg_overlap``), checked like every provider: is an option that
  FA4 does not take by default faster in FA4 itself?

      python scripts/ab_bench.py --mode fwd --hdim 64 --seqlen 16384 --causal false \
          --fa4-variant ss192:tile_mn=192x192,mma_pv_is_rs=false

- ``--probe NAME=VALUE`` (backward) also times the default kernel with a cost probe
  (``fa_sm100.hopper.probes``, Note [cost probes]): a piece of its work taken out or made
  cheaper, e.g. ``dq_reduce=none`` (no dQ reduce into L2) or ``ds_barrier=none`` (the MMA
  warpgroups do not meet before the dQ GEMM), to measure what that piece costs. Probes
  joined by ``+`` run together in one kernel (``pointwise=none+dq_reduce=none``: the loop's
  GEMMs and data movement without the math or the dQ reduce).
  A probe's gradients are wrong by design: its run is compiled and timed, not checked, and its
  line in the cell says so.

      python scripts/ab_bench.py --mode bwd --hdim 128 --seqlen 4096 16384 \
          --probe dq_reduce=none --probe dq_reduce=copy

- ``--top-clock`` follows every call with a GPU sleep as long as the default's call, so the
  board stays below its power limit and the SM clock at its top: each run's time is then its
  work's own, not what the power manager made of its energy (Note [top-clock timing] in
  ``fa_sm100.benchmarking``). On an H200 an A/A pair read 1.000x [0.999, 1.001] this way at
  hdim 128 16k; back to back such pairs have read 0.983x-1.007x.

      python scripts/ab_bench.py --mode bwd --hdim 128 --seqlen 16384 --top-clock \
          --variant nofence:dv_before_fence=false

- ``--heads N [N ...]`` replaces the cell's head count (hidden 2048 / head dim) with each N
  (the batch stays 16k tokens / seqlen): the number of CTAs, and so how whole the last wave
  of CTAs on the GPU's SMs is, changes while the work per CTA does not.

Backward cells beside the grid's: ``--window LEFT RIGHT`` (each side an int or ``none``)
adds a sliding window, ``--deterministic`` asks for deterministic gradients. The defaults
(and every variant's other fields) are then chosen for that problem, as ``sm90_bwd`` chooses
them; the forward's O and LSE come from ``sm90_fwd``. A variant may not set a field that names the
problem (``causal``, ``window_left``, ``deterministic``, ...): every run of a cell computes
the same gradients.

    python scripts/ab_bench.py --mode bwd --hdim 128 --seqlen 4096 --causal false \
        --window 256 0 --deterministic --variant wg:dq_handoff_per_wg=true --no-fa4
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


from fa_sm100.benchmarking import (GRID_HIDDEN, GRID_TOKENS, ClockSampler,
                                   calls_per_round, cell_config, clock_summary,
                                   duty_cycled_ms, error_text, events_ms, format_interval,
                                   host_and_gpu_ms, launch_bound, median, median_interval,
                                   paired_rounds, paired_speedup_rounds, paired_speedups,
                                   same_kernel_variants)
from fa_sm100.config import parse_bool
from fa_sm100.hopper import probes

TOKENS = GRID_TOKENS  # the benchmark grid's cells
HIDDEN = GRID_HIDDEN
LAUNCH_CHECK_CALLS = 16  # calls timed host-side for the launch-bound check
# FlashAttention-4 forward options --fa4-variant may set (values: _fa4_value)
FA4_FWD_FIELDS = ("tile_mn", "mma_pv_is_rs", "intra_wg_overlap")


def _bool_list(text: str):
    return {"both": (False, True), "true": (True,), "yes": (True,), "false": (False,),
            "no": (False,)}[text.lower()]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("fwd", "bwd"), default="bwd")
    p.add_argument("--hdim", type=int, nargs="+", default=[128])
    p.add_argument("--seqlen", type=int, nargs="+", default=[4096])
    p.add_argument("--causal", type=_bool_list, default=(False, True),
                   help="both (default), true or false")
    p.add_argument("--variant", action="append", default=[], metavar="NAME:FIELD=VALUE[,...]",
                   help="a config to compare with the default (repeatable)")
    p.add_argument("--fa4-variant", action="append", default=[],
                   metavar="NAME:FIELD=VALUE[,...]",
                   help="forward: FlashAttention-4 with these options of its own (fields "
                        f"{', '.join(FA4_FWD_FIELDS)}; tile_mn as MxN), repeatable")
    p.add_argument("--probe", action="append", default=[], metavar="NAME=VALUE[+NAME=VALUE]",
                   help="also time the default with this probe of the mode's kernel, or these "
                        "together (results not checked; fa_sm100.hopper.probes), repeatable")
    p.add_argument("--heads", type=int, nargs="+", default=None,
                   help="heads per cell (default: hidden 2048 / head dim); each value is a cell")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--round-ms", type=float, default=150.0,
                   help="length of one measurement of the default (sets the calls per round)")
    p.add_argument("--top-clock", action="store_true",
                   help="follow every call with a GPU sleep as long as the default's call, so "
                        "the clock stays at its top below the power limit: the work's own time "
                        "(Note [top-clock timing] in fa_sm100/benchmarking.py)")
    p.add_argument("--window", nargs=2, default=None, metavar=("LEFT", "RIGHT"),
                   help="backward: a sliding window, each side an int >= 0 or 'none'")
    p.add_argument("--deterministic", action="store_true",
                   help="backward: deterministic gradients")
    p.add_argument("--no-fa4", action="store_true", help="leave FlashAttention-4 out")
    p.add_argument("--json", default=None, help="write every round's times here")
    a = p.parse_args(argv)
    if a.rounds < 2:
        p.error("--rounds must be at least 2")
    names = set()
    for flag, specs in (("--variant", a.variant), ("--fa4-variant", a.fa4_variant)):
        for spec in specs:
            name, sep, fields = spec.partition(":")
            if not sep or not name or not fields:
                p.error(f"{flag} {spec!r}: expected NAME:field=value[,field=value]")
            if name in names or name in ("default", "fa4"):
                p.error(f"{flag} name {name!r} is taken")
            names.add(name)
    if a.fa4_variant and a.mode != "fwd":
        p.error("--fa4-variant times FlashAttention-4's forward: use it with --mode fwd")
    kernel_probes = probes.FWD_KERNEL_PROBES if a.mode == "fwd" else None
    for spec in a.probe:
        try:
            pairs = probes.parse_probe_set(spec)
        except ValueError as e:
            p.error(f"--probe: {e}")
        for name, _ in pairs:
            if (name in probes.FWD_KERNEL_PROBES) != (kernel_probes is not None):
                p.error(f"--probe {name} probes the "
                        f"{'forward' if kernel_probes is None else 'backward'} kernel: use it "
                        f"with --mode {'fwd' if kernel_probes is None else 'bwd'}")
    if len(set(a.probe)) != len(a.probe):
        p.error("--probe: each probe once")
    if a.fa4_variant and a.no_fa4:
        p.error("--fa4-variant needs FlashAttention-4: leave out --no-fa4")
    for h in a.heads or ():
        if h < 1:
            p.error(f"--heads {h}: must be at least 1")
    for d in a.hdim:
        if HIDDEN % d and not a.heads:
            p.error(f"--hdim {d} does not divide the hidden size {HIDDEN}: give --heads")
    for s in a.seqlen:
        if s < 1 or TOKENS % s:
            p.error(f"--seqlen {s} must divide {TOKENS} tokens")
    a.problem = {}  # the backward cells' window / deterministic (cell_config's ``problem``)
    if (a.window or a.deterministic) and a.mode != "bwd":
        p.error("--window and --deterministic are backward problems: use them with --mode bwd")
    if a.window:
        sides = [None if x.lower() == "none" else x for x in a.window]
        if any(x is not None and not x.isdigit() for x in sides) or sides == [None, None]:
            p.error(f"--window {' '.join(a.window)}: each side an int >= 0 or 'none', not both "
                    "'none'")
        a.problem["window_left"], a.problem["window_right"] = (
            None if x is None else int(x) for x in sides)
    if a.deterministic:
        a.problem["deterministic"] = True
    return a


def parse_variants(specs, mode):
    """[(name, {field: value})] from ``NAME:field=value,...``; unknown fields and fields
    that name the problem (use --hdim, --causal, --window, --deterministic) raise ValueError
    (before any GPU work)."""
    from fa_sm100.config import parse_variant
    from fa_sm100.hopper.bwd_config import BwdConfig
    from fa_sm100.hopper.config import Sm90FwdConfig

    cls = BwdConfig if mode == "bwd" else Sm90FwdConfig
    return [parse_variant(spec, cls) for spec in specs]


def _fa4_value(field: str, text: str):
    """One --fa4-variant value: ``tile_mn`` as MxN (two positive multiples of 16), the others
    booleans as every ``--variant`` reads them (``fa_sm100.config.parse_bool``)."""
    if field == "tile_mn":
        m, sep, n = text.lower().partition("x")
        dims = (int(m), int(n)) if sep and m.isdigit() and n.isdigit() else ()
        if not dims or any(x == 0 or x % 16 for x in dims):
            raise ValueError(f"tile_mn={text!r}: expected MxN, two positive multiples of 16 "
                             "(e.g. 192x192)")
        return dims
    try:
        return parse_bool(text)
    except ValueError:
        raise ValueError(f"{field}={text!r}: expected true or false") from None


def parse_fa4_variants(specs):
    """[(name, {FA4 forward option: value})] from ``NAME:field=value,...``; a field FA4's
    forward does not take here (``FA4_FWD_FIELDS``) or a bad value raises ValueError (before
    any GPU work)."""
    out = []
    for spec in specs:
        name, _, text = spec.partition(":")
        fields = {}
        for item in filter(None, text.split(",")):
            field, sep, value = item.partition("=")
            if not sep or field not in FA4_FWD_FIELDS:
                raise ValueError(f"--fa4-variant {spec!r}: {item!r} is not field=value with a "
                                 f"field of {FA4_FWD_FIELDS}")
            fields[field] = _fa4_value(field, value)
        out.append((name, fields))
    return out


def fa4_forward_call(fa4_fwd, q, k, v, causal, fields):
    """The no-argument call that runs FlashAttention-4's forward ``fa4_fwd`` (its
    ``_flash_attn_fwd``) on q, k, v with the options ``fields`` and returns the output."""
    return lambda: fa4_fwd(q, k, v, causal=causal, **fields)[0]


def cell_heads(d, heads):
    """The cell's head counts: ``heads`` (--heads) or hidden / head dim."""
    return heads or [HIDDEN // d]


def _benchmark_script():
    """The benchmark command's module (its forward output check)."""
    from fa_sm100.cli import benchmark

    return benchmark


def fwd_cell(d, s, causal, h, variants, fa4_variants, with_fa4, torch, probe_list=()):
    """Runs of one forward cell ({name: no-argument call}: ours with each variant, FA4 with
    each of ``fa4_variants``, the default under each probe set of ``probe_list``, compiled
    inside it: Note [cost probes]) and the check of their output."""
    from fa_sm100.hopper.interface import prepare_sm90_fwd

    b = TOKENS // s
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    runs = {name: prepare_sm90_fwd(q, k, v, causal=causal,
                                   config=cell_config("fwd", d, s, causal, fields, h))
            for name, fields in [("default", {})] + variants}
    for pairs in probe_list:  # the launch holds the probed kernel, compiled in the block
        with probes.probes_active(pairs):
            runs[PROBE_PREFIX + probe_set_name(pairs)] = prepare_sm90_fwd(
                q, k, v, causal=causal, config=cell_config("fwd", d, s, causal, {}, h))
    if with_fa4:
        from flash_attn.cute import flash_attn_func as fa4

        runs["fa4"] = lambda: fa4(q, k, v, causal=causal)
    if fa4_variants:
        from flash_attn.cute.interface import _flash_attn_fwd

        for name, fields in fa4_variants:
            runs[name] = fa4_forward_call(_flash_attn_fwd, q, k, v, causal, fields)
    bench = _benchmark_script()

    def check(out):
        out = out[0] if isinstance(out, tuple) else out
        return bench.check_output(out, q, k, v, causal, torch)
    return runs, check


PROBE_PREFIX = "probe:"  # a probe's run name: PROBE_PREFIX + "name=value"


def bwd_cell(d, s, causal, h, variants, with_fa4, torch, probe_list=(), problem=None):
    """Runs of one backward cell and the check of their gradients; each ``(name, value)`` of
    ``probe_list`` adds a run of the default kernel under that cost probe, named
    ``PROBE_PREFIX + "name=value"`` (not to be checked: Note [cost probes]). ``problem``: the
    cell's window and deterministic mode (``parse_args``)."""
    from fa_sm100.config import default_head_dim_v
    from fa_sm100.hopper import bwd_bench
    from fa_sm100.hopper.bwd_interface import sm90_bwd
    from fa_sm100.hopper.interface import sm90_fwd

    b, dv = TOKENS // s, default_head_dim_v(d)
    q, k = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    v, dout = (torch.randn(b, s, h, dv, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    fa4 = bwd_bench._fa4_fn()[0] if with_fa4 else None
    if with_fa4 and fa4 is None:
        raise RuntimeError("FlashAttention-4 is not importable here: pass --no-fa4")
    problem = problem or {}
    window = (problem.get("window_left"), problem.get("window_right"))
    det = problem.get("deterministic", False)
    out, lse = sm90_fwd(q, k, v, causal=causal, window_size=window, return_lse=True)
    runs = {}
    for name, fields in [("default", {})] + variants:
        cfg = cell_config("bwd", d, s, causal, fields, problem=problem)
        runs[name] = (lambda cfg=cfg: sm90_bwd(dout, q, k, v, out, lse, causal=causal,
                                                window_size=window, deterministic=det,
                                                config=cfg))
    for pairs in probe_list:
        runs[PROBE_PREFIX + probe_set_name(pairs)] = probed_call(runs["default"], pairs)
    if fa4 is not None:
        runs["fa4"] = bwd_bench._fa4_backward(fa4, q, k, v, dout, causal, det, window)
    ref = bwd_bench.reference_grads(q, k, v, dout, causal, torch.float32, window)
    plain = bwd_bench.reference_grads(q, k, v, dout, causal, torch.bfloat16, window)
    return runs, lambda grads: bwd_bench.check_grads(grads, ref, plain)


def probe_set_name(pairs):
    """``name=value[+name=value...]``: a set of probes as ``--probe`` spells it."""
    return "+".join(f"{name}={value}" for name, value in pairs)


def probed_call(run, pairs):
    """``run`` made inside the probes ``pairs`` (``((name, value), ...)``, active together):
    every call, so that each finds the probed kernel in the compile cache (Note [cost
    probes])."""
    def call():
        with probes.probes_active(pairs):
            return run()
    return call


def problem_label(problem):
    """The cell label's tail for ``--window`` / ``--deterministic``."""
    text = ""
    if "window_left" in problem:
        text += f" window ({problem['window_left']}, {problem['window_right']})"
    if problem.get("deterministic"):
        text += " deterministic"
    return text


def format_cell(label, times, calls, same=()):
    """The cell's lines: per provider the median ms and the paired speed-up over default with
    its 95% interval (``median_interval``; "[n/a]" below 6 rounds); variants in ``same`` are
    marked as building the default's kernels. With FA4, the ratios of the medians over it,
    then each run's paired speed-up over it with its interval."""
    speed = paired_speedups(times, "default")
    rounds = paired_speedup_rounds(times, "default")
    lines = [f"{label}: {len(times['default'])} rounds of {calls} calls"]
    for name, ms in times.items():
        mid, lo, hi = speed[name]
        ci = median_interval(rounds[name])
        lines.append(f"  {name:12s} {median(ms):9.4f} ms   x{mid:.3f} vs default "
                     f"{format_interval(ci)} (rounds {lo:.3f}-{hi:.3f})"
                     + ("   [same kernel as default: A/A]" if name in same else "")
                     + ("   [probe: results not checked]" if name.startswith(PROBE_PREFIX)
                        else ""))
    if "fa4" in times:
        fa4 = median(times["fa4"])
        lines.append("  over fa4: " + ", ".join(f"{n} {fa4 / median(ms):.3f}x"
                                                for n, ms in times.items() if n != "fa4"))
        over = paired_speedup_rounds(times, "fa4")
        lines.append("  over fa4, paired: " + ", ".join(
            f"{n} {median(r):.3f}x {format_interval(median_interval(r))}"
            for n, r in over.items() if n != "fa4"))
    return "\n".join(lines)


def main(argv=None):
    a = parse_args(argv)
    cells = [(d, s, c, h) for d in a.hdim for s in a.seqlen for c in a.causal
             for h in cell_heads(d, a.heads)]
    try:  # every config of the run, before any GPU work
        variants = parse_variants(a.variant, a.mode)
        fa4_variants = parse_fa4_variants(a.fa4_variant)
        probe_list = [probes.parse_probe_set(spec) for spec in a.probe]
        same = {}  # per cell: the variants that build the default's kernels
        for d, s, causal, h in cells:  # builds (so validates) every variant's config
            same[d, s, causal, h] = same_kernel_variants(a.mode, d, s, causal, variants, h,
                                                         problem=a.problem)
            for name, fields in same[d, s, causal, h].items():
                print(f"ab_bench: note: variant {name} ({', '.join(fields)}) builds the same "
                      f"kernels as the default at {a.mode} hdim {d} seqlen {s} "
                      f"{'causal' if causal else 'non-causal'}: the switch has no effect "
                      "there, so its ratio measures noise (an A/A check)", flush=True)
            for name, value in sum(probe_list, ()):  # nothing to probe stops the run
                probes.check_probe_config(name, value, cell_config(a.mode, d, s, causal, {},
                                                                   h, problem=a.problem))
    except ValueError as e:
        print(f"ab_bench: {e}", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("ab_bench needs an sm_90 GPU (H100/H200): the SM90 kernels are what it times",
              file=sys.stderr)
        return 2
    rows = []
    for i, (d, s, causal, h) in enumerate(cells):
        label = (f"[{i + 1}/{len(cells)}] {a.mode} hdim {d} seqlen {s} "
                 f"{'causal' if causal else 'non-causal'}")
        if a.heads:
            label += f" heads {h}"
        label += problem_label(a.problem)
        t0 = time.time()
        print(f"{label}: compiling and checking ...", flush=True)
        torch.manual_seed(i)
        try:
            if a.mode == "bwd":  # --fa4-variant is forward only (parse_args)
                runs, check = bwd_cell(d, s, causal, h, variants, not a.no_fa4, torch,
                                       probe_list, a.problem)
            else:
                runs, check = fwd_cell(d, s, causal, h, variants, fa4_variants, not a.no_fa4,
                                       torch, probe_list)
            for name, run in runs.items():
                if name.startswith(PROBE_PREFIX):  # compiled and run once, wrong by design
                    run()
                    torch.cuda.synchronize()
                    continue
                wrong = check(run())
                torch.cuda.synchronize()
                if wrong is not None:
                    print(f"{label}: {name} gave a wrong result: {wrong}", file=sys.stderr)
                    return 1
        except Exception as e:  # noqa: BLE001 - a provider that cannot run stops the A/B
            print(f"{label}: {error_text(e)}", file=sys.stderr)
            return 1
        calls = calls_per_round(events_ms(runs["default"], 3, torch), a.round_ms)
        # warm every provider once at full length
        warm_ms = {name: events_ms(run, calls, torch) for name, run in runs.items()}
        # the providers the host cannot keep busy (few calls: a full launch queue would make
        # the host wait for the GPU and look launch-bound)
        host = {name: host_and_gpu_ms(run, min(calls, LAUNCH_CHECK_CALLS), torch)
                for name, run in runs.items()}
        measure = (lambda run: events_ms(run, calls, torch))
        if a.top_clock:  # Note [top-clock timing]: a sleep as long as the default's call
            measure = (lambda run: duty_cycled_ms(run, calls, warm_ms["default"], torch))
        with ClockSampler() as clocks:
            times = paired_rounds(runs, a.rounds, measure)
        print(format_cell(label, times, calls, same[d, s, causal, h])
              + f"   ({time.time() - t0:.0f} s)", flush=True)
        conditions = clocks.result()
        if conditions is not None:
            print("  " + clock_summary([("all runs", conditions)]), flush=True)
        for name, (host_ms, gpu_ms) in host.items():
            if launch_bound(host_ms, gpu_ms):
                print(f"  WARNING {name}: launch-bound (the host takes {host_ms:.3f} ms to issue "
                      f"a call that runs {gpu_ms:.3f} ms): its time is the host's, not the "
                      "kernels'; use a longer --seqlen", flush=True)
        rows.append({"mode": a.mode, "head_dim": d, "seqlen": s, "causal": causal, "heads": h,
                     "window": [a.problem.get("window_left"), a.problem.get("window_right")],
                     "deterministic": a.problem.get("deterministic", False),
                     "calls": calls, "ms": times, "top_clock": a.top_clock,
                     "clock_mhz_w": conditions, "host_ms": {n: ms for n, (ms, _) in host.items()},
                     "speedup_vs_default": paired_speedups(times, "default"),
                     "same_kernel_as_default": sorted(same[d, s, causal, h])})
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "variants": a.variant,
                           "fa4_variants": a.fa4_variant, "probes": a.probe,
                           "rows": rows}, f, indent=1)
        del runs, check
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
