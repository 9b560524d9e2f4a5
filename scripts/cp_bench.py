#!/usr/bin/env python
"""Context parallelism on several GPUs: tokens per second per GPU, compute against communication.

Entry point of ``python -m fa_sm100 cp_bench`` (``fa_sm100/cli/cp_bench.py``: its
docstring, or --help); the same flags and output."""

import sys

from fa_sm100.cli.cp_bench import main

if __name__ == "__main__":
    sys.exit(main())
