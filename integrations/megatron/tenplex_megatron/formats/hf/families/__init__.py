"""The built-in families, one declarative file each; importing this package registers them.

Order matters: :func:`~tenplex_megatron.formats.hf.family.choose` tries the
family registered last first, so the most specific come last.
"""

from tenplex_megatron.formats.hf.families import llama, mixtral, qwen2, qwen3, qwen3_moe  # noqa: F401
