"""The layout's rules, checked on the source: no import cycle inside moend_fx, library code never imports the
CLI, no module over 300 lines, no function over 60 lines (outside the CLI's argument tables)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_MODULE_LINES = 300
MAX_FUNCTION_LINES = 60


def _modules() -> dict[str, Path]:
    """Every module of the installed package: dotted name -> file (``passes/`` is ``moend_fx.passes``)."""
    out: dict[str, Path] = {}
    for base, prefix in ((ROOT / "moend_fx", "moend_fx"), (ROOT / "passes", "moend_fx.passes")):
        for f in base.rglob("*.py"):
            parts = list(f.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([prefix, *parts])] = f
    return out


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING" or (
        isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING")


def _imported(name: str, tree: ast.Module, *, top_level_only: bool) -> set[str]:
    """moend_fx modules that module ``name`` imports (with the packages Python initialises on the way)."""
    pkg = name if MODULES[name].name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(pkg.split(".")[: len(pkg.split(".")) - node.level + 1] + ([base] if base else []))
                subs = [f"{base}.{a.name}" for a in node.names]
                # `from pkg import submodule` inside pkg needs pkg's __init__ no more than a plain import does
                inside = name.startswith(base + ".") and all(m in MODULES for m in subs)
                targets = subs if inside else [base, *subs]
            elif isinstance(node, ast.If) and not _is_type_checking(node):
                visit(node.body + node.orelse)
                continue
            elif isinstance(node, (ast.Try,)):
                visit(node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body])
                continue
            elif not top_level_only:
                visit([c for c in ast.iter_child_nodes(node) if isinstance(c, ast.stmt)])
                continue
            else:
                continue
            for t in targets:
                parts = t.split(".")
                for i in range(2, len(parts) + 1):
                    mod = ".".join(parts[:i])
                    # moend_fx.a.b also runs moend_fx.a's __init__, unless the importer sits inside moend_fx.a
                    # (then that __init__ is already running: importing a sibling is no edge back to it)
                    implicit = i < len(parts) and name.startswith(mod + ".")
                    if mod in MODULES and not implicit:
                        found.add(mod)

    visit(tree.body)
    found.discard(name)
    return found


def _trees() -> dict[str, ast.Module]:
    return {n: ast.parse(f.read_text(), str(f)) for n, f in MODULES.items()}


TREES = _trees()


def test_no_import_cycle_inside_moend_fx():
    graph = {n: _imported(n, t, top_level_only=True) for n, t in TREES.items()}
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    cycles: list[list[str]] = []

    def dfs(n: str, stack: list[str]) -> None:
        state[n] = 1
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                cycles.append(stack[stack.index(m):] + [m])
            elif m not in state:
                dfs(m, [*stack, m])
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            dfs(n, [n])
    assert not cycles, "import cycles (module-level imports):\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_import_walk_sees_real_edges():
    # guards the test above against passing because it parses nothing
    graph = {n: _imported(n, t, top_level_only=True) for n, t in TREES.items()}
    assert "moend_fx.common.errors" in graph["moend_fx.storage.quant"]
    assert sum(map(len, graph.values())) > 100


def test_library_never_imports_the_cli():
    offenders = sorted(n for n, t in TREES.items() if not n.startswith("moend_fx.cli")
                       and any(m.startswith("moend_fx.cli") for m in _imported(n, t, top_level_only=False)))
    assert not offenders, f"library modules importing moend_fx.cli: {offenders}"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_is_at_most_300_lines(name):
    n = len(MODULES[name].read_text().splitlines())
    assert n <= MAX_MODULE_LINES, f"{MODULES[name].relative_to(ROOT)} has {n} lines"


def _is_argument_table(fn: ast.FunctionDef) -> bool:
    """A CLI function that mostly declares arguments (add_argument / add_parser calls)."""
    calls = [c for c in ast.walk(fn) if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)]
    declaring = [c for c in calls if c.func.attr in ("add_argument", "add_parser", "add_argument_group",
                                                      "add_mutually_exclusive_group", "set_defaults")]
    return len(declaring) * 2 >= len(fn.body)


def test_functions_are_at_most_60_lines():
    long = []
    for name, tree in TREES.items():
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = fn.end_lineno - fn.lineno + 1
                if n > MAX_FUNCTION_LINES and not (name.startswith("moend_fx.cli") and _is_argument_table(fn)):
                    long.append(f"{MODULES[name].relative_to(ROOT)}:{fn.lineno} {fn.name} ({n} lines)")
    assert not long, "functions over 60 lines:\n" + "\n".join(long)
