"""Commands the CLI finds as plugins.

Packages add commands through the ``tenplex.commands`` entry-point group:
each entry point names an object with ``name``, ``help``,
``add_arguments(parser)`` and ``run(args) -> int``. (Checkpoint formats are
plugins of the library, not of the CLI: see :mod:`tenplex.formats`.)
"""

from __future__ import annotations

from importlib.metadata import entry_points

__all__ = ["commands"]


def commands() -> dict:
    """``{name: command}`` for every installed command plugin."""
    out = {}
    for ep in entry_points(group="tenplex.commands"):
        command = ep.load()
        out[command.name] = command
    return out
