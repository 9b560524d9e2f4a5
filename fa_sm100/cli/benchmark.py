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

``--grid models`` times the cells models run instead of the hdim x seqlen x causal grid
(``fa_sm100.bench_cells.MODEL_CELLS``: GQA 4:1 and 8:1 at head dims 128 and 64, MQA prefill,
the (192, 128) head dims), forward or (``--mode bwd``) backward, with the same providers,
method and columns; ``--hdim``, ``--seqlen``, ``--causal``, ``--total-tokens`` and
``--hidden`` shape the default grid only. Its rows also carry ``cell`` (the cell's label) and
``heads_kv``; its figure is one group of bars per cell. SDPA runs GQA/MQA with
``enable_gqa=True``. Where SDPA's backend does not take a cell's shape (torch's own
``can_use_cudnn_attention`` / ``can_use_flash_attention`` on the cell's tensors), that peer is
absent there: its row says ``absent`` (``cudnn_absent`` in the backward's) with torch's
reason, is not timed, and is no error. TFLOP/s count the query heads, as FA does.

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


from fa_sm100.bench_cells import MODEL_CELLS, SDPA_BACKENDS, default_grid_cell, sdpa_refusal
from fa_sm100.benchmarking import (MIN_ROUNDS, ClockSampler, cell_seed,
                                   clock_summary, format_interval, median, paired_interval,
                                   paired_ratio, plot_grid, plot_mode_bars, ratio_points,
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
    p.add_argument("--grid", choices=["default", "models"], default="default",
                   help="models: the cells models run (GQA, MQA, (192,128) prefill: "
                        "fa_sm100.bench_cells.MODEL_CELLS) instead of hdim x seqlen x causal")
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
    if args.grid == "models" and args.ours_variant:
        p.error("--ours-variant times the default grid only (its A/A notes are made for its "
                "cells)")
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

    backend = getattr(SDPBackend, SDPA_BACKENDS[name][0])

    def run(q, k, v, causal):
        # SDPA takes BHSD; transposed views keep the BSHD memory of the other providers.
        gqa = {"enable_gqa": True} if k.shape[2] != q.shape[2] else {}
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, **gqa
            ).transpose(1, 2)

    return lambda q, k, v, causal: (lambda: run(q, k, v, causal))


def absent_peers(names, cell, dtype, torch) -> dict:
    """{provider: why} for the SDPA providers among ``names`` that do not take ``cell``
    (``sdpa_refusal``): absent from that cell, not timed, not an error."""
    found = {}
    for name in names:
        why = sdpa_refusal(name, cell, dtype, torch) if name in SDPA_BACKENDS else None
        if why is not None:
            found[name] = why
    return found


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


def grid_cells(args) -> list:
    """The ``BenchCell``s a run times, in order: ``--grid models``'s, or the default grid's
    (every hdim, then causality, then seqlen)."""
    if args.grid == "models":
        return list(MODEL_CELLS)
    return [default_grid_cell(d, s, c, args.total_tokens, args.hidden)
            for d in args.hdim for c in args.causal for s in args.seqlen]


def cell_inputs(cell, dtype, torch):
    """Fresh random q, k, v of ``cell`` on the GPU, seeded by the cell (``cell_seed``)."""
    gen = torch.Generator(device="cuda")
    gen.manual_seed(cell_seed(cell.head_dim, cell.seqlen, cell.causal))
    return tuple(torch.randn(shape, device="cuda", dtype=dtype, generator=gen)
                 for shape in cell.shapes)


def cell_keys(cell, named: bool) -> dict:
    """A row's keys that say which cell it is; ``named`` (``--grid models``) adds the cell's
    label and its KV heads."""
    keys = {"hdim": cell.head_dim, "hdim_v": cell.head_dim_v, "causal": cell.causal,
            "seqlen": cell.seqlen, "batch": cell.batch, "heads": cell.heads}
    return {"cell": cell.label, **keys, "heads_kv": cell.heads_kv} if named else keys


def row_where(row) -> str:
    """A forward row's cell in words: its label, or hdim, causality and seqlen."""
    return row.get("cell") or f"hdim {row['hdim']} causal {row['causal']} seqlen {row['seqlen']}"


def run_grid(args):
    import torch

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
    named = args.grid == "models"
    plan = []  # (cell, its providers, its absent peers, its rounds)
    for cell in grid_cells(args):
        gone = absent_peers(providers, cell, dtype, torch)
        names = [name for name in providers if name not in gone]
        plan.append((cell, names, gone, args.repeat or whole_cycles(MIN_ROUNDS, len(names))))
    total = sum(len(names) * repeat for _, names, _, repeat in plan)
    rows, step = [], 0
    for cell, names, gone, repeat in plan:
        b, h, s, d, dv, causal = (cell.batch, cell.heads, cell.seqlen, cell.head_dim,
                                  cell.head_dim_v, cell.causal)
        q, k, v = cell_inputs(cell, dtype, torch)
        where = (cell.label if named else
                 f"hdim {d} {'causal' if causal else 'noncausal'} seqlen {s}")

        def on_step(name):
            nonlocal step
            step += 1
            progress(step, total, f"{where} {name}")

        conditions = {}
        times, errors = run_cell({name: providers[name] for name in names}, q, k, v, causal,
                                 repeat, lambda fn: time_ms(fn, args.warmup, args.rep, torch),
                                 torch, on_step, monitor=lambda: ClockSampler(q.device.index or 0),
                                 conditions=conditions)
        peers = [p for p in names if not p.startswith("ours")]
        keys = cell_keys(cell, named)
        for name in names:
            row = {"provider": name, **keys, "ms": None, "tflops": None, "mhz": None,
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
        for name, why in gone.items():
            rows.append({"provider": name, **keys, "ms": None, "tflops": None, "error": None,
                         "absent": why})
    for name, why in unavailable.items():
        for cell, *_ in plan:
            keys = {k: x for k, x in cell_keys(cell, named).items() if k != "hdim_v"}
            rows.append({"provider": name, **keys, "ms": None, "tflops": None,
                         "error": f"unavailable: {why}"})
    return rows, torch.cuda.get_device_name(), unavailable


def table(rows, providers):
    """Markdown table: one line per cell ((hdim, causal, seqlen), or ``--grid models``' cell
    label, in grid order), TFLOP/s per provider, ours over the best peer (ratio of the medians)
    and, when the rows carry it, the paired ratio (``fa_sm100.benchmarking.paired_ratio``)
    with its 95% interval (``paired_interval``)."""
    named = any("cell" in r for r in rows)
    cell_of = ((lambda r: r["cell"]) if named else
               (lambda r: (r["hdim"], r["causal"], r["seqlen"])))
    keys = list(dict.fromkeys(map(cell_of, rows))) if named else sorted(set(map(cell_of, rows)))
    by = {(cell_of(r), r["provider"]): r for r in rows}
    peers = [p for p in providers if not p.startswith("ours")]
    head = ["cell" if named else "hdim", *([] if named else ["causal", "seqlen"]), *providers]
    paired = any(r.get("ratio_paired") for r in rows)
    if "ours" in providers and peers:
        head.append("ours / best peer")
        if paired:
            head.append("paired")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for cell in keys:
        vals = []
        for p in providers:
            r = by.get((cell, p))
            vals.append(f"{r['tflops']:.0f}" if r and r["tflops"] else "n/a")
        line = ([cell] if named else [str(cell[0]), "yes" if cell[1] else "no", str(cell[2])])
        line += vals
        if "ours" in providers and peers:
            ours = by.get((cell, "ours"))
            best = max((by[(cell, p)]["tflops"] or 0.0 for p in peers if (cell, p) in by),
                       default=0.0)
            line.append(f"{ours['tflops'] / best:.2f}x" if ours and ours["tflops"] and best
                        else "n/a")
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


def plot_cells(rows, providers, path, device, mode="fwd"):
    """``--grid models``' PNG: one group of bars per cell, TFLOP/s of each provider
    (``fa_sm100.benchmarking.plot_mode_bars``), from rows of one provider and cell each (the
    forward's; the backward's through ``bwd_bench.long_rows``) that carry ``cell``."""
    bars = {}
    for r in rows:
        bar = bars.setdefault(r["cell"], {"mode": mode, "cell": r["cell"], "tflops": {}})
        if r.get("tflops"):
            bar["tflops"][r["provider"]] = r["tflops"]
    name = {"fwd": "forward", "bwd": "backward"}[mode]

    def label(bar):  # "32q/8kv d128 8k causal b2" as "32q/8kv", "d128", "8k", "causal b2"
        return bar["cell"].replace(" ", "\n", 3)

    plot_mode_bars(list(bars.values()), providers, path,
                   f"the cells models run, through the public APIs, {device}", label,
                   lambda m, cells: f"{name}, TFLOP/s counting the query heads")


def print_verdicts(rows) -> None:
    """The count of ``interval_verdict``s over the rows' paired intervals, if any."""
    points = ratio_points(rows)
    if points:
        print(verdict_summary(p.interval for p in points))


def write_results(args, meta, rows, csv_rows, draw) -> None:
    """``--csv`` (``csv_rows``: their keys, in order of first use, are the columns),
    ``--json`` (``meta`` and ``rows``) and ``--png`` (``draw(path)``)."""
    if args.csv and csv_rows:
        import csv

        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in csv_rows for k in r)))
            w.writeheader()
            w.writerows(csv_rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**meta, "rows": rows}, f, indent=1)
    if args.png:
        draw(args.png)


