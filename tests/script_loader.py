"""Load a command line of ``scripts/`` as a module, for the tests of its functions.

Pytest puts this folder on ``sys.path`` (the test files are not a package), so a test imports
``from script_loader import load_script``.
"""

import importlib.util
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str):
    """``scripts/<name>.py`` executed as a fresh module (not entered in ``sys.modules``)."""
    spec = importlib.util.spec_from_file_location(f"fa_sm100_script_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
