"""The ``tenplex`` command: reshard, inspect, plan, verify, example, and plugins' commands.

Failures exit 1 with a one-line message (``--debug`` shows the traceback);
usage errors exit 2.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import sys
import traceback

from tenplex.argtypes import positive_int, positive_seconds
from tenplex.cli.plugins import commands as plugin_commands
from tenplex.errors import ConfigError, TenplexError, exhausted
from tenplex.ptree.config import ParallelConfig

__all__ = ["main", "run", "build_parser", "command_names", "COMMANDS"]


def _config(text: str) -> ParallelConfig:
    try:
        return ParallelConfig.parse(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


TO_METAVAR = "dp=D,tp=T,pp=P[,cp=C,ep=E,etp=ET,vpp=V,stages=a:b:...]"
TO_HELP = "the target config: axes dp, tp, pp, cp, ep, etp, vpp (missing ones are 1; etp defaults to tp)"


def _reshard_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="source checkpoint (path or fsspec URL)")
    p.add_argument("dst", help="where to write the result (must not exist as a checkpoint)")
    p.add_argument("--to", type=_config, default=None, metavar=TO_METAVAR,
                   help=TO_HELP + "; required except for a format with one layout (hf: tp = pp = ep = 1)")
    p.add_argument("--format", default=None,
                   help="output format (default: the source's); 'tenplex' or a plugin's name")
    p.add_argument("--threads", type=positive_int, default=8, help="parallel reads, leaf builds and uploads (default 8)")
    p.add_argument("--hf-arch", default=None, metavar="FAMILY",
                   help="hf export: the model family (llama, qwen2, qwen3, mixtral, qwen3_moe; default: "
                        "inferred from the checkpoint's args)")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="hf export: the output dtype (default: the parameters' dtype)")
    p.add_argument("--max-shard-size", default=None, metavar="BYTES",
                   help="hf export: the largest output file, in bytes or as '5GB' (default 5GB)")
    p.add_argument("--names", choices=("local", "te"), default=None,
                   help="Megatron key naming scheme of the output: megatron-core's local layer spec or "
                        "TransformerEngine's (default: the source's)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--timeout", type=positive_seconds, default=30.0,
                   help="under torchrun: seconds a silent process may take before the reshard fails "
                        "on every process (default 30)")


def _inspect_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path")
    p.add_argument("--json", action="store_true")


def _plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path")
    p.add_argument("--to", type=_config, required=True, metavar=TO_METAVAR, help=TO_HELP)
    p.add_argument("--per-host", type=positive_int, default=8, help="devices per host (default 8)")
    p.add_argument("--best-placement", action="store_true",
                   help="place the new ranks on devices to keep the most bytes in place")
    p.add_argument("--json", action="store_true")


def _verify_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path")
    p.add_argument("--checksums", action="store_true",
                   help="also print an xxh3-128 digest of every file (plugin formats)")
    p.add_argument("--threads", type=positive_int, default=8, help="files checked at once (default 8)")


def _example_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dst")
    p.add_argument("--config", type=_config, default=ParallelConfig(dp=2, tp=2, pp=1),
                   metavar=TO_METAVAR)
    p.add_argument("--layers", type=positive_int, default=4)
    p.add_argument("--hidden", type=positive_int, default=256)
    p.add_argument("--heads", type=positive_int, default=8)
    p.add_argument("--seed", type=int, default=0)


COMMANDS = {  # name -> (help, adds its arguments); run by tenplex.cli.commands.<name>
    "reshard": ("convert a checkpoint to another parallel config", _reshard_arguments),
    "inspect": ("show a checkpoint's config, tree and sizes", _inspect_arguments),
    "plan": ("show what a reshard would move, without moving it", _plan_arguments),
    "verify": ("check a checkpoint's files on disk: checksums, sizes, metadata", _verify_arguments),
    "example": ("write a random GPT-style checkpoint to try the tools on", _example_arguments),
}
"""The core commands; plugins add theirs through the ``tenplex.commands`` entry point."""


def command_names() -> list[str]:
    """Every command ``tenplex`` takes: the core ones, then the plugins' (sorted)."""
    return list(COMMANDS) + sorted(plugin_commands())


_GLOBAL_VALUES = ("--model-config", "--iteration")
"""The global options that take a value (their value is not the command)."""


def _core_command(argv: list[str]) -> bool:
    """Whether ``argv`` names a core command (then the plugins' commands, and the modules they
    import, are not loaded: ``tenplex_megatron.demo`` took 0.1-0.4 s of every start-up)."""
    skip = False
    for token in argv:
        if skip:
            skip = False
        elif token in _GLOBAL_VALUES:
            skip = True
        elif not token.startswith("-"):
            return token in COMMANDS
    return False


