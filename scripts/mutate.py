#!/usr/bin/env python
"""Plant faults into the SM100 forward's PTX and report which CPU layer catches each.

Entry point of ``python -m fa_sm100 mutate`` (``fa_sm100/cli/mutate.py``: its docstring,
or --help); the same flags and output."""

import sys

import _paths  # noqa: F401  (this folder holds inspect.py: take it off sys.path first)

from fa_sm100.cli.mutate import main

if __name__ == "__main__":
    sys.exit(main())
