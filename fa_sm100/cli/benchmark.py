"""Forward attention throughput of several providers in one process on one GPU.

    python scripts/benchmark.py                       # the issue's grid (bf16, 16k tokens, hidden 2048)
    python scripts/benchmark.py --hdim 128 --seqlen 1024 4096 --causal false \\
        --providers ours fa4 --csv out.csv --json out.json --png out.png

Providers: ``ours`` (fa_sm100's forward), ``fa4`` (flash_attn.cute, when importable),
``cudnn`` and ``flash`` (torch SDPA with that backend forced). Each cell: batch =
total_tokens / seqlen, heads = hidden / hdim, fresh random inputs, median time of
``triton.testing.do_bench`` (CUDA events when triton is missing). V's head dim is the
forward's default for hdim (``fa_sm100.config.default_head_dim_v``: 128 with 192, else hdim).
TFLOP/s counts 2 * b * h * s_q * s_k * (d + dv) (the two GEMMs), halved for causal. Ratios
are against the best
peer measured in this run.

Every provider is timed through its public API, as a model calls it: ours through
``flash_attn_func``, FA4 through ``flash_attn.cute.flash_attn_func``, cuDNN and flash through
``torch.nn.functional.scaled_dot_product_attention``; the ratio of ours over the best peer is
on that path. ``--timing both`` (the default) adds ``ours:launch``, the launch alone
(``prepare_sm90_fwd``: validation, config, compile, SM count and the outputs decided once per
cell), as a labelled second column; ``--timing launch`` times only that as ``ours``.

Correctness: the first call of every provider in a cell is checked against a float32
reference on 64 query rows of every batch and head (the project's rule: error <= 2 x the
error of the same rows computed plainly in the input precision + 1e-3). A provider that is
wrong on a cell is not timed there; its row says "wrong output: ...". A provider that raises
reports the error instead of a number. Exit status 1 when any provider gave a wrong output or
ours (or a variant of it) failed on a cell; peers that cannot run a cell do not fail the run.

``--ours-variant`` cells where the variant sets only switches the kernels do not read there
(equal ``effective()`` configs) are named before any GPU work ("benchmark: note: ... A/A")
and listed under ``same_kernel_as_default`` in the JSON: the variant's ratio there is noise.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys


from fa_sm100.benchmarking import (MIN_ROUNDS, ClockSampler, cell_seed,
                                   clock_summary, format_interval, median, paired_interval,
                                   paired_ratio, plot_grid, ratio_points,
                                   same_kernel_variants, summarize_conditions, time_ms,
                                   verdict_summary, whole_cycles)

PROVIDERS = ("ours", "fa4", "cudnn", "flash")


def _bool(text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "on", "yes", "causal"):
        return True
    if low in ("0", "false", "off", "no", "noncausal"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a boolean")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["fwd", "bwd"], default="fwd",
                   help="bwd: time the backward (fa_sm100.hopper.bwd_bench) on the same grid")
    p.add_argument("--hdim", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--seqlen", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--causal", type=_bool, nargs="+", default=[False, True])
    p.add_argument("--total-tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    p.add_argument("--timing", choices=["public", "launch", "both"], default="both",
                   help="ours through flash_attn_func (public), its prepared launch alone "
                        "(launch), or both: the launch as the extra column ours:launch")
    p.add_argument("--ours-variant", action="append", default=[], metavar="NAME:FIELD=VALUE[,...]",
                   help="also time ours with these SM90 config overrides, as provider ours:NAME "
                        "(repeatable), e.g. --ours-variant nopp:pingpong=false; the cells where "
                        "it builds the default's kernels (an A/A check) are named before the run")
    p.add_argument("--repeat", type=int, default=None,
                   help="rounds per cell, provider order balanced for carry-over "
                        "(fa_sm100.benchmarking.round_order; default: whole cycles of it, at "
                        "least 6: 8 for the forward's four providers, 6 for three); the median "
                        "of the rounds is kept (the slower one of two), and ours over the best "
                        "peer is also reported paired by round (column 'paired')")
    p.add_argument("--warmup", type=int, default=25, help="ms of warmup per cell")
    p.add_argument("--rep", type=int, default=100, help="ms of timed repetitions per cell")
    p.add_argument("--csv")
    p.add_argument("--json")
    p.add_argument("--png")
    args = p.parse_args(argv)
    if args.repeat is not None and args.repeat < 1:
        p.error(f"--repeat {args.repeat}: must be at least 1")
    for s in args.seqlen:
        if s < 1 or args.total_tokens % s:
            p.error(f"--seqlen {s} must divide --total-tokens {args.total_tokens}")
    for d in args.hdim:
        if args.hidden % d:
            p.error(f"--hdim {d} must divide --hidden {args.hidden}")
    return args


def flops(b, h, sq, sk, d, dv, causal):
    f = 2.0 * b * h * sq * sk * (d + dv)
    return f / 2 if causal else f


def prepare_ours(q, k, v, causal, config=None):
    """ours for one cell through the public API: a no-argument callable that calls
    ``flash_attn_func`` (its warm path: the call plan, then allocate and launch)."""
    from fa_sm100.interface import flash_attn_func

    return lambda: flash_attn_func(q, k, v, causal=causal, config=config)


def prepare_ours_launch(q, k, v, causal, config=None):
    """ours, launch only (the second column): on sm_90 ``prepare_sm90_fwd`` plans and allocates
    once, and the callable only launches; elsewhere the public function."""
    import torch

    if torch.cuda.get_device_capability(q.device) == (9, 0):
        from fa_sm100.hopper.interface import prepare_sm90_fwd

        return prepare_sm90_fwd(q, k, v, causal=causal, config=config)
    return prepare_ours(q, k, v, causal, config)


def provider_names(args) -> list:
    """The table's columns: the providers, ``ours:launch`` after them with ``--timing both``,
    then the variants."""
    names = list(args.providers)
    if "ours" in names and args.timing == "both":
        names.append("ours:launch")
    return names + [f"ours:{v.partition(':')[0]}" for v in args.ours_variant]


def make_variant(spec, torch):
    """ours with SM90 config overrides: ``NAME:field=value,field=value``."""
    from fa_sm100.config import parse_variant
    from fa_sm100.hopper.config import Sm90FwdConfig, select_sm90_fwd_config

    name, overrides = parse_variant(spec, Sm90FwdConfig)
    overrides.setdefault("write_lse", False)  # as ``ours``: nobody reads the LSE here

    def prepare(q, k, v, causal):
        d, dv = q.shape[-1], v.shape[-1]
        cfg = select_sm90_fwd_config(d, dv, str(q.dtype).split(".")[-1], causal,
                                     seqlen_k=k.shape[1], seqlen_q=q.shape[1],
                                     batch_heads=q.shape[0] * q.shape[2], **overrides)
        return prepare_ours(q, k, v, causal, config=cfg)

    return f"ours:{name}", prepare


def same_kernel_cells(args) -> dict:
    """{variant name: [[hdim, causal, seqlen], ...]}: the grid's cells where an
    ``--ours-variant`` builds the same kernels as the default (equal ``effective()`` configs:
    it sets only switches the kernels do not read there), so that its ratio there measures
    noise, not the switch. Needs no GPU. An unknown field raises ValueError; a cell where the
    default's or a variant's config cannot be built (a head dim ours lacks, a switch invalid
    there) is left to the run, which reports it for that provider."""
    from fa_sm100.config import parse_variant

    if args.mode == "bwd":
        from fa_sm100.hopper.bwd_config import BwdConfig as config_class
    else:
        from fa_sm100.hopper.config import Sm90FwdConfig as config_class
    variants = [parse_variant(spec, config_class) for spec in args.ours_variant]
    dtype = {"bf16": "bfloat16", "fp16": "float16"}[args.dtype]
    found = {}
    for d in args.hdim:
        for causal in args.causal:
            for s in args.seqlen:
                try:
                    same = same_kernel_variants(args.mode, d, s, causal, variants, None,
                                                args.total_tokens, args.hidden, dtype,
                                                skip_invalid=True)
                except ValueError:
                    continue  # no default kernel here: the run reports the cell
                for name in same:
                    found.setdefault(name, []).append([d, causal, s])
    return found


def print_same_kernel_notes(found: dict, cells: int) -> None:
    """One line per variant of ``same_kernel_cells``: where it is an A/A check."""
    for name, where in found.items():
        listed = ", ".join(f"hdim {d} {'causal' if c else 'non-causal'} {s}" for d, c, s in where)
        print(f"benchmark: note: variant {name} builds the same kernels as the default in "
              f"{len(where)} of {cells} cells (A/A: its ratio there measures noise): {listed}")


def make_provider(name, torch):
    """``prepare(q, k, v, causal) -> run``, where ``run()`` computes the output; raise with the
    reason when the provider is unavailable. Work done by ``prepare`` is not timed."""
    if name == "ours":
        return prepare_ours
    if name == "ours:launch":
        return prepare_ours_launch
    if name == "fa4":
        from flash_attn.cute import flash_attn_func as fa4

        def run(q, k, v, causal):
            out = fa4(q, k, v, causal=causal)
            return out[0] if isinstance(out, tuple) else out

        return lambda q, k, v, causal: (lambda: run(q, k, v, causal))
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[name]

    def run(q, k, v, causal):
        # SDPA takes BHSD; transposed views keep the BSHD memory of the other providers.
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal
            ).transpose(1, 2)

    return lambda q, k, v, causal: (lambda: run(q, k, v, causal))


CHECK_ROWS = 64  # query rows per (batch, head) in the correctness check


def check_rows(seqlen_q: int, torch, device="cpu"):
    """The query rows the check reads: evenly spaced, the first and the last included."""
    n = min(CHECK_ROWS, seqlen_q)
    return torch.linspace(0, seqlen_q - 1, n, device=device).round().long().unique()


def attention_rows(q, k, v, causal, rows, dtype, torch):
    """softmax(q k^T / sqrt(d)) v for the query ``rows`` of every batch and head, in ``dtype``.

    float32: the reference. The input dtype (S and P rounded to it, as a plain implementation
    in that precision would): the baseline of the error rule. Causal is bottom-right aligned
    (query i sees keys j <= i + seqlen_k - seqlen_q), the convention of every provider here.
    """
    sq, h, d = q.shape[1], q.shape[2], q.shape[3]
    sk, hk = k.shape[1], k.shape[2]
    kf = k.to(dtype).repeat_interleave(h // hk, dim=2)
    vf = v.to(dtype).repeat_interleave(h // hk, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q[:, rows].to(dtype), kf) * (1.0 / math.sqrt(d))
    if causal:
        visible = torch.arange(sk, device=q.device)[None, :] <= rows[:, None] + (sk - sq)
        s = s.masked_fill(~visible, float("-inf"))
    p = torch.nan_to_num(torch.softmax(s.float(), dim=-1), nan=0.0).to(dtype)
    return torch.einsum("bhqk,bkhd->bqhd", p, vf)


def check_output(out, q, k, v, causal, torch):
    """None when ``out`` (b, s, h, dv) is right on the checked rows, else the reason."""
    from fa_sm100.testing import check_against_reference

    want_shape = (*q.shape[:3], v.shape[-1])
    if tuple(out.shape) != want_shape:
        return f"shape {tuple(out.shape)}, expected {want_shape}"
    rows = check_rows(q.shape[1], torch, q.device)
    ref = attention_rows(q, k, v, causal, rows, torch.float32, torch)
    plain = attention_rows(q, k, v, causal, rows, q.dtype, torch)
    try:
        check_against_reference(out[:, rows], ref, plain, atol=1e-3, what="output")
    except AssertionError as e:
        return str(e)
    return None


def run_cell(providers, q, k, v, causal, repeat, measure, torch, on_step=None, monitor=None,
             conditions=None):
    """``fa_sm100.benchmarking.run_cell`` on one forward cell: ``providers[name](q, k, v,
    causal)`` prepares, ``check_output`` checks the first output of each."""
    from fa_sm100.benchmarking import run_cell as run_rounds

    prepares = {name: (lambda p=p: p(q, k, v, causal)) for name, p in providers.items()}
    return run_rounds(prepares, lambda out: check_output(out, q, k, v, causal, torch), repeat,
                      measure, sync=torch.cuda.synchronize if q.is_cuda else None,
                      on_step=on_step, monitor=monitor, conditions=conditions)


def exit_status(rows) -> int:
    """1 when a provider gave a wrong output, or ours (or a variant) failed on a cell."""
    for r in rows:
        err = r.get("error") or ""
        if err.startswith("wrong output") or (r["provider"].startswith("ours") and err):
            return 1
    return 0


def progress(i, n, label):
    width = 30
    done = int(width * i / n)
    sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {i}/{n} {label:<48}")
    sys.stderr.flush()
    if i == n:
        sys.stderr.write("\n")


def run_grid(args):
    import torch

    from fa_sm100.config import default_head_dim_v

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    providers = {}
    unavailable = {}
    for name in args.providers:
        try:
            providers[name] = make_provider(name, torch)
        except Exception as e:  # noqa: BLE001 - an absent peer is reported, not fatal
            unavailable[name] = f"{type(e).__name__}: {e}"
    if "ours" in providers and args.timing == "launch":
        providers["ours"] = prepare_ours_launch
    elif "ours" in providers and args.timing == "both":
        providers["ours:launch"] = prepare_ours_launch
    for spec in args.ours_variant:
        label, fn = make_variant(spec, torch)
        providers[label] = fn
    cells = [(d, c, s) for d in args.hdim for c in args.causal for s in args.seqlen]
    repeat = args.repeat or whole_cycles(MIN_ROUNDS, len(providers))
    total = len(cells) * len(providers) * repeat
    rows, step = [], 0
    for d, causal, s in cells:
        b, h = args.total_tokens // s, args.hidden // d
        gen = torch.Generator(device="cuda")
        gen.manual_seed(cell_seed(d, s, causal))
        dv = default_head_dim_v(d)
        q, k = (torch.randn(b, s, h, d, device="cuda", dtype=dtype, generator=gen)
                for _ in range(2))
        v = torch.randn(b, s, h, dv, device="cuda", dtype=dtype, generator=gen)

        def on_step(name):
            nonlocal step
            step += 1
            progress(step, total, f"hdim {d} {'causal' if causal else 'noncausal'} seqlen {s} {name}")

        conditions = {}
        times, errors = run_cell(providers, q, k, v, causal, repeat,
                                 lambda fn: time_ms(fn, args.warmup, args.rep, torch), torch,
                                 on_step, monitor=lambda: ClockSampler(q.device.index or 0),
                                 conditions=conditions)
        peers = [p for p in providers if not p.startswith("ours")]
        for name in providers:
            row = {"provider": name, "hdim": d, "hdim_v": dv, "causal": causal, "seqlen": s,
                   "batch": b, "heads": h, "ms": None, "tflops": None, "mhz": None,
                   "watts": None, "error": errors.get(name),
                   # ours only: over the best peer, round by round (paired_ratio), and the
                   # 95% interval of that median (paired_interval)
                   "ratio_paired": paired_ratio(times, name, peers) if name == "ours" else None,
                   "ratio_paired_ci": (paired_interval(times, name, peers) if name == "ours"
                                       else None),
                   "rounds_ms": list(times[name])}
            if times[name]:
                ms = median(times[name])
                row["ms"] = ms
                row["tflops"] = flops(b, h, s, s, d, dv, causal) / (ms * 1e-3) / 1e12
            row["mhz"], row["watts"] = (summarize_conditions(conditions.get(name, []))
                                        or (None, None))
            rows.append(row)
    for name, why in unavailable.items():
        for d, causal, s in cells:
            rows.append({"provider": name, "hdim": d, "causal": causal, "seqlen": s,
                         "batch": args.total_tokens // s, "heads": args.hidden // d, "ms": None,
                         "tflops": None, "error": f"unavailable: {why}"})
    return rows, torch.cuda.get_device_name(), unavailable


def table(rows, providers):
    """Markdown table: one line per (hdim, causal, seqlen), TFLOP/s per provider, ours over the
    best peer (ratio of the medians) and, when the rows carry it, the paired ratio
    (``fa_sm100.benchmarking.paired_ratio``) with its 95% interval (``paired_interval``)."""
    keys = sorted({(r["hdim"], r["causal"], r["seqlen"]) for r in rows})
    by = {(r["hdim"], r["causal"], r["seqlen"], r["provider"]): r for r in rows}
    peers = [p for p in providers if not p.startswith("ours")]
    head = ["hdim", "causal", "seqlen", *providers]
    paired = any(r.get("ratio_paired") for r in rows)
    if "ours" in providers and peers:
        head.append("ours / best peer")
        if paired:
            head.append("paired")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for d, c, s in keys:
        vals = []
        for p in providers:
            r = by.get((d, c, s, p))
            vals.append(f"{r['tflops']:.0f}" if r and r["tflops"] else "n/a")
        line = [str(d), "yes" if c else "no", str(s), *vals]
        if "ours" in providers and peers:
            ours = by.get((d, c, s, "ours"))
            best = max((by[(d, c, s, p)]["tflops"] or 0.0 for p in peers if (d, c, s, p) in by),
                       default=0.0)
            line.append(f"{ours['tflops'] / best:.2f}x" if ours and ours["tflops"] and best else "n/a")
            if paired:
                line.append(f"{ours['ratio_paired']:.3f}x "
                            f"{format_interval(ours.get('ratio_paired_ci'))}"
                            if ours and ours.get("ratio_paired") else "n/a")
        lines.append("| " + " | ".join(line) + " |")
    return "\n".join(lines)


def csv_row(row: dict, device: str) -> dict:
    """A forward row as CSV columns: the interval as ``ratio_paired_lo`` / ``_hi`` (empty
    without one), the rounds' times left to the JSON, the device added."""
    out = {k: v for k, v in row.items() if k not in ("ratio_paired_ci", "rounds_ms")}
    interval = row.get("ratio_paired_ci") or (None, None)
    out["ratio_paired_lo"], out["ratio_paired_hi"] = interval
    out["device"] = device
    return out


