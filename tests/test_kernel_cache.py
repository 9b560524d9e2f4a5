"""The disk cache of compiled kernels (``fa_sm100.kernel_cache``) and the warm-up command, on
the CPU: the object files the forward launches are the same whichever machine compiles them.

Each step runs in a fresh process, as a server's would: the first compiles and writes the
cache, the second loads every kernel from it without compiling, an unloadable entry is
rebuilt, and with the disk cache off nothing is written.
"""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.compile

WARMUP = [sys.executable, "-m", "fa_sm100", "warmup", "--hdim", "64", "--causal", "true",
          "--seqlen", "1024"]


def warmup(cache, **env):
    run = subprocess.run(WARMUP, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "FA_SM100_CACHE_DIR": str(cache), **env})
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


def test_a_second_process_loads_what_the_first_compiled(tmp_path):
    first = warmup(tmp_path)
    assert "compiled in" in first and "1 compiled" in first, first
    entries = list(tmp_path.glob("sm90_fwd-*.o"))
    assert len(entries) == 1 and entries[0].stat().st_size > 0
    second = warmup(tmp_path)
    assert "loaded from disk" in second and "0 compiled" in second, second
    assert list(tmp_path.glob("sm90_fwd-*.o")) == entries  # nothing new written


def test_an_unloadable_entry_is_rebuilt(tmp_path):
    warmup(tmp_path)
    (entry,) = tmp_path.glob("sm90_fwd-*.o")
    entry.write_bytes(b"not an object file")
    rebuilt = warmup(tmp_path)
    assert "compiled in" in rebuilt, rebuilt
    assert "loaded from disk" in warmup(tmp_path)  # the replacement loads
    assert not list(tmp_path.glob(".*"))  # no temporary file left behind


def test_the_disk_cache_can_be_turned_off(tmp_path):
    out = warmup(tmp_path, FA_SM100_DISK_CACHE="0")
    assert "memory only" in out and "compiled in" in out
    assert not list(tmp_path.iterdir())


def test_the_cache_name_changes_with_the_key_and_the_code(monkeypatch, tmp_path):
    """Different configs never share an entry, and the same config under other code (another
    fingerprint) does not find the old entry."""
    from fa_sm100 import kernel_cache
    from fa_sm100.hopper.config import select_sm90_fwd_config

    monkeypatch.setenv("FA_SM100_CACHE_DIR", str(tmp_path))
    a = select_sm90_fwd_config(64, causal=True, write_lse=False)
    b = a.replace(write_lse=True)
    assert kernel_cache.entry_path("sm90_fwd", a) != kernel_cache.entry_path("sm90_fwd", b)
    assert kernel_cache.entry_path("sm90_fwd", a) == kernel_cache.entry_path("sm90_fwd", a)
    before = kernel_cache.entry_path("sm90_fwd", a)
    monkeypatch.setattr(kernel_cache, "_fingerprint", "other code")
    assert kernel_cache.entry_path("sm90_fwd", a) != before
