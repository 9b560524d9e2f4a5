#!/usr/bin/env python
"""Thin command line over fa_sm100.research.timeline_cli (see its docstring, or --help).

Every number it prints without an SM100 GPU is MODEL OUTPUT of the protocol model's timing
mode, labelled as such.
"""

import sys

from fa_sm100.research.timeline_cli import main

if __name__ == "__main__":
    sys.exit(main())
