"""The built-in families, one declarative file each; importing this package registers them.

Order matters: :func:`~tenplex_megatron.formats.hf.family.choose` tries the
family registered last first, so the most specific come last (Mistral, which
expresses no more than Llama, comes before it: a plain model exports as Llama).
"""

from tenplex_megatron.formats.hf.families import mistral, llama, mixtral, qwen2, qwen3, qwen3_moe  # noqa: F401
