"""The families to choose from: the built-in ones (``families/``) and any a plugin registered."""

from __future__ import annotations

from tenplex_megatron.formats.hf import families as _builtin  # noqa: F401  (registers the built-in families)
from tenplex_megatron.formats.hf.family import Family, choose as _choose, registered
from tenplex_megatron.formats.hf.fields import ModelFields
from tenplex_megatron.model.config import MegatronConfig

__all__ = ["families", "choose"]


def families() -> dict[str, Family]:
    """``{name: family}``, the most recently registered first."""
    return registered()


def choose(cfg: MegatronConfig, fields: ModelFields, name: str | None = None) -> Family:
    """:func:`tenplex_megatron.formats.hf.family.choose` over every family."""
    return _choose(cfg, fields, name)
