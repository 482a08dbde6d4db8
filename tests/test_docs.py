"""The docs stay true: the guide's Python blocks run, every CLI command has a page, and the
architecture page's trace names functions that exist and call what it says they call."""

import ast
import contextlib
import io
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).parent.parent
DOCS = ROOT / "docs"
REF = re.compile(r"`((?:tenplex|integrations|tests|bench)/[\w/]+\.py):([\w.]+)`")
"""A reference ``path.py:name`` or ``path.py:Class.method`` in backticks."""


def test_guide_examples_run(capsys):
    text = (DOCS / "guide.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= 5
    scope: dict = {}
    for block in blocks:
        exec(compile(block, "docs/guide.md", "exec"), scope)
    out = capsys.readouterr().out
    assert "tp=3 does not divide num_query_groups=8" in out


def test_every_cli_command_has_a_page():
    from tenplex.cli.main import build_parser, command_names

    names = command_names()
    assert {"reshard", "inspect", "plan", "verify", "example"} <= set(names)
    for name in names:
        assert (DOCS / "cli" / f"{name}.md").exists(), name
        out = io.StringIO()  # the parser takes it as a command: `tenplex NAME --help` exits 0
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
            build_parser().parse_args([name, "--help"])
        assert done.value.code == 0 and f"tenplex {name}" in out.getvalue(), name
    with contextlib.redirect_stderr(io.StringIO()), pytest.raises(SystemExit) as done:
        build_parser().parse_args(["no-such-command"])
    assert done.value.code == 2


# -- docs/architecture.md ------------------------------------------------------------

def _definition(path: str, dotted: str) -> ast.AST | None:
    """The function, class or module-level assignment ``dotted`` names in ``path``, or None."""
    file = ROOT / path
    if not file.exists():
        return None
    body = ast.parse(file.read_text()).body
    node = None
    for part in dotted.split("."):
        node = next((n for n in body if getattr(n, "name", None) == part
                     or any(isinstance(t, ast.Name) and t.id == part
                            for t in getattr(n, "targets", [getattr(n, "target", None)]))), None)
        if node is None:
            return None
        body = getattr(node, "body", [])
    return node


def _identifiers(node: ast.AST | None) -> set[str]:
    """Every name and attribute a definition's source mentions (none for a missing one)."""
    out: set[str] = set()
    if node is None:
        return out
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
        elif isinstance(n, ast.alias):  # `from m import f as g` names f
            out.add(n.name.rpartition(".")[2])
    return out


def _mentioned(dotted: str, names: set[str]) -> bool:
    parts = dotted.split(".")
    return parts[-1] in names or (parts[-1] == "__init__" and parts[-2] in names)


def _trace_items() -> list[str]:
    text = (DOCS / "architecture.md").read_text()
    section = text.split("## A trace", 1)[1].split("\n## ", 1)[0]
    return [m.group(0) for m in re.finditer(r"^\d+\. .*?(?=^\d+\. |\Z)", section, re.M | re.S)]


def test_architecture_names_only_definitions_that_exist():
    refs = REF.findall((DOCS / "architecture.md").read_text())
    assert len(refs) >= 40, "the page should name the functions it talks about"
    missing = [f"{p}:{n}" for p, n in refs if _definition(p, n) is None]
    assert not missing, f"docs/architecture.md names what does not exist: {missing}"


def test_architecture_trace_follows_the_calls():
    """In each step of the trace, the first function named calls (or names) every other one,
    directly or through another function named in the same step."""
    items = _trace_items()
    assert len(items) >= 15
    wrong = []
    for item in items:
        refs = list(dict.fromkeys(REF.findall(item)))
        assert len(refs) >= 2, item[:80]
        reached = [refs[0]]
        names = _identifiers(_definition(*refs[0]))
        pending = refs[1:]
        while True:
            found = [r for r in pending if _mentioned(r[1], names)]
            if not found:
                break
            for r in found:
                pending.remove(r)
                reached.append(r)
                names |= _identifiers(_definition(*r))
        wrong += [f"{refs[0][0]}:{refs[0][1]} does not reach {p}:{n}" for p, n in pending]
    assert not wrong, "the trace in docs/architecture.md is out of date:\n" + "\n".join(wrong)


def test_the_trace_check_catches_a_wrong_step():
    # guard the guard: a step that names a function its caller never reaches must fail
    names = _identifiers(_definition("tenplex/cli/main.py", "main"))
    assert _mentioned("build_parser", names)
    assert not _mentioned("make_plan", names)
    assert _definition("tenplex/store/reader.py", "StoreReader.no_such_method") is None
    assert _definition("tenplex/ptree/tree.py", "DTYPES") is not None
