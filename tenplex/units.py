"""Bytes: the one byte formatter of tenplex (library reports and the CLI), and the one
progress-callback type."""

from __future__ import annotations

from typing import Callable

__all__ = ["Progress", "format_bytes"]

Progress = Callable[[int, int], None]
"""``progress(done_bytes, total_bytes)``, the only kind of progress callback in tenplex."""


def format_bytes(n: float) -> str:
    """Bytes as a short decimal (SI) string: ``512 B``, ``1.50 GB``, up to ``PB``."""
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{int(n)} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return str(n)
