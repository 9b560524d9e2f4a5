#!/usr/bin/env python
"""Cross-compile FlashAttention-4's SM90 forward (or backward) on a machine with no GPU, keep

Entry point of ``python -m fa_sm100 dump_fa4_sm90_sass`` (``fa_sm100/cli/dump_fa4_sm90_sass.py``: its docstring,
or --help); the same flags and output."""

import sys

from fa_sm100.cli.dump_fa4_sm90_sass import main

if __name__ == "__main__":
    sys.exit(main())