def run_models_bwd(args, meta) -> int:
    """``--grid models --mode bwd``: ``bwd_bench.bench_cell`` (ours through autograd,
    ``ours:launch``, FA4, cuDNN; its check and rows) on every cell, cuDNN's column marked
    ``cudnn_absent`` where SDPA does not take the cell (``sdpa_refusal``); the JSON holds
    ``meta`` and the rows (each with its ``cell``), the CSV and the PNG the rows of one
    provider and cell each. Returns ``bwd_bench.exit_status``."""
    import torch

    from fa_sm100.hopper import bwd_bench

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    rows = []
    for cell in MODEL_CELLS:
        row = bwd_bench.bench_cell(cell.batch, cell.heads, cell.heads_kv, cell.seqlen,
                                   cell.head_dim, cell.causal, dtype=dtype, repeat=args.repeat,
                                   warmup=args.warmup, rep=args.rep, timing=args.timing)
        why = sdpa_refusal("cudnn", cell, dtype, torch)
        if why is not None and "cudnn_tflops" not in row:  # its call raised: the shape, not it
            row.pop("cudnn_error", None)
            row["cudnn_absent"] = why
        rows.append({"cell": cell.label, **row})
        print(bwd_bench.format_row(rows[-1]) + (f"\n    cudnn: absent ({why})" if why else ""),
              flush=True)
    bwd_bench.print_clocks(rows)
    print_verdicts(rows)
    device = torch.cuda.get_device_name()
    long = [{"cell": r["cell"], **x} for r in rows for x in bwd_bench.long_rows([r])]
    names = ["ours", *(["ours:launch"] if args.timing == "both" else []), "fa4", "cudnn"]
    write_results(args, {**meta, "mode": "bwd", "device": device}, rows,
                  [{**x, "device": device} for x in long],
                  lambda path: plot_cells(long, names, path, device, "bwd"))
    return bwd_bench.exit_status(rows)


