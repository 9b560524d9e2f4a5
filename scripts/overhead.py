#!/usr/bin/env python
"""Host cost per call through the public APIs, ours beside the peers, in one process.

Entry point of ``python -m fa_sm100 overhead`` (``fa_sm100/cli/overhead.py``: its docstring,
or --help); the same flags and output."""

import sys

from fa_sm100.cli.overhead import main

if __name__ == "__main__":
    sys.exit(main())
