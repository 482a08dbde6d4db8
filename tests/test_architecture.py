"""The house rules, checked by walking the source: no import cycles, layers point down, small modules.

Every import counts, including imports inside functions (they hide cycles
from the interpreter, not from readers). ``from a import b`` is an edge to
the module ``a.b`` when that is a module, else to ``a``.
"""

from __future__ import annotations

import ast
import graphlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = {"tenplex": ROOT / "tenplex",
            "tenplex_megatron": ROOT / "integrations" / "megatron" / "tenplex_megatron"}
MAX_LINES = 500

# layer -> layers it may import (besides itself and the leaf modules below)
LAYERS = {
    "tenplex.ptree": set(),
    "tenplex.models": {"tenplex.ptree"},
    "tenplex.transform": {"tenplex.ptree"},
    "tenplex.store": {"tenplex.ptree", "tenplex.transform"},
    # api, elastic and distributed_save are siblings over store: none imports another
    "tenplex.api": {"tenplex.ptree", "tenplex.transform", "tenplex.store"},
    "tenplex.elastic": {"tenplex.ptree", "tenplex.transform", "tenplex.store"},
    "tenplex.distributed_save": {"tenplex.ptree", "tenplex.transform", "tenplex.store"},
    # host-local snapshots; recovery from them sits over api (load) and elastic (recover)
    "tenplex.snapshot": {"tenplex.ptree", "tenplex.transform", "tenplex.store"},
    "tenplex.snapshot_recover": {"tenplex.ptree", "tenplex.transform", "tenplex.store", "tenplex.api",
                                 "tenplex.elastic", "tenplex.snapshot"},
    "tenplex.cli": {"tenplex.ptree", "tenplex.transform", "tenplex.store", "tenplex.models",
                    "tenplex.api", "tenplex.elastic", "tenplex.distributed_save"},
}
"""The graph drawn in docs/architecture.md."""
LEAVES = {"tenplex.errors", "tenplex.units"}
"""Modules every layer may import (they import nothing of tenplex)."""


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for name, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((name,) + parts)] = path
    return out


def _imports(module: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The project modules that ``module`` imports anywhere in its body."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c` of a non-module attribute
                target = target.rpartition(".")[0]
            if target and target != module:
                out.add(target)
    return out


GRAPH = {m: _imports(m, p, set(_modules())) for m, p in _modules().items()}


def test_no_import_cycles():
    sorter = graphlib.TopologicalSorter({m: deps for m, deps in GRAPH.items()})
    try:
        sorter.prepare()
    except graphlib.CycleError as exc:
        pytest.fail(f"import cycle: {' -> '.join(exc.args[1])}")


def test_modules_do_not_import_their_own_package_facade():
    offenders = [m for m, deps in GRAPH.items() if m.count(".") >= 1 and
                 m.split(".")[0] in deps]
    assert not offenders, f"import from a submodule instead of the package facade: {offenders}"


def test_layers_point_down():
    bad = []
    for module, deps in GRAPH.items():
        layer = next((l for l in LAYERS if module == l or module.startswith(l + ".")), None)
        for dep in deps:
            if dep.startswith("tenplex_megatron") and module.startswith("tenplex."):
                bad.append(f"{module} -> {dep} (the core knows nothing of Megatron)")
            if layer is None or dep in LEAVES or dep == layer or dep.startswith(layer + "."):
                continue
            allowed = LAYERS[layer]
            if not any(dep == a or dep.startswith(a + ".") for a in allowed):
                bad.append(f"{module} -> {dep}")
    assert not bad, "imports that point up or sideways:\n" + "\n".join(bad)


def test_modules_are_small():
    folders = [ROOT / d for d in ("tenplex", "integrations", "tests", "bench", "examples")]
    big = {}
    for folder in folders:
        for path in folder.rglob("*.py"):
            n = len(path.read_text().splitlines())
            if n >= MAX_LINES:
                big[str(path.relative_to(ROOT))] = n
    assert not big, f"modules of {MAX_LINES} lines or more: {big}"


def test_the_walk_sees_imports_inside_functions():
    # guard the guard: a known in-function import must be in the graph
    assert GRAPH and all(isinstance(v, set) for v in GRAPH.values())
    inside = [m for m, p in _modules().items()
              if any(isinstance(n, (ast.Import, ast.ImportFrom)) and n.col_offset > 0
                     for n in ast.walk(ast.parse(p.read_text())))]
    assert inside, "no in-function imports found; the walk would not prove anything about them"
