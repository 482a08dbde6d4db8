"""The format protocol's records (:mod:`tenplex.formats.protocol`) made from the Megatron readers' and writers' results.

Every Megatron format's plugin object (``plugin.py``, ``hf/plugin.py``)
returns these records; the readers and writers keep their own result shapes.
"""

from __future__ import annotations

from tenplex.formats.protocol import Description, VerifyResult, WriteResult, padding_lines

from tenplex_megatron.formats.description import Description as MegatronDescription

__all__ = ["description", "written", "verified"]


def description(name: str, d: MegatronDescription) -> Description:
    """The protocol's :class:`~tenplex.formats.protocol.Description` of a Megatron description."""
    return Description(format=name, tree=d.tree, config=d.config, values=d.values, meta=d.meta,
                       notes=tuple(d.notes))


def written(r: dict, bytes_read: int, direct: bool = False) -> WriteResult:
    """The protocol's record of a writer's ``{"bytes_written", "files", "bytes_needed"?, "padding"?, "notes"?, "part"?}``."""
    return WriteResult(bytes_read=bytes_read, bytes_needed=r.get("bytes_needed"),
                       bytes_written=r["bytes_written"], files=r["files"],
                       padding=padding_lines(r.get("padding", [])), notes=tuple(r.get("notes", [])),
                       direct=direct, part=r.get("part"))


def verified(r: dict, checked: str) -> VerifyResult:
    """The protocol's record of a verifier's ``{"files", "bytes", "tensors", "checksums"}``."""
    return VerifyResult(files=r["files"], bytes=r["bytes"], tensors=r["tensors"], checked=checked,
                        checksums=r.get("checksums"))
