"""The store conformance suite on every backend: one class per backend.

A new backend joins with one class that derives from :class:`StoreSuite`
and overrides the ``root`` fixture (a fresh, empty root URL, removed
afterwards), as fsspec's ``fsspec/tests/abstract`` suite is used.
"""

from __future__ import annotations

import uuid

import fsspec
import pytest

from .suite_commit import CommitSuite
from .suite_integrity import IntegritySuite
from .suite_roundtrip import RoundTripSuite


class StoreSuite(RoundTripSuite, IntegritySuite, CommitSuite):
    """Every conformance test."""


class TestFileStore(StoreSuite):
    @pytest.fixture
    def root(self, tmp_path):
        return f"file://{tmp_path}"


class TestMemoryStore(StoreSuite):
    atomic_create = False  # fsspec's memory:// create is check-then-put (in one process)

    @pytest.fixture
    def root(self):
        url = f"memory://tenplex-{uuid.uuid4().hex}"
        yield url
        fs = fsspec.filesystem("memory")
        if fs.exists(url.removeprefix("memory://")):
            fs.rm(url.removeprefix("memory://"), recursive=True)


class TestS3Store(StoreSuite):
    """s3:// on a moto server on 127.0.0.1 (see tests/conftest.py)."""

    @pytest.fixture
    def root(self, s3_bucket):
        return f"{s3_bucket}/{uuid.uuid4().hex}"
