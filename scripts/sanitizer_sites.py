#!/usr/bin/env python
"""Name the instructions behind compute-sanitizer's hazard reports.

Entry point of ``python -m fa_sm100 sanitizer_sites`` (``fa_sm100/cli/sanitizer_sites.py``: its docstring,
or --help); the same flags and output."""

import sys

from fa_sm100.cli.sanitizer_sites import main

if __name__ == "__main__":
    sys.exit(main())
