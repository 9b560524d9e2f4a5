"""Contract: the package's public names, and that config/layouts/pipelines import without torch."""

import subprocess
import sys

import pytest


def test_flash_attn_func_is_the_public_entry_point():
    import fa_sm100
    from fa_sm100.interface import flash_attn_func

    assert fa_sm100.flash_attn_func is flash_attn_func
    assert "flash_attn_func" in fa_sm100.__all__
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        fa_sm100.no_such_name


def test_config_layouts_and_pipeline_table_do_not_import_torch():
    code = ("import sys, fa_sm100, layouts, pipelines.spec; "
            "fa_sm100.select_config(); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_every_script_is_a_command_of_the_package():
    """``scripts/<name>.py`` is an entry point of ``python -m fa_sm100 <name>``: every script
    names a command, and every command's module has a ``main`` that answers --help."""
    import contextlib
    import importlib
    import io
    from pathlib import Path

    from fa_sm100.cli import COMMANDS

    scripts = {p.stem for p in (Path(__file__).resolve().parents[1] / "scripts").glob("*.py")}
    assert scripts <= set(COMMANDS), scripts - set(COMMANDS)
    for name, (module_name, what) in COMMANDS.items():
        main = importlib.import_module(module_name).main
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
            main(["--help"])
        assert exit_.value.code == 0 and "usage" in out.getvalue(), name


def test_every_script_runs_its_commands_main(monkeypatch):
    """``python scripts/<name>.py ARGS`` is ``python -m fa_sm100 <name> ARGS``: every script,
    run as a program, calls its command's ``main`` (the one that answers --help above) and
    exits with what it returns."""
    import importlib
    import runpy
    from pathlib import Path

    from fa_sm100.cli import COMMANDS

    scripts = sorted((Path(__file__).resolve().parents[1] / "scripts").glob("*.py"))
    assert scripts
    calls = []
    for path in scripts:
        with monkeypatch.context() as patch:  # every command's main stands in, named
            for name, (module_name, _) in COMMANDS.items():
                patch.setattr(importlib.import_module(module_name), "main",
                              lambda *args, name=name: calls.append((name, args)) or 7)
            with pytest.raises(SystemExit) as exit_:
                runpy.run_path(str(path), run_name="__main__")
        assert calls == [(path.stem, ())] and exit_.value.code == 7, (path.name, calls)
        calls.clear()


def test_a_script_and_its_command_give_the_same_output():
    from script_loader import ROOT, repo_env

    script = subprocess.run([sys.executable, "scripts/inspect.py", "--list"], cwd=ROOT,
                            capture_output=True, text=True, env=repo_env(), check=True)
    command = subprocess.run([sys.executable, "-m", "fa_sm100", "inspect", "--list"], cwd=ROOT,
                             capture_output=True, text=True, env=repo_env(), check=True)
    assert script.stdout == command.stdout and "sm90_bwd" in script.stdout


def test_scripts_inspect_hands_the_name_over_to_the_standard_library():
    """With scripts/ first on sys.path (any script run from there), ``import inspect`` gets
    the standard library's module, not scripts/inspect.py: no script needs a path fix."""
    import subprocess
    import sys
    from pathlib import Path

    scripts = Path(__file__).resolve().parents[1] / "scripts"
    code = (f"import sys; sys.path.insert(0, {str(scripts)!r}); import inspect, dataclasses; "
            "print(inspect.__file__); print(callable(inspect.signature))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    path, has_signature = out.stdout.split()
    assert Path(path).parent != scripts and has_signature == "True"
