"""The one path rule: nothing is read from outside a checkpoint's root, and nothing that blocks.

Every reader of a local checkpoint (the store's manifest, ``shards/`` and its
shard files, Megatron's legacy and ``torch_dist`` files, DCP items named by
``relative_path``) resolves the path it is about to read with
:func:`resolve_inside`:

- the path is resolved through every symlink (``os.path.realpath``), and the
  result must lie under the resolved root. A link *inside* the checkpoint that
  points elsewhere inside it is followed; a link that leaves the root is
  refused with :class:`~tenplex.errors.PathError` before anything is opened,
  so no size, digest or byte of an outside file reaches an output or a message;
- the file is then opened non-blocking and checked with ``fstat`` on the open
  descriptor (:func:`open_regular`): a FIFO, a device or a directory is
  refused with :class:`~tenplex.errors.CorruptShardError` and never blocks.

The root itself may be reached through links (a user's ``/data`` may be a
link); only what lies below it is checked. ``docs/guide.md`` ("Limits") states
the rule.
"""

from __future__ import annotations

import os
import stat

from tenplex.errors import CorruptShardError, PathError

__all__ = ["resolve_inside", "open_regular", "regular_size", "check_inside"]


def _cut(text: str, limit: int = 400) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def resolve_inside(root: str, path: str, what: str | None = None) -> str:
    """``path`` resolved through symlinks, checked to lie in ``root``.

    ``path`` is the full path of the file (``root`` joined with its name), absolute or
    relative to the working directory as ``root`` may be: ``tenplex inspect ckpt/legacy``
    gives ``root="ckpt/legacy"`` and ``path="ckpt/legacy/latest_checkpointed_iteration.txt"``.
    (Joining a relative ``path`` to ``root`` once more looked for ``ckpt/legacy/ckpt/legacy/...``:
    every Megatron and Hugging Face checkpoint named by a relative path was "not a checkpoint".)

    Raises:
        PathError: the resolved path is ``root`` itself or lies outside the resolved ``root``.
    """
    what = what or path
    real, real_root = os.path.realpath(path), os.path.realpath(root)
    if real == real_root or os.path.commonpath([real, real_root]) != real_root:
        raise PathError(f"{_cut(what)}: resolves to {_cut(real)}, outside the checkpoint "
                        f"directory {_cut(real_root)}; tenplex reads no file outside it")
    return real


def open_regular(path: str, what: str | None = None, buffering: int = -1, root: str | None = None):
    """Open the regular file at ``path`` for reading: ``(binary file, size in bytes)``.

    With ``root``, ``path`` must resolve inside it (:func:`resolve_inside`). The
    file is opened non-blocking and checked with ``fstat`` on the open descriptor,
    so a FIFO swapped in after a check cannot block the read.

    Raises:
        PathError: ``path`` resolves outside ``root``.
        CorruptShardError: ``path`` is missing, unreadable or not a regular file.
    """
    what = what or path
    if root is not None:
        path = resolve_inside(root, path, what)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise CorruptShardError(f"{what}: file is missing") from None
    except OSError as exc:
        raise CorruptShardError(f"{what}: cannot open it ({exc.strerror})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise CorruptShardError(f"{what}: not a regular file (mode {stat.filemode(st.st_mode)})")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb", buffering=buffering), st.st_size


def regular_size(path: str, what: str | None = None, root: str | None = None) -> int:
    """The size of the regular file at ``path`` (inside ``root`` where given).

    Raises:
        PathError, CorruptShardError: as :func:`open_regular` (a missing file is a CorruptShardError).
    """
    what = what or path
    if root is not None:
        path = resolve_inside(root, path, what)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise CorruptShardError(f"{what}: file is missing") from None
    if not stat.S_ISREG(st.st_mode):
        raise CorruptShardError(f"{what}: not a regular file (mode {stat.filemode(st.st_mode)})")
    return st.st_size


def check_inside(root: str, paths) -> None:
    """:func:`resolve_inside` for each existing entry of ``paths`` (a reader's files, before it opens them).

    Raises:
        PathError: the first path that resolves outside ``root``.
    """
    for path in paths:
        if os.path.lexists(path):
            resolve_inside(root, path)
