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
