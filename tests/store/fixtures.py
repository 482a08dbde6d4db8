"""The fixtures every store backend provides (as fsspec's ``tests/abstract`` does).

A backend's test class overrides :meth:`StoreFixtures.root`; the suite's
classes use nothing else of the backend.
"""

from __future__ import annotations

import pytest

from .helpers import SPEC, SRC, state_of


class StoreFixtures:
    """Fixtures of the store conformance suite."""

    @pytest.fixture
    def root(self) -> str:
        """A fresh, empty root URL on the backend (removed afterwards). Backends override it."""
        raise NotImplementedError("a backend's test class must override the 'root' fixture")

    @pytest.fixture
    def state(self):
        """``(tree, global state, {rank: shards})`` of the suite's GPT under ``SRC``."""
        return state_of(SPEC, SRC, 7)
