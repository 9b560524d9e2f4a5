"""Reading Nsight Compute's CSV exports of a profiled call, kernel by kernel (no GPU needed).

``scripts/ncu_bwd.py`` profiles one backward cell (ours and FA4) with ``ncu --set full`` and
exports three pages of each report; this module reads them and condenses what the backward's profile needed
by hand into tables that put two kernels side by side:

- ``details`` (``ncu -i R --page details --csv``): one row per (kernel, section, metric):
  ``kernel_times`` takes each kernel's duration, elapsed cycles and SM clock;
- ``raw`` (``--page raw --csv``): one row per kernel, one column per metric, a units row
  under the header: ``raw_metrics``; ``stall_samples`` picks the sampled warp states
  (``smsp__pcsamp_warps_issue_stalled_*``; ``warpgroup_arrive`` among them: the samples the
  ``source`` page leaves without a reason);
- ``source`` (``--page source --csv --print-source sass``): per kernel a ``"Kernel Name",``
  line, a header and one row per SASS instruction with its executed count and sampled stalls:
  ``source_rows``; ``main_loop`` keeps the instructions executed exactly as often as the
  kernel's most executed HGMMA (the straight-line body of its MMA loop), and ``loop_opcodes``
  counts them per warp and loop turn.

Each reader also takes the CSV gzip-compressed (a name ending in ``.gz``). Kernels are picked
by a substring of their name (``find_kernel``): ``Sm90FlashBackward`` for
ours, ``FlashAttentionBackwardSm90`` for FA4's main kernel.
"""

from __future__ import annotations

import collections
import csv
import gzip
import io
import re
from typing import Dict, List, Mapping

STALL_PREFIX = "smsp__pcsamp_warps_issue_stalled_"
ALL_SAMPLES = "Warp Stall Sampling (All Samples)"


def _open(path: str):
    """A CSV export for reading as text, gzip-compressed when its name ends in ``.gz``."""
    if path.endswith(".gz"):
        return gzip.open(path, "rt", newline="")
    return open(path, newline="")


def _number(text: str) -> float:
    """A metric value as ncu prints it ("13,769,267", "74.69", "" for none) -> float."""
    text = text.strip().replace(",", "")
    return float(text) if text else float("nan")


def find_kernel(names, key: str) -> str:
    """The one name in ``names`` that contains ``key``; ValueError for none or several."""
    hits = [n for n in names if key in n]
    if len(hits) != 1:
        raise ValueError(f"{len(hits)} kernels match {key!r} among {sorted(names)}")
    return hits[0]


def kernel_times(details_csv: str) -> Dict[str, dict]:
    """Per kernel (in launch order): ``duration_us``, ``cycles`` (elapsed) and ``sm_ghz`` of
    a ``details`` page. Durations are converted to microseconds from ncu's unit."""
    scale = {"ns": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6,
             "second": 1e6, "nsecond": 1e-3}
    out: Dict[str, dict] = {}
    with _open(details_csv) as f:
        for row in csv.DictReader(f):
            name = f"{row['ID']}: {row['Kernel Name']}"
            entry = out.setdefault(name, {})
            metric, unit = row["Metric Name"], row["Metric Unit"].strip()
            if metric == "Duration":
                if unit not in scale:
                    raise ValueError(f"{details_csv}: duration in unknown unit {unit!r}")
                entry["duration_us"] = _number(row["Metric Value"]) * scale[unit]
            elif metric == "Elapsed Cycles":
                entry["cycles"] = _number(row["Metric Value"])
            elif metric == "SM Frequency":
                ghz = _number(row["Metric Value"])
                entry["sm_ghz"] = ghz / 1e3 if unit.lower().startswith("mhz") else ghz
    return out


def raw_metrics(raw_csv: str) -> Dict[str, Dict[str, float]]:
    """Per kernel (``"ID: name"``): every numeric metric of a ``raw`` page (the row of units
    under the header is skipped; text-valued metrics are left out)."""
    with _open(raw_csv) as f:
        rows = list(csv.reader(f))
    header = rows[0]
    name_col, id_col = header.index("Kernel Name"), header.index("ID")
    out = {}
    for row in rows[2:]:
        metrics = {}
        for key, value in zip(header, row):
            try:
                metrics[key] = _number(value)
            except ValueError:
                continue
        out[f"{row[id_col]}: {row[name_col]}"] = metrics
    return out


