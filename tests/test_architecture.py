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
    # formats: the protocol, the registry and the tenplex store as a format, over store
    "tenplex.formats": {"tenplex.ptree", "tenplex.transform", "tenplex.store", "tenplex.models"},
    # api, elastic and distributed_save are siblings over store: none imports another
    "tenplex.api": {"tenplex.ptree", "tenplex.transform", "tenplex.store", "tenplex.formats"},
    "tenplex.elastic": {"tenplex.ptree", "tenplex.transform", "tenplex.store"},
    "tenplex.distributed_save": {"tenplex.ptree", "tenplex.transform", "tenplex.store"},
    # host-local snapshots; recovery from them sits over api (load) and elastic (recover)
    "tenplex.snapshot": {"tenplex.ptree", "tenplex.transform", "tenplex.store"},
    "tenplex.snapshot_recover": {"tenplex.ptree", "tenplex.transform", "tenplex.store", "tenplex.api",
                                 "tenplex.elastic", "tenplex.snapshot"},
    # a reshard run by the processes of a torchrun job, over formats and store
    "tenplex.distributed_reshard": {"tenplex.ptree", "tenplex.transform", "tenplex.store", "tenplex.formats",
                                    "tenplex.distributed_parts"},
    # its branch for a format that writes in parts (Megatron): over formats only
    "tenplex.distributed_parts": {"tenplex.ptree", "tenplex.transform", "tenplex.store", "tenplex.formats"},
    "tenplex.cli": {"tenplex.ptree", "tenplex.transform", "tenplex.store", "tenplex.formats", "tenplex.models",
                    "tenplex.api", "tenplex.elastic", "tenplex.distributed_save", "tenplex.distributed_reshard"},
    "tenplex.__main__": {"tenplex.cli"},
}
"""The graph drawn in docs/architecture.md."""
CORE = {"tenplex", "tenplex.ptree", "tenplex.models", "tenplex.transform", "tenplex.store", "tenplex.formats",
        "tenplex.api", "tenplex.snapshot", "tenplex.snapshot_recover",
        "tenplex.elastic", "tenplex.distributed_save", "tenplex.distributed_reshard", "tenplex.distributed_parts"}
"""What the integration may import of the core (not the CLI)."""
MEGATRON = "tenplex_megatron"
LAYERS.update({
    # the facade: above every core layer but the CLI
    "tenplex": CORE - {"tenplex"},
    # the integration's wings: torchfiles and dcp know no Megatron; legacy and dist are siblings
    f"{MEGATRON}.torchfiles": CORE,
    f"{MEGATRON}.dcp": CORE | {f"{MEGATRON}.torchfiles"},
    f"{MEGATRON}.model": CORE | {f"{MEGATRON}.torchfiles"},
    f"{MEGATRON}.formats": CORE | {f"{MEGATRON}.torchfiles", f"{MEGATRON}.model"},
    f"{MEGATRON}.formats.legacy": CORE | {f"{MEGATRON}.torchfiles", f"{MEGATRON}.model",
                                          f"{MEGATRON}.formats"},
    f"{MEGATRON}.formats.dist": CORE | {f"{MEGATRON}.torchfiles", f"{MEGATRON}.dcp", f"{MEGATRON}.model",
                                        f"{MEGATRON}.formats"},
    f"{MEGATRON}.formats.plugin": CORE | {f"{MEGATRON}.model", f"{MEGATRON}.formats",
                                          f"{MEGATRON}.formats.legacy", f"{MEGATRON}.formats.dist"},
    f"{MEGATRON}.live": CORE | {f"{MEGATRON}.torchfiles", f"{MEGATRON}.model"},
    f"{MEGATRON}.cpu_shim": set(),
    f"{MEGATRON}.demo": CORE | {f"{MEGATRON}.model", f"{MEGATRON}.live", f"{MEGATRON}.cpu_shim"},
    f"{MEGATRON}.commands": {f"{MEGATRON}.demo"},
})
LEAVES = {"tenplex.errors", "tenplex.units", "tenplex.limits", "tenplex.argtypes"}
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


def _layer(module: str) -> str | None:
    """The layer ``module`` belongs to: the longest layer name that is it or a package above it."""
    hits = [layer for layer in LAYERS if module == layer or module.startswith(layer + ".")]
    return max(hits, key=len, default=None)


def violations(graph: dict[str, set[str]]) -> list[str]:
    """Every edge of ``graph`` that points up or sideways between layers, one line each."""
    bad = []
    for module, deps in graph.items():
        layer = _layer(module)
        for dep in deps:
            if dep.startswith(MEGATRON) and module.startswith("tenplex."):
                bad.append(f"{module} -> {dep} (the core knows nothing of Megatron)")
                continue
            target = _layer(dep)
            if layer is None or dep in LEAVES or target == layer or target in LAYERS[layer]:
                continue
            bad.append(f"{module} -> {dep}")
    return sorted(bad)


def test_layers_point_down():
    bad = violations(GRAPH)
    assert not bad, "imports that point up or sideways:\n" + "\n".join(bad)


@pytest.mark.parametrize("edge", [
    ("tenplex_megatron.formats.legacy.read", "tenplex_megatron.formats.dist.read"),
    ("tenplex_megatron.formats.dist.read", "tenplex_megatron.formats.legacy.grid"),
    ("tenplex_megatron.live.change", "tenplex_megatron.formats.plugin"),
    ("tenplex_megatron.dcp.records", "tenplex_megatron.model.config"),
    ("tenplex_megatron.torchfiles.ptfile", "tenplex_megatron.dcp.records"),
    ("tenplex_megatron.formats.common", "tenplex_megatron.formats.legacy.read"),
    ("tenplex.store.reader", "tenplex.api"),
    ("tenplex.ptree.tree", "tenplex_megatron.model.layouts"),
])
def test_an_added_edge_between_wings_is_caught(edge):
    module, dep = edge
    assert module in GRAPH and dep in GRAPH, f"{edge}: a module the test names is gone; update the test"
    graph = {m: set(d) for m, d in GRAPH.items()}
    graph[module].add(dep)
    assert any(line.startswith(f"{module} -> {dep}") for line in violations(graph)), edge


def test_modules_are_small():
    folders = [ROOT / d for d in ("tenplex", "integrations", "tests", "bench", "examples")]
    big = {}
    for folder in folders:
        for path in folder.rglob("*.py"):
            n = len(path.read_text().splitlines())
            if n >= MAX_LINES:
                big[str(path.relative_to(ROOT))] = n
    assert not big, f"modules of {MAX_LINES} lines or more: {big}"


def test_the_walk_sees_imports_inside_functions(tmp_path):
    # guard the guard: an import inside a function is an edge of the graph
    path = tmp_path / "probe.py"
    path.write_text("def f():\n    from tenplex_megatron.formats.dist import read\n    return read\n")
    assert _imports("tenplex_megatron.formats.legacy.probe", path, set(GRAPH)) == \
        {"tenplex_megatron.formats.dist.read"}


def test_no_process_global_caches():
    """No ``functools.lru_cache``/``cache`` in the libraries: what is derived from a config is built once
    per operation and handed down (the plan carries its shardings; a Megatron config keeps what is
    derived from it, ``tenplex_megatron.model.derived``), never kept in process-global state."""
    found = []
    for module, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for dec in node.decorator_list:
                    target = dec.func if isinstance(dec, ast.Call) else dec
                    name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
                    if name in ("lru_cache", "cache"):
                        found.append(f"{module}.{node.name}")
    assert not found, f"process-global caches: {found}"
