#!/usr/bin/env python
"""Paired A/B timing of SM90 config switches: is a change faster, and by how much?

Entry point of ``python -m fa_sm100 ab_bench`` (``fa_sm100/cli/ab_bench.py``: its docstring,
or --help); the same flags and output."""

import sys

import _paths  # noqa: F401  (this folder holds inspect.py: take it off sys.path first)

from fa_sm100.cli.ab_bench import main

if __name__ == "__main__":
    sys.exit(main())
