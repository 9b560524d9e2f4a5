#!/usr/bin/env python
"""Thin command line over fa_sm100.research.timeline_cli (see its docstring, or --help).

Every number it prints without an SM100 GPU is MODEL OUTPUT of the protocol model's timing
mode, labelled as such.
"""

import sys

try:  # first import: keeps scripts/inspect.py from shadowing the standard `inspect`
    import _paths  # noqa: F401
except ImportError:  # loaded as a module (tests): this folder is not on sys.path
    pass

from fa_sm100.research.timeline_cli import main

if __name__ == "__main__":
    sys.exit(main())
