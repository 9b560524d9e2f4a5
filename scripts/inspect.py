#!/usr/bin/env python
"""Cross-compile a kernel of fa-sm100 on a machine with no GPU and report what the compiler made.

Entry point of ``python -m fa_sm100 inspect`` (``fa_sm100/cli/inspect_kernel.py``: its docstring,
or --help); the same flags and output.

This file's name is a contract (``python scripts/inspect.py``) and also the name of a standard
library module. When any script of this folder runs, the folder is first on ``sys.path``, so
``import inspect`` (dataclasses, torch and others do it) finds this file. Imported under that
name, it hands the import over to the standard library's ``inspect``: the other scripts need
no path fix."""

import sys

if __name__ != "__main__":  # imported as ``inspect``: the standard library's module instead
    import importlib.util
    import os
    import sysconfig

    _spec = importlib.util.spec_from_file_location(
        __name__, os.path.join(sysconfig.get_paths()["stdlib"], "inspect.py"))
    _standard = importlib.util.module_from_spec(_spec)
    sys.modules[__name__] = _standard  # what the importing statement receives
    _spec.loader.exec_module(_standard)
else:
    from fa_sm100.cli.inspect_kernel import main

    sys.exit(main())
