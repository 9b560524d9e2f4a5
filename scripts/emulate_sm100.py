#!/usr/bin/env python
"""Run the SM100 forward kernel's own PTX on the CPU emulator (issue 9) and compare.

Entry point of ``python -m fa_sm100 emulate_sm100`` (``fa_sm100/cli/emulate_sm100.py``: its docstring,
or --help); the same flags and output."""

import sys

from fa_sm100.cli.emulate_sm100 import main

if __name__ == "__main__":
    sys.exit(main())
