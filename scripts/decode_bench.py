#!/usr/bin/env python
"""Decode against a KV cache: K/V read bandwidth, ours against FA4.

Entry point of ``python -m fa_sm100 decode_bench`` (``fa_sm100/cli/decode_bench.py``: its
docstring, or --help); the same flags and output."""

import sys

from fa_sm100.cli.decode_bench import main

if __name__ == "__main__":
    sys.exit(main())
