#!/usr/bin/env python
"""Numerics of the SM100 forward algorithm, emulated on the CPU (issue 5).

Entry point of ``python -m fa_sm100 emulate`` (``fa_sm100/cli/emulate.py``: its docstring,
or --help); the same flags and output."""

import sys

import _paths  # noqa: F401  (this folder holds inspect.py: take it off sys.path first)

from fa_sm100.cli.emulate import main

if __name__ == "__main__":
    sys.exit(main())
