#!/usr/bin/env python
"""Decode against a KV cache: K/V read bandwidth, ours against FA4.

Entry point of ``python -m fa_sm100 decode_bench`` (``fa_sm100/cli/decode_bench.py``: its
docstring, or --help); the same flags and output."""

import sys

import _paths  # noqa: F401  (this folder holds inspect.py: take it off sys.path first)

from fa_sm100.cli.decode_bench import main

if __name__ == "__main__":
    sys.exit(main())
