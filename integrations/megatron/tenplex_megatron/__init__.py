"""tenplex for Megatron-LM and megatron-core: layouts, checkpoint formats and the demo."""
