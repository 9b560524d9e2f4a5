"""The SASS a compile kept (``inspect_kernel(..., keep_dir=...)``), read for the compile tests.

Pytest puts this folder on ``sys.path`` (the test files are not a package), so a test imports
``from kept_sass import read_kept_sass, main_loop_ops``.
"""

import glob


def read_kept_sass(keep_dir) -> str:
    """The one ``*.sass`` listing in ``keep_dir``."""
    (path,) = glob.glob(str(keep_dir / "*.sass"))
    with open(path) as f:
        return f.read()


def main_loop_ops(sass: str) -> list:
    """The opcodes (modifiers kept, guards dropped) of the kernel's main loop: the loop with
    the most HGMMAs (``compile_tools.sass_main_loop``)."""
    from fa_sm100.compile_tools import sass_main_loop, sass_opcode

    return [sass_opcode(t) for _, t in sass_main_loop(sass)]
