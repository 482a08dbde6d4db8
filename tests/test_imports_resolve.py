"""Every name imported from ``tenplex`` or ``tenplex_megatron`` exists, and so does every attribute
used on an imported module of theirs, in the library, the examples, the benchmarks and the tests.

This is what a merge that renames or removes a function breaks first, and a test suite that never
runs the caller does not notice. On 7391691 (main after four merges) it found
``live/state.py`` calling ``rng.encode``, removed by another branch (every live change raised
AttributeError), and ``hostile/test_api.py`` importing ``tenplex_megatron.dist`` (the module
failed at collection).

Scanned statically (``ast``): ``from X import name [as alias]``, ``import X [as alias]`` and
``alias.attr`` where ``alias`` names a module of these packages. In-function imports count too.
"""

from __future__ import annotations

import ast
import importlib
import pathlib
from types import ModuleType

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCANNED = ["tenplex", "integrations/megatron/tenplex_megatron", "examples", "bench", "tests",
           "integrations/megatron/tests"]
PACKAGES = ("tenplex", "tenplex_megatron")


def _ours(name: str) -> bool:
    return name.split(".")[0] in PACKAGES


def _resolve(module: str, name: str):
    """``module.name``: an attribute, or a submodule; raises ImportError/AttributeError if neither."""
    mod = importlib.import_module(module)
    if hasattr(mod, name):
        return getattr(mod, name)
    try:
        return importlib.import_module(f"{module}.{name}")
    except ModuleNotFoundError:
        raise AttributeError(f"module {module} has no {name!r}") from None


def _problems(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    modules: dict[str, ModuleType] = {}
    out = []
    for node in ast.walk(tree):
        try:
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and _ours(node.module):
                for alias in node.names:
                    obj = _resolve(node.module, alias.name)
                    if isinstance(obj, ModuleType):
                        modules[alias.asname or alias.name] = obj
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if _ours(alias.name):
                        mod = importlib.import_module(alias.name)
                        if alias.asname:
                            modules[alias.asname] = mod
        except (ImportError, AttributeError) as exc:
            out.append(f"{where}:{node.lineno}: {type(exc).__name__}: {exc}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            mod = modules[node.value.id]
            if not hasattr(mod, node.attr):
                try:
                    importlib.import_module(f"{mod.__name__}.{node.attr}")
                except ImportError:
                    out.append(f"{where}:{node.lineno}: module {mod.__name__} has no {node.attr!r}")
    return out


def test_every_imported_name_and_module_attribute_exists():
    files = sorted(p for d in SCANNED for p in (ROOT / d).rglob("*.py"))
    assert len(files) > 100
    problems = [p for f in files for p in _problems(f)]
    assert not problems, "\n".join(problems)


def test_the_check_sees_a_missing_name(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("from tenplex.errors import NoSuchError\nimport tenplex.units as u\n"
                     "def f():\n    from tenplex_megatron.model import rng\n    return rng.encode, u.no_such\n")
    got = _problems(probe)
    assert len(got) == 3 and "NoSuchError" in got[0], got
    assert {"module tenplex_megatron.model.rng has no 'encode'", "module tenplex.units has no 'no_such'"} == \
        {g.split(": ", 1)[1] for g in got[1:]}, got
