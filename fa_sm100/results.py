"""The speed claims of README.md and the docs, generated from the results files.

A claim in a Markdown file sits between ``<!-- claim:NAME -->`` and ``<!-- /claim -->``;
``render`` replaces the text between with what ``CLAIMS[NAME]`` makes of its results file
(``docs/data/...``), so each number has one source. ``python -m fa_sm100 claims`` rewrites the
files (``--check``: exit 1 and name the stale ones instead); ``tests/test_results.py`` fails
when a file and its results disagree.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FILES = ("README.md", "docs/status.md", "docs/host_path.md")
CLAIM = re.compile(r"(<!-- claim:([a-z0-9_]+) -->)(.*?)(<!-- /claim -->)", re.S)


def _load(path: str) -> dict:
    with open(ROOT / path) as f:
        return json.load(f)


def _paired(rows) -> tuple:
    """(cells at or above 1.00, cells, the cells below as 'x.xxx' strings)."""
    below = [f"{r:.3f}" for r in rows if r < 1.0]
    return len(rows) - len(below), len(rows), below


def sm90_grid(mode: str) -> str:
    """The public-path grid of the SM90 forward or backward (docs/data/host_path/)."""
    data = _load(f"docs/data/host_path/sm90_{mode}_public_h200.json")
    rows = [r for r in data["rows"] if r.get("provider", "ours") == "ours"]
    ups, total, below = _paired([r["ratio_paired"] for r in rows])
    path = "`flash_attn_func`" if mode == "fwd" else "autograd"
    text = (f"at or above the best of FA4 / cuDNN through {path} in {ups} of {total} grid "
            f"cells")
    if below:
        text += f" ({'the others' if len(below) > 1 else 'the other'} {', '.join(below)})"
    return text


def feature_grid(path: str, label) -> str:
    """'fwd a-b in n of m, bwd ...' over FA4 from a feature benchmark's rows."""
    data = _load(path)
    parts = []
    for mode, name in (("fwd", "forward"), ("bwd", "backward")):
        ratios = [r["ratio"] for r in data["rows"] if r["mode"] == mode and r["ratio"]]
        if not ratios:
            continue
        ups, total, below = _paired(ratios)
        part = f"{name} {min(ratios):.3f}x-{max(ratios):.3f}x, at or above 1.00 in {ups} of {total}"
        parts.append(part)
    return f"{label}: " + "; ".join(parts)


def softcap() -> str:
    """Capped over FA4's capped and over our uncapped, forward and backward (cap 30)."""
    parts = []
    for mode, name in (("fwd", "forward"), ("bwd", "backward")):
        rows = _load(f"docs/data/softcap/softcap_{mode}_h200.json")["rows"]
        peer = [r["ratios"]["ours cap / fa4 cap"][0] for r in rows]
        own = [r["ratios"]["ours cap / ours"][0] for r in rows]
        parts.append(f"capped {name} {min(peer):.2f}x-{max(peer):.2f}x of FA4's capped, "
                     f"{min(own):.2f}x-{max(own):.2f}x of our uncapped")
    return "; ".join(parts)


def overhead() -> str:
    data = _load("docs/data/host_path/overhead_h200.json")
    per, host = data["us_per_call"], data.get("host_us_per_call", data["us_per_call"])
    f, t, b = per["forward"], per["forward + backward"], per["backward"]
    return (f"forward {f['ours']:.1f} us per call (SDPA cuDNN {f['sdpa_cudnn']:.1f}); forward + "
            f"`autograd.grad` {t['ours']:.1f} us per call, {host['forward + backward']['ours']:.1f}"
            f" us of host time (cuDNN {t['sdpa_cudnn']:.1f} / "
            f"{host['forward + backward']['sdpa_cudnn']:.1f}); `autograd.grad` alone "
            f"{b['ours']:.1f} / {host['backward']['ours']:.1f} (cuDNN {b['sdpa_cudnn']:.1f} / "
            f"{host['backward']['sdpa_cudnn']:.1f})")


OVERHEAD_ROWS = (("forward", "forward (`flash_attn_func`)"),
                 ("forward + backward", "forward + `torch.autograd.grad`"),
                 ("backward", "`torch.autograd.grad` alone"))
OVERHEAD_PROVIDERS = ("ours", "fa4", "sdpa_cudnn", "sdpa_flash")


def overhead_table() -> str:
    """docs/host_path.md's table: per call / host us of each row and provider, each row's
    lowest per-call figure in bold."""
    data = _load("docs/data/host_path/overhead_h200.json")
    per, host = data["us_per_call"], data["host_us_per_call"]
    lines = ["", "| per call / host (us) | ours | FA4 | SDPA cuDNN | SDPA flash |",
             "|---|---|---|---|---|"]
    for row, label in OVERHEAD_ROWS:
        numbers = {p: per[row][p] for p in OVERHEAD_PROVIDERS
                   if isinstance(per[row].get(p), (int, float))}
        best = min(numbers.values())
        cells = ["" if p not in numbers else
                 f"**{per[row][p]:.1f}** / {host[row][p]:.1f}" if numbers[p] == best else
                 f"{per[row][p]:.1f} / {host[row][p]:.1f}" for p in OVERHEAD_PROVIDERS]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    launch = [per[f"launch only: {m}"]["ours"] for m in ("forward", "backward")]
    lines.append(f"| ours, launch only: forward / backward | {launch[0]:.1f} / {launch[1]:.1f}"
                 " | | | |")
    return "\n".join(lines) + "\n"


CLAIMS = {
    "sm90_fwd_grid": lambda: sm90_grid("fwd"),
    "sm90_bwd_grid": lambda: sm90_grid("bwd"),
    "window": lambda: feature_grid("docs/data/window/window_h200.json",
                                   "causal + left window, hdim 128, over FA4"),
    "varlen": lambda: feature_grid("docs/data/varlen/varlen_h200.json",
                                   "packed batches, hdim 128, over FA4's varlen forward and "
                                   "backward"),
    "softcap": softcap,
    "overhead": overhead,
    "overhead_table": overhead_table,
}


def render(text: str) -> str:
    """``text`` with every claim span's body made from its results file."""
    def one(m):
        name = m.group(2)
        if name not in CLAIMS:
            raise ValueError(f"unknown claim {name!r}: one of {sorted(CLAIMS)}")
        return m.group(1) + CLAIMS[name]() + m.group(4)
    return CLAIM.sub(one, text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fa_sm100 claims", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 naming the files whose claims are stale")
    args = p.parse_args(argv)
    stale = []
    for name in FILES:
        path = ROOT / name
        text = path.read_text()
        new = render(text)
        if new != text:
            stale.append(name)
            if not args.check:
                path.write_text(new)
    for name in stale:
        print(f"{name}: {'stale' if args.check else 'rewritten'}")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
