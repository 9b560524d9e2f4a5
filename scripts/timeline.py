#!/usr/bin/env python
"""Thin command line over fa_sm100.research.timeline_cli (see its docstring, or --help).

Every number it prints without an SM100 GPU is MODEL OUTPUT of the protocol model's timing
mode, labelled as such.
"""

import os
import sys

# scripts/ holds inspect.py, named like the standard library's module: keep this directory off
# the import path so that `import inspect` (dataclasses uses it) gets the standard one.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != _HERE]
_ROOT = os.path.dirname(_HERE)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from fa_sm100.research.timeline_cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
