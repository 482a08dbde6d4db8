"""Every hostile file is refused through the CLI: exit 1, one stderr line naming it, nothing run.

Each case of :mod:`hostile_corpus` runs ``python -m tenplex.cli.main
inspect|verify|reshard`` in a subprocess whose working directory is an empty
temporary directory. The payloads that would run code create an absolute
marker path or ``pwned`` in that working directory; neither may appear.
The subprocesses of all cases run three at a time in one module fixture
(each takes seconds, mostly importing torch); each case's test checks its own
result.
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

TIMEOUT = 240  # seconds; a hang (a FIFO opened for reading) fails the case
COMMANDS = ("inspect", "verify", "reshard")


def _cli(command: str, ckpt: pathlib.Path, out: pathlib.Path, cwd: pathlib.Path):
    args = {"inspect": ["inspect", str(ckpt)], "verify": ["verify", str(ckpt)],
            "reshard": ["reshard", str(ckpt), str(out), "--to", "dp=1,tp=1,pp=1"]}[command]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        return subprocess.run([sys.executable, "-m", "tenplex.cli.main", *args], cwd=cwd, env=env,
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
    """``{case id: (root, ctx, completed process)}`` for every case, run three at a time."""
    base = tmp_path_factory.mktemp("hostile-cli")

    def run(case):
        root = base / case.id
        ctx, ckpt = _prepare(real, case.fmt, root, case.make)
        return case.id, (root, ctx, _cli(case.command, ckpt, root / "out", root / "cwd"))

    with ThreadPoolExecutor(max_workers=3) as pool:
        return dict(pool.map(run, CASES))


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


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_cli_refuses_hostile_file(case, results):
    root, ctx, done = results[case.id]
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
def test_issue_10_exploit_runs_nothing(command, real, tmp_path):
    """The reproduction from issue 10: ``tenplex inspect DIR`` created MARKER."""
    ctx, ckpt = _issue_10_directory(real, tmp_path / "case")
    done = _cli(command, ckpt, tmp_path / "case" / "out", tmp_path / "case" / "cwd")
    _assert_refused(tmp_path / "case", ctx, done, ".metadata",
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
