#!/usr/bin/env python
"""Logit softcapping's cost, ours and FA4's, in one process on one GPU (forward and backward).

Entry point of ``python -m fa_sm100 softcap_bench`` (``fa_sm100/cli/softcap_bench.py``: its docstring,
or --help); the same flags and output."""

import sys

from fa_sm100.cli.softcap_bench import main

if __name__ == "__main__":
    sys.exit(main())
