#!/usr/bin/env python
"""Variable-length (packed) batches, ours against FA4 in one process on one GPU (forward).

Entry point of ``python -m fa_sm100 varlen_bench`` (``fa_sm100/cli/varlen_bench.py``: its
docstring, or --help); the same flags and output."""

import sys

from fa_sm100.cli.varlen_bench import main

if __name__ == "__main__":
    sys.exit(main())
