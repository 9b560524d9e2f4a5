"""The package's modules import each other without cycles (docs/index.md, "Layers").

Read from the sources (no import runs): every ``import`` of a module of ``fa_sm100``,
``pipelines`` or ``layouts``. At module level the imports form no cycle; and no import inside
a function names a module that itself imports, directly or not, the importing one at module
level (a deferred import that exists only to dodge a cycle). Deferred imports that keep a
module light (the DSL, an optional dependency, a backend chosen at run time) stay; imports
under ``if TYPE_CHECKING:`` never run and are not counted."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fa_sm100", "pipelines", "layouts")


def _modules() -> dict:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _targets(name: str, path: Path, node) -> set:
    """The project modules one import statement names: ``from pkg import sub`` names the
    submodule (loading it runs the package's ``__init__`` first, which is not a dependency
    of ``sub`` on the package's other modules)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    if isinstance(node, ast.Import):
        found = {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            up = package.split(".")[:len(package.split(".")) - node.level + 1]
            base = ".".join(up + ([node.module] if node.module else []))
        subs = {f"{base}.{a.name}" for a in node.names} & MODULES.keys()
        found = subs or {base}
    return found & MODULES.keys()


def _imports(name: str, path: Path):
    """(module-level targets, deferred targets) of one module."""
    tree = ast.parse(path.read_text())
    top, deferred = set(), set()

    def visit(node, at_top: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                (top if at_top else deferred).update(_targets(name, path, child))
            inner = at_top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                      ast.Lambda))
            visit(child, inner)

    visit(tree, True)
    return top - {name}, deferred - {name}


GRAPH, DEFERRED = {}, {}
for _name, _path in MODULES.items():
    GRAPH[_name], DEFERRED[_name] = _imports(_name, _path)


def _reachable(start: str) -> set:
    seen, todo = set(), [start]
    while todo:
        for nxt in GRAPH[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_module_level_imports_form_no_cycle():
    cycles = sorted(f"{a} -> ... -> {a}" for a in GRAPH if a in _reachable(a))
    assert not cycles, cycles


def test_no_deferred_import_dodges_a_cycle():
    dodges = sorted(f"{a} imports {b} inside a function, and {b} imports {a}"
                    for a, targets in DEFERRED.items() for b in targets
                    if a in _reachable(b))
    assert not dodges, dodges


def test_the_graph_is_read():
    """The reader finds the imports it must (a check that the two tests above can fail)."""
    assert "fa_sm100.ptxemu.decode" in GRAPH["fa_sm100.ptxemu.ops"]
    assert "fa_sm100.softmax_math" in GRAPH["fa_sm100.config"]
    assert "fa_sm100" not in GRAPH["fa_sm100.config"]  # ``from fa_sm100 import sub``
