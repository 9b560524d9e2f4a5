#!/usr/bin/env python
"""Paired A/B timing of SM90 config switches: is a change faster, and by how much?

Entry point of ``python -m fa_sm100 ab_bench`` (``fa_sm100/cli/ab_bench.py``: its docstring,
or --help); the same flags and output."""

import sys

from fa_sm100.cli.ab_bench import main

if __name__ == "__main__":
    sys.exit(main())
