"""Megatron checkpoints written in parts by several processes, committed once (``tenplex reshard`` under torchrun).

The protocol's write in parts (:mod:`tenplex.formats.protocol`, :class:`~tenplex.formats.protocol.Part`)
for both Megatron formats. Every process plans the same target; the
target ranks that write a file are split across the processes by bytes
(:func:`tenplex.store.split.split_weights`, a pipeline stage kept on one
process where that balances). Each process writes its ranks' files into
the run's temporary folder ``ROOT/.iter_NNNNNNN.tmp-TOKEN`` (the token is
the same on every process), fsyncs them and reports ``{relative path:
[size, xxh3-128]}`` (the digest ``tenplex verify --checksums`` prints).
The committing process checks that every file the target needs was
reported by exactly one part and is on disk with its size, then renames
the folder into place and writes the tracker file last
(Megatron-LM's ``--load`` reads the tracker first), so a failure at any
point before leaves no checkpoint visible.
"""

from __future__ import annotations

import glob
import os
import shutil
from typing import Iterable, Mapping, Sequence

from tenplex.errors import AlreadyExistsError, CorruptShardError
from tenplex.formats.protocol import Part
from tenplex.store.split import split_weights

from tenplex_megatron.formats.checks import file_digest
from tenplex_megatron.formats.folders import iteration_dir_name, write_tracker

__all__ = ["part_folder", "part_ranks", "seal", "remove_files", "checked_parts", "commit_parts", "abort_parts"]


def part_folder(root: str, iteration, token: str) -> str:
    """The run's temporary folder for iteration ``iteration`` under the ``--save`` root ``root`` (created).

    Raises:
        AlreadyExistsError: the iteration folder exists (tenplex never overwrites a checkpoint).
    """
    name = iteration_dir_name(iteration)
    final = os.path.join(root, name)
    if os.path.lexists(final):
        raise AlreadyExistsError(f"{final} exists; tenplex never overwrites a checkpoint in place")
    folder = os.path.join(root, f".{name}.tmp-{token}")
    os.makedirs(folder, exist_ok=True)
    return folder


def part_ranks(build, writers: Sequence[int], part: Part) -> set[int]:
    """The ranks of ``writers`` (target ranks that write a file) whose files ``part`` writes.

    Weighted by the bytes of the tensors each rank holds (``build``: a
    :class:`~tenplex_megatron.formats.target.TargetBuilder`); the same split on every process.
    """
    D, to = build.runner.D, build.to
    weights = {r: sum(h.numel * leaf.itemsize for p, leaf in build.tree.tensors()
                      if (h := D.holding(p, to.coord(r))) is not None) for r in writers}
    return set(split_weights(weights, part.count, to)[part.index])


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def seal(folder: str, files: Iterable[str]) -> dict[str, list]:
    """fsync ``files`` (relative to ``folder``) and their folders; ``{file: [size in bytes, xxh3-128 hex]}``."""
    out, dirs = {}, {folder}
    for rel in sorted(files):
        path = os.path.join(folder, rel)
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        out[rel] = [os.path.getsize(path), file_digest(path)]
        dirs.add(os.path.dirname(path))
    for d in sorted(dirs):
        _fsync_dir(d)
    return out


def remove_files(folder: str, files: Iterable[str]) -> None:
    """Remove ``files`` (relative to ``folder``) and the folders they leave empty, ``folder`` too
    (the run's: a part that fails after the committing process removed the run's folder may have
    made it again); best effort."""
    for rel in files:
        path = os.path.join(folder, rel)
        try:
            os.remove(path)
        except OSError:
            pass
        try:
            parent = os.path.dirname(path)
            if parent != folder:
                os.rmdir(parent)  # only when empty
        except OSError:
            pass
    try:
        os.rmdir(folder)  # only when empty: the other parts' files keep it
    except OSError:
        pass


def checked_parts(folder: str, parts: Sequence[Mapping]) -> dict[str, list]:
    """Every part's files, checked against the files the target needs and the disk.

    Raises:
        CorruptShardError: parts that disagree on the files needed, a file reported twice
            or not at all, or a file missing or of another size on disk.
    """
    expected = sorted(parts[0]["expected"])
    found: dict[str, list] = {}
    for i, p in enumerate(parts):
        if sorted(p["expected"]) != expected:
            raise CorruptShardError(f"{folder}: part {i} planned other files than part 0 "
                                    f"({len(p['expected'])} against {len(expected)})")
        for rel, entry in p["files"].items():
            if rel in found:
                raise CorruptShardError(f"{folder}/{rel}: reported by two parts; expected one")
            found[rel] = entry
    missing = sorted(set(expected) - set(found))
    extra = sorted(set(found) - set(expected))
    if missing or extra:
        raise CorruptShardError(f"{folder}: the parts reported {len(found)} files; missing "
                                f"{missing[:4]}, not expected {extra[:4]}")
    for rel, (size, _) in sorted(found.items()):
        path = os.path.join(folder, rel)
        on_disk = os.path.getsize(path) if os.path.isfile(path) else None
        if on_disk != size:
            seen = "no such file" if on_disk is None else f"{on_disk} bytes"
            raise CorruptShardError(f"{path}: expected {size} bytes as its part reported, found {seen} "
                                    "(the processes need a folder every process can read: a shared "
                                    "filesystem, not a per-host directory)")
    return found


def commit_parts(root: str, parts: Sequence[Mapping], token: str, finish=None) -> dict:
    """Check the parts' files, run ``finish(folder)`` (e.g. a DCP ``.metadata``), rename the folder
    into place, then write the tracker; ``{"bytes_written", "files", "checksums"}``.

    Raises:
        CorruptShardError: as :func:`checked_parts`; nothing is visible.
        AlreadyExistsError: the iteration folder appeared meanwhile.
    """
    iteration = parts[0]["iteration"]
    name = iteration_dir_name(iteration)
    folder = os.path.join(root, f".{name}.tmp-{token}")
    files = checked_parts(folder, parts)
    if finish is not None:
        finish(folder)
    final = os.path.join(root, name)
    if os.path.lexists(final):
        raise AlreadyExistsError(f"{final} exists; tenplex never overwrites a checkpoint in place")
    os.rename(folder, final)
    _fsync_dir(root)
    write_tracker(root, iteration)
    return {"bytes_written": sum(p.get("bytes_written", 0) for p in parts), "files": len(files),
            "checksums": {rel: digest for rel, (_, digest) in files.items()}}


def abort_parts(root: str, token: str) -> None:
    """Remove the run's temporary folder (every part's files); best effort, for the committing process."""
    if not token.isalnum():
        return
    for folder in glob.glob(os.path.join(glob.escape(root), f".*.tmp-{token}")):
        shutil.rmtree(folder, ignore_errors=True)
