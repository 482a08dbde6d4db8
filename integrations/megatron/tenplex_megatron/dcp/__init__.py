"""PyTorch Distributed Checkpoint (DCP) directories: metadata records, checks, safe reads and writes.

Nothing here knows Megatron: ``tenplex_megatron.formats.dist`` puts
megatron-core's keys and layouts on top.
"""
