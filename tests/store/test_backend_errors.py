"""A storage backend's own errors reach the user as a StoreError naming the path.

s3fs lets botocore's ``NoCredentialsError`` through (it is no OSError): ``tenplex inspect
s3://bucket/ckpt`` printed ``NoCredentialsError: Unable to locate credentials``, naming no path,
and a location that cannot be looked at (a protocol whose package is missing, a backend that
fails) was reported as "not a checkpoint of any known format". The filesystem here fails as such
a backend does, under a protocol of its own.
"""

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from tenplex.formats import detect
from tenplex.errors import ManifestError, StoreError
from tenplex.store.url import translate_errors


class NoCredentials(Exception):
    """What botocore raises where no credentials are configured (defined outside Python and tenplex)."""


class FailingFS(MemoryFileSystem):
    protocol = "tenplexfailing"

    def exists(self, path, **kwargs):
        raise NoCredentials("Unable to locate credentials")


@pytest.fixture(autouse=True)
def failing_backend():
    fsspec.register_implementation(FailingFS.protocol, FailingFS, clobber=True)
    yield


def test_a_backend_error_names_the_path_and_its_cause():
    with pytest.raises(StoreError, match=r"^tenplexfailing://bucket/ckpt: NoCredentials: Unable to locate"):
        detect("tenplexfailing://bucket/ckpt")


def test_a_location_that_is_only_empty_is_still_not_a_checkpoint(tmp_path):
    with pytest.raises(ManifestError, match="not a checkpoint of any known format"):
        detect(str(tmp_path))


def test_python_and_tenplex_errors_pass_unchanged():
    for exc in (ValueError("a bug"), MemoryError(), KeyError("k")):
        with pytest.raises(type(exc)):
            with translate_errors("somewhere"):
                raise exc
    with pytest.raises(StoreError, match="^somewhere: NoCredentials: no"):
        with translate_errors("somewhere"):
            raise NoCredentials("no")
