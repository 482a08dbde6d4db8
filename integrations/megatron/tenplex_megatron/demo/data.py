"""Real text that nobody on this project wrote: the Python standard library's own source.

The corpus is the ``*.py`` files directly in the running interpreter's
stdlib directory (``sysconfig.get_paths()["stdlib"]``), read in sorted name
order and concatenated; it is on every machine that has Python. Tokens are
bytes (a 256-symbol vocabulary). Samples are consecutive, non-overlapping
windows of ``seq + 1`` bytes. The global sample order is one seeded
permutation; step ``k`` of a run with global batch ``B`` consumes samples
``order[consumed : consumed + B]`` (wrapping around), and dp rank ``d`` of
``dp`` takes the ``d``-th contiguous slice of them, so the global batch and
the sample sequence do not depend on dp.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["Corpus", "load_corpus"]

VOCAB = 256


def _source_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.glob("*.py") if p.is_file())


@dataclass(frozen=True)
class Corpus:
    """Samples ``[n, seq + 1]`` (int64 byte values) and the global order of their indices."""

    samples: torch.Tensor
    order: torch.Tensor
    source: str
    nbytes: int

    def global_batch(self, consumed: int, batch: int) -> torch.Tensor:
        """Sample indices of the global batch that starts after ``consumed`` samples."""
        n = len(self.order)
        return self.order[torch.arange(consumed, consumed + batch) % n]

    def local_batch(self, consumed: int, batch: int, dp: int, dp_rank: int):
        """This dp rank's ``(inputs, labels)``, each ``[batch / dp, seq]``, and the global indices."""
        idx = self.global_batch(consumed, batch)
        per = batch // dp
        tokens = self.samples[idx[dp_rank * per:(dp_rank + 1) * per]]
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), idx


def load_corpus(seq: int, max_bytes: int = 4 << 20, seed: int = 1234) -> Corpus:
    """The stdlib corpus cut into samples of ``seq + 1`` bytes, with a seeded global order."""
    parts, total = [], 0
    for path in _source_files():
        data = path.read_bytes()
        parts.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    text = b"".join(parts)[:max_bytes]
    n = len(text) // (seq + 1)
    flat = torch.frombuffer(bytearray(text[: n * (seq + 1)]), dtype=torch.uint8).long()
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return Corpus(flat.view(n, seq + 1), order,
                  f"{len(parts)} .py files of {sysconfig.get_paths()['stdlib']}", len(text))
