"""Megatron-LM's vocabulary padding: the rows a checkpoint stores at a tp, and the checks on them.

The checks take a :class:`~tenplex_megatron.model.config.MegatronConfig` (which uses
:func:`padded_vocab_size`; not imported here, so the two modules form no cycle).
"""

from __future__ import annotations

import argparse
from math import ceil
from typing import Any

from tenplex.errors import ConfigError

__all__ = ["padded_vocab_size", "check_target_vocab", "check_vocab"]


def padded_vocab_size(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron-LM pads the vocabulary to a multiple of ``make_vocab_size_divisible_by * tp``
    (``megatron/training/tokenizer/tokenizer.py::_vocab_size_with_padding``)."""
    multiple = divisible_by * tp
    return ceil(vocab / multiple) * multiple


def check_target_vocab(cfg: MegatronConfig, tp: int) -> None:
    """A target ``tp``'s padded vocabulary must not depend on the tokenizer's size the args did not give.

    With :attr:`MegatronConfig.vocab_padded_from` ``M``, the tokenizer's size ``v`` is one of
    ``vocab_size - M + 1 .. vocab_size``; Megatron-LM at ``tp`` pads ``v`` to a multiple of
    ``make_vocab_size_divisible_by * tp`` (:func:`padded_vocab_size`). Where every such ``v`` pads alike
    (any tp that is a multiple of the saver's; any change of pp, dp, ep) that padding is the target's;
    otherwise the target's rows would be a guess.

    Raises:
        ConfigError: naming both paddings and asking for the tokenizer's size.
    """
    if not cfg.vocab_padded_from:
        return
    low, high = (padded_vocab_size(v, cfg.make_vocab_size_divisible_by, tp)
                 for v in (cfg.vocab_size - cfg.vocab_padded_from + 1, cfg.vocab_size))
    if low != high:
        raise ConfigError(f"the args hold padded_vocab_size={cfg.vocab_size} and no vocab_size: the tokenizer's "
                          f"{cfg.vocab_size - cfg.vocab_padded_from + 1}..{cfg.vocab_size} tokens pad to {low} to "
                          f"{high} rows at tp={tp} (make_vocab_size_divisible_by="
                          f"{cfg.make_vocab_size_divisible_by}), depending on which; pass the tokenizer's "
                          "vocabulary size with --model-config (a JSON file such as {\"vocab_size\": 50257})")


def check_vocab(cfg: MegatronConfig, args: Any, tp: int, rows: int | None, where: str) -> None:
    """The stored (padded) vocabulary rows must be the model config's padding at the saver's ``tp``.

    Raises:
        ConfigError: if the args' ``vocab_size`` differs from the model config's,
            or ``rows`` is not ``cfg.padded_vocab(tp)``: tenplex neither truncates
            nor invents vocabulary rows.
    """
    a = vars(args) if isinstance(args, argparse.Namespace) else dict(args or {})
    stored = a.get("vocab_size")
    if stored and stored != cfg.vocab_size:
        raise ConfigError(f"{where}: the args say vocab_size={stored}, the model config says "
                          f"{cfg.vocab_size}; tenplex neither truncates nor invents vocabulary rows")
    padded = cfg.padded_vocab(tp)
    if rows is not None and rows != padded:
        raise ConfigError(f"{where}: the checkpoint stores {rows} vocabulary rows, but vocab_size="
                          f"{cfg.vocab_size} pads to {padded} at tp={tp} (make_vocab_size_divisible_by="
                          f"{cfg.make_vocab_size_divisible_by}); give the tokenizer's vocabulary size "
                          "with --model-config")
