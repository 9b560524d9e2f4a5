#!/usr/bin/env python
"""Nsight Compute of one backward cell, ours and FA4, kernel by kernel; and a summary that puts

Entry point of ``python -m fa_sm100 ncu_bwd`` (``fa_sm100/cli/ncu_bwd.py``: its docstring,
or --help); the same flags and output."""

import sys

from fa_sm100.cli.ncu_bwd import main

if __name__ == "__main__":
    sys.exit(main())
