"""The tenplex error hierarchy.

Every error raised on purpose by tenplex derives from :class:`TenplexError`
and also from the built-in exception that fits it best, so callers may catch
either. Messages name the object, what was expected and what was found.

::

    TenplexError
    ├── ConfigError(ValueError)        impossible parallel config for a tree
    ├── LayoutError(ValueError)        a layout that cannot describe its tensor
    ├── PathError(ValueError)          a bad leaf path or storage key ('..', absolute, ...)
    ├── ShardError(ValueError)         shards that do not match the tree (dtype, shape, leaf)
    │   └── ReplicaMismatchError       replicas of one region disagree
    ├── MissingDataError(LookupError)  a region that no live source holds
    ├── PlanError(ValueError)          a malformed or mismatched plan
    ├── StoreError(OSError)            storage failures
    │   ├── ManifestError              missing, malformed or unknown-version manifest
    │   │   └── UnsafePickleError      a pickle that asks for what the allow-list refuses
    │   ├── CorruptShardError          checksum mismatch, truncated or missing shard file
    │   └── AlreadyExistsError         a committed checkpoint would be overwritten
    ├── TransferError(RuntimeError)    a peer failed or timed out during a transfer
    └── LimitError(MemoryError)        an input that needs more memory or deeper nesting than the
                                       process has (a MemoryError or RecursionError while it was read)

The verbs (``tenplex.save``, ``load``, ``load_global``, ``reshard``, ``verify``,
``save_distributed``) and the ``tenplex`` command turn a ``MemoryError`` or
``RecursionError`` raised inside them into a :class:`LimitError` naming their
input, at one place each (:func:`bounded_entry`, ``tenplex.cli.main.main``).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, TypeVar

__all__ = [
    "TenplexError",
    "ConfigError",
    "LayoutError",
    "PathError",
    "ShardError",
    "ReplicaMismatchError",
    "MissingDataError",
    "PlanError",
    "StoreError",
    "ManifestError",
    "UnsafePickleError",
    "CorruptShardError",
    "AlreadyExistsError",
    "TransferError",
    "LimitError",
    "exhausted",
    "bounded_entry",
]


class TenplexError(Exception):
    """Base class of every error tenplex raises on purpose."""


class ConfigError(TenplexError, ValueError):
    """A parallel config that is impossible for the tree (e.g. tp does not divide heads)."""


class LayoutError(TenplexError, ValueError):
    """A layout that does not fit its tensor (axis out of range, parts that do not sum up)."""


class PathError(TenplexError, ValueError):
    """A leaf path or storage key that is empty, absolute, or contains '..'."""


class ShardError(TenplexError, ValueError):
    """Local shards that do not match the tree: missing leaf, wrong dtype or shape."""


class ReplicaMismatchError(ShardError):
    """Two replicas of the same region hold different bytes."""


class MissingDataError(TenplexError, LookupError):
    """Some destination regions have no live source.

    Attributes:
        missing: ``{leaf path: [Box, ...]}``, the regions (in global
            coordinates of the padded tensor) that no live source holds.
    """

    def __init__(self, message: str, missing: dict | None = None):
        super().__init__(message)
        self.missing = dict(missing or {})


class PlanError(TenplexError, ValueError):
    """A plan that is malformed or does not belong to the given tree or shards."""


class StoreError(TenplexError, OSError):
    """A failure reading or writing a store."""


class ManifestError(StoreError):
    """A manifest that is missing, malformed, or of an unknown format version."""


class UnsafePickleError(ManifestError):
    """A checkpoint file whose pickle tenplex refuses to load.

    A global outside the exact allow-list, a call or state that the allowed
    global does not take, an opcode outside the accepted set, or a stream
    that is truncated or lies about a length. Nothing from the file has run.
    """


class CorruptShardError(StoreError):
    """A shard file that is missing, truncated, or fails its checksum."""


class AlreadyExistsError(StoreError):
    """A save that would overwrite a committed checkpoint."""


class TransferError(TenplexError, RuntimeError):
    """A distributed transfer failed: a peer died, timed out or raised."""


class LimitError(TenplexError, MemoryError):
    """An input whose reading needs more memory, or deeper recursion, than the process has.

    Raised in place of a ``MemoryError`` or ``RecursionError`` that a read or
    write raised (the message names the input, what ran out, and the limit to
    raise). Inputs beyond a named limit of :mod:`tenplex.limits` are refused
    earlier, with the error of the file they come from.
    """


def exhausted(what: str, exc: BaseException) -> "LimitError":
    """The :class:`LimitError` for ``exc`` (a ``MemoryError`` or ``RecursionError``) raised while ``what`` was handled."""
    text = str(what)
    text = text if len(text) <= 300 else text[:297] + "..."
    if isinstance(exc, RecursionError):
        return LimitError(f"{text}: expected nesting within Python's recursion limit, found deeper "
                          "nesting while it was read (RecursionError); the input is refused")
    return LimitError(f"{text}: expected the input to fit in this process's memory, found it does not "
                      "(MemoryError while it was read); the input is refused")


def _named(signature: inspect.Signature, args: tuple, kwargs: dict, arg: str) -> str:
    try:
        value = signature.bind_partial(*args, **kwargs).arguments.get(arg)
    except TypeError:
        return "..."
    return str(value) if isinstance(value, str) or hasattr(value, "__fspath__") else "..."


F = TypeVar("F", bound=Callable[..., Any])


def bounded_entry(arg: str) -> Callable[[F], F]:
    """Decorate a public verb: a ``MemoryError`` or ``RecursionError`` escaping it becomes a :class:`LimitError`.

    The message names the verb's argument ``arg`` (the checkpoint's path or URL).
    A :class:`TenplexError` (a ``LimitError`` included) passes unchanged.
    """
    def wrap(fn: F) -> F:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def verb(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except TenplexError:
                raise
            except (MemoryError, RecursionError) as exc:
                error = exhausted(f"{fn.__name__}({_named(signature, args, kwargs, arg)})", exc)
            raise error  # outside the handler: the failed call's frames (and their memory) are freed
        return verb  # type: ignore[return-value]
    return wrap
