#!/usr/bin/env python
"""Plant faults into the SM100 forward's PTX and report which CPU layer catches each.

Entry point of ``python -m fa_sm100 mutate`` (``fa_sm100/cli/mutate.py``: its docstring,
or --help); the same flags and output."""

import sys

from fa_sm100.cli.mutate import main

if __name__ == "__main__":
    sys.exit(main())
