"""What a Megatron GPT model's state is: its config, tree and layouts, flat optimizer buffers, RNG, tied copies.

No file format lives here: the formats (``tenplex_megatron.formats``) and
live changes (``tenplex_megatron.live``) both build on these.
"""
