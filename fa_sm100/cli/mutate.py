"""Plant faults into the SM100 forward's PTX and report which CPU layer catches each.

    python scripts/mutate.py                     # every fault, every schedule policy
    python scripts/mutate.py --only skip_vote flip_parity --policy late
    python scripts/mutate.py --write-docs        # also regenerate the table in docs/verification.md
    python scripts/mutate.py --json mutations.json

The catalogue and what "caught" means are in ``fa_sm100/ptxemu/mutate.py``. Exit status 1 when
a fault is caught by no layer, 2 for bad arguments.
"""

import argparse
import json
import os
import sys


from fa_sm100.ptxemu import mutate

DOCS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs",
                    "verification.md")
BEGIN, END = "<!-- mutate:begin -->", "<!-- mutate:end -->"


def write_docs(table: str, path: str = DOCS) -> None:
    """Replace the text between the markers in docs/verification.md with ``table``."""
    text = open(path).read()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{path} has no {BEGIN} ... {END} block to regenerate")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(path, "w") as f:
        f.write(f"{head}{BEGIN}\n{table}\n{END}{tail}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", default=None, choices=sorted(mutate.BY_NAME),
                   help="these faults only")
    p.add_argument("--policy", nargs="+", default=list(mutate.POLICIES),
                   choices=mutate.POLICIES, help="schedule policies to run each fault under")
    p.add_argument("--write-docs", action="store_true",
                   help="regenerate the table in docs/verification.md (every fault and policy)")
    p.add_argument("--json", default=None, help="write the outcomes here")
    a = p.parse_args(argv)
    if a.write_docs and (a.only or a.policy != list(mutate.POLICIES)):
        p.error("--write-docs regenerates the whole table: leave out --only and --policy")
    results = mutate.run_catalogue(a.only, a.policy, log=lambda s: print(s, flush=True))
    table = mutate.render_table(results)
    print(table)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    if a.write_docs:
        write_docs(table)
    missed = [n for n, o in results.items() if not mutate.caught(o)]
    if missed:
        print(f"caught by no layer: {', '.join(missed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