def plot(rows, providers, path, device):
    """The forward grid's PNG (``fa_sm100.benchmarking.plot_grid``)."""
    plot_grid(rows, providers, path, f"forward attention, {device}")


def main(argv=None):
    args = parse_args(argv)
    try:  # before any GPU work
        same = same_kernel_cells(args)
    except ValueError as e:
        print(f"benchmark: {e}", file=sys.stderr)
        return 2
    print_same_kernel_notes(same, len(args.hdim) * len(args.causal) * len(args.seqlen))
    if args.mode == "bwd":
        from fa_sm100.hopper.bwd_bench import run_from_benchmark_args

        return run_from_benchmark_args(args, {"same_kernel_as_default": same})
    rows, device, unavailable = run_grid(args)
    providers = provider_names(args)
    print(f"device: {device}")
    for name, why in unavailable.items():
        print(f"provider {name} unavailable: {why}")
    print(table(rows, providers))
    points = ratio_points(rows)
    if points:
        print(verdict_summary(p.interval for p in points))
    clocks = clock_summary((r["provider"], (r["mhz"], r["watts"]) if r.get("mhz") else None)
                           for r in rows)
    if clocks:
        print(clocks)
    for r in rows:
        if r["error"] and not r["error"].startswith("unavailable"):
            print(f"{r['provider']} hdim {r['hdim']} causal {r['causal']} seqlen {r['seqlen']}: {r['error']}")
    meta = {"device": device, "command": " ".join(sys.argv), "dtype": args.dtype,
            "total_tokens": args.total_tokens, "hidden": args.hidden,
            "same_kernel_as_default": same}
    if args.csv:
        import csv

        flat = [csv_row(r, device) for r in rows]
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(flat[0].keys()))
            w.writeheader()
            w.writerows(flat)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**meta, "rows": rows}, f, indent=1)
    if args.png:
        plot(rows, providers, args.png, device)
    status = exit_status(rows)
    if status:
        print("FAILED: a provider gave a wrong output, or ours failed on a cell (see above)",
              file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
