"""Load a command line of ``scripts/`` as a module, for the tests of its functions.

Pytest puts this folder on ``sys.path`` (the test files are not a package), so a test imports
``from script_loader import load_script``.
"""

import importlib.util
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"


def repo_env(**extra) -> dict:
    """``os.environ`` with this checkout first on ``PYTHONPATH`` (plus ``extra``), for a
    subprocess that must import this ``fa_sm100`` whatever its working directory and whatever
    the editable install points at."""
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return env


def load_script(name: str):
    """``scripts/<name>.py`` executed as a fresh module (not entered in ``sys.modules``)."""
    spec = importlib.util.spec_from_file_location(f"fa_sm100_script_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