def build_parser(plugins: bool = True) -> argparse.ArgumentParser:
    """The ``tenplex`` parser; ``plugins=False`` leaves the plugins' commands out."""
    parser = argparse.ArgumentParser(
        prog="tenplex", description="Plan and move training state between parallel configs "
                                    "(dp, tp, pp, cp, ep, etp, vpp).")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    parser.add_argument("--model-config", default=None, metavar="JSON",
                        help="model config for checkpoints that do not carry one (format plugins)")
    parser.add_argument("--iteration", default=None, metavar="N",
                        help="which iteration of a Megatron-LM --save folder to read (default: the "
                             "tracker's, latest_checkpointed_iteration.txt; or 'release')")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (text, add_arguments) in COMMANDS.items():
        add_arguments(sub.add_parser(name, help=text))
    for name, command in sorted(plugin_commands().items() if plugins else ()):  # e.g. the Megatron demo
        p = sub.add_parser(name, help=command.help)
        command.add_arguments(p)
        p.set_defaults(tenplex_command=command)
    return parser


def _return_freed_memory() -> None:
    """Ask glibc to serve buffers of 1 MiB or more with ``mmap``, so freed tensors go back to the OS.

    glibc's default threshold rises (up to 32 MiB) as large buffers are freed, after which
    they come from the heap, which keeps what it once held: a conversion's memory would
    follow the most it ever held rather than what it holds. ``mallopt(M_MMAP_THRESHOLD)``
    fixes the threshold; nothing happens off glibc.
    """
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD = -3
    except (OSError, AttributeError):
        pass


def _input(args: argparse.Namespace) -> str:
    """What the command read: its source path (``src`` or ``path``), else its name."""
    return str(getattr(args, "src", None) or getattr(args, "path", None) or args.command)


def _say(line: str) -> None:
    """Write ``line`` and its newline to stderr in one write: under torchrun every process writes
    its error line to one shared pipe, and with unbuffered stderr (``PYTHONUNBUFFERED``, ``-u``)
    ``print`` writes the text and the newline separately, so another process's line could land
    between them and two lines would run together."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(plugins=not _core_command(argv))
    args = parser.parse_args(argv)
    from tenplex.cli import commands

    _return_freed_memory()
    try:
        try:
            if getattr(args, "tenplex_command", None) is not None:
                return args.tenplex_command.run(args) or 0
            return getattr(commands, args.command)(args) or 0
        except TenplexError:
            raise
        except (MemoryError, RecursionError) as exc:  # the one place for the CLI (errors.bounded_entry: the API's)
            error = exhausted(_input(args), exc)
        raise error  # outside the handler: the failed command's frames are freed first
    except KeyboardInterrupt:
        _say("tenplex: interrupted")
        return 130
    except BrokenPipeError:
        if not _stdout_gone():
            raise
        # the reader of the output went away (``tenplex inspect X | head -1``): nothing to report,
        # and stdout points at /dev/null so that the final flush does not fail again (Python's
        # documentation, "Note on SIGPIPE"); the exit status says the output was cut
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 1
    except Exception as exc:  # the CLI boundary: every failure is one line
        if args.debug:
            traceback.print_exc()
            remote = getattr(exc, "worker_traceback", None)   # a worker process's own traceback
            if remote:
                print(f"worker {getattr(exc, 'worker', '?')}'s traceback:\n{remote.rstrip()}", file=sys.stderr)
        name = "" if isinstance(exc, TenplexError) else f"{type(exc).__name__}: "
        message = str(exc).splitlines()[0] if str(exc) else repr(exc)
        _say(f"tenplex {args.command}: {name}{message}")
        return 1


def _stdout_gone() -> bool:
    """Whether standard output is a pipe whose reader has closed it (``POLLERR`` on the writing end)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no file descriptor (a test's StringIO), no poll
        return False


def run() -> None:
    """The ``tenplex`` console script: :func:`main`, then exit without tearing down the interpreter.

    By the time :func:`main` returns, every file it wrote is closed and renamed into place
    and every thread pool is shut down; what is left is the interpreter's own teardown
    (a garbage collection over torch's modules and its operator-library finalizers), which
    takes 0.3-1 s after a conversion. Standard output and error are flushed, then the
    process exits with :func:`os._exit`.

    Before :func:`main`, ``gc.freeze()`` puts what the imports made (torch's modules: about
    170k objects) out of the collector's reach: the process never frees them, yet each full
    collection walked them all with the GIL held; one during a reshard of the 0.5 GB store of
    ``bench/reshard_scale.py`` took 0.18 to 0.45 s on a loaded machine. Frozen, none runs.
    (Not in :func:`main`, which tests call in one long process.)
    """
    from tenplex.cli import commands  # noqa: F401  (torch and the library, imported first)
    gc.freeze()
    code = main()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said
            code = code or 1
    os._exit(code)


if __name__ == "__main__":
    run()
