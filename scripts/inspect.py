#!/usr/bin/env python
"""Cross-compile a kernel of fa-sm100 on a machine with no GPU and report what the compiler made.

Entry point of ``python -m fa_sm100 inspect`` (``fa_sm100/cli/inspect_kernel.py``: its docstring,
or --help); the same flags and output."""

import sys

import _paths  # noqa: F401  (this folder holds inspect.py: take it off sys.path first)

from fa_sm100.cli.inspect_kernel import main

if __name__ == "__main__":
    sys.exit(main())
