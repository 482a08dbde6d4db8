"""Checkpoint formats the CLI reads and writes, found as plugins.

The core knows one format, ``tenplex`` (the store). Other packages add
formats through the ``tenplex.formats`` entry-point group; each entry point
names an object with:

- ``name``: the ``--format`` value;
- ``detect(path) -> bool``: whether ``path`` holds a checkpoint of this format;
- ``to_store(path, tmp_url) -> dict``: convert it into a tenplex store at
  ``tmp_url`` and return the meta to carry along;
- ``from_store(url, path, to=None)``: write the tenplex store at ``url``, laid
  out for ``to``, as a checkpoint of this format at ``path`` (atomically);
- optionally ``reshard(src, dst, to, **options)``: a direct reshard within the
  format, for formats whose files hold model-space tensors; it returns None
  when it cannot (the CLI then goes through the planner).
"""

from __future__ import annotations

from importlib.metadata import entry_points

from tenplex.errors import ManifestError, StoreError
from tenplex.store.manifest import MANIFEST
from tenplex.store.url import StoreRoot

__all__ = ["TENPLEX", "formats", "detect"]

TENPLEX = "tenplex"


def formats() -> dict:
    """``{name: plugin}`` for every installed format plugin."""
    out = {}
    for ep in entry_points(group="tenplex.formats"):
        plugin = ep.load()
        out[plugin.name] = plugin
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
