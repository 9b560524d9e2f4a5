#!/usr/bin/env python
"""Numerics of the SM100 forward algorithm, emulated on the CPU (issue 5).

Entry point of ``python -m fa_sm100 emulate`` (``fa_sm100/cli/emulate.py``: its docstring,
or --help); the same flags and output."""

import sys

from fa_sm100.cli.emulate import main

if __name__ == "__main__":
    sys.exit(main())
