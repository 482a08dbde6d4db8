"""Hugging Face model directories written in parts by several processes, committed once.

The protocol's write in parts (:mod:`tenplex.formats.protocol`,
:class:`~tenplex.formats.protocol.Part`) for the ``hf`` format, used by
``torchrun ... -m tenplex reshard SRC DST --format hf``. Every process plans
the same export (the same shard files, ``model-0000i-of-0000N.safetensors``,
from the shapes alone); the files are split across the processes by bytes
(:func:`tenplex.store.split.split_weights`, each file its own unit: heaviest
first, onto the least loaded process). Each process writes its files into the
run's temporary sibling folder ``DST.tenplex-partial-TOKEN`` (the token is the
same on every process), reading only the source bytes its files' tensors need,
fsyncs them and reports ``{file: [size, xxh3-128]}``. The committing process
checks that every file was reported by exactly one part and is on disk with its
size, writes ``model.safetensors.index.json`` and ``config.json`` last, and
renames the folder to ``DST``: until then nothing is at ``DST``, and
:func:`tenplex_megatron.formats.hf.hfdir.is_hf_dir` sees no model there.

A model with fewer files than processes leaves processes idle (a file is
written by one process); ``--max-shard-size`` makes more, smaller files.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Mapping, Sequence

from tenplex.errors import AlreadyExistsError
from tenplex.formats.protocol import Part
from tenplex.store.split import split_weights

from tenplex_megatron.formats.parts import checked_parts, seal

__all__ = ["partial_folder", "part_folder", "my_files", "write_meta", "seal", "commit_hf", "abort_hf",
           "INDEX", "CONFIG"]

INDEX = "model.safetensors.index.json"
CONFIG = "config.json"


def partial_folder(dst: str, tag: str) -> str:
    """The temporary sibling folder of ``dst`` an export writes into (``tag``: a pid or a run's token)."""
    return f"{dst.rstrip('/')}.tenplex-partial-{tag}"


def part_folder(dst: str, token: str) -> str:
    """The run's temporary folder for ``dst`` (created; every process of the run names the same one)."""
    folder = partial_folder(dst, token)
    os.makedirs(folder, exist_ok=True)
    return folder


def my_files(sizes: Sequence[int], part: Part) -> list[int]:
    """The indices of the files (``sizes``: bytes of each file's tensors) that ``part`` writes;
    the same split on every process."""
    return split_weights(dict(enumerate(sizes)), part.count)[part.index]


def write_meta(folder: str, index: Mapping, config: Mapping) -> None:
    """``model.safetensors.index.json`` and ``config.json`` in ``folder`` (the export's own layout)."""
    with open(os.path.join(folder, INDEX), "w") as f:
        json.dump(index, f, indent=2)
    with open(os.path.join(folder, CONFIG), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def commit_hf(dst: str, parts: Sequence[Mapping], token: str) -> dict:
    """Check the parts' files, write the index and config, fsync, rename the folder to ``dst``;
    ``{"bytes_written", "files", "checksums"}``.

    ``parts[0]`` carries ``"index"`` and ``"config"`` (every part plans the same ones).

    Raises:
        CorruptShardError: a file reported twice or not at all, or missing or of another size on
            disk (:func:`tenplex_megatron.formats.parts.checked_parts`); nothing is visible.
        AlreadyExistsError: ``dst`` appeared meanwhile and is not an empty directory.
    """
    folder = partial_folder(dst, token)
    files = checked_parts(folder, parts)
    write_meta(folder, parts[0]["index"], parts[0]["config"])
    seal(folder, [INDEX, CONFIG])
    if os.path.isdir(dst) and not os.listdir(dst):
        os.rmdir(dst)
    if os.path.lexists(dst):
        raise AlreadyExistsError(f"{dst}: exists and is not an empty directory; the export writes a new one")
    os.rename(folder, dst)
    parent = os.open(os.path.dirname(os.path.abspath(dst)), os.O_RDONLY)
    try:
        os.fsync(parent)
    finally:
        os.close(parent)
    return {"bytes_written": sum(p.get("bytes_written", 0) for p in parts), "files": len(files),
            "checksums": {rel: digest for rel, (_, digest) in files.items()}}


def abort_hf(dst: str, token: str) -> None:
    """Remove the run's temporary folder (every part's files); best effort."""
    if token.isalnum():
        shutil.rmtree(partial_folder(dst, token), ignore_errors=True)
