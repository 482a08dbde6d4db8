"""Megatron checkpoint formats: ``megatron-legacy`` (``formats.legacy``) and ``megatron-dist`` (``formats.dist``).

The two are siblings and never import each other; what both need (the
description record, the shard source, the target builder, the args a writer
derives, file checks) lives in this package's own modules.
``formats.plugin`` registers both with tenplex.
"""
