"""``--shard K/N`` (tests/conftest.py, scripts/sm90_memcheck.py): the shares of a run are
disjoint and cover every test, and a malformed value stops the run before any test."""

import pathlib
import subprocess
import sys

import pytest
from fa_sm100.shards import parse_shard, shard_of
from script_loader import repo_env


def test_shards_are_disjoint_and_cover_every_item():
    items = list(range(11))
    seen = []
    for k in (1, 2, 3):
        kept, dropped = shard_of(items, k, 3)
        assert sorted(kept + dropped) == items
        seen += kept
    assert sorted(seen) == items
    assert shard_of(items, 2, 3)[0] == [1, 4, 7, 10]
    assert shard_of(items, 1, 1) == (items, [])


@pytest.mark.parametrize("text", ["0/2", "3/2", "1", "a/b", "1/2/3", "-1/2"])
def test_malformed_shards_raise_value_error_naming_the_form(text):
    with pytest.raises(ValueError, match="--shard"):
        parse_shard(text)


def _run_pytest(tmp_path, *args):
    (tmp_path / "test_many.py").write_text(
        "import pytest\n\n@pytest.mark.parametrize('i', range(5))\ndef test_i(i):\n    pass\n")
    conftest = (pathlib.Path(__file__).parent / "conftest.py").read_text()
    (tmp_path / "conftest.py").write_text(conftest)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(tmp_path / "test_many.py"), *args],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=repo_env())  # the conftest imports fa_sm100


def test_two_shards_run_every_test_once(tmp_path):
    outs = [_run_pytest(tmp_path, "--shard", f"{k}/2", "-rA") for k in (1, 2)]
    ran = []
    for out in outs:
        assert out.returncode == 0, out.stdout + out.stderr
        ran += [line.split("::")[1].strip() for line in out.stdout.splitlines()
                if line.startswith("PASSED ")]
    assert sorted(ran) == sorted(f"test_i[{i}]" for i in range(5))
    assert "3 passed, 2 deselected" in outs[0].stdout


def test_a_bad_shard_is_a_usage_error(tmp_path):
    out = _run_pytest(tmp_path, "--shard", "3/2")
    assert out.returncode == 4  # pytest's usage error
    assert "needs 1 <= K <= N" in out.stderr


def test_memcheck_shards_run_every_case_once_and_refuse_a_bad_value():
    """``scripts/sm90_memcheck.py --shard K/N`` deals its cases as pytest deals tests, and a
    bad value is an argparse error (exit 2) before anything touches a GPU."""
    from script_loader import load_script

    mod = load_script("sm90_memcheck")
    for mode, cases in (("bwd", mod.BWD_CASES), ("fwd", mod.CASES)):
        shares = [mod.select_cases(mode, f"{k}/3") for k in (1, 2, 3)]
        assert sorted(map(repr, sum(shares, []))) == sorted(map(repr, cases))
        assert all(shares)
    assert mod.select_cases("bwd") == mod.BWD_CASES
    with pytest.raises(SystemExit) as err:
        mod.main(["--mode", "bwd", "--shard", "3/2"])
    assert err.value.code == 2
