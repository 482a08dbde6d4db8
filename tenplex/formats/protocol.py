"""The format protocol: what every checkpoint format implements, and the records it returns.

A format is an object with a ``name`` and five calls, made in this order
(modelled on Orbax's ``CheckpointLayout`` and PyTorch DCP's
``StorageReader``/``WriteResult``):

1. ``detect(path) -> bool``: whether ``path`` holds a checkpoint of this
   format. It reads at most a directory listing and a small marker file.
2. ``describe(path, **options) -> Description``: what the checkpoint holds,
   from its metadata only (no tensor data).
3. ``open_source(path, **options) -> ShardSource``: the checkpoint's own files
   as a :class:`tenplex.store.source.ShardSource`, which the planner and the
   store executor read in place, by byte ranges.
4. ``write(source, path, to, **options) -> WriteResult``: any ``ShardSource``,
   laid out for ``to``, written at ``path`` as a checkpoint of this format, a
   bounded number of target files at a time, and committed atomically:
   nothing is visible at ``path`` until every file is written, and a failure
   leaves nothing there.
5. ``verify(path, **options) -> VerifyResult``: the files on disk checked
   against their own checksums, without loading the checkpoint.

A format may also offer ``why_not(path) -> str | None``: where ``detect``
said no but ``path`` looks like one of its checkpoints that cannot be read
(a Megatron ``--save`` root whose tracker names a missing folder), the
fault, which the registry raises instead of "not a checkpoint"; None
otherwise. Like ``detect``, it reads little and raises nothing.

A format may also offer ``reshard(src, dst, to, **options) -> WriteResult |
None``: a direct reshard within the format (for files that hold model-space
tensors); None when it cannot, and the caller then goes through the planner.
A format whose checkpoints have one layout only (a Hugging Face model
directory: tp = pp = ep = 1) says so with ``fixed_config``, a
:class:`~tenplex.ptree.config.ParallelConfig`; the CLI then needs no ``--to``.

**Writing in parts** (several processes, one commit: ``tenplex reshard``
under torchrun, :mod:`tenplex.distributed_reshard`). A format that can
says so with ``parts = True`` and then also accepts:

- ``write(source, path, to, part=Part(index, count, token), **options)``:
  write only part ``index`` of ``count`` of the target's files, into a
  temporary place named by ``token`` (the same on every process), fsync
  them, and commit nothing. It returns a ``WriteResult`` whose ``part`` is
  JSON: ``{"files": {relative path: [size in bytes, xxh3-128 hex]}, ...}``
  plus whatever the commit needs (e.g. a DCP directory's item records).
  Which files a part writes is the format's choice (balanced by bytes);
  every process calls it with the same arguments but ``index``.
- ``commit(path, to, parts, part=Part(...), **options) -> WriteResult``:
  run by one process after every part has reported; ``parts`` are their
  ``WriteResult.part`` in index order. It checks every file the target
  needs is reported once and is on disk (as the committing process sees
  it) with its reported size, then makes the checkpoint visible at once
  (Megatron: rename the iteration folder into place, then the tracker
  file). A refused commit raises ``CorruptShardError`` and leaves nothing visible.
- ``abort(path, part=Part(...), everything=False)``: remove this part's
  files (``everything``: the whole temporary place, any part's files; the
  committing process calls it after a failure). Best effort, never raises.

**Sharing an opened source** (``tenplex reshard`` under torchrun). A
format may let one process open a source and hand it to the others, so
that the source's metadata (pickles, indexes) is read once per job, not
once per process:

- ``share(source) -> dict``: the source returned by ``open_source``, as
  JSON (plain data: it travels through the job's key-value store; never a
  pickle);
- ``open_shared(path, shared, **options) -> ShardSource``: the same source
  at ``path`` (the path the sharing process opened), rebuilt from
  ``shared`` without reading the metadata files, reading only the tensor
  bytes asked of it. ``shared`` is untrusted input: the format checks every
  field, that every file it names lies inside ``path`` with the size the
  sharing process saw, and that every byte range lies inside its file,
  and raises ``ManifestError`` otherwise. Values kept in the files (e.g.
  RNG states) travel as byte ranges, read by the process that needs them.
  (The tenplex store shares only its manifest's digest: each process reads
  the manifest, checked against that digest, and checks a shard file's
  header before its own first read of the file.)

``options`` are keyword arguments every call accepts and ignores where they
do not apply: ``model_config`` (a JSON file's path with the model's fields),
``threads`` (reads or files at once), ``checksums`` (``verify`` also returns
a digest per file), ``progress`` (``progress(done_bytes, total_bytes)``), and
format-specific ones a format documents itself.

Formats are found by :mod:`tenplex.formats.registry`: the tenplex store is
built in; other packages add formats through the ``tenplex.formats``
entry-point group, each entry point naming a ``Format`` object.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, runtime_checkable

from tenplex.ptree.config import ParallelConfig
from tenplex.ptree.tree import PTree
from tenplex.store.source import ShardSource

__all__ = ["Format", "Description", "WriteResult", "VerifyResult", "Progress", "Part", "padding_lines",
           "source_notes"]

Progress = Callable[[int, int], None]
"""``progress(done_bytes, total_bytes)``."""


@dataclass(frozen=True)
class Description:
    """A checkpoint in tenplex terms, without its tensor data.

    Attributes:
        format: the format's name.
        tree: the tree spec (tensor leaves with global shapes, dtypes, layouts).
        config: the parallel config the checkpoint's files are laid out for.
        values: ``{path: JSON value}`` of the value leaves read from metadata
            (possibly partial: a format may read some only on demand).
        meta: free-form JSON the format carries along (e.g. Megatron args).
        files: the number of files holding tensor data, where known cheaply.
        stored_bytes: their total size in bytes, where known cheaply.
        notes: remarks for the user, one line each.
    """

    format: str
    tree: PTree
    config: ParallelConfig
    values: Mapping[str, Any]
    meta: Mapping[str, Any]
    files: int | None = None
    stored_bytes: int | None = None
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class WriteResult:
    """What a write (or a direct reshard) did.

    Attributes:
        bytes_read: bytes fetched from the source's files.
        bytes_needed: unique source bytes the plan reads (None where the
            format copied stored items whole, without a plan).
        bytes_written: tensor bytes written to the target.
        files: files written.
        padding: one line per padded axis whose padded length changed.
        notes: remarks for the user (what was dropped, derived or kept), one line each.
        direct: True when stored items were copied as they are, without the planner.
        part: a part's report for ``commit`` (``write(..., part=...)``, see the module
            docstring): JSON, ``{"files": {relative path: [size, xxh3-128 hex]}, ...}``; else None.
    """

    bytes_read: int
    bytes_needed: int | None
    bytes_written: int
    files: int
    padding: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    direct: bool = False
    part: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class Part:
    """One process's share of a write in parts (see the module docstring).

    Attributes:
        index: this part, ``0 <= index < count`` (the process's rank).
        count: the number of parts (processes).
        token: names the run's temporary place; the same on every process
            (letters and digits only).
    """

    index: int
    count: int
    token: str

    def __post_init__(self):
        if not (0 <= self.index < self.count) or not self.token.isalnum():
            raise ValueError(f"Part({self.index}, {self.count}, {self.token!r}): expected 0 <= index < "
                             "count and an alphanumeric token")


@dataclass(frozen=True)
class VerifyResult:
    """What ``verify`` checked, when every check passed.

    Attributes:
        files: files checked.
        bytes: bytes of those files read and checked.
        tensors: stored tensors.
        checked: what was checked, in words (e.g. ``"every block's xxh3 checksum"``).
        checksums: ``{relative path: xxh3-128 hex digest}`` when asked for, else None.
    """

    files: int
    bytes: int
    tensors: int
    checked: str
    checksums: Mapping[str, str] | None = None


@runtime_checkable
class Format(Protocol):
    """A checkpoint format; see the module docstring for the call order and options.

    Errors: every call raises :class:`tenplex.errors.TenplexError` subclasses:
    ``ManifestError`` for metadata that lies or is missing,
    ``CorruptShardError`` for tensor data that fails a check,
    ``ConfigError`` for a target the checkpoint cannot be laid out for,
    ``AlreadyExistsError`` for a ``write`` to a committed checkpoint.
    """

    name: str

    def detect(self, path: str) -> bool: ...

    def describe(self, path: str, **options) -> Description: ...

    def open_source(self, path: str, **options) -> ShardSource: ...

    def write(self, source: ShardSource, path: str, to: ParallelConfig, **options) -> WriteResult: ...

    def verify(self, path: str, **options) -> VerifyResult: ...


def padding_lines(changes) -> tuple[str, ...]:
    """``str`` of each padding change (``PaddingChange`` records or lines already)."""
    return tuple(str(c) for c in changes)


def source_notes(source) -> tuple[str, ...]:
    """The notes of the :class:`Description` behind ``source`` (a format's ``open_source``: what it
    dropped or derived while reading), for the target's report; ``()`` for a source without one."""
    return tuple(getattr(getattr(source, "desc", None), "notes", None) or ())