def stall_samples(metrics: Mapping[str, float]) -> Dict[str, float]:
    """The sampled warp states of one kernel's raw metrics, by reason (all samples, issued
    or not), largest first; ``sample_count`` is the total."""
    out = {k[len(STALL_PREFIX):]: v for k, v in metrics.items()
           if k.startswith(STALL_PREFIX) and not k.endswith("_not_issued") and v == v}
    out = dict(sorted(out.items(), key=lambda kv: -kv[1]))
    out["sample_count"] = metrics.get("smsp__pcsamp_sample_count", float("nan"))
    return out


def source_rows(source_csv: str) -> Dict[str, List[dict]]:
    """Per kernel name: the SASS rows of a ``source`` page (address, source, executed count,
    samples and one column per stall reason, as ncu names them)."""
    with _open(source_csv) as f:
        text = f.read()
    out = {}
    for part in re.split(r'^"Kernel Name",', text, flags=re.M)[1:]:
        name, _, rest = part.partition("\n")
        name = next(csv.reader([name]))[0]
        out[name] = list(csv.DictReader(io.StringIO(rest)))
    return out


def opcode(source: str) -> str:
    """The opcode of a SASS line, without its predicate (``@!P0 BRA x`` -> ``BRA``)."""
    words = source.split()
    return words[1] if words and words[0].startswith("@") else (words[0] if words else "")


def main_loop(rows: List[dict]) -> List[dict]:
    """The rows executed exactly as often as the most executed HGMMA: the straight-line body
    of the kernel's MMA loop (its branches around masks and waits excluded)."""
    hgmma = [int(r["Instructions Executed"] or 0) for r in rows
             if opcode(r["Source"]).startswith("HGMMA")]
    if not hgmma:
        raise ValueError("no HGMMA among the rows: not an MMA kernel")
    turns = max(hgmma)
    return [r for r in rows if int(r["Instructions Executed"] or 0) == turns]


def loop_opcodes(rows: List[dict]) -> Dict[str, int]:
    """Opcodes of ``main_loop(rows)`` counted once per warp and loop turn."""
    return dict(collections.Counter(opcode(r["Source"]) for r in main_loop(rows)).most_common())


def loop_samples(rows: List[dict]) -> Dict[str, int]:
    """Sampled warp states in ``main_loop(rows)`` by opcode, largest first, and ``total``."""
    counts = collections.Counter()
    for r in main_loop(rows):
        counts[opcode(r["Source"])] += int(r[ALL_SAMPLES] or 0)
    out = dict(counts.most_common())
    out["total"] = sum(counts.values())
    return out


def side_by_side(columns: Mapping[str, Mapping[str, float]], keys=None, fmt="{:>14,.0f}"):
    """Lines of a table: one row per key (``keys``, or every key of the first column in its
    order), one column per entry of ``columns``; a missing value prints as "-"."""
    names = list(columns)
    keys = list(keys) if keys is not None else list(columns[names[0]])
    width = max([len(k) for k in keys] + [8])
    lines = [" " * width + "".join(f"{n[:14]:>15}" for n in names)]
    for k in keys:
        cells = []
        for n in names:
            v = columns[n].get(k)
            cells.append(" " + (fmt.format(v) if v is not None and v == v else f"{'-':>14}"))
        lines.append(f"{k:<{width}}" + "".join(cells))
    return lines


def plot_stalls(cells: Mapping[str, Mapping[str, Mapping[str, float]]], path: str, title: str,
                top: int = 10):
    """Grouped horizontal bars, one panel per cell: per report (``cells[cell][label]``, the
    ``stall_samples`` of its main kernel plus an optional ``"tensor pipe active %"``), each
    stall reason's share of the report's samples, for the ``top`` reasons largest in any
    report; the tensor-pipe activity goes in the legend. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(cells)
    fig, axes = plt.subplots(1, len(names), figsize=(7 * len(names), 5), squeeze=False)
    for ax, cell in zip(axes.flat, names):
        reports = cells[cell]
        share = {label: {k: v / r["sample_count"] for k, v in r.items()
                         if k not in ("sample_count", "tensor pipe active %")}
                 for label, r in reports.items()}
        reasons = sorted({k for v in share.values() for k in v},
                         key=lambda k: -max(v.get(k, 0.0) for v in share.values()))[:top]
        height = 0.8 / len(reports)
        for i, (label, values) in enumerate(share.items()):
            active = reports[label].get("tensor pipe active %")
            ax.barh([y + i * height for y in range(len(reasons))],
                    [100 * values.get(k, 0.0) for k in reasons], height=height,
                    label=label + (f" (tensor pipe {active:.1f}% active)" if active else ""))
        ax.set_yticks([y + 0.4 - height / 2 for y in range(len(reasons))], reasons)
        ax.invert_yaxis()
        ax.set_xlabel("% of the main kernel's warp samples")
        ax.set_title(cell)
        ax.grid(axis="x", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
