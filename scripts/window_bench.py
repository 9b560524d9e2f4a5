#!/usr/bin/env python
"""Sliding-window attention, ours against FA4 in one process on one GPU (forward and backward).

Entry point of ``python -m fa_sm100 window_bench`` (``fa_sm100/cli/window_bench.py``: its docstring,
or --help); the same flags and output."""

import sys

from fa_sm100.cli.window_bench import main

if __name__ == "__main__":
    sys.exit(main())
