"""megatron-core ``dist_checkpointing`` (``torch_dist``) directories: keys, read, write, direct reshard, verify."""
