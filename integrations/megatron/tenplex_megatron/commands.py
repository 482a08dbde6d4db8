"""Commands the Megatron integration adds to the ``tenplex`` CLI (entry-point group ``tenplex.commands``).

Each object has ``name``, ``help``, ``add_arguments(parser)`` and
``run(args) -> int``; the CLI adds a subcommand for it (see
``tenplex/cli/formats.py``).
"""

from __future__ import annotations

__all__ = ["DEMO"]


class _Demo:
    """``tenplex demo``: elastic Megatron GPT training through changing (dp, tp, pp)."""

    name = "demo"
    help = "elastic Megatron GPT training through changing (dp, tp, pp)"

    @staticmethod
    def add_arguments(parser) -> None:
        from tenplex_megatron.demo import build_parser

        build_parser(parser)

    @staticmethod
    def run(args) -> int:
        from tenplex_megatron.demo import main

        return main(parsed=args)


DEMO = _Demo()
