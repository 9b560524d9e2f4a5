#!/usr/bin/env python
"""Forward attention throughput of several providers in one process on one GPU.

Entry point of ``python -m fa_sm100 benchmark`` (``fa_sm100/cli/benchmark.py``: its docstring,
or --help); the same flags and output."""

import sys

from fa_sm100.cli.benchmark import main

if __name__ == "__main__":
    sys.exit(main())
