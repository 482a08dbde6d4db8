"""argparse types for the ``tenplex`` command and plugins' commands (a leaf: imports nothing of tenplex).

A count below 1 or a timeout that is not a finite positive number is a usage
error (exit 2) at parse time: before these, ``tenplex plan --per-host 0``
ended in a ``ZeroDivisionError``, ``--threads 0`` was silently taken as 1, and
``tenplex demo --micro-batch 0`` started its workers before failing.
"""

from __future__ import annotations

import argparse
import math

__all__ = ["positive_int", "positive_seconds"]


def positive_int(text: str) -> int:
    """A decimal integer >= 1 (threads, devices per host, layers, steps, batch sizes).

    Raises:
        argparse.ArgumentTypeError: anything else, quoting ``text``.
    """
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, found {text!r}")
    return value


def positive_seconds(text: str) -> float:
    """A finite number of seconds > 0.

    Raises:
        argparse.ArgumentTypeError: anything else (``0``, ``-1``, ``nan``, ``inf``), quoting ``text``.
    """
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds > 0, found {text!r}")
    return value
