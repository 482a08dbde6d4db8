"""Every Python snippet in docs/elastic.md and docs/megatron.md is code a test runs (issue 24).

A snippet is preceded by ``<!-- tested: PATH ... -->``; every code line of it
(comments dropped) is a line of PATH, and PATH is run by a test. The live
snippets use no name the page leaves undefined, the failure recipe recovers
outside its ``except`` block, the dotted names the pages give import, and the
command line the Megatron example documents parses.
"""

import argparse
import ast
import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = ["docs/elastic.md", "docs/megatron.md"]
BLOCK = re.compile(r"((?:<!-- tested: (\S+)[^>]*-->\n)?)```python\n(.*?)```", flags=re.S)
NOT_MODULES = {"tenplex.commands"}
"""Dotted names on the pages that are not Python objects: an entry-point group."""
TESTS = [*sorted((ROOT / "tests").rglob("test_*.py")),
         *sorted((ROOT / "integrations" / "megatron" / "tests").rglob("test_*.py"))]


def _code(line: str) -> str:
    return re.sub(r"\s+#[^\"']*$", "", line).strip()


def _blocks(page: str):
    """``(tested path or None, code, the text after the block up to the next block or heading)``."""
    text = (ROOT / page).read_text()
    out = []
    for m in BLOCK.finditer(text):
        rest = text[m.end():]
        stop = min([i for i in (rest.find("```"), rest.find("\n#")) if i >= 0] or [len(rest)])
        out.append((m.group(2), m.group(3), rest[:stop]))
    return out


@pytest.mark.parametrize("page", PAGES)
def test_every_snippet_is_lines_of_a_file_a_test_runs(page):
    blocks = _blocks(page)
    assert blocks, page
    for path, code, _ in blocks:
        assert path is not None, f"{page}: a snippet without a '<!-- tested: PATH -->' marker:\n{code[:200]}"
        ran = {_code(line) for line in (ROOT / path).read_text().splitlines()}
        lines = [_code(line) for line in code.splitlines() if _code(line) and not line.lstrip().startswith("#")]
        missing = [line for line in lines if line not in ran]
        assert not missing, (page, path, missing)
        name = pathlib.Path(path)
        runners = [t.name for t in TESTS if t.name != "test_docs_snippets.py"
                   and (name.name in t.read_text() or f"import {name.stem}" in t.read_text())]
        assert runners, f"{page}: no test runs {path}"


def _free_names(code: str) -> set[str]:
    """Names a snippet reads that it neither assigns nor imports."""
    tree = ast.parse(code)
    bound, read = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (bound if isinstance(node.ctx, ast.Store) else read).add(node.id)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return read - bound - set(dir(__builtins__) if isinstance(__builtins__, dict) is False else __builtins__)


@pytest.mark.parametrize("page", PAGES)
def test_every_name_a_snippet_uses_is_defined_or_explained(page):
    """A name a snippet reads is assigned or imported in it, or named (in backticks) in the
    text right after it, or in an earlier snippet of the page."""
    earlier: set[str] = set()
    for path, code, after in _blocks(page):
        explained = set(re.findall(r"`([A-Za-z_]\w*)", after))
        unexplained = _free_names(code) - explained - earlier
        assert not unexplained, f"{page} ({path}): {sorted(unexplained)} are used but never defined or explained"
        earlier |= {n.id for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Name)} | explained


def test_the_failure_recipe_recovers_outside_the_except_block():
    failures = [code for path, code, _ in _blocks("docs/megatron.md") if "live.rebuild_after_failure(" in code]
    assert len(failures) == 1
    tree = ast.parse(failures[0])
    tries = [n for n in ast.walk(tree) if isinstance(n, ast.Try)]
    assert tries, "the failure recipe must show where the failure is caught"
    in_handler = {id(n) for t in tries for h in t.handlers for n in ast.walk(h)}
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr in ("export_state", "leave", "rebuild_after_failure")]
    assert len(calls) == 3 and not [c for c in calls if id(c) in in_handler]


@pytest.mark.parametrize("page", PAGES)
def test_dotted_names_on_the_page_import(page):
    text = (ROOT / page).read_text()
    names = sorted(set(re.findall(r"`((?:tenplex_megatron|tenplex)(?:\.[A-Za-z_]\w*)+)`", text)) - NOT_MODULES)
    assert names
    wrong = []
    for name in names:
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            try:
                for attr in parts[cut:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                wrong.append(name)
            break
        else:
            wrong.append(name)
    assert not wrong, f"{page} names what does not import: {wrong}"


def test_the_megatron_example_accepts_its_documented_command_line():
    path = ROOT / "examples" / "megatron_elastic.py"
    source = path.read_text()
    module = ast.parse(source)
    doc = ast.get_docstring(module)
    run = next(line for line in doc.splitlines() if line.startswith("Run:"))
    options = re.findall(r"\[([^\]]+)\]", run)
    assert options, run
    parse = next(n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == "parse_args")
    scope = {"argparse": argparse, "__doc__": doc}
    exec(compile(ast.Module([parse], []), str(path), "exec"), scope)
    for option in options:
        import sys
        saved = sys.argv
        sys.argv = [str(path), *option.split()]
        try:
            scope["parse_args"]()
        except SystemExit as exc:
            pytest.fail(f"{path.name}: its docstring offers {option!r}, which its parser refuses ({exc})")
        finally:
            sys.argv = saved
