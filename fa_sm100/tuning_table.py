"""Tuning tables: a kernel's defaults as rows (where a row applies -> what it sets -> the
measurement or the rule behind it), the lookup that applies them, and the markdown block of
docs/tuning.md that shows them. The SM90 forward's table is ``FWD_TUNING`` (hopper/fwd_tuning.py),
the backward's ``BWD_TUNING`` (hopper/bwd_tuning.py).

Contract of ``apply_rows``:

- It reads the problem and the fields given to it, nothing else: no tensor contents, no device
  query, no allocation.
- Rows apply in order. A row's predicate sees the config the rows before it left, so a later
  row overrides an earlier one.
- A row never changes a field the caller set (``asked``); its other fields still apply. A row
  whose fields belong together names them in ``unless_asked``: any of them set by the caller
  skips the whole row. ``keep`` may refuse a row's result (the backward keeps its persistent
  rows only where the persistent rules pass).
- Rows do not judge validity: the config's ``validate()`` does, on the lookup's result.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

DOC = Path(__file__).resolve().parents[1] / "docs" / "tuning.md"


@dataclass(frozen=True)
class TuningRow:
    """One default: where it applies (``where`` in words, ``when`` as code over the problem
    and the config so far), what it sets, and why (``measured``, ``rule``)."""

    name: str
    where: str
    when: Callable[[Any, Any], bool]
    sets: dict
    measured: str = ""
    rule: str = ""
    unless_asked: tuple = ()

    def conditions(self) -> str:
        """What else the lookup checks before it keeps the row, in words (docs/tuning.md)."""
        return ""


class Draft:
    """The fields a lookup has chosen so far, read as the config they will make, without making
    it: ``draft(cls, fields)`` is an instance of a plain class that carries ``cls``'s
    properties, methods and field defaults (not its ``__init__``, ``__setattr__`` or
    ``__eq__``) and keeps ``fields`` as its ``__dict__``, so a predicate reads fields and calls
    methods at the config's own speed. ``replace`` gives another draft. Nothing is validated:
    a lookup builds its config once, at the end (``build``). Fields with a default factory must
    be in ``fields``."""

    _config_cls: type

    def replace(self, **changes) -> "Draft":
        return draft(self._config_cls, {**self.__dict__, **changes})

    def build(self):
        """The config itself (one construction, not validated)."""
        return self._config_cls(**self.__dict__)

    def __repr__(self) -> str:
        return f"draft({self._config_cls.__name__}, {self.__dict__!r})"


_DRAFT_CLASSES: dict = {}


def draft(cls: type, fields: dict) -> Draft:
    """A ``Draft`` of ``cls`` with ``fields`` (the dict itself, not a copy)."""
    draft_cls = _DRAFT_CLASSES.get(cls)
    if draft_cls is None:
        members = {"_config_cls": cls}
        for klass in reversed(cls.__mro__[:-1]):  # the config's own members win; not object's
            members.update((name, member) for name, member in vars(klass).items()
                           if not name.startswith("__") and name not in vars(Draft))
        draft_cls = _DRAFT_CLASSES[cls] = type(f"{cls.__name__}Draft", (Draft,), members)
    made = object.__new__(draft_cls)
    made.__dict__ = fields
    return made


def apply_rows(problem, rows, fields: dict, asked: Mapping, make: Callable[[dict], Any],
               keep: Optional[Callable[[TuningRow, Any], bool]] = None,
               applied: Optional[list] = None):
    """``make(fields)`` after ``rows`` (the module's contract): ``fields`` holds the problem's
    fields, the lookup's start and the caller's fields (``asked``). The names of the rows that
    applied are appended to ``applied``."""
    cfg = make(fields)
    for row in rows:
        changes = {name: value for name, value in row.sets.items() if name not in asked}
        if not changes or any(name in asked for name in row.unless_asked):
            continue
        if not row.when(problem, cfg):
            continue
        candidate_fields = {**fields, **changes}
        candidate = make(candidate_fields)
        if keep is not None and not keep(row, candidate):
            continue
        if applied is not None:
            applied.append(row.name)
        fields, cfg = candidate_fields, candidate
    return cfg


def render_table(rows) -> str:
    """The rows as a markdown table, in lookup order."""
    lines = ["| # | row | where | sets | why |", "|---|---|---|---|---|"]
    for i, row in enumerate(rows, 1):
        sets = ", ".join(f"`{name}={value!r}`" for name, value in row.sets.items())
        if row.unless_asked:
            sets += " (unless " + " or ".join(f"`{n}`" for n in row.unless_asked) + " is asked)"
        sets += row.conditions()
        why = "; ".join(f"**{kind}:** {text}" for kind, text in
                        (("measured", row.measured), ("rule", row.rule)) if text)
        lines.append(f"| {i} | {row.name} | {row.where} | {sets} | {why} |")
    return "\n".join(lines)


@dataclass(frozen=True)
class DocBlock:
    """The block of docs/tuning.md that shows one table, between its two markers, generated by
    ``python -m <module> --write``."""

    name: str  # names the markers: "fwd_tuning"
    module: str  # writes the block: "fa_sm100.hopper.fwd_tuning"
    table: str  # the table's name in it: "FWD_TUNING"
    rows: tuple
    title: str  # "the SM90 forward's tuning table"
    path: Path = DOC

    @property
    def begin(self) -> str:
        return (f"<!-- BEGIN {self.name} table: generated by `python -m {self.module} --write` "
                f"from {self.table}; edit the rows there -->")

    @property
    def end(self) -> str:
        return f"<!-- END {self.name} table -->"

    def render(self, text: str) -> str:
        """``text`` (the page) with this block replaced by the current table."""
        head, begin, rest = text.partition(self.begin)
        _, end, tail = rest.partition(self.end)
        if not begin or not end:
            raise ValueError(f"{self.path} lacks the markers {self.begin!r} ... {self.end!r}")
        return f"{head}{self.begin}\n{render_table(self.rows)}\n{self.end}{tail}"

    def main(self, argv=None) -> int:
        """Print the table, or write / check the page (exit 1 where it is out of date)."""
        parser = argparse.ArgumentParser(
            description=f"Print {self.title}, or write / check {self.path.name}.")
        group = parser.add_mutually_exclusive_group()
        group.add_argument("--write", action="store_true", help=f"rewrite the table in {self.path}")
        group.add_argument("--check", action="store_true",
                           help=f"exit 1 if the table in {self.path} differs from {self.table}")
        args = parser.parse_args(argv)
        if not (args.write or args.check):
            print(render_table(self.rows))
            return 0
        text = self.path.read_text()
        new = self.render(text)
        if args.write:
            self.path.write_text(new)
            return 0
        if new != text:
            print(f"{self.path} is out of date: python -m {self.module} --write", file=sys.stderr)
            return 1
        return 0
