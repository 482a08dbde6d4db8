"""Live state of a running megatron-core job: export, import, change, recover."""
