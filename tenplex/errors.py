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
    └── TransferError(RuntimeError)    a peer failed or timed out during a transfer
"""

from __future__ import annotations

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