def main(argv=None):
    args = parse_args(argv)
    models = args.grid == "models"
    try:  # before any GPU work
        same = same_kernel_cells(args)
    except ValueError as e:
        print(f"benchmark: {e}", file=sys.stderr)
        return 2
    print_same_kernel_notes(same, len(args.hdim) * len(args.causal) * len(args.seqlen))
    meta = {"command": " ".join(sys.argv), "dtype": args.dtype}
    if args.mode == "bwd":
        if models:
            return run_models_bwd(args, {**meta, "grid": "models"})
        from fa_sm100.hopper.bwd_bench import run_from_benchmark_args

        return run_from_benchmark_args(args, {"same_kernel_as_default": same})
    rows, device, unavailable = run_grid(args)
    providers = provider_names(args)
    print(f"device: {device}")
    for name, why in unavailable.items():
        print(f"provider {name} unavailable: {why}")
    print(table(rows, providers))
    print_verdicts(rows)
    clocks = clock_summary((r["provider"], (r["mhz"], r["watts"]) if r.get("mhz") else None)
                           for r in rows)
    if clocks:
        print(clocks)
    for r in rows:
        if r["error"] and not r["error"].startswith("unavailable"):
            print(f"{r['provider']} {row_where(r)}: {r['error']}")
        if r.get("absent"):
            print(f"{r['provider']} {row_where(r)}: absent ({r['absent']})")
    meta = {"device": device, **meta}
    if models:
        meta.update(grid="models", mode="fwd")
    else:
        meta.update(total_tokens=args.total_tokens, hidden=args.hidden,
                    same_kernel_as_default=same)
    write_results(args, meta, rows, [csv_row(r, device) for r in rows],
                  lambda path: (plot_cells if models else plot)(rows, providers, path, device))
    status = exit_status(rows)
    if status:
        print("FAILED: a provider gave a wrong output, or ours failed on a cell (see above)",
              file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
