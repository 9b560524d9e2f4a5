"""Import-path set-up for the scripts in this folder: every script imports it first.

Python puts a script's own folder first on ``sys.path``. This folder holds ``inspect.py`` (its
name is a contract of the project), so ``import inspect`` in the standard library, torch or
dataclasses would get that script instead of the standard module. This module takes the
folder off ``sys.path`` and puts the repository root on it (for a checkout that is not
installed).
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(_HERE)

sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != _HERE]
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
