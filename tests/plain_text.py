"""Printed reports read by their words: a test of what a report says (a cell's ratio and
verdict on one line, a label beside its value) compares ``word_lines``, so the column widths
and padding, which follow the longest label or number, may change without failing it.

Pytest puts this folder on ``sys.path`` (the test files are not a package), so a test imports
``from plain_text import word_lines``.
"""


def words(text: str) -> str:
    """``text`` with each run of whitespace made one space, ends stripped."""
    return " ".join(text.split())


def word_lines(text: str) -> list:
    """The lines of ``text``, each through ``words``."""
    return [words(line) for line in text.splitlines()]
