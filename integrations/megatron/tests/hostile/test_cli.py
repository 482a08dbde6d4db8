"""Every hostile file is refused through the CLI: exit 1, one stderr line naming it, nothing run.

Each case of :mod:`hostile_corpus` runs ``tenplex inspect|verify|reshard`` with
an empty temporary directory as its working directory. The payloads that would
run code create an absolute marker path or ``pwned`` in that working directory;
neither may appear. Most cases run the command in this process
(:func:`inprocess_cli.run_cli`: the exit status and every line the process
would print, warnings included); those in :data:`SUBPROCESS` and the issue-10
reproduction run the installed ``tenplex`` console script in a subprocess (each
takes seconds, mostly importing torch: they run three at a time in one module
fixture, and each case's test checks its own result).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from hostile_corpus import CASES, CWD_MARKER, Ctx, real_checkpoint
from hostile_pickles import META, call, glob4, shell, text
from inprocess_cli import run_cli

TIMEOUT = 240  # seconds; a hang (a FIFO opened for reading) fails the case
COMMANDS = ("inspect", "verify", "reshard")
# run by the console script in a subprocess, with the issue-10 reproduction (.metadata, each command):
# both FIFOs (a hang), payloads aimed at the working directory, a .distcp byte object, a legacy file
SUBPROCESS = frozenset({"meta-relpath-fifo", "model-fifo", "common-open-cwd", "object-dotted-global",
                        "dopt-reduce-namespace"})


def _argv(command: str, ckpt: pathlib.Path, out: pathlib.Path) -> list[str]:
    return {"inspect": ["inspect", str(ckpt)], "verify": ["verify", str(ckpt)],
            "reshard": ["reshard", str(ckpt), str(out), "--to", "dp=1,tp=1,pp=1"]}[command]


def _script() -> str:
    """The installed ``tenplex`` console script beside this interpreter."""
    script = shutil.which("tenplex", path=os.path.dirname(sys.executable))
    assert script, f"no tenplex console script beside {sys.executable}"
    return script


def _cli(command: str, ckpt: pathlib.Path, out: pathlib.Path, cwd: pathlib.Path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        return subprocess.run([_script(), *_argv(command, ckpt, out)], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired as exc:
        return subprocess.CompletedProcess(exc.cmd, "timeout", "", f"timed out after {TIMEOUT} s")


def _prepare(real: pathlib.Path, fmt: str, root: pathlib.Path, make) -> tuple[Ctx, pathlib.Path]:
    root.mkdir(parents=True)
    ckpt = root / "ckpt"
    shutil.copytree(real / fmt, ckpt, symlinks=True)
    (root / "cwd").mkdir()
    ctx = Ctx(marker=root / "MARKER")
    make(ckpt, ctx)
    return ctx, ckpt


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    return real_checkpoint(tmp_path_factory.mktemp("hostile-real"))


@pytest.fixture(scope="module")
def results(real, tmp_path_factory):
    """``{id: (root, ctx, completed process)}`` for the :data:`SUBPROCESS` cases (by case id) and
    the issue-10 reproduction (``issue-10-<command>``), all run three at a time."""
    base = tmp_path_factory.mktemp("hostile-cli")

    def run(job):
        key, command, prepare = job
        root = base / key
        ctx, ckpt = prepare(root)
        return key, (root, ctx, _cli(command, ckpt, root / "out", root / "cwd"))

    jobs = [(c.id, c.command, lambda root, c=c: _prepare(real, c.fmt, root, c.make))
            for c in CASES if c.id in SUBPROCESS]
    jobs += [(f"issue-10-{command}", command, lambda root: _issue_10_directory(real, root))
             for command in COMMANDS]
    with ThreadPoolExecutor(max_workers=3) as pool:
        return dict(pool.map(run, jobs))


def _assert_refused(root: pathlib.Path, ctx: Ctx, done, file: str, message: str) -> None:
    assert not ctx.marker.exists(), "a payload ran: the marker file exists"
    assert sorted(os.listdir(root / "cwd")) == [], "a payload wrote into the working directory"
    assert not list(root.rglob(CWD_MARKER)) and not list(root.rglob(ctx.marker.name)), "a payload ran"
    assert not (root / "out").exists(), "a refused reshard left output behind"
    assert done.returncode == 1, f"exit {done.returncode}: {done.stderr[-2000:]}"
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one stderr line, got {len(lines)}:\n{done.stderr[-3000:]}"
    assert lines[0].startswith("tenplex "), lines[0]
    assert pathlib.PurePath(file).name in lines[0], f"the message does not name {file}: {lines[0]}"
    assert re.search(message, lines[0]), f"{message!r} not in: {lines[0]}"


def test_subprocess_cases_exist():
    assert SUBPROCESS <= {c.id for c in CASES}
    assert {c.id for c in CASES if "fifo" in c.id} <= SUBPROCESS
    assert {c.fmt for c in CASES if c.id in SUBPROCESS} == {"dist", "legacy"}


@pytest.mark.slow
def test_in_process_run_sees_what_the_console_script_prints(results, real, tmp_path):
    """For every subprocess run but the FIFOs, :func:`run_cli` gives the same exit status and stderr."""
    by_id = {c.id: c for c in CASES}
    for key, (sub_root, _, theirs) in results.items():
        if "fifo" in key:
            continue
        root = tmp_path / key
        if key in by_id:
            command = by_id[key].command
            _, ckpt = _prepare(real, by_id[key].fmt, root, by_id[key].make)
        else:
            command = key.removeprefix("issue-10-")
            _, ckpt = _issue_10_directory(real, root)
        done = run_cli(_argv(command, ckpt, root / "out"), cwd=root / "cwd", timeout=TIMEOUT)
        assert theirs.returncode == 1 and done.returncode == 1, key
        assert done.stderr == theirs.stderr.replace(str(sub_root), str(root)), key


def test_in_process_run_shows_warnings_fd_writes_and_escaped_errors(monkeypatch, tmp_path):
    """What would make a subprocess print more than one line makes :func:`run_cli` report it too."""
    import warnings

    from tenplex.cli import commands

    def noisy(args):
        warnings.warn("a user warning")
        warnings.warn("hidden, as in a subprocess", DeprecationWarning)
        os.write(2, b"from C\n")
        print("out")
        open("written-here", "w").close()
        raise RuntimeError("boom")

    monkeypatch.setattr(commands, "inspect", noisy)
    done = run_cli(["inspect", "x"], cwd=tmp_path)
    assert done.returncode == 1 and done.stdout == "out\n"
    assert (tmp_path / "written-here").exists()
    lines = done.stderr.splitlines()
    assert lines[0] == "tenplex inspect: RuntimeError: boom", lines
    assert any("UserWarning: a user warning" in line for line in lines) and "from C" in lines
    assert not any("hidden" in line for line in lines)

    def escapes(args):
        raise SystemExit(3)

    monkeypatch.setattr(commands, "inspect", escapes)
    assert run_cli(["inspect", "x"]).returncode == 3
    monkeypatch.setattr(commands, "inspect", lambda args: __import__("time").sleep(5))
    assert run_cli(["inspect", "x"], timeout=0.5).returncode == "timeout"


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_cli_refuses_hostile_file(case, real, tmp_path, request):
    if case.id in SUBPROCESS:
        root, ctx, done = request.getfixturevalue("results")[case.id]
    else:
        root = tmp_path / "case"
        ctx, ckpt = _prepare(real, case.fmt, root, case.make)
        done = run_cli(_argv(case.command, ckpt, root / "out"), cwd=root / "cwd", timeout=TIMEOUT)
    _assert_refused(root, ctx, done, case.file, case.message)


def _issue_10_directory(real: pathlib.Path, root: pathlib.Path) -> tuple[Ctx, pathlib.Path]:
    """The issue's directory: ``metadata.json`` (torch_dist), a ``common.pt`` holding only ``args``,
    and a ``.metadata`` that is nothing but ``torch.distributed.checkpoint.metadata.os.system("touch MARKER")``."""
    def make(ckpt: pathlib.Path, ctx: Ctx) -> None:
        with torch.serialization.safe_globals([argparse.Namespace]):
            args = torch.load(ckpt / "common.pt", weights_only=True)["args"]  # ours: written by the test
        for p in ckpt.iterdir():
            if p.name != "metadata.json":
                p.unlink()
        torch.save({"args": args}, ckpt / "common.pt")
        (ckpt / ".metadata").write_bytes(
            b"\x80\x04" + shell(glob4(META, "os.system"), f"touch {ctx.marker}") + b".")
    return _prepare(real, "dist", root, make)


@pytest.mark.slow
@pytest.mark.parametrize("command", COMMANDS)
def test_a_dotted_os_system_in_dcp_metadata_runs_nothing(command, results):
    """The reproduction from issue 10: ``tenplex inspect DIR`` created MARKER."""
    root, ctx, done = results[f"issue-10-{command}"]
    _assert_refused(root, ctx, done, ".metadata",
                    r"global torch\.distributed\.checkpoint\.metadata\.os\.system is not in the DCP "
                    r"metadata allow-list \(dotted names are not resolved\)")


def test_payloads_run_under_plain_pickle(real, tmp_path):
    """The corpus's shell payload is live: Python's own unpickler runs it (so a test that sees no
    marker proves tenplex refused it, not that the payload was broken)."""
    import pickle
    ctx = Ctx(marker=tmp_path / "MARKER")
    pickle.loads(b"\x80\x04" + shell(glob4(META, "os.system"), f"touch {ctx.marker}") + b".")
    assert ctx.marker.exists()
    ctx.marker.unlink()
    pickle.loads(b"\x80\x04" + call(glob4("builtins", "open"), text(str(ctx.marker)), text("w")) + b".")
    assert ctx.marker.exists()
