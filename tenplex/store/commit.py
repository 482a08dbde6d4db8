"""The commit: put ``manifest.json`` in place durably, never replacing another writer's.

A checkpoint is committed exactly when its manifest exists. Two writers may
race to commit at one URL (two jobs, or a rerun beside a slow first run);
the first commit wins and the other gets
:class:`~tenplex.errors.AlreadyExistsError`, whatever the backend:

- **Local filesystems**: the shard files were fsynced when closed; the
  ``shards/`` directory, the root and the root's parent are fsynced, the manifest is written to
  ``manifest.json.tmp-<uuid>`` and fsynced, then hard-linked to
  ``manifest.json`` (``link`` fails if the name exists: a no-replace
  rename), the temporary is removed and the root fsynced again. Where the
  filesystem has no hard links, a check, then ``rename``, then a re-read is
  used (a writer that commits between the check and the rename is replaced).
- **Object stores with conditional writes** (``s3://``: a PUT with
  ``If-None-Match: *``, which AWS S3 and moto honour; ``memory://``:
  a create-only put): the manifest is created in one request that fails if
  it exists, then re-read to confirm (a store that ignored the condition is
  caught when the other writer's manifest is read back).
- **Other fsspec backends**: check that no manifest exists, put it, re-read
  it and compare. Two writers whose checks both pass before either puts
  race: the later put wins, and the earlier writer learns it only if its
  re-read comes after that put. Use such backends with one writer per URL.
"""

from __future__ import annotations

import errno
import os
import uuid

from tenplex.errors import AlreadyExistsError, StoreError
from tenplex.store.manifest import MANIFEST
from tenplex.store.url import StoreRoot, translate_errors

__all__ = ["CONDITIONAL", "commit_manifest", "fsync_dir", "temp_name"]

CONDITIONAL = ("s3", "s3a", "memory")
"""fsspec protocols whose ``pipe_file(..., mode="create")`` is an atomic create-if-absent."""

_NO_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK}


def temp_name() -> str:
    """A fresh temporary manifest name, ``manifest.json.tmp-<uuid>``."""
    return f"{MANIFEST}.tmp-{uuid.uuid4().hex}"


def fsync_dir(path: str) -> None:
    """fsync a local directory, so that the names created in it survive a crash."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit_manifest(root: StoreRoot, data: bytes) -> None:
    """Create ``root``'s manifest with ``data``, unless one exists (see the module docstring).

    Raises:
        AlreadyExistsError: another writer committed first; its manifest is untouched.
        StoreError: the backend failed; nothing is committed.
    """
    where = f"{root}/{MANIFEST}"
    with translate_errors(where):
        if root.local:
            _commit_local(root, data, where)
            return
        protocols = root.fs.protocol if isinstance(root.fs.protocol, tuple) else (root.fs.protocol,)
        full = root.key(MANIFEST)
        if any(p in CONDITIONAL for p in protocols):
            try:
                root.fs.pipe_file(full, data, mode="create")
            except FileExistsError:
                raise _exists(where) from None
        else:
            if root.fs.exists(full):
                raise _exists(where)
            root.fs.pipe_file(full, data)
        if root.fs.cat_file(full) != data:
            raise _exists(where)


def _exists(where: str) -> AlreadyExistsError:
    return AlreadyExistsError(f"{where}: another writer committed a checkpoint here first; "
                              "this save is not committed and its files are removed")


def _commit_local(root: StoreRoot, data: bytes, where: str) -> None:
    final = root.key(MANIFEST)
    tmp = root.key(temp_name())
    for path in (root.key("shards"), root.path, os.path.dirname(root.path)):
        if path and os.path.isdir(path):  # the names of the files, of shards/ and of the root
            fsync_dir(path)
    with open(tmp, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    try:
        try:
            os.link(tmp, final)
        except FileExistsError:
            raise _exists(where) from None
        except OSError as exc:
            if exc.errno not in _NO_LINKS:
                raise
            if os.path.exists(final):  # no hard links here: check, rename, re-read
                raise _exists(where) from None
            os.rename(tmp, final)
            with open(final, "rb") as f:
                if f.read() != data:
                    raise _exists(where) from None
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise StoreError(f"{where}: cannot remove temporary {tmp}: {exc}") from exc
    fsync_dir(root.path)
