"""The store's test package: an fsspec-style conformance suite and its helpers.

The suite's test classes (``suite_*.py``) are abstract: each backend joins
with one class in ``test_backends.py`` that overrides the ``root`` fixture.
Modules here import one another relatively (``from .helpers import ...``).
"""
