"""The ``tenplex`` command: reshard, inspect, plan, verify, example.

Failures exit 1 with a one-line message (``--debug`` shows the traceback);
usage errors exit 2.
"""

from __future__ import annotations

import argparse
import sys
import traceback

from tenplex.errors import ConfigError, TenplexError
from tenplex.ptree.config import ParallelConfig

__all__ = ["main", "build_parser"]


def _config(text: str) -> ParallelConfig:
    try:
        return ParallelConfig.parse(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tenplex", description="Plan and move training state between (dp, tp, pp) configs.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    parser.add_argument("--model-config", default=None, metavar="JSON",
                        help="model config for checkpoints that do not carry one (format plugins)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("reshard", help="convert a checkpoint to another parallel config")
    p.add_argument("src", help="source checkpoint (path or fsspec URL)")
    p.add_argument("dst", help="where to write the result (must not exist as a checkpoint)")
    p.add_argument("--to", type=_config, required=True, metavar="dp=D,tp=T,pp=P")
    p.add_argument("--format", default=None,
                   help="output format (default: the source's); 'tenplex' or a plugin's name")
    p.add_argument("--threads", type=int, default=8, help="parallel reads (default 8)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")

    p = sub.add_parser("inspect", help="show a checkpoint's config, tree and sizes")
    p.add_argument("path")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("plan", help="show what a reshard would move, without moving it")
    p.add_argument("path")
    p.add_argument("--to", type=_config, required=True, metavar="dp=D,tp=T,pp=P")
    p.add_argument("--per-host", type=int, default=8, help="devices per host (default 8)")
    p.add_argument("--best-placement", action="store_true",
                   help="place the new ranks on devices to keep the most bytes in place")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("verify", help="check every checksum and the manifest's consistency")
    p.add_argument("path")

    p = sub.add_parser("demo", help="elastic Megatron GPT training through changing (dp, tp, pp)")
    try:
        from tenplex_megatron.demo import build_parser as demo_parser
        demo_parser(p)
    except ImportError:  # the Megatron integration is not installed
        p.add_argument("rest", nargs=argparse.REMAINDER)

    p = sub.add_parser("example", help="write a random GPT-style checkpoint to try the tools on")
    p.add_argument("dst")
    p.add_argument("--config", type=_config, default=ParallelConfig(dp=2, tp=2, pp=1),
                   metavar="dp=D,tp=T,pp=P")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from tenplex.cli import commands

    try:
        return getattr(commands, args.command)(args) or 0
    except KeyboardInterrupt:
        print("tenplex: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # the CLI boundary: every failure is one line
        if args.debug:
            traceback.print_exc()
            remote = getattr(exc, "worker_traceback", None)   # a worker process's own traceback
            if remote:
                print(f"worker {getattr(exc, 'worker', '?')}'s traceback:\n{remote.rstrip()}", file=sys.stderr)
        name = "" if isinstance(exc, TenplexError) else f"{type(exc).__name__}: "
        message = str(exc).splitlines()[0] if str(exc) else repr(exc)
        print(f"tenplex {args.command}: {name}{message}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
