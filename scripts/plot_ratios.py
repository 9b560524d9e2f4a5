#!/usr/bin/env python
"""Plot ours over the best peer, paired, with 95% intervals, from benchmark grids' JSON.

Entry point of ``python -m fa_sm100 plot_ratios`` (``fa_sm100/cli/plot_ratios.py``: its docstring,
or --help); the same flags and output."""

import sys

from fa_sm100.cli.plot_ratios import main

if __name__ == "__main__":
    sys.exit(main())
