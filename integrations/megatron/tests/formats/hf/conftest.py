"""Fixtures of the Hugging Face tests: megatron-core sources saved once per session."""

import pytest

from hf_cases import source_cache


@pytest.fixture(scope="session")
def hf_sources(tmp_path_factory):
    """``get(model, n, parallel)`` of :func:`hf_cases.source_cache`, shared by the export tests."""
    return source_cache(tmp_path_factory.mktemp("hf_src"))
