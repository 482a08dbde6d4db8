"""Which formats are installed, and which one a path is.

The tenplex store is built in (:mod:`tenplex.formats.store`); other packages
add formats through the ``tenplex.formats`` entry-point group, each entry
point naming a :class:`~tenplex.formats.protocol.Format` object (the
``tenplex-megatron`` package adds ``megatron-legacy`` and ``megatron-dist``).
"""

from __future__ import annotations

from importlib.metadata import entry_points

from tenplex.errors import ConfigError, ManifestError
from tenplex.formats.protocol import Format
from tenplex.formats.store import TENPLEX, TenplexFormat
from tenplex.store.manifest import MANIFEST
from tenplex.store.url import StoreRoot, translate_errors

__all__ = ["formats", "get_format", "detect", "broken"]

ENTRY_POINTS = "tenplex.formats"
"""The entry-point group formats register under."""

NO_PLUGINS = (f"; no format plugin is installed (none registers a {ENTRY_POINTS!r} entry point: on PYTHONPATH "
              "alone a package registers none): `pip install -e integrations/megatron` (tenplex-megatron) "
              "adds megatron-legacy, megatron-dist and hf")
"""Added to "unknown format" errors where only the built-in store is known."""


def broken() -> dict[str, str]:
    """``{entry point name: why it did not load}`` for installed format plugins that fail to import.

    A plugin that cannot be imported (a stale install, a missing optional
    dependency) does not stop the other formats: :func:`formats` leaves it
    out, and :func:`get_format` and :func:`detect` name it and its error
    where it could have been the one asked for.
    """
    out = {}
    for ep in entry_points(group=ENTRY_POINTS):
        try:
            ep.load()
        except Exception as exc:  # noqa: BLE001 - any import failure of a plugin is reported, not raised
            out[ep.name] = f"{ep.value}: {type(exc).__name__}: {str(exc)[:200]}"
    return out


def formats() -> dict[str, Format]:
    """``{name: format}``: the tenplex store first, then every installed plugin by entry-point order.

    Plugins that fail to import are left out (see :func:`broken`).

    Raises:
        ConfigError: a plugin's object lacks a call of the protocol, or its
            name is taken.
    """
    out: dict[str, Format] = {TENPLEX: TenplexFormat()}
    for ep in entry_points(group=ENTRY_POINTS):
        try:
            fmt = ep.load()
        except Exception:  # noqa: BLE001 - reported by broken()
            continue
        if not isinstance(fmt, Format):
            raise ConfigError(f"entry point {ep.name} = {ep.value}: expected a tenplex.formats.Format "
                              f"(name, detect, describe, open_source, write, verify); found {type(fmt).__name__}")
        if fmt.name in out:
            raise ConfigError(f"entry point {ep.name} = {ep.value}: format name {fmt.name!r} is taken")
        out[fmt.name] = fmt
    return out


def get_format(name: str) -> Format:
    """The installed format called ``name``.

    Raises:
        ConfigError: no such format.
    """
    if name == TENPLEX:  # built in: no plugin is imported (a plugin may not take its name)
        return TenplexFormat()
    known = formats()
    if name not in known:
        bad = broken()
        why = f"; the plugin {name!r} is installed but does not load ({bad[name]})" if name in bad else ""
        if len(known) == 1 and not bad:
            why = NO_PLUGINS
        raise ConfigError(f"format {name!r}: unknown; expected one of {', '.join(known)}{why}")
    return known[name]


def detect(path: str) -> Format:
    """The format of the checkpoint at ``path`` (the tenplex store is asked first).

    Raises:
        StoreError: the backend cannot look at ``path`` (no credentials, an fsspec protocol
            whose package is missing): its error, not "not a checkpoint".
        ManifestError: no installed format recognizes it; or one says why it cannot read it
            (its ``why_not``: a Megatron ``--save`` root whose tracker names a missing folder).
    """
    store = TenplexFormat()
    if store.detect(path):  # asked first anyway: a tenplex store needs no plugin imported
        return store
    known = formats()
    for fmt in known.values():
        if fmt.detect(path):
            return fmt
    _reachable(path)
    for fmt in known.values():  # one that half recognizes it says what is wrong (see the protocol)
        why = getattr(fmt, "why_not", None)
        reason = why(path) if why is not None else None
        if reason:
            raise ManifestError(reason)
    bad = "".join(f"; plugin {n} does not load ({why})" for n, why in broken().items())
    hint = NO_PLUGINS if len(known) == 1 and not bad else ""
    raise ManifestError(f"{path}: not a checkpoint of any known format ({', '.join(known)}); "
                        f"a tenplex checkpoint has a {MANIFEST}{bad}{hint}")


def _reachable(path: str) -> None:
    """Raise the backend's StoreError if ``path`` cannot be asked whether it exists.

    Formats' ``detect`` answers only yes or no (a backend error is a no), so this asks once more
    where none said yes, to tell "not a checkpoint" from "cannot look".
    """
    root = StoreRoot(path)
    with translate_errors(str(path)):
        root.fs.exists(root.path)
