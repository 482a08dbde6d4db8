"""Checkpoint formats and commands the CLI finds as plugins.

The core knows one format, ``tenplex`` (the store). Other packages add
formats through the ``tenplex.formats`` entry-point group; each entry point
names an object with:

- ``name``: the ``--format`` value;
- ``detect(path) -> bool``: whether ``path`` holds a checkpoint of this format;
- ``describe(path, **options)``: what the checkpoint holds, read from its
  metadata only (no tensor data): an object with ``tree``, ``config``,
  ``values`` (``{path: JSON value}``, possibly partial) and ``meta``;
- ``open_source(path, **options)``: a :class:`tenplex.store.source.ShardSource`
  over the checkpoint's own files, which the planner and the store executor
  read in place, by byte ranges;
- ``write(source, path, to, **options) -> dict``: write any ``ShardSource``
  laid out for ``to`` as a checkpoint of this format at ``path``
  (atomically), one target file at a time; the result has
  ``bytes_written``, ``padding`` (:class:`~tenplex.transform.plan.PaddingChange`
  records) and ``notes`` (lines for the user);
- ``verify(path, **options) -> dict``: check the files on disk; the result
  has ``files``, ``bytes``, ``tensors`` and ``checksums`` (``{file: digest}``
  or None);
- optionally ``reshard(src, dst, to, **options) -> dict | None``: a direct
  reshard within the format, for formats whose files hold model-space
  tensors; None when it cannot (the CLI then goes through the planner).

``options`` may hold ``model_config`` (a JSON file's path), ``threads``,
``checksums`` and ``progress`` (``progress(done_bytes, total_bytes)``).

Packages add commands through the ``tenplex.commands`` group: each entry
point names an object with ``name``, ``help``, ``add_arguments(parser)``
and ``run(args) -> int``.
"""

from __future__ import annotations

from importlib.metadata import entry_points

from tenplex.errors import ManifestError, StoreError
from tenplex.store.manifest import MANIFEST
from tenplex.store.url import StoreRoot

__all__ = ["TENPLEX", "formats", "detect", "commands"]

TENPLEX = "tenplex"


def formats() -> dict:
    """``{name: plugin}`` for every installed format plugin."""
    out = {}
    for ep in entry_points(group="tenplex.formats"):
        plugin = ep.load()
        out[plugin.name] = plugin
    return out


def commands() -> dict:
    """``{name: command}`` for every installed command plugin."""
    out = {}
    for ep in entry_points(group="tenplex.commands"):
        command = ep.load()
        out[command.name] = command
    return out


def detect(path: str) -> str:
    """The format of the checkpoint at ``path``.

    Raises:
        ManifestError: if no known format recognizes it.
    """
    root = StoreRoot(path)
    try:
        if root.exists(MANIFEST):
            return TENPLEX
    except StoreError:
        pass
    for name, plugin in formats().items():
        if plugin.detect(path):
            return name
    known = ", ".join([TENPLEX] + sorted(formats()))
    raise ManifestError(f"{path}: not a checkpoint of any known format ({known}); "
                        f"a tenplex checkpoint has a {MANIFEST}")
