"""``tenplex demo``: elastic Megatron GPT training on real text (see :mod:`.run`)."""

from tenplex_megatron.demo.run import build_parser, main, run_demo

__all__ = ["build_parser", "main", "run_demo"]
