"""Load a command line of ``scripts/`` as a module, for the tests of its functions.

Pytest puts this folder on ``sys.path`` (the test files are not a package), so a test imports
``from script_loader import load_script``.
"""

import importlib.util
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"  # the entry points


def repo_env(**extra) -> dict:
    """``os.environ`` with this checkout first on ``PYTHONPATH`` (plus ``extra``), for a
    subprocess that must import this ``fa_sm100`` whatever its working directory and whatever
    the editable install points at."""
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return env


def load_script(name: str):
    """The module of command ``name`` (``fa_sm100.cli.COMMANDS``; ``scripts/<name>.py`` is its
    entry point) executed as a fresh module (not entered in ``sys.modules``)."""
    from fa_sm100.cli import COMMANDS

    module_name = COMMANDS[name][0]
    path = ROOT / (module_name.replace(".", "/") + ".py")
    spec = importlib.util.spec_from_file_location(f"fa_sm100_script_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
