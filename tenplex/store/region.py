"""Deprecated name of :mod:`tenplex.store.fetch` (``read_region``).

Kept only until ``tenplex/elastic.py`` imports ``tenplex.store.fetch``;
remove this module then (there is one ``region.py``: :mod:`tenplex.ptree.region`).
"""

from tenplex.store.fetch import read_region

__all__ = ["read_region"]
