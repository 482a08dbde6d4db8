"""The user guide's Python blocks run, in order, as written."""

import pathlib
import re

DOCS = pathlib.Path(__file__).parent.parent / "docs"


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
    from tenplex.cli.main import build_parser

    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    for name in commands:
        assert (DOCS / "cli" / f"{name}.md").exists(), name
