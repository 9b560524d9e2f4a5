#!/usr/bin/env python
"""Compile and run FlashAttention-4's SM90 forward once so CUTE_DSL_KEEP can keep its PTX and

Entry point of ``python -m fa_sm100 dump_fa4_sm90`` (``fa_sm100/cli/dump_fa4_sm90.py``: its docstring,
or --help); the same flags and output."""

import sys

from fa_sm100.cli.dump_fa4_sm90 import main

if __name__ == "__main__":
    sys.exit(main())
