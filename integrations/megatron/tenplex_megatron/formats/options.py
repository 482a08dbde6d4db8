"""The format options (:mod:`tenplex.formats.protocol`) every Megatron plugin reads the same way."""

from __future__ import annotations

import json

__all__ = ["model_config"]


def model_config(options: dict) -> dict | None:
    """The ``model_config`` option's JSON file (``--model-config``): its fields, or None when not given.

    For Megatron checkpoints these are ``MegatronConfig`` fields (a whole config, or overrides of
    the args); for an HF source, Megatron args that win over those made from ``config.json``.
    """
    path = options.get("model_config")
    if not path:
        return None
    with open(path) as f:
        return json.load(f)
