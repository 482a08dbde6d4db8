"""Shared test helpers: hypothesis strategies, multi-process workers, rendezvous.

Imported as ``tests.helpers.<module>``; spawned workers find them because
``multiprocessing`` (spawn) hands its children the parent's ``sys.path``.
"""
