#!/usr/bin/env python
"""Run the SM90 forward (or backward) on a representative set of problems, for compute-sanitizer.

Entry point of ``python -m fa_sm100 sm90_memcheck`` (``fa_sm100/cli/sm90_memcheck.py``: its docstring,
or --help); the same flags and output."""

import sys

from fa_sm100.cli.sm90_memcheck import main

if __name__ == "__main__":
    sys.exit(main())
