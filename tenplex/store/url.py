"""Store roots: an fsspec URL, keys under it, and backend errors translated at the boundary."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import fsspec
from fsspec.implementations.local import LocalFileSystem

from tenplex.errors import PathError, StoreError
from tenplex.ptree.tree import check_path
from tenplex.store.paths import open_regular, regular_size, resolve_inside

__all__ = ["StoreRoot", "translate_errors"]


class StoreRoot:
    """A directory-like root on any fsspec filesystem (``file://``, ``memory://``, ``s3://``, ...).

    Args:
        url: the root URL; a bare path means ``file://``.
        storage_options: passed to fsspec (e.g. ``{"endpoint_url": ...}`` for S3).

    Attributes:
        fs: the fsspec filesystem.
        path: the root path within ``fs``.
        url: the URL as given.
    """

    def __init__(self, url: str, storage_options: dict | None = None):
        self.url = str(url)
        try:
            self.fs, self.path = fsspec.core.url_to_fs(self.url, **(storage_options or {}))
        except (ValueError, ImportError) as exc:
            raise StoreError(f"store {self.url}: cannot open: {exc}") from exc
        self.path = self.path.rstrip("/")

    @property
    def local(self) -> bool:
        """Whether the root is on a local filesystem (``open``, ``fsync``, ``link`` apply)."""
        return isinstance(self.fs, LocalFileSystem)

    @property
    def atomic_rename(self) -> bool:
        """Whether renaming a file is atomic (local POSIX filesystems)."""
        return self.local

    def key(self, key: str) -> str:
        """The full path of ``key`` under the root.

        Raises:
            PathError: if ``key`` is absolute or has ``..`` (see :func:`check_path`).
        """
        return f"{self.path}/{check_path(key)}"

    def open_read(self, key: str, what: str | None = None):
        """Open ``key`` for reading as a binary file.

        On a local root the path rule applies (:mod:`tenplex.store.paths`):
        the file must resolve inside the root and be a regular file (a FIFO
        never blocks). Elsewhere fsspec opens it.

        Raises:
            PathError: ``key`` resolves outside the root.
            CorruptShardError: a local ``key`` that is not a regular file.
            FileNotFoundError: ``key`` does not exist.
        """
        if not self.local:
            return self.fs.open(self.key(key), "rb")
        full = resolve_inside(self.path, self.key(key), what or f"{self.url}/{key}")
        if not os.path.lexists(full):
            raise FileNotFoundError(full)
        return open_regular(full, what or f"{self.url}/{key}")[0]

    def exists(self, key: str) -> bool:
        with translate_errors(self.url):
            return self.fs.exists(self.key(key))

    def size(self, key: str) -> int:
        """The size of ``key`` in bytes (on a local root: a regular file inside the root).

        Raises:
            FileNotFoundError: ``key`` does not exist.
        """
        if self.local:
            full = resolve_inside(self.path, self.key(key), f"{self.url}/{key}")
            if not os.path.lexists(full):
                raise FileNotFoundError(full)
            return regular_size(full, f"{self.url}/{key}")
        with translate_errors(self.url):
            return self.fs.size(self.key(key))

    def __str__(self) -> str:
        return self.url


@contextlib.contextmanager
def translate_errors(what: str) -> Iterator[None]:
    """Re-raise backend errors as StoreError naming ``what``.

    Translated: OS errors (other than tenplex's own and ``FileNotFoundError``), and the
    exceptions of storage libraries that are not OS errors (botocore's
    ``NoCredentialsError`` under s3fs, for one: it reached the user bare, naming no path).
    An exception class defined by Python, tenplex, numpy or torch passes unchanged (a
    bug stays a bug; a ``MemoryError`` stays one).
    """
    try:
        yield
    except (StoreError, PathError):
        raise
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise StoreError(f"{what}: {exc}") from exc
    except Exception as exc:
        if type(exc).__module__.partition(".")[0] in _NOT_BACKENDS:
            raise
        raise StoreError(f"{what}: {type(exc).__name__}: {exc}") from exc


_NOT_BACKENDS = frozenset({"builtins", "tenplex", "numpy", "torch"})
"""Top-level modules whose exceptions :func:`translate_errors` lets through."""
